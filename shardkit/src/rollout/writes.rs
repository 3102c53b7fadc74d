//! What a dual write of a rollout works with: its context, what it leaves for after the commit, and the old-entity writes behind it.

use crate::error::Result;
use crate::exec::Shards;
use crate::gsi::GsiState;
use crate::phase::Phase;
use crate::pipeline::WriteOp;
use crate::topology::ShardId;
use futures::future::BoxFuture;
use sea_orm::{ActiveValue, DatabaseTransaction, Value};
use std::any::Any;
use std::sync::Arc;

/// What a write of the old entity leaves to do once its transaction commits
/// (fill or invalidate caches).
pub(crate) type CacheUpdate = Box<dyn FnOnce() + Send>;

/// Where a dual write runs: the old row's transaction and shard.
pub(crate) struct DualCtx<'a> {
    pub(crate) shards: &'a Shards,
    pub(crate) gsi: &'a Arc<GsiState>,
    pub(crate) txn: &'a DatabaseTransaction,
    pub(crate) shard: &'a str,
    pub(crate) shard_id: ShardId,
}

/// A row of the old entity as the write pipeline hands it over, whatever
/// the entity's type: its columns' values in `Column::iter()` order. The
/// registry finds a rollout by the entity's type, so the rollout reads the
/// values back as its own `Old` (see [`Shared::old_model`]).
pub(crate) type RowValues = Vec<Value>;

/// An active model of the old entity, the same way (see [`RowValues`]).
pub(crate) type ActiveValues = Vec<ActiveValue<Value>>;

/// The write side of a rollout, keyed in the registry by the old entity's
/// type. The write stage ([`DualWrite`]) calls it for every write of that
/// entity.
pub(crate) trait OldWrites: Send + Sync {
    fn name(&self) -> &str;
    fn phase(&self) -> Phase;
    /// Where reads of the old entity go in the current phase (see
    /// [`OldReads`]).
    fn old_reads(&self) -> OldReads;
    /// The typed rollout, for [`Cluster::rollout`](crate::Cluster::rollout).
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
    /// Before a write of the entity (before `new_only`): a folded part
    /// locks its root, and re-folds the root it leaves.
    fn before_write<'a>(
        &'a self,
        _ctx: DualCtx<'a>,
        _op: WriteOp,
        _model: ActiveValues,
    ) -> BoxFuture<'a, Result<Option<CacheUpdate>>> {
        Box::pin(std::future::ready(Ok(None)))
    }
    /// Whether an update or delete of the entity needs the row as it was
    /// (a folded part: the root it leaves).
    fn needs_current(&self) -> bool {
        false
    }
    /// After the old row `row` was inserted or updated (`current`: the row
    /// before an update, when [`needs_current`](Self::needs_current)).
    fn after_write<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        row: RowValues,
        current: Option<RowValues>,
    ) -> BoxFuture<'a, Result<Option<CacheUpdate>>>;
    /// After the old row named by `model` was deleted (`current`: the row
    /// as it was, when [`needs_current`](Self::needs_current)), or, from
    /// `new_only` on, instead of deleting it.
    fn after_delete<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        model: ActiveValues,
        current: Option<RowValues>,
    ) -> BoxFuture<'a, Result<(u64, Option<CacheUpdate>)>>;
    /// `NewOnly`: an insert (`update == false`) or update of the old entity,
    /// applied to the new table only. Returns the old row as written.
    fn write_new_only<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        model: ActiveValues,
        update: bool,
    ) -> BoxFuture<'a, Result<(RowValues, CacheUpdate)>>;
}

/// Where reads of a rollout's old entity go.
pub(crate) enum OldReads {
    /// The old table: it is still written.
    Old,
    /// The new table, in place of the old one (`FROM new AS old`): every
    /// old column exists there with the same type.
    New(crate::read::ReadFrom),
    /// Refused, for this reason.
    Refused(String),
}
