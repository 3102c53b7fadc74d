//! Read replicas on the PostgreSQL servers of `scripts/replicas.sh start`
//! (primary 127.0.0.1:5442, streaming replicas 5443 and 5444; skipped with
//! a printed line when they are unreachable).
//!
//! (a) reads/s of keyed reads with `Consistency::Replica` over the two
//!     replicas, as a ratio to primary-only reads, interleaved round by
//!     round (medians); and each replica's share of the replica reads (on
//!     this 2-core machine the three servers share the cores, so the
//!     replicas add no capacity here). Plain SeaORM reads of the same rows
//!     on the primary and on the replicas, in the same rounds, show how
//!     much of the ratio is the servers' (a hot standby answers a read
//!     slower than its primary) and how much is shardkit's.
//! (b) with the replicas applying changes 300 ms late: 8 writers each commit
//!     with a session and read back with `Consistency::AtLeast`; the p50/p99
//!     of the read-back (the token wait, or the wait and the fallback) and
//!     the share of reads the primary answered.
//!
//! `cargo bench -p shardkit-tests --bench replicas`

use sea_orm::{ActiveValue::Set, ConnectionTrait};
use shardkit::{Cluster, ClusterConfig, Consistency, Session};
use shardkit_tests::interleaved;
use shardkit_tests::models::{Customer, Migrator, order};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PRIMARY: &str = "postgres://postgres@127.0.0.1:5442";
const REPLICA: &str = "postgres://postgres@127.0.0.1:5443";
const REPLICA2: &str = "postgres://postgres@127.0.0.1:5444";
const DBS: [&str; 2] = ["skr_bench_0", "skr_bench_1"];
const READS: i64 = 400;

async fn apply_delay(ms: u64) {
    for replica in [REPLICA, REPLICA2] {
        let db = sea_orm::Database::connect(replica).await.unwrap();
        db.execute_unprepared(&format!(
            "ALTER SYSTEM SET recovery_min_apply_delay = '{ms}ms'"
        ))
        .await
        .unwrap();
        db.execute_unprepared("SELECT pg_reload_conf()")
            .await
            .unwrap();
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Ok(admin) = sea_orm::Database::connect(PRIMARY).await else {
        println!(
            "replicas: no PostgreSQL primary at {PRIMARY}: skipped (scripts/replicas.sh start)"
        );
        return;
    };
    for replica in [REPLICA, REPLICA2] {
        if sea_orm::Database::connect(replica).await.is_err() {
            println!("replicas: no replica at {replica}: skipped (scripts/replicas.sh start)");
            return;
        }
    }
    let mut toml = String::from("[pool]\nmax_connections = 8\n[read]\nreplica_wait_ms = 1000\n");
    for (i, db) in DBS.iter().enumerate() {
        admin
            .execute_unprepared(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await
            .unwrap();
        admin
            .execute_unprepared(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
        toml.push_str(&format!(
            "[[shards]]\nname = \"s{i}\"\nurl = \"{PRIMARY}/{db}\"\nreplicas = [\n  {{ name = \"s{i}ra\", url = \"{REPLICA}/{db}\" }},\n  {{ name = \"s{i}rb\", url = \"{REPLICA2}/{db}\" }},\n]\n"
        ));
    }
    toml.push_str("[groups.Customer]\n");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let per_replica: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let seen = Arc::clone(&per_replica);
    let cluster = Cluster::builder(ClusterConfig::from_toml(&toml).unwrap())
        .on_statement(move |e| {
            if e.shard.contains('r') && e.statement.sql.contains("orders") {
                *seen.lock().unwrap().entry(e.shard.to_owned()).or_default() += 1;
            }
        })
        .connect()
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    for id in 1..=READS {
        let tx = cluster.begin::<Customer>(id).await.unwrap();
        tx.insert(order::ActiveModel {
            id: Set(id),
            customer_id: Set(id),
            total_cents: Set(id),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    // (a) primary-only against any replica, interleaved.
    let reads = |consistency: Consistency| {
        let cluster = cluster.clone();
        Box::pin(async move {
            for id in 1..=READS {
                cluster
                    .find::<order::Entity>()
                    .key(id)
                    .consistency(consistency.clone())
                    .one()
                    .await
                    .unwrap()
                    .unwrap();
            }
        }) as shardkit_tests::Job<'static>
    };
    // Plain SeaORM: the same statement on the shard databases, or on
    // their replicas (the two replicas in turn).
    let plain = |urls: Vec<String>| async move {
        let mut dbs = Vec::new();
        for url in urls {
            let mut options = sea_orm::ConnectOptions::new(url);
            options.max_connections(8).sqlx_logging(false);
            dbs.push(sea_orm::Database::connect(options).await.unwrap());
        }
        Arc::new(dbs)
    };
    let plain_primary = plain(DBS.iter().map(|db| format!("{PRIMARY}/{db}")).collect()).await;
    let plain_replicas = plain(
        [REPLICA, REPLICA2]
            .iter()
            .flat_map(|r| DBS.iter().map(move |db| format!("{r}/{db}")))
            .collect(),
    )
    .await;
    let plain_reads = |dbs: Arc<Vec<sea_orm::DatabaseConnection>>| {
        Box::pin(async move {
            use sea_orm::{ColumnTrait, EntityTrait, QueryFilter};
            for id in 1..=READS {
                let db = &dbs[id as usize % dbs.len()];
                order::Entity::find()
                    .filter(order::Column::CustomerId.eq(id))
                    .one(db)
                    .await
                    .unwrap();
            }
        }) as shardkit_tests::Job<'static>
    };
    let medians = interleaved(9, 4, |kind| match kind {
        0 => reads(Consistency::Primary),
        1 => reads(Consistency::Replica { max_lag: None }),
        2 => plain_reads(Arc::clone(&plain_primary)),
        _ => plain_reads(Arc::clone(&plain_replicas)),
    })
    .await;
    let rate = |d: Duration| READS as f64 / d.as_secs_f64();
    let ratio = |a: usize, b: usize| medians[b].as_secs_f64() / medians[a].as_secs_f64();
    println!(
        "replicas/spread: shardkit primary {:.0} reads/s, replica {:.0} reads/s, ratio {:.3}",
        rate(medians[0]),
        rate(medians[1]),
        ratio(1, 0)
    );
    println!(
        "replicas/spread: plain SeaORM primary {:.0} reads/s, replicas {:.0} reads/s, ratio {:.3}",
        rate(medians[2]),
        rate(medians[3]),
        ratio(3, 2)
    );
    println!(
        "replicas/spread: shardkit ÷ plain SeaORM, on the primary {:.3}, on the replicas {:.3}",
        ratio(0, 2),
        ratio(1, 3)
    );
    let shares = per_replica.lock().unwrap().clone();
    let total: u64 = shares.values().sum();
    let mut names: Vec<_> = shares.keys().cloned().collect();
    names.sort();
    for name in names {
        println!(
            "replicas/spread: {name} served {:.1}% of replica reads",
            100.0 * shares[&name] as f64 / total as f64
        );
    }

    // (b) read-your-writes on a replica 300 ms behind.
    apply_delay(300).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before: u64 = per_replica.lock().unwrap().values().sum();
    let tasks = (0..8i64).map(|task| {
        let cluster = cluster.clone();
        tokio::spawn(async move {
            let session = Session::new();
            let mut waits = Vec::new();
            for round in 0..15 {
                let id = 1 + task * 50 + round;
                let tx = cluster.begin::<Customer>(id).await.unwrap();
                tx.update(order::ActiveModel {
                    id: Set(id),
                    customer_id: Set(id),
                    total_cents: Set(-round),
                })
                .await
                .unwrap();
                tx.commit_in(&session).await.unwrap();
                let started = Instant::now();
                let row = cluster
                    .find::<order::Entity>()
                    .key(id)
                    .consistency(Consistency::at_least(&session))
                    .one()
                    .await
                    .unwrap()
                    .unwrap();
                waits.push(started.elapsed());
                assert_eq!(row.total_cents, -round, "a stale read with the session");
            }
            waits
        })
    });
    let mut waits: Vec<Duration> = Vec::new();
    for task in futures::future::join_all(tasks).await {
        waits.extend(task.unwrap());
    }
    apply_delay(0).await;
    let on_replica: u64 = per_replica.lock().unwrap().values().sum::<u64>() - before;
    waits.sort();
    let pct = |p: f64| waits[((waits.len() as f64 * p) as usize).min(waits.len() - 1)];
    println!(
        "replicas/read_your_writes (300 ms apply delay): {} reads, p50 {:?}, p99 {:?}, answered by the primary {:.1}%",
        waits.len(),
        pct(0.5),
        pct(0.99),
        100.0 * (waits.len() as u64).saturating_sub(on_replica) as f64 / waits.len() as f64
    );
    drop(cluster);
    for db in DBS {
        let _ = admin
            .execute_unprepared(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await;
    }
}
