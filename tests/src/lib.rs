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

use sea_orm::{ConnectionTrait, Database, DatabaseConnection};
use shardkit::{Cluster, ClusterConfig};
use std::path::PathBuf;

/// A database server kind the scenarios run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Embedded SQLite files.
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// MySQL / MariaDB.
    MySql,
}

impl Backend {
    /// The server URL (no database) for this backend.
    pub fn server_url(self) -> Option<String> {
        match self {
            Backend::Sqlite => None,
            Backend::Postgres => Some(
                std::env::var("SHARDKIT_PG_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into()),
            ),
            Backend::MySql => Some(
                std::env::var("SHARDKIT_MYSQL_URL")
                    .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into()),
            ),
        }
    }

    fn admin_url(self) -> Option<String> {
        self.server_url().map(|url| match self {
            Backend::Postgres => format!("{}/postgres", url.trim_end_matches('/')),
            _ => url,
        })
    }
}

/// The shard databases of one test on one backend.
pub struct TestDbs {
    /// The backend.
    pub backend: Backend,
    /// Database names (server backends) or file paths (SQLite), one per shard.
    pub names: Vec<String>,
    dir: Option<PathBuf>,
    admin: Option<DatabaseConnection>,
}

/// Whether a missing server must fail the run.
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// A database name unique to the test, within the 63 characters PostgreSQL allows.
fn db_name(test: &str, suffix: &str) -> String {
    let mut base: String = test
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    // FNV-1a of the full name keeps truncated names distinct.
    let hash = test.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    base.truncate(36);
    format!("sk_{base}_{:06x}_{suffix}", hash & 0xff_ffff)
}

impl TestDbs {
    /// Creates `shards` fresh databases for `test` (plus nothing else).
    ///
    /// Panics when the backend's server cannot be reached: [`backend_tests!`]
    /// marks the scenarios of an unreachable server ignored before they
    /// start, so a scenario that gets here expects its server.
    pub async fn create(backend: Backend, test: &str, shards: usize) -> Self {
        let Some(admin_url) = backend.admin_url() else {
            let dir = std::env::temp_dir()
                .join("shardkit-tests")
                .join(db_name(test, "sqlite"));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create the test's SQLite directory");
            let names = (0..shards)
                .map(|i| dir.join(format!("shard_{i}.db")).display().to_string())
                .collect();
            return TestDbs {
                backend,
                names,
                dir: Some(dir),
                admin: None,
            };
        };
        assert!(
            harness::reachable(backend),
            "{backend:?} is unreachable at {}",
            backend.server_url().unwrap_or_default()
        );
        let admin = Database::connect(admin_url.as_str())
            .await
            .unwrap_or_else(|err| panic!("{backend:?} is unreachable at {admin_url}: {err}"));
        let names: Vec<String> = (0..shards).map(|i| db_name(test, &i.to_string())).collect();
        let dbs = TestDbs {
            backend,
            names,
            dir: None,
            admin: Some(admin),
        };
        for name in &dbs.names {
            dbs.recreate(name).await;
        }
        dbs
    }

    /// [`create`](Self::create) when the backend's server is reachable;
    /// otherwise prints why and returns `None` (for benchmarks, which
    /// measure what they can).
    pub async fn create_if_reachable(backend: Backend, test: &str, shards: usize) -> Option<Self> {
        if !harness::reachable(backend) {
            println!("skipping {test} on {backend:?}: server unreachable");
            return None;
        }
        Some(Self::create(backend, test, shards).await)
    }

    /// Drops (if present) and creates one database on the server.
    pub async fn recreate(&self, name: &str) {
        let admin = self.admin.as_ref().expect("server backend");
        let drop = match self.backend {
            Backend::Postgres => format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"),
            _ => format!("DROP DATABASE IF EXISTS `{name}`"),
        };
        admin
            .execute_unprepared(&drop)
            .await
            .expect("drop test database");
        let create = match self.backend {
            Backend::Postgres => format!("CREATE DATABASE \"{name}\""),
            _ => format!("CREATE DATABASE `{name}`"),
        };
        admin
            .execute_unprepared(&create)
            .await
            .expect("create test database");
    }

    /// An extra database for the test (a directory, a ticket server...), also
    /// dropped by [`cleanup`](Self::cleanup). Returns its URL.
    pub async fn extra(&mut self, suffix: &str) -> String {
        match self.backend {
            Backend::Sqlite => {
                let dir = self.dir.as_ref().expect("sqlite dir");
                let path = dir.join(format!("{suffix}.db")).display().to_string();
                self.names.push(path.clone());
                format!("sqlite://{path}?mode=rwc")
            }
            _ => {
                let name = format!("{}_{suffix}", self.names[0]);
                self.recreate(&name).await;
                self.names.push(name.clone());
                format!("{}/{name}", self.backend.server_url().unwrap_or_default())
            }
        }
    }

    /// The shard entries of a cluster config: SQLite files get their own
    /// `url`; server shards share one `[[hosts]]` entry, several databases on
    /// one server.
    pub fn shards_toml(&self, shards: usize) -> String {
        self.shards_toml_with(shards, "", &[])
    }

    /// Like [`shards_toml`](Self::shards_toml), with extra `[pool]` settings and
    /// the shards at `broken` pointing at a database that cannot be reached
    /// (a closed port; for SQLite, an empty database without the tables).
    pub fn shards_toml_with(&self, shards: usize, pool: &str, broken: &[usize]) -> String {
        // Small pools: many tests run at once against one server.
        let mut toml = format!("[pool]\nmax_connections = 4\n{pool}\n");
        let unreachable = |i: usize| match self.backend {
            // SQLite has no server to lose, and SeaORM opens the file at
            // connect time (to read its version): a failed SQLite shard is an
            // empty database the migrations never reach, so every read of a
            // table fails on it.
            Backend::Sqlite => {
                let dir = self.dir.as_ref().expect("sqlite dir");
                let path = dir.join(format!("s{i}-broken.db"));
                format!(
                    "[[shards]]\nname = \"s{i}\"\nurl = \"sqlite://{}?mode=rwc\"\n\n",
                    path.display()
                )
            }
            Backend::Postgres => format!(
                "[[shards]]\nname = \"s{i}\"\nurl = \"postgres://postgres@127.0.0.1:9/down\"\n\n"
            ),
            Backend::MySql => {
                format!("[[shards]]\nname = \"s{i}\"\nurl = \"mysql://root@127.0.0.1:9/down\"\n\n")
            }
        };
        match self.backend {
            Backend::Sqlite => {
                for (i, path) in self.names.iter().take(shards).enumerate() {
                    if broken.contains(&i) {
                        toml.push_str(&unreachable(i));
                        continue;
                    }
                    toml.push_str(&format!(
                        "[[shards]]\nname = \"s{i}\"\nurl = \"sqlite://{path}?mode=rwc\"\n\n"
                    ));
                }
            }
            _ => {
                let url = self.backend.server_url().unwrap_or_default();
                toml.push_str(&format!(
                    "[[hosts]]\nname = \"server\"\nurl = \"{url}\"\n\n"
                ));
                for (i, db) in self.names.iter().take(shards).enumerate() {
                    if broken.contains(&i) {
                        toml.push_str(&unreachable(i));
                        continue;
                    }
                    toml.push_str(&format!(
                        "[[shards]]\nname = \"s{i}\"\nhost = \"server\"\ndatabase = \"{db}\"\n\n"
                    ));
                }
            }
        }
        toml
    }

    /// Connects a cluster over the first `shards` databases with `groups` (TOML
    /// `[groups.*]` tables) appended.
    pub async fn cluster(&self, shards: usize, groups: &str) -> Cluster {
        Cluster::connect(self.config(shards, groups))
            .await
            .expect("connect the test cluster")
    }

    /// The config [`cluster`](Self::cluster) connects with.
    pub fn config(&self, shards: usize, groups: &str) -> ClusterConfig {
        let toml = format!("{}\n{groups}", self.shards_toml(shards));
        ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("config: {e}\n{toml}"))
    }

    /// Drops every database the test created. Call it last: a failing test
    /// never gets here and leaves its databases for inspection.
    pub async fn cleanup(self) {
        match self.backend {
            Backend::Sqlite => {
                if let Some(dir) = &self.dir {
                    let _ = std::fs::remove_dir_all(dir);
                }
            }
            _ => {
                let admin = self.admin.as_ref().expect("server backend");
                for name in &self.names {
                    let drop = match self.backend {
                        Backend::Postgres => {
                            format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")
                        }
                        _ => format!("DROP DATABASE IF EXISTS `{name}`"),
                    };
                    admin
                        .execute_unprepared(&drop)
                        .await
                        .expect("drop test database");
                }
            }
        }
    }
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
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a tokio runtime for the scenario");
            runtime.block_on(async move {
                let mut dbs = TestDbs::create(self.backend, self.test, self.shards).await;
                (self.body)(&mut dbs).await;
                dbs.cleanup().await;
            });
        }
    }

    /// Whether `backend`'s server accepts a TCP connection (SQLite always).
    pub(crate) fn reachable(backend: Backend) -> bool {
        use std::net::{TcpStream, ToSocketAddrs};
        let Some(url) = backend.server_url() else {
            return true;
        };
        let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
        let authority = rest.split('/').next().unwrap_or(rest);
        let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let default_port = if backend == Backend::Postgres {
            5432
        } else {
            3306
        };
        let addr = if host.contains(':') {
            host.to_owned()
        } else {
            format!("{host}:{default_port}")
        };
        addr.to_socket_addrs().is_ok_and(|mut addrs| {
            addrs.any(|a| TcpStream::connect_timeout(&a, std::time::Duration::from_secs(2)).is_ok())
        })
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
                        let up = reachable(backend);
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
/// connection open and stops forwarding (a server that hangs mid-statement).
/// Dropping it kills it.
pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    kill: tokio::sync::watch::Sender<bool>,
    frozen: tokio::sync::watch::Sender<bool>,
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
        let (frozen, freezes) = tokio::sync::watch::channel(false);
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
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = killed.changed() => return,
                        _ = freezes.wait_for(|f| *f) => {}
                    }
                    // Frozen: both sockets stay open, nothing moves, until
                    // the proxy is killed.
                    let _ = killed.changed().await;
                    drop((client, server));
                });
            }
        });
        Proxy { port, kill, frozen }
    }

    /// Cuts every connection and refuses new ones.
    pub fn kill(&self) {
        let _ = self.kill.send(true);
    }

    /// Stops forwarding on every connection (open ones and new ones) while
    /// keeping them open: the server looks hung mid-statement.
    pub fn freeze(&self) {
        let _ = self.frozen.send(true);
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

impl TestDbs {
    /// The connections the server holds open to this test's databases
    /// (`pg_stat_activity` / `information_schema.PROCESSLIST`), for checking
    /// that nothing leaked. SQLite has no server: always 0.
    pub async fn server_connections(&self) -> usize {
        let Some(admin) = &self.admin else {
            return 0;
        };
        let list = self
            .names
            .iter()
            .map(|n| format!("'{}'", n.replace('\'', "")))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = match self.backend {
            Backend::Postgres => format!(
                "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE datname IN ({list}) \
                 AND pid <> pg_backend_pid()"
            ),
            _ => format!(
                "SELECT COUNT(*) AS n FROM information_schema.PROCESSLIST WHERE DB IN ({list}) \
                 AND ID <> CONNECTION_ID()"
            ),
        };
        let row = admin
            .query_one_raw(sea_orm::Statement::from_string(
                admin.get_database_backend(),
                sql,
            ))
            .await
            .expect("count server connections")
            .expect("a count row");
        row.try_get::<i64>("", "n").expect("a count") as usize
    }

    /// Waits (polling, at most `within`) until the server holds at most
    /// `expected` connections to this test's databases; returns the last count.
    pub async fn settle_connections(&self, expected: usize, within: std::time::Duration) -> usize {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let n = self.server_connections().await;
            if n <= expected || tokio::time::Instant::now() >= deadline {
                return n;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
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
