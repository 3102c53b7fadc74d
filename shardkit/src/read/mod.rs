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
//! read ([`ShardError::ShardsFailed`](crate::ShardError::ShardsFailed) names every failed shard and why), unless
//! the caller asked for partial results with [`Find::partial`].

mod execute;
mod find;
mod guard;
mod in_tx;
mod index;
mod keys;
mod merge;
mod moves;
mod plan;
mod related;
mod request;
mod route;
mod select;
mod traits;

pub use find::Find;
pub use guard::ReadFrom;
pub(crate) use guard::{MoveMark, ReadGuard, ReferenceFence, read_from};
pub(crate) use in_tx::{Poison, poison_if_aborted, stream_open};
pub use in_tx::{TxFind, TxSelect};
pub(crate) use index::{IndexLookup, IndexQuery, exact_eq};
pub use keys::KeyOf;
pub(crate) use keys::{guard_check, key_condition, key_expr, keyed_statement, related_select};
pub(crate) use merge::compare_values;
pub use plan::{MergePlan, PlannedRoute, PlannedStatement, ReadPlan, escape_controls};
pub use related::{AlsoRelated, WithRelated};
pub use select::{KeyedPages, KeyedSelect, MultiSelect, MultiShard, RowStream};

pub use route::{AllowPartial, ByIndex, Keyed, Keys, Partial, Scatter, Unkeyed};
