//! What features check before a read runs ([`ReadGuard`]): a rollout
//! reading another table in place of an entity's own ([`ReadFrom`]), and
//! the move mark of a `movable` group.

use crate::entity::{ReferenceTable, ShardedEntity};
use crate::error::Result;
use sea_orm::{DatabaseConnection, QueryTrait, Select};
use std::sync::Arc;

/// A check a feature makes before a read of an entity runs: a rollout
/// serves reads of an old entity whose table it no longer writes from the
/// new table, or refuses them.
pub(crate) trait ReadGuard: Send + Sync {
    /// `Ok(None)`: read the entity's own table; `Ok(Some(r))`: read table
    /// `r.table` in its place (`FROM t AS <own table>`); `Err`: refused.
    fn check(&self, entity: std::any::TypeId, table: &'static str) -> Result<Option<ReadFrom>>;

    /// Work to await before routing a read of `group` (a bucket map read
    /// long ago, or older than `seen_epoch`, the epoch a read's session
    /// saw, is read again), within the read's `timeout` when it has one;
    /// `None` when there is none. `Err`: the read must not be routed (the
    /// session's map could not be read).
    fn before_routing(
        &self,
        _group: &'static str,
        _seen_epoch: Option<u64>,
        _timeout: Option<std::time::Duration>,
    ) -> Option<futures::future::BoxFuture<'_, Result<()>>> {
        None
    }

    /// The moves of `group` (see [`MoveMark`]); `None`: it never moves
    /// (rows are on one shard each).
    fn move_mark(
        &self,
        _group: &'static str,
        _timeout: Option<std::time::Duration>,
    ) -> Option<futures::future::BoxFuture<'_, MoveMark>> {
        None
    }

    /// The check around a read that joins a reference table; `None`: none.
    fn reference_fence(&self) -> Option<&dyn ReferenceFence> {
        None
    }
}

/// What a read that joins a reference table does around its statement, so
/// that an instance never sees the table go back to an older version: the
/// copy it reads is at least as new as any the instance read or wrote
/// before (brought up to date first when it is behind), and what the copy
/// held by the end of the read is what the instance has seen since.
pub(crate) trait ReferenceFence: Send + Sync {
    /// Before the statement on `conn` (a shard, or one of its replicas):
    /// returns the version the read needs, for [`after`](Self::after).
    fn before<'a>(
        &'a self,
        table: &'static dyn ReferenceTable,
        conn: &'a DatabaseConnection,
    ) -> futures::future::BoxFuture<'a, Result<i64>>;

    /// After it, on the same connection: refuses the rows when the copy is
    /// older than `need` (set back while the instance took it to be new).
    fn after<'a>(
        &'a self,
        table: &'static dyn ReferenceTable,
        conn: &'a DatabaseConnection,
        need: i64,
    ) -> futures::future::BoxFuture<'a, Result<()>>;
}

/// A feature's guard behind a shared pointer is a guard.
impl<T: ReadGuard + ?Sized> ReadGuard for Arc<T> {
    fn check(&self, entity: std::any::TypeId, table: &'static str) -> Result<Option<ReadFrom>> {
        (**self).check(entity, table)
    }

    fn before_routing(
        &self,
        group: &'static str,
        seen_epoch: Option<u64>,
        timeout: Option<std::time::Duration>,
    ) -> Option<futures::future::BoxFuture<'_, Result<()>>> {
        (**self).before_routing(group, seen_epoch, timeout)
    }

    fn move_mark(
        &self,
        group: &'static str,
        timeout: Option<std::time::Duration>,
    ) -> Option<futures::future::BoxFuture<'_, MoveMark>> {
        (**self).move_mark(group, timeout)
    }

    fn reference_fence(&self) -> Option<&dyn ReferenceFence> {
        (**self).reference_fence()
    }
}

/// Two features' guards, composed like the write stages: the first
/// table swap (or refusal) wins, both awaits run before routing (the
/// first's first), and the first feature that tracks moves gives the mark.
impl<A: ReadGuard, B: ReadGuard> ReadGuard for (A, B) {
    fn check(&self, entity: std::any::TypeId, table: &'static str) -> Result<Option<ReadFrom>> {
        match self.0.check(entity, table)? {
            Some(from) => Ok(Some(from)),
            None => self.1.check(entity, table),
        }
    }

    fn before_routing(
        &self,
        group: &'static str,
        seen_epoch: Option<u64>,
        timeout: Option<std::time::Duration>,
    ) -> Option<futures::future::BoxFuture<'_, Result<()>>> {
        match (
            self.0.before_routing(group, seen_epoch, timeout),
            self.1.before_routing(group, seen_epoch, timeout),
        ) {
            (Some(a), Some(b)) => Some(Box::pin(async move {
                a.await?;
                b.await
            })),
            (a, b) => a.or(b),
        }
    }

    fn move_mark(
        &self,
        group: &'static str,
        timeout: Option<std::time::Duration>,
    ) -> Option<futures::future::BoxFuture<'_, MoveMark>> {
        self.0
            .move_mark(group, timeout)
            .or_else(|| self.1.move_mark(group, timeout))
    }

    fn reference_fence(&self) -> Option<&dyn ReferenceFence> {
        self.0
            .reference_fence()
            .or_else(|| self.1.reference_fence())
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
    /// Its name, for its global indexes' tables and for messages.
    pub(crate) table: &'static str,
    /// The table in statements: in its entity's schema, if it names one.
    pub(crate) table_ref: sea_orm::sea_query::TableRef,
    /// Its indexed columns, and whether each is unique.
    pub(crate) indexes: Arc<[(&'static str, bool)]>,
}

/// Reads table `from` in place of `E`'s own: `FROM from AS e_table`, so the
/// statement's column references still resolve.
pub(crate) fn read_from<E: ShardedEntity>(select: &mut Select<E>, from: &ReadFrom) {
    QueryTrait::query(select)
        .from_clear()
        .from_as(from.table_ref.clone(), E::default());
}
