//! The longest cleanup grace of the processes of a cluster, per movable
//! group, in `shardkit_bucket_epochs.grace_ms`.
//!
//! A mover deletes a moved bucket's rows from its old shard a grace after
//! the flip, and an application instance routes reads by a map it read up
//! to three quarters of its own grace ago: an instance configured with a
//! longer grace than a mover's could read a bucket the mover had cleaned.
//! Every process now records its `cleanup_grace_ms` here when it reads the
//! map (the largest stays), and a mover cleans after the longest recorded
//! one. `NULL`: none recorded yet (the mover's own grace applies).

use sea_orm_migration::prelude::*;

/// Adds the recorded cleanup grace to the bucket maps' epochs.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261128_000013_add_cleanup_grace"
    }
}

#[derive(DeriveIden)]
enum ShardkitBucketEpochs {
    Table,
    /// The longest `cleanup_grace_ms` a process of the cluster has recorded.
    GraceMs,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager
            .has_column("shardkit_bucket_epochs", "grace_ms")
            .await?
        {
            return Ok(());
        }
        manager
            .alter_table(
                Table::alter()
                    .table(ShardkitBucketEpochs::Table)
                    .add_column(
                        ColumnDef::new(ShardkitBucketEpochs::GraceMs)
                            .big_integer()
                            .null(),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager
            .has_column("shardkit_bucket_epochs", "grace_ms")
            .await?
        {
            manager
                .alter_table(
                    Table::alter()
                        .table(ShardkitBucketEpochs::Table)
                        .drop_column(ShardkitBucketEpochs::GraceMs)
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    }
}
