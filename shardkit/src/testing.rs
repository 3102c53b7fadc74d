//! Fresh shard databases for each test, like `#[sqlx::test]`: created
//! named after the test, dropped when it passes, left for inspection when
//! it fails. Enabled by the `testing` feature:
//!
//! ```toml
//! [dev-dependencies]
//! shardkit = { version = "0.1", features = ["testing"] }
//! ```
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use shardkit::testing::{Backend, TestShards};
//!
//! let shards = TestShards::create(Backend::Sqlite, "orders::refunds", 4).await;
//! let cluster = shards.cluster(4, "[groups.Customer]\n").await;
//! assert_eq!(cluster.topology().shard_names().count(), 4);
//! drop(cluster);
//! shards.cleanup().await; // last: a failed test never gets here
//! # }
//! ```
//!
//! Servers: `SHARDKIT_PG_URL` (default `postgres://postgres@127.0.0.1:5432`)
//! and `SHARDKIT_MYSQL_URL` (default `mysql://root@127.0.0.1:3306`).
//! SQLite shards are files under the system's temporary directory.
//! [`Backend::reachable`] tells a test whether to run or report itself
//! skipped; `create` panics when the server cannot be reached.

use crate::{Cluster, ClusterConfig};
use sea_orm::{ConnectionTrait, Database, DatabaseConnection};
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
    /// The server's `host:port` (what a test proxy forwards to); `None` for
    /// SQLite.
    pub fn server_address(self) -> Option<String> {
        let url = self.server_url()?;
        url.rsplit('@').next().map(str::to_owned)
    }

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

    /// Whether `backend`'s server accepts a TCP connection (SQLite always).
    pub fn reachable(self) -> bool {
        use std::net::{TcpStream, ToSocketAddrs};
        let Some(url) = self.server_url() else {
            return true;
        };
        let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
        let authority = rest.split('/').next().unwrap_or(rest);
        let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let default_port = if self == Backend::Postgres {
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

    fn admin_url(self) -> Option<String> {
        self.server_url().map(|url| match self {
            Backend::Postgres => format!("{}/postgres", url.trim_end_matches('/')),
            _ => url,
        })
    }
}

/// The shard databases of one test on one backend.
pub struct TestShards {
    /// The backend.
    pub backend: Backend,
    /// Database names (server backends) or file paths (SQLite), one per shard.
    pub names: Vec<String>,
    dir: Option<PathBuf>,
    admin: Option<DatabaseConnection>,
}

/// The prefix of the databases [`TestShards::create`] makes.
pub const DEFAULT_PREFIX: &str = "sk";

/// A database name unique to the test, `<prefix>_<test>_<hash>_<suffix>`,
/// within the 63 bytes PostgreSQL allows.
fn db_name(prefix: &str, test: &str, suffix: &str) -> String {
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
    base.truncate(38 - prefix.len().min(MAX_PREFIX));
    format!("{prefix}_{base}_{:06x}_{suffix}", hash & 0xff_ffff)
}

/// The longest prefix [`TestShards::create_prefixed`] takes.
const MAX_PREFIX: usize = 16;

impl TestShards {
    /// Creates `shards` fresh databases for `test` (plus nothing else).
    ///
    /// Panics when the backend's server cannot be reached: check
    /// [`Backend::reachable`] first (shardkit's own test harness marks the
    /// scenarios of an unreachable server ignored before they start), or
    /// use [`create_if_reachable`](Self::create_if_reachable).
    pub async fn create(backend: Backend, test: &str, shards: usize) -> Self {
        Self::create_prefixed(backend, DEFAULT_PREFIX, test, shards).await
    }

    /// [`create`](Self::create) with database names (and the SQLite
    /// directory) starting `<prefix>_` instead of `sk_`: tests of several
    /// applications, or of several checkouts, on one server keep apart, and
    /// a server's test databases are found (and dropped) by their prefix.
    ///
    /// Panics when `prefix` is empty, longer than 16 bytes, or has anything
    /// but ASCII letters, digits and `_`.
    pub async fn create_prefixed(
        backend: Backend,
        prefix: &str,
        test: &str,
        shards: usize,
    ) -> Self {
        assert!(
            !prefix.is_empty()
                && prefix.len() <= MAX_PREFIX
                && prefix
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_'),
            "test database prefix {prefix:?}: 1 to {MAX_PREFIX} ASCII letters, digits or `_`"
        );
        let Some(admin_url) = backend.admin_url() else {
            let dir = std::env::temp_dir()
                .join("shardkit-tests")
                .join(db_name(prefix, test, "sqlite"));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create the test's SQLite directory");
            let names = (0..shards)
                .map(|i| dir.join(format!("shard_{i}.db")).display().to_string())
                .collect();
            return TestShards {
                backend,
                names,
                dir: Some(dir),
                admin: None,
            };
        };
        assert!(
            backend.reachable(),
            "{backend:?} is unreachable at {}",
            backend.server_url().unwrap_or_default()
        );
        let admin = Database::connect(admin_url.as_str())
            .await
            .unwrap_or_else(|err| panic!("{backend:?} is unreachable at {admin_url}: {err}"));
        let names: Vec<String> = (0..shards)
            .map(|i| db_name(prefix, test, &i.to_string()))
            .collect();
        let dbs = TestShards {
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
        if !backend.reachable() {
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

    /// A text in the URL of this test's first shard and of no other test's
    /// shard: the argument that scopes one of shardkit's failpoints to the
    /// clusters over these databases (`return(<scope>)`), so that tests
    /// running at once in one process do not stop each other's work.
    pub fn scope(&self) -> String {
        self.scope_of(0)
    }

    /// [`scope`](Self::scope) of shard `shard` (a failpoint scoped to a
    /// move's target matches that shard's URL only).
    pub fn scope_of(&self, shard: usize) -> String {
        match self.backend.server_address() {
            None => self.names[shard].clone(),
            Some(address) => format!("{address}/{}", self.names[shard]),
        }
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

    /// [`shards_toml_with`](Self::shards_toml_with) with shards `through`
    /// reached at `127.0.0.1:<port>` (a test proxy in front of the server)
    /// instead of the server: `(shard index, port)`.
    pub fn shards_toml_through(
        &self,
        shards: usize,
        pool: &str,
        through: &[(usize, u16)],
    ) -> String {
        let mut toml = self.shards_toml_with(shards, pool, &[]);
        for &(i, port) in through {
            let url = match self.backend {
                Backend::MySql => format!("mysql://root@127.0.0.1:{port}/{}", self.names[i]),
                _ => format!("postgres://postgres@127.0.0.1:{port}/{}", self.names[i]),
            };
            toml = toml.replace(
                &format!(
                    "name = \"s{i}\"\nhost = \"server\"\ndatabase = \"{}\"\n",
                    self.names[i]
                ),
                &format!("name = \"s{i}\"\nurl = \"{url}\"\n"),
            );
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

impl TestShards {
    /// The connections the server holds open to this test's databases
    /// (`pg_stat_activity` / `information_schema.PROCESSLIST`), for checking
    /// that nothing leaked. SQLite has no server: always 0.
    pub async fn server_connections(&self) -> usize {
        match &self.admin {
            Some(admin) => connections_to(admin, &self.names).await,
            None => 0,
        }
    }

    /// Waits (at most 10 s) until the server holds at most `expected`
    /// connections to this test's databases, and fails the test with both
    /// counts when it still holds more: what a scenario asserts after its
    /// clusters are dropped, so that nothing leaked.
    pub async fn assert_connections_settle(&self, expected: usize) {
        let after = self
            .settle_connections(expected, std::time::Duration::from_secs(10))
            .await;
        if after > expected {
            let open = match &self.admin {
                Some(admin) => describe_connections(admin, &self.names).await,
                None => String::new(),
            };
            panic!("connections leaked: {after} open, at most {expected} expected{open}");
        }
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

/// How many connections the server `admin` is connected to has open to
/// the databases `names`, `admin`'s own left out (PostgreSQL or
/// MySQL/MariaDB): what a test counts to find connections a cluster left
/// behind.
pub async fn connections_to(admin: &sea_orm::DatabaseConnection, names: &[String]) -> usize {
    let list = quoted_list(names);
    let backend = admin.get_database_backend();
    let sql = match backend {
        sea_orm::DbBackend::Postgres => format!(
            "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE datname IN ({list}) \
             AND pid <> pg_backend_pid()"
        ),
        _ => format!(
            "SELECT COUNT(*) AS n FROM information_schema.PROCESSLIST WHERE DB IN ({list}) \
             AND ID <> CONNECTION_ID()"
        ),
    };
    let row = admin
        .query_one_raw(sea_orm::Statement::from_string(backend, sql))
        .await
        .expect("count server connections")
        .expect("a count row");
    row.try_get::<i64>("", "n").expect("a count") as usize
}

fn quoted_list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("'{}'", n.replace('\'', "")))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One line per connection the server holds to `names`: its database,
/// state and last statement, for a failed leak check to show what is
/// still open.
async fn describe_connections(admin: &sea_orm::DatabaseConnection, names: &[String]) -> String {
    let list = quoted_list(names);
    let backend = admin.get_database_backend();
    let sql = match backend {
        sea_orm::DbBackend::Postgres => format!(
            "SELECT CONCAT_WS(' | ', datname, state, \
             CAST(now() - state_change AS TEXT), LEFT(query, 200)) AS line \
             FROM pg_stat_activity WHERE datname IN ({list}) AND pid <> pg_backend_pid()"
        ),
        _ => format!(
            "SELECT CONCAT_WS(' | ', DB, COMMAND, TIME, STATE, LEFT(INFO, 200)) AS line \
             FROM information_schema.PROCESSLIST WHERE DB IN ({list}) \
             AND ID <> CONNECTION_ID()"
        ),
    };
    match admin
        .query_all_raw(sea_orm::Statement::from_string(backend, sql))
        .await
    {
        Ok(rows) => rows
            .iter()
            .filter_map(|r| r.try_get::<String>("", "line").ok())
            .map(|line| format!("\n  {line}"))
            .collect(),
        Err(e) => format!("\n  (listing them failed: {e})"),
    }
}
