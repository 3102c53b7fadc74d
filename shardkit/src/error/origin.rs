//! Whose statement failed ([`Origin`], [`Subsystem`]) and what a caller
//! can do about it ([`Retry`]).

/// Whose statement a [`ShardError::Db`](crate::ShardError::Db) was.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Origin {
    /// A read or write of an entity group's rows, or its transaction
    /// (`begin`, `commit`), or its directory.
    Group(&'static str),
    /// One of shardkit's own tables.
    Table {
        /// Which part of shardkit.
        subsystem: Subsystem,
        /// The table (`gsi_users_email`, `tickets_photos`,
        /// `shardkit_rollouts`, or the entity table a check read).
        table: String,
    },
}

impl Origin {
    /// [`Origin::Table`] of `subsystem` on `table`.
    pub fn table(subsystem: Subsystem, table: impl Into<String>) -> Self {
        Origin::Table {
            subsystem,
            table: table.into(),
        }
    }

    /// The entity group, for [`Origin::Group`].
    pub fn group(&self) -> Option<&'static str> {
        match self {
            Origin::Group(group) => Some(group),
            Origin::Table { .. } => None,
        }
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Group(group) => write!(f, "group `{group}`"),
            Origin::Table { subsystem, table } => {
                write!(f, "{} table `{table}`", subsystem.as_str())
            }
        }
    }
}

/// The parts of shardkit that keep tables of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Subsystem {
    /// Global secondary indexes: index tables and their catalog.
    Gsi,
    /// Ticket sequences on the ticket servers.
    Ids,
    /// Denormalisation rollouts: their state table.
    Rollout,
    /// Verification of rows between tables or shards.
    Verify,
    /// The bucket map, bucket fences and bucket moves.
    Rebalance,
    /// Work that spans keys: the outbox, the inbox, sagas and idempotent
    /// requests.
    CrossKey,
    /// Reference tables: their copies, versions and change log.
    Reference,
}

impl Subsystem {
    /// `gsi`, `ids`, `rollout`, `verify`, `rebalance`, `cross_key` or
    /// `reference`.
    pub fn as_str(self) -> &'static str {
        match self {
            Subsystem::Gsi => "gsi",
            Subsystem::Ids => "ids",
            Subsystem::Rollout => "rollout",
            Subsystem::Verify => "verify",
            Subsystem::Rebalance => "rebalance",
            Subsystem::CrossKey => "cross_key",
            Subsystem::Reference => "reference",
        }
    }
}

/// What a caller can do about an error ([`ShardError::retry`](crate::ShardError::retry)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retry {
    /// The same call fails the same way: fix the input, the config or the
    /// program.
    Never,
    /// A transient failure (a lost connection, a busy database, a timeout):
    /// the same call may succeed now.
    Now,
    /// Retry the same call after waiting this long.
    After(std::time::Duration),
    /// The database aborted the transaction (deadlock, serialization
    /// failure): everything it did is gone; run the whole transaction again.
    Transaction,
}

/// A short, growing, jittered pause before attempt `attempt + 1` of work
/// the database aborted (a deadlock, a serialization failure, a lost
/// unique claim), so that the attempts that collided do not collide again
/// in lockstep: 4 ms, 8 ms, 16 ms … at most 128 ms, plus up to 4 ms.
pub(crate) fn abort_backoff(attempt: u32) -> std::time::Duration {
    use std::hash::{BuildHasher, Hasher};
    // A fresh random seed per call: jitter without a clock or an RNG crate.
    let jitter = std::hash::RandomState::new().build_hasher().finish() % 4_000_000;
    std::time::Duration::from_millis(2u64 << Ord::min(attempt, 6))
        + std::time::Duration::from_nanos(jitter)
}
