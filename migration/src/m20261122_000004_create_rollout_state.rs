//! The shared state of denormalisation rollouts: one row per rollout, read on
//! the first shard of its group by every instance of the application.

use sea_orm_migration::prelude::*;

/// Creates `shardkit_rollouts`.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261122_000004_create_rollout_state"
    }
}

#[derive(DeriveIden)]
enum ShardkitRollouts {
    Table,
    /// The rollout's name.
    Name,
    /// `off`, `cache_both`, `dual_write`, `read_new`, `new_only` or `done`.
    Phase,
    /// When the phase last changed (Unix ms; 0 = never).
    ChangedMs,
    /// The least time between two phase changes: the longest cache TTL plus
    /// refresh interval of any instance that registered the rollout.
    GapMs,
    /// Backfill progress (`<shard index>:<last primary key>`), NULL when none.
    Backfill,
    /// Verifier progress, NULL when none.
    Verify,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ShardkitRollouts::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ShardkitRollouts::Name)
                            .string_len(128)
                            .not_null()
                            .primary_key(),
                    )
                    .col(
                        ColumnDef::new(ShardkitRollouts::Phase)
                            .string_len(16)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitRollouts::ChangedMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitRollouts::GapMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(ColumnDef::new(ShardkitRollouts::Backfill).text().null())
                    .col(ColumnDef::new(ShardkitRollouts::Verify).text().null())
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(ShardkitRollouts::Table).to_owned())
            .await
    }
}
