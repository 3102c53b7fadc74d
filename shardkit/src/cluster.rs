//! [`Cluster`]: the entry point. It holds the validated topology and one
//! connection pool per logical shard (and per directory database), routes keys,
//! and hands out reads ([`Cluster::find`]) and transactions ([`Cluster::begin`]).

use crate::clock::{Clock, SystemClock};
use crate::entity::{EntityGroup, ShardKey, ShardedEntity};
use crate::error::{Result, ShardError};
use crate::ids::{Ids, TicketServer, mysql_session_sql};
use crate::read::{Find, Unkeyed};
use crate::topology::{ClusterConfig, DatabaseUrl, Located, PoolConfig, ShardId, Target, Topology};
use crate::tx::ShardTx;
use futures::future::join_all;
use sea_orm::sea_query::{Alias, Expr, OnConflict, Query};
use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection, ExprTrait};
use sea_orm_migration::MigratorTrait;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

/// A sharded database cluster. Cheap to clone (two `Arc`s); share it.
///
/// Dropping the last handle (and the reads, transactions and rollout handles
/// made from it) stops the cluster's periodic tasks and closes its pools.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
    /// Present on the handles users hold and everything made from them;
    /// absent on the handles periodic tasks borrow for a pass, so a pass in
    /// flight does not count as a user of the cluster.
    _user: Option<Arc<crate::periodic::Users>>,
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
    health: Vec<Arc<crate::health::ShardHealth>>,
    directories: Vec<DatabaseConnection>,
    read: ReadSettings,
    ids: Arc<Ids>,
    gsi_states: crate::gsi::StateCache,
    gsi_grace: Duration,
    gsi_pins: std::collections::HashMap<String, ShardId>,
    /// `[gsi] relaxed_commit`.
    gsi_relaxed: bool,
    /// Each shard's PostgreSQL server identity, read on first need.
    servers: Vec<tokio::sync::OnceCell<Option<String>>>,
    /// For statements sent outside SeaORM's metered paths.
    observer: Option<StatementObserver>,
    /// The time for snowflakes, GSI grace and rollout gaps and caches.
    clock: Arc<dyn Clock>,
    /// Closes when the last user handle drops: stops the periodic tasks.
    stop: crate::periodic::Stop,
    /// Registered rollouts, by the old entity's type.
    rollouts: std::sync::RwLock<
        std::collections::HashMap<std::any::TypeId, Arc<dyn crate::rollout::OldWrites>>,
    >,
}

/// A [`Cluster`] reference that does not keep it alive (for background tasks).
#[derive(Clone)]
pub(crate) struct WeakCluster(std::sync::Weak<Inner>);

impl WeakCluster {
    /// A handle for one pass of a periodic task: it keeps the pools open
    /// while the pass runs but is not a user of the cluster (see
    /// [`crate::periodic`]).
    pub(crate) fn upgrade(&self) -> Option<Cluster> {
        self.0.upgrade().map(|inner| Cluster { inner, _user: None })
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

/// Builds a [`Cluster`] with options beyond the config file.
pub struct ClusterBuilder {
    config: ClusterConfig,
    observer: Option<StatementObserver>,
    clock: Arc<dyn Clock>,
}

impl ClusterBuilder {
    /// Calls `observer` after every statement any shard runs: for metrics, slow
    /// query logs, or tests that assert on the SQL sent to each shard.
    pub fn on_statement(
        mut self,
        observer: impl Fn(&StatementEvent<'_>) + Send + Sync + 'static,
    ) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// The clock the cluster reads for everything time-dependent: snowflake
    /// ids, the GSI grace period, rollout phase gaps and rollout cache
    /// lifetimes (default: [`SystemClock`](crate::clock::SystemClock)). Tests
    /// pass a [`ManualClock`](crate::clock::ManualClock) to move time without
    /// sleeping.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Validates the config and connects (see [`Cluster::connect`]).
    pub async fn connect(self) -> Result<Cluster> {
        let ClusterBuilder {
            config,
            observer,
            clock,
        } = self;
        let topology = Topology::build(&config)?;
        let pool = &config.pool;
        let probe_timeout = Duration::from_secs(pool.connect_timeout_secs.unwrap_or(5));
        let health: Vec<_> = topology
            .shards()
            .iter()
            .map(|s| Arc::new(crate::health::ShardHealth::new(&s.url, probe_timeout)))
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
                Some(mysql_session_sql(i, count)),
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
        let servers = topology
            .ticket_servers()
            .iter()
            .zip(tickets)
            .map(|(spec, conn)| TicketServer::new(spec.name.clone(), conn))
            .collect();
        let ids = Arc::new(Ids::new(servers, config.ids.clone(), Arc::clone(&clock))?);
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
        let topology_ids: std::collections::HashMap<String, ShardId> = topology
            .shard_names()
            .map(|name| {
                (
                    name.to_owned(),
                    topology.shard_id(name).unwrap_or(ShardId(0)),
                )
            })
            .collect();
        let read = ReadSettings {
            timeout: config.read.timeout_ms.map(Duration::from_millis),
            max_concurrency: config.read.max_concurrency.unwrap_or(16),
        };
        let servers = shards.iter().map(|_| Default::default()).collect();
        let (users, stop) = crate::periodic::Users::new();
        Ok(Cluster {
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
                ids,
                gsi_states: crate::gsi::StateCache::default(),
                gsi_grace: Duration::from_millis(config.gsi.grace_ms.unwrap_or(30_000)),
                gsi_pins: config
                    .gsi
                    .pin
                    .iter()
                    .filter_map(|(index, shard)| {
                        Some((index.clone(), topology_ids.get(shard).copied()?))
                    })
                    .collect(),
                gsi_relaxed: config.gsi.relaxed_commit.unwrap_or(true),
                servers,
                observer: kept_observer,
                rollouts: Default::default(),
                clock,
                stop,
            }),
        })
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("shards", &self.inner.topology.shards())
            .field("directories", &self.inner.topology.directories())
            .finish()
    }
}

impl Cluster {
    /// Validates the config and connects to every shard and directory database
    /// (concurrently). Fails with [`ShardError::Connect`] naming the first shard
    /// that could not be reached; its URL appears without its password.
    pub async fn connect(config: ClusterConfig) -> Result<Self> {
        Cluster::builder(config).connect().await
    }

    /// A builder for options the config file cannot hold (statement observers).
    pub fn builder(config: ClusterConfig) -> ClusterBuilder {
        ClusterBuilder {
            config,
            observer: None,
            clock: Arc::new(SystemClock),
        }
    }

    /// The id service: ticket sequences, snowflakes.
    pub fn ids(&self) -> &Arc<Ids> {
        &self.inner.ids
    }

    /// The cluster's clock (see [`ClusterBuilder::clock`]).
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    /// The clock's time in the milliseconds shardkit stores.
    pub(crate) fn now_ms(&self) -> i64 {
        crate::clock::now_ms(&*self.inner.clock)
    }

    /// The signal that stops the cluster's periodic tasks when it drops.
    pub(crate) fn stop_signal(&self) -> &crate::periodic::Stop {
        &self.inner.stop
    }

    pub(crate) fn downgrade(&self) -> WeakCluster {
        WeakCluster(Arc::downgrade(&self.inner))
    }

    /// The rollout registered for the entity with type id `entity`.
    pub(crate) fn rollout_writes(
        &self,
        entity: std::any::TypeId,
    ) -> Option<Arc<dyn crate::rollout::OldWrites>> {
        let map = self
            .inner
            .rollouts
            .read()
            .unwrap_or_else(|p| p.into_inner());
        if map.is_empty() {
            return None;
        }
        map.get(&entity).cloned()
    }

    /// Registers a rollout's write side; `false` if the entity has one.
    pub(crate) fn add_rollout(
        &self,
        entity: std::any::TypeId,
        writes: Arc<dyn crate::rollout::OldWrites>,
    ) -> bool {
        let mut map = self
            .inner
            .rollouts
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if map.contains_key(&entity) {
            return false;
        }
        map.insert(entity, writes);
        true
    }

    pub(crate) fn gsi_states(&self) -> &crate::gsi::StateCache {
        &self.inner.gsi_states
    }

    pub(crate) fn gsi_pin(&self, index: &str) -> Option<ShardId> {
        self.inner.gsi_pins.get(index).copied()
    }

    pub(crate) fn gsi_grace(&self) -> Duration {
        self.inner.gsi_grace
    }

    pub(crate) fn gsi_relaxed(&self) -> bool {
        self.inner.gsi_relaxed
    }

    /// Shard `id`'s PostgreSQL server identity (see
    /// [`crate::gsi::read_server_identity`]), read once.
    pub(crate) async fn server_identity(&self, id: ShardId) -> Option<&str> {
        self.inner.servers[id.index()]
            .get_or_init(|| {
                crate::gsi::read_server_identity(self.side_conn(id), self.shard_name(id))
            })
            .await
            .as_deref()
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
    pub fn topology(&self) -> &Topology {
        &self.inner.topology
    }

    /// A shard's connection pool by name, for administration and for checking
    /// where rows landed. Statements sent through it bypass shardkit's checks.
    pub fn connection(&self, shard: &str) -> Option<&DatabaseConnection> {
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
    pub(crate) fn health(&self, id: ShardId) -> &Arc<crate::health::ShardHealth> {
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
    pub async fn route<G: EntityGroup>(&self, key: &G::Key) -> Result<Target> {
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
    pub fn route_now<G: EntityGroup>(&self, key: &G::Key) -> Result<Option<Target>> {
        match self.inner.topology.locate(G::NAME, key)? {
            Located::Target(target) => self.storable::<G>(key, target).map(Some),
            Located::Directory(_) => Ok(None),
        }
    }

    /// [`shard_of`](Self::shard_of) without I/O: `Ok(None)` when the group's
    /// placement needs a lookup (directory).
    pub fn shard_of_now<G: EntityGroup>(&self, key: &G::Key) -> Result<Option<&str>> {
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
    pub async fn shard_of<G: EntityGroup>(&self, key: &G::Key) -> Result<&str> {
        let target = self.route::<G>(key).await?;
        Ok(self.shard_name(target.shard))
    }

    /// Starts a read of entity `E`. A key must be given (`.key(k)`) before it
    /// can run; shardkit never guesses which shards to read.
    pub fn find<E: ShardedEntity>(&self) -> Find<E, Unkeyed> {
        Find::new(self.clone(), E::find())
    }

    /// Opens a transaction for group `G` pinned to `key`, on the key's shard.
    /// Every write in it must carry that key.
    pub async fn begin<G: EntityGroup>(&self, key: G::Key) -> Result<ShardTx<G>> {
        let target = match self.route_now::<G>(&key)? {
            Some(target) => target,
            None => self.route::<G>(&key).await?,
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
        Ok(ShardTx::new(txn, self.clone(), key, shard, target, span).holding(writer))
    }

    /// Runs `work` in a transaction for group `G` pinned to `key`: commits
    /// when it returns `Ok`, rolls back when it returns `Err`, and runs it
    /// again (in a new transaction, up to 3 attempts in all) when the
    /// database aborted the transaction — a deadlock or serialization
    /// failure, [`Retry::Transaction`](crate::Retry::Transaction) — in the
    /// work or in the commit. Any other error is returned at once.
    ///
    /// ```no_run
    /// # use shardkit::prelude::*;
    /// # #[derive(EntityGroup)] #[shardkit(key = i64)] pub struct Customer;
    /// # async fn run(cluster: Cluster) -> shardkit::Result<()> {
    /// let n = cluster
    ///     .transaction::<Customer, _, _>(42, |tx| async move {
    ///         // tx.insert(..).await?; tx.update(..).await?;
    ///         Ok(tx.key() * 2)
    ///     })
    ///     .await?;
    /// # let _ = n; Ok(()) }
    /// ```
    ///
    /// `work` gets the transaction behind an `Arc` so the future it returns
    /// can own it; it must not keep a clone past its own end (the commit
    /// needs the only one: a kept clone rolls the attempt back and returns
    /// [`ShardError::RollbackOnly`]).
    pub async fn transaction<G, T, Fut>(
        &self,
        key: G::Key,
        work: impl FnMut(Arc<ShardTx<G>>) -> Fut,
    ) -> Result<T>
    where
        G: EntityGroup,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.transaction_attempts::<G, T, Fut>(key, 3, work).await
    }

    /// [`transaction`](Self::transaction) with at most `attempts` runs of
    /// `work` (at least 1).
    pub async fn transaction_attempts<G, T, Fut>(
        &self,
        key: G::Key,
        attempts: u32,
        mut work: impl FnMut(Arc<ShardTx<G>>) -> Fut,
    ) -> Result<T>
    where
        G: EntityGroup,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let attempts = Ord::max(attempts, 1);
        let mut attempt = 1;
        loop {
            let tx = Arc::new(self.begin::<G>(key.clone()).await?);
            let outcome = work(Arc::clone(&tx)).await;
            let result = match (outcome, Arc::try_unwrap(tx)) {
                (Ok(value), Ok(tx)) => tx.commit().await.map(|()| value),
                (Err(err), Ok(tx)) => {
                    // The work's error is the one to report; a failed
                    // rollback only means the connection is gone too.
                    let _ = tx.rollback().await;
                    Err(err)
                }
                (outcome, Err(shared)) => {
                    let shard = shared.shard().to_owned();
                    // Dropping the last clone rolls back.
                    drop(shared);
                    outcome.and(Err(ShardError::RollbackOnly {
                        group: G::NAME,
                        shard,
                        reason: "the transaction closure kept a clone of its ShardTx past its \
                                 end; nothing was committed"
                            .to_owned(),
                    }))
                }
            };
            match result {
                Err(err) if attempt < attempts && err.retry() == crate::Retry::Transaction => {
                    tracing::debug!(group = G::NAME, attempt, error = %err, "transaction retried");
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    /// The lookup table of a directory-placed group.
    pub fn directory<G: EntityGroup>(&self) -> Result<Directory<G>> {
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
            cluster: self.clone(),
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
    pub async fn migrate<M: MigratorTrait>(&self) -> Result<MigrationReport> {
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
    pub async fn migration_status<M: MigratorTrait>(&self) -> Result<MigrationReport> {
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
            .zip(self.inner.ids.server_connections())
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
    cluster: Cluster,
    index: usize,
    _group: PhantomData<fn() -> G>,
}

impl<G: EntityGroup> Directory<G> {
    fn conn(&self) -> &DatabaseConnection {
        &self.cluster.inner.directories[self.index]
    }

    fn table(&self) -> Alias {
        Alias::new(
            self.cluster.inner.topology.directories()[self.index]
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
        if self.cluster.inner.topology.shard_id(shard).is_none() {
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
        let id = self
            .cluster
            .inner
            .topology
            .shard_id(&shard)
            .ok_or_else(|| ShardError::Unroutable {
                group: G::NAME,
                key: format!("{key:?}"),
                reason: format!("the directory names shard `{shard}`, which is not in the config"),
            })?;
        Ok(Target {
            shard: id,
            bucket: None,
        })
    }
}
