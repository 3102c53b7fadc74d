//! The lookup table of `placement = "directory"` groups: one row per key,
//! naming the logical shard the key lives on.

use sea_orm_migration::prelude::*;

/// Creates `shardkit_directory (group_name, shard_key, shard)`.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261122_000001_create_shardkit_directory"
    }
}

#[derive(DeriveIden)]
enum ShardkitDirectory {
    Table,
    GroupName,
    ShardKey,
    Shard,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ShardkitDirectory::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ShardkitDirectory::GroupName)
                            .string_len(128)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitDirectory::ShardKey)
                            .string_len(255)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitDirectory::Shard)
                            .string_len(128)
                            .not_null(),
                    )
                    .primary_key(
                        Index::create()
                            .col(ShardkitDirectory::GroupName)
                            .col(ShardkitDirectory::ShardKey),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(ShardkitDirectory::Table).to_owned())
            .await
    }
}
