//! Rollout costs on SQLite and PostgreSQL (4 shards each), side by side in
//! one run:
//!
//! - `rollout/<backend>/single_write` vs `dual_write`: one old-model insert in
//!   its own shard transaction, on a cluster without the rollout and on one
//!   in `dual_write` (old and new rows in the same transaction).
//! - `rollout/<backend>/db_read` vs `cache_hit`: the new model of one row read
//!   by key and primary key from its shard, and served from the rollout's
//!   new-model cache.
//! - `rollout/<backend>/verify_100k`: the verifier over 100,000 rows (old
//!   converted vs new), reported in rows/s.
//!
//! `cargo bench -p shardkit-tests --bench rollout` (PostgreSQL skips with a
//! printed line when unreachable).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sea_orm::{ColumnTrait, EntityTrait, IntoActiveModel, QueryFilter};
use shardkit::{Cluster, Phase, Rollout, VerifyOptions};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, TestDbs};
use std::hint::black_box;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

const VERIFY_ROWS: i64 = 100_000;

fn person(id: i64) -> person_v1::Model {
    person_v1::Model {
        id,
        customer_id: id % 64,
        first_name: "P".into(),
        last_name: format!("N{id}"),
        city: "Oslo".into(),
    }
}

/// Loads rows 1..=VERIFY_ROWS into both tables, each on its key's shard.
async fn load(cluster: &Cluster) {
    let mut per_shard: std::collections::HashMap<String, Vec<person_v1::Model>> =
        Default::default();
    for id in 1..=VERIFY_ROWS {
        let p = person(id);
        let shard = cluster.shard_of::<Customer>(&p.customer_id).await.unwrap();
        per_shard.entry(shard.to_owned()).or_default().push(p);
    }
    for (shard, rows) in per_shard {
        let db = cluster.connection(&shard).unwrap();
        for chunk in rows.chunks(1_000) {
            person_v1::Entity::insert_many(chunk.iter().map(|p| p.clone().into_active_model()))
                .exec_without_returning(db)
                .await
                .unwrap();
            person_v2::Entity::insert_many(
                chunk.iter().map(|p| person_to_v2(p).into_active_model()),
            )
            .exec_without_returning(db)
            .await
            .unwrap();
        }
    }
}

async fn insert(cluster: &Cluster, id: i64) {
    let p = person(id);
    let tx = cluster.begin::<Customer>(p.customer_id).await.unwrap();
    tx.insert(p.into_active_model()).await.unwrap();
    tx.commit().await.unwrap();
}

fn rollout(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for (backend, label) in [(Backend::Sqlite, "sqlite"), (Backend::Postgres, "postgres")] {
        let Some((dbs, plain, dual, people, cached_people)) = rt.block_on(async {
            let dbs = TestDbs::create_if_reachable(backend, &format!("bench::rollout_{label}"), 4)
                .await?;
            let plain = dbs.cluster(4, "[groups.Customer]\n").await;
            plain.migrate::<Migrator>().await.unwrap();
            load(&plain).await;
            let dual = dbs.cluster(4, "[groups.Customer]\n").await;
            let people = dual
                .register_rollout(
                    Rollout::<person_v1::Entity, person_v2::Entity>::new("people_v2", person_to_v2)
                        .to_old(person_to_v1)
                        .cache_ttl(Duration::from_millis(1))
                        .refresh_every(Duration::from_secs(1)),
                )
                .await
                .unwrap();
            for _ in 0..2 {
                loop {
                    match people.advance().await {
                        Ok(_) => break,
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
            }
            assert_eq!(people.phase(), Phase::DualWrite);
            // A third instance with a long cache TTL, for the cache read.
            let cached = dbs.cluster(4, "[groups.Customer]\n").await;
            let cached_people = cached
                .register_rollout(
                    Rollout::<person_v1::Entity, person_v2::Entity>::new("people_v2", person_to_v2)
                        .to_old(person_to_v1)
                        .cache_ttl(Duration::from_secs(600)),
                )
                .await
                .unwrap();
            assert_eq!(cached_people.phase(), Phase::DualWrite);
            Some((dbs, plain, dual, people, cached_people))
        }) else {
            println!("rollout/{label} skipped: server unreachable");
            continue;
        };
        let next = AtomicI64::new(VERIFY_ROWS + 1);
        let mut group = c.benchmark_group(format!("rollout/{label}"));
        // First, while both tables hold the same 100,000 rows (the single
        // writes below go to the old table only).
        group.sample_size(10);
        group.throughput(Throughput::Elements(VERIFY_ROWS as u64));
        group.bench_function("verify_100k", |b| {
            b.to_async(&rt).iter(|| async {
                let report = people.verify(VerifyOptions::default()).await.unwrap();
                assert!(report.is_consistent());
                black_box(report.rows);
            })
        });
        group.throughput(Throughput::Elements(1));
        group.sample_size(40);
        group.bench_function("single_write", |b| {
            b.to_async(&rt)
                .iter(|| insert(&plain, next.fetch_add(1, Ordering::Relaxed)))
        });
        group.bench_function("dual_write", |b| {
            b.to_async(&rt)
                .iter(|| insert(&dual, next.fetch_add(1, Ordering::Relaxed)))
        });
        let probe = person(7);
        group.bench_function("db_read", |b| {
            b.to_async(&rt).iter(|| async {
                let row = dual
                    .find::<person_v2::Entity>()
                    .key(probe.customer_id)
                    .filter(person_v2::Column::Id.eq(probe.id))
                    .one()
                    .await
                    .unwrap();
                black_box(row.unwrap());
            })
        });
        group.bench_function("cache_hit", |b| {
            rt.block_on(cached_people.get_new(probe.customer_id, probe.id))
                .unwrap()
                .unwrap();
            b.to_async(&rt).iter(|| async {
                black_box(
                    cached_people
                        .get_new(probe.customer_id, probe.id)
                        .await
                        .unwrap(),
                );
            })
        });
        group.finish();
        drop((plain, dual, people, cached_people));
        rt.block_on(dbs.cleanup());
    }
}

criterion_group!(benches, rollout);
criterion_main!(benches);
