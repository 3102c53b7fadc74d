//! The core scenarios, on SQLite, PostgreSQL and MySQL/MariaDB: rows land on
//! the shard their key routes to, keyed reads see only their key, and writes
//! that would cross keys are refused before any SQL runs.

use sea_orm::{
    ActiveValue::NotSet, ActiveValue::Unchanged, DbErr, EntityTrait, PaginatorTrait, QueryFilter,
};
use sea_orm_migration::MigratorTrait;
use shardkit::prelude::*;
use shardkit::topology::pghash::partition_hash_i64;
use shardkit::{Cluster, ErrorKind, ShardError};
use shardkit_tests::models::*;
use shardkit_tests::{TestDbs, backend_tests};

backend_tests!(4 =>
    rows_land_on_their_shard,
    cross_shard_write_is_refused,
    missing_shard_key_is_refused,
    update_and_delete_stay_within_their_key,
    tx_find_reads_inside_the_transaction,
    migrate_shows_shards_behind,
    range_modulo_and_directory_placements,
    text_and_uuid_keys,
    text_keys_match_exactly,
    [Postgres, MySql] missing_databases_are_created_when_asked,
);

const CUSTOMER_HASH: &str = r#"
[groups.Customer]
placement = "hash"
buckets = 1024
bucket_ranges = [
    { shard = "s0", first = 0,   last = 255 },
    { shard = "s1", first = 256, last = 511 },
    { shard = "s2", first = 512, last = 767 },
    { shard = "s3", first = 768, last = 1023 },
]
"#;

async fn customer_cluster(dbs: &TestDbs) -> Cluster {
    let cluster = dbs.cluster(4, CUSTOMER_HASH).await;
    cluster.migrate::<Migrator>().await.expect("migrate");
    cluster
}

/// The shard a customer id must be on, computed from the hash alone.
fn expected_customer_shard(id: i64) -> String {
    let bucket = partition_hash_i64(id) % 1024;
    format!("s{}", bucket / 256)
}

fn shard_names(cluster: &Cluster) -> Vec<String> {
    cluster
        .topology()
        .shard_names()
        .map(str::to_owned)
        .collect()
}

async fn orders_on(cluster: &Cluster, shard: &str, customer: i64) -> Vec<order::Model> {
    order::Entity::find()
        .filter(order::Column::CustomerId.eq(customer))
        .all(cluster.connection(shard).expect("shard"))
        .await
        .expect("direct read")
}

async fn insert_customer_with_orders(cluster: &Cluster, id: i64, orders: i64) {
    let tx = cluster.begin::<Customer>(id).await.expect("begin");
    tx.insert(customer::ActiveModel {
        id: Set(id),
        name: Set(format!("c{id}")),
    })
    .await
    .expect("insert customer");
    for n in 0..orders {
        tx.insert(order::ActiveModel {
            id: Set(id * 100 + n),
            customer_id: Set(id),
            total_cents: Set(100 * n),
        })
        .await
        .expect("insert order");
    }
    tx.commit().await.expect("commit");
}

async fn rows_land_on_their_shard(dbs: &mut TestDbs) {
    let cluster = customer_cluster(dbs).await;
    for id in 1..=40 {
        insert_customer_with_orders(&cluster, id, 3).await;
    }
    let mut used = std::collections::BTreeSet::new();
    for id in 1..=40 {
        let expected = expected_customer_shard(id);
        assert_eq!(
            cluster.shard_of::<Customer>(&id).await.unwrap(),
            expected,
            "customer {id}"
        );
        used.insert(expected.clone());
        for shard in shard_names(&cluster) {
            let conn = cluster.connection(&shard).unwrap();
            let customer = customer::Entity::find_by_id(id).one(conn).await.unwrap();
            let orders = orders_on(&cluster, &shard, id).await;
            if shard == expected {
                assert_eq!(
                    customer.map(|c| c.name),
                    Some(format!("c{id}")),
                    "customer {id} on {shard}"
                );
                assert_eq!(orders.len(), 3, "orders of {id} on {shard}");
            } else {
                assert!(customer.is_none(), "customer {id} leaked onto {shard}");
                assert!(orders.is_empty(), "orders of {id} leaked onto {shard}");
            }
        }
        // The keyed read returns this customer's rows only, although other
        // customers share the shard.
        let mut mine = cluster.find::<order::Entity>().key(id).all().await.unwrap();
        mine.sort_by_key(|o| o.id);
        assert_eq!(
            mine.iter().map(|o| o.id).collect::<Vec<_>>(),
            vec![id * 100, id * 100 + 1, id * 100 + 2]
        );
        assert!(mine.iter().all(|o| o.customer_id == id));
    }
    assert_eq!(used.len(), 4, "40 customers should use all 4 shards");

    // filter / order_by / limit / count keep working on a keyed read.
    let top = cluster
        .find::<order::Entity>()
        .key(7)
        .filter(order::Column::TotalCents.gte(100))
        .order_by_desc(order::Column::Id)
        .limit(1)
        .all()
        .await
        .unwrap();
    assert_eq!(top.iter().map(|o| o.id).collect::<Vec<_>>(), vec![702]);
    let n = cluster
        .find::<order::Entity>()
        .key(7)
        .filter(order::Column::TotalCents.gte(100))
        .count()
        .await
        .unwrap();
    assert_eq!(n, 2);
    let one = cluster
        .find::<customer::Entity>()
        .key(9)
        .one()
        .await
        .unwrap();
    assert_eq!(one.map(|c| c.id), Some(9));
    assert!(
        cluster
            .find::<customer::Entity>()
            .key(41)
            .one()
            .await
            .unwrap()
            .is_none()
    );
}

async fn total_orders(cluster: &Cluster) -> u64 {
    let mut total = 0;
    for shard in shard_names(cluster) {
        total += order::Entity::find()
            .count(cluster.connection(&shard).unwrap())
            .await
            .unwrap();
    }
    total
}

async fn cross_shard_write_is_refused(dbs: &mut TestDbs) {
    let cluster = customer_cluster(dbs).await;
    let tx = cluster.begin::<Customer>(1).await.unwrap();
    tx.insert(order::ActiveModel {
        id: Set(1),
        customer_id: Set(1),
        total_cents: Set(10),
    })
    .await
    .expect("own key is accepted");

    // `ghost`'s table does not exist: had any SQL run, this would be a
    // database error, not a refusal.
    let err = tx
        .insert(ghost::ActiveModel {
            id: Set(2),
            customer_id: Set(2),
        })
        .await
        .unwrap_err();
    match &err {
        ShardError::CrossShardWrite {
            entity,
            column,
            expected,
            found,
        } => {
            assert_eq!(
                (*entity, *column, expected.as_str(), found.as_str()),
                ("ghosts_never_created", "customer_id", "1", "2")
            );
        }
        other => panic!("expected CrossShardWrite, got {other:?}"),
    }
    assert_eq!(err.kind(), ErrorKind::Refused);
    assert!(err.to_string().contains("customer_id = 2"), "{err}");
    assert!(tx.is_rollback_only());

    // Same shard, other key: still refused (keys, not shards, are checked).
    let same_shard_other_key = (2..1000)
        .find(|k| expected_customer_shard(*k) == expected_customer_shard(1))
        .unwrap();
    let err = tx
        .insert(order::ActiveModel {
            id: Set(3),
            customer_id: Set(same_shard_other_key),
            total_cents: Set(1),
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::RollbackOnly { .. }), "{err:?}");

    let err = tx.commit().await.unwrap_err();
    match &err {
        ShardError::RollbackOnly { group, reason, .. } => {
            assert_eq!(*group, "Customer");
            assert!(reason.contains("cross-shard write refused"), "{reason}");
        }
        other => panic!("expected RollbackOnly, got {other:?}"),
    }
    assert_eq!(total_orders(&cluster).await, 0, "nothing may be written");

    // A model hook cannot move the row to another key after the first check.
    // (One write transaction at a time per SQLite shard: `tx` is over.)
    let hooked = cluster.begin::<Customer>(1).await.unwrap();
    let err = hooked
        .insert(mover::ActiveModel {
            id: Set(1),
            customer_id: Set(1),
            note: Set("move".into()),
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ShardError::CrossShardWrite { found, .. } if found == "999"),
        "{err:?}"
    );
    drop(hooked);
    // Nor before a delete.
    let hooked = cluster.begin::<Customer>(1).await.unwrap();
    let err = hooked
        .delete(mover::ActiveModel {
            id: Unchanged(1),
            customer_id: Unchanged(1),
            note: Set("move".into()),
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ShardError::CrossShardWrite { found, .. } if found == "999"),
        "{err:?}"
    );
    drop(hooked);

    // A fresh transaction on the same shard for the other key is refused too,
    // even though it would land on the same database.
    let tx = cluster
        .begin::<Customer>(same_shard_other_key)
        .await
        .unwrap();
    let err = tx
        .insert(ghost::ActiveModel {
            id: Set(4),
            customer_id: Set(1),
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::CrossShardWrite { .. }), "{err:?}");
    drop(tx);
    assert_eq!(total_orders(&cluster).await, 0);
}

async fn missing_shard_key_is_refused(dbs: &mut TestDbs) {
    let cluster = customer_cluster(dbs).await;
    let tx = cluster.begin::<Customer>(5).await.unwrap();
    tx.insert(order::ActiveModel {
        id: Set(1),
        customer_id: Set(5),
        total_cents: Set(1),
    })
    .await
    .unwrap();
    let err = tx
        .insert(ghost::ActiveModel {
            id: Set(1),
            customer_id: NotSet,
        })
        .await
        .unwrap_err();
    match &err {
        ShardError::MissingShardKey { entity, column } => {
            assert_eq!((*entity, *column), ("ghosts_never_created", "customer_id"));
        }
        other => panic!("expected MissingShardKey, got {other:?}"),
    }
    let err = tx.commit().await.unwrap_err();
    assert!(matches!(err, ShardError::RollbackOnly { .. }), "{err:?}");
    assert_eq!(total_orders(&cluster).await, 0);
}

/// Asserts that an update matched no row of its key.
fn not_updated<T: std::fmt::Debug>(result: Result<T, ShardError>) {
    let err = result.unwrap_err();
    assert!(
        matches!(
            &err,
            ShardError::Db {
                source: DbErr::RecordNotUpdated,
                ..
            }
        ),
        "{err:?}"
    );
}

async fn update_and_delete_stay_within_their_key(dbs: &mut TestDbs) {
    let cluster = customer_cluster(dbs).await;
    // Two customers on one shard.
    let a = 1;
    let b = (2..1000)
        .find(|k| expected_customer_shard(*k) == expected_customer_shard(a))
        .unwrap();
    let shard = expected_customer_shard(a);
    insert_customer_with_orders(&cluster, a, 1).await; // order id 100
    let order_id = a * 100;
    // A row of an entity with a global index (its writes take the stages'
    // path), under the same primary key.
    cluster.setup::<contact::Entity>().await.unwrap();
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    tx.insert(contact::row(order_id, a, "a@example.com", "1"))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // Key b cannot update or delete a's row through a shared primary key.
    let tx = cluster.begin::<Customer>(b).await.unwrap();
    not_updated(
        tx.update(order::ActiveModel {
            id: Unchanged(order_id),
            customer_id: Unchanged(b),
            total_cents: Set(999),
        })
        .await,
    );
    // Nothing to set: still matched within key b, so a's row is not returned.
    not_updated(
        tx.update(order::ActiveModel {
            id: Unchanged(order_id),
            customer_id: Unchanged(b),
            total_cents: Unchanged(0),
        })
        .await,
    );
    // Only the primary key set, nothing else to set: the same (SeaORM reads
    // the row back by its primary key alone), on the one-statement path and
    // on the stages' path.
    not_updated(
        tx.update(order::ActiveModel {
            id: Set(order_id),
            customer_id: Unchanged(b),
            total_cents: Unchanged(0),
        })
        .await,
    );
    not_updated(
        tx.update(contact::ActiveModel {
            id: Set(order_id),
            customer_id: Unchanged(b),
            email: Unchanged("a@example.com".to_owned()),
            phone: Unchanged("1".to_owned()),
        })
        .await,
    );
    let deleted = tx
        .delete(order::ActiveModel {
            id: Unchanged(order_id),
            customer_id: Unchanged(b),
            total_cents: NotSet,
        })
        .await
        .unwrap();
    assert_eq!(deleted, 0);
    // A delete without its primary key is SeaORM's error, before any SQL.
    let err = tx
        .delete(order::ActiveModel {
            id: NotSet,
            customer_id: Unchanged(b),
            total_cents: NotSet,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            ShardError::Db {
                source: DbErr::PrimaryKeyNotSet { ctx: "DeleteOne" },
                operation,
                ..
            } if operation == "delete orders"
        ),
        "{err:?}"
    );
    assert!(!tx.is_rollback_only(), "a refusal before any SQL");
    tx.commit().await.unwrap();
    let rows = orders_on(&cluster, &shard, a).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].total_cents, 0, "a's order must be untouched");

    // Moving a row to another key is a cross-shard write.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let err = tx
        .update(order::ActiveModel {
            id: Unchanged(order_id),
            customer_id: Set(b),
            total_cents: NotSet,
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::CrossShardWrite { .. }), "{err:?}");
    drop(tx);

    // The owner updates and deletes.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let updated = tx
        .update(order::ActiveModel {
            id: Unchanged(order_id),
            customer_id: Unchanged(a),
            total_cents: Set(4242),
        })
        .await
        .unwrap();
    assert_eq!(updated.total_cents, 4242);
    tx.commit().await.unwrap();
    assert_eq!(orders_on(&cluster, &shard, a).await[0].total_cents, 4242);

    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let deleted = tx
        .delete(order::ActiveModel {
            id: Unchanged(order_id),
            customer_id: Unchanged(a),
            total_cents: NotSet,
        })
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    tx.commit().await.unwrap();
    assert!(orders_on(&cluster, &shard, a).await.is_empty());
}

async fn tx_find_reads_inside_the_transaction(dbs: &mut TestDbs) {
    let cluster = customer_cluster(dbs).await;
    let a = 3;
    let other = (1..1000)
        .find(|k| *k != a && expected_customer_shard(*k) == expected_customer_shard(a))
        .unwrap();
    insert_customer_with_orders(&cluster, other, 2).await;

    let tx = cluster.begin::<Customer>(a).await.unwrap();
    for n in 0..2 {
        tx.insert(order::ActiveModel {
            id: Set(a * 100 + n),
            customer_id: Set(a),
            total_cents: Set(50 + n),
        })
        .await
        .unwrap();
    }
    let inside = tx.find::<order::Entity>().all().await.unwrap();
    assert_eq!(
        inside.len(),
        2,
        "the transaction sees its own uncommitted rows, and only its key's"
    );
    assert!(inside.iter().all(|o| o.customer_id == a));
    let filtered = tx
        .find::<order::Entity>()
        .filter(order::Column::TotalCents.gt(50))
        .count()
        .await
        .unwrap();
    assert_eq!(filtered, 1);
    assert!(tx.find::<customer::Entity>().one().await.unwrap().is_none());
    tx.commit().await.unwrap();
    assert_eq!(
        cluster
            .find::<order::Entity>()
            .key(a)
            .count()
            .await
            .unwrap(),
        2
    );
}

async fn migrate_shows_shards_behind(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(4, CUSTOMER_HASH).await;
    let old = cluster.migrate::<OldMigrator>().await.unwrap();
    assert!(old.is_current());
    assert_eq!(old.databases.len(), 4);

    let status = cluster.migration_status::<Migrator>().await.unwrap();
    assert_eq!(status.behind().len(), 4);
    assert!(status.databases.iter().all(|d| d.pending.len()
        == Migrator::migrations().len() - OldMigrator::migrations().len()
        && d.applied.len() == OldMigrator::migrations().len()));

    // One shard upgraded by hand: the other three are visibly behind it.
    Migrator::up(cluster.connection("s0").unwrap(), None)
        .await
        .unwrap();
    let status = cluster.migration_status::<Migrator>().await.unwrap();
    let behind: Vec<&str> = status.behind().iter().map(|d| d.name.as_str()).collect();
    assert_eq!(behind, vec!["s1", "s2", "s3"]);
    assert!(status.to_string().contains("<- behind"));

    let done = cluster.migrate::<Migrator>().await.unwrap();
    assert!(done.is_current(), "{done}");
    let names: Vec<String> = Migrator::migrations()
        .iter()
        .map(|m| m.name().to_owned())
        .collect();
    for db in &done.databases {
        assert_eq!(db.applied, names, "{}", db.name);
    }
    for shard in shard_names(&cluster) {
        let n = order::Entity::find()
            .count(cluster.connection(&shard).unwrap())
            .await;
        assert_eq!(n.unwrap(), 0, "orders table exists on {shard}");
    }
}

async fn range_modulo_and_directory_placements(dbs: &mut TestDbs) {
    let directory_url = dbs.extra("directory").await;
    let groups = format!(
        r#"
[groups.Account]
placement = "range"
ranges = [
    {{ shard = "s1", from = 1000, to = 2000 }},
    {{ shard = "s0", to = 1000 }},
    {{ shard = "s2", from = 2000, to = 3000 }},
    {{ shard = "s3", from = 3000 }},
]

[groups.meters]
placement = "modulo"
shards = ["s3", "s2", "s1", "s0"]

[groups.Member]
placement = "directory"
directory = {{ url = "{directory_url}" }}
"#
    );
    let cluster = dbs.cluster(4, &groups).await;
    let report = cluster.migrate::<Migrator>().await.unwrap();
    assert!(
        report
            .databases
            .iter()
            .any(|d| d.name == "directory:Member"),
        "{report}"
    );

    // range: [from, to), unbounded ends.
    for (account, shard) in [
        (-5, "s0"),
        (0, "s0"),
        (999, "s0"),
        (1000, "s1"),
        (1999, "s1"),
        (2000, "s2"),
        (2999, "s2"),
        (3000, "s3"),
        (i32::MAX, "s3"),
    ] {
        let tx = cluster.begin::<Account>(account).await.unwrap();
        assert_eq!(tx.shard(), shard, "account {account}");
        tx.insert(ledger::ActiveModel {
            id: Set(i64::from(account)),
            account: Set(account),
            amount: Set(1),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let here = ledger::Entity::find_by_id(i64::from(account))
            .one(cluster.connection(shard).unwrap())
            .await
            .unwrap();
        assert_eq!(
            here.map(|r| r.account),
            Some(account),
            "account {account} on {shard}"
        );
    }

    // modulo: meter % 4 indexes the shard list.
    let order = ["s3", "s2", "s1", "s0"];
    for meter in [0i64, 1, 2, 3, 4, 5, (1 << 40) + 7, -1, -6] {
        let shard = order[meter.rem_euclid(4) as usize];
        let tx = cluster.begin::<Meter>(meter).await.unwrap();
        assert_eq!(tx.shard(), shard, "meter {meter}");
        tx.insert(sample::ActiveModel {
            id: Set(meter),
            meter: Set(meter),
            kwh: Set(3),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let n = sample::Entity::find()
            .filter(sample::Column::Meter.eq(meter))
            .count(cluster.connection(shard).unwrap())
            .await
            .unwrap();
        assert_eq!(n, 1, "meter {meter} on {shard}");
        let found = cluster
            .find::<sample::Entity>()
            .key(meter)
            .all()
            .await
            .unwrap();
        assert_eq!(found.len(), 1);
    }

    // directory: the lookup table decides.
    let directory = cluster.directory::<Member>().unwrap();
    directory.assign(&10, "s2").await.unwrap();
    directory.assign(&11, "s0").await.unwrap();
    directory.assign(&11, "s3").await.unwrap(); // reassignment overwrites
    assert_eq!(directory.lookup(&11).await.unwrap().as_deref(), Some("s3"));
    for (member, shard) in [(10, "s2"), (11, "s3")] {
        let tx = cluster.begin::<Member>(member).await.unwrap();
        assert_eq!(tx.shard(), shard);
        tx.insert(profile::ActiveModel {
            member_id: Set(member),
            bio: Set("hi".into()),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let row = profile::Entity::find_by_id(member)
            .one(cluster.connection(shard).unwrap())
            .await
            .unwrap();
        assert!(row.is_some(), "member {member} on {shard}");
        assert_eq!(
            cluster
                .find::<profile::Entity>()
                .key(member)
                .all()
                .await
                .unwrap()
                .len(),
            1
        );
    }
    let err = cluster.begin::<Member>(12).await.unwrap_err();
    assert!(
        matches!(
            &err,
            ShardError::Unroutable {
                group: "Member",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.kind(), ErrorKind::Routing);
    assert!(matches!(
        directory.assign(&12, "s9").await,
        Err(ShardError::Config { .. })
    ));
    assert!(directory.remove(&10).await.unwrap());
    assert!(directory.lookup(&10).await.unwrap().is_none());
    // Directory keys that differ only in case or trailing spaces are three
    // entries on every backend (MySQL/MariaDB's default collation made them
    // one, so assigning `acme` moved `Acme`).
    use sea_orm::ConnectionTrait;
    use sea_orm::sea_query::{Alias, Expr, ExprTrait};
    let db = cluster.connection("s1").unwrap();
    let mut insert = sea_orm::sea_query::Query::insert();
    insert
        .into_table(Alias::new("shardkit_directory"))
        .columns(["group_name", "shard_key", "shard"].map(Alias::new));
    for (key, shard) in [("Acme", "s0"), ("acme", "s1"), ("acme ", "s2")] {
        insert.values_panic(["Exact".into(), key.into(), shard.into()]);
    }
    db.execute(&insert).await.unwrap();
    let mut lookup = sea_orm::sea_query::Query::select();
    lookup
        .column(Alias::new("shard"))
        .from(Alias::new("shardkit_directory"))
        .and_where(Expr::col(Alias::new("group_name")).eq("Exact"))
        .and_where(Expr::col(Alias::new("shard_key")).eq("acme"));
    let found: Vec<String> = db
        .query_all(&lookup)
        .await
        .unwrap()
        .iter()
        .map(|r| r.try_get("", "shard").unwrap())
        .collect();
    assert_eq!(found, ["s1"]);
    assert!(
        cluster.directory::<Account>().is_err(),
        "Account is range-placed"
    );
}

async fn text_and_uuid_keys(dbs: &mut TestDbs) {
    let groups = "[groups.Tenant]\n[groups.Device]\nbuckets = 64\n";
    let cluster = dbs.cluster(4, groups).await;
    cluster.migrate::<Migrator>().await.unwrap();

    let tenants = [
        "acme",
        "globex",
        "initech",
        "umbrella",
        "żółw",
        "a-very-long-tenant-name-over-twenty-four-bytes",
    ];
    for (i, tenant) in tenants.iter().enumerate() {
        let tx = cluster.begin::<Tenant>(tenant.to_string()).await.unwrap();
        tx.insert(note::ActiveModel {
            id: Set(i as i64),
            tenant: Set(tenant.to_string()),
            body: Set(format!("note of {tenant}")),
        })
        .await
        .unwrap();
        let err = tx
            .insert(note::ActiveModel {
                id: Set(100 + i as i64),
                tenant: Set("someone-else".into()),
                body: Set(String::new()),
            })
            .await
            .unwrap_err();
        assert!(matches!(err, ShardError::CrossShardWrite { .. }));
        drop(tx); // rolled back: redo it properly
        let tx = cluster.begin::<Tenant>(tenant.to_string()).await.unwrap();
        tx.insert(note::ActiveModel {
            id: Set(i as i64),
            tenant: Set(tenant.to_string()),
            body: Set(format!("note of {tenant}")),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    for tenant in tenants {
        let expected = cluster
            .shard_of::<Tenant>(&tenant.to_string())
            .await
            .unwrap()
            .to_owned();
        for shard in shard_names(&cluster) {
            let n = note::Entity::find()
                .filter(note::Column::Tenant.eq(tenant))
                .count(cluster.connection(&shard).unwrap())
                .await
                .unwrap();
            assert_eq!(
                n,
                u64::from(shard == expected),
                "tenant {tenant} on {shard}"
            );
        }
        let notes = cluster
            .find::<note::Entity>()
            .key(tenant.to_string())
            .all()
            .await
            .unwrap();
        assert_eq!(
            notes.iter().map(|n| n.body.as_str()).collect::<Vec<_>>(),
            vec![format!("note of {tenant}")]
        );
    }

    let devices: Vec<uuid::Uuid> = (0..12u128)
        .map(|i| uuid::Uuid::from_u128(i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)))
        .collect();
    for (i, device) in devices.iter().enumerate() {
        let tx = cluster.begin::<Device>(*device).await.unwrap();
        assert!(tx.target().bucket.unwrap() < 64);
        tx.insert(reading::ActiveModel {
            id: Set(i as i64),
            device_id: Set(*device),
            value: Set(i as i64),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    for (i, device) in devices.iter().enumerate() {
        let expected = cluster.shard_of::<Device>(device).await.unwrap().to_owned();
        let row = reading::Entity::find_by_id(i as i64)
            .one(cluster.connection(&expected).unwrap())
            .await
            .unwrap();
        assert_eq!(row.map(|r| r.device_id), Some(*device));
        let got = cluster
            .find::<reading::Entity>()
            .key(*device)
            .one()
            .await
            .unwrap();
        assert_eq!(got.map(|r| r.value), Some(i as i64));
    }
}

/// Keys differing only in case or trailing spaces are different keys, also on
/// MySQL/MariaDB whose default collation calls them equal.
async fn text_keys_match_exactly(dbs: &mut TestDbs) {
    // Every tenant on one shard, so the three keys share a table.
    let (cluster, sent) =
        shardkit_tests::recording_cluster(dbs, 4, "[groups.Tenant]\nshards = [\"s0\"]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let tenants = ["acme", "Acme", "acme "];
    for (i, tenant) in tenants.iter().enumerate() {
        let tx = cluster.begin::<Tenant>(tenant.to_string()).await.unwrap();
        tx.insert(note::ActiveModel {
            id: Set(i as i64),
            tenant: Set(tenant.to_string()),
            body: Set(format!("{tenant:?}")),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    for (i, tenant) in tenants.iter().enumerate() {
        let rows = cluster
            .find::<note::Entity>()
            .key(tenant.to_string())
            .all()
            .await
            .unwrap();
        assert_eq!(
            rows.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![i as i64],
            "key {tenant:?}"
        );
        let rows = cluster
            .find::<note::Entity>()
            .keys([tenant.to_string()])
            .all()
            .await
            .unwrap();
        assert_eq!(rows.len(), 1, "keys([{tenant:?}])");
    }
    // A write for "acme" cannot delete "Acme"'s row through its primary key.
    let tx = cluster.begin::<Tenant>("acme".to_string()).await.unwrap();
    let deleted = tx
        .delete(note::ActiveModel {
            id: Unchanged(1),
            tenant: Unchanged("acme".to_string()),
            body: NotSet,
        })
        .await
        .unwrap();
    assert_eq!(deleted, 0);
    tx.commit().await.unwrap();
    // Nor can a batch of "acme" reach the other two keys' rows, even with a
    // filter of its own that names them (an `OR`, which must stay within
    // the key's two comparisons).
    let changed = cluster
        .transaction::<Tenant, _, _>("acme".to_string(), |tx| async move {
            tx.update_many::<note::Entity>()
                .set(note::ActiveModel {
                    body: Set("batch".into()),
                    ..Default::default()
                })
                .filter(
                    sea_orm::Condition::any()
                        .add(note::Column::Id.eq(0))
                        .add(note::Column::Id.eq(1))
                        .add(note::Column::Id.eq(2)),
                )
                .exec()
                .await
        })
        .await
        .unwrap();
    assert_eq!(changed, 1, "acme's own row only");
    // The key's comparison comes first, and the filter's `OR` stays inside
    // parentheses after it (on MySQL/MariaDB after both comparisons).
    let update = sent
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|(_, s)| s.sql.starts_with("UPDATE"))
        .map(|(shard, s)| {
            (
                shard.clone(),
                s.sql.clone(),
                s.values.as_ref().map(|v| v.0.len()),
            )
        })
        .expect("the batch's UPDATE");
    let expected = match dbs.backend {
        shardkit_tests::Backend::Postgres => {
            r#"UPDATE "notes" SET "body" = $1 WHERE "tenant" = $2 AND ("notes"."id" = $3 OR "notes"."id" = $4 OR "notes"."id" = $5)"#
        }
        shardkit_tests::Backend::MySql => {
            "UPDATE `notes` SET `body` = ? WHERE `tenant` = ? AND CAST(`tenant` AS BINARY) = ? \
             AND (`notes`.`id` = ? OR `notes`.`id` = ? OR `notes`.`id` = ?)"
        }
        _ => {
            r#"UPDATE "notes" SET "body" = ? WHERE "notes"."tenant" = ? AND ("notes"."id" = ? OR "notes"."id" = ? OR "notes"."id" = ?)"#
        }
    };
    let values = if dbs.backend == shardkit_tests::Backend::MySql {
        6
    } else {
        5
    };
    assert_eq!(update, ("s0".to_owned(), expected.to_owned(), Some(values)));
    let deleted = cluster
        .transaction::<Tenant, _, _>("acme".to_string(), |tx| async move {
            tx.delete_many::<note::Entity>()
                .filter(note::Column::Id.is_in([1, 2]))
                .exec()
                .await
        })
        .await
        .unwrap();
    assert_eq!(deleted, 0, "rows 1 and 2 are Acme's and \"acme \"'s");
    let mut all = note::Entity::find()
        .all(cluster.connection("s0").unwrap())
        .await
        .unwrap();
    all.sort_by_key(|n| n.id);
    let bodies: Vec<&str> = all.iter().map(|n| n.body.as_str()).collect();
    assert_eq!(bodies, ["batch", "\"Acme\"", "\"acme \""]);
}

/// `[pool] create_databases = true` creates a shard database that does not
/// exist yet (PostgreSQL, MySQL/MariaDB); without it, connecting fails
/// naming the shard.
async fn missing_databases_are_created_when_asked(dbs: &mut TestDbs) {
    let url = dbs.extra("fresh").await;
    let name = url.rsplit('/').next().unwrap().to_owned();
    let server = dbs.backend.server_url().unwrap();
    let (admin, drop_sql) = match dbs.backend {
        shardkit_tests::Backend::Postgres => (
            format!("{server}/postgres"),
            format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"),
        ),
        _ => (server.clone(), format!("DROP DATABASE IF EXISTS `{name}`")),
    };
    let admin = sea_orm::Database::connect(admin.as_str()).await.unwrap();
    sea_orm::ConnectionTrait::execute_unprepared(&admin, &drop_sql)
        .await
        .unwrap();

    let toml = |create: bool| {
        format!(
            "[[shards]]\nname = \"s0\"\nurl = \"{url}\"\n[pool]\nmax_connections = 2\nconnect_timeout_secs = 5\ncreate_databases = {create}\n[groups.Customer]\n"
        )
    };
    let refused = Cluster::connect(shardkit::ClusterConfig::from_toml(&toml(false)).unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ShardError::Connect { shard, .. } if shard == "s0"),
        "{refused:?}"
    );

    let cluster = Cluster::connect(shardkit::ClusterConfig::from_toml(&toml(true)).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let tx = cluster.begin::<Customer>(3).await.unwrap();
    tx.insert(order::ActiveModel {
        id: Set(1),
        customer_id: Set(3),
        total_cents: Set(10),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let rows = cluster.find::<order::Entity>().key(3).all().await.unwrap();
    assert_eq!(rows.len(), 1);
    drop(cluster);
    // A second cluster finds it there and creates nothing.
    let again = Cluster::connect(shardkit::ClusterConfig::from_toml(&toml(true)).unwrap())
        .await
        .unwrap();
    assert_eq!(
        again.find::<order::Entity>().key(3).count().await.unwrap(),
        1
    );
}
