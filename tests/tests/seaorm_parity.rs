//! SeaORM's toolbox inside one shard key: relations, streams, batch writes.
//! Each read must return the key's rows only, even when another key's rows
//! share the shard and the join; each write must touch only the key's rows.

use futures::TryStreamExt;
use shardkit::prelude::*;
use shardkit_tests::models::*;
use shardkit_tests::{Backend, Proxy, TestDbs, backend_tests};
use std::time::Duration;

backend_tests!(2 =>
    related_reads_stay_within_the_key,
    keyed_streams_return_the_keys_rows,
    [Postgres, MySql] a_stream_from_a_shard_that_hangs_mid_statement_fails,
);

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

fn skus(items: &[cart_item::Model]) -> Vec<&str> {
    let mut skus: Vec<&str> = items.iter().map(|i| i.sku.as_str()).collect();
    skus.sort_unstable();
    skus
}

async fn related_reads_stay_within_the_key(dbs: &mut TestDbs) {
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
    assert_eq!(
        plan.to_string().matches("customer_id").count() >= 1,
        true,
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

async fn keyed_streams_return_the_keys_rows(dbs: &mut TestDbs) {
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
async fn a_stream_from_a_shard_that_hangs_mid_statement_fails(dbs: &mut TestDbs) {
    let before = dbs.server_connections().await;
    let server = dbs
        .backend
        .server_url()
        .unwrap()
        .rsplit('@')
        .next()
        .unwrap()
        .to_owned();
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
    // Rows larger than every socket buffer between the server and shardkit.
    let label = "x".repeat(8_000);
    let tx = cluster.begin::<Customer>(key).await.unwrap();
    tx.insert_many((0..600).map(|n| cart(n, key, &label)))
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
    assert!(read < 600, "every row arrived before the freeze");
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
