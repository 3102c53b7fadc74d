//! The write stage of ids: fills an insert's unset id.

use crate::entity::{EntityGroup, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::id_spec::IdStrategy;
use crate::ids::handle::Ids;
use crate::pipeline::{WriteCtx, WriteOp, WriteStage};

/// The write stage of ids (see [`crate::pipeline`]): an insert whose
/// `#[shardkit(id = "...")]` primary key is unset gets a fresh id.
#[doc(hidden)]
pub struct FillIds {
    ids: Ids,
}

impl FillIds {
    pub(crate) fn new(ids: Ids) -> Self {
        FillIds { ids }
    }
}

impl crate::pipeline::sealed::Sealed for FillIds {}

impl WriteStage for FillIds {
    async fn prepare<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        op: WriteOp,
        model: &mut E::ActiveModel,
    ) -> Result<()> {
        use sea_orm::ActiveModelTrait;
        let Some((column, strategy)) = E::ID else {
            return Ok(());
        };
        if op != WriteOp::Insert || !model.get(column).is_not_set() {
            return Ok(());
        }
        // Boxed, so writes of entities without ids do not carry its state.
        let id = match strategy {
            IdStrategy::Encoded(sequence) => {
                // The pipeline checked the row's key is the transaction's.
                let key = E::active_shard_key(model).ok_or(ShardError::MissingShardKey {
                    entity: table_name::<E>(),
                    column: E::SHARD_KEY_FIELD,
                })?;
                let topology = ctx.shards.topology();
                Box::pin(self.ids.next_encoded::<E::Group>(topology, sequence, &key))
                    .await?
                    .into()
            }
            strategy => Box::pin(self.ids.generate(strategy)).await?,
        };
        model.try_set(column, id).map_err(|source| {
            ShardError::db(
                crate::error::Origin::Group(<E::Group as EntityGroup>::NAME),
                ctx.shard_name.to_owned(),
                format!("insert {}", table_name::<E>()),
                source,
            )
        })
    }
}
