//! [`ShardError`], its kinds and what a caller can do about each.

use crate::error::Bounded;
use crate::error::DriverCause;
use crate::error::DriverError;
use crate::error::Origin;
use crate::error::Retry;
use crate::error::db_retry;
use crate::error::is_sqlite_busy;
use sea_orm::DbErr;

/// `Result` with [`ShardError`] as the default error.
pub type Result<T, E = ShardError> = std::result::Result<T, E>;

/// How often the breaker probes a down shard, and so how long
/// [`ShardError::Unavailable`] tells a caller to wait before retrying.
pub(crate) const REPROBE: std::time::Duration = std::time::Duration::from_millis(500);

/// Everything that can go wrong in shardkit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// The cluster configuration is invalid. `entry` names the offending part,
    /// e.g. `shards[2] ("s2")` or `groups.Customer.buckets[1]`.
    #[error("invalid shardkit config at {entry}: {message}")]
    Config {
        /// Where in the config the problem is.
        entry: String,
        /// What is wrong and how to fix it.
        message: String,
    },

    /// A shard's database could not be reached when the cluster connected.
    #[error("cannot connect to shard `{shard}` at {url}: {cause}")]
    Connect {
        /// The logical shard (or directory database) being connected.
        shard: String,
        /// The URL with its password replaced by `***`.
        url: String,
        /// The driver's error, with the password scrubbed from it; also
        /// the error's [`source`](std::error::Error::source).
        #[source]
        cause: DriverError,
    },

    /// A statement failed on a shard (or a directory database or ticket
    /// server). The message ends with the driver's own error, once: its
    /// message and code (`(code: 5) database is locked` on SQLite,
    /// `deadlock detected (SQLSTATE 40P01)` on PostgreSQL, `1213 (40001):
    /// Deadlock found ...` on MySQL/MariaDB). SeaORM's error stays the
    /// [`source`](std::error::Error::source), for code that inspects it;
    /// [`ShardError::report`] does not print it again.
    #[error("{operation} on `{shard}` ({origin}) failed: {}", DriverCause(source))]
    Db {
        /// Whose statement it was: an entity group's rows, or which
        /// subsystem's table.
        origin: Box<Origin>,
        /// The shard it ran on.
        shard: String,
        /// What shardkit was doing (`select orders`, `insert orders`, `commit`, ...).
        operation: String,
        /// SeaORM's error.
        #[source]
        source: DbErr,
    },

    /// A write inside a [`ShardTx`](crate::ShardTx) carried a row whose shard key
    /// is not the transaction's key. Nothing was sent to the database, and the
    /// transaction is now rollback-only.
    #[error(
        "cross-shard write refused: `{entity}` row has {column} = {found}, but the transaction \
         is pinned to {column} = {expected}; open a transaction for that key instead"
    )]
    CrossShardWrite {
        /// The entity (table) being written.
        entity: &'static str,
        /// The shard key column.
        column: &'static str,
        /// The transaction's key.
        expected: String,
        /// The key the row carries.
        found: String,
    },

    /// A write carried an ActiveModel whose shard key is not set, so it cannot be
    /// checked against the transaction's key. Nothing was sent to the database.
    #[error(
        "`{entity}` write has no shard key: set `{column}` on the ActiveModel (to the \
         transaction's key) before writing it"
    )]
    MissingShardKey {
        /// The entity (table) being written.
        entity: &'static str,
        /// The shard key column that was `NotSet`.
        column: &'static str,
    },

    /// The transaction refused an earlier write (cross-shard or without a shard
    /// key), a write stage or a batch written row by row failed in it, or the
    /// database ended it during one of its writes or reads (a deadlock, a
    /// serialization failure: the database has rolled it back, and on
    /// MySQL/MariaDB later statements would run outside it; after that, reads
    /// are refused too), so it can only be rolled back. Nothing it did was
    /// committed. Its [`retry`](Self::retry) is `Never`, but
    /// [`Cluster::transaction`](crate::Cluster::transaction) runs its work
    /// again when the database ended the transaction. (Another error of a
    /// one-row write's or a read's statement, a unique violation or
    /// MySQL/MariaDB's lock wait timeout, say, does not poison it; the
    /// caller decides, as with any SeaORM transaction.)
    #[error(
        "transaction for group `{group}` on shard `{shard}` is rollback-only after an earlier \
         error ({reason}); nothing was committed"
    )]
    RollbackOnly {
        /// The transaction's group.
        group: &'static str,
        /// The transaction's shard.
        shard: String,
        /// The first error that poisoned it.
        reason: String,
    },

    /// The group has no entry in the cluster config.
    #[error(
        "entity group `{group}` has no placement: add a `[groups.{group}]` table to the cluster config (configured groups: {configured})"
    )]
    UnknownGroup {
        /// The group's name (`EntityGroup::NAME`).
        group: String,
        /// The groups the config does define.
        configured: String,
    },

    /// A key could not be placed on any shard: outside every configured range,
    /// absent from the directory, or of a type the placement cannot handle.
    #[error("cannot route group `{group}` key {key}: {reason}")]
    Unroutable {
        /// The group.
        group: &'static str,
        /// The key (Debug form).
        key: String,
        /// Why no shard takes it.
        reason: String,
    },

    /// A read over several shards failed on some of them, and the caller did
    /// not ask for partial results (`.partial()`). Lists every failed shard
    /// with its cause.
    #[error(
        "{} of {asked} shards failed reading `{table}` (group `{group}`): {}",
        failures.len(),
        list_failures(failures)
    )]
    ShardsFailed {
        /// The group read.
        group: &'static str,
        /// The table read.
        table: &'static str,
        /// How many shards were asked.
        asked: usize,
        /// Each failed shard and why.
        failures: Vec<ShardFailure>,
    },

    /// A shard did not answer within the read timeout. shardkit stopped waiting
    /// and dropped the statement's future (its connection is discarded); the
    /// database may still finish the statement unless it has a server-side
    /// limit (`statement_timeout`, `max_statement_time`).
    #[error(
        "shard `{shard}` (group `{group}`) did not answer within {after:?}; shardkit stopped waiting"
    )]
    Timeout {
        /// The group read.
        group: &'static str,
        /// The slow shard.
        shard: String,
        /// The timeout that fired.
        after: std::time::Duration,
    },

    /// The shard is marked down: a connection attempt failed (refused, or
    /// no answer within the connect timeout). Requests of that shard fail
    /// with this at once, without I/O, until a background probe reaches it
    /// again.
    #[error("shard `{shard}` is unavailable ({cause}); requests fail fast until it answers again")]
    Unavailable {
        /// The shard.
        shard: String,
        /// Why the last connection attempt failed (driver message, password scrubbed).
        cause: String,
    },

    /// A multi-shard read asked for something that cannot be merged correctly
    /// from per-shard results.
    #[error("cannot merge a multi-shard read of `{table}`: {reason}")]
    Unmergeable {
        /// The table read.
        table: &'static str,
        /// What cannot be merged.
        reason: String,
    },

    /// An operation asked for something shardkit cannot do safely for this
    /// entity (or, for a transaction, while one of its streams is open);
    /// nothing was sent. The reason says what to do instead.
    #[error("{operation} of `{table}` is refused: {reason}")]
    Unsupported {
        /// The table written.
        table: &'static str,
        /// The operation (`update_many`, ...).
        operation: &'static str,
        /// Why, and what to do instead.
        reason: String,
    },

    /// A unique global index already maps this value to another live row (or
    /// to a write still in flight). Reported only on the database's
    /// unique-violation code; a claim the database aborted (a deadlock) or
    /// could not run is a [`ShardError::Db`]. The message quotes at most the
    /// value's first 64 characters.
    #[error(
        "unique index `{index}` already holds value {} for another row",
        Bounded(value)
    )]
    UniqueViolation {
        /// The index table.
        index: String,
        /// The value.
        value: String,
    },

    /// A value is longer than a global index holds
    /// ([`MAX_VALUE_CHARS`](crate::gsi::MAX_VALUE_CHARS)). Refused before any
    /// I/O on every backend; nothing was written.
    #[error(
        "value for global index `{index}` is {chars} characters long; an index value holds at \
         most {max} (value starts {prefix:?})"
    )]
    IndexValueTooLong {
        /// The index table.
        index: String,
        /// The value's length in characters.
        chars: usize,
        /// The most an index value holds.
        max: usize,
        /// The value's first 64 characters.
        prefix: String,
    },

    /// No ticket server could hand out a ticket for the sequence.
    #[error("no ticket server could serve sequence `{sequence}`: {causes}")]
    IdsUnavailable {
        /// The sequence.
        sequence: String,
        /// Each server's failure, in the order the servers were asked.
        causes: String,
        /// The last server's own error, when it was one (a connect or
        /// statement failure; not a refusal such as a missing place): the
        /// error's [`source`](std::error::Error::source), so a chain walks
        /// to the driver's error.
        #[source]
        last: Option<std::sync::Arc<ShardError>>,
    },

    /// A ticket sequence has no ids left: its next block, `ticket × block`,
    /// would pass `i64::MAX`. No id was handed out (ids never wrap
    /// negative), and retrying never helps: the sequence's counter only
    /// grows. Its users need a new sequence (or a wider id).
    #[error(
        "sequence `{sequence}` is exhausted: ticket {ticket} × block {block} is past the largest \
         id, {}",
        i64::MAX
    )]
    SequenceExhausted {
        /// The sequence.
        sequence: String,
        /// The ticket drawn.
        ticket: u64,
        /// Ids per ticket (`[ids.sequences.<name>] block`).
        block: u64,
    },

    /// The clock stepped back further than the snowflake generator waits out;
    /// no id was made (it could have repeated one).
    #[error("the clock moved back {millis} ms; refusing to make snowflake ids until it catches up")]
    ClockMovedBackwards {
        /// How far back.
        millis: u64,
    },

    /// A rollout phase change came sooner after the previous one than the
    /// rollout's gap (the longest cache TTL plus refresh interval of any
    /// instance that registered it): cache objects of the previous phase may
    /// still be served somewhere. Nothing was changed.
    ///
    /// A backfill asked for too soon after the move to `dual_write` has
    /// `from == to == dual_write`: instances may still act on `cache_both`
    /// and write rows the copy would miss.
    #[error("{}", too_soon_message(.rollout, *.from, *.to, *.elapsed_ms, *.gap_ms, *.wait_ms))]
    RolloutTooSoon {
        /// The rollout.
        rollout: String,
        /// Its phase.
        from: crate::phase::Phase,
        /// The phase asked for.
        to: crate::phase::Phase,
        /// Time since the previous change.
        elapsed_ms: u64,
        /// The required gap.
        gap_ms: u64,
        /// How much longer to wait.
        wait_ms: u64,
    },

    /// A rollout refused an operation in its current phase (a write of the
    /// old entity after `Done`, a backfill before dual writes, a phase change
    /// another instance made first, ...). Nothing was written.
    #[error("rollout `{rollout}` (phase {phase}) refused: {reason}")]
    Rollout {
        /// The rollout.
        rollout: String,
        /// Its phase when it refused.
        phase: crate::phase::Phase,
        /// Why, and what to do instead.
        reason: String,
    },

    /// The key's bucket has moved off (or is being cut over from) the shard
    /// the write was routed to: that shard's fence refused it inside its
    /// transaction, and nothing was written. [`Cluster::begin`] refreshes the
    /// bucket map and retries on the new owner, so a program sees this only
    /// when the cut-over took longer than the retries waited.
    ///
    /// [`Cluster::begin`]: crate::Cluster::begin
    #[error(
        "bucket {bucket} of group `{group}` is {state} on shard `{shard}`: its writes go to the bucket's new owner (refresh the bucket map and retry)"
    )]
    BucketMoved {
        /// The group.
        group: &'static str,
        /// The bucket.
        bucket: u32,
        /// The shard that refused.
        shard: String,
        /// What the shard's fence says (`moved`, `none`, or `cutting over`).
        state: String,
    },

    /// A read of a `movable` group was refused: this instance last read the
    /// group's bucket map longer ago than three quarters of
    /// `cleanup_grace_ms` (or never), and reading it again failed: the
    /// control database out of reach, slower than the read's timeout, or
    /// holding an older map than this instance (restored or failed over to
    /// an older copy). A bucket
    /// moved since the map was read may have left its old shard by now, so
    /// routing by it could miss rows; nothing was read. Writes are not
    /// affected (each shard's fence checks them). Retry once the control
    /// database answers; a longer `cleanup_grace_ms` rides out longer
    /// outages of it.
    #[error(
        "bucket map of group `{group}` {} (a read needs it read within three quarters of the cleanup grace, {:?}): a moved bucket's old rows may be gone, so the read is refused; reading the map again failed: {cause}",
        age.map_or_else(|| "never read since this instance connected".to_owned(), |a| format!("last read {}s ago", a.as_secs())),
        grace
    )]
    BucketMapExpired {
        /// The group read.
        group: &'static str,
        /// How long ago the map was last read (`None`: never, since this
        /// instance connected).
        age: Option<std::time::Duration>,
        /// The group's `cleanup_grace_ms`.
        grace: std::time::Duration,
        /// Why reading the map failed (the control database's error).
        cause: String,
    },

    /// A bucket move was refused or cannot go on (an overlapping move, a
    /// plan naming an unknown shard, an abort after the cut-over, rows that
    /// still differ after catch-up). Nothing was changed by the refused call.
    #[error("bucket move{} of group `{group}` refused: {reason}", .id.map(|i| format!(" #{i}")).unwrap_or_default())]
    Rebalance {
        /// The group.
        group: String,
        /// The move, when one is meant.
        id: Option<i64>,
        /// Why, and what to do instead.
        reason: String,
    },

    /// An invariant of shardkit's own broke: a bug in shardkit, never the
    /// caller's input. Nothing more was written after it was found (a
    /// transaction it happened in is rolled back). Please report it with
    /// the message.
    #[error("shardkit bug: {what} (please report this)")]
    Internal {
        /// What was found broken, and where.
        what: String,
    },

    /// A session token ([`Session`](crate::Session)'s text, carried in a
    /// cookie or header) could not be read. Nothing was read or written.
    #[error("invalid session token: {reason}")]
    InvalidSession {
        /// What is wrong with it.
        reason: String,
    },

    /// Cross-key work was refused: a message that cannot be encoded,
    /// decoded or matched to its type, a saga that cannot go on, a stored
    /// outcome that does not decode, an unknown message or saga id. `what`
    /// names the message (`message \`credit\` 0190…`), saga or request;
    /// nothing was written.
    #[error("{what}: {reason}")]
    CrossKey {
        /// The message, saga or request concerned.
        what: String,
        /// What is wrong, and what to do.
        reason: String,
    },

    /// A write to a reference table was refused before it changed anything:
    /// an insert of a primary key the table has, an update or delete of one
    /// it lacks.
    #[error("reference table `{table}`: {reason}")]
    Reference {
        /// The reference table.
        table: &'static str,
        /// What is wrong, and what to do.
        reason: String,
    },

    /// A read that joins a reference table found the table's copy on the
    /// key's shard older than a version this instance has read or written
    /// before: the copy was set back (a restore of the shard), or a write
    /// did not reach it and its catch-up has not run yet. No row was
    /// returned. The background catch-up brings the copy up (it runs about
    /// once a second): [`Retry::After`] that.
    #[error(
        "the copy of reference table `{table}` on `{shard}` is at version {have}, older than version {need} this instance has read"
    )]
    ReferenceBehind {
        /// The reference table.
        table: &'static str,
        /// The shard whose copy is behind.
        shard: String,
        /// The copy's version.
        have: i64,
        /// The version the read needed.
        need: i64,
    },

    /// Applying migrations to a shard failed. Like [`ShardError::Db`], the
    /// message ends with the driver's own error.
    #[error("migrating shard `{shard}` failed: {}", DriverCause(source))]
    Migration {
        /// The shard (or directory database) being migrated.
        shard: String,
        /// SeaORM's error.
        #[source]
        source: DbErr,
    },
}

/// A coarse classification of [`ShardError`] for callers that branch on it
/// (retry, report, fix config) without matching every variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The configuration is wrong; fix it and restart.
    Config,
    /// A database could not be reached or a statement failed; may be transient.
    Database,
    /// The program asked for something shardkit refuses (cross-shard write,
    /// missing key, poisoned transaction), or a sequence is exhausted;
    /// retrying the same call will not help.
    Refused,
    /// The key has no shard.
    Routing,
    /// A broken invariant of shardkit's own ([`ShardError::Internal`]): a
    /// bug, never the caller's input.
    Internal,
}

impl ShardError {
    /// A `Timeout` that fired on what was left of a longer budget, reported
    /// with the whole budget `after` (what the caller set); other errors as
    /// they are.
    pub(crate) fn timed_out_after(self, after: std::time::Duration) -> Self {
        match self {
            ShardError::Timeout { group, shard, .. } => ShardError::Timeout {
                group,
                shard,
                after,
            },
            other => other,
        }
    }

    /// The shard this error happened on, when it names one.
    pub(crate) fn shard(&self) -> Option<&str> {
        match self {
            ShardError::Db { shard, .. }
            | ShardError::Timeout { shard, .. }
            | ShardError::BucketMoved { shard, .. }
            | ShardError::Unavailable { shard, .. } => Some(shard),
            _ => None,
        }
    }

    /// Which kind of error this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ShardError::Config { .. } | ShardError::UnknownGroup { .. } => ErrorKind::Config,
            ShardError::Connect { .. }
            | ShardError::Db { .. }
            | ShardError::Migration { .. }
            | ShardError::ShardsFailed { .. }
            | ShardError::Timeout { .. }
            | ShardError::Unavailable { .. }
            | ShardError::IdsUnavailable { .. }
            | ShardError::ReferenceBehind { .. }
            | ShardError::BucketMapExpired { .. }
            | ShardError::ClockMovedBackwards { .. } => ErrorKind::Database,
            ShardError::CrossShardWrite { .. }
            | ShardError::MissingShardKey { .. }
            | ShardError::RollbackOnly { .. }
            | ShardError::Unmergeable { .. }
            | ShardError::Unsupported { .. }
            | ShardError::UniqueViolation { .. }
            | ShardError::IndexValueTooLong { .. }
            | ShardError::RolloutTooSoon { .. }
            | ShardError::Rebalance { .. }
            | ShardError::SequenceExhausted { .. }
            | ShardError::InvalidSession { .. }
            | ShardError::CrossKey { .. }
            | ShardError::Reference { .. }
            | ShardError::Rollout { .. } => ErrorKind::Refused,
            ShardError::Unroutable { .. } | ShardError::BucketMoved { .. } => ErrorKind::Routing,
            ShardError::Internal { .. } => ErrorKind::Internal,
        }
    }

    /// Whether the database ended the transaction with this error: a
    /// deadlock or a serialization failure ([`Retry::Transaction`]), not
    /// MySQL/MariaDB's lock wait timeout, which ends only the statement.
    pub(crate) fn ended_transaction(&self) -> bool {
        self.retry() == Retry::Transaction
            && !matches!(self, ShardError::Db { source, .. }
                if crate::error::is_lock_wait_timeout(source))
    }

    /// What a caller can do about this error: never retry, retry the same
    /// call now, retry after a delay, or run the whole transaction again.
    ///
    /// Database errors are classified by the driver's own codes, never by
    /// message text: PostgreSQL SQLSTATE `40001` (serialization failure) and
    /// `40P01` (deadlock), MySQL/MariaDB errors 1213 (deadlock) and 1205
    /// (lock wait timeout) abort the transaction ([`Retry::Transaction`]);
    /// a lost connection and a pool timeout are transient ([`Retry::Now`]);
    /// SQLite's `SQLITE_BUSY`/`SQLITE_LOCKED` (`database is locked`: another
    /// writer, maybe another process, held the file's write lock for the
    /// whole busy timeout) is [`Retry::After`] a short wait (50 ms; retrying
    /// at once meets the same writer); a server at its connection
    /// limit (PostgreSQL `53300` "too many clients", MySQL/MariaDB 1040
    /// "Too many connections" and 1203) is [`Retry::After`] a short wait
    /// (100 ms), and does not mark the shard down; a shard marked down
    /// ([`ShardError::Unavailable`]) is [`Retry::After`] its next probe; a unique or foreign-key
    /// violation and every other statement error are [`Retry::Never`].
    pub fn retry(&self) -> Retry {
        match self {
            ShardError::Db { source, .. } => db_retry(source),
            ShardError::Connect { .. }
            | ShardError::Timeout { .. }
            | ShardError::IdsUnavailable { .. }
            | ShardError::BucketMoved { .. } => Retry::Now,
            ShardError::ShardsFailed { failures, .. } => failures
                .iter()
                .map(|f| f.error.retry())
                .max_by_key(|r| match r {
                    Retry::Now => 1,
                    Retry::After(_) => 2,
                    Retry::Transaction => 3,
                    Retry::Never => 4,
                })
                .unwrap_or(Retry::Never),
            ShardError::Unavailable { .. } => Retry::After(REPROBE),
            ShardError::ReferenceBehind { .. } | ShardError::BucketMapExpired { .. } => {
                Retry::After(std::time::Duration::from_secs(1))
            }
            ShardError::ClockMovedBackwards { millis } => {
                Retry::After(std::time::Duration::from_millis(*millis))
            }
            ShardError::RolloutTooSoon { wait_ms, .. } => {
                Retry::After(std::time::Duration::from_millis(*wait_ms))
            }
            ShardError::Config { .. }
            | ShardError::Internal { .. }
            | ShardError::UnknownGroup { .. }
            | ShardError::Migration { .. }
            | ShardError::CrossShardWrite { .. }
            | ShardError::MissingShardKey { .. }
            | ShardError::RollbackOnly { .. }
            | ShardError::Unmergeable { .. }
            | ShardError::Unsupported { .. }
            | ShardError::UniqueViolation { .. }
            | ShardError::IndexValueTooLong { .. }
            | ShardError::Rollout { .. }
            | ShardError::Rebalance { .. }
            | ShardError::SequenceExhausted { .. }
            | ShardError::InvalidSession { .. }
            | ShardError::CrossKey { .. }
            | ShardError::Reference { .. }
            | ShardError::Unroutable { .. } => Retry::Never,
        }
    }

    /// Whether this is SQLite's `database is locked` (see
    /// [`retry`](Self::retry)).
    pub(crate) fn is_sqlite_busy(&self) -> bool {
        matches!(self, ShardError::Db { source, .. } if is_sqlite_busy(source))
    }

    /// The message with every cause, each once, for logs and reports.
    ///
    /// Every variant's message already ends with its root cause (the
    /// driver's message for [`ShardError::Db`] and [`ShardError::Migration`];
    /// a scrubbed cause for [`ShardError::Connect`] and
    /// [`ShardError::Unavailable`]), so this is the message: the typed
    /// [`source`](std::error::Error::source) kept beside it (SeaORM's
    /// `DbErr`, whose own message repeats the driver's at every level) is
    /// not printed again. A chain printer that walks `source()` (`{:#}` of
    /// `anyhow`) shows the driver's message more than once; log this
    /// instead.
    pub fn report(&self) -> Report<'_> {
        Report(self)
    }

    /// A [`ShardError::Db`]: `operation` failed on `shard` with SeaORM's
    /// error `source`, for `origin` (an entity group's rows, or which
    /// subsystem's table). The one constructor of a failed statement.
    pub(crate) fn db(
        origin: Origin,
        shard: impl Into<String>,
        operation: impl Into<String>,
        source: DbErr,
    ) -> Self {
        ShardError::Db {
            origin: Box::new(origin),
            shard: shard.into(),
            operation: operation.into(),
            source,
        }
    }

    /// A [`ShardError::Internal`]: an invariant of shardkit's own broke.
    pub(crate) fn internal(what: impl Into<String>) -> Self {
        ShardError::Internal { what: what.into() }
    }

    /// A [`ShardError::Config`]: `entry` names where the value was given
    /// (a key of the config, a command-line option such as `--bucket`),
    /// `message` what is wrong with it and how to fix it.
    pub fn config(entry: impl Into<String>, message: impl Into<String>) -> Self {
        ShardError::Config {
            entry: entry.into(),
            message: message.into(),
        }
    }
}

/// One shard's failure in a multi-shard read.
#[derive(Debug)]
pub struct ShardFailure {
    /// The shard that failed.
    pub shard: String,
    /// Why (a [`ShardError::Db`], [`ShardError::Timeout`], ...).
    pub error: Box<ShardError>,
}

impl std::fmt::Display for ShardFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.shard, self.error.report())
    }
}

fn list_failures(failures: &[ShardFailure]) -> String {
    failures
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn too_soon_message(
    rollout: &str,
    from: crate::phase::Phase,
    to: crate::phase::Phase,
    elapsed_ms: u64,
    gap_ms: u64,
    wait_ms: u64,
) -> String {
    if from == to {
        format!(
            "rollout `{rollout}` cannot backfill yet: it moved to {from} {elapsed_ms} ms ago and \
             instances may act on the previous phase (writing rows a copy would miss) for \
             {gap_ms} ms; wait {wait_ms} ms"
        )
    } else {
        format!(
            "rollout `{rollout}` cannot move from {from} to {to} yet: the previous phase change \
             was {elapsed_ms} ms ago and caches may hold objects of that phase for {gap_ms} ms; \
             wait {wait_ms} ms"
        )
    }
}

/// An error with every cause, each once ([`ShardError::report`]).
pub struct Report<'a>(pub(crate) &'a ShardError);

impl std::fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The message names the root cause (see `report`); the sources
        // behind it only repeat it.
        write!(f, "{}", self.0)
    }
}

impl std::fmt::Debug for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Whether attempt `attempt` of at most `attempts` of a transaction that
/// failed with `err` runs again: when the database ended it (`aborted`,
/// whatever error the work made of that: it may have handled the abort's
/// own error and met the refusal of its next statement) or `err` says to
/// run the whole transaction again ([`Retry::Transaction`]), and attempts
/// are left. It returns after the pause of
/// [`abort_backoff`](super::abort_backoff): transactions that deadlocked
/// with each other would collide again if they ran again at once.
pub(crate) async fn again_after_abort(
    err: &ShardError,
    aborted: bool,
    attempt: u32,
    attempts: u32,
) -> bool {
    if attempt >= attempts || !(aborted || err.retry() == Retry::Transaction) {
        return false;
    }
    tokio::time::sleep(super::abort_backoff(attempt)).await;
    true
}
