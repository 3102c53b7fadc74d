//! Fencing tokens for bucket moves.
//!
//! `shardkit_moves.generation` (on the group's control database) counts the
//! times a mover took the move: every take-over, after a lapsed hold or not,
//! raises it. `shardkit_move_fences` (on every shard) holds, per move, the
//! generation whose mover may write there: a mover installs its generation
//! on each shard the move touches before it writes anything, and every
//! write it makes to a shard checks that row in the same transaction, so a
//! mover that was paused past its hold and resumes is refused where its
//! writes land.

use sea_orm_migration::prelude::*;

/// Adds the move generation and the per-shard fences.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261125_000009_add_move_fencing"
    }
}

#[derive(DeriveIden)]
enum ShardkitMoves {
    Table,
    /// Raised by every take-over of the move (`run`, `abort`).
    Generation,
}

#[derive(DeriveIden)]
enum ShardkitMoveFences {
    Table,
    Grp,
    MoveId,
    /// The generation whose mover may write on this shard.
    Generation,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if !manager.has_column("shardkit_moves", "generation").await? {
            manager
                .alter_table(
                    Table::alter()
                        .table(ShardkitMoves::Table)
                        .add_column(
                            ColumnDef::new(ShardkitMoves::Generation)
                                .big_integer()
                                .not_null()
                                .default(0),
                        )
                        .to_owned(),
                )
                .await?;
        }
        manager
            .create_table(
                Table::create()
                    .table(ShardkitMoveFences::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ShardkitMoveFences::Grp)
                            .string_len(128)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoveFences::MoveId)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoveFences::Generation)
                            .big_integer()
                            .not_null(),
                    )
                    .primary_key(
                        Index::create()
                            .col(ShardkitMoveFences::Grp)
                            .col(ShardkitMoveFences::MoveId),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(ShardkitMoveFences::Table)
                    .if_exists()
                    .to_owned(),
            )
            .await?;
        if manager.has_column("shardkit_moves", "generation").await? {
            manager
                .alter_table(
                    Table::alter()
                        .table(ShardkitMoves::Table)
                        .drop_column(ShardkitMoves::Generation)
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    }
}
