//! The harness shardkit's integration tests run on.
//!
//! Every scenario runs on SQLite and, when reachable, on PostgreSQL and
//! MySQL/MariaDB ([`backend_tests!`] makes one `#[tokio::test]` per backend).
//! Each test creates its own shard databases, named after it, and drops them
//! when it passes (like `#[sqlx::test]`); a failing test leaves them for
//! inspection. Outside CI an unreachable server is skipped with a printed
//! line; with `CI=true` it fails the test.
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
    /// Creates `shards` fresh databases for `test` (plus nothing else), or
    /// returns `None` when the backend's server is unreachable outside CI.
    pub async fn create(backend: Backend, test: &str, shards: usize) -> Option<Self> {
        let Some(admin_url) = backend.admin_url() else {
            let dir = std::env::temp_dir()
                .join("shardkit-tests")
                .join(db_name(test, "sqlite"));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create the test's SQLite directory");
            let names = (0..shards)
                .map(|i| dir.join(format!("shard_{i}.db")).display().to_string())
                .collect();
            return Some(TestDbs {
                backend,
                names,
                dir: Some(dir),
                admin: None,
            });
        };
        let admin = match Database::connect(admin_url.as_str()).await {
            Ok(conn) => conn,
            Err(err) => {
                if in_ci() {
                    panic!("{backend:?} is unreachable at {admin_url} and CI=true: {err}");
                }
                println!("skipping {test} on {backend:?}: server unreachable ({err})");
                return None;
            }
        };
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
        Some(dbs)
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

/// Makes one `#[tokio::test]` per backend for each scenario
/// `async fn name(dbs: &mut TestDbs)`, in a module named after it.
#[macro_export]
macro_rules! backend_tests {
    ($shards:expr => $($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            use $crate::{Backend, TestDbs};
            async fn run(backend: Backend) {
                let test = concat!(module_path!(), "::", stringify!($scenario));
                let test = test.split_once("::").map_or(test, |(_, rest)| rest);
                let Some(mut dbs) = TestDbs::create(backend, test, $shards).await else { return };
                super::$scenario(&mut dbs).await;
                dbs.cleanup().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() { run(Backend::Sqlite).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() { run(Backend::Postgres).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mysql() { run(Backend::MySql).await }
        }
    )*};
}

/// A TCP proxy in front of a database server that a test can cut, to make a
/// server unreachable mid-test: [`kill`](Proxy::kill) closes the listener and
/// every connection through it.
pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    kill: tokio::sync::watch::Sender<bool>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target` (`host:port`).
    pub async fn start(target: String) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (kill, mut killed) = tokio::sync::watch::channel(false);
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
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = killed.changed() => {}
                    }
                });
            }
        });
        Proxy { port, kill }
    }

    /// Cuts every connection and refuses new ones.
    pub fn kill(&self) {
        let _ = self.kill.send(true);
    }
}

/// Every statement a [`recording_cluster`] sent: (shard, statement).
pub type Sent = std::sync::Arc<std::sync::Mutex<Vec<(String, sea_orm::Statement)>>>;

/// A cluster over the test's first `shards` databases (with `groups`
/// appended to the config) that records every statement it sends.
pub async fn recording_cluster(dbs: &TestDbs, shards: usize, groups: &str) -> (Cluster, Sent) {
    let sent: Sent = Sent::default();
    let log = std::sync::Arc::clone(&sent);
    let cluster = Cluster::builder(dbs.config(shards, groups))
        .on_statement(move |event| {
            log.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((event.shard.to_owned(), event.statement.clone()))
        })
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
