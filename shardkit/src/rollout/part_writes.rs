//! Writes of the folded parts of a rollout (an old root and its parts written through the new model).

use crate::entity::{ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::keyset::tuple_text;
use crate::phase::Phase;
use crate::read::KeyOf;
use crate::rollout::parts::Applied;
use crate::rollout::{
    ActiveValues, CacheUpdate, DualCtx, OldReads, OldWrites, PartDef, RowValues, Shared,
};
use futures::future::BoxFuture;
use sea_orm::{ActiveValue, DbErr, Value};
use std::any::Any;
use std::sync::Arc;

/// The write side of one part of a fold, keyed in the registry by the part
/// entity's type: what a write of the part does to its root's new row.
///
/// Lock order, on every backend: the roots a write touches (sorted), then
/// the part's own row, then (after the write) the re-folds, which read the
/// roots again under locks they already hold. A root's own writes lock the
/// root and then read its parts, so no two transactions wait on each other
/// in opposite orders through a fold.
pub(super) struct PartWrites<Old: ShardedEntity, New: ShardedEntity> {
    pub(super) shared: Arc<Shared<Old, New>>,
    pub(super) part: usize,
}

impl<Old, New> PartWrites<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    fn def(&self) -> &dyn PartDef<Old> {
        &*self.shared.parts[self.part]
    }

    fn refused_if_done(&self) -> Result<()> {
        if self.shared.phase() == Phase::Done {
            return Err(self.shared.refused_err(format!(
                "`{}` is folded into `{}`, whose old tables are retired; write `{}` instead",
                self.def().table(),
                table_name::<New>(),
                table_name::<New>()
            )));
        }
        Ok(())
    }

    fn missing(&self, what: &str) -> ShardError {
        self.shared.refused_err(format!(
            "a write of `{}` folded into `{}` must carry its {what}",
            self.def().table(),
            table_name::<New>()
        ))
    }

    /// Locks the roots an update or delete of the part touches before the
    /// part's own row: the one it names now (as the write's model says, or
    /// read without a lock) and the one it moves to, in sorted order.
    async fn lock_roots(
        &self,
        ctx: &DualCtx<'_>,
        key: &KeyOf<Old>,
        pk: &[Value],
        named: Option<Value>,
        moving_to: Option<Value>,
    ) -> Result<()> {
        let def = self.def();
        let err = |e| {
            self.shared
                .db_err(ctx.shard, format!("select {}", def.table()), e)
        };
        let guess = match named {
            Some(link) => Some(link),
            None => def.stored_link(ctx.txn, key, pk).await.map_err(err)?,
        };
        let mut roots: Vec<Value> = guess.into_iter().chain(moving_to).collect();
        roots.sort_by_key(|v| tuple_text(std::slice::from_ref(v)));
        roots.dedup();
        for root in &roots {
            self.shared.lock_root(ctx, key, root).await?;
        }
        // The pipeline then reads the part's row under its lock; if a move
        // committed since the guess, the re-fold after the write locks the
        // root it names out of order (only a concurrent move of this very
        // row makes that happen, and a deadlock it may cause is reported as
        // one: retry the transaction).
        Ok(())
    }

    /// From `new_only` on: the write of a part applied to its root's folded
    /// row (read under its row lock, split with `to_old` and `to_old_parts`,
    /// changed, folded again).
    async fn apply_new_only(
        &self,
        ctx: &DualCtx<'_>,
        op: crate::pipeline::WriteOp,
        model: ActiveValues,
    ) -> Result<(Applied, CacheUpdate)> {
        let def = self.def();
        let (key, link, _) = def.key_link_pk(&model);
        let Some(key) = key else {
            return Err(self.missing("shard key"));
        };
        let Some(link) = link else {
            return Err(self.missing(&format!(
                "`{}` (the column that names its root; in {} the folded row is found by it)",
                def.link(),
                self.phase()
            )));
        };
        let shared = &self.shared;
        let what = format!(
            "{} {} (as {})",
            op.as_str(),
            def.table(),
            table_name::<New>()
        );
        let Some(current) = shared
            .new_row_in(ctx, &key, std::slice::from_ref(&link))
            .await?
        else {
            return Err(shared.db_err(
                ctx.shard,
                what,
                DbErr::RecordNotFound(format!(
                    "no `{}` row with primary key {} under this key for `{}`.`{}` to fold into",
                    table_name::<New>(),
                    tuple_text(std::slice::from_ref(&link)),
                    def.table(),
                    def.link()
                )),
            ));
        };
        let (Some(to_old), Some(to_old_parts)) = (&shared.to_old, &shared.to_old_parts) else {
            return Err(shared.refused_err(format!(
                "in {} a write of `{}` is applied to the folded row, which needs \
                 Rollout::to_old and Rollout::to_old_parts",
                self.phase(),
                def.table()
            )));
        };
        let root = to_old(&current);
        let mut parts = to_old_parts(&current);
        let applied = def.apply(&mut parts, op, model).map_err(|e| match e {
            DbErr::RecordNotUpdated => shared.refused_err(format!(
                "in {}, `{}` row to update is not among the rows folded into `{}` {}: it does \
                 not exist, or the update moves it to another `{}` (not supported from \
                 new_only on: delete it and insert it there)",
                self.phase(),
                def.table(),
                table_name::<New>(),
                tuple_text(std::slice::from_ref(&link)),
                def.link()
            )),
            DbErr::RecordNotInserted => shared.refused_err(format!(
                "`{}` already holds this `{}` row (duplicate primary key)",
                table_name::<New>(),
                def.table()
            )),
            other => shared.db_err(ctx.shard, what.clone(), other),
        })?;
        let new = (shared.to_new)(&root, &parts);
        shared.write_new(ctx, &root, new.clone(), false).await?;
        Ok((applied, shared.self_arc().fill_both(root, new)))
    }
}

/// Both cache updates, in order.
fn both(a: CacheUpdate, b: CacheUpdate) -> CacheUpdate {
    Box::new(move || {
        a();
        b();
    })
}

impl<Old, New> OldWrites for PartWrites<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn phase(&self) -> Phase {
        self.shared.phase()
    }

    fn old_reads(&self) -> OldReads {
        let phase = self.phase();
        if phase >= Phase::NewOnly {
            return OldReads::Refused(format!(
                "in {phase} the table `{}` (folded into `{}`) is no longer written, and its rows \
                 cannot be read from the folded table: read them with the rollout's \
                 `get_parts(key, id)` (and the root with `get_old(key, id)`), or read `{}`",
                self.def().table(),
                table_name::<New>(),
                table_name::<New>()
            ));
        }
        OldReads::Old
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }

    fn needs_current(&self) -> bool {
        true
    }

    fn before_write<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        op: crate::pipeline::WriteOp,
        model: ActiveValues,
    ) -> BoxFuture<'a, Result<Option<CacheUpdate>>> {
        use crate::pipeline::WriteOp;
        Box::pin(async move {
            self.refused_if_done()?;
            if !self.phase().caches() {
                return Ok(None);
            }
            let (key, link, pk) = self.def().key_link_pk(&model);
            let Some(key) = key else {
                return Err(self.missing("shard key"));
            };
            if op == WriteOp::Insert {
                if let Some(link) = &link {
                    self.shared.lock_root(&ctx, &key, link).await?;
                }
                return Ok(None);
            }
            let Some(pk) = pk else {
                return Err(self.missing("primary key"));
            };
            let (named, moving_to) = match &model[self.def().link_position()] {
                ActiveValue::Unchanged(v) => (Some(v.clone()), None),
                ActiveValue::Set(v) if op == WriteOp::Update => (None, Some(v.clone())),
                _ => (None, None),
            };
            self.lock_roots(&ctx, &key, &pk, named, moving_to).await?;
            Ok(None)
        })
    }

    fn after_write<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        row: RowValues,
        current: Option<RowValues>,
    ) -> BoxFuture<'a, Result<Option<CacheUpdate>>> {
        Box::pin(async move {
            self.refused_if_done()?;
            let phase = self.phase();
            if !phase.caches() {
                return Ok(None);
            }
            let model: ActiveValues = row.into_iter().map(ActiveValue::Set).collect();
            let (Some(key), Some(link), _) = self.def().key_link_pk(&model) else {
                return Ok(None);
            };
            let shared = self.shared.self_arc();
            let after = shared.refold(&ctx, &key, &link, phase.writes_new()).await?;
            // Moved to another root: the one it left is folded without it.
            let left = current
                .map(|row| row[self.def().link_position()].clone())
                .filter(|before| *before != link);
            match left {
                Some(before) => {
                    let other = shared
                        .refold(&ctx, &key, &before, phase.writes_new())
                        .await?;
                    Ok(Some(both(after, other)))
                }
                None => Ok(Some(after)),
            }
        })
    }

    fn after_delete<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        model: ActiveValues,
        current: Option<RowValues>,
    ) -> BoxFuture<'a, Result<(u64, Option<CacheUpdate>)>> {
        Box::pin(async move {
            self.refused_if_done()?;
            let phase = self.phase();
            if phase >= Phase::NewOnly {
                let (saved, after) = self
                    .apply_new_only(&ctx, crate::pipeline::WriteOp::Delete, model)
                    .await?;
                return match saved {
                    Applied::Deleted(n) => Ok((n, Some(after))),
                    Applied::Saved(_) => Ok((1, Some(after))),
                };
            }
            // The row is gone: its root, as it was, is folded without it.
            let (Some(current), true) = (current, phase.caches()) else {
                return Ok((0, None));
            };
            let link = current[self.def().link_position()].clone();
            let (Some(key), _, _) = self.def().key_link_pk(&model) else {
                return Err(self.missing("shard key"));
            };
            let shared = self.shared.self_arc();
            let after = shared.refold(&ctx, &key, &link, phase.writes_new()).await?;
            Ok((0, Some(after)))
        })
    }

    fn write_new_only<'a>(
        &'a self,
        ctx: DualCtx<'a>,
        model: ActiveValues,
        update: bool,
    ) -> BoxFuture<'a, Result<(RowValues, CacheUpdate)>> {
        Box::pin(async move {
            self.refused_if_done()?;
            let op = if update {
                crate::pipeline::WriteOp::Update
            } else {
                crate::pipeline::WriteOp::Insert
            };
            match self.apply_new_only(&ctx, op, model).await? {
                (Applied::Saved(row), after) => Ok((row, after)),
                (Applied::Deleted(_), _) => Err(ShardError::internal(format!(
                    "rollout `{}`: a part write answered with a delete",
                    self.shared.name
                ))),
            }
        })
    }
}
