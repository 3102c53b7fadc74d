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
//! - `rollout/<backend>/fold`: a write of a folded part — one `order_lines`
//!   row of an order with 10 lines updated, or a line inserted, each in its
//!   own shard transaction — on a cluster without the rollout and on one
//!   with `orders` + `order_lines` → `orders_v2` in `dual_write` (the order
//!   re-folded from its lines in the same transaction). Database-bound, so
//!   the two run interleaved round by round (`shardkit_tests::interleaved`)
//!   and the medians and their ratio are printed.
//!
//! `cargo bench -p shardkit-tests --bench rollout` (PostgreSQL skips with a
//! printed line when unreachable).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sea_orm::{ColumnTrait, EntityTrait, IntoActiveModel, QueryFilter};
use shardkit::{Cluster, Phase, Rollout, VerifyOptions};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, TestDbs, interleaved};
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
                        .refresh_interval(Duration::from_secs(1)),
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

/// Orders with lines each, folded.
const FOLD_ORDERS: i64 = 40;
const FOLD_LINES: i64 = 10;
const FOLD_ROUNDS: usize = 400;

fn line(order: i64, n: i64, cents: i64) -> order_line::Model {
    order_line::Model {
        id: order * 1_000 + n,
        customer_id: order % 16,
        order_id: order,
        sku: format!("sku-{n}"),
        cents,
    }
}

async fn update_line(cluster: &Cluster, order: i64, n: i64, cents: i64) {
    let tx = cluster.begin::<Customer>(order % 16).await.unwrap();
    tx.update(order_line::ActiveModel {
        id: sea_orm::ActiveValue::Unchanged(order * 1_000 + n),
        customer_id: sea_orm::ActiveValue::Unchanged(order % 16),
        cents: sea_orm::ActiveValue::Set(cents),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

async fn insert_line(cluster: &Cluster, row: order_line::Model) {
    let tx = cluster.begin::<Customer>(row.customer_id).await.unwrap();
    tx.insert(row.into_active_model()).await.unwrap();
    tx.commit().await.unwrap();
}

/// `rollout/<backend>/fold`: part writes with and without the fold,
/// interleaved.
fn fold(_: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for (backend, label) in [(Backend::Sqlite, "sqlite"), (Backend::Postgres, "postgres")] {
        rt.block_on(async {
            let Some(dbs) =
                TestDbs::create_if_reachable(backend, &format!("bench::fold_{label}"), 4).await
            else {
                println!("rollout/{label}/fold skipped: server unreachable");
                return;
            };
            let plain = dbs.cluster(4, "[groups.Customer]\n").await;
            plain.migrate::<Migrator>().await.unwrap();
            let folded = dbs.cluster(4, "[groups.Customer]\n").await;
            let orders = folded
                .register_rollout(
                    Rollout::<order::Entity, order_v2::Entity>::fold("orders_v2", order_fold)
                        .part::<order_line::Entity>(order_line::Column::OrderId)
                        .to_old(order_unfold)
                        .to_old_parts(order_parts)
                        .cache_ttl(Duration::from_millis(1))
                        .refresh_interval(Duration::from_secs(1)),
                )
                .await
                .unwrap();
            // The updates' orders (10 lines each), then the inserts' (none
            // yet; each gets 10).
            let insert_orders = 2 * FOLD_ROUNDS as i64 / FOLD_LINES;
            for order in 1..=FOLD_ORDERS + insert_orders {
                let tx = plain.begin::<Customer>(order % 16).await.unwrap();
                tx.insert(
                    order::Model {
                        id: order,
                        customer_id: order % 16,
                        total_cents: 0,
                    }
                    .into_active_model(),
                )
                .await
                .unwrap();
                if order <= FOLD_ORDERS {
                    for n in 0..FOLD_LINES {
                        tx.insert(line(order, n, 1).into_active_model()).await.unwrap();
                    }
                }
                tx.commit().await.unwrap();
            }
            for _ in 0..2 {
                loop {
                    match orders.advance().await {
                        Ok(_) => break,
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
            }
            // The backfill waits out the gap after dual_write began.
            tokio::time::sleep(orders.gap()).await;
            assert!(orders.backfill().await.unwrap().finished);
            assert_eq!(orders.phase(), Phase::DualWrite);
            let (edits, adds) = (AtomicI64::new(0), AtomicI64::new(0));
            let updates = interleaved(FOLD_ROUNDS, 2, |kind| {
                let cluster = if kind == 0 { &plain } else { &folded };
                // Both kinds edit every order's lines in turn.
                let round = edits.fetch_add(1, Ordering::Relaxed);
                let order = 1 + round % FOLD_ORDERS;
                Box::pin(update_line(cluster, order, round % FOLD_LINES, round))
            })
            .await;
            let inserts = interleaved(FOLD_ROUNDS, 2, |kind| {
                let cluster = if kind == 0 { &plain } else { &folded };
                // Lines of the orders that had none, ten each: the fold of
                // an insert reads 1 to 10 lines.
                let round = adds.fetch_add(1, Ordering::Relaxed);
                let order = FOLD_ORDERS + 1 + round / FOLD_LINES;
                Box::pin(insert_line(cluster, line(order, round % FOLD_LINES, 1)))
            })
            .await;
            for (what, medians) in [("update", &updates), ("insert", &inserts)] {
                println!(
                    "rollout/{label}/fold {what} of a line: without rollout {:?}, folded (10 lines) {:?}, ratio {:.2} x",
                    medians[0],
                    medians[1],
                    medians[1].as_secs_f64() / medians[0].as_secs_f64()
                );
            }
            let report = orders.verify(VerifyOptions::default()).await.unwrap();
            black_box(report.rows);
            drop((plain, folded, orders));
            dbs.cleanup().await;
        });
    }
}

criterion_group!(benches, rollout, fold);
criterion_main!(benches);
