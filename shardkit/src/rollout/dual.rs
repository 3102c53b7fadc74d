//! The write side: dual writes of the new row in the old row's
//! transaction, `new_only` translation, cache fills, and the write stage
//! ([`DualWrite`]) that calls them for every write of a rollout's old entity.

use crate::entity::{EntityGroup, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::keyset::{pk_condition, tuple_text, upsert};
use crate::gsi::GsiState;
use crate::phase::Phase;
use crate::pipeline::{Replaced, WriteOp, WriteStage, Written};
use crate::read::KeyOf;
use crate::rollout::parts::Parts;
use crate::rollout::registry::Registry;
use crate::rollout::{
    ActiveValues, CacheUpdate, ConvertFn, DualCtx, OldReads, OldWrites, RowValues, Shared,
    cache_key, model_from_values,
};
use futures::future::BoxFuture;
use sea_orm::{
    ActiveModelTrait, ConnectionTrait, DbErr, IntoActiveModel, Iterable, ModelTrait, QueryFilter,
    Value,
};
use std::any::{Any, TypeId};
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl<Old, New> Shared<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    pub(super) fn db_err(&self, shard: &str, operation: String, source: DbErr) -> ShardError {
        ShardError::db(
            crate::error::Origin::Group(<Old::Group as EntityGroup>::NAME),
            shard.to_owned(),
            operation,
            source,
        )
    }

    /// The old row the pipeline handed over (see [`RowValues`]).
    pub(super) fn old_model(&self, values: RowValues) -> Result<Old::Model> {
        model_from_values::<Old>(values).map_err(|e| {
            self.refused_err(format!(
                "internal: not a row of `{}`: {e}",
                table_name::<Old>()
            ))
        })
    }

    /// The old active model the pipeline handed over, and which of its
    /// columns were `Set` (see [`ActiveValues`]).
    pub(super) fn old_active(&self, values: ActiveValues) -> Result<(Old::ActiveModel, Vec<bool>)> {
        crate::key::active_from_values::<Old>(values).map_err(|e| {
            self.refused_err(format!(
                "internal: not a row of `{}`: {e}",
                table_name::<Old>()
            ))
        })
    }

    pub(super) fn old_key(row: &Old::Model) -> String {
        cache_key(
            &Old::shard_key(row).to_directory_text(),
            &crate::key::model_pk::<Old>(row),
        )
    }

    /// Fills both caches with `row` (an old model) and `new` (its new
    /// model) once the write commits.
    pub(super) fn fill_both(self: &Arc<Self>, row: Old::Model, new: New::Model) -> CacheUpdate {
        let shared = self.clone();
        Box::new(move || {
            let key = Self::old_key(&row);
            shared.new_cache.insert(key.clone(), new);
            shared.old_cache.insert(key, row);
        })
    }

    pub(super) fn invalidate_both(self: &Arc<Self>, key: String) -> CacheUpdate {
        let shared = self.clone();
        Box::new(move || {
            shared.old_cache.invalidate(&key);
            shared.new_cache.invalidate(&key);
        })
    }

    /// Writes `new`, the new model of `old`, in the transaction: its index
    /// rows first (see [`crate::gsi`]), then the row itself, as an upsert
    /// (the row may predate dual writes, or a backfill may have copied it).
    pub(super) async fn write_new(
        &self,
        ctx: &DualCtx<'_>,
        old: &Old::Model,
        new: New::Model,
        insert_only: bool,
    ) -> Result<()> {
        // The converted row is a write like any other: it must stay on the
        // old row's key, or it would land on a shard that key does not own.
        let (expected, found) = (Old::shard_key(old), New::shard_key(&new));
        if expected.to_directory_text() != found.to_directory_text() {
            return Err(ShardError::CrossShardWrite {
                entity: table_name::<New>(),
                column: New::SHARD_KEY_FIELD,
                expected: format!("{expected:?}"),
                found: format!("{found:?}"),
            });
        }
        self.index_new(ctx, &new).await?;
        let op = format!("dual write {}", table_name::<New>());
        // Fault injection: fails the write of the new table named by the
        // failpoint's argument, `table` or `table@key` (any, without one).
        #[cfg(feature = "failpoints")]
        if fail::eval("shardkit::rollout::write_new", |arg| {
            arg.unwrap_or_default()
        })
        .is_some_and(|target| {
            let (table, key) = target.split_once('@').unwrap_or((&target, ""));
            (table.is_empty() || table == table_name::<New>())
                && (key.is_empty() || key == found.to_directory_text())
        }) {
            return Err(self.db_err(ctx.shard, op, DbErr::Custom("failpoint".into())));
        }
        let res = if insert_only {
            New::insert(new.into_active_model().reset_all())
                .exec_without_returning(ctx.txn)
                .await
                .map(drop)
        } else {
            upsert::<New, _>(ctx.txn, new).await
        };
        res.map_err(|e| self.db_err(ctx.shard, op, e))
    }

    pub(super) async fn index_new(&self, ctx: &DualCtx<'_>, new: &New::Model) -> Result<()> {
        if New::GLOBAL_INDEXES.is_empty() {
            return Ok(());
        }
        let key = New::shard_key(new).to_directory_text();
        let owner = crate::key::model_pk::<New>(new);
        for (column, unique) in New::GLOBAL_INDEXES {
            let index = crate::gsi::IndexDef::of::<New>(*column, *unique);
            crate::gsi::Gsi::new(ctx.shards, ctx.gsi)
                .write_entry_from::<New>(
                    &index,
                    &new.get(*column),
                    &key,
                    &owner,
                    Some((ctx.shard_id, ctx.txn)),
                )
                .await?;
        }
        Ok(())
    }

    /// The new row with `pk` under `key`, read within the transaction under
    /// its row lock: the caller changes it and writes it back, and a
    /// concurrent change must wait rather than be overwritten.
    pub(super) async fn new_row_in(
        &self,
        ctx: &DualCtx<'_>,
        key: &KeyOf<New>,
        pk: &[Value],
    ) -> Result<Option<New::Model>> {
        use sea_orm::QuerySelect;
        let backend = ctx.txn.get_database_backend();
        let mut select = New::find()
            .filter(crate::read::key_condition::<New>(
                std::slice::from_ref(key),
                backend,
            ))
            .filter(pk_condition::<New>(pk));
        if backend != sea_orm::DbBackend::Sqlite {
            select = select.lock_exclusive();
        }
        select
            .one(ctx.txn)
            .await
            .map_err(|e| self.db_err(ctx.shard, format!("select {}", table_name::<New>()), e))
    }
}

impl<Old, New> OldWrites for Shared<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn phase(&self) -> Phase {
        Shared::phase(self)
    }

    fn old_reads(&self) -> OldReads {
        let phase = self.phase();
        // From read_new on, the new table is backfilled and written by every
        // write: reading it then means no instance still reads the old
        // table when another one stops writing it (new_only).
        match &self.read_new_table {
            Some(from) if phase >= Phase::ReadNew => OldReads::New(from.clone()),
            None if phase >= Phase::NewOnly => OldReads::Refused(format!(
                "in {phase} the old table `{}` is no longer written, and `{}` does not hold \
                 every old column with the same type and nullability, so this read cannot be \
                 served from it: read the old model with the rollout's `get_old(key, id)`, or \
                 read `{}`",
                table_name::<Old>(),
                table_name::<New>(),
                table_name::<New>()
            )),
            _ => OldReads::Old,
        }
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }

    fn after_write<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        row: RowValues,
        _current: Option<RowValues>,
    ) -> BoxFuture<'a, Result<Option<CacheUpdate>>> {
        Box::pin(async move {
            let phase = self.phase();
            let row = self.old_model(row)?;
            if phase == Phase::Done {
                return Err(self.refused_err(format!(
                    "the old table `{}` is retired; write `{}` instead",
                    table_name::<Old>(),
                    table_name::<New>()
                )));
            }
            if !phase.caches() {
                return Ok(None);
            }
            // The new model, folded with the root's parts as they are in
            // this transaction: written from dual_write on, cached from
            // cache_both on.
            let new = self.fold_in(&ctx, &row).await?;
            if phase.writes_new() {
                self.write_new(&ctx, &row, new.clone(), false).await?;
            }
            let this = self.self_arc();
            Ok(Some(this.fill_both(row, new)))
        })
    }

    fn after_delete<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        model: ActiveValues,
        _current: Option<RowValues>,
    ) -> BoxFuture<'a, Result<(u64, Option<CacheUpdate>)>> {
        Box::pin(async move {
            let phase = self.phase();
            let (model, _) = self.old_active(model)?;
            if phase == Phase::Done {
                return Err(self.refused_err(format!(
                    "the old table `{}` is retired; delete from `{}` instead",
                    table_name::<Old>(),
                    table_name::<New>()
                )));
            }
            let (Some(key), Some(pk)) =
                (Old::active_shard_key(&model), model.get_primary_key_value())
            else {
                return Ok((0, None));
            };
            let pk: Vec<Value> = pk.into_iter().collect();
            let mut deleted = 0;
            if phase.writes_new() {
                let backend = ctx.txn.get_database_backend();
                deleted = New::delete_many()
                    .filter(crate::read::key_condition::<New>(
                        std::slice::from_ref(&key),
                        backend,
                    ))
                    .filter(pk_condition::<New>(&pk))
                    .exec(ctx.txn)
                    .await
                    .map_err(|e| {
                        self.db_err(ctx.shard, format!("dual delete {}", table_name::<New>()), e)
                    })?
                    .rows_affected;
            }
            // Deletes invalidate both caches whatever the phase: an entry
            // left from an earlier phase must not outlive its row.
            let this = self.self_arc();
            let after = this.invalidate_both(cache_key(&key.to_directory_text(), &tuple_text(&pk)));
            Ok((deleted, Some(after)))
        })
    }

    fn write_new_only<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        model: ActiveValues,
        update: bool,
    ) -> BoxFuture<'a, Result<(RowValues, CacheUpdate)>> {
        Box::pin(async move {
            let phase = self.phase();
            let (model, set) = self.old_active(model)?;
            if phase == Phase::Done {
                return Err(self.refused_err(format!(
                    "the old table `{}` is retired; write `{}` instead",
                    table_name::<Old>(),
                    table_name::<New>()
                )));
            }
            let op = |what: &str| {
                format!(
                    "{what} {} (as {})",
                    table_name::<Old>(),
                    table_name::<New>()
                )
            };
            let (old, parts) = if update {
                // Apply the set columns to the old form of the current new row.
                let Some(key) = Old::active_shard_key(&model) else {
                    return Err(ShardError::internal(format!(
                        "rollout `{}`: an update of `{}` without a shard key",
                        self.name,
                        table_name::<Old>()
                    )));
                };
                let Some(pk) = model.get_primary_key_value() else {
                    return Err(self.db_err(
                        ctx.shard,
                        op("update"),
                        DbErr::PrimaryKeyNotSet { ctx: "rollout" },
                    ));
                };
                let pk: Vec<Value> = pk.into_iter().collect();
                let current = self
                    .new_row_in(&ctx, &key, &pk)
                    .await?
                    .ok_or_else(|| self.db_err(ctx.shard, op("update"), DbErr::RecordNotUpdated))?;
                let Some(to_old) = &self.to_old else {
                    return Err(self.refused_err("no new → old conversion was registered"));
                };
                // A fold keeps the parts the new row holds.
                let parts = match &self.to_old_parts {
                    _ if !self.folds() => Parts::default(),
                    Some(split) => split(&current),
                    None => {
                        return Err(self.refused_err(format!(
                            "in {phase} an update of `{}` is applied to the folded row, which \
                             needs Rollout::to_old_parts",
                            table_name::<Old>()
                        )));
                    }
                };
                let mut merged = to_old(&current).into_active_model();
                for (column, set) in <Old::Column as Iterable>::iter().zip(set) {
                    if set {
                        merged.set(
                            column,
                            model.get(column).into_value().unwrap_or(Value::Bool(None)),
                        );
                    }
                }
                let old = Old::__try_into_model(merged)
                    .map_err(|e| self.db_err(ctx.shard, op("update"), e))?;
                (old, parts)
            } else {
                // A new root holds no parts yet.
                let old = Old::__try_into_model(model)
                    .map_err(|e| self.db_err(ctx.shard, op("insert"), e))?;
                (old, Parts::default())
            };
            let new = (self.to_new)(&old, &parts);
            self.write_new(&ctx, &old, new.clone(), !update).await?;
            let this = self.self_arc();
            let after = this.fill_both(old.clone(), new);
            Ok((crate::key::model_values::<Old>(&old), after))
        })
    }
}

impl<Old: ShardedEntity, New: ShardedEntity> Shared<Old, New> {
    pub(super) fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Acquire))
    }

    /// Sets the phase this instance acts on after its own phase change;
    /// a shared-state read that began before it can no longer overwrite it.
    pub(super) fn set_local_phase(&self, phase: Phase) {
        let _changing = self.phase_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.phase_epoch.fetch_add(1, Ordering::AcqRel);
        self.phase.store(phase as u8, Ordering::Release);
        crate::metrics::rollout_phase(&self.name, phase);
    }

    /// The count of this instance's own phase changes, taken before a read
    /// of the shared state ([`set_read_phase`](Self::set_read_phase)).
    pub(super) fn phase_epoch(&self) -> u64 {
        self.phase_epoch.load(Ordering::Acquire)
    }

    /// Sets the phase read from the shared state by a read that began at
    /// `epoch`, unless this instance changed the phase since (the read may
    /// have seen the row before that change).
    pub(super) fn set_read_phase(&self, phase: Phase, epoch: u64) {
        let _changing = self.phase_lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.phase_epoch.load(Ordering::Acquire) == epoch {
            self.phase.store(phase as u8, Ordering::Release);
            crate::metrics::rollout_phase(&self.name, phase);
        }
    }

    pub(crate) fn to_old_fn(&self) -> Option<&ConvertFn<New::Model, Old::Model>> {
        self.to_old.as_deref()
    }

    pub(crate) fn refused_err(&self, reason: impl Into<String>) -> ShardError {
        ShardError::Rollout {
            rollout: self.name.clone(),
            phase: self.phase(),
            reason: reason.into(),
        }
    }

    /// `self` as the `Arc` the registry holds: cache fills run after the
    /// transaction commits, so their closures must own a reference.
    pub(super) fn self_arc(&self) -> Arc<Self> {
        self.me
            .upgrade()
            .expect("a rollout is reachable only through its Arc")
    }
}

/// The write stage of rollouts (see [`crate::pipeline`]): a write of an
/// entity with a registered rollout follows the rollout's phase — caches
/// filled after the commit, the new row written in the same transaction,
/// and from `new_only` on the new table written instead of the old.
#[doc(hidden)]
pub struct DualWrite {
    registry: Arc<Registry>,
    gsi: Arc<GsiState>,
}

impl DualWrite {
    pub(crate) fn new(registry: Arc<Registry>, gsi: Arc<GsiState>) -> Self {
        DualWrite { registry, gsi }
    }

    fn ctx<'a>(&'a self, ctx: &'a crate::pipeline::WriteCtx<'a>) -> DualCtx<'a> {
        DualCtx {
            shards: ctx.shards,
            gsi: &self.gsi,
            txn: ctx.txn,
            shard: ctx.shard_name,
            shard_id: ctx.shard,
        }
    }
}

/// Runs the rollout's cache work once the transaction commits.
fn defer(ctx: &crate::pipeline::WriteCtx<'_>, after: Option<CacheUpdate>) {
    if let Some(after) = after {
        ctx.defer(Box::pin(async move { after() }));
    }
}

impl crate::pipeline::sealed::Sealed for DualWrite {}

impl WriteStage for DualWrite {
    fn batch<E: ShardedEntity>(
        &self,
        ctx: &crate::pipeline::WriteCtx<'_>,
        _op: WriteOp,
    ) -> crate::pipeline::Batch {
        match self.registry.get(TypeId::of::<E>()) {
            None => {
                // A batch of one statement passes no `after_write`.
                self.registry.watch.wrote::<E>(ctx.shards);
                crate::pipeline::Batch::Statement
            }
            Some(rollout) if rollout.phase() >= Phase::NewOnly => {
                crate::pipeline::Batch::Refused(format!(
                    "rollout `{}` is in phase {:?}: the old table is no longer written, so a batch \
                     cannot pick its rows there; batch-write the new entity, or write the rows \
                     one by one",
                    rollout.name(),
                    rollout.phase()
                ))
            }
            Some(_) => crate::pipeline::Batch::PerRow,
        }
    }

    fn needs_current<E: ShardedEntity>(&self, op: WriteOp) -> bool {
        op != WriteOp::Insert
            && self
                .registry
                .get(TypeId::of::<E>())
                .is_some_and(|rollout| rollout.needs_current())
    }

    async fn replace<E: ShardedEntity>(
        &self,
        ctx: &crate::pipeline::WriteCtx<'_>,
        op: WriteOp,
        model: &E::ActiveModel,
    ) -> Result<Option<Replaced<E::Model>>> {
        let Some(rollout) = self.registry.get(TypeId::of::<E>()) else {
            return Ok(None);
        };
        let values = crate::key::active_values::<E>(model);
        if rollout.phase() < Phase::NewOnly {
            // A folded part locks the roots it touches before its own row
            // (see `fold`); nothing for a root.
            let after = rollout.before_write(self.ctx(ctx), op, values).await?;
            defer(ctx, after);
            return Ok(None);
        }
        if op == WriteOp::Delete {
            let (deleted, after) = rollout.after_delete(self.ctx(ctx), values, None).await?;
            defer(ctx, after);
            return Ok(Some(Replaced::Deleted(deleted)));
        }
        let (row, after) = rollout
            .write_new_only(self.ctx(ctx), values, op == WriteOp::Update)
            .await?;
        defer(ctx, Some(after));
        let row = model_from_values::<E>(row).map_err(|e| ShardError::Rollout {
            rollout: rollout.name().to_owned(),
            phase: rollout.phase(),
            reason: format!("internal: not a row of `{}`: {e}", table_name::<E>()),
        })?;
        Ok(Some(Replaced::Saved(row)))
    }

    async fn after_write<E: ShardedEntity>(
        &self,
        ctx: &crate::pipeline::WriteCtx<'_>,
        _op: WriteOp,
        written: Written<'_, E>,
    ) -> Result<()> {
        let Some(rollout) = self.registry.get(TypeId::of::<E>()) else {
            self.registry.watch.wrote::<E>(ctx.shards);
            return Ok(());
        };
        let after = match written {
            Written::Saved { row, current } => {
                let values = crate::key::model_values::<E>(row);
                let current = current.map(crate::key::model_values::<E>);
                rollout.after_write(self.ctx(ctx), values, current).await?
            }
            Written::Deleted { model, current, .. } => {
                let values = crate::key::active_values::<E>(model);
                let current = current.map(crate::key::model_values::<E>);
                rollout
                    .after_delete(self.ctx(ctx), values, current)
                    .await?
                    .1
            }
        };
        defer(ctx, after);
        Ok(())
    }
}
