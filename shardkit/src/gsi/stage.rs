//! The write stage of global indexes ([`IndexFirst`]).

use crate::entity::ShardedEntity;
use crate::error::Result;
use crate::gsi::{Gsi, GsiState, IndexDef};
use crate::key::active_pk as owner_pk;
use crate::key::{model_pk, value_text};
use crate::pipeline::{WriteCtx, WriteOp, WriteStage, Written};
use sea_orm::{ActiveModelTrait, ActiveValue, IdenStatic, ModelTrait};
use std::sync::Arc;

/// The write stage of global indexes (see [`crate::pipeline`]): an insert's
/// or update's index rows are written before the row (index-first), and an
/// update's or delete's replaced index rows are removed after the commit.
#[doc(hidden)]
pub struct IndexFirst {
    state: Arc<GsiState>,
}

impl IndexFirst {
    pub(crate) fn new(state: Arc<GsiState>) -> Self {
        IndexFirst { state }
    }

    /// Queues removal of `row`'s index rows for the indexes `changed`
    /// selects, after the commit, each as the version it has now.
    async fn queue_removals<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        row: &E::Model,
        changed: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let gsi = Gsi::new(ctx.shards, &self.state);
        let owner = model_pk::<E>(row);
        for (column, unique) in E::GLOBAL_INDEXES {
            if !changed(column.as_str()) {
                continue;
            }
            let index = IndexDef::of::<E>(*column, *unique);
            let removal = gsi
                .removal::<E>(
                    &index,
                    &row.get(*column),
                    ctx.key(),
                    &owner,
                    Some((ctx.shard, ctx.txn)),
                )
                .await?;
            if let Some(removal) = removal {
                let shards = ctx.shards.for_task();
                let state = Arc::clone(&self.state);
                // Old index rows go only once the row's commit made them
                // stale; a failure leaves a dangling row, which lookups
                // ignore and reconciliation removes.
                ctx.defer(Box::pin(async move {
                    if let Err(err) = Gsi::new(&shards, &state).remove_entry(&removal).await {
                        tracing::warn!(index = %removal.index.table, error = %err.report(), "index row left for reconciliation");
                    }
                }));
            }
        }
        Ok(())
    }

    // `op` names the operation in the failpoint's error only.
    #[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
    async fn index_rows<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        op: WriteOp,
        model: &E::ActiveModel,
        current: Option<&E::Model>,
    ) -> Result<()> {
        let owner = owner_pk(model);
        let gsi = Gsi::new(ctx.shards, &self.state);
        let mut changed = Vec::new();
        for (column, unique) in E::GLOBAL_INDEXES {
            let value = match (model.get(*column), current) {
                (ActiveValue::Set(v), _) | (ActiveValue::Unchanged(v), None) => v,
                _ => continue,
            };
            if let Some(current) = current {
                if value_text(&current.get(*column)) == value_text(&value) {
                    continue;
                }
                changed.push(column.as_str());
            }
            let index = IndexDef::of::<E>(*column, *unique);
            gsi.write_entry_from::<E>(
                &index,
                &value,
                ctx.key(),
                &owner,
                Some((ctx.shard, ctx.txn)),
            )
            .await?;
        }
        fail::fail_point!("shardkit::gsi::after_index_write", |_| Err(
            crate::error::ShardError::db(
                crate::error::Origin::Group(<E::Group as crate::entity::EntityGroup>::NAME),
                ctx.shard_name.to_owned(),
                format!("{} {}", op.as_str(), crate::entity::table_name::<E>()),
                sea_orm::DbErr::Custom("failpoint shardkit::gsi::after_index_write".into())
            )
        ));
        if let Some(current) = current {
            self.queue_removals::<E>(ctx, current, |c| changed.contains(&c))
                .await?;
        }
        Ok(())
    }
}

impl crate::pipeline::sealed::Sealed for IndexFirst {}

impl WriteStage for IndexFirst {
    fn batch<E: ShardedEntity>(&self, _ctx: &WriteCtx<'_>, _op: WriteOp) -> crate::pipeline::Batch {
        if E::GLOBAL_INDEXES.is_empty() {
            crate::pipeline::Batch::Statement
        } else {
            crate::pipeline::Batch::PerRow
        }
    }

    fn needs_current<E: ShardedEntity>(&self, op: WriteOp) -> bool {
        op != WriteOp::Insert && !E::GLOBAL_INDEXES.is_empty()
    }

    /// Writes the index rows of `model`'s indexed values, each committed on
    /// its own before the primary write. For an update (`current` is the row
    /// as it is), only changed values are written, and the replaced rows are
    /// queued for removal after the commit.
    async fn before_write<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        op: WriteOp,
        model: &E::ActiveModel,
        current: Option<&E::Model>,
    ) -> Result<()> {
        if E::GLOBAL_INDEXES.is_empty() || (op == WriteOp::Update && current.is_none()) {
            return Ok(());
        }
        // Boxed: the index writes' state would otherwise sit inside every
        // write's future, whether its entity has indexes or not.
        Box::pin(self.index_rows::<E>(ctx, op, model, current)).await
    }

    /// A deleted row's index rows go after the commit.
    async fn after_write<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        _op: WriteOp,
        written: Written<'_, E>,
    ) -> Result<()> {
        if let Written::Deleted {
            current: Some(current),
            rows: 1..,
            ..
        } = written
        {
            Box::pin(self.queue_removals::<E>(ctx, current, |_| true)).await?;
        }
        Ok(())
    }
}
