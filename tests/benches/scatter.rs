//! Multi-shard reads.
//!
//! (a) `scatter/delayed`: a scatter over 8 PostgreSQL shards whose every
//!     `orders` read takes t = 20 ms (a view over `pg_sleep(0.02)`), against one
//!     keyed read of one such shard (t itself). Concurrency means the scatter
//!     costs about t, not 8 t. Skipped with a printed line when PostgreSQL is
//!     unreachable.
//! (b) `scatter/keys_1000`: `keys()` over 1,000 keys on 8 SQLite shards; the
//!     setup asserts it sends 8 statements carrying 1,000 keys in all.
//!
//! `cargo bench -p shardkit-tests --bench scatter`

use criterion::{Criterion, criterion_group, criterion_main};
use sea_orm::{ConnectionTrait, Set};
use shardkit::Cluster;
use shardkit_tests::models::{Customer, Migrator, order};
use shardkit_tests::{Backend, TestDbs};
use std::sync::{Arc, Mutex};

const DELAY_SECS: &str = "0.02";

async fn seed(cluster: &Cluster, customers: i64) {
    for customer in 1..=customers {
        let tx = cluster.begin::<Customer>(customer).await.unwrap();
        tx.insert(order::ActiveModel {
            id: Set(customer),
            customer_id: Set(customer),
            total_cents: Set(customer % 100),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
}

fn delayed(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let Some((dbs, cluster)) = rt.block_on(async {
        let dbs = TestDbs::create_if_reachable(Backend::Postgres, "bench::scatter_delayed", 8).await?;
        let cluster = dbs.cluster(8, "[groups.Customer]\n").await;
        cluster.migrate::<Migrator>().await.unwrap();
        seed(&cluster, 64).await;
        for shard in cluster.topology().shard_names().map(str::to_owned).collect::<Vec<_>>() {
            let db = cluster.connection(&shard).unwrap();
            db.execute_unprepared("ALTER TABLE orders RENAME TO orders_data").await.unwrap();
            db.execute_unprepared(&format!(
                "CREATE VIEW orders AS SELECT o.* FROM orders_data o CROSS JOIN (SELECT pg_sleep({DELAY_SECS})) AS s"
            ))
            .await
            .unwrap();
        }
        Some((dbs, cluster))
    }) else {
        println!("scatter/delayed skipped: PostgreSQL unreachable");
        return;
    };
    let mut group = c.benchmark_group("scatter/delayed");
    group.sample_size(30);
    group.bench_function("one_shard", |b| {
        b.to_async(&rt)
            .iter(|| async { cluster.find::<order::Entity>().key(7).all().await.unwrap() })
    });
    group.bench_function("scatter_8", |b| {
        b.to_async(&rt).iter(|| async {
            let rows = cluster
                .find::<order::Entity>()
                .scatter()
                .all()
                .await
                .unwrap();
            assert_eq!(rows.len(), 64);
        })
    });
    group.finish();
    drop(cluster);
    rt.block_on(dbs.cleanup());
}

fn keys_1000(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sent: Arc<Mutex<Vec<usize>>> = Arc::default();
    let log = Arc::clone(&sent);
    let (dbs, cluster) = rt.block_on(async {
        let dbs = TestDbs::create(Backend::Sqlite, "bench::scatter_keys", 8).await;
        let cluster = Cluster::builder(dbs.config(8, "[groups.Customer]\n"))
            .on_statement(move |e| {
                log.lock()
                    .unwrap()
                    .push(e.statement.values.as_ref().map_or(0, |v| v.0.len()))
            })
            .connect()
            .await
            .unwrap();
        cluster.migrate::<Migrator>().await.unwrap();
        seed(&cluster, 1000).await;
        (dbs, cluster)
    });
    let keys: Vec<i64> = (1..=1000).collect();
    sent.lock().unwrap().clear();
    let rows = rt
        .block_on(cluster.find::<order::Entity>().keys(keys.clone()).all())
        .unwrap();
    assert_eq!(rows.len(), 1000);
    let statements = sent.lock().unwrap().clone();
    assert_eq!(
        statements.len(),
        8,
        "keys() over 8 shards sends 8 statements"
    );
    assert_eq!(
        statements.iter().sum::<usize>(),
        1000,
        "and 1,000 bound keys in all"
    );
    println!(
        "scatter/keys_1000: {} statements, {} bound keys",
        statements.len(),
        statements.iter().sum::<usize>()
    );

    c.bench_function("scatter/keys_1000", |b| {
        b.to_async(&rt).iter(|| async {
            let rows = cluster
                .find::<order::Entity>()
                .keys(keys.clone())
                .all()
                .await
                .unwrap();
            assert_eq!(rows.len(), 1000);
        })
    });
    drop(cluster);
    rt.block_on(dbs.cleanup());
}

criterion_group!(benches, delayed, keys_1000);
criterion_main!(benches);
