//! Reads. A read names what it reads before it can run: one shard key
//! ([`Find::key`]), several ([`Find::keys`]), or every shard on purpose
//! ([`Find::scatter`]).
//!
//! A keyed read runs on its key's shard with `shard_key = key` added to its
//! `WHERE` clause, so it never returns another key's rows even when two keys
//! share a shard. A multi-shard read asks only the shards that can hold its
//! keys, each with only its own keys (an `IN` list split per shard and chunked
//! under the backend's parameter limit), runs the shards concurrently (at most
//! `read.max_concurrency` at once) and merges: `order_by_*` + `limit` /
//! `offset` give the same rows as one database would, `count()` sums.
//!
//! A shard that fails or does not answer within the timeout fails the whole
//! read ([`ShardError::ShardsFailed`] names every failed shard and why), unless
//! the caller asked for partial results with [`Find::partial`].

use crate::entity::{EntityGroup, ShardedEntity};
use crate::error::Result;
use sea_orm::{QueryTrait, Select};
use std::sync::Arc;

/// A check a feature makes before a read of an entity runs: a rollout
/// serves reads of an old entity whose table it no longer writes from the
/// new table, or refuses them.
pub(crate) trait ReadGuard: Send + Sync {
    /// `Ok(None)`: read the entity's own table; `Ok(Some(r))`: read table
    /// `r.table` in its place (`FROM t AS <own table>`); `Err`: refused.
    fn check(&self, entity: std::any::TypeId, table: &'static str) -> Result<Option<ReadFrom>>;

    /// Work to await before routing a read of `group` (a bucket map read
    /// long ago is read again); `None` when there is none.
    fn before_routing(&self, _group: &'static str) -> Option<futures::future::BoxFuture<'_, ()>> {
        None
    }

    /// The moves of `group` (see [`MoveMark`]); `None`: it never moves
    /// (rows are on one shard each).
    fn move_mark(&self, _group: &'static str) -> Option<futures::future::BoxFuture<'_, MoveMark>> {
        None
    }
}

/// What a multi-shard count or projection of a `movable` group needs to
/// know of its moves: `Some((unfinished, newest id))`, or `None` when the
/// control database cannot say. Rows may be on two shards while a move is
/// not finished; a count or projection that saw no unfinished move before
/// and the same mark after its gather saw each row once.
pub(crate) type MoveMark = Option<(u64, i64)>;

/// Another table that answers an entity's reads in place of its own (a
/// rollout's new table from `read_new` on), with its global indexes: an
/// index read uses the other table's index on the same column, which is
/// the one its writes keep.
#[derive(Clone, Debug)]
pub struct ReadFrom {
    pub(crate) table: &'static str,
    /// Its indexed columns, and whether each is unique.
    pub(crate) indexes: Arc<[(&'static str, bool)]>,
}

/// Reads table `from` in place of `E`'s own: `FROM from AS e_table`, so the
/// statement's column references still resolve.
pub(crate) fn read_from<E: ShardedEntity>(select: &mut Select<E>, from: &'static str) {
    QueryTrait::query(select)
        .from_clear()
        .from_as(sea_orm::sea_query::Alias::new(from), E::default());
}

/// The shard key type of entity `E`.
pub type KeyOf<E> = <<E as ShardedEntity>::Group as EntityGroup>::Key;

mod execute;
mod find;
mod in_tx;
mod index;
mod keys;
mod plan;
mod route;
mod traits;

pub(crate) use execute::compare_values;
pub use find::{Find, KeyedPages, KeyedSelect, MultiSelect, MultiShard, RowStream};
pub(crate) use in_tx::stream_open;
pub use in_tx::{TxFind, TxSelect};
pub(crate) use index::{IndexLookup, IndexQuery, exact_eq};
pub(crate) use keys::{guard_check, key_condition, related_select};
pub use plan::{MergePlan, PlannedRoute, PlannedStatement, ReadPlan, escape_controls};

/// What `find_with_related` returns: each row of `E` with its related rows.
pub type WithRelated<E, R> = Vec<(
    <E as sea_orm::EntityTrait>::Model,
    Vec<<R as sea_orm::EntityTrait>::Model>,
)>;

/// What `find_also_related` returns: each row of `E` with its related row,
/// if any.
pub type AlsoRelated<E, R> = Vec<(
    <E as sea_orm::EntityTrait>::Model,
    Option<<R as sea_orm::EntityTrait>::Model>,
)>;
pub use route::{AllowPartial, ByIndex, Keyed, Keys, Partial, Scatter, Unkeyed};
