//! [`ShardTx<G>`]: a transaction pinned to one entity group and one shard key.
//!
//! The key, not the shard, is what a transaction is for: two keys that share a
//! shard today may not after a rebalance, so a write whose row carries another
//! key is refused even when it would land on the same database. Rows of other
//! groups are refused at compile time (the [`InGroup`](crate::entity::InGroup) bound).

mod batch;
mod shard_tx;

pub use batch::{TxDeleteMany, TxUpdateMany};
pub use shard_tx::ShardTx;
