//! SeaORM's toolbox inside one shard key: relations, streams, batch writes.
//! Each read must return the key's rows only, even when another key's rows
//! share the shard and the join; each write must touch only the key's rows.

use futures::TryStreamExt;
use sea_orm::ExprTrait;
use shardkit::prelude::*;
use shardkit_tests::models::*;
use shardkit_tests::{Backend, Proxy, TestDbs, contacts_by_index, recording_cluster};
use std::time::Duration;

/// Two customers whose rows share a shard.
async fn neighbours(cluster: &Cluster) -> (i64, i64) {
    let first = 1_i64;
    let shard = cluster
        .shard_of::<Customer>(&first)
        .await
        .unwrap()
        .to_owned();
    let mut other = first;
    loop {
        other += 1;
        if cluster.shard_of::<Customer>(&other).await.unwrap() == shard {
            return (first, other);
        }
    }
}

fn cart(id: i64, customer: i64, label: &str) -> cart::ActiveModel {
    cart::ActiveModel {
        id: Set(id),
        customer_id: Set(customer),
        label: Set(label.to_owned()),
    }
}

fn item(id: i64, customer: i64, cart: i64, sku: &str) -> cart_item::ActiveModel {
    cart_item::ActiveModel {
        id: Set(id),
        customer_id: Set(customer),
        cart_id: Set(cart),
        sku: Set(sku.to_owned()),
        quantity: Set(1),
    }
}

/// Customer `a` has carts 1 (items 10, 11) and 2 (no item of its own);
/// customer `b`, on the same shard, has cart 3 and items 20 (in `a`'s cart 1)
/// and 21 (in `a`'s cart 2): rows a join would match if it ignored the key.
async fn seed_carts(cluster: &Cluster, a: i64, b: i64) {
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    tx.insert_many([cart(1, a, "a-1"), cart(2, a, "a-2")])
        .await
        .unwrap();
    tx.insert_many([item(10, a, 1, "a-x"), item(11, a, 1, "a-y")])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let tx = cluster.begin::<Customer>(b).await.unwrap();
    tx.insert(cart(3, b, "b-3")).await.unwrap();
    tx.insert_many([item(20, b, 1, "b-in-a1"), item(21, b, 2, "b-in-a2")])
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// Every cart item of `key`.
async fn items_of(cluster: &Cluster, key: i64) -> Vec<cart_item::Model> {
    cluster
        .find::<cart_item::Entity>()
        .key(key)
        .all()
        .await
        .unwrap()
}

fn skus(items: &[cart_item::Model]) -> Vec<&str> {
    let mut skus: Vec<&str> = items.iter().map(|i| i.sku.as_str()).collect();
    skus.sort_unstable();
    skus
}

pub(crate) async fn related_reads_stay_within_the_key(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let (a, b) = neighbours(&cluster).await;
    seed_carts(&cluster, a, b).await;

    // find_with_related: every cart of a, each with a's items only; cart 2,
    // whose only item is b's, is still there, with no item.
    let carts = cluster
        .find::<cart::Entity>()
        .key(a)
        .find_with_related(cart_item::Entity)
        .await
        .unwrap();
    let got: Vec<(i64, Vec<&str>)> = carts.iter().map(|(c, i)| (c.id, skus(i))).collect();
    assert_eq!(got, vec![(1, vec!["a-x", "a-y"]), (2, vec![])]);

    // A limit would count joined rows: refused.
    let err = cluster
        .find::<cart::Entity>()
        .key(a)
        .limit(1)
        .find_with_related(cart_item::Entity)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ShardError::Unsupported {
                operation: "find_with_related",
                ..
            }
        ),
        "{err:?}"
    );

    // Filters of the keyed read apply to the root side.
    let carts = cluster
        .find::<cart::Entity>()
        .key(a)
        .filter(cart::Column::Label.eq("a-2"))
        .find_with_related(cart_item::Entity)
        .await
        .unwrap();
    assert_eq!(carts.len(), 1);
    assert_eq!(carts[0].0.id, 2);
    assert!(carts[0].1.is_empty(), "{:?}", carts[0].1);

    // find_also_related from the items' side: b's items name a's carts, but
    // b's read finds no cart of b's key for them.
    let items = cluster
        .find::<cart_item::Entity>()
        .key(b)
        .order_by_asc(cart_item::Column::Id)
        .find_also_related(cart::Entity)
        .await
        .unwrap();
    let got: Vec<(i64, Option<i64>)> = items
        .iter()
        .map(|(i, c)| (i.id, c.as_ref().map(|c| c.id)))
        .collect();
    assert_eq!(got, vec![(20, None), (21, None)]);
    let items = cluster
        .find::<cart_item::Entity>()
        .key(a)
        .find_also_related(cart::Entity)
        .await
        .unwrap();
    let got: Vec<(i64, Option<i64>)> = items
        .iter()
        .map(|(i, c)| (i.id, c.as_ref().map(|c| c.id)))
        .collect();
    assert_eq!(got, vec![(10, Some(1)), (11, Some(1))]);

    // find_related from a model: a keyed read of the related entity.
    let cart_1 = cluster
        .find::<cart::Entity>()
        .key(a)
        .filter(cart::Column::Id.eq(1))
        .one()
        .await
        .unwrap()
        .unwrap();
    let items = cluster
        .find_related(&cart_1, cart_item::Entity)
        .order_by_asc(cart_item::Column::Id)
        .all()
        .await
        .unwrap();
    assert_eq!(skus(&items), vec!["a-x", "a-y"]);
    let n = cluster
        .find_related(&cart_1, cart_item::Entity)
        .count()
        .await
        .unwrap();
    assert_eq!(n, 2, "b's item in a's cart is not a's");
    let plan = cluster
        .find_related(&cart_1, cart_item::Entity)
        .explain()
        .await
        .unwrap();
    // One shard, one statement: the join to the cart, scoped to a's key.
    let plan = plan.to_string();
    assert!(
        plan.contains("INNER JOIN") && plan.contains("customer_id"),
        "{plan}"
    );

    // The same inside a transaction of each key.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let carts = tx
        .find::<cart::Entity>()
        .find_with_related(cart_item::Entity)
        .await
        .unwrap();
    let got: Vec<(i64, Vec<&str>)> = carts.iter().map(|(c, i)| (c.id, skus(i))).collect();
    assert_eq!(got, vec![(1, vec!["a-x", "a-y"]), (2, vec![])]);
    let items = tx
        .find_related(&cart_1, cart_item::Entity)
        .all()
        .await
        .unwrap();
    assert_eq!(skus(&items), vec!["a-x", "a-y"]);
    tx.rollback().await.unwrap();
    let tx = cluster.begin::<Customer>(b).await.unwrap();
    let items = tx
        .find::<cart_item::Entity>()
        .find_also_related(cart::Entity)
        .await
        .unwrap();
    assert!(items.iter().all(|(_, c)| c.is_none()), "{items:?}");
    assert_eq!(items.len(), 2);
    // a's cart read from b's transaction: b's rows only, so none.
    let items = tx
        .find_related(&cart_1, cart_item::Entity)
        .all()
        .await
        .unwrap();
    assert_eq!(skus(&items), vec!["b-in-a1"]);
    tx.rollback().await.unwrap();
}

pub(crate) async fn keyed_streams_return_the_keys_rows(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let (a, b) = neighbours(&cluster).await;
    for (key, base) in [(a, 0), (b, 1_000)] {
        let tx = cluster.begin::<Customer>(key).await.unwrap();
        tx.insert_many((0..120).map(|n| cart(base + n, key, &format!("c{n}"))))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    let all = cluster
        .find::<cart::Entity>()
        .key(a)
        .order_by_asc(cart::Column::Id)
        .all()
        .await
        .unwrap();
    let streamed: Vec<cart::Model> = cluster
        .find::<cart::Entity>()
        .key(a)
        .order_by_asc(cart::Column::Id)
        .stream()
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(streamed.len(), 120);
    assert_eq!(streamed, all);

    // Projections stream too.
    let ids: Vec<i64> = cluster
        .find::<cart::Entity>()
        .key(b)
        .select_only()
        .column(cart::Column::Id)
        .order_by_desc(cart::Column::Id)
        .into_tuple::<i64>()
        .stream()
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(ids, (1_000..1_120).rev().collect::<Vec<_>>());

    // Dropping a stream half-read gives its connection back: a pool of
    // 4 serves 20 half-read streams in a row.
    for _ in 0..20 {
        let mut rows = cluster
            .find::<cart::Entity>()
            .key(a)
            .stream()
            .await
            .unwrap();
        assert!(rows.try_next().await.unwrap().is_some());
    }

    // In a transaction: while a stream holds its connection, any other
    // statement of the transaction is refused at once (it would wait for
    // the stream for ever); once the stream is dropped, all is well.
    let tx = cluster.begin::<Customer>(b).await.unwrap();
    let mut rows = tx.find::<cart::Entity>().stream().await.unwrap();
    assert!(rows.try_next().await.unwrap().is_some());
    let err = tx.insert(cart(5_000, b, "late")).await.unwrap_err();
    assert!(matches!(err, ShardError::Unsupported { .. }), "{err:?}");
    let err = tx.find::<cart::Entity>().count().await.unwrap_err();
    assert!(matches!(err, ShardError::Unsupported { .. }), "{err:?}");
    let err = tx
        .update_many::<cart::Entity>()
        .set(cart::ActiveModel {
            label: Set("x".into()),
            ..Default::default()
        })
        .exec()
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::Unsupported { .. }), "{err:?}");
    drop(rows);
    tx.insert(cart(5_000, b, "late")).await.unwrap();
    tx.rollback().await.unwrap();

    // In a transaction: its key's rows, on its connection.
    let tx = cluster.begin::<Customer>(b).await.unwrap();
    let rows: Vec<cart::Model> = tx
        .find::<cart::Entity>()
        .stream()
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(rows.len(), 120);
    assert!(rows.iter().all(|r| r.customer_id == b));
    tx.rollback().await.unwrap();

    // A statement the shard refuses fails when the stream opens.
    let err = match cluster.find::<ghost::Entity>().key(a).stream().await {
        Err(err) => err,
        Ok(_) => panic!("a stream of a missing table opened"),
    };
    assert!(matches!(err, ShardError::Db { .. }), "{err:?}");
}

/// A shard that stops answering in the middle of a stream: the stream ends
/// with the shard's error within the read's timeout instead of hanging, and
/// once the cluster is dropped no server connection is left.
pub(crate) async fn a_stream_from_a_shard_that_hangs_mid_statement_fails(dbs: &mut TestDbs) {
    let before = dbs.server_connections().await;
    let server = dbs.backend.server_address().unwrap();
    let proxy = Proxy::start(server).await;
    let url = match dbs.backend {
        Backend::MySql => format!("mysql://root@127.0.0.1:{}/{}", proxy.port, dbs.names[1]),
        _ => format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            proxy.port, dbs.names[1]
        ),
    };
    let first = dbs.shards_toml_with(1, "connect_timeout_secs = 1\n", &[]);
    let toml =
        format!("{first}\n[[shards]]\nname = \"s1\"\nurl = \"{url}\"\n\n[groups.Customer]\n");
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let mut key = 0_i64;
    while cluster
        .shard_of::<Customer>(&{
            key += 1;
            key
        })
        .await
        .unwrap()
        != "s1"
    {}
    // Rows larger than every socket buffer between the server and shardkit
    // (16 MB: 600 rows, 4.8 MB, were once read whole before the freeze).
    const ROWS: i64 = 2_000;
    let label = "x".repeat(8_000);
    let tx = cluster.begin::<Customer>(key).await.unwrap();
    tx.insert_many((0..ROWS).map(|n| cart(n, key, &label)))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let mut rows = cluster
        .find::<cart::Entity>()
        .key(key)
        .timeout(Duration::from_secs(2))
        .stream()
        .await
        .unwrap();
    assert!(rows.try_next().await.unwrap().is_some());
    proxy.freeze();
    let mut read = 1;
    let err = loop {
        match rows.try_next().await {
            Ok(Some(_)) => read += 1,
            Ok(None) => panic!("the stream ended after {read} rows as if complete"),
            Err(err) => break err,
        }
    };
    assert!(read < ROWS, "every row arrived before the freeze");
    match &err {
        ShardError::Timeout { shard, .. } | ShardError::Unavailable { shard, .. } => {
            assert_eq!(shard, "s1", "{err:?}")
        }
        other => panic!("expected the shard's timeout or outage, got {other:?}"),
    }
    drop(rows);
    proxy.kill();
    drop(cluster);
    let left = dbs
        .settle_connections(before, Duration::from_secs(10))
        .await;
    assert_eq!(
        left, before,
        "server connections left after the cluster was dropped"
    );
}

pub(crate) async fn batch_writes_touch_only_the_key(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let (a, b) = neighbours(&cluster).await;
    seed_carts(&cluster, a, b).await;

    // update_many: one statement, only a's rows, whatever the filter says.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let changed = tx
        .update_many::<cart_item::Entity>()
        .set(cart_item::ActiveModel {
            sku: Set("renamed".into()),
            ..Default::default()
        })
        .col_expr(
            cart_item::Column::Quantity,
            sea_orm::sea_query::Expr::col(cart_item::Column::Quantity).add(4),
        )
        .filter(cart_item::Column::CartId.eq(1))
        .exec()
        .await
        .unwrap();
    assert_eq!(changed, 2, "a's two items in cart 1, not b's item in it");
    tx.commit().await.unwrap();
    let mine = items_of(&cluster, a).await;
    assert!(
        mine.iter().all(|i| i.sku == "renamed" && i.quantity == 5),
        "{mine:?}"
    );
    let theirs = items_of(&cluster, b).await;
    assert_eq!(skus(&theirs), vec!["b-in-a1", "b-in-a2"]);
    assert!(theirs.iter().all(|i| i.quantity == 1), "{theirs:?}");

    // Moving rows to another key is refused before any I/O; the transaction
    // becomes rollback-only and nothing is written.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let err = tx
        .update_many::<cart_item::Entity>()
        .set(cart_item::ActiveModel {
            customer_id: Set(b),
            ..Default::default()
        })
        .exec()
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::CrossShardWrite { .. }), "{err:?}");
    assert!(tx.is_rollback_only());
    let err = tx
        .update_many::<cart_item::Entity>()
        .col_expr(
            cart_item::Column::CustomerId,
            sea_orm::sea_query::Expr::value(b),
        )
        .exec()
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::RollbackOnly { .. }), "{err:?}");
    drop(tx);
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let err = tx
        .update_many::<cart_item::Entity>()
        .col_expr(
            cart_item::Column::CustomerId,
            sea_orm::sea_query::Expr::value(b),
        )
        .exec()
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::CrossShardWrite { .. }), "{err:?}");
    drop(tx);
    // Setting a primary key (in the first of two `set`s), or nothing at all,
    // is refused before any I/O.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let sets_id = tx
        .update_many::<cart_item::Entity>()
        .set(cart_item::ActiveModel {
            id: Set(77),
            ..Default::default()
        })
        .set(cart_item::ActiveModel {
            sku: Set("unkeyed".into()),
            ..Default::default()
        });
    for (update, expected) in [
        (sets_id, "it sets a primary-key column"),
        (tx.update_many::<cart_item::Entity>(), "nothing to set"),
    ] {
        let err = update.exec().await.unwrap_err();
        assert!(
            matches!(&err, ShardError::Unsupported { reason, .. } if reason.starts_with(expected)),
            "{err:?}"
        );
    }
    drop(tx);
    assert_eq!(
        cluster
            .find::<cart_item::Entity>()
            .key(a)
            .count()
            .await
            .unwrap(),
        2
    );

    // Filters chained on a batch are ANDed, whatever the first one's kind:
    // an `any` first filter does not take in the next one.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let changed = tx
        .update_many::<cart_item::Entity>()
        .set(cart_item::ActiveModel {
            sku: Set("wrong".into()),
            ..Default::default()
        })
        .filter(
            sea_orm::Condition::any()
                .add(cart_item::Column::Id.eq(10))
                .add(cart_item::Column::Id.eq(20)),
        )
        .filter(cart_item::Column::Quantity.eq(99))
        .exec()
        .await
        .unwrap();
    assert_eq!(changed, 0, "(id 10 or 20) and quantity 99: no row");
    // An empty `any` matches nothing, and still nothing with a second filter.
    let deleted = tx
        .delete_many::<cart_item::Entity>()
        .filter(sea_orm::Condition::any())
        .filter(cart_item::Column::CartId.eq(1))
        .exec()
        .await
        .unwrap();
    assert_eq!(deleted, 0, "an empty any() and cart 1: no row");
    // A lone `any` naming b's item last (`key AND id = 10 OR id = 20`
    // would reach it), and a subquery on another table of the group (which
    // has a shard-key column of its own) naming every cart, a's and b's,
    // still stop at a's rows.
    let changed = tx
        .update_many::<cart_item::Entity>()
        .col_expr(
            cart_item::Column::Quantity,
            sea_orm::sea_query::Expr::value(7),
        )
        .filter(
            sea_orm::Condition::any()
                .add(cart_item::Column::Id.eq(10))
                .add(cart_item::Column::Id.eq(20)),
        )
        .exec()
        .await
        .unwrap();
    assert_eq!(changed, 1, "item 10 only: item 20 is b's");
    let every_cart = sea_orm::sea_query::Query::select()
        .column(cart::Column::Id)
        .from(cart::Entity)
        .and_where(cart::Column::CustomerId.is_in([a, b]))
        .to_owned();
    let changed = tx
        .update_many::<cart_item::Entity>()
        .col_expr(
            cart_item::Column::Quantity,
            sea_orm::sea_query::Expr::value(8),
        )
        .filter(cart_item::Column::CartId.in_subquery(every_cart))
        .exec()
        .await
        .unwrap();
    assert_eq!(changed, 2, "a's items 10 and 11, not b's 20 and 21");
    tx.commit().await.unwrap();
    let theirs = items_of(&cluster, b).await;
    assert!(theirs.iter().all(|i| i.quantity == 1), "{theirs:?}");
    let mine = items_of(&cluster, a).await;
    assert_eq!(skus(&mine), vec!["renamed", "renamed"]);

    // `set` twice sets the columns of both calls.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let changed = tx
        .update_many::<cart_item::Entity>()
        .set(cart_item::ActiveModel {
            sku: Set("twice".into()),
            ..Default::default()
        })
        .set(cart_item::ActiveModel {
            quantity: Set(7),
            ..Default::default()
        })
        .exec()
        .await
        .unwrap();
    assert_eq!(changed, 2);
    tx.commit().await.unwrap();
    let mine = items_of(&cluster, a).await;
    assert!(
        mine.iter().all(|i| i.sku == "twice" && i.quantity == 7),
        "{mine:?}"
    );
    let theirs = items_of(&cluster, b).await;
    assert!(
        theirs.iter().all(|i| i.sku != "twice" && i.quantity == 1),
        "{theirs:?}"
    );

    // delete_many: a's rows only.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let deleted = tx.delete_many::<cart_item::Entity>().exec().await.unwrap();
    assert_eq!(deleted, 2);
    tx.commit().await.unwrap();
    assert_eq!(
        cluster
            .find::<cart_item::Entity>()
            .key(a)
            .count()
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        cluster
            .find::<cart_item::Entity>()
            .key(b)
            .count()
            .await
            .unwrap(),
        2
    );
}

async fn indexed_contacts(cluster: &Cluster) {
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    for column in [contact::Column::Email, contact::Column::Phone] {
        cluster
            .gsi()
            .backfill::<contact::Entity>(column)
            .await
            .unwrap();
    }
}

async fn phone_owners(cluster: &Cluster, phone: &str) -> Vec<i64> {
    contacts_by_index(cluster, contact::Column::Phone, phone).await
}

/// On an entity with global indexes, batch writes go row by row through the
/// pipeline: index rows follow every change and every delete.
pub(crate) async fn batch_writes_keep_global_indexes(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    indexed_contacts(&cluster).await;
    let (a, b) = neighbours(&cluster).await;
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    tx.insert_many([
        contact::row(1, a, "a1@x", "555-1"),
        contact::row(2, a, "a2@x", "555-1"),
        contact::row(3, a, "a3@x", "555-3"),
    ])
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let tx = cluster.begin::<Customer>(b).await.unwrap();
    tx.insert(contact::row(4, b, "b4@x", "555-1"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(phone_owners(&cluster, "555-1").await, vec![1, 2, 4]);

    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let changed = tx
        .update_many::<contact::Entity>()
        .set(contact::ActiveModel {
            phone: Set("555-9".into()),
            ..Default::default()
        })
        .filter(contact::Column::Phone.eq("555-1"))
        .exec()
        .await
        .unwrap();
    assert_eq!(changed, 2);
    // An expression cannot be indexed before it is written: refused, before
    // any I/O, and the transaction goes on.
    let err = tx
        .update_many::<contact::Entity>()
        .col_expr(
            contact::Column::Phone,
            sea_orm::sea_query::Expr::value("555-0"),
        )
        .exec()
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ShardError::Unsupported {
                operation: "update_many",
                ..
            }
        ),
        "{err}"
    );
    assert!(!tx.is_rollback_only());
    tx.commit().await.unwrap();
    assert_eq!(phone_owners(&cluster, "555-9").await, vec![1, 2]);
    assert_eq!(
        phone_owners(&cluster, "555-1").await,
        vec![4],
        "b's contact kept its number"
    );

    // One unique value for two rows: the first row takes it, the second is
    // refused, and the whole batch with it: the transaction cannot commit
    // the first row alone.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let err = tx
        .update_many::<contact::Entity>()
        .set(contact::ActiveModel {
            email: Set("same@x".into()),
            ..Default::default()
        })
        .exec()
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::UniqueViolation { .. }), "{err:?}");
    assert!(tx.is_rollback_only());
    assert!(matches!(
        tx.commit().await,
        Err(ShardError::RollbackOnly { .. })
    ));
    let emails: Vec<String> = cluster
        .find::<contact::Entity>()
        .key(a)
        .all()
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.email)
        .collect();
    assert!(!emails.contains(&"same@x".to_owned()), "{emails:?}");

    // A primary key or nothing at all to set: refused before any I/O.
    let tx = cluster.begin::<Customer>(a).await.unwrap();
    for update in [
        tx.update_many::<contact::Entity>()
            .set(contact::ActiveModel {
                id: Set(99),
                ..Default::default()
            }),
        tx.update_many::<contact::Entity>(),
    ] {
        let err = update.exec().await.unwrap_err();
        assert!(
            matches!(
                err,
                ShardError::Unsupported {
                    operation: "update_many",
                    ..
                }
            ),
            "{err:?}"
        );
    }
    drop(tx);

    let tx = cluster.begin::<Customer>(a).await.unwrap();
    let deleted = tx
        .delete_many::<contact::Entity>()
        .filter(contact::Column::Phone.eq("555-9"))
        .exec()
        .await
        .unwrap();
    assert_eq!(deleted, 2);
    tx.commit().await.unwrap();
    assert_eq!(phone_owners(&cluster, "555-9").await, Vec::<i64>::new());
    let left = cluster
        .find::<contact::Entity>()
        .key(a)
        .all()
        .await
        .unwrap();
    assert_eq!(left.iter().map(|c| c.id).collect::<Vec<_>>(), vec![3]);
    // The deleted rows' unique emails are free again.
    let tx = cluster.begin::<Customer>(b).await.unwrap();
    tx.insert(contact::row(5, b, "a1@x", "555-5"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

pub(crate) async fn save_inserts_or_updates(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let tx = cluster.begin::<Customer>(9).await.unwrap();
    // No id: inserted, with its `#[shardkit(id = "uuid_v7")]` id filled in.
    let saved = tx
        .save(event::ActiveModel {
            customer_id: Set(9),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = saved.id.clone().unwrap();
    assert_eq!(id.get_version_num(), 7);
    // With its id: updated in place.
    tx.insert(cart(1, 9, "old")).await.unwrap();
    let saved = tx.save(cart(1, 9, "new")).await.unwrap();
    assert_eq!(saved.label.clone().unwrap(), "new");
    // Of another key: refused, and the transaction with it.
    let err = tx.save(cart(2, 10, "theirs")).await.unwrap_err();
    assert!(matches!(err, ShardError::CrossShardWrite { .. }), "{err:?}");
    assert!(matches!(
        tx.commit().await,
        Err(ShardError::RollbackOnly { .. })
    ));
    assert_eq!(
        cluster
            .find::<event::Entity>()
            .key(9)
            .count()
            .await
            .unwrap(),
        0,
        "rolled back"
    );

    let tx = cluster.begin::<Customer>(9).await.unwrap();
    tx.insert(cart(1, 9, "old")).await.unwrap();
    tx.save(cart(1, 9, "new")).await.unwrap();
    tx.commit().await.unwrap();
    let carts = cluster.find::<cart::Entity>().key(9).all().await.unwrap();
    assert_eq!(
        carts.iter().map(|c| c.label.as_str()).collect::<Vec<_>>(),
        vec!["new"]
    );
}

/// 8 writers on a pool of 2 per shard, each batch-updating and deleting
/// its own key's indexed rows (index rows on both shards): every batch
/// completes, and only its own rows change.
pub(crate) async fn batch_writes_on_a_small_pool_all_complete(dbs: &mut TestDbs) {
    let toml = format!(
        "{}\n[groups.Customer]\n",
        dbs.shards_toml(2)
            .replace("max_connections = 4", "max_connections = 2")
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    indexed_contacts(&cluster).await;
    for key in 1..=8_i64 {
        let tx = cluster.begin::<Customer>(key).await.unwrap();
        tx.insert_many(
            (0..4).map(|n| contact::row(key * 100 + n, key, &format!("{key}-{n}@x"), "555-0")),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let writers = (1..=8_i64).map(|key| {
        let cluster = cluster.clone();
        tokio::spawn(async move {
            cluster
                .transaction::<Customer, _, _>(key, |tx| async move {
                    tx.update_many::<contact::Entity>()
                        .set(contact::ActiveModel {
                            phone: Set(format!("555-{key}")),
                            ..Default::default()
                        })
                        .exec()
                        .await?;
                    tx.delete_many::<contact::Entity>()
                        .filter(contact::Column::Id.eq(key * 100))
                        .exec()
                        .await
                })
                .await
        })
    });
    for writer in futures::future::join_all(writers).await {
        assert_eq!(writer.unwrap().unwrap(), 1);
    }
    assert_eq!(phone_owners(&cluster, "555-0").await, Vec::<i64>::new());
    for key in 1..=8_i64 {
        let expected: Vec<i64> = (1..4).map(|n| key * 100 + n).collect();
        assert_eq!(
            phone_owners(&cluster, &format!("555-{key}")).await,
            expected
        );
    }
}

/// Projections of several shards: the union of every shard's rows when
/// nothing orders them; an ordered one is refused before any statement runs.
pub(crate) async fn multi_shard_projections_merge_or_refuse(dbs: &mut TestDbs) {
    let (cluster, sent) = recording_cluster(dbs, 2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    // Customers 1..=6 on both shards, 3 carts each.
    for key in 1..=6_i64 {
        let tx = cluster.begin::<Customer>(key).await.unwrap();
        tx.insert_many((0..3).map(|n| cart(key * 10 + n, key, &format!("k{key}"))))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let shards: std::collections::HashSet<String> =
        futures::future::join_all((1..=6_i64).map(|k| {
            let cluster = cluster.clone();
            async move { cluster.shard_of::<Customer>(&k).await.unwrap().to_owned() }
        }))
        .await
        .into_iter()
        .collect();
    assert_eq!(shards.len(), 2, "the keys span both shards");

    let mut ids: Vec<i64> = cluster
        .find::<cart::Entity>()
        .scatter()
        .select_only()
        .column(cart::Column::Id)
        .into_tuple()
        .all()
        .await
        .unwrap();
    ids.sort_unstable();
    let expected: Vec<i64> = (1..=6_i64)
        .flat_map(|k| (0..3).map(move |n| k * 10 + n))
        .collect();
    assert_eq!(ids, expected);

    let pairs: Vec<(i64, String)> = cluster
        .find::<cart::Entity>()
        .keys([2, 5])
        .filter(cart::Column::Id.ne(20))
        .select_only()
        .column(cart::Column::CustomerId)
        .column(cart::Column::Label)
        .into_tuple()
        .all()
        .await
        .unwrap();
    let mut pairs = pairs;
    pairs.sort();
    assert_eq!(
        pairs,
        vec![
            (2, "k2".into()),
            (2, "k2".into()),
            (5, "k5".into()),
            (5, "k5".into()),
            (5, "k5".into())
        ]
    );

    let json = cluster
        .find::<cart::Entity>()
        .keys([3])
        .into_json()
        .all()
        .await
        .unwrap();
    assert_eq!(json.len(), 3);
    assert!(json.iter().all(|row| row["customer_id"] == 3), "{json:?}");

    let some: Vec<i64> = cluster
        .find::<cart::Entity>()
        .scatter()
        .select_only()
        .column(cart::Column::Id)
        .limit(4)
        .offset(1)
        .into_tuple()
        .all()
        .await
        .unwrap();
    assert_eq!(some.len(), 4);
    assert!(some.iter().all(|id| expected.contains(id)));

    let part = cluster
        .find::<cart::Entity>()
        .scatter()
        .partial()
        .select_only()
        .column(cart::Column::Id)
        .into_tuple::<i64>()
        .all()
        .await
        .unwrap();
    assert!(part.is_complete());
    assert_eq!(part.rows.len(), 18);

    let before = sent.lock().unwrap().len();
    let err = cluster
        .find::<cart::Entity>()
        .scatter()
        .order_by_desc(cart::Column::Id)
        .select_only()
        .column(cart::Column::Id)
        .into_tuple::<i64>()
        .all()
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::Unmergeable { .. }), "{err:?}");
    assert!(err.to_string().contains("`id`"), "{err}");
    assert_eq!(sent.lock().unwrap().len(), before, "no statement ran");
}

/// `insert_without_returning` and `update_without_returning`: one statement
/// each (no `RETURNING`, no read-back `SELECT`), the key checked, an id
/// filled; on an entity with global indexes the whole pipeline runs, so its
/// index rows are written.
pub(crate) async fn writes_without_returning_send_one_statement(dbs: &mut TestDbs) {
    let (cluster, sent) = recording_cluster(dbs, 2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let tx = cluster.begin::<Customer>(9).await.unwrap();
    sent.lock().unwrap().clear();
    assert_eq!(
        tx.insert_without_returning(cart(1, 9, "old"))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        tx.update_without_returning(cart(1, 9, "new"))
            .await
            .unwrap(),
        1
    );
    // Another key's row with the same primary key is not this key's.
    assert_eq!(
        tx.update_without_returning(cart(2, 9, "none"))
            .await
            .unwrap(),
        0
    );
    // An update that does not name its row is refused before any SQL.
    let err = tx
        .update_without_returning(cart::ActiveModel {
            customer_id: Set(9),
            label: Set("unnamed".to_owned()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::Db { .. }), "{err:?}");
    assert!(
        err.to_string().contains("update carts")
            && err
                .to_string()
                .contains("an update without its primary key set"),
        "{err}"
    );
    let statements: Vec<String> = sent
        .lock()
        .unwrap()
        .iter()
        .map(|(_, s)| s.sql.to_ascii_uppercase())
        // Background statements of the instance aside.
        .filter(|s| s.contains("CARTS"))
        .collect();
    assert_eq!(statements.len(), 3, "{statements:#?}");
    assert!(!statements[1].contains("SET \"ID\"") && !statements[1].contains("SET `ID`"));
    assert!(statements[0].starts_with("INSERT") && !statements[0].contains("RETURNING"));
    assert!(statements[1].starts_with("UPDATE") && !statements[1].contains("RETURNING"));
    assert!(
        statements.iter().all(|s| !s.starts_with("SELECT")),
        "{statements:#?}"
    );
    // An id left unset is filled as by `insert`.
    assert_eq!(
        tx.insert_without_returning(event::ActiveModel {
            customer_id: Set(9),
            ..Default::default()
        })
        .await
        .unwrap(),
        1
    );
    // Another key's row is refused before any SQL, and the transaction with it.
    let carts_sent = || {
        sent.lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| s.sql.to_ascii_uppercase().contains("CARTS"))
            .count()
    };
    let before = carts_sent();
    let err = tx
        .insert_without_returning(cart(3, 10, "theirs"))
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::CrossShardWrite { .. }), "{err:?}");
    assert_eq!(carts_sent(), before);
    assert!(matches!(
        tx.commit().await,
        Err(ShardError::RollbackOnly { .. })
    ));

    let tx = cluster.begin::<Customer>(9).await.unwrap();
    tx.insert_without_returning(cart(1, 9, "old"))
        .await
        .unwrap();
    tx.update_without_returning(cart(1, 9, "new"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let carts = cluster.find::<cart::Entity>().key(9).all().await.unwrap();
    assert_eq!(
        carts.iter().map(|c| c.label.as_str()).collect::<Vec<_>>(),
        ["new"]
    );
    assert_eq!(
        cluster
            .find::<event::Entity>()
            .key(9)
            .count()
            .await
            .unwrap(),
        0
    );

    // Global indexes: the row is found through its index afterwards.
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    let tx = cluster.begin::<Customer>(9).await.unwrap();
    assert_eq!(
        tx.insert_without_returning(contact::row(7, 9, "nine@x", "555-9"))
            .await
            .unwrap(),
        1
    );
    tx.commit().await.unwrap();
    assert_eq!(phone_owners(&cluster, "555-9").await, [7]);
}
