//! Reference tables: small shared tables (currencies, countries, plans)
//! with a copy on every shard, so that a key's reads join them on the key's
//! own shard.
//!
//! Mark the model with `#[derive(shardkit::Sharded)]` and
//! `#[shardkit(reference)]`; write it through
//! [`Cluster::reference`](crate::Cluster::reference).
//!
//! - **The source.** The cluster's first shard holds the copy every other
//!   one follows and a counter per table (`shardkit_reference_versions`,
//!   which holds every copy's version too). A write is one transaction
//!   there: it takes the next version and changes the rows. Once it has
//!   committed it is durable, whatever else is down.
//! - **The copies.** The write is then applied to every other shard, each
//!   in one transaction that moves the copy's version from the one before
//!   to the new one (compare and set). A shard that is down, or whose copy
//!   is not at the version before, is brought up later by a catch-up: in
//!   one snapshot of the source, its version and its rows; then, in one
//!   transaction on the shard, the copy's version set and its rows compared
//!   with the source's, the missing and different ones written and the
//!   extra ones deleted (each by its own typed key: a copy is never
//!   emptied). A copy passes from version to version, each one whole: it
//!   never holds part of a version. A background task of every instance
//!   that registered the table reads every copy's version each second and
//!   runs the catch-up for copies not at the source's (behind, or ahead of
//!   a source restored to an earlier point, which they follow back); a read
//!   that finds its copy behind runs it first; a bucket move runs it on its
//!   target before it copies and before the cut-over.
//! - **Never backwards.** An instance remembers the newest version it has
//!   read or written of each table. A read that joins a reference table
//!   (a keyed read's `find_also_related` / `find_with_related`, or
//!   [`Reference::read`]) first makes sure the copy it reads is at least
//!   that new (catching it up if not), then reads the copy's version after
//!   its rows: what it read is at most that version, and the next read
//!   anywhere is at least that version. Reads inside a
//!   [`ShardTx`](crate::ShardTx) read the copy as the transaction sees it.
//! - **Consistency tools.** [`Reference::status`] gives each copy's
//!   version, [`Reference::verify`] compares every copy with the source
//!   row by row and repairs them; `shardctl reference status|verify`.
//! - **Foreign keys.** A shard's own tables may reference a reference
//!   table (SeaORM's `belongs_to` makes the key). A copy is never emptied
//!   and refilled: rows are written over and only the rows the source no
//!   longer has are deleted, so a catch-up keeps the references intact. A
//!   row deleted on the source while a shard's rows still reference it
//!   cannot be deleted there: that copy stays behind, and its catch-up
//!   fails with the database's foreign-key error (in the logs, and in
//!   [`ReferenceWrite::behind`]) until those rows are gone. A bucket move
//!   brings the tables to its target before it copies rows that reference
//!   them.

mod handle;
mod state;
mod sync;
mod watch;

pub use handle::{
    CopyReport, CopyStatus, Reference, ReferenceReport, ReferenceStatus, ReferenceWrite,
};
pub(crate) use state::References;
#[doc(hidden)]
pub use watch::Typed;
