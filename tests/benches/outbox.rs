//! Cross-key transfers through the outbox on PostgreSQL (the default
//! server, `SHARDKIT_PG_URL`; skipped with a printed line when it is
//! unreachable), four shard databases.
//!
//! (a) Throughput: 8 tasks each make 150 transfers, interleaved round by
//!     round (medians): a single-key transfer (two wallets of one holder,
//!     debited and credited in one transaction) against a cross-key one
//!     (debit and send in the sender's transaction, then the relay's
//!     delivery: the credit with its inbox row in the receiver's
//!     transaction and the message deleted in the sender's), counted until
//!     every credit is applied. One relay runs throughout.
//! (b) Delivery lag at about 500 transfers/s for 8 s with one relay: from
//!     the send to the handler's start, p50/p99; and where a delivery's
//!     time goes (the relay's pass: the outbox read, the receiver's
//!     transaction, the sender's delete).
//!
//! `cargo bench -p shardkit-tests --bench outbox`

use sea_orm::{ActiveValue::Set, ConnectionTrait, QuerySelect};
use shardkit::{Cluster, ClusterConfig, Message};
use shardkit_tests::interleaved;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

const DBS: [&str; 4] = ["sko_bench_0", "sko_bench_1", "sko_bench_2", "sko_bench_3"];
const HOLDERS: i64 = 400;
const TASKS: i64 = 8;
const PER_TASK: i64 = 150;

#[derive(shardkit::EntityGroup)]
#[shardkit(key = i64)]
pub struct Holder;

pub mod wallet {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "bench_wallets")]
    #[shardkit(group = super::Holder)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub holder: i64,
        pub balance: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

pub struct Migrator;

#[sea_orm_migration::async_trait::async_trait]
impl sea_orm_migration::MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn sea_orm_migration::MigrationTrait>> {
        let mut all = shardkit_migration::migrations();
        all.push(Box::new(shardkit_tests::models::CreateTable(
            "m20261126_000401_bench_wallets",
            wallet::Entity,
        )));
        all
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Credit {
    amount: i64,
    /// Milliseconds since the Unix epoch at the send.
    sent_ms: u64,
}

impl Message for Credit {
    const NAME: &'static str = "bench_credit";
    type From = Holder;
    type To = Holder;
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Adds `amount` to `holder`'s wallet `id`, read under its row lock.
async fn add(tx: &shardkit::ShardTx<Holder>, id: i64, amount: i64) -> shardkit::Result<()> {
    let w = tx
        .find::<wallet::Entity>()
        .filter_by_id(id)
        .lock_exclusive()
        .one()
        .await?
        .expect("wallet");
    tx.update(wallet::ActiveModel {
        id: Set(id),
        holder: Set(w.holder),
        balance: Set(w.balance + amount),
    })
    .await?;
    Ok(())
}

trait ById {
    fn filter_by_id(self, id: i64) -> Self;
}

impl<F: sea_orm::QueryFilter> ById for F {
    fn filter_by_id(self, id: i64) -> Self {
        self.filter(sea_orm::ColumnTrait::eq(&wallet::Column::Id, id))
    }
}

/// Holder `h`'s two wallets: `2h` and `2h + 1`.
fn wallets(h: i64) -> (i64, i64) {
    (2 * h, 2 * h + 1)
}

fn pair(task: i64, i: i64) -> (i64, i64) {
    let from = (task * 53 + i * 7) % HOLDERS + 1;
    let to = (from + 1 + (i * 31) % (HOLDERS - 1)) % HOLDERS + 1;
    (from, if to == from { to % HOLDERS + 1 } else { to })
}

async fn pending(cluster: &Cluster) -> u64 {
    let mut n = 0;
    for name in DBS.iter().enumerate().map(|(i, _)| format!("s{i}")) {
        let db = cluster.connection(&name).unwrap();
        let row = db
            .query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT COUNT(*) AS n FROM shardkit_outbox",
            ))
            .await
            .unwrap()
            .unwrap();
        n += row.try_get::<i64>("", "n").unwrap() as u64;
    }
    n
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let server = std::env::var("SHARDKIT_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned());
    let Ok(admin) = sea_orm::Database::connect(&server).await else {
        println!("outbox: no PostgreSQL at {server}: skipped");
        return;
    };
    let mut toml = String::from("[pool]\nmax_connections = 8\n");
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
            "[[shards]]\nname = \"s{i}\"\nurl = \"{server}/{db}\"\n"
        ));
    }
    toml.push_str("[groups.Holder]\nbuckets = 64\n");
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    for h in 1..=HOLDERS {
        let (a, b) = wallets(h);
        cluster
            .transaction::<Holder, _, _>(h, |tx| async move {
                for id in [a, b] {
                    tx.insert(wallet::ActiveModel {
                        id: Set(id),
                        holder: Set(h),
                        balance: Set(1_000_000),
                    })
                    .await?;
                }
                Ok(())
            })
            .await
            .unwrap();
    }
    let lags: Arc<Mutex<Vec<u64>>> = Arc::default();
    let applied = Arc::new(AtomicU64::new(0));
    let relay = {
        let (lags, applied) = (lags.clone(), applied.clone());
        cluster
            .outbox()
            .poll_every(Duration::from_millis(5))
            .handle::<Credit, _, _, _>(move |tx, c: Credit| {
                let (lags, applied) = (lags.clone(), applied.clone());
                async move {
                    lags.lock()
                        .unwrap()
                        .push(now_ms().saturating_sub(c.sent_ms));
                    let (to, _) = wallets(*tx.key());
                    add(&tx, to, c.amount).await?;
                    applied.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, shardkit::ShardError>(())
                }
            })
    };
    let running = relay.run();

    // (a) single-key against cross-key, interleaved.
    let job = |cross: bool| {
        let cluster = cluster.clone();
        Box::pin(async move {
            let tasks: Vec<_> = (0..TASKS)
                .map(|task| {
                    let cluster = cluster.clone();
                    tokio::spawn(async move {
                        for i in 0..PER_TASK {
                            let (from, to) = pair(task, i);
                            cluster
                                .transaction::<Holder, _, _>(from, |tx| async move {
                                    let (a, b) = wallets(from);
                                    add(&tx, a, -1).await?;
                                    if cross {
                                        tx.send(
                                            to,
                                            &Credit {
                                                amount: 1,
                                                sent_ms: now_ms(),
                                            },
                                        )
                                        .await?;
                                    } else {
                                        add(&tx, b, 1).await?;
                                    }
                                    Ok(())
                                })
                                .await
                                .unwrap();
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            // Counted until every credit is applied.
            while cross && pending(&cluster).await > 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }) as shardkit_tests::Job<'static>
    };
    let medians = interleaved(5, 2, |kind| job(kind == 1)).await;
    let n = (TASKS * PER_TASK) as f64;
    let rate = |d: Duration| n / d.as_secs_f64();
    println!(
        "outbox/throughput: single-key {:.0} transfers/s, cross-key {:.0} transfers/s (applied), cost {:.2}x",
        rate(medians[0]),
        rate(medians[1]),
        medians[1].as_secs_f64() / medians[0].as_secs_f64()
    );

    // (b) about 500 transfers/s for 8 s, one relay.
    lags.lock().unwrap().clear();
    let started = Instant::now();
    let senders: Vec<_> = (0..TASKS)
        .map(|task| {
            let cluster = cluster.clone();
            tokio::spawn(async move {
                // 8 senders at 62.5/s each.
                let mut tick = tokio::time::interval(Duration::from_millis(16));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let mut sent = 0u64;
                let mut i = 0;
                while started.elapsed() < Duration::from_secs(8) {
                    tick.tick().await;
                    i += 1;
                    let (from, to) = pair(task + 100, i);
                    cluster
                        .transaction::<Holder, _, _>(from, |tx| async move {
                            let (a, _) = wallets(from);
                            add(&tx, a, -1).await?;
                            tx.send(
                                to,
                                &Credit {
                                    amount: 1,
                                    sent_ms: now_ms(),
                                },
                            )
                            .await?;
                            Ok(())
                        })
                        .await
                        .unwrap();
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    let mut sent = 0;
    for s in senders {
        sent += s.await.unwrap();
    }
    let send_secs = started.elapsed().as_secs_f64();
    while pending(&cluster).await > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut lag = lags.lock().unwrap().clone();
    lag.sort_unstable();
    let p = |q: f64| lag[((lag.len() as f64 - 1.0) * q) as usize];
    println!(
        "outbox/lag: {sent} transfers in {send_secs:.1} s ({:.0}/s), delivery lag p50 {} ms, p99 {} ms, max {} ms",
        sent as f64 / send_secs,
        p(0.5),
        p(0.99),
        lag.last().copied().unwrap_or_default()
    );

    // Where a delivery's time goes: one message, each part timed alone.
    running.stop();
    let from = 1;
    cluster
        .transaction::<Holder, _, _>(from, |tx| async move {
            tx.send(
                2,
                &Credit {
                    amount: 1,
                    sent_ms: now_ms(),
                },
            )
            .await?;
            Ok(())
        })
        .await
        .unwrap();
    let t = Instant::now();
    let report = relay.deliver().await.unwrap();
    let whole = t.elapsed();
    let t = Instant::now();
    let _ = relay.deliver().await.unwrap();
    let empty = t.elapsed();
    println!(
        "outbox/parts: a pass that applies one message {:.1} ms ({} applied); an empty pass (4 outbox reads) {:.1} ms",
        whole.as_secs_f64() * 1e3,
        report.applied,
        empty.as_secs_f64() * 1e3
    );
    for db in DBS {
        let _ = admin
            .execute_unprepared(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await;
    }
}
