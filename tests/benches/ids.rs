//! Id generation.
//!
//! - `ids/segment/{sqlite,mariadb}`: `Sequence::next()` from memory (block
//!   100,000, background prefetch), one thread. Also prints the p99 of single
//!   calls timed one by one (that timing includes `Instant::now()` itself).
//! - `ids/flickr/*`: B = 1 (one ticket per id) against a hand-written
//!   `REPLACE INTO ...; SELECT LAST_INSERT_ID()` loop on the same MariaDB.
//! - `ids/snowflake`, `ids/uuid_v7` vs `ids/uuid_now_v7`.
//!
//! `cargo bench -p shardkit-tests --bench ids` (MariaDB cases skip with a
//! printed line when the server is unreachable).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sea_orm::{ConnectionTrait, Database, Statement};
use shardkit::{Cluster, ClusterConfig};
use shardkit_tests::models::Migrator;
use shardkit_tests::{Backend, TestDbs};
use std::hint::black_box;
use std::time::{Duration, Instant};

const BLOCK: u64 = 100_000;

async fn ticket_cluster(backend: Backend, name: &str) -> Option<(TestDbs, Cluster)> {
    let mut dbs = TestDbs::create_if_reachable(backend, name, 1).await?;
    let a = dbs.extra("tickets_a").await;
    let b = dbs.extra("tickets_b").await;
    let toml = format!(
        "{}\n[ids]\nservers = [{{ name = \"a\", url = \"{a}\" }}, {{ name = \"b\", url = \"{b}\" }}]\n\
         [ids.sequences.mem]\nblock = {BLOCK}\n[ids.sequences.flickr]\nblock = 1\n",
        dbs.shards_toml(1)
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.ids().create_sequence("mem").await.unwrap();
    cluster.ids().create_sequence("flickr").await.unwrap();
    Some((dbs, cluster))
}

fn segment(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for (backend, label) in [(Backend::Sqlite, "sqlite"), (Backend::MySql, "mariadb")] {
        let Some((dbs, cluster)) = rt.block_on(ticket_cluster(
            backend,
            &format!("bench::ids_segment_{label}"),
        )) else {
            println!("ids/segment/{label} skipped: server unreachable");
            continue;
        };
        let seq = cluster.ids().sequence("mem").unwrap();
        rt.block_on(async {
            // p99 of single calls, timed one by one, after a warm-up.
            for _ in 0..200_000 {
                black_box(seq.next().await.unwrap());
            }
            let mut samples = Vec::with_capacity(1_000_000);
            for _ in 0..1_000_000 {
                let t = Instant::now();
                black_box(seq.next().await.unwrap());
                samples.push(t.elapsed());
            }
            samples.sort_unstable();
            println!(
                "ids/segment/{label}: p50 {:?} p99 {:?} p99.9 {:?} max {:?} over 1,000,000 calls",
                samples[500_000], samples[990_000], samples[999_000], samples[999_999]
            );
        });
        let mut group = c.benchmark_group("ids/segment");
        group.throughput(Throughput::Elements(1));
        group.bench_function(label, |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let seq = seq.clone();
                async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        black_box(seq.next().await.unwrap());
                    }
                    start.elapsed()
                }
            })
        });
        group.finish();
        drop(seq);
        drop(cluster);
        rt.block_on(dbs.cleanup());
    }
}

fn flickr(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let Some((dbs, cluster)) = rt.block_on(ticket_cluster(Backend::MySql, "bench::ids_flickr"))
    else {
        println!("ids/flickr skipped: MariaDB unreachable");
        return;
    };
    // The hand-written loop: one pinned connection, Flickr's session settings,
    // REPLACE INTO then SELECT LAST_INSERT_ID().
    let url = format!("{}/{}", Backend::MySql.server_url().unwrap(), dbs.names[1]);
    let hand = rt.block_on(async {
        let mut opts = sea_orm::ConnectOptions::new(url);
        opts.max_connections(1).min_connections(1);
        let db = Database::connect(opts).await.unwrap();
        db.execute_unprepared(
            "SET SESSION auto_increment_increment = 2, auto_increment_offset = 1",
        )
        .await
        .unwrap();
        db
    });
    let mut group = c.benchmark_group("ids/flickr");
    group
        .sample_size(50)
        .measurement_time(Duration::from_secs(8));
    group.bench_function("hand_written_replace_select", |b| {
        b.to_async(&rt).iter(|| async {
            hand.execute_unprepared("REPLACE INTO tickets_flickr (stub) VALUES ('a')")
                .await
                .unwrap();
            let row = hand
                .query_one_raw(Statement::from_string(
                    hand.get_database_backend(),
                    "SELECT LAST_INSERT_ID() AS id",
                ))
                .await
                .unwrap()
                .unwrap();
            black_box(row.try_get::<u64>("", "id").unwrap())
        })
    });
    let ids = cluster.ids().clone();
    group.bench_function("shardkit_block_1", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ids.next("flickr").await.unwrap()) })
    });
    group.finish();
    drop(hand);
    drop(cluster);
    rt.block_on(dbs.cleanup());
}

fn generators(c: &mut Criterion) {
    let snowflake = shardkit::Snowflake::new(
        shardkit::SnowflakeLayout::default(),
        1,
        std::sync::Arc::new(shardkit::ids::SystemClock),
    )
    .unwrap();
    let mut group = c.benchmark_group("ids");
    group.throughput(Throughput::Elements(1));
    group.bench_function("snowflake", |b| {
        b.iter(|| black_box(snowflake.next().unwrap()))
    });
    group.bench_function("uuid_v7", |b| b.iter(|| black_box(shardkit::uuid_v7())));
    group.bench_function("uuid_now_v7", |b| {
        b.iter(|| black_box(uuid::Uuid::now_v7()))
    });
    group.finish();
}

criterion_group!(benches, segment, flickr, generators);
criterion_main!(benches);
