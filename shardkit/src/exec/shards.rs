//! [`Shards`]: the connected databases of a cluster and how shardkit talks
//! to them: one pool per logical shard (and a small side pool), directory
//! databases, ticket servers, each shard's circuit breaker, the statement
//! observer, routing of keys, migrations. The execution layer: reads,
//! transactions and features run their statements through it, and it
//! knows none of them.

use crate::clock::Clock;
use crate::entity::{EntityGroup, ShardKey};
use crate::error::{Result, ShardError};
use crate::exec::health::{HEALTHY_FOR, REPROBE, SUSPECT_AFTER};
use crate::topology::{ClusterConfig, DatabaseUrl, Located, PoolConfig, ShardId, Target, Topology};
use futures::future::join_all;
use sea_orm::sea_query::{Alias, Expr, OnConflict, Query};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, ExprTrait, Statement,
};
use sea_orm_migration::MigratorTrait;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

/// The connected databases of a cluster. Cheap to clone (two `Arc`s).
#[derive(Clone)]
pub(crate) struct Shards {
    inner: Arc<Inner>,
    /// Present on the handles users hold and everything made from them;
    /// absent on the handles periodic tasks borrow for a pass, so a pass in
    /// flight does not count as a user of the cluster.
    _user: Option<Arc<crate::exec::periodic::Users>>,
}

struct Inner {
    topology: Topology,
    shards: Vec<DatabaseConnection>,
    /// Per shard, a small pool for autocommitted index writes and owner
    /// checks (see [`Cluster::side_conn`]).
    side: Vec<DatabaseConnection>,
    /// With two or more SQLite shards: one write transaction at a time
    /// across them (see [`Cluster::begin`]).
    sqlite_writer: Option<Arc<tokio::sync::Semaphore>>,
    /// How long `begin` waits for `sqlite_writer`.
    sqlite_writer_wait: Duration,
    /// Per shard, its circuit breaker.
    health: Vec<Arc<crate::exec::health::ShardHealth>>,
    directories: Vec<DatabaseConnection>,
    /// Per ticket server, its pool (the id service draws from them).
    tickets: Vec<DatabaseConnection>,
    read: ReadSettings,
    /// Each shard's PostgreSQL server identity, read on first need.
    servers: Vec<tokio::sync::OnceCell<Option<String>>>,
    /// For statements sent outside SeaORM's metered paths.
    observer: Option<StatementObserver>,
    /// The time for snowflakes, GSI grace and rollout gaps and caches.
    clock: Arc<dyn Clock>,
    /// Closes when the last user handle drops: stops the periodic tasks.
    stop: crate::exec::periodic::Stop,
}

/// A [`Shards`] reference that does not keep the pools open (for
/// background tasks).
#[derive(Clone)]
pub(crate) struct WeakShards(std::sync::Weak<Inner>);

impl crate::exec::periodic::Handle for Shards {
    type Weak = WeakShards;

    fn downgrade(&self) -> WeakShards {
        WeakShards(Arc::downgrade(&self.inner))
    }

    /// A handle for one pass of a periodic task: it keeps the pools open
    /// while the pass runs but is not a user of the cluster (see
    /// [`crate::exec::periodic`]).
    fn upgrade(weak: &WeakShards) -> Option<Shards> {
        weak.0.upgrade().map(|inner| Shards { inner, _user: None })
    }

    fn stop_signal(&self) -> &crate::exec::periodic::Stop {
        &self.inner.stop
    }
}

/// Cluster-wide read defaults (from `[read]`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReadSettings {
    pub(crate) timeout: Option<Duration>,
    pub(crate) max_concurrency: usize,
}

/// Called after every statement a shard runs (see [`ClusterBuilder::on_statement`]).
pub type StatementObserver = Arc<dyn Fn(&StatementEvent<'_>) + Send + Sync>;

/// One executed statement, as seen by a [`StatementObserver`].
#[derive(Debug)]
#[non_exhaustive]
pub struct StatementEvent<'a> {
    /// The shard (or `directory:<group>`) it ran on.
    pub shard: &'a str,
    /// The statement with its bound values.
    pub statement: &'a sea_orm::Statement,
    /// How long it took.
    pub elapsed: Duration,
    /// Whether it failed.
    pub failed: bool,
}

impl Shards {
    /// Validates `config` and connects every database it names (see
    /// [`Cluster::connect`](crate::Cluster::connect)).
    pub(crate) async fn connect(
        config: &ClusterConfig,
        observer: Option<StatementObserver>,
        clock: Arc<dyn Clock>,
    ) -> Result<Shards> {
        let topology = Topology::build(config)?;
        let pool = &config.pool;
        let probe_timeout = Duration::from_secs(pool.connect_timeout_secs.unwrap_or(5));
        let health: Vec<_> = topology
            .shards()
            .iter()
            .map(|s| Arc::new(crate::exec::health::ShardHealth::new(&s.url, probe_timeout)))
            .collect();
        if !pool.connect_lazy.unwrap_or(false) {
            // One direct connection per shard first: it fails within the
            // connect timeout with the driver's cause, where the pool would
            // retry a refused connection until its acquire timeout and then
            // say only "pool timed out".
            let probes = join_all(health.iter().map(|h| h.probe_once())).await;
            for (spec, probe) in topology.shards().iter().zip(probes) {
                if let Err(cause) = probe {
                    return Err(ShardError::Connect {
                        shard: spec.name.clone(),
                        url: spec.url.redacted(),
                        cause,
                    });
                }
            }
        }
        let kept_observer = observer.clone();
        let observer = observer.as_ref();
        let shard_conns = join_all(
            topology
                .shards()
                .iter()
                .map(|s| connect_one(s.name.clone(), &s.url, pool, observer, None, false)),
        );
        let side_pool = side_pool_config(pool);
        let side_conns = join_all(topology.shards().iter().map(|s| {
            connect_one(
                s.name.clone(),
                &s.url,
                &side_pool,
                observer,
                Some(SIDE_MYSQL_SESSION.to_owned()),
                true,
            )
        }));
        let count = topology.ticket_servers().len();
        let ticket_conns = join_all(topology.ticket_servers().iter().enumerate().map(|(i, s)| {
            connect_one(
                s.name.clone(),
                &s.url,
                pool,
                observer,
                Some(crate::id_spec::mysql_session_sql(i, count)),
                false,
            )
        }));
        let dir_conns = join_all(topology.directories().iter().map(|d| {
            connect_one(
                format!("directory:{}", d.group),
                &d.url,
                pool,
                observer,
                None,
                false,
            )
        }));
        let (shards, directories, tickets) = futures::join!(shard_conns, dir_conns, ticket_conns);
        // After the main pools: opening a SQLite file while another
        // connection switches it to WAL fails with `database is locked`.
        let side = side_conns.await;
        let tickets = tickets.into_iter().collect::<Result<Vec<_>>>()?;
        let shards = shards.into_iter().collect::<Result<Vec<_>>>()?;
        let side = side
            .into_iter()
            .zip(&shards)
            .zip(topology.shards())
            .map(|((side, main), spec)| {
                // Each connection to an in-memory SQLite database is a
                // database of its own: index rows must use the main pool.
                let raw = spec.url.expose();
                if raw.contains(":memory:") || raw.contains("mode=memory") {
                    Ok(main.clone())
                } else {
                    side
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let sqlite_shards = shards
            .iter()
            .filter(|c| c.get_database_backend() == sea_orm::DbBackend::Sqlite)
            .count();
        let directories = directories.into_iter().collect::<Result<Vec<_>>>()?;
        let read = ReadSettings {
            timeout: config.read.timeout_ms.map(Duration::from_millis),
            max_concurrency: config.read.max_concurrency.unwrap_or(16),
        };
        let servers = shards.iter().map(|_| Default::default()).collect();
        let (users, stop) = crate::exec::periodic::Users::new();
        Ok(Shards {
            _user: Some(Arc::new(users)),
            inner: Arc::new(Inner {
                topology,
                shards,
                side,
                sqlite_writer: (sqlite_shards > 1)
                    .then(|| Arc::new(tokio::sync::Semaphore::new(1))),
                sqlite_writer_wait: Duration::from_secs(pool.acquire_timeout_secs.unwrap_or(30)),
                health,
                directories,
                read,
                tickets,
                servers,
                observer: kept_observer,
                clock,
                stop,
            }),
        })
    }
}

impl std::fmt::Debug for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shards")
            .field("shards", &self.inner.topology.shards())
            .field("directories", &self.inner.topology.directories())
            .finish()
    }
}

impl Shards {
    /// This handle as one a periodic pass borrows: it keeps the pools open
    /// but is not a user of the cluster.
    pub(crate) fn for_task(&self) -> Shards {
        Shards {
            inner: Arc::clone(&self.inner),
            _user: None,
        }
    }

    /// The cluster's clock (see [`ClusterBuilder::clock`]).
    pub(crate) fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    /// The clock's time in the milliseconds shardkit stores.
    pub(crate) fn now_ms(&self) -> i64 {
        crate::clock::now_ms(&*self.inner.clock)
    }

    /// Shard `id`'s PostgreSQL server identity (see
    /// [`read_server_identity`]), read once.
    pub(crate) async fn server_identity(&self, id: ShardId) -> Option<&str> {
        self.inner.servers[id.index()]
            .get_or_init(|| read_server_identity(self.side_conn(id), self.shard_name(id)))
            .await
            .as_deref()
    }

    /// Whether shards `a` and `b` are databases of one PostgreSQL server.
    pub(crate) async fn same_pg_server(&self, a: ShardId, b: ShardId) -> bool {
        match (self.server_identity(a).await, self.server_identity(b).await) {
            (Some(x), Some(y)) => x == y,
            _ => false,
        }
    }

    /// Reports a statement sent outside SeaORM's metered paths to the
    /// [`ClusterBuilder::on_statement`] observer.
    pub(crate) fn observe(
        &self,
        shard: &str,
        statement: &sea_orm::Statement,
        elapsed: Duration,
        failed: bool,
    ) {
        if let Some(observer) = &self.inner.observer {
            observer(&StatementEvent {
                shard,
                statement,
                elapsed,
                failed,
            });
        }
    }

    pub(crate) fn read_settings(&self) -> ReadSettings {
        self.inner.read
    }

    /// The validated topology.
    pub(crate) fn topology(&self) -> &Topology {
        &self.inner.topology
    }

    /// A shard's connection pool by name, for administration and for checking
    /// where rows landed. Statements sent through it bypass shardkit's checks.
    pub(crate) fn connection(&self, shard: &str) -> Option<&DatabaseConnection> {
        let id = self.inner.topology.shard_id(shard)?;
        Some(&self.inner.shards[id.index()])
    }

    pub(crate) fn shard_conn(&self, id: ShardId) -> &DatabaseConnection {
        &self.inner.shards[id.index()]
    }

    /// Shard `id`'s side pool: small, separate from the pool transactions
    /// take their connections from, and used only for single autocommitted
    /// statements (index claims and removals, owner checks) by callers that
    /// hold no side connection already. A transaction holding a main
    /// connection may wait for a side connection, never the reverse, and a
    /// side connection never waits for any connection, so waits for
    /// connections cannot form a cycle however small the pools are. Its
    /// lock waits are bounded (`lock_timeout`, `innodb_lock_wait_timeout`,
    /// SQLite's busy timeout): a claim can wait on an index row locked by a
    /// transaction that in turn waits for a connection.
    pub(crate) fn side_conn(&self, id: ShardId) -> &DatabaseConnection {
        &self.inner.side[id.index()]
    }

    /// Shard `id`'s circuit breaker.
    pub(crate) fn health(&self, id: ShardId) -> &Arc<crate::exec::health::ShardHealth> {
        &self.inner.health[id.index()]
    }

    pub(crate) fn shard_name(&self, id: ShardId) -> &str {
        &self.inner.topology.shard(id).name
    }

    /// Where `key` of group `G` lives. Pure computation for hash, range and
    /// modulo placements; one lookup for directory placements.
    ///
    /// A `u64` key above `i64::MAX` routed to a PostgreSQL or SQLite shard is
    /// refused here ([`ShardError::Unroutable`]), before any statement binds
    /// it: those backends have no unsigned 64-bit type.
    pub(crate) async fn route<G: EntityGroup>(&self, key: &G::Key) -> Result<Target> {
        match self.inner.topology.locate(G::NAME, key)? {
            Located::Target(target) => self.storable::<G>(key, target),
            Located::Directory(index) => {
                let target = self.directory_index::<G>(index).lookup_target(key).await?;
                self.storable::<G>(key, target)
            }
        }
    }

    /// [`route`](Self::route) without I/O: `Ok(None)` when the group's
    /// placement needs a lookup (directory), in which case call `route`.
    pub(crate) fn route_now<G: EntityGroup>(&self, key: &G::Key) -> Result<Option<Target>> {
        match self.inner.topology.locate(G::NAME, key)? {
            Located::Target(target) => self.storable::<G>(key, target).map(Some),
            Located::Directory(_) => Ok(None),
        }
    }

    /// [`shard_of`](Self::shard_of) without I/O: `Ok(None)` when the group's
    /// placement needs a lookup (directory).
    pub(crate) fn shard_of_now<G: EntityGroup>(&self, key: &G::Key) -> Result<Option<&str>> {
        Ok(self
            .route_now::<G>(key)?
            .map(|target| self.shard_name(target.shard)))
    }

    /// Refuses a key the target shard's backend cannot bind.
    fn storable<G: EntityGroup>(&self, key: &G::Key, target: Target) -> Result<Target> {
        if !key.fits_signed_64() {
            let backend = self.shard_conn(target.shard).get_database_backend();
            if backend != sea_orm::DbBackend::MySql {
                return Err(ShardError::Unroutable {
                    group: G::NAME,
                    key: format!("{key:?}"),
                    reason: format!(
                        "a u64 key above {} fits only MySQL/MariaDB's BIGINT UNSIGNED; shard `{}` \
                         is {backend:?}, which stores 64-bit integers signed",
                        i64::MAX,
                        self.shard_name(target.shard)
                    ),
                });
            }
        }
        Ok(target)
    }

    /// The name of the shard `key` of group `G` lives on.
    pub(crate) async fn shard_of<G: EntityGroup>(&self, key: &G::Key) -> Result<&str> {
        let target = self.route::<G>(key).await?;
        Ok(self.shard_name(target.shard))
    }

    /// Opens a write transaction on the shard of `key` of group `G`, under
    /// the shard's breaker (and, with several SQLite shards, holding the
    /// cluster's SQLite write slot).
    pub(crate) async fn begin<G: EntityGroup>(&self, key: &G::Key) -> Result<Begun> {
        let target = match self.route_now::<G>(key)? {
            Some(target) => target,
            None => self.route::<G>(key).await?,
        };
        let shard = self.shard_name(target.shard).to_owned();
        let span = tracing::info_span!(
            "shardkit.tx",
            group = G::NAME,
            shard = %shard,
            bucket = tracing::field::Empty,
        );
        if let Some(bucket) = target.bucket.filter(|_| !span.is_disabled()) {
            span.record("bucket", bucket);
        }
        tracing::debug!(parent: &span, key = ?key, "begin");
        let conn = self.shard_conn(target.shard);
        let writer = match &self.inner.sqlite_writer {
            Some(gate) if conn.get_database_backend() == sea_orm::DbBackend::Sqlite => {
                // A SQLite transaction holds its file's write lock from
                // `begin`, and its index rows may need another file's: two
                // such transactions on two files would each wait for the
                // other's lock. One SQLite write transaction at a time
                // across the cluster's files makes that wait impossible.
                let wait = self.inner.sqlite_writer_wait;
                let permit = tokio::time::timeout(wait, Arc::clone(gate).acquire_owned())
                    .await
                    .ok()
                    .and_then(|p| p.ok())
                    .ok_or_else(|| ShardError::Db {
                        group: G::NAME,
                        shard: shard.clone(),
                        operation: "begin".to_owned(),
                        source: sea_orm::DbErr::ConnectionAcquire(sea_orm::ConnAcquireErr::Timeout),
                    })?;
                Some(permit)
            }
            _ => None,
        };
        // Under the shard's breaker: a shard that refuses or hangs fails the
        // begin with its cause instead of after the pool's acquire timeout.
        let begin = async {
            crate::exec::begin_write(conn)
                .await
                .map_err(|source| ShardError::Db {
                    group: G::NAME,
                    shard: shard.clone(),
                    operation: "begin".to_owned(),
                    source,
                })
        };
        let txn = self.bounded(target.shard, G::NAME, None, begin).await?;
        Ok(Begun {
            txn,
            shard,
            target,
            span,
            writer,
        })
    }

    /// The lookup table of a directory-placed group.
    pub(crate) fn directory<G: EntityGroup>(&self) -> Result<Directory<G>> {
        match self.inner.topology.placement(G::NAME)? {
            crate::topology::Placement::Directory { directory } => {
                Ok(self.directory_index(*directory))
            }
            _ => Err(ShardError::config(
                format!("groups.{}", G::NAME),
                "this group is not placed by directory (placement = \"directory\")",
            )),
        }
    }

    fn directory_index<G: EntityGroup>(&self, index: usize) -> Directory<G> {
        Directory {
            shards: self.clone(),
            index,
            _group: PhantomData,
        }
    }

    /// Applies migrator `M` to every shard and every directory database, and
    /// shardkit's own ticket-server migrations
    /// ([`shardkit_migration::TicketMigrator`], never `M`) to every ticket
    /// server, all of them concurrently, then reports each one's status.
    /// Fails with [`ShardError::Migration`] naming a database whose migration
    /// failed, after every other one has had its turn.
    pub(crate) async fn migrate<M: MigratorTrait>(&self) -> Result<MigrationReport> {
        let results = join_all(self.databases().map(|(name, conn, role)| async move {
            match role {
                Role::Data => M::up(conn, None).await,
                Role::Tickets => shardkit_migration::TicketMigrator::up(conn, None).await,
            }
            .map_err(|source| ShardError::Migration {
                shard: name,
                source,
            })
        }))
        .await;
        results.into_iter().collect::<Result<Vec<()>>>()?;
        self.migration_status::<M>().await
    }

    /// The migration status of every shard and directory database (against
    /// `M`) and of every ticket server (against shardkit's ticket-server
    /// migrations), without changing anything (beyond creating SeaORM's
    /// migration table if missing).
    pub(crate) async fn migration_status<M: MigratorTrait>(&self) -> Result<MigrationReport> {
        let statuses = join_all(self.databases().map(|(name, conn, role)| async move {
            match role {
                Role::Data => migration_status_of::<M>(name, conn).await,
                Role::Tickets => {
                    migration_status_of::<shardkit_migration::TicketMigrator>(name, conn).await
                }
            }
        }))
        .await;
        Ok(MigrationReport {
            databases: statuses.into_iter().collect::<Result<Vec<_>>>()?,
        })
    }

    /// Every database of the cluster with its report name and role,
    /// deduplicated by URL (a directory or a ticket server may live in a
    /// shard's database, which then takes the application's migrations):
    /// shards, directory databases, ticket servers.
    fn databases(&self) -> impl Iterator<Item = (String, &DatabaseConnection, Role)> {
        let topology = &self.inner.topology;
        let shards = topology
            .shards()
            .iter()
            .zip(&self.inner.shards)
            .map(|(spec, conn)| (spec.name.clone(), &spec.url, conn, Role::Data));
        let dirs = topology
            .directories()
            .iter()
            .zip(&self.inner.directories)
            .map(|(spec, conn)| {
                (
                    format!("directory:{}", spec.group),
                    &spec.url,
                    conn,
                    Role::Data,
                )
            });
        let tickets = topology
            .ticket_servers()
            .iter()
            .zip(&self.inner.tickets)
            .map(|(spec, conn)| (format!("ids:{}", spec.name), &spec.url, conn, Role::Tickets));
        let mut seen: Vec<&DatabaseUrl> = Vec::new();
        shards
            .chain(dirs)
            .chain(tickets)
            .filter(move |(_, url, _, _)| {
                if seen.contains(url) {
                    false
                } else {
                    seen.push(url);
                    true
                }
            })
            .map(|(name, _, conn, role)| (name, conn, role))
    }
}

/// A write transaction [`Shards::begin`] opened.
pub(crate) struct Begun {
    pub(crate) txn: sea_orm::DatabaseTransaction,
    pub(crate) shard: String,
    pub(crate) target: Target,
    pub(crate) span: tracing::Span,
    /// The cluster's SQLite write slot, to hold until the transaction ends.
    pub(crate) writer: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// The ticket servers' pools, in config order.
impl Shards {
    pub(crate) fn ticket_connections(&self) -> &[DatabaseConnection] {
        &self.inner.tickets
    }
}

/// What a database of the cluster holds, and so which migrations it takes.
#[derive(Clone, Copy)]
enum Role {
    /// A shard or a directory database: the application's migrator.
    Data,
    /// A ticket server: shardkit's ticket tables only.
    Tickets,
}

async fn migration_status_of<M: MigratorTrait>(
    name: String,
    conn: &DatabaseConnection,
) -> Result<DatabaseMigrationStatus> {
    let applied = M::get_applied_migrations(conn).await;
    let pending = M::get_pending_migrations(conn).await;
    match (applied, pending) {
        (Ok(applied), Ok(pending)) => Ok(DatabaseMigrationStatus {
            name,
            applied: applied.iter().map(|m| m.name().to_owned()).collect(),
            pending: pending.iter().map(|m| m.name().to_owned()).collect(),
        }),
        (Err(source), _) | (_, Err(source)) => Err(ShardError::Migration {
            shard: name,
            source,
        }),
    }
}

/// Connections per shard in the side pool ([`Cluster::side_conn`]).
const SIDE_POOL_SIZE: u32 = 2;

/// How long a side-pool statement waits for a row lock, in seconds.
const SIDE_LOCK_WAIT_SECS: u64 = 5;

/// The MySQL session setting of side-pool connections.
const SIDE_MYSQL_SESSION: &str = "SET SESSION innodb_lock_wait_timeout = 5";

/// The side pool's settings: the shards' timeouts, a few connections opened
/// on first use.
fn side_pool_config(pool: &PoolConfig) -> PoolConfig {
    PoolConfig {
        max_connections: Some(SIDE_POOL_SIZE),
        min_connections: None,
        connect_lazy: Some(true),
        ..pool.clone()
    }
}

async fn connect_one(
    name: String,
    url: &DatabaseUrl,
    pool: &PoolConfig,
    observer: Option<&StatementObserver>,
    mysql_session: Option<String>,
    side: bool,
) -> Result<DatabaseConnection> {
    // The password travels in the driver's options, not in the URL: SeaORM
    // records the URL in its connect span (TRACE).
    let (driver_url, password) = url.for_driver();
    let mut options = ConnectOptions::new(driver_url);
    // A side pool's statements wait at most this long for a row lock.
    let lock_timeout = side.then(|| format!("{SIDE_LOCK_WAIT_SECS}s"));
    if password.is_some() || lock_timeout.is_some() {
        // One closure per driver: SeaORM keeps only the last one set.
        let for_mysql = password.clone();
        options.map_sqlx_postgres_opts(move |mut opts| {
            if let Some(password) = &password {
                opts = opts.password(password);
            }
            if let Some(timeout) = &lock_timeout {
                opts = opts.options([("lock_timeout", timeout)]);
            }
            opts
        });
        if let Some(password) = for_mysql {
            options.map_sqlx_mysql_opts(move |opts| opts.password(&password));
        }
    }
    // Statements are logged by shardkit's own spans; keep the driver's
    // per-statement log below info.
    options.sqlx_logging_level(log::LevelFilter::Debug);
    if let Some(n) = pool.max_connections {
        options.max_connections(n);
    }
    if let Some(n) = pool.min_connections {
        options.min_connections(n);
    }
    if let Some(secs) = pool.connect_timeout_secs {
        options.connect_timeout(Duration::from_secs(secs));
    }
    if let Some(secs) = pool.acquire_timeout_secs {
        options.acquire_timeout(Duration::from_secs(secs));
    }
    if let Some(test) = pool.test_before_acquire {
        options.test_before_acquire(test);
    }
    if let Some(lazy) = pool.connect_lazy {
        options.connect_lazy(lazy);
    }
    let raw = url.expose();
    if raw.starts_with("sqlite:") && !raw.contains("journal_mode") && !raw.contains(":memory:") {
        // WAL lets readers run beside the one writer; a URL that names its
        // own journal mode keeps it.
        options.map_sqlx_sqlite_opts(|opts| {
            opts.journal_mode(sea_orm::sqlx::sqlite::SqliteJournalMode::Wal)
        });
    }
    if let Some(sql) = mysql_session {
        // Session variables live per connection: set them on every connection
        // the pool opens, not once.
        let sql = Arc::new(sql);
        options.map_sqlx_mysql_pool_opts(move |opts| {
            let sql = Arc::clone(&sql);
            opts.after_connect(move |conn, _meta| {
                let sql = Arc::clone(&sql);
                Box::pin(async move {
                    use sea_orm::sqlx::{AssertSqlSafe, Executor, raw_sql};
                    // The statement is built from two integers, not user input.
                    conn.execute(raw_sql(AssertSqlSafe(sql.to_string())))
                        .await
                        .map(|_| ())
                })
            })
        });
    }
    let mut conn = Database::connect(options)
        .await
        .map_err(|err| ShardError::Connect {
            shard: name.clone(),
            url: url.redacted(),
            cause: url.scrub(&err.to_string()),
        })?;
    if let Some(observer) = observer {
        let observer = Arc::clone(observer);
        conn.set_metric_callback(move |info| {
            observer(&StatementEvent {
                shard: &name,
                statement: info.statement,
                elapsed: info.elapsed,
                failed: info.failed,
            })
        });
    }
    Ok(conn)
}

/// The result of [`Cluster::migrate`] / [`Cluster::migration_status`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationReport {
    /// One entry per shard (by name), per directory database
    /// (`directory:<group>`) and per ticket server (`ids:<name>`).
    pub databases: Vec<DatabaseMigrationStatus>,
}

/// One database's migrations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatabaseMigrationStatus {
    /// Shard name, `directory:<group>` or `ids:<server>`.
    pub name: String,
    /// Applied migrations, in order.
    pub applied: Vec<String>,
    /// Migrations not yet applied.
    pub pending: Vec<String>,
}

impl MigrationReport {
    /// Databases with pending migrations: behind the migrator, and so behind
    /// any shard that has them applied.
    pub fn behind(&self) -> Vec<&DatabaseMigrationStatus> {
        self.databases
            .iter()
            .filter(|d| !d.pending.is_empty())
            .collect()
    }

    /// Whether every database has every migration applied.
    pub fn is_current(&self) -> bool {
        self.behind().is_empty()
    }
}

impl std::fmt::Display for MigrationReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for db in &self.databases {
            writeln!(
                f,
                "{:<24} applied {:>3}  pending {:>3}{}",
                db.name,
                db.applied.len(),
                db.pending.len(),
                if db.pending.is_empty() {
                    ""
                } else {
                    "  <- behind"
                }
            )?;
        }
        Ok(())
    }
}

/// The `key → shard` lookup table of a directory-placed group (see
/// `placement = "directory"`). The table is created by the `shardkit-migration`
/// crate's migrations.
pub struct Directory<G: EntityGroup> {
    shards: Shards,
    index: usize,
    _group: PhantomData<fn() -> G>,
}

impl<G: EntityGroup> Directory<G> {
    fn conn(&self) -> &DatabaseConnection {
        &self.shards.inner.directories[self.index]
    }

    fn table(&self) -> Alias {
        Alias::new(
            self.shards.inner.topology.directories()[self.index]
                .table
                .as_str(),
        )
    }

    fn db_err(&self, operation: &str, source: sea_orm::DbErr) -> ShardError {
        ShardError::Db {
            group: G::NAME,
            shard: format!("directory:{}", G::NAME),
            operation: operation.to_owned(),
            source,
        }
    }

    /// Places `key` on `shard` (insert or overwrite).
    pub async fn assign(&self, key: &G::Key, shard: &str) -> Result<()> {
        if self.shards.inner.topology.shard_id(shard).is_none() {
            return Err(ShardError::config(
                format!("directory:{}", G::NAME),
                format!("cannot assign a key to shard `{shard}`: no such shard"),
            ));
        }
        let stmt = Query::insert()
            .into_table(self.table())
            .columns([
                Alias::new("group_name"),
                Alias::new("shard_key"),
                Alias::new("shard"),
            ])
            .values_panic([G::NAME.into(), key.to_directory_text().into(), shard.into()])
            .on_conflict(
                OnConflict::columns([Alias::new("group_name"), Alias::new("shard_key")])
                    .update_column(Alias::new("shard"))
                    .to_owned(),
            )
            .to_owned();
        self.conn()
            .execute(&stmt)
            .await
            .map_err(|e| self.db_err("assign directory entry", e))?;
        Ok(())
    }

    /// The shard `key` is assigned to, if any.
    pub async fn lookup(&self, key: &G::Key) -> Result<Option<String>> {
        let stmt = Query::select()
            .column(Alias::new("shard"))
            .from(self.table())
            .and_where(Expr::col(Alias::new("group_name")).eq(G::NAME))
            .and_where(Expr::col(Alias::new("shard_key")).eq(key.to_directory_text()))
            .to_owned();
        let row = self
            .conn()
            .query_one(&stmt)
            .await
            .map_err(|e| self.db_err("directory lookup", e))?;
        row.map(|row| row.try_get::<String>("", "shard"))
            .transpose()
            .map_err(|e| self.db_err("directory lookup", e))
    }

    /// Removes `key`'s entry; returns whether there was one.
    pub async fn remove(&self, key: &G::Key) -> Result<bool> {
        let stmt = Query::delete()
            .from_table(self.table())
            .and_where(Expr::col(Alias::new("group_name")).eq(G::NAME))
            .and_where(Expr::col(Alias::new("shard_key")).eq(key.to_directory_text()))
            .to_owned();
        let res = self
            .conn()
            .execute(&stmt)
            .await
            .map_err(|e| self.db_err("directory remove", e))?;
        Ok(res.rows_affected() > 0)
    }

    async fn lookup_target(&self, key: &G::Key) -> Result<Target> {
        let shard = self
            .lookup(key)
            .await?
            .ok_or_else(|| ShardError::Unroutable {
                group: G::NAME,
                key: format!("{key:?}"),
                reason: "the key has no entry in the directory; assign it with \
                     `cluster.directory::<G>()?.assign(&key, shard)`"
                    .to_owned(),
            })?;
        let id =
            self.shards
                .inner
                .topology
                .shard_id(&shard)
                .ok_or_else(|| ShardError::Unroutable {
                    group: G::NAME,
                    key: format!("{key:?}"),
                    reason: format!(
                        "the directory names shard `{shard}`, which is not in the config"
                    ),
                })?;
        Ok(Target {
            shard: id,
            bucket: None,
        })
    }
}

/// Which PostgreSQL server a shard's database lives on (system identifier
/// and start time); `None` on other backends or when it cannot be read.
pub(crate) async fn read_server_identity(db: &DatabaseConnection, shard: &str) -> Option<String> {
    if db.get_database_backend() != DbBackend::Postgres {
        return None;
    }
    // Tests: the shard named by the failpoint's argument reports a server of
    // its own, the others one shared server.
    fail::fail_point!("shardkit::gsi::server_identity", |elsewhere: Option<
        String,
    >| {
        Some(if elsewhere.as_deref() == Some(shard) {
            format!("elsewhere:{shard}")
        } else {
            "shared".to_owned()
        })
    });
    let sql = "SELECT system_identifier::text || '@' || pg_postmaster_start_time()::text AS id \
               FROM pg_control_system()";
    match db
        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
    {
        Ok(row) => row.and_then(|r| r.try_get::<String>("", "id").ok()),
        Err(err) => {
            tracing::warn!(shard, error = %err, "server identity unknown: index rows there commit flushed");
            None
        }
    }
}

/// The breaker around every request (see [`crate::exec::health`]).
impl Shards {
    /// Runs `fut`, a request that needs a connection of shard `id`, under
    /// the shard's breaker and `timeout`: fails at once with
    /// [`ShardError::Unavailable`] while the shard is down, and as soon as a
    /// probe started while `fut` waits finds it down; otherwise `fut`
    /// decides (or the timeout, [`ShardError::Timeout`]).
    pub(crate) async fn bounded<T>(
        &self,
        id: ShardId,
        group: &'static str,
        timeout: Option<Duration>,
        fut: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let health = self.health(id);
        let shard = self.shard_name(id);
        if let Some(cause) = health.down_cause() {
            return Err(ShardError::Unavailable {
                shard: shard.to_owned(),
                cause,
            });
        }
        let watched = async {
            tokio::select! {
                biased;
                result = fut => match result {
                    // The pool gave up connecting (its own timeout may be
                    // shorter than the probe's): ask the probe why.
                    Err(ShardError::Db {
                        source: sea_orm::DbErr::ConnectionAcquire(_) | sea_orm::DbErr::Conn(_),
                        ..
                    }) if health.can_probe() => {
                        match self.probe_shared(id).await {
                            Err(cause) => Err(ShardError::Unavailable {
                                shard: shard.to_owned(),
                                cause,
                            }),
                            Ok(()) => result,
                        }
                    }
                    other => other,
                },
                cause = self.watch(id) => Err(ShardError::Unavailable {
                    shard: shard.to_owned(),
                    cause,
                }),
            }
        };
        match timeout {
            None => watched.await,
            Some(after) => tokio::time::timeout(after, watched)
                .await
                .unwrap_or_else(|_| {
                    Err(ShardError::Timeout {
                        group,
                        shard: shard.to_owned(),
                        after,
                    })
                }),
        }
    }

    /// Completes (with the cause) only once shard `id` is found down.
    async fn watch(&self, id: ShardId) -> String {
        tokio::time::sleep(SUSPECT_AFTER).await;
        loop {
            match self.probe_shared(id).await {
                Err(cause) => return cause,
                Ok(()) => tokio::time::sleep(HEALTHY_FOR).await,
            }
        }
    }

    /// Shard `id`'s state from a recent or new probe, marking it down when
    /// the probe fails.
    async fn probe_shared(&self, id: ShardId) -> std::result::Result<(), String> {
        let health = Arc::clone(self.health(id));
        // In a task of its own: a request that gives up (its timeout) must
        // not cancel the probe that would mark the shard down.
        let probe = tokio::spawn(async move { health.check().await });
        match probe.await {
            Ok(Err(cause)) => {
                self.shard_down(id, &cause);
                Err(cause)
            }
            Ok(Ok(())) | Err(_) => Ok(()),
        }
    }

    /// Marks shard `id` down and, if it was up, starts the probe that
    /// brings it back.
    pub(crate) fn shard_down(&self, id: ShardId, cause: &str) {
        let health = self.health(id);
        if !health.mark_down(cause) {
            return;
        }
        tracing::warn!(
            shard = self.shard_name(id),
            cause,
            "shard down: requests fail fast until a probe reaches it"
        );
        crate::exec::periodic::spawn(
            self,
            REPROBE,
            crate::exec::periodic::FirstPass::AfterInterval,
            move |shards: Shards| async move {
                let health = Arc::clone(shards.health(id));
                match health.probe_once().await {
                    Ok(()) => {
                        health.mark_up();
                        tracing::info!(shard = shards.shard_name(id), "shard back up");
                        std::ops::ControlFlow::Break(())
                    }
                    Err(cause) => {
                        health.mark_down(&cause);
                        std::ops::ControlFlow::Continue(())
                    }
                }
            },
        );
    }
}
