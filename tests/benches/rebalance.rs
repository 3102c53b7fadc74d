//! Bucket moves on PostgreSQL (databases of one server as shards), in one
//! run:
//!
//! - `copy`: 1,000,000 rows of a three-column table (`orders`: id,
//!   customer_id, total_cents; indexed on customer_id, as a shard key is)
//!   moved from s0 to s1, every bucket of the group: the copy phase's rows
//!   per second, the whole move's time by phase, and the copy against the
//!   server's own copy of the same rows with its client tools (PostgreSQL:
//!   psql's `COPY` out and in; MariaDB too: `mariadb-dump`'s multi-row
//!   `INSERT`s loaded with `mariadb`).
//! - `writes`: 100,000 rows moved while a writer starts one single-row
//!   update transaction every millisecond (1,000 writes/s, up to 16 in
//!   flight) on keys of the moving buckets: each write's latency, the p99
//!   before the move and during the copy, and the longest write during the
//!   whole move (the cut-over's block included).
//!
//! - `fence`: what being movable costs a write: one single-row update
//!   transaction on a cluster whose group is `movable` (the fence's read of
//!   the bucket's state first) and on one whose group is not, over the same
//!   databases, interleaved round by round; medians and their ratio. On
//!   SQLite, PostgreSQL and MariaDB (each skipped when unreachable).
//!
//! `cargo bench -p shardkit-tests --bench rebalance` (skips with a printed
//! line when PostgreSQL is unreachable). Pass `--rows N` to change the copy
//! size.

use sea_orm::{ActiveValue::Set, ActiveValue::Unchanged, ConnectionTrait, Statement};
use shardkit::rebalance::{MovePhase, MoveProgress};
use shardkit::{Cluster, ClusterConfig, JobControl};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, TestDbs};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CUSTOMERS: i64 = 100_000;

fn config(dbs: &TestDbs) -> ClusterConfig {
    let toml = format!(
        "{}\n[groups.Customer]\nbuckets = 1024\nshards = [\"s0\"]\nmovable = true\n\n[rebalance]\nrefresh_ms = 200\ncleanup_grace_ms = 0\n{}",
        dbs.shards_toml(2)
            .replace("max_connections = 4", "max_connections = 16"),
        std::env::var("CHUNK")
            .map(|c| format!("chunk = {c}\n"))
            .unwrap_or_default(),
    );
    ClusterConfig::from_toml(&toml).unwrap()
}

/// A migrated cluster whose s0 holds `rows` orders (loaded in the database).
async fn loaded(dbs: &TestDbs, rows: i64) -> Cluster {
    let cluster = Cluster::connect(config(dbs)).await.unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.refresh_bucket_maps().await.unwrap();
    for shard in ["s0", "s1"] {
        let db = cluster.connection(shard).unwrap();
        db.execute_unprepared("CREATE INDEX IF NOT EXISTS orders_customer ON orders (customer_id)")
            .await
            .unwrap();
    }
    let db = cluster.connection("s0").unwrap();
    let series = match db.get_database_backend() {
        // MariaDB's SEQUENCE engine.
        sea_orm::DbBackend::MySql => format!("(SELECT seq AS g FROM seq_1_to_{rows}) s"),
        _ => format!("generate_series(1, {rows}) g"),
    };
    db.execute_raw(Statement::from_string(
        db.get_database_backend(),
        format!(
            "INSERT INTO orders (id, customer_id, total_cents) \
             SELECT g, g % {CUSTOMERS}, g % 5000 FROM {series}"
        ),
    ))
    .await
    .unwrap();
    let analyze = match db.get_database_backend() {
        sea_orm::DbBackend::MySql => "ANALYZE TABLE orders",
        _ => "ANALYZE orders",
    };
    db.execute_unprepared(analyze).await.unwrap();
    cluster
}

/// When each phase was first reported, and the copy's rows at the last
/// copying report.
#[derive(Default)]
struct Phases {
    first: BTreeMap<MovePhase, Instant>,
    copied: (u64, Option<Instant>),
}

async fn copy(backend: Backend, rows: i64) {
    // s0 and s1 are the cluster's shards; the third database takes the raw
    // copies it is compared with.
    let Some(dbs) = TestDbs::create_if_reachable(backend, "bench_rebalance_copy", 3).await else {
        return;
    };
    let name = format!("{backend:?}").to_lowercase();
    let cluster = loaded(&dbs, rows).await;
    let scratch = &dbs.names[2];
    let tools = Tools::of(backend);
    tools.run(&format!(
        "{} | {} >/dev/null",
        tools.schema(&dbs.names[0]),
        tools.client(scratch)
    ));
    // The server's own copy of the same rows before the move and after it,
    // into the same empty table each time; their mean is the comparison.
    let raw_before = tools.raw_copy(&dbs.names[0], scratch);
    tools.run(&format!(
        "{}{}'TRUNCATE orders'",
        tools.client(scratch),
        tools.command_flag()
    ));
    let phases = Arc::new(Mutex::new(Phases::default()));
    let seen = Arc::clone(&phases);
    let moves = cluster
        .rebalance::<Customer>()
        .unwrap()
        .entity::<order::Entity>()
        .control(JobControl::new().on_progress(move |p: &MoveProgress| {
            let mut s = seen.lock().unwrap();
            s.first.entry(p.phase).or_insert_with(Instant::now);
            if p.phase == MovePhase::Copying {
                s.copied = (p.rows_copied, Some(Instant::now()));
            }
        }));
    let plan = moves.plan_buckets(0..1024, "s1").await.unwrap();
    let started = moves.start(&plan).await.unwrap();
    let t0 = Instant::now();
    let done = moves.run(started.id).await.unwrap();
    let total = t0.elapsed();
    assert_eq!(done.phase, MovePhase::Done);
    assert_eq!(done.rows_copied, rows as u64);
    let s = std::mem::take(&mut *phases.lock().unwrap());
    let copy_start = s.first.get(&MovePhase::Copying).copied().unwrap_or(t0);
    let copy_time = s.copied.1.unwrap_or(copy_start) - copy_start;
    let rate = s.copied.0 as f64 / copy_time.as_secs_f64().max(1e-9);
    println!(
        "rebalance/{name}/copy: {rows} rows in {:.2} s = {rate:.0} rows/s (target >= 100,000)",
        copy_time.as_secs_f64(),
    );
    // s1 now holds every row.
    let raw_after = tools.raw_copy(&dbs.names[1], scratch);
    if let (Some(before), Some(after)) = (raw_before, raw_after) {
        let raw = (before + after) / 2;
        let raw_rate = rows as f64 / raw.as_secs_f64().max(1e-9);
        println!(
            "rebalance/{name}/copy: raw {} of the same rows {:.2} s before the move, {:.2} s after: {raw_rate:.0} rows/s; the move's copy is {:.2}x of it (goal >= 0.8x)",
            tools.raw_name(),
            before.as_secs_f64(),
            after.as_secs_f64(),
            rate / raw_rate
        );
    }
    let mut marks: Vec<(MovePhase, Instant)> = s.first.iter().map(|(p, t)| (*p, *t)).collect();
    marks.sort_by_key(|(_, t)| *t);
    let mut line = String::new();
    for pair in marks.windows(2) {
        line.push_str(&format!(
            "{} {:.2} s, ",
            pair[0].0,
            (pair[1].1 - pair[0].1).as_secs_f64()
        ));
    }
    println!(
        "rebalance/{name}/copy: whole move {:.2} s ({line}then cut-over and cleaning)",
        total.as_secs_f64()
    );
    drop(cluster);
    dbs.cleanup().await;
}

/// The server's own client tools, for the raw copy a move's copy is
/// compared with: psql's `COPY … TO STDOUT | COPY … FROM STDIN` on
/// PostgreSQL; a dump (multi-row `INSERT`s) loaded with the client on
/// MariaDB.
struct Tools {
    backend: Backend,
    /// The server URL (PostgreSQL) or the client's connection flags.
    server: String,
}

impl Tools {
    fn of(backend: Backend) -> Tools {
        let url = backend.server_url().unwrap_or_default();
        let server = match backend {
            Backend::MySql => {
                // mysql://user@host:port
                let rest = url.trim_start_matches("mysql://");
                let (user, address) = rest.split_once('@').unwrap_or(("root", rest));
                let (host, port) = address.split_once(':').unwrap_or((address, "3306"));
                format!("-h {host} -P {port} -u {user}")
            }
            _ => url,
        };
        Tools { backend, server }
    }

    fn raw_name(&self) -> &'static str {
        match self.backend {
            Backend::MySql => "mariadb-dump | mariadb (multi-row INSERTs)",
            _ => "COPY TO STDOUT | COPY FROM STDIN",
        }
    }

    /// The client on database `db`.
    fn client(&self, db: &str) -> String {
        match self.backend {
            Backend::MySql => format!("mariadb {} {db}", self.server),
            _ => format!("psql -q -v ON_ERROR_STOP=1 '{}/{db}'", self.server),
        }
    }

    /// How the client is given one statement.
    fn command_flag(&self) -> &'static str {
        match self.backend {
            Backend::MySql => " -e ",
            _ => " -c ",
        }
    }

    /// `orders`' definition on database `db`, as statements.
    fn schema(&self, db: &str) -> String {
        match self.backend {
            Backend::MySql => format!("mariadb-dump --no-data {} {db} orders", self.server),
            _ => format!("pg_dump --schema-only -t orders '{}/{db}'", self.server),
        }
    }

    /// `orders`' rows from database `from` into `to`; `None` (and a line
    /// saying why) when the tools fail.
    fn raw_copy(&self, from: &str, to: &str) -> Option<Duration> {
        let pipeline = match self.backend {
            Backend::MySql => format!(
                "mariadb-dump --no-create-info --single-transaction {} {from} orders | {}",
                self.server,
                self.client(to)
            ),
            _ => format!(
                "{} -c 'COPY orders TO STDOUT' | {} -c 'COPY orders FROM STDIN'",
                self.client(from),
                self.client(to)
            ),
        };
        let t = Instant::now();
        self.run(&pipeline).then(|| t.elapsed())
    }

    /// Runs a shell pipeline; `false` (and a line saying why) when it fails.
    fn run(&self, pipeline: &str) -> bool {
        match std::process::Command::new("sh")
            .arg("-c")
            .arg(pipeline)
            .status()
        {
            Ok(status) if status.success() => true,
            other => {
                println!("rebalance/copy: `{pipeline}` failed ({other:?})");
                false
            }
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

async fn writes() {
    let Some(dbs) =
        TestDbs::create_if_reachable(Backend::Postgres, "bench_rebalance_writes", 2).await
    else {
        return;
    };
    let rows = 100_000;
    let cluster = loaded(&dbs, rows).await;
    // Phase index while the move runs: 0 before it, then 1 + phase.
    let phase = Arc::new(AtomicU8::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let lat: Arc<Mutex<Vec<(u8, Duration)>>> = Arc::default();
    let writer = {
        let (cluster, phase, stop, lat) = (
            cluster.clone(),
            Arc::clone(&phase),
            Arc::clone(&stop),
            Arc::clone(&lat),
        );
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let in_flight = Arc::new(tokio::sync::Semaphore::new(16));
            let mut n = 0i64;
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                n += 1;
                let id = (n * 7_919) % rows + 1;
                let customer = id % CUSTOMERS;
                let (cluster, phase, lat) = (cluster.clone(), Arc::clone(&phase), Arc::clone(&lat));
                let permit = Arc::clone(&in_flight).acquire_owned().await.unwrap();
                tokio::spawn(async move {
                    let at = phase.load(Ordering::SeqCst);
                    let t = Instant::now();
                    let tx = cluster.begin::<Customer>(customer).await.unwrap();
                    tx.update(order::ActiveModel {
                        id: Unchanged(id),
                        customer_id: Unchanged(customer),
                        total_cents: Set(n % 5_000),
                    })
                    .await
                    .unwrap();
                    tx.commit().await.unwrap();
                    lat.lock().unwrap().push((at, t.elapsed()));
                    drop(permit);
                });
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let shown = Arc::clone(&phase);
    let moves =
        cluster
            .rebalance::<Customer>()
            .unwrap()
            .entity::<order::Entity>()
            .control(JobControl::new().on_progress(move |p: &MoveProgress| {
                shown.store(1 + p.phase as u8, Ordering::SeqCst)
            }));
    let plan = moves.plan_buckets(0..1024, "s1").await.unwrap();
    let started = moves.start(&plan).await.unwrap();
    phase.store(1, Ordering::SeqCst);
    let done = moves.run(started.id).await.unwrap();
    phase.store(100, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    writer.await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(done.phase, MovePhase::Done);
    let lat = std::mem::take(&mut *lat.lock().unwrap());
    let sorted = |f: &dyn Fn(u8) -> bool| {
        let mut v: Vec<Duration> = lat.iter().filter(|(p, _)| f(*p)).map(|(_, d)| *d).collect();
        v.sort();
        v
    };
    let before = sorted(&|p| p == 0);
    let copying = sorted(&|p| p == 1 + MovePhase::Copying as u8);
    let during = sorted(&|p| (1..100).contains(&p));
    let (b99, c99) = (percentile(&before, 0.99), percentile(&copying, 0.99));
    println!(
        "rebalance/postgres/writes: {} writes before the move, p99 {:.2} ms; {} during the copy, p99 {:.2} ms = {:.2} x (target <= 2 x)",
        before.len(),
        b99.as_secs_f64() * 1e3,
        copying.len(),
        c99.as_secs_f64() * 1e3,
        c99.as_secs_f64() / b99.as_secs_f64().max(1e-9)
    );
    println!(
        "rebalance/postgres/writes: {} writes during the whole move ({} rows), the longest {:.1} ms (target <= 250 ms), p99 {:.2} ms",
        during.len(),
        rows,
        during.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        percentile(&during, 0.99).as_secs_f64() * 1e3,
    );
    let mut by_phase: BTreeMap<u8, Duration> = BTreeMap::new();
    for (p, d) in &lat {
        let slot = by_phase.entry(*p).or_default();
        *slot = (*slot).max(*d);
    }
    println!(
        "rebalance/postgres/writes: longest by the phase a write began in: {}",
        by_phase
            .iter()
            .map(|(p, d)| {
                let name = match p {
                    0 => "before".to_owned(),
                    100 => "after".to_owned(),
                    p => [
                        "registered",
                        "copying",
                        "catching_up",
                        "verified",
                        "cutting_over",
                        "cleaning",
                        "done",
                        "aborted",
                    ][(*p - 1) as usize]
                        .to_owned(),
                };
                format!("{name} {:.1} ms", d.as_secs_f64() * 1e3)
            })
            .collect::<Vec<_>>()
            .join(", ")
    );
    drop(cluster);
    dbs.cleanup().await;
}

async fn fence() {
    for backend in [Backend::Sqlite, Backend::Postgres, Backend::MySql] {
        let Some(dbs) = TestDbs::create_if_reachable(backend, "bench_rebalance_fence", 2).await
        else {
            continue;
        };
        let movable = loaded_small(&dbs, true).await;
        let fixed = loaded_small(&dbs, false).await;
        let n = std::sync::atomic::AtomicI64::new(0);
        let medians = shardkit_tests::interleaved(2_000, 2, |kind| {
            let cluster = if kind == 0 { &fixed } else { &movable };
            let i = n.fetch_add(1, Ordering::Relaxed);
            let id = i % 1_000 + 1;
            Box::pin(async move {
                let tx = cluster.begin::<Customer>(id % 100).await.unwrap();
                tx.update(order::ActiveModel {
                    id: Unchanged(id),
                    customer_id: Unchanged(id % 100),
                    total_cents: Set(i),
                })
                .await
                .unwrap();
                tx.commit().await.unwrap();
            })
        })
        .await;
        println!(
            "rebalance/{backend:?}/fence: update transaction {:.3} ms, movable {:.3} ms = {:.2} x",
            medians[0].as_secs_f64() * 1e3,
            medians[1].as_secs_f64() * 1e3,
            medians[1].as_secs_f64() / medians[0].as_secs_f64()
        );
        drop((movable, fixed));
        dbs.cleanup().await;
    }
}

/// 1,000 orders of customers 0..100, on a cluster whose group is movable
/// or not (both on the same databases).
async fn loaded_small(dbs: &TestDbs, movable: bool) -> Cluster {
    let toml = format!(
        "{}\n[groups.Customer]\nbuckets = 1024\nmovable = {movable}\n",
        dbs.shards_toml(2)
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.refresh_bucket_maps().await.unwrap();
    if movable {
        for id in 1..=1_000i64 {
            let tx = cluster.begin::<Customer>(id % 100).await.unwrap();
            tx.insert(order::ActiveModel {
                id: Set(id),
                customer_id: Set(id % 100),
                total_cents: Set(0),
            })
            .await
            .unwrap();
            tx.commit().await.unwrap();
        }
    }
    cluster
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rows = args
        .iter()
        .position(|a| a == "--rows")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000_000);
    let filter: Vec<&String> = args
        .iter()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wants = |name: &str| filter.is_empty() || filter.iter().any(|f| name.contains(f.as_str()));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        if wants("copy") {
            copy(Backend::Postgres, rows).await;
            copy(Backend::MySql, rows).await;
        }
        if wants("writes") {
            writes().await;
        }
        if wants("fence") {
            fence().await;
        }
    });
}
