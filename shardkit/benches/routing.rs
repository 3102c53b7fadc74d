//! Routing cost.
//!
//! (a) `resolve`: key → bucket → shard alone (hash placement, 1024 buckets, 4 shards).
//! (b) `point_read`: a keyed point read through shardkit against the same read with
//!     plain SeaORM on the same SQLite in-memory database.
//!
//! `cargo bench -p shardkit --bench routing`

use criterion::{Criterion, criterion_group, criterion_main};
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter};
use shardkit::topology::Located;
use shardkit::{Cluster, ClusterConfig, EntityGroup, Topology};
use std::hint::black_box;

#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Customer;

pub mod order {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "orders")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub total_cents: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

const CONFIG: &str = r#"
[pool]
max_connections = 1            # one in-memory SQLite database per shard
test_before_acquire = false
[[shards]]
name = "s0"
url = "sqlite::memory:"
[[shards]]
name = "s1"
url = "sqlite::memory:"
[[shards]]
name = "s2"
url = "sqlite::memory:"
[[shards]]
name = "s3"
url = "sqlite::memory:"
[groups.Customer]
buckets = 1024
"#;

fn resolve(c: &mut Criterion) {
    let topology = Topology::build(&ClusterConfig::from_toml(CONFIG).unwrap()).unwrap();
    let mut key: i64 = 0x0005_DEEC_E66D;
    c.bench_function("routing/resolve", |b| {
        b.iter(|| {
            key = key
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            match topology.locate(Customer::NAME, black_box(&key)) {
                Ok(Located::Target(t)) => t.shard,
                other => panic!("{other:?}"),
            }
        })
    });
}

fn point_read(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cluster: Cluster = rt.block_on(async {
        let cluster = Cluster::connect(ClusterConfig::from_toml(CONFIG).unwrap())
            .await
            .unwrap();
        for shard in ["s0", "s1", "s2", "s3"] {
            let db = cluster.connection(shard).unwrap();
            let schema = sea_orm::Schema::new(db.get_database_backend());
            db.execute(&schema.create_table_from_entity(order::Entity))
                .await
                .unwrap();
        }
        for customer in 0..1000_i64 {
            let tx = cluster.begin::<Customer>(customer).await.unwrap();
            tx.insert(order::ActiveModel {
                id: sea_orm::Set(customer),
                customer_id: sea_orm::Set(customer),
                total_cents: sea_orm::Set(customer * 10),
            })
            .await
            .unwrap();
            tx.commit().await.unwrap();
        }
        cluster
    });
    let key = 42_i64;
    let shard = rt
        .block_on(cluster.shard_of::<Customer>(&key))
        .unwrap()
        .to_owned();
    let db = cluster.connection(&shard).unwrap().clone();

    // Both reads run in every iteration, in alternating order, and each
    // benchmark times only its own: the two see the same machine state (thread
    // wake-ups on a small VM dominate a SQLite round trip and drift over time).
    let plain = || async {
        let row = order::Entity::find()
            .filter(order::Column::CustomerId.eq(black_box(key)))
            .one(&db)
            .await
            .unwrap();
        assert!(row.is_some());
    };
    let sharded = || async {
        let row = cluster
            .find::<order::Entity>()
            .key(black_box(key))
            .one()
            .await
            .unwrap();
        assert!(row.is_some());
    };
    let mut group = c.benchmark_group("routing/point_read");
    group.sample_size(200);
    group.bench_function("sea_orm", |b| {
        b.to_async(&rt).iter_custom(|iters| async move {
            let mut timed = std::time::Duration::ZERO;
            for i in 0..iters {
                if i % 2 == 0 {
                    sharded().await;
                }
                let start = std::time::Instant::now();
                plain().await;
                timed += start.elapsed();
                if i % 2 == 1 {
                    sharded().await;
                }
            }
            timed
        })
    });
    group.bench_function("shardkit", |b| {
        b.to_async(&rt).iter_custom(|iters| async move {
            let mut timed = std::time::Duration::ZERO;
            for i in 0..iters {
                if i % 2 == 0 {
                    plain().await;
                }
                let start = std::time::Instant::now();
                sharded().await;
                timed += start.elapsed();
                if i % 2 == 1 {
                    plain().await;
                }
            }
            timed
        })
    });
    group.finish();
}

criterion_group!(benches, resolve, point_read);
criterion_main!(benches);
