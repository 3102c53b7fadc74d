//! The live bucket map of `movable` groups and the state of bucket moves.
//!
//! On the group's first configured shard (its control database):
//! `shardkit_bucket_epochs` (one row per group: the map's epoch),
//! `shardkit_bucket_map` (each bucket's owner), `shardkit_moves` (each move
//! and its phase) and `shardkit_move_buckets` (which move holds which
//! bucket, so two moves of one bucket cannot run at once). On every shard:
//! `shardkit_bucket_states` (whether this shard takes writes for a bucket:
//! the fence) and `shardkit_move_changes` (keys written while their bucket
//! moves away from this shard).

use sea_orm_migration::prelude::*;

/// Creates the bucket-map and bucket-move tables.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261123_000006_create_bucket_moves"
    }
}

#[derive(DeriveIden)]
enum ShardkitBucketEpochs {
    Table,
    /// The group's name.
    Grp,
    /// Bumped by every cut-over.
    Epoch,
    /// The group's number of buckets.
    Buckets,
}

#[derive(DeriveIden)]
enum ShardkitBucketMap {
    Table,
    Grp,
    Bucket,
    /// The owning shard's name.
    Shard,
}

#[derive(DeriveIden)]
enum ShardkitBucketStates {
    Table,
    Grp,
    Bucket,
    /// `owned`, `moving` (writes are logged), `moved` (fenced) or `none`.
    State,
    /// The move that set `moving` or `moved`.
    MoveId,
}

#[derive(DeriveIden)]
enum ShardkitMoves {
    Table,
    Id,
    Grp,
    /// The shard the buckets move to.
    Target,
    /// The moving buckets and where each comes from (`bucket:shard,...`).
    Buckets,
    /// registered, copying, catching_up, verified, cutting_over, cleaning,
    /// done, aborted.
    Phase,
    /// Where the copy stopped (resumable).
    Cursor,
    RowsCopied,
    ChangesApplied,
    CutoverMs,
    CreatedMs,
    UpdatedMs,
    /// The last error the mover met.
    Error,
    /// The entities' tables, in the order the mover copies them.
    Tables,
    /// The process running the move (a token), while it holds the lease.
    Runner,
    /// Until when (clock ms) the runner's lease holds.
    LeaseMs,
}

#[derive(DeriveIden)]
enum ShardkitMoveBuckets {
    Table,
    Grp,
    Bucket,
    MoveId,
}

#[derive(DeriveIden)]
enum ShardkitMoveChanges {
    Table,
    Seq,
    MoveId,
    Bucket,
    /// The written key (`ShardKey::to_directory_text`).
    KeyText,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let name = |n: &mut ColumnDef| n.string_len(128).not_null().to_owned();
        manager
            .create_table(
                Table::create()
                    .table(ShardkitBucketEpochs::Table)
                    .if_not_exists()
                    .col(name(&mut ColumnDef::new(ShardkitBucketEpochs::Grp)).primary_key())
                    .col(
                        ColumnDef::new(ShardkitBucketEpochs::Epoch)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitBucketEpochs::Buckets)
                            .integer()
                            .not_null(),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(ShardkitBucketMap::Table)
                    .if_not_exists()
                    .col(name(&mut ColumnDef::new(ShardkitBucketMap::Grp)))
                    .col(
                        ColumnDef::new(ShardkitBucketMap::Bucket)
                            .integer()
                            .not_null(),
                    )
                    .col(name(&mut ColumnDef::new(ShardkitBucketMap::Shard)))
                    .primary_key(
                        Index::create()
                            .col(ShardkitBucketMap::Grp)
                            .col(ShardkitBucketMap::Bucket),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(ShardkitBucketStates::Table)
                    .if_not_exists()
                    .col(name(&mut ColumnDef::new(ShardkitBucketStates::Grp)))
                    .col(
                        ColumnDef::new(ShardkitBucketStates::Bucket)
                            .integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitBucketStates::State)
                            .string_len(16)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitBucketStates::MoveId)
                            .big_integer()
                            .null(),
                    )
                    .primary_key(
                        Index::create()
                            .col(ShardkitBucketStates::Grp)
                            .col(ShardkitBucketStates::Bucket),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(ShardkitMoves::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ShardkitMoves::Id)
                            .big_integer()
                            .not_null()
                            .auto_increment()
                            .primary_key(),
                    )
                    .col(name(&mut ColumnDef::new(ShardkitMoves::Grp)))
                    .col(name(&mut ColumnDef::new(ShardkitMoves::Target)))
                    .col(ColumnDef::new(ShardkitMoves::Buckets).text().not_null())
                    .col(
                        ColumnDef::new(ShardkitMoves::Phase)
                            .string_len(16)
                            .not_null(),
                    )
                    .col(ColumnDef::new(ShardkitMoves::Cursor).text().null())
                    .col(
                        ColumnDef::new(ShardkitMoves::RowsCopied)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoves::ChangesApplied)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoves::CutoverMs)
                            .big_integer()
                            .null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoves::CreatedMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoves::UpdatedMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(ColumnDef::new(ShardkitMoves::Error).text().null())
                    .col(ColumnDef::new(ShardkitMoves::Tables).text().not_null())
                    .col(ColumnDef::new(ShardkitMoves::Runner).string_len(64).null())
                    .col(ColumnDef::new(ShardkitMoves::LeaseMs).big_integer().null())
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(ShardkitMoveBuckets::Table)
                    .if_not_exists()
                    .col(name(&mut ColumnDef::new(ShardkitMoveBuckets::Grp)))
                    .col(
                        ColumnDef::new(ShardkitMoveBuckets::Bucket)
                            .integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoveBuckets::MoveId)
                            .big_integer()
                            .not_null(),
                    )
                    .primary_key(
                        Index::create()
                            .col(ShardkitMoveBuckets::Grp)
                            .col(ShardkitMoveBuckets::Bucket),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(ShardkitMoveChanges::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ShardkitMoveChanges::Seq)
                            .big_integer()
                            .not_null()
                            .auto_increment()
                            .primary_key(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoveChanges::MoveId)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoveChanges::Bucket)
                            .integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitMoveChanges::KeyText)
                            .text()
                            .not_null(),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            ShardkitMoveChanges::Table.into_iden(),
            ShardkitMoveBuckets::Table.into_iden(),
            ShardkitMoves::Table.into_iden(),
            ShardkitBucketStates::Table.into_iden(),
            ShardkitBucketMap::Table.into_iden(),
            ShardkitBucketEpochs::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).if_exists().to_owned())
                .await?;
        }
        Ok(())
    }
}
