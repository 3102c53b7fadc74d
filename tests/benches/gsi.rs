//! Global secondary index costs, side by side in one run, on SQLite and
//! PostgreSQL (4 shards each):
//!
//! - `gsi/<backend>/insert_plain` vs `insert_with_gsi`: one row in its own
//!   shard transaction, without and with one unique global index.
//! - `gsi/<backend>/insert_plain_plus_autocommit`: the plain insert plus one
//!   autocommitted row on another shard — the two durable commits index-first
//!   needs, without any index logic: the floor for `insert_with_gsi`.
//! - `gsi/<backend>/keyed_read` vs `by_index`: the same row read by its shard
//!   key, and by its indexed email.
//!
//! - `gsi/<backend>/paired`: the inserts and the reads again, interleaved
//!   round by round, medians and ratios printed (see
//!   `shardkit_tests::interleaved`).
//!
//! `cargo bench -p shardkit-tests --bench gsi` (PostgreSQL skips with a
//! printed line when unreachable).

use criterion::{Criterion, criterion_group, criterion_main};
use sea_orm::{ConnectionTrait, EntityTrait, Set};
use shardkit::EntityGroup;
use shardkit_tests::{Backend, TestDbs, interleaved};
use std::hint::black_box;
use std::sync::atomic::{AtomicI64, Ordering};

#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Owner;

pub mod indexed {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "accounts_indexed")]
    #[shardkit(group = crate::Owner)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        #[shardkit(global_index(unique))]
        pub email: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod plain {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "accounts_plain")]
    #[shardkit(group = crate::Owner)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        pub email: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

fn gsi(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for (backend, label) in [(Backend::Sqlite, "sqlite"), (Backend::Postgres, "postgres")] {
        let Some((dbs, cluster)) = rt.block_on(async {
            let dbs =
                TestDbs::create_if_reachable(backend, &format!("bench::gsi_{label}"), 4).await?;
            let cluster = dbs.cluster(4, "[groups.Owner]\n").await;
            cluster
                .migrate::<shardkit_migration::Migrator>()
                .await
                .unwrap();
            for name in cluster
                .topology()
                .shard_names()
                .map(str::to_owned)
                .collect::<Vec<_>>()
            {
                let db = cluster.connection(&name).unwrap();
                let schema = sea_orm::Schema::new(db.get_database_backend());
                db.execute(&schema.create_table_from_entity(indexed::Entity))
                    .await
                    .unwrap();
                db.execute(&schema.create_table_from_entity(plain::Entity))
                    .await
                    .unwrap();
            }
            cluster.gsi().create::<indexed::Entity>().await.unwrap();
            cluster
                .gsi()
                .backfill::<indexed::Entity>(indexed::Column::Email)
                .await
                .unwrap();
            Some((dbs, cluster))
        }) else {
            println!("gsi/{label} skipped: server unreachable");
            continue;
        };
        let next = AtomicI64::new(1);
        let mut group = c.benchmark_group(format!("gsi/{label}"));
        group.sample_size(40);
        group.bench_function("insert_plain", |b| {
            b.to_async(&rt)
                .iter(|| insert_plain(&cluster, next.fetch_add(1, Ordering::Relaxed)))
        });
        // The floor index-first cannot go below: the same insert plus one
        // autocommitted row on another shard (two durable commits).
        group.bench_function("insert_plain_plus_autocommit", |b| {
            b.to_async(&rt).iter(|| {
                insert_plain_plus_autocommit(&cluster, next.fetch_add(1, Ordering::Relaxed))
            })
        });
        group.bench_function("insert_with_gsi", |b| {
            b.to_async(&rt)
                .iter(|| insert_with_gsi(&cluster, next.fetch_add(1, Ordering::Relaxed)))
        });
        // A row to read back, by key and by index.
        let probe = rt.block_on(async {
            let id = next.fetch_add(1, Ordering::Relaxed);
            let tx = cluster.begin::<Owner>(id).await.unwrap();
            tx.insert(indexed::ActiveModel {
                id: Set(id),
                email: Set("probe@x".into()),
            })
            .await
            .unwrap();
            tx.commit().await.unwrap();
            id
        });
        group.bench_function("keyed_read", |b| {
            b.to_async(&rt).iter(|| async {
                let row = cluster
                    .find::<indexed::Entity>()
                    .key(probe)
                    .one()
                    .await
                    .unwrap();
                black_box(row.unwrap());
            })
        });
        group.bench_function("by_index", |b| {
            b.to_async(&rt).iter(|| async {
                let row = cluster
                    .find::<indexed::Entity>()
                    .by_index(indexed::Column::Email, "probe@x")
                    .one()
                    .await
                    .unwrap();
                black_box(row.unwrap());
            })
        });
        group.finish();
        rt.block_on(paired(&cluster, &next, probe, label));
        drop(cluster);
        rt.block_on(dbs.cleanup());
    }
}

async fn insert_plain(cluster: &shardkit::Cluster, id: i64) {
    let tx = cluster.begin::<Owner>(id).await.unwrap();
    tx.insert(plain::ActiveModel {
        id: Set(id),
        email: Set(format!("u{id}@x")),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

async fn insert_plain_plus_autocommit(cluster: &shardkit::Cluster, id: i64) {
    let tx = cluster.begin::<Owner>(id).await.unwrap();
    let own = tx.target().shard.index();
    tx.insert(plain::ActiveModel {
        id: Set(id),
        email: Set(format!("u{id}@x")),
    })
    .await
    .unwrap();
    let other = cluster.topology().shards()[(own + 1) % 4].name.clone();
    plain::Entity::insert(plain::ActiveModel {
        id: Set(-id),
        email: Set(format!("f{id}@x")),
    })
    .exec(cluster.connection(&other).unwrap())
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

async fn insert_with_gsi(cluster: &shardkit::Cluster, id: i64) {
    let tx = cluster.begin::<Owner>(id).await.unwrap();
    tx.insert(indexed::ActiveModel {
        id: Set(id),
        email: Set(format!("u{id}@x")),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// `gsi/<backend>/paired`: the benchmark's pairs again, interleaved.
async fn paired(cluster: &shardkit::Cluster, next: &AtomicI64, probe: i64, label: &str) {
    let inserts = interleaved(300, 3, |kind| {
        let id = next.fetch_add(1, Ordering::Relaxed);
        match kind {
            0 => Box::pin(insert_plain(cluster, id)),
            1 => Box::pin(insert_with_gsi(cluster, id)),
            _ => Box::pin(insert_plain_plus_autocommit(cluster, id)),
        }
    })
    .await;
    let reads = interleaved(1000, 2, |kind| {
        Box::pin(async move {
            let find = cluster.find::<indexed::Entity>();
            let row = match kind {
                0 => find.key(probe).one().await,
                _ => find.by_index(indexed::Column::Email, "probe@x").one().await,
            };
            black_box(row.unwrap().unwrap());
        })
    })
    .await;
    let ratio = |a: std::time::Duration, b: std::time::Duration| a.as_secs_f64() / b.as_secs_f64();
    println!(
        "gsi/{label}/paired (medians of interleaved runs): insert_plain {:.2?}, insert_with_gsi {:.2?} \
         = {:.2} ×, insert_plain_plus_autocommit {:.2?} = {:.2} × (300 rounds); keyed_read {:.2?}, \
         by_index {:.2?} = {:.2} × (1,000 rounds)",
        inserts[0],
        inserts[1],
        ratio(inserts[1], inserts[0]),
        inserts[2],
        ratio(inserts[2], inserts[0]),
        reads[0],
        reads[1],
        ratio(reads[1], reads[0]),
    );
}

criterion_group!(benches, gsi);
criterion_main!(benches);
