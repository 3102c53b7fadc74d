//! Global secondary indexes (PayPal's GSI, Vitess's `consistent_lookup`).
//!
//! A field marked `#[shardkit(global_index)]` (or `global_index(unique)`) gets
//! an index table `gsi_<table>_<column>` on every shard of its group: the
//! secondary value, the owner's shard key and primary key (as text), and when
//! the row was written. An index row lives on the shard its *value* hashes to
//! (PostgreSQL's text hash over the group's shards), so there is no single
//! index database to lose.
//!
//! **Index first.** On insert the index row commits before the primary row's
//! transaction (or, when it lives on the owner's own shard, atomically with
//! it, in the same transaction); on an update of an indexed column the new index row commits
//! first and the old one is removed after the primary commits; on delete the
//! index row is removed after the primary commits. A failure in between leaves
//! a *dangling* index row, never a primary row without one. Lookups verify the
//! owner (the read filters on the indexed column), so a dangling or stale row
//! never yields a wrong row, and [`Gsi::reconcile`] removes dangling rows older
//! than a grace period.
//!
//! **Durability.** An index row on another shard commits on its own, so an
//! insert pays two durable commits. When that shard is a database of the same
//! PostgreSQL server as the owner's (one WAL), the index row commits with
//! `synchronous_commit = off`: its commit record precedes the owner's in the
//! WAL, and the owner's flushed commit flushes everything before it, so a
//! committed owner never loses its index row in a crash; what a crash can lose
//! is an index row whose owner did not commit — a dangling row, as after any
//! failed insert. Across servers, and on SQLite and MySQL/MariaDB, every index
//! row commits flushed. `[gsi] relaxed_commit = false` turns this off. Removals
//! (after the owner's commit) are relaxed on any PostgreSQL shard: losing one
//! leaves a dangling row.
//!
//! A catalog (`shardkit_gsi_catalog`, on every shard of the group) records each
//! index and its state: `write_only` while [`Gsi::backfill`] fills it
//! (lookups fall back to a scatter read), `active` after.

mod backfill;
mod catalog;
mod handle;
mod lookup;
mod reconcile;
mod stage;
mod write;

use crate::gsi::handle::{
    BACKFILL_CURSOR, CATALOG_TABLE, Durability, RECONCILE_CHUNK, STATE_TTL, convert_to_collation,
    gsi_err, index_of, mysql_exact_collation,
};
pub use handle::{BackfillProgress, Gsi, IndexState, ReconcileConflict, ReconcileReport};
pub(crate) use handle::{GsiState, IndexDef, Removal};
pub(crate) use lookup::GsiLookup;
pub use stage::IndexFirst;
pub use write::MAX_VALUE_CHARS;
