//! Id generation.
//!
//! - `ids/segment/{sqlite,mariadb}`: `Sequence::next()` from memory (block
//!   100,000, background prefetch), one thread. Also prints the p99 of single
//!   calls timed one by one (that timing includes `Instant::now()` itself).
//! - `ids/flickr/*`: B = 1 (one ticket per id) against a hand-written
//!   `REPLACE INTO ...; SELECT LAST_INSERT_ID()` loop on the same MariaDB.
//! - `ids/flickr_concurrent/{postgres,mariadb}`: B = 1 drawn by 8 tasks at
//!   once on one ticket server with a pool of 8, against a plain loop of the
//!   same upsert (`INSERT ... ON CONFLICT ... RETURNING` / `REPLACE INTO`)
//!   by 8 tasks on a pool of 8 of its own; the two run interleaved round by
//!   round and the medians and their ratio are printed.
//! - `ids/snowflake`, `ids/uuid_v7` vs `ids/uuid_now_v7`.
//!
//! `cargo bench -p shardkit-tests --bench ids` (MariaDB cases skip with a
//! printed line when the server is unreachable).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sea_orm::{ConnectionTrait, Database, Statement};
use shardkit::{Cluster, ClusterConfig};
use shardkit_tests::models::Migrator;
use shardkit_tests::{Backend, TestDbs, interleaved};
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
    let ids = cluster.ids();
    group.bench_function("shardkit_block_1", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ids.next("flickr").await.unwrap()) })
    });
    group.finish();
    drop(hand);
    drop(cluster);
    rt.block_on(dbs.cleanup());
}

/// Callers and pool size of `ids/flickr_concurrent`.
const CALLERS: usize = 8;
/// Ids (or upserts) per caller per round.
const PER_CALLER: usize = 50;
const ROUNDS: usize = 40;

/// `ids/flickr_concurrent/<backend>`: concurrent B = 1 callers against the
/// same number of tasks running the bare upsert, interleaved.
fn flickr_concurrent(_: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for (backend, label) in [(Backend::Postgres, "postgres"), (Backend::MySql, "mariadb")] {
        rt.block_on(async {
            let name = format!("bench::ids_flickr_concurrent_{label}");
            let Some(mut dbs) = TestDbs::create_if_reachable(backend, &name, 1).await else {
                println!("ids/flickr_concurrent/{label} skipped: server unreachable");
                return;
            };
            let url = dbs.extra("tickets").await;
            let toml = format!(
                "{}\n[ids]\nservers = [{{ name = \"t\", url = \"{url}\" }}]\n\
                 [ids.sequences.flickr]\nblock = 1\n",
                // The harness's small pools, at the callers' count.
                dbs.shards_toml(1)
                    .replace("max_connections = 4", &format!("max_connections = {CALLERS}"))
            );
            let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
                .await
                .unwrap();
            cluster.migrate::<Migrator>().await.unwrap();
            cluster.ids().create_sequence("flickr").await.unwrap();
            // The plain loop: a pool of the same size on the same table,
            // one statement per id, the ticket read from its answer.
            let mut opts = sea_orm::ConnectOptions::new(url);
            opts.max_connections(CALLERS as u32);
            let plain = Database::connect(opts).await.unwrap();
            let upsert = match backend {
                Backend::MySql => "REPLACE INTO tickets_flickr (stub) VALUES ('a')",
                _ => {
                    "INSERT INTO tickets_flickr (stub, id) VALUES ('a', 1) ON CONFLICT (stub) \
                     DO UPDATE SET id = tickets_flickr.id + 1 RETURNING id"
                }
            };
            let draw_plain = |plain: sea_orm::DatabaseConnection| async move {
                for _ in 0..PER_CALLER {
                    let id = if backend == Backend::MySql {
                        // Concurrent REPLACEs of one stub deadlock now and
                        // then; run the statement again, as shardkit does.
                        loop {
                            match plain.execute_unprepared(upsert).await {
                                Ok(done) => break done.last_insert_id(),
                                Err(err) if err.to_string().contains("1213") => continue,
                                Err(err) => panic!("{err}"),
                            }
                        }
                    } else {
                        let row = plain
                            .query_one_raw(Statement::from_string(plain.get_database_backend(), upsert))
                            .await
                            .unwrap()
                            .unwrap();
                        row.try_get::<i64>("", "id").unwrap() as u64
                    };
                    black_box(id);
                }
            };
            let medians = interleaved(ROUNDS, 2, |kind| {
                let cluster = cluster.clone();
                let plain = plain.clone();
                Box::pin(async move {
                    let mut tasks = tokio::task::JoinSet::new();
                    for _ in 0..CALLERS {
                        if kind == 0 {
                            let ids = cluster.ids();
                            tasks.spawn(async move {
                                for _ in 0..PER_CALLER {
                                    black_box(ids.next("flickr").await.unwrap());
                                }
                            });
                        } else {
                            tasks.spawn(draw_plain(plain.clone()));
                        }
                    }
                    tasks.join_all().await;
                })
            })
            .await;
            let per_round = (CALLERS * PER_CALLER) as f64;
            let rate = |d: Duration| per_round / d.as_secs_f64();
            println!(
                "ids/flickr_concurrent/{label} ({CALLERS} tasks x {PER_CALLER}, pool {CALLERS}, medians of \
                 {ROUNDS} interleaved rounds): shardkit_block_1 {:.2?} = {:.0} ids/s, plain_upsert {:.2?} \
                 = {:.0} upserts/s: {:.2} x",
                medians[0],
                rate(medians[0]),
                medians[1],
                rate(medians[1]),
                rate(medians[0]) / rate(medians[1]),
            );
            drop(plain);
            drop(cluster);
            dbs.cleanup().await;
        });
    }
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

criterion_group!(benches, segment, flickr, flickr_concurrent, generators);
criterion_main!(benches);
