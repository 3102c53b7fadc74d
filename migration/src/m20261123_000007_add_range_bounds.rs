//! Key ranges in the live map, so range groups can split and move ranges.
//!
//! A `movable` range group keeps its ranges in `shardkit_bucket_map`: one
//! row per range (its id in `bucket`), with the range's bounds in `lo` and
//! `hi` (`NULL`: unbounded; otherwise `i:<integer>` or `t:<text>`). Hash
//! groups leave both `NULL`.

use sea_orm_migration::prelude::*;

/// Adds the range bounds to the bucket map.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261123_000007_add_range_bounds"
    }
}

#[derive(DeriveIden)]
enum ShardkitBucketMap {
    Table,
    /// The range's lower bound (inclusive).
    Lo,
    /// The range's upper bound (exclusive).
    Hi,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One column per statement: SQLite adds one at a time.
        for column in [ShardkitBucketMap::Lo, ShardkitBucketMap::Hi] {
            if manager
                .has_column("shardkit_bucket_map", &column.to_string())
                .await?
            {
                continue;
            }
            manager
                .alter_table(
                    Table::alter()
                        .table(ShardkitBucketMap::Table)
                        .add_column(ColumnDef::new(column).text().null())
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for column in [ShardkitBucketMap::Lo, ShardkitBucketMap::Hi] {
            if manager
                .has_column("shardkit_bucket_map", &column.to_string())
                .await?
            {
                manager
                    .alter_table(
                        Table::alter()
                            .table(ShardkitBucketMap::Table)
                            .drop_column(column)
                            .to_owned(),
                    )
                    .await?;
            }
        }
        Ok(())
    }
}
