//! [`Shards`]: the connected databases of a cluster and how shardkit talks
//! to them: one pool per logical shard (and a small side pool), directory
//! databases, ticket servers, each shard's circuit breaker, the statement
//! observer, routing of keys, migrations. The execution layer: reads,
//! transactions and features run their statements through it, and it
//! knows none of them.

use crate::clock::Clock;
use crate::entity::{EntityGroup, ShardKey};
use crate::error::{Result, ShardError};
use crate::topology::{Located, ShardId, Target, Topology};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use std::sync::Arc;
use std::time::Duration;

/// The connected databases of a cluster. Cheap to clone (two `Arc`s).
#[derive(Clone)]
pub(crate) struct Shards {
    pub(super) inner: Arc<Inner>,
    /// Present on the handles users hold and everything made from them;
    /// absent on the handles periodic tasks borrow for a pass, so a pass in
    /// flight does not count as a user of the cluster.
    pub(super) _user: Option<Arc<crate::exec::periodic::Users>>,
}

pub(super) struct Inner {
    pub(super) topology: Topology,
    pub(super) shards: Vec<DatabaseConnection>,
    /// Per shard, a small pool for autocommitted index writes and owner
    /// checks (see [`Cluster::side_conn`]).
    pub(super) side: Vec<DatabaseConnection>,
    /// With two or more SQLite shards: one write transaction at a time
    /// across them, in this process and every other instance on the same
    /// files (see [`crate::exec::sqlite`]).
    pub(super) sqlite_writer: Option<Arc<crate::exec::sqlite::WriterSlot>>,
    /// Per shard, its circuit breaker.
    pub(super) health: Vec<Arc<crate::exec::health::ShardHealth>>,
    /// Per shard, its read replicas.
    pub(super) replicas: Vec<crate::exec::replicas::ReplicaSet>,
    pub(super) directories: Vec<DatabaseConnection>,
    /// Per ticket server, its pool (the id service draws from them).
    pub(super) tickets: Vec<DatabaseConnection>,
    pub(super) read: ReadSettings,
    pub(super) rebalance: RebalanceSettings,
    /// Each shard's PostgreSQL server identity, read on first need.
    pub(super) servers: Vec<tokio::sync::OnceCell<Option<String>>>,
    /// For statements sent outside SeaORM's metered paths.
    pub(super) observer: Option<StatementObserver>,
    /// The time for snowflakes, GSI grace and rollout gaps and caches.
    pub(super) clock: Arc<dyn Clock>,
    /// Closes when the last user handle drops: stops the periodic tasks.
    pub(super) stop: crate::exec::periodic::Stop,
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
    /// How long a read with a session waits for a replica to catch up.
    pub(crate) replica_wait: Duration,
    /// How long a replica may take to answer before the primary does.
    pub(crate) replica_timeout: Duration,
    /// Between two lag probes of every replica.
    pub(crate) replica_probe: Duration,
}

impl ReadSettings {
    /// How long a read of the control database's bucket map may take (for
    /// a read, the map refresh, a move mark): the read timeout, else 5 s.
    pub(crate) fn control_bound(&self) -> Duration {
        self.timeout.unwrap_or(Duration::from_secs(5))
    }
}

/// Bucket-move settings (from `[rebalance]`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RebalanceSettings {
    /// Between two reads of the bucket maps' epochs (zero: never).
    pub(crate) refresh: Duration,
    pub(crate) cutover_wait: Duration,
    pub(crate) cleanup_grace: Duration,
    /// `[rebalance] chunk`, when set (see [`copy_chunk`](Self::copy_chunk)
    /// and [`chunk`](Self::chunk)).
    pub(crate) chunk_setting: Option<u64>,
    /// How long one step of a mover (a run of copied chunks, a replay
    /// batch, a cleaning chunk) may take.
    pub(crate) step_timeout: Duration,
    /// How long a move waits for its tables' columns to agree.
    pub(crate) schema_wait: Duration,
}

impl RebalanceSettings {
    /// Rows per copy chunk: `[rebalance] chunk`, else 50,000 for an entity
    /// copied with `COPY` (between PostgreSQL shards) and 20,000 for one
    /// copied as models. With `COPY` a chunk's fixed part (its read, its
    /// transaction, the fence, the commit) weighs more: chunks of 50,000
    /// rows copied at 0.82–0.88 × the server's own `COPY`, chunks of 20,000
    /// at 0.61–0.69 ×.
    pub(crate) fn copy_chunk(&self, by_copy: bool) -> u64 {
        self.chunk_setting
            .unwrap_or(if by_copy { 50_000 } else { 20_000 })
    }

    /// Rows per chunk of a move's other steps (compare, replay, clean):
    /// `[rebalance] chunk`, else 20,000.
    pub(crate) fn chunk(&self) -> u64 {
        self.chunk_setting.unwrap_or(20_000)
    }
}

/// Called after every statement a shard runs (see [`ClusterBuilder::on_statement`](crate::ClusterBuilder::on_statement)).
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

    /// Fault injection (feature `failpoints`): whether the failpoint
    /// `name` fires for this cluster. Its argument, `scope` or
    /// `scope@<n>`, scopes it to the clusters one of whose shard URLs
    /// contains `scope` (tests of one process each set their own);
    /// `Some(n)` (empty without one) when it fires. Without an argument it
    /// fires for every cluster. A count (`2*return(...)`) is used up by
    /// every cluster's evaluation, whatever its scope: scoped failpoints
    /// take none.
    pub(crate) fn failpoint(&self, name: &str) -> Option<String> {
        #[cfg(not(feature = "failpoints"))]
        {
            let _ = name;
            None
        }
        #[cfg(feature = "failpoints")]
        {
            let arg = fail::eval(name, |arg| arg.unwrap_or_default())?;
            let (scope, detail) = match arg.rsplit_once('@') {
                Some((scope, n)) if n.bytes().all(|b| b.is_ascii_digit()) => (scope, n),
                _ => (arg.as_str(), ""),
            };
            (scope.is_empty()
                || self
                    .inner
                    .topology
                    .shards()
                    .iter()
                    .any(|s| s.url.expose().contains(scope)))
            .then(|| detail.to_owned())
        }
    }

    pub(crate) fn read_settings(&self) -> ReadSettings {
        self.inner.read
    }

    /// The validated topology.
    pub(crate) fn rebalance_settings(&self) -> RebalanceSettings {
        self.inner.rebalance
    }

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
        let shard = self.shard_name(target.shard);
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
        // A SQLite transaction holds its file's write lock from `begin`, and
        // its index rows may need another file's: two such transactions on
        // two files would each wait for the other's lock. One SQLite write
        // transaction at a time across the cluster's files, in every
        // instance, makes that wait impossible.
        let begin_failed = |source| {
            ShardError::db(
                crate::error::Origin::Group(G::NAME),
                shard.to_owned(),
                "begin",
                source,
            )
        };
        let writer = self
            .sqlite_write_slot(target.shard)
            .await
            .map_err(begin_failed)?;
        // Under the shard's breaker: a shard that refuses or hangs fails the
        // begin with its cause instead of after the pool's acquire timeout.
        // SeaORM boxes the driver's begin: this future is a pointer.
        let begin = async { crate::exec::begin_pooled(conn).await.map_err(begin_failed) };
        let txn = self.bounded(target.shard, G::NAME, None, begin).await?;
        Ok(Begun {
            txn,
            target,
            span,
            writer,
        })
    }
}

impl Shards {
    /// The cluster's SQLite write slot (see [`crate::exec::sqlite`]), for a
    /// write transaction on shard `id` that may write another file while it
    /// holds this one's lock; `None` when the shard is not SQLite or the
    /// cluster has one SQLite shard. Waits at most the busy timeout, then
    /// fails with SQLite's `database is locked`.
    pub(crate) async fn sqlite_write_slot(
        &self,
        id: ShardId,
    ) -> std::result::Result<Option<crate::exec::sqlite::WriterPermit>, sea_orm::DbErr> {
        match &self.inner.sqlite_writer {
            Some(slot) if self.shard_conn(id).get_database_backend() == DbBackend::Sqlite => {
                slot.acquire().await.map(Some)
            }
            _ => Ok(None),
        }
    }
}

/// A write transaction [`Shards::begin`] opened.
pub(crate) struct Begun {
    pub(crate) txn: sea_orm::DatabaseTransaction,
    pub(crate) target: Target,
    pub(crate) span: tracing::Span,
    /// The cluster's SQLite write slot, to hold until the transaction ends.
    pub(crate) writer: Option<crate::exec::sqlite::WriterPermit>,
}

/// How a key's write transaction is opened: a feature that must see every
/// transaction begin (the bucket moves' fence) registers its own on the
/// cluster, as features register write stages and read guards. `()` is
/// the plain [`Shards::begin`].
pub(crate) trait BeginHook: Send + Sync {
    /// Opens a write transaction of group `G` for `key`.
    fn begin<G: EntityGroup>(
        &self,
        shards: &Shards,
        key: &G::Key,
    ) -> impl std::future::Future<Output = Result<Begun>> + Send;
}

impl BeginHook for () {
    fn begin<G: EntityGroup>(
        &self,
        shards: &Shards,
        key: &G::Key,
    ) -> impl std::future::Future<Output = Result<Begun>> + Send {
        shards.begin::<G>(key)
    }
}

/// The ticket servers' pools, in config order.
impl Shards {
    pub(crate) fn ticket_connections(&self) -> &[DatabaseConnection] {
        &self.inner.tickets
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
