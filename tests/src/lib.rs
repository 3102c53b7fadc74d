//! The harness shardkit's integration tests run on.
//!
//! Every scenario runs on SQLite and, when reachable, on PostgreSQL and
//! MySQL/MariaDB ([`backend_tests!`] makes one test per backend).
//! Each test creates its own shard databases, named after it, and drops them
//! when it passes (like `#[sqlx::test]`); a failing test leaves them for
//! inspection. Outside CI the scenarios of an unreachable server are reported
//! as ignored (never as passed); with `CI=true` they fail.
//!
//! Servers: `SHARDKIT_PG_URL` (default `postgres://postgres@127.0.0.1:5432`)
//! and `SHARDKIT_MYSQL_URL` (default `mysql://root@127.0.0.1:3306`).

pub mod models;

use sea_orm::ConnectionTrait;
use shardkit::Cluster;

pub use shardkit::testing::{Backend, TestShards as TestDbs};

/// Whether a missing server must fail the run.
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Makes one test per backend for each scenario `async fn name(dbs: &mut
/// TestDbs)`, in a module named after it (`name::sqlite`, `name::postgres`,
/// `name::mysql`), and the test binary's `main` that runs them.
///
/// A scenario can be limited to some backends: `[Postgres] name`. The file
/// must be a `harness = false` test target (`tests/Cargo.toml`): the
/// scenarios run through [`harness::run`], which marks the scenarios of an
/// unreachable server *ignored* (shown and counted as such) instead of
/// letting them pass without running; with `CI=true` they run and fail.
#[macro_export]
macro_rules! backend_tests {
    ($shards:expr => $($([$($backend:ident),+])? $scenario:ident),* $(,)?) => {
        $(
            mod $scenario {
                pub(super) fn trials() -> Vec<$crate::harness::Scenario> {
                    let test = concat!(module_path!(), "::", stringify!($scenario));
                    let test = test.split_once("::").map_or(test, |(_, rest)| rest);
                    let backends: &[$crate::Backend] =
                        $crate::backend_tests!(@backends $([$($backend),+])?);
                    backends
                        .iter()
                        .map(|&backend| $crate::harness::Scenario::new(
                            test,
                            backend,
                            $shards,
                            |dbs| Box::pin(super::$scenario(dbs)),
                        ))
                        .collect()
                }
            }
        )*

        fn main() -> std::process::ExitCode {
            $crate::harness::run([$($scenario::trials()),*].into_iter().flatten().collect())
        }

        /// Runs only when this file was built with libtest's harness, which
        /// would never call the `main` above.
        #[test]
        fn harness_false_is_missing_in_tests_cargo_toml() {
            panic!(
                "{} uses shardkit_tests::backend_tests!: declare it in tests/Cargo.toml with \
                 `harness = false`, or none of its scenarios run",
                file!()
            );
        }
    };
    (@backends) => {
        &[$crate::Backend::Sqlite, $crate::Backend::Postgres, $crate::Backend::MySql]
    };
    (@backends [$($backend:ident),+]) => { &[$($crate::Backend::$backend),+] };
}

/// The runner behind [`backend_tests!`], on `libtest-mimic`: the same
/// command-line filters and output as `cargo test`, plus scenarios of an
/// unreachable server reported as ignored.
pub mod harness {
    use super::{Backend, TestDbs, in_ci};
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex, mpsc};
    use std::time::Duration;

    type Body = for<'a> fn(&'a mut TestDbs) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

    /// One scenario on one backend.
    pub struct Scenario {
        test: &'static str,
        backend: Backend,
        shards: usize,
        body: Body,
    }

    impl Scenario {
        /// A scenario named `test` on `backend` over `shards` fresh databases.
        pub fn new(test: &'static str, backend: Backend, shards: usize, body: Body) -> Self {
            Scenario {
                test,
                backend,
                shards,
                body,
            }
        }

        fn name(&self) -> String {
            let backend = match self.backend {
                Backend::Sqlite => "sqlite",
                Backend::Postgres => "postgres",
                Backend::MySql => "mysql",
            };
            let scenario = self.test.rsplit("::").next().unwrap_or(self.test);
            format!("{scenario}::{backend}")
        }

        fn run(self) {
            let watchdog = Watchdog::start(self.name());
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a tokio runtime for the scenario");
            let phase = &watchdog.phase;
            runtime.block_on(async move {
                *lock(phase) = "creating its databases";
                let mut dbs = TestDbs::create(self.backend, self.test, self.shards).await;
                *lock(phase) = "running";
                (self.body)(&mut dbs).await;
                *lock(phase) = "dropping its databases";
                dbs.cleanup().await;
            });
            *lock(phase) = "shutting its runtime down (a task or blocking call is stuck)";
            drop(runtime);
        }
    }

    /// A phase that a panicking scenario left is still worth reporting.
    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How long one scenario may take before [`Watchdog`] stops the binary
    /// (`SHARDKIT_SCENARIO_LIMIT_SECS`, default 600; the longest scenarios
    /// take a minute or two on a loaded two-core machine).
    fn scenario_limit() -> Duration {
        let secs = std::env::var("SHARDKIT_SCENARIO_LIMIT_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(600);
        Duration::from_secs(secs)
    }

    /// Turns a scenario that hangs into a failure that names it, what it was
    /// doing and where every thread of the process stands (through `gdb`,
    /// when the machine has it), instead of a test binary that runs until
    /// CI's own limit with nothing to show. A scenario's threads cannot be
    /// cancelled from outside, so it ends the process.
    struct Watchdog {
        phase: Arc<Mutex<&'static str>>,
        _done: mpsc::Sender<()>,
    }

    impl Watchdog {
        fn start(name: String) -> Watchdog {
            let phase = Arc::new(Mutex::new("starting"));
            let (done, finished) = mpsc::channel::<()>();
            let watched = Arc::clone(&phase);
            let limit = scenario_limit();
            std::thread::spawn(move || {
                // The scenario drops the sender when it ends, however it ends.
                if finished.recv_timeout(limit) != Err(mpsc::RecvTimeoutError::Timeout) {
                    return;
                }
                let phase = *lock(&watched);
                eprintln!(
                    "\n{name}: still {phase} after {} s; the stacks of every thread follow",
                    limit.as_secs()
                );
                let gdb = std::process::Command::new("gdb")
                    .args(["-p", &std::process::id().to_string(), "-batch"])
                    .args(["-ex", "thread apply all bt"])
                    .stdout(std::process::Stdio::inherit())
                    .status();
                if let Err(err) = gdb {
                    eprintln!("(no stacks: gdb could not run: {err})");
                }
                eprintln!("{name}: still {phase} after {} s", limit.as_secs());
                std::process::exit(101);
            });
            Watchdog { phase, _done: done }
        }
    }

    /// Runs `scenarios` as the test binary's tests; returns its exit code.
    pub fn run(scenarios: Vec<Scenario>) -> std::process::ExitCode {
        let args = libtest_mimic::Arguments::from_args();
        let mut reach: Vec<(Backend, bool)> = Vec::new();
        let ci = in_ci();
        let trials = scenarios
            .into_iter()
            .map(|scenario| {
                let backend = scenario.backend;
                let up = match reach.iter().find(|(b, _)| *b == backend) {
                    Some((_, up)) => *up,
                    None => {
                        let up = backend.reachable();
                        if !up {
                            eprintln!(
                                "{backend:?} is unreachable at {}: {}",
                                backend.server_url().unwrap_or_default(),
                                if ci {
                                    "CI=true, so its scenarios run and fail"
                                } else {
                                    "its scenarios are ignored (set CI=true to fail instead)"
                                }
                            );
                        }
                        reach.push((backend, up));
                        up
                    }
                };
                let name = scenario.name();
                libtest_mimic::Trial::test(name, move || {
                    scenario.run();
                    Ok(())
                })
                .with_ignored_flag(!up && !ci)
            })
            .collect();
        libtest_mimic::run(&args, trials).exit_code()
    }
}

/// A TCP proxy in front of a database server that a test can cut, to make a
/// server unreachable mid-test: [`kill`](Proxy::kill) closes the listener and
/// every connection through it; [`freeze`](Proxy::freeze) keeps every
/// connection open and stops forwarding (a server that hangs mid-statement),
/// [`freeze_open`](Proxy::freeze_open) does so for the connections open now
/// only. Dropping it kills it.
pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    kill: tokio::sync::watch::Sender<bool>,
    /// Connections are numbered as accepted; those numbered below this
    /// are frozen.
    frozen: tokio::sync::watch::Sender<u64>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Connections being forwarded (their tasks not yet ended).
    open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target` (`host:port`).
    pub async fn start(target: String) -> Proxy {
        Proxy::start_on(0, target).await
    }

    /// Listens on loopback `port` (0: a free one) and forwards to `target`:
    /// with the port of a killed proxy, the server is reachable again.
    pub async fn start_on(port: u16, target: String) -> Proxy {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (kill, mut killed) = tokio::sync::watch::channel(false);
        let (frozen, freezes) = tokio::sync::watch::channel(0_u64);
        let open = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = std::sync::Arc::clone(&open);
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let numbers = std::sync::Arc::clone(&accepted);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    _ = killed.changed() => return,
                };
                let Ok((mut client, _)) = accepted else {
                    continue;
                };
                let target = target.clone();
                let mut killed = killed.clone();
                let mut freezes = freezes.clone();
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let number = numbers.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let done = Countdown(std::sync::Arc::clone(&counted));
                tokio::spawn(async move {
                    let _done = done;
                    let Ok(mut server) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = killed.changed() => return,
                        _ = freezes.wait_for(|below| number < *below) => {}
                    }
                    // Frozen: both sockets stay open, nothing moves, until
                    // the proxy is killed.
                    let _ = killed.changed().await;
                    drop((client, server));
                });
            }
        });
        Proxy {
            port,
            kill,
            frozen,
            accepted,
            open,
        }
    }

    /// Cuts every connection and refuses new ones (the forwarding tasks
    /// close their sockets as they run; [`killed`](Self::killed) waits).
    pub fn kill(&self) {
        let _ = self.kill.send(true);
    }

    /// [`kill`](Self::kill), then waits until every connection through the
    /// proxy is closed (at most 2 s): a client's next statement on one of
    /// them finds it closed, not still forwarding.
    pub async fn killed(&self) {
        self.kill();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
        while self.open.load(std::sync::atomic::Ordering::SeqCst) > 0
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }

    /// Stops forwarding on every connection (open ones and new ones) while
    /// keeping them open: the server looks hung mid-statement.
    pub fn freeze(&self) {
        let _ = self.frozen.send(u64::MAX);
    }

    /// Stops forwarding on the connections open now, keeping them open;
    /// new ones are forwarded: a connection whose server stopped answering
    /// mid-statement, while the server still takes new ones.
    pub fn freeze_open(&self) {
        let _ = self
            .frozen
            .send(self.accepted.load(std::sync::atomic::Ordering::SeqCst));
    }
}

/// Counts a forwarded connection down when its task ends.
struct Countdown(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Countdown {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A server that accepts connections and never answers: the shard that
/// hangs instead of refusing. Every accepted socket is held open until the
/// `Hung` is dropped, and counted.
pub struct Hung {
    /// The port it listens on.
    pub port: u16,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Hung {
    /// Listens on a free loopback port.
    pub async fn start() -> Hung {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the hung server");
        let port = listener.local_addr().expect("hung server address").port();
        let accepted = std::sync::Arc::new(AtomicUsize::new(0));
        let open = std::sync::Arc::new(AtomicUsize::new(0));
        let (a, o) = (accepted.clone(), open.clone());
        let task = tokio::spawn(async move {
            let mut held = tokio::task::JoinSet::new();
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    continue;
                };
                a.fetch_add(1, Ordering::SeqCst);
                o.fetch_add(1, Ordering::SeqCst);
                let o = o.clone();
                // Read (and drop) whatever the client sends, never answer;
                // a closed socket is no longer open.
                held.spawn(async move {
                    let mut sink = [0u8; 1024];
                    loop {
                        match tokio::io::AsyncReadExt::read(&mut socket, &mut sink).await {
                            Ok(0) | Err(_) => break,
                            Ok(_) => {}
                        }
                    }
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Hung {
            port,
            accepted,
            open,
            task,
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Connections the client side has not closed yet.
    pub fn open(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A PostgreSQL or MySQL URL pointing at it (for `backend`; SQLite has no
    /// server to hang, so PostgreSQL's form is used).
    pub fn url(&self, backend: Backend) -> String {
        match backend {
            Backend::MySql => format!("mysql://root@127.0.0.1:{}/hung", self.port),
            _ => format!("postgres://postgres@127.0.0.1:{}/hung", self.port),
        }
    }
}

impl Drop for Hung {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Every statement a [`recording_cluster`] sent: (shard, statement).
pub type Sent = std::sync::Arc<std::sync::Mutex<Vec<(String, sea_orm::Statement)>>>;

/// A cluster over the test's first `shards` databases (with `groups`
/// appended to the config) that records every statement it sends.
pub async fn recording_cluster(dbs: &TestDbs, shards: usize, groups: &str) -> (Cluster, Sent) {
    recording_cluster_with(dbs, shards, groups, |builder| builder).await
}

/// [`recording_cluster`] with more builder options (a clock, say).
pub async fn recording_cluster_with(
    dbs: &TestDbs,
    shards: usize,
    groups: &str,
    options: impl FnOnce(shardkit::ClusterBuilder) -> shardkit::ClusterBuilder,
) -> (Cluster, Sent) {
    let sent: Sent = Sent::default();
    let log = std::sync::Arc::clone(&sent);
    let builder = Cluster::builder(dbs.config(shards, groups)).on_statement(move |event| {
        log.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((event.shard.to_owned(), event.statement.clone()))
    });
    let cluster = options(builder)
        .connect()
        .await
        .expect("connect the test cluster");
    (cluster, sent)
}

/// One write to a global index table among a [`recording_cluster`]'s
/// statements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexWrite {
    /// The shard it ran on.
    pub shard: String,
    /// `INSERT`, `UPDATE` or `DELETE`.
    pub op: String,
    /// Sent behind `SET LOCAL synchronous_commit = off` (committed without
    /// waiting for the WAL flush).
    pub relaxed: bool,
}

/// The writes to index table `table` among the recorded statements, in order.
pub fn index_writes(sent: &Sent, table: &str) -> Vec<IndexWrite> {
    const RELAXED: &str = "SET LOCAL synchronous_commit = off; ";
    sent.lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|(_, s)| s.sql.contains(table))
        .filter_map(|(shard, s)| {
            let (relaxed, sql) = match s.sql.strip_prefix(RELAXED) {
                Some(rest) => (true, rest),
                None => (false, s.sql.as_str()),
            };
            let op = sql.split_whitespace().next()?.to_uppercase();
            ["INSERT", "UPDATE", "DELETE"]
                .contains(&op.as_str())
                .then(|| IndexWrite {
                    shard: shard.clone(),
                    op,
                    relaxed,
                })
        })
        .collect()
}

/// The primary keys (sorted) of the contacts a `by_index` read of `column`
/// = `value` returns.
pub async fn contacts_by_index(
    cluster: &Cluster,
    column: models::contact::Column,
    value: &str,
) -> Vec<i64> {
    let mut ids: Vec<i64> = cluster
        .find::<models::contact::Entity>()
        .by_index(column, value)
        .all()
        .await
        .expect("an index read")
        .into_iter()
        .map(|c| c.id)
        .collect();
    ids.sort_unstable();
    ids
}

/// `SELECT COUNT(*)` of `table` summed over every shard of the cluster.
pub async fn count_rows(cluster: &Cluster, table: &str) -> u64 {
    let mut n = 0;
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).expect("configured shard");
        let row = db
            .query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                format!("SELECT COUNT(*) AS n FROM {table}"),
            ))
            .await
            .expect("count rows")
            .expect("a count row");
        n += row.try_get::<i64>("", "n").expect("a count") as u64;
    }
    n
}

/// A [`JobControl`](shardkit::JobControl) whose token another task cancels
/// while the job runs: at the job's `nth` progress report, which waits until
/// that task has cancelled it (so the cancellation lands between two
/// chunks, deterministically); and how many reports the job made.
pub fn cancelled_by_another_task<P: 'static>(
    nth: u64,
) -> (
    shardkit::JobControl<P>,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::Ordering;
    let reports = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = std::sync::Arc::clone(&reports);
    let token = shardkit::CancellationToken::new();
    let canceller = token.clone();
    let runtime = tokio::runtime::Handle::current();
    let control = shardkit::JobControl::new()
        .on_progress(move |_: &P| {
            if counted.fetch_add(1, Ordering::SeqCst) + 1 == nth {
                let (done, cancelled) = std::sync::mpsc::channel();
                let token = canceller.clone();
                runtime.spawn(async move {
                    token.cancel();
                    let _ = done.send(());
                });
                tokio::task::block_in_place(|| cancelled.recv().expect("the cancelling task"));
            }
        })
        .cancel_on(token);
    (control, reports)
}

/// One benchmark job of [`interleaved`].
pub type Job<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 'a>>;

/// Medians of `kinds` jobs run interleaved round by round (order rotating),
/// so all of them see the same machine: on a VM whose commit flush time
/// drifts by 2–3 × over minutes, criterion's one-after-another runs can
/// compare a fast minute with a slow one.
pub async fn interleaved<'a>(
    rounds: usize,
    kinds: usize,
    job: impl Fn(usize) -> Job<'a>,
) -> Vec<std::time::Duration> {
    let mut times = vec![Vec::with_capacity(rounds); kinds];
    for round in 0..rounds {
        for k in 0..kinds {
            let kind = (round + k) % kinds;
            let started = std::time::Instant::now();
            job(kind).await;
            times[kind].push(started.elapsed());
        }
    }
    times
        .into_iter()
        .map(|mut t| {
            t.sort();
            t[t.len() / 2]
        })
        .collect()
}

/// shardkit's metrics as a test binary's process records them
/// (`metrics_util`'s debugging recorder, installed on first use).
pub mod recorded {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    /// The recorder is the process's, and scenarios run side by side: every
    /// snapshot (which drains the recorder) is added to these totals, and each
    /// scenario reads its own labels from them.
    pub struct Totals {
        snapshotter: Snapshotter,
        counters: Mutex<HashMap<String, u64>>,
        histograms: Mutex<HashMap<String, Vec<f64>>>,
        gauges: Mutex<HashMap<String, f64>>,
    }

    pub fn totals() -> &'static Totals {
        static TOTALS: OnceLock<Totals> = OnceLock::new();
        TOTALS.get_or_init(|| {
            let recorder = DebuggingRecorder::new();
            let snapshotter = recorder.snapshotter();
            recorder
                .install()
                .expect("the only recorder of this process");
            Totals {
                snapshotter,
                counters: Mutex::default(),
                histograms: Mutex::default(),
                gauges: Mutex::default(),
            }
        })
    }

    /// `name{label=value,...}` with the labels sorted.
    fn key_text(key: &metrics::Key) -> String {
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        format!("{}{{{}}}", key.name(), labels.join(","))
    }

    impl Totals {
        fn take(&self) {
            let mut counters = self.counters.lock().unwrap();
            let mut histograms = self.histograms.lock().unwrap();
            for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
                let text = key_text(key.key());
                match value {
                    DebugValue::Counter(n) => *counters.entry(text).or_default() += n,
                    DebugValue::Histogram(xs) => histograms
                        .entry(text)
                        .or_default()
                        .extend(xs.into_iter().map(|x| x.into_inner())),
                    DebugValue::Gauge(x) => {
                        self.gauges.lock().unwrap().insert(text, x.into_inner());
                    }
                }
            }
        }

        /// The counter `key` (`name{label=value,...}`, labels sorted) so far.
        pub fn counter(&self, key: &str) -> u64 {
            self.take();
            self.counters.lock().unwrap().get(key).copied().unwrap_or(0)
        }

        /// The histogram `key`'s samples so far.
        pub fn samples(&self, key: &str) -> Vec<f64> {
            self.take();
            self.histograms
                .lock()
                .unwrap()
                .get(key)
                .cloned()
                .unwrap_or_default()
        }

        /// The gauge `key`'s last value, if it was ever set.
        pub fn gauge(&self, key: &str) -> Option<f64> {
            self.take();
            self.gauges.lock().unwrap().get(key).copied()
        }

        /// Every counter's and histogram's key seen so far.
        pub fn all_keys(&self) -> Vec<String> {
            self.take();
            let mut keys: Vec<String> = self.counters.lock().unwrap().keys().cloned().collect();
            keys.extend(self.histograms.lock().unwrap().keys().cloned());
            keys
        }
    }
}
