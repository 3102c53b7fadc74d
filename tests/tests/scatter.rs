//! Cross-shard reads on 8 shards, on SQLite, PostgreSQL and MySQL/MariaDB:
//! `keys()` asks only the shards holding the keys, each with only its own
//! keys; `scatter()` merges order/limit/offset exactly as one database would;
//! a failed or slow shard fails the read by default and is reported beside the
//! healthy rows with `.partial()`.

use sea_orm::{
    ConnectionTrait, DatabaseConnection, EntityTrait, PaginatorTrait, QueryFilter, QueryOrder,
    QuerySelect, Statement, Value,
};
use sea_orm_migration::MigratorTrait;
use shardkit::prelude::*;
use shardkit::{Cluster, ShardError};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, TestDbs, backend_tests, recording_cluster};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

backend_tests!(8 =>
    keys_split_per_shard,
    scatter_merges_like_one_database,
    failed_shard_fails_or_is_reported,
    slow_shard_times_out,
    [Sqlite] long_key_lists_are_chunked_under_the_parameter_limit,
);

/// 120 customers with 3 orders each, written through the cluster, and the same
/// rows in one plain database for reference answers.
async fn load(
    cluster: &Cluster,
    single: &DatabaseConnection,
    skip_shard: Option<&str>,
) -> Vec<order::Model> {
    let mut all = Vec::new();
    for customer in 1..=120_i64 {
        if Some(cluster.shard_of::<Customer>(&customer).await.unwrap()) == skip_shard {
            continue;
        }
        let tx = cluster.begin::<Customer>(customer).await.unwrap();
        for n in 0..3 {
            // Totals repeat across customers so ordering needs the tie-breaker.
            let row = order::Model {
                id: customer * 10 + n,
                customer_id: customer,
                total_cents: (customer * 37 + n * 11) % 50,
            };
            tx.insert(order::ActiveModel {
                id: Set(row.id),
                customer_id: Set(row.customer_id),
                total_cents: Set(row.total_cents),
            })
            .await
            .unwrap();
            order::Entity::insert(order::ActiveModel {
                id: Set(row.id),
                customer_id: Set(row.customer_id),
                total_cents: Set(row.total_cents),
            })
            .exec(single)
            .await
            .unwrap();
            all.push(row);
        }
        tx.commit().await.unwrap();
    }
    all
}

async fn reference_db(dbs: &mut TestDbs) -> DatabaseConnection {
    let url = dbs.extra("single").await;
    let db = sea_orm::Database::connect(url.as_str()).await.unwrap();
    Migrator::up(&db, None).await.unwrap();
    db
}

fn bound_ints(stmt: &Statement) -> BTreeSet<i64> {
    stmt.values
        .iter()
        .flat_map(|v| v.0.iter())
        .filter_map(|v| match v {
            Value::BigInt(Some(x)) => Some(*x),
            _ => None,
        })
        .collect()
}

async fn keys_split_per_shard(dbs: &mut TestDbs) {
    let single = reference_db(dbs).await;
    let (cluster, sent) = recording_cluster(dbs, 8, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    load(&cluster, &single, None).await;

    let keys: Vec<i64> = (1..=60).step_by(3).chain([4, 4, 7, 500]).collect();
    let mut expected_by_shard: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    for k in &keys {
        expected_by_shard
            .entry(cluster.shard_of::<Customer>(k).await.unwrap().to_owned())
            .or_default()
            .insert(*k);
    }
    sent.lock().unwrap().clear();
    let mut got = cluster
        .find::<order::Entity>()
        .keys(keys.clone())
        .all()
        .await
        .unwrap();
    got.sort_by_key(|o| o.id);
    let want = order::Entity::find()
        .filter(order::Column::CustomerId.is_in(keys.clone()))
        .order_by_asc(order::Column::Id)
        .all(&single)
        .await
        .unwrap();
    assert_eq!(got, want);

    // One statement per shard holding keys, carrying exactly that shard's keys.
    let statements = sent.lock().unwrap().clone();
    let mut seen: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    for (shard, stmt) in &statements {
        // One key is an equality, several an IN list.
        assert!(
            stmt.sql.contains("IN") || bound_ints(stmt).len() == 1,
            "{}",
            stmt.sql
        );
        assert!(
            seen.insert(shard.clone(), bound_ints(stmt)).is_none(),
            "two statements to {shard}"
        );
    }
    assert_eq!(seen, expected_by_shard);

    // 1,000 keys over 8 shards: 8 statements, 1,000 bound keys in all.
    sent.lock().unwrap().clear();
    // Duplicates are sent once.
    let many: Vec<i64> = (1..=1000).chain(1..=100).collect();
    let rows = cluster
        .find::<order::Entity>()
        .keys(many)
        .all()
        .await
        .unwrap();
    assert_eq!(rows.len(), 120 * 3);
    let statements = sent.lock().unwrap().clone();
    assert_eq!(statements.len(), 8, "one statement per shard");
    let params: usize = statements
        .iter()
        .map(|(_, s)| s.values.as_ref().map_or(0, |v| v.0.len()))
        .sum();
    assert_eq!(params, 1000);

    // Keys + filter + order + limit, and count.
    let got = cluster
        .find::<order::Entity>()
        .keys((1..=50).collect::<Vec<_>>())
        .filter(order::Column::TotalCents.gt(10))
        .order_by_desc(order::Column::TotalCents)
        .order_by_asc(order::Column::Id)
        .limit(7)
        .all()
        .await
        .unwrap();
    let want = order::Entity::find()
        .filter(order::Column::CustomerId.between(1, 50))
        .filter(order::Column::TotalCents.gt(10))
        .order_by_desc(order::Column::TotalCents)
        .order_by_asc(order::Column::Id)
        .limit(7)
        .all(&single)
        .await
        .unwrap();
    assert_eq!(got, want);
    let n = cluster
        .find::<order::Entity>()
        .keys([1, 2, 3, 999])
        .count()
        .await
        .unwrap();
    assert_eq!(n, 9);
}

async fn scatter_merges_like_one_database(dbs: &mut TestDbs) {
    let single = reference_db(dbs).await;
    let (cluster, sent) = recording_cluster(dbs, 8, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    load(&cluster, &single, None).await;

    sent.lock().unwrap().clear();
    let all = cluster
        .find::<order::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    assert_eq!(all.len(), 360);
    let shards: BTreeSet<String> = sent
        .lock()
        .unwrap()
        .iter()
        .map(|(s, _)| s.clone())
        .collect();
    assert_eq!(shards.len(), 8, "scatter asks every shard");

    for (limit, offset) in [(1, 0), (10, 0), (17, 5), (400, 0), (5, 358)] {
        let got = cluster
            .find::<order::Entity>()
            .scatter()
            .filter(order::Column::TotalCents.lt(40))
            .order_by_asc(order::Column::TotalCents)
            .order_by_desc(order::Column::Id)
            .limit(limit)
            .offset(offset)
            .all()
            .await
            .unwrap();
        let want = order::Entity::find()
            .filter(order::Column::TotalCents.lt(40))
            .order_by_asc(order::Column::TotalCents)
            .order_by_desc(order::Column::Id)
            .limit(limit)
            .offset(offset)
            .all(&single)
            .await
            .unwrap();
        assert_eq!(got, want, "limit {limit} offset {offset}");
    }
    // Each shard returns at most limit + offset rows.
    sent.lock().unwrap().clear();
    let _ = cluster
        .find::<order::Entity>()
        .scatter()
        .order_by_asc(order::Column::Id)
        .limit(3)
        .offset(2)
        .all()
        .await
        .unwrap();
    for (_, stmt) in sent.lock().unwrap().iter() {
        assert!(stmt.sql.contains("LIMIT"), "{}", stmt.sql);
        let bound: Vec<&Value> = stmt.values.iter().flat_map(|v| v.0.iter()).collect();
        assert!(
            bound
                .iter()
                .any(|v| matches!(v, Value::BigUnsigned(Some(5)))),
            "limit 3 + offset 2 per shard: {:?}",
            stmt
        );
    }

    let first = cluster
        .find::<order::Entity>()
        .scatter()
        .order_by_desc(order::Column::Id)
        .one()
        .await
        .unwrap();
    assert_eq!(first.map(|o| o.id), Some(1202));
    let n = cluster
        .find::<order::Entity>()
        .scatter()
        .filter(order::Column::TotalCents.gte(25))
        .count()
        .await
        .unwrap();
    let want = order::Entity::find()
        .filter(order::Column::TotalCents.gte(25))
        .count(&single)
        .await
        .unwrap();
    assert_eq!(n, want);

    // A custom field-list ordering cannot be merged: refused before any I/O.
    sent.lock().unwrap().clear();
    let err = cluster
        .find::<order::Entity>()
        .scatter()
        .order_by(
            order::Column::TotalCents,
            sea_orm::Order::Field(sea_orm::Values(vec![
                Value::BigInt(Some(1)),
                Value::BigInt(Some(2)),
            ])),
        )
        .all()
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::Unmergeable { .. }), "{err:?}");
    assert!(sent.lock().unwrap().is_empty(), "nothing was sent");

    // Bounded concurrency still reads every shard.
    let bounded = cluster
        .find::<order::Entity>()
        .scatter()
        .max_concurrency(2)
        .count()
        .await
        .unwrap();
    assert_eq!(bounded, 360);
}

async fn failed_shard_fails_or_is_reported(dbs: &mut TestDbs) {
    let single = reference_db(dbs).await;
    let toml = format!(
        "{}\n[groups.Customer]\n",
        dbs.shards_toml_with(8, "connect_lazy = true\nacquire_timeout_secs = 3\n", &[3])
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .expect("lazy connect tolerates a dead shard");
    for shard in ["s0", "s1", "s2", "s4", "s5", "s6", "s7"] {
        Migrator::up(cluster.connection(shard).unwrap(), None)
            .await
            .unwrap();
    }
    let rows = load(&cluster, &single, Some("s3")).await;
    assert!(!rows.is_empty());

    let err = cluster
        .find::<order::Entity>()
        .scatter()
        .all()
        .await
        .unwrap_err();
    match &err {
        ShardError::ShardsFailed {
            asked, failures, ..
        } => {
            assert_eq!(*asked, 8);
            assert_eq!(failures.len(), 1);
            assert_eq!(failures[0].shard, "s3");
            // A closed port marks the shard down (its cause kept); the
            // broken SQLite shard is a database without the table.
            assert!(
                match dbs.backend {
                    Backend::Sqlite => matches!(*failures[0].error, ShardError::Db { .. }),
                    _ =>
                        matches!(&*failures[0].error, ShardError::Unavailable { cause, .. } if cause.contains("refused")),
                },
                "{:?}",
                failures[0].error
            );
        }
        other => panic!("expected ShardsFailed, got {other:?}"),
    }
    assert!(err.to_string().contains("s3:"), "{err}");

    let partial = cluster
        .find::<order::Entity>()
        .scatter()
        .partial()
        .all()
        .await
        .unwrap();
    assert!(!partial.is_complete());
    assert_eq!(partial.failed_shards(), vec!["s3"]);
    let mut got = partial.rows;
    got.sort_by_key(|o| o.id);
    let mut want = rows.clone();
    want.sort_by_key(|o| o.id);
    assert_eq!(got, want, "every row of the healthy shards");

    let count = cluster
        .find::<order::Entity>()
        .scatter()
        .partial()
        .count()
        .await
        .unwrap();
    assert_eq!(count.rows, rows.len() as u64);
    assert_eq!(count.failed.len(), 1);

    // keys(): only shards holding the keys are asked; the dead one only if needed.
    let healthy_key = rows[0].customer_id;
    let got = cluster
        .find::<order::Entity>()
        .keys([healthy_key])
        .all()
        .await
        .unwrap();
    assert_eq!(got.len(), 3);
    let dead_key = (1..1000)
        .find(|k| futures_lite_shard(&cluster, *k) == "s3")
        .unwrap();
    let err = cluster
        .find::<order::Entity>()
        .keys([healthy_key, dead_key])
        .all()
        .await
        .unwrap_err();
    assert!(
        matches!(err, ShardError::ShardsFailed { asked: 2, .. }),
        "{err:?}"
    );
    let partial = cluster
        .find::<order::Entity>()
        .keys([healthy_key, dead_key])
        .partial()
        .all()
        .await
        .unwrap();
    assert_eq!(partial.rows.len(), 3);
    assert_eq!(partial.failed.len(), 1);
}

fn futures_lite_shard(cluster: &Cluster, key: i64) -> String {
    match cluster.topology().locate("Customer", &key).unwrap() {
        shardkit::topology::Located::Target(t) => cluster.topology().shard(t.shard).name.clone(),
        other => panic!("{other:?}"),
    }
}

/// Makes `orders` on one shard answer slowly: a view over the real table that
/// waits (PostgreSQL `pg_sleep`, MySQL `SLEEP`) or, on SQLite, burns CPU in a
/// recursive CTE for several seconds.
async fn slow_down(db: &DatabaseConnection, backend: Backend) {
    let statements: Vec<&str> = match backend {
        Backend::Postgres => vec![
            "ALTER TABLE orders RENAME TO orders_data",
            "CREATE VIEW orders AS SELECT o.* FROM orders_data o CROSS JOIN (SELECT pg_sleep(5)) AS s",
        ],
        Backend::MySql => vec![
            "RENAME TABLE orders TO orders_data",
            "CREATE VIEW orders AS SELECT o.* FROM orders_data o CROSS JOIN (SELECT SLEEP(5) AS z) AS s",
        ],
        Backend::Sqlite => vec![
            "ALTER TABLE orders RENAME TO orders_data",
            "CREATE VIEW orders AS SELECT o.* FROM orders_data o WHERE (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 30000000) SELECT count(*) FROM c) > 0",
        ],
    };
    for sql in statements {
        db.execute_unprepared(sql).await.unwrap();
    }
}

async fn slow_shard_times_out(dbs: &mut TestDbs) {
    let single = reference_db(dbs).await;
    let cluster = dbs
        .cluster(8, "[groups.Customer]\n[read]\ntimeout_ms = 400\n")
        .await;
    cluster.migrate::<Migrator>().await.unwrap();
    let rows = load(&cluster, &single, None).await;
    slow_down(cluster.connection("s2").unwrap(), dbs.backend).await;

    // Cluster-wide timeout from `[read] timeout_ms`.
    let start = Instant::now();
    let err = cluster
        .find::<order::Entity>()
        .scatter()
        .all()
        .await
        .unwrap_err();
    let elapsed = start.elapsed();
    match &err {
        ShardError::ShardsFailed { failures, .. } => {
            assert_eq!(failures.len(), 1);
            assert_eq!(failures[0].shard, "s2");
            assert!(
                matches!(*failures[0].error, ShardError::Timeout { after, .. } if after == Duration::from_millis(400)),
                "{:?}",
                failures[0].error
            );
        }
        other => panic!("expected ShardsFailed, got {other:?}"),
    }
    assert!(
        elapsed < Duration::from_millis(2500),
        "the timeout fired after {elapsed:?}, not within its bound"
    );

    // Per-query timeout and partial results.
    let start = Instant::now();
    let partial = cluster
        .find::<order::Entity>()
        .scatter()
        .timeout(Duration::from_millis(250))
        .partial()
        .all()
        .await
        .unwrap();
    assert!(start.elapsed() < Duration::from_millis(2500));
    assert_eq!(partial.failed.len(), 1);
    assert!(matches!(
        *partial.failed[0].error,
        ShardError::Timeout { .. }
    ));
    let on_s2: BTreeSet<i64> = {
        let mut ids = BTreeSet::new();
        for r in &rows {
            if futures_lite_shard(&cluster, r.customer_id) == "s2" {
                ids.insert(r.id);
            }
        }
        ids
    };
    assert!(!on_s2.is_empty());
    assert_eq!(partial.rows.len(), rows.len() - on_s2.len());
    assert!(partial.rows.iter().all(|r| !on_s2.contains(&r.id)));
}

/// A key list longer than SQLite's 32,766-parameter limit is split into
/// several statements on the same shard, and every row still comes back.
async fn long_key_lists_are_chunked_under_the_parameter_limit(dbs: &mut TestDbs) {
    let (cluster, sent) = recording_cluster(dbs, 1, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let tx = cluster.begin::<Customer>(70_000).await.unwrap();
    tx.insert(order::ActiveModel {
        id: Set(1),
        customer_id: Set(70_000),
        total_cents: Set(1),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    sent.lock().unwrap().clear();
    let rows = cluster
        .find::<order::Entity>()
        .keys(1..=70_000)
        .filter(order::Column::TotalCents.gte(0))
        .all()
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    // The read's statements (the background read of rollout instances a
    // first write starts may land in the log too).
    let statements: Vec<_> = sent
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| s.sql.contains("\"orders\""))
        .cloned()
        .collect();
    assert_eq!(
        statements.len(),
        3,
        "70,000 keys in chunks under 32,766 parameters"
    );
    for (_, stmt) in &statements {
        let n = stmt.values.as_ref().map_or(0, |v| v.0.len());
        assert!(n <= 32_766, "{n} parameters");
    }
    let keys: Vec<i64> = statements
        .iter()
        .flat_map(|(_, s)| s.values.iter().flat_map(|v| v.0.clone()))
        .filter_map(|v| match v {
            Value::BigInt(Some(k)) if k >= 1 => Some(k),
            _ => None,
        })
        .collect();
    assert_eq!(keys.len(), 70_000, "every key sent once");
    assert_eq!(keys.iter().copied().collect::<BTreeSet<_>>().len(), 70_000);
    drop(cluster);
}
