//! The instances that registered each rollout: who acts on its phase, with
//! which cache lifetime, and when each last re-read the phase. Read by
//! `RolloutHandle::status`, and by instances that write a rollout's old
//! entity without having registered the rollout (they warn).

use sea_orm_migration::prelude::*;

/// Creates `shardkit_rollout_instances`.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261123_000005_create_rollout_instances"
    }
}

#[derive(DeriveIden)]
enum ShardkitRolloutInstances {
    Table,
    /// The rollout's name (`shardkit_rollouts.name`).
    Rollout,
    /// The instance's name (`Rollout::instance`, or one made at registration).
    Instance,
    /// The rollout's old table.
    OldTable,
    /// The instance's cache lifetime (ms).
    CacheTtlMs,
    /// How often the instance re-reads the phase (ms).
    RefreshMs,
    /// When it last re-read the phase (Unix ms).
    SeenMs,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ShardkitRolloutInstances::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ShardkitRolloutInstances::Rollout)
                            .string_len(128)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitRolloutInstances::Instance)
                            .string_len(128)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitRolloutInstances::OldTable)
                            .string_len(128)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitRolloutInstances::CacheTtlMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitRolloutInstances::RefreshMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitRolloutInstances::SeenMs)
                            .big_integer()
                            .not_null(),
                    )
                    .primary_key(
                        Index::create()
                            .col(ShardkitRolloutInstances::Rollout)
                            .col(ShardkitRolloutInstances::Instance),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(ShardkitRolloutInstances::Table)
                    .to_owned(),
            )
            .await
    }
}
