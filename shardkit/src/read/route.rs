//! What a read names before it runs (one key, several, every shard, an
//! index value), and how a multi-shard read reports failed shards.

use crate::entity::ShardedEntity;
use crate::error::{Result, ShardError, ShardFailure};
use crate::read::KeyOf;
use sea_orm::Value;

/// A read that has no shard key yet: add `.key(k)`, `.keys(..)` or `.scatter()`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unkeyed;

/// A read pinned to one shard key.
#[derive(Clone, Debug)]
pub struct Keyed<K>(pub(super) K);

/// A read of several shard keys.
#[derive(Clone, Debug)]
pub struct Keys<K>(pub(super) Vec<K>);

/// A read of every shard of the group.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scatter;

/// A read by a global secondary index value ([`Find::by_index`](crate::read::Find::by_index)).
#[derive(Clone, Debug)]
pub struct ByIndex {
    pub(super) column: &'static str,
    pub(super) value: Value,
}

/// A multi-shard read that returns the rows of healthy shards plus the list
/// of failed ones ([`Partial`]) instead of failing.
#[derive(Clone, Debug)]
pub struct AllowPartial<R>(pub(super) R);

/// The result of a [`Find::partial`](crate::read::Find::partial) read: the rows every healthy shard
/// returned, and the shards that failed with their errors.
#[derive(Debug)]
pub struct Partial<T> {
    /// Rows (or the count) from the shards that answered.
    pub rows: T,
    /// The shards that failed or timed out, with why.
    pub failed: Vec<ShardFailure>,
}

impl<T> Partial<T> {
    /// Whether every shard answered.
    pub fn is_complete(&self) -> bool {
        self.failed.is_empty()
    }

    /// The names of the shards that failed, in shard order.
    pub fn failed_shards(&self) -> Vec<&str> {
        self.failed.iter().map(|f| f.shard.as_str()).collect()
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Unkeyed {}
    impl<K> Sealed for super::Keyed<K> {}
    impl<K> Sealed for super::Keys<K> {}
    impl Sealed for super::Scatter {}
    impl Sealed for super::ByIndex {}
    impl<R> Sealed for super::AllowPartial<R> {}
}

/// Which shards a read goes to.
#[doc(hidden)]
#[derive(Debug)]
pub enum RouteSpec<K> {
    /// One key: its shard.
    One(K),
    /// These keys: their shards, each with its own keys.
    Many(Vec<K>),
    /// Every shard of the group.
    All,
    /// The shards a global index lists for a value (column, value).
    Index(&'static str, Value),
}

/// What a multi-shard read tells [`Routed::finish`].
#[doc(hidden)]
#[derive(Debug)]
pub struct Gathered {
    pub(super) group: &'static str,
    pub(super) table: &'static str,
    pub(super) asked: usize,
    pub(super) failed: Vec<ShardFailure>,
}

/// The routing states a read can run in. `Unkeyed` is not one of them, so an
/// unkeyed read does not compile.
#[diagnostic::on_unimplemented(
    message = "this shardkit read has no shard key, so it cannot run",
    label = "add `.key(k)`, `.keys(..)` or `.scatter()` before running the read",
    note = "shardkit never guesses which shards to read: use `.key(k)` for one shard key, \
            `.keys([..])` for several, or `.scatter()` to read every shard on purpose"
)]
pub trait Routed<E: ShardedEntity>: sealed::Sealed + Send {
    /// What the read returns: the rows, or [`Partial`] rows.
    type Output<T>;
    #[doc(hidden)]
    const PARTIAL: bool = false;
    #[doc(hidden)]
    fn spec(self) -> RouteSpec<KeyOf<E>>;
    #[doc(hidden)]
    fn finish<T>(rows: T, gathered: Gathered) -> Result<Self::Output<T>>;
}

pub(super) fn strict<T>(rows: T, gathered: Gathered) -> Result<T> {
    if gathered.failed.is_empty() {
        Ok(rows)
    } else {
        Err(ShardError::ShardsFailed {
            group: gathered.group,
            table: gathered.table,
            asked: gathered.asked,
            failures: gathered.failed,
        })
    }
}

impl<E: ShardedEntity> Routed<E> for Keyed<KeyOf<E>> {
    type Output<T> = T;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        RouteSpec::One(self.0)
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<T> {
        strict(rows, gathered)
    }
}

impl<E: ShardedEntity> Routed<E> for Keys<KeyOf<E>> {
    type Output<T> = T;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        RouteSpec::Many(self.0)
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<T> {
        strict(rows, gathered)
    }
}

impl<E: ShardedEntity> Routed<E> for Scatter {
    type Output<T> = T;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        RouteSpec::All
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<T> {
        strict(rows, gathered)
    }
}

impl<E: ShardedEntity> Routed<E> for ByIndex {
    type Output<T> = T;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        RouteSpec::Index(self.column, self.value)
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<T> {
        strict(rows, gathered)
    }
}

impl<E: ShardedEntity, R: Routed<E>> Routed<E> for AllowPartial<R> {
    type Output<T> = Partial<T>;
    const PARTIAL: bool = true;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        self.0.spec()
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<Partial<T>> {
        Ok(Partial {
            rows,
            failed: gathered.failed,
        })
    }
}
