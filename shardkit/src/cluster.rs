//! [`Cluster`]: the entry point, and the facade over shardkit's layers.
//!
//! A cluster is the connected databases (the execution layer's
//! `Shards`) plus the features built on them: ids,
//! global indexes, rollouts. It hands out reads ([`Cluster::find`]) and
//! transactions ([`Cluster::begin`]) and wires the features into them: the
//! write pipeline's stages ([`Stages`]) into every transaction, the global
//! index lookup into every read. See `ARCHITECTURE.md` for the layers.

use crate::clock::{Clock, SystemClock};
use crate::entity::{EntityGroup, ReferenceEntity, ShardedEntity};
use crate::error::{Result, ShardError};
use crate::exec::BeginHook;
use crate::exec::Shards;
use crate::gsi::{Gsi, GsiLookup, GsiState, IndexFirst, IndexState};
use crate::id_spec::IdStrategy;
use crate::ids::{FillIds, Ids, TicketServer};
use crate::job::JobControl;
use crate::read::{Find, IndexLookup, KeyOf, Keyed, Unkeyed};
use crate::rebalance::{Fenced, MoveReads};
use crate::reference::{Reference, References};
use crate::rollout::{DualWrite, Registry, Rollout, RolloutHandle, Rollouts};
use crate::topology::{ClusterConfig, Target, Topology};
use crate::verify::{VerifyOptions, VerifyReport};
use sea_orm::DatabaseConnection;
use sea_orm_migration::MigratorTrait;
use std::sync::Arc;

pub use crate::exec::shards::{StatementEvent, StatementObserver};
pub use crate::exec::{
    DatabaseMigrationStatus, Directory, MigrateOptions, MigrationProgress, MigrationReport,
};

/// A transaction pinned to one key of group `G` (see [`crate::tx::ShardTx`]),
/// whose writes run through the cluster's [`Stages`].
pub type ShardTx<G> = crate::tx::ShardTx<G, Stages>;

/// The write pipeline's stages, in the order they run (see
/// [`crate::pipeline`]): ids, then global indexes, then rollouts. A feature
/// that must see every write is one more member here.
#[doc(hidden)]
pub type Stages = (FillIds, (IndexFirst, DualWrite));

/// A sharded database cluster. Cheap to clone (two `Arc`s); share it.
///
/// Dropping the last handle (and the reads, transactions and rollout handles
/// made from it) stops the cluster's periodic tasks and closes its pools.
#[derive(Clone)]
pub struct Cluster {
    shards: Shards,
    features: Arc<Features>,
}

/// A [`Cluster`] that keeps nothing alive, for background tasks
/// ([`crate::exec::periodic`]): a pass upgrades it to a cluster that is not
/// a user, so a running task never keeps the cluster open.
pub(crate) struct WeakCluster {
    shards: <Shards as crate::exec::periodic::Handle>::Weak,
    features: std::sync::Weak<Features>,
}

impl crate::exec::periodic::Handle for Cluster {
    type Weak = WeakCluster;

    fn downgrade(&self) -> WeakCluster {
        WeakCluster {
            shards: crate::exec::periodic::Handle::downgrade(&self.shards),
            features: Arc::downgrade(&self.features),
        }
    }

    fn upgrade(weak: &WeakCluster) -> Option<Cluster> {
        Some(Cluster {
            shards: crate::exec::periodic::Handle::upgrade(&weak.shards)?,
            features: weak.features.upgrade()?,
        })
    }

    fn stop_signal(&self) -> &crate::exec::periodic::Stop {
        crate::exec::periodic::Handle::stop_signal(&self.shards)
    }
}

/// The state of the features built on the shards.
struct Features {
    ids: Ids,
    gsi: Arc<GsiState>,
    rollouts: Arc<Registry>,
    stages: Arc<Stages>,
    index: Arc<dyn IndexLookup>,
    guard: Arc<ReadGuards>,
    /// The bucket moves' guard alone, for the reads of features that
    /// choose their tables themselves (a rollout's old and new tables).
    moves: Arc<dyn crate::read::ReadGuard>,
    begin: Fenced,
    references: References,
}

/// What reads consult before they run, one guard per feature: the
/// rollouts (an old entity's reads served from the new table from
/// `read_new` on), then the bucket moves (a map read too long ago is read
/// again before a read is routed by it; the move mark of a count), then the
/// reference tables (a read that joins one never sees it go back).
type ReadGuards = (Arc<Registry>, (Arc<MoveReads>, References));

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
    /// lifetimes (default: [`SystemClock`]). Tests
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
        let shards = Shards::connect(&config, observer, Arc::clone(&clock)).await?;
        let servers = shards
            .topology()
            .ticket_servers()
            .iter()
            .zip(shards.ticket_connections())
            .map(|(spec, conn)| TicketServer::new(spec.name.clone(), conn.clone()))
            .collect();
        let ids = Ids::new(servers, config.ids.clone(), clock)?;
        let gsi = Arc::new(GsiState::new(&config, shards.topology()));
        let rollouts = Arc::new(Registry::default());
        let stages = Arc::new((
            FillIds::new(ids.clone()),
            (
                IndexFirst::new(Arc::clone(&gsi)),
                DualWrite::new(Arc::clone(&rollouts), Arc::clone(&gsi)),
            ),
        ));
        let index = Arc::new(GsiLookup::new(Arc::clone(&gsi)));
        crate::rebalance::load_maps(&shards).await?;
        shards.spawn_replica_probes();
        let refresh = shards.rebalance_settings().refresh;
        if !refresh.is_zero() && shards.topology().movable_groups().next().is_some() {
            crate::exec::periodic::spawn(
                &shards,
                refresh,
                crate::exec::periodic::FirstPass::AfterInterval,
                |shards| async move {
                    crate::rebalance::refresh_all(&shards).await;
                    std::ops::ControlFlow::Continue(())
                },
            );
        }
        let references = References::new(shards.for_task());
        let moves = Arc::new(MoveReads::new(shards.for_task()));
        let guard: Arc<ReadGuards> = Arc::new((
            Arc::clone(&rollouts),
            (Arc::clone(&moves), references.clone()),
        ));
        Ok(Cluster {
            shards,
            features: Arc::new(Features {
                ids,
                gsi,
                rollouts,
                stages,
                index,
                guard,
                moves,
                begin: Fenced,
                references,
            }),
        })
    }
}

/// The error of [`Cluster::try_transaction`], like SeaORM's
/// `TransactionError`: shardkit's own, or the work's.
#[derive(Debug)]
pub enum TransactionError<E> {
    /// Beginning or committing the transaction failed, or it was
    /// rollback-only; the work's effects are not committed.
    Connection(ShardError),
    /// The work returned this error; the transaction was rolled back.
    Transaction(E),
}

impl<E: std::fmt::Display> std::fmt::Display for TransactionError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransactionError::Connection(e) => std::fmt::Display::fmt(e, f),
            TransactionError::Transaction(e) => std::fmt::Display::fmt(e, f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for TransactionError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TransactionError::Connection(e) => Some(e),
            TransactionError::Transaction(e) => Some(e),
        }
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("shards", &self.shards.topology().shards())
            .field("directories", &self.shards.topology().directories())
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

    /// The execution layer, for the cross-key work built on the cluster.
    pub(crate) fn shards(&self) -> &Shards {
        &self.shards
    }

    /// The id service: ticket sequences, snowflakes.
    pub fn ids(&self) -> Ids {
        self.features.ids.clone()
    }

    /// The cluster's clock (see [`ClusterBuilder::clock`]).
    pub fn clock(&self) -> &Arc<dyn Clock> {
        self.shards.clock()
    }

    /// Whether shard `name` answers a fresh connection now: its circuit
    /// breaker's probe (the one running, or one that ended less than a
    /// second ago, answers instead of a new one). A failure marks the shard
    /// down, so later statements to it fail at once; a success marks it up.
    /// `Err` holds the cause as text, password scrubbed (`no shard ...` for
    /// a name the topology does not have), for a health page or an
    /// operator's `status`.
    pub async fn probe_shard(&self, name: &str) -> std::result::Result<(), String> {
        let id = self
            .shards
            .topology()
            .shard_id(name)
            .ok_or_else(|| format!("no shard `{name}`"))?;
        self.shards.health(id).check().await
    }

    /// Every shard's read replicas, each probed now (its lag against its
    /// shard, bounded by `[read] replica_timeout_ms`): whether reads may use
    /// it, its lag, and why it left the rotation when it did.
    pub async fn replicas(&self) -> Vec<crate::ReplicaStatus> {
        self.shards.replica_status().await
    }

    /// The validated topology.
    pub fn topology(&self) -> &Topology {
        self.shards.topology()
    }

    /// A shard's connection pool by name, for administration and for checking
    /// where rows landed. Statements sent through it bypass shardkit's checks.
    pub fn connection(&self, shard: &str) -> Option<&DatabaseConnection> {
        self.shards.connection(shard)
    }

    /// Where `key` of group `G` lives. Pure computation for hash, range and
    /// modulo placements; one lookup for directory placements.
    ///
    /// A `u64` key above `i64::MAX` routed to a PostgreSQL or SQLite shard is
    /// refused here ([`ShardError::Unroutable`]), before any statement binds
    /// it: those backends have no unsigned 64-bit type.
    pub async fn route<G: EntityGroup>(&self, key: &G::Key) -> Result<Target> {
        self.shards.route::<G>(key).await
    }

    /// [`route`](Self::route) without I/O: `Ok(None)` when the group's
    /// placement needs a lookup (directory), in which case call `route`.
    pub fn route_now<G: EntityGroup>(&self, key: &G::Key) -> Result<Option<Target>> {
        self.shards.route_now::<G>(key)
    }

    /// [`shard_of`](Self::shard_of) without I/O: `Ok(None)` when the group's
    /// placement needs a lookup (directory).
    pub fn shard_of_now<G: EntityGroup>(&self, key: &G::Key) -> Result<Option<&str>> {
        self.shards.shard_of_now::<G>(key)
    }

    /// The name of the shard `key` of group `G` lives on.
    pub async fn shard_of<G: EntityGroup>(&self, key: &G::Key) -> Result<&str> {
        self.shards.shard_of::<G>(key).await
    }

    /// Starts a read of entity `E`. A key must be given (`.key(k)`) before it
    /// can run; shardkit never guesses which shards to read.
    pub fn find<E: ShardedEntity>(&self) -> Find<E, Unkeyed> {
        Find::new(
            self.shards.clone(),
            Some(Arc::clone(&self.features.index)),
            Some(self.read_guard()),
            E::find(),
        )
    }

    /// The rows of `R` related to `model`, like SeaORM's
    /// [`ModelTrait::find_related`](sea_orm::ModelTrait::find_related): a
    /// keyed read of `R` on `model`'s shard key (its shard, its key's rows),
    /// joined to `model`'s row by the relation. Filter, order, page or
    /// project it like any keyed read.
    pub fn find_related<M, R>(&self, model: &M, related: R) -> Find<R, Keyed<KeyOf<R>>>
    where
        M: sea_orm::ModelTrait,
        M::Entity: ShardedEntity<Model = M> + sea_orm::Related<R>,
        R: crate::InGroup<<M::Entity as ShardedEntity>::Group>,
    {
        let key = <M::Entity as ShardedEntity>::shard_key(model);
        let guard = self.read_guard();
        // The model's side is joined from the table its reads go to (a
        // rollout's new table); a refusal is reported when the read runs.
        let m_from = crate::read::guard_check::<M::Entity>(Some(&*guard))
            .ok()
            .flatten();
        Find::new(
            self.shards.clone(),
            Some(Arc::clone(&self.features.index)),
            Some(guard),
            crate::read::related_select(model, related, m_from.as_ref()),
        )
        .joining::<M::Entity>()
        .key(key)
    }

    /// What reads consult before they run: rollouts serve reads of an old
    /// entity from the new table once the old one is no longer written.
    fn read_guard(&self) -> Arc<dyn crate::read::ReadGuard> {
        Arc::clone(&self.features.guard) as Arc<dyn crate::read::ReadGuard>
    }

    /// Opens a transaction for group `G` pinned to `key`, on the key's shard.
    /// Every write in it must carry that key.
    ///
    /// For a `movable` group, the transaction first checks its bucket's fence
    /// on the shard (see [`crate::rebalance`]); when the bucket has moved, it
    /// refreshes the bucket map and begins again on the new owner (waiting,
    /// for at most 15 s, while a cut-over is under way: a mover that died
    /// with the bucket fenced can be taken over 10 s after its last step),
    /// so the program sees a transaction on the right shard.
    pub async fn begin<G: EntityGroup>(&self, key: G::Key) -> Result<ShardTx<G>> {
        let begun = self.features.begin.begin::<G>(&self.shards, &key).await?;
        Ok(crate::tx::ShardTx::new(
            begun,
            self.shards.clone(),
            Arc::clone(&self.features.stages),
            Some(self.read_guard()),
            key,
        ))
    }

    /// Bucket moves of group `G` (a `movable` hash group): plan, start, run,
    /// resume and abort them, from this process or another (see
    /// [`crate::rebalance`]). Refused with [`ShardError::Rebalance`] when
    /// `G` is not a `movable` hash or range group.
    pub fn rebalance<G: EntityGroup>(&self) -> Result<crate::rebalance::Rebalance<G>> {
        crate::rebalance::Rebalance::new(self.shards.clone(), self.features.references.clone())
    }

    /// Reads every `movable` group's bucket map now (seeding it on first
    /// use), instead of waiting for the periodic refresh; returns nothing
    /// new when the epochs are unchanged.
    pub async fn refresh_bucket_maps(&self) -> Result<()> {
        crate::rebalance::load_maps(&self.shards).await
    }

    /// Runs `work` in a transaction for group `G` pinned to `key`: commits
    /// when it returns `Ok`, rolls back when it returns `Err`, and runs it
    /// again (in a new transaction, up to 3 attempts in all, after a short
    /// jittered pause: 4 ms, then 8 ms, plus up to 4 ms) when the
    /// database aborted the transaction — a deadlock or serialization
    /// failure, [`Retry::Transaction`](crate::Retry::Transaction) — in the
    /// work or in the commit (also when the work handled that error itself
    /// and then returned another, such as the
    /// [`RollbackOnly`](ShardError::RollbackOnly) refusal of its next
    /// statement, or `Ok`), or, after its short wait, when SQLite said
    /// `database is locked` (another writer, maybe another process, held a
    /// file's lock for the whole busy timeout). Any other error is returned
    /// at once.
    ///
    /// ```
    /// # use shardkit::prelude::*;
    /// # #[derive(EntityGroup)] #[shardkit(key = i64)] pub struct Customer;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> shardkit::Result<()> {
    /// # let cluster = Cluster::connect(ClusterConfig::from_toml(
    /// #     "shards = [{ name = \"s0\", url = \"sqlite::memory:\" }]\n[groups.Customer]\n",
    /// # )?).await?;
    /// let n = cluster
    ///     .transaction::<Customer, _, _>(42, |tx| async move {
    ///         // tx.insert(..).await?; tx.update(..).await?;
    ///         Ok(tx.key() * 2)
    ///     })
    ///     .await?;
    /// assert_eq!(n, 84);
    /// # Ok(()) }
    /// ```
    ///
    /// `work` gets the transaction behind an `Arc` so the future it returns
    /// can own it; it must not keep a clone past its own end (the commit
    /// needs the only one: a kept clone rolls the attempt back and returns
    /// [`ShardError::RollbackOnly`]).
    ///
    /// After the database aborted the transaction, shardkit refuses the
    /// work's later reads and writes through the [`ShardTx`]; statements it
    /// sends itself through
    /// [`unchecked_connection`](ShardTx::unchecked_connection) are not
    /// checked: on MySQL/MariaDB they run outside the rolled-back
    /// transaction, each committed on its own, and then again in the next
    /// attempt. Return the error of a statement sent that way.
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

    /// Runs `work` in a transaction for group `G` pinned to `key`, with an
    /// error type of the application's, like SeaORM's
    /// [`TransactionTrait::transaction`](sea_orm::TransactionTrait::transaction):
    /// commits when `work` returns `Ok`, rolls back and returns
    /// [`TransactionError::Transaction`] with the work's error when it
    /// returns `Err`, and returns [`TransactionError::Connection`] when
    /// beginning or committing fails (a
    /// [`ShardError`] whose [`retry`](ShardError::retry) says what to do).
    /// `work` runs once: unlike [`transaction`](Self::transaction), nothing
    /// is run again after an abort, since only the application knows
    /// whether its error came from one. An application error type that
    /// wraps `ShardError` (`From<ShardError>`) lets `?` work on shardkit's
    /// calls inside.
    ///
    /// ```
    /// # use shardkit::prelude::*;
    /// # #[derive(EntityGroup)] #[shardkit(key = i64)] pub struct Customer;
    /// #[derive(Debug)]
    /// enum AppError {
    ///     Db(ShardError),
    ///     TooLarge(i64),
    /// }
    /// impl From<ShardError> for AppError {
    ///     fn from(e: ShardError) -> Self {
    ///         AppError::Db(e)
    ///     }
    /// }
    /// impl std::fmt::Display for AppError {
    ///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    ///         match self {
    ///             AppError::Db(e) => write!(f, "{e}"),
    ///             AppError::TooLarge(n) => write!(f, "{n} is too large"),
    ///         }
    ///     }
    /// }
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> shardkit::Result<()> {
    /// # let cluster = Cluster::connect(ClusterConfig::from_toml(
    /// #     "shards = [{ name = \"s0\", url = \"sqlite::memory:\" }]\n[groups.Customer]\n",
    /// # )?).await?;
    /// let refused = cluster
    ///     .try_transaction::<Customer, i64, AppError, _>(42, |tx| async move {
    ///         let n = tx.key() * 2; // tx.insert(..).await?; ..
    ///         if n > 50 {
    ///             return Err(AppError::TooLarge(n)); // rolled back
    ///         }
    ///         Ok(n)
    ///     })
    ///     .await;
    /// assert!(matches!(
    ///     refused,
    ///     Err(shardkit::TransactionError::Transaction(AppError::TooLarge(84)))
    /// ));
    /// # Ok(()) }
    /// ```
    pub async fn try_transaction<G, T, E, Fut>(
        &self,
        key: G::Key,
        work: impl FnOnce(Arc<ShardTx<G>>) -> Fut,
    ) -> std::result::Result<T, TransactionError<E>>
    where
        G: EntityGroup,
        Fut: std::future::Future<Output = std::result::Result<T, E>>,
    {
        let tx = Arc::new(
            self.begin::<G>(key)
                .await
                .map_err(TransactionError::Connection)?,
        );
        let outcome = work(Arc::clone(&tx)).await;
        match (outcome, Arc::try_unwrap(tx)) {
            (Ok(value), Ok(tx)) => tx
                .commit()
                .await
                .map(|()| value)
                .map_err(TransactionError::Connection),
            (Err(err), Ok(tx)) => {
                // The work's error is the one to report; a failed rollback
                // only means the connection is gone too.
                let _ = tx.rollback().await;
                Err(TransactionError::Transaction(err))
            }
            (Err(err), Err(shared)) => {
                drop(shared);
                Err(TransactionError::Transaction(err))
            }
            (Ok(_), Err(shared)) => {
                let shard = shared.shard().to_owned();
                // Dropping the last clone rolls back.
                drop(shared);
                Err(TransactionError::Connection(ShardError::RollbackOnly {
                    group: G::NAME,
                    shard,
                    reason: "the transaction closure kept a clone of its ShardTx past its end; \
                             nothing was committed"
                        .to_owned(),
                }))
            }
        }
    }

    /// [`transaction`](Self::transaction) with at most `attempts` runs of
    /// `work` (at least 1).
    pub async fn transaction_attempts<G, T, Fut>(
        &self,
        key: G::Key,
        attempts: u32,
        work: impl FnMut(Arc<ShardTx<G>>) -> Fut,
    ) -> Result<T>
    where
        G: EntityGroup,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.run_transaction(key, attempts, None, work).await
    }

    /// [`transaction`](Self::transaction) whose commit is recorded in
    /// `session` ([`ShardTx::commit_in`](crate::tx::ShardTx::commit_in)),
    /// so reads with [`Consistency::AtLeast`](crate::Consistency::AtLeast)
    /// of the session see it, on a replica or on the shard.
    pub async fn transaction_in<G, T, Fut>(
        &self,
        session: &crate::Session,
        key: G::Key,
        work: impl FnMut(Arc<ShardTx<G>>) -> Fut,
    ) -> Result<T>
    where
        G: EntityGroup,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.run_transaction(key, 3, Some(session), work).await
    }

    async fn run_transaction<G, T, Fut>(
        &self,
        key: G::Key,
        attempts: u32,
        session: Option<&crate::Session>,
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
            // The database ended this attempt: whatever error `work` made
            // of that, a new attempt can succeed (`again_after_abort`).
            let aborted = tx.was_aborted();
            let result = match (outcome, Arc::try_unwrap(tx)) {
                (Ok(value), Ok(tx)) => match session {
                    Some(session) => tx.commit_in(session).await.map(|()| value),
                    None => tx.commit().await.map(|()| value),
                },
                (Err(err), Ok(tx)) => {
                    // The work's error is the one to report; a failed
                    // rollback only means the connection is gone too.
                    let _ = tx.rollback().await;
                    Err(err)
                }
                // Not run again, whatever ended the attempt: the kept clone
                // may hold the transaction, and its locks, open.
                (outcome, Err(shared)) => {
                    let shard = shared.shard().to_owned();
                    // Dropping the last clone rolls back.
                    drop(shared);
                    return outcome.and(Err(ShardError::RollbackOnly {
                        group: G::NAME,
                        shard,
                        reason: "the transaction closure kept a clone of its ShardTx past its \
                                 end; nothing was committed"
                            .to_owned(),
                    }));
                }
            };
            let err = match result {
                Ok(value) => return Ok(value),
                Err(err) => err,
            };
            if crate::error::again_after_abort(&err, aborted, attempt, attempts).await {
                tracing::debug!(group = G::NAME, attempt, error = %err.report(), "transaction retried");
            } else if attempt < attempts && err.is_sqlite_busy() {
                tracing::debug!(group = G::NAME, attempt, error = %err.report(), "transaction retried after a wait");
                if let crate::Retry::After(wait) = err.retry() {
                    tokio::time::sleep(wait).await;
                }
            } else {
                return Err(err);
            }
            attempt += 1;
        }
    }

    /// The lookup table of a directory-placed group.
    pub fn directory<G: EntityGroup>(&self) -> Result<Directory<G>> {
        self.shards.directory::<G>()
    }

    /// Creates what shardkit keeps for the entities `S` (one entity, or a
    /// tuple of up to 12), after [`migrate`](Self::migrate) has created their
    /// tables; safe to run again at every start:
    ///
    /// - for every `#[shardkit(global_index)]`: the index table on every
    ///   shard of the entity's group and its catalog row
    ///   ([`Gsi::create`]). A new index starts `write_only` (written by
    ///   every write, lookups scatter); [`Gsi::backfill`] indexes the rows
    ///   already there and activates it (at once on an empty table);
    /// - for every `#[shardkit(id = "ticket:<seq>")]` or
    ///   `"encoded:<seq>"`: the sequence's table on every ticket server
    ///   ([`Ids::create_sequence`]).
    ///
    /// ```
    /// # use shardkit::prelude::*;
    /// # #[derive(EntityGroup)] #[shardkit(key = i64)] pub struct User;
    /// pub mod photo {
    ///     use sea_orm::entity::prelude::*;
    ///
    ///     #[sea_orm::model]
    ///     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    ///     #[sea_orm(table_name = "photos")]
    ///     #[shardkit(group = crate::User)]
    ///     pub struct Model {
    ///         #[sea_orm(primary_key, auto_increment = false)]
    ///         #[shardkit(id = "ticket:photos")]
    ///         pub id: i64,
    ///         #[shardkit(shard_key)]
    ///         pub user_id: i64,
    ///         #[shardkit(global_index(unique))]
    ///         pub slug: String,
    ///     }
    ///
    ///     impl ActiveModelBehavior for ActiveModel {}
    /// }
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cluster = Cluster::connect(ClusterConfig::from_toml(r#"
    ///     shards = [{ name = "s0", url = "sqlite::memory:" }, { name = "s1", url = "sqlite::memory:" }]
    ///     [groups.User]
    ///     [ids]
    ///     servers = [{ name = "t0", url = "sqlite::memory:" }]
    /// "#)?).await?;
    /// cluster.migrate::<shardkit::migration::Migrator>().await?; // your Migrator, in an application
    /// let report = cluster.setup::<photo::Entity>().await?;     // or a tuple: (photo::Entity, ..)
    /// assert_eq!(report.sequences, ["photos"]);
    /// assert_eq!(report.indexes[0].0, "gsi_photos_slug");
    /// # Ok(()) }
    /// ```
    pub async fn setup<S: EntitySet>(&self) -> Result<SetupReport> {
        let mut report = SetupReport::default();
        S::setup(self, &mut report).await?;
        Ok(report)
    }

    /// [`setup`](Self::setup) of one entity.
    async fn setup_entity<E: ShardedEntity>(&self, report: &mut SetupReport) -> Result<()> {
        if !E::GLOBAL_INDEXES.is_empty() {
            self.gsi().create::<E>().await?;
            for (column, unique) in E::GLOBAL_INDEXES {
                let state = self.gsi().state::<E>(*column).await?;
                let table = crate::gsi::IndexDef::of::<E>(*column, *unique).table;
                report.indexes.push((table, state));
            }
        }
        if let Some((_, IdStrategy::Ticket(name) | IdStrategy::Encoded(name))) = E::ID
            && !report.sequences.iter().any(|s| s == name)
        {
            self.features.ids.create_sequence(name).await?;
            report.sequences.push(name.to_owned());
        }
        Ok(())
    }

    /// Applies migrator `M` to every shard and every directory database, and
    /// shardkit's own ticket-server migrations
    /// ([`shardkit_migration::TicketMigrator`], never `M`) to every ticket
    /// server, all of them concurrently, then creates the ticket sequences
    /// `[ids.sequences]` names ([`Ids::create_configured_sequences`]) and
    /// reports each database's status and what ran there. Fails with
    /// [`ShardError::Migration`] naming the first database (in the config's
    /// order) whose migration failed, after every other one has had its
    /// turn; [`migrate_with`](Self::migrate_with) reports every failure
    /// instead. The `movable` groups' bucket maps and every shard's bucket
    /// states are prepared whatever failed (a shard added to the config gets
    /// its states here, so moves can hand it buckets).
    ///
    /// What shardkit keeps beside an entity's own table (index tables, the
    /// ticket sequences its ids draw from) is created per entity by
    /// [`setup`](Self::setup); a write that finds such a table missing fails
    /// with an error that names that call.
    pub async fn migrate<M: MigratorTrait>(&self) -> Result<MigrationReport> {
        let (report, failed) = self.migrate_fleet::<M>(&MigrateOptions::new()).await?;
        match failed {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// [`migrate`](Self::migrate) a few databases at a time, with progress
    /// and cancellation ([`MigrateOptions`]), reporting every database's
    /// outcome instead of failing on the first: a database that failed has
    /// its error in [`DatabaseMigrationStatus::error`] and is in
    /// [`MigrationReport::failed`], and what ran on each one is in
    /// [`DatabaseMigrationStatus::ran`]. The next call resumes: each
    /// database applies only what it has not applied (SeaORM's migration
    /// table), so what succeeded elsewhere never runs again. On
    /// MySQL/MariaDB a migration's DDL is not transactional: a migration of
    /// several statements that fails half-way leaves its first statements
    /// applied, so write each one to be run again (`if_not_exists`), or one
    /// statement per migration. Fails only when the bucket maps or the
    /// configured ticket sequences cannot be prepared on a fleet that
    /// migrated without a failure.
    pub async fn migrate_with<M: MigratorTrait>(
        &self,
        options: MigrateOptions,
    ) -> Result<MigrationReport> {
        Ok(self.migrate_fleet::<M>(&options).await?.0)
    }

    async fn migrate_fleet<M: MigratorTrait>(
        &self,
        options: &MigrateOptions,
    ) -> Result<(MigrationReport, Option<ShardError>)> {
        let (report, failed) = self.shards.migrate_with::<M>(options).await;
        // Cancelled: databases were left as they were; what follows a
        // migration waits for the run that finishes it.
        if options.cancelled() {
            return Ok((report, failed));
        }
        // The movable groups' maps and every shard's bucket states (a shard
        // added to the config gets its own), even when a database failed
        // (a ticket server down): a half-done set-up must not leave a map
        // whose fences refuse every write.
        let complete = report.failed().is_empty();
        match crate::rebalance::load_maps(&self.shards).await {
            Err(e) if complete => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e.report(), "bucket maps not prepared; a migration failed too")
            }
            Ok(()) => {}
        }
        if complete {
            self.features.ids.create_configured_sequences().await?;
        }
        Ok((report, failed))
    }

    /// The migration status of every shard and directory database (against
    /// `M`) and of every ticket server (against shardkit's ticket-server
    /// migrations), without changing anything (beyond creating SeaORM's
    /// migration table if missing). A database that cannot be read is in
    /// the report with its [`error`](DatabaseMigrationStatus::error), and
    /// counts as [`behind`](MigrationReport::behind);
    /// [`MigrationReport::versions`] groups the databases by the last
    /// migration each has applied (drift).
    pub async fn migration_status<M: MigratorTrait>(&self) -> Result<MigrationReport> {
        Ok(self.shards.migration_status::<M>().await)
    }

    /// Reference table `E` (`#[shardkit(reference)]`): its versioned
    /// writes to every shard, its reads, status and verification (see
    /// [`crate::reference`]). Registers the table with this instance: from
    /// now on its background task brings copies that are behind up to date,
    /// and its bucket moves bring the table to their target before the
    /// cut-over.
    pub fn reference<E: ReferenceEntity + 'static>(&self) -> Reference<E> {
        Reference::new(self.features.references.clone())
    }

    /// Global secondary indexes: create, backfill, reconcile.
    pub fn gsi(&self) -> Gsi {
        Gsi::new(&self.shards, &self.features.gsi)
    }

    /// The next id of sequence `name` with `key`'s bucket in its low
    /// [`BUCKET_BITS`](crate::ids::BUCKET_BITS) bits, so
    /// [`Cluster::route_id`] finds the shard from the id alone (Instagram's
    /// layout, with a ticket sequence where Instagram used time, so ids stay
    /// unique across processes). The group must use a hash placement with at
    /// most 8,192 buckets.
    pub async fn next_encoded_id<G: EntityGroup>(&self, name: &str, key: &G::Key) -> Result<i64> {
        self.features
            .ids
            .next_encoded::<G>(self.topology(), name, key)
            .await
    }

    /// The shard a shard-encoded id ([`Cluster::next_encoded_id`]) belongs to, from
    /// the id alone.
    pub fn route_id<G: EntityGroup>(&self, id: i64) -> Result<Target> {
        crate::ids::route_id::<G>(self.topology(), id)
    }

    /// Registers a rollout from `Old` to `New`. From now on every
    /// [`ShardTx`] write of `Old` follows the rollout's phase;
    /// the code that writes `Old` does not change.
    ///
    /// Creates the rollout's row in `shardkit_rollouts` (phase `off`) when it
    /// is the first instance to register it, and raises the stored gap to
    /// this instance's cache TTL + refresh interval when that is longer.
    /// Refused when `Old` already has a rollout on this cluster, or when the
    /// two entities' primary keys have different numbers of columns.
    pub fn register_rollout<Old, New>(
        &self,
        rollout: Rollout<Old, New>,
    ) -> futures::future::BoxFuture<'_, Result<RolloutHandle<Old, New>>>
    where
        Old: ShardedEntity,
        New: ShardedEntity<Group = Old::Group>,
    {
        // Boxed so that a `New` of another group is one compile error.
        crate::boxed::boxed(move || async move { self.rollouts().register(rollout).await })
    }

    /// The rollouts other instances registered whose old entity this
    /// instance has written (or tried to: a write counts from its start,
    /// failed or not) without registering them, as (old table,
    /// rollout) pairs: its writes of those tables are neither dual-written
    /// nor cached. Each is also logged once at warn level. Found from
    /// `shardkit_rollout_instances`, re-read in the background every 30 s
    /// (one table per group) from this instance's first write on, so a
    /// write shortly after another instance registers may not be listed
    /// yet.
    pub fn rollouts_not_registered(&self) -> Vec<(String, String)> {
        self.features.rollouts.watch.not_registered()
    }

    /// The rollout registered for `Old` on this cluster. Refused with
    /// [`ShardError::Config`] when `Old` has none, or has one to another
    /// entity than `New`.
    pub fn rollout<Old, New>(&self) -> Result<RolloutHandle<Old, New>>
    where
        Old: ShardedEntity,
        New: ShardedEntity<Group = Old::Group>,
    {
        self.rollouts().handle::<Old, New>()
    }

    fn rollouts(&self) -> Rollouts<'_> {
        Rollouts {
            registry: &self.features.rollouts,
            shards: &self.shards,
            gsi: &self.features.gsi,
            moves: &self.features.moves,
        }
    }

    /// Compares `E`'s rows on shard `source` with those on shard `target`
    /// (for a bucket move: only rows whose shard key falls in `bucket`, when
    /// given), chunk by chunk, reporting rows missing from, extra on or
    /// different on the target; [`VerifyOptions::repair`] makes the target
    /// match. Without a bucket, and with both shards on PostgreSQL or both on
    /// MySQL/MariaDB, chunk digests are computed in the databases.
    pub async fn verify_shards<E>(
        &self,
        source: &str,
        target: &str,
        bucket: Option<u32>,
        opts: VerifyOptions,
    ) -> Result<VerifyReport>
    where
        E: ShardedEntity,
    {
        self.verify_shards_with::<E>(source, target, bucket, opts, JobControl::new())
            .await
    }

    /// [`verify_shards`](Self::verify_shards) with a [`JobControl`]: its
    /// progress callback is called with the report so far after every
    /// chunk, and once its token is cancelled the comparison stops at the
    /// next chunk boundary and returns the report so far (`finished: false`)
    /// with its position in [`VerifyReport::cursor`]; pass that to
    /// [`VerifyOptions::start_at`] to resume (nothing is saved in the
    /// databases).
    pub async fn verify_shards_with<E>(
        &self,
        source: &str,
        target: &str,
        bucket: Option<u32>,
        opts: VerifyOptions,
        control: JobControl<VerifyReport>,
    ) -> Result<VerifyReport>
    where
        E: ShardedEntity,
    {
        crate::verify::verify_shards::<E>(&self.shards, source, target, bucket, opts, control).await
    }
}

/// The entities [`Cluster::setup`] prepares: one entity, or a tuple of up to
/// 12 (`(user::Entity, photo::Entity)`).
pub trait EntitySet {
    /// Prepares each entity in order.
    #[doc(hidden)]
    fn setup(
        cluster: &Cluster,
        report: &mut SetupReport,
    ) -> impl std::future::Future<Output = Result<()>> + Send;
}

impl<E: ShardedEntity> EntitySet for E {
    async fn setup(cluster: &Cluster, report: &mut SetupReport) -> Result<()> {
        cluster.setup_entity::<E>(report).await
    }
}

macro_rules! entity_set {
    ($($e:ident),+) => {
        impl<$($e: ShardedEntity),+> EntitySet for ($($e,)+) {
            async fn setup(cluster: &Cluster, report: &mut SetupReport) -> Result<()> {
                $(cluster.setup_entity::<$e>(report).await?;)+
                Ok(())
            }
        }
    };
}

entity_set!(A);
entity_set!(A, B);
entity_set!(A, B, C);
entity_set!(A, B, C, D);
entity_set!(A, B, C, D, E);
entity_set!(A, B, C, D, E, F);
entity_set!(A, B, C, D, E, F, G);
entity_set!(A, B, C, D, E, F, G, H);
entity_set!(A, B, C, D, E, F, G, H, I);
entity_set!(A, B, C, D, E, F, G, H, I, J);
entity_set!(A, B, C, D, E, F, G, H, I, J, K);
entity_set!(A, B, C, D, E, F, G, H, I, J, K, L);

/// What [`Cluster::setup`] created or found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetupReport {
    /// Each global index's table and its state (`WriteOnly` until a
    /// backfill activates it).
    pub indexes: Vec<(String, IndexState)>,
    /// The ticket sequences the entities' ids draw from.
    pub sequences: Vec<String>,
}

impl std::fmt::Display for SetupReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (table, state) in &self.indexes {
            writeln!(f, "index {table}: {state:?}")?;
        }
        for name in &self.sequences {
            writeln!(f, "sequence {name}: tickets_{name}")?;
        }
        Ok(())
    }
}
