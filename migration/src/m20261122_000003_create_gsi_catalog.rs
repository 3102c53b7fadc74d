//! The catalog of global secondary indexes: one row per index, on every shard
//! of its group.

use sea_orm_migration::prelude::*;

/// Creates `shardkit_gsi_catalog`.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261122_000003_create_gsi_catalog"
    }
}

#[derive(DeriveIden)]
enum ShardkitGsiCatalog {
    Table,
    Name,
    PrimaryTable,
    GsiTable,
    SecondaryColumn,
    ShardKeyColumn,
    IsUnique,
    State,
    Progress,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ShardkitGsiCatalog::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ShardkitGsiCatalog::Name)
                            .string_len(128)
                            .not_null()
                            .primary_key(),
                    )
                    .col(
                        ColumnDef::new(ShardkitGsiCatalog::PrimaryTable)
                            .string_len(128)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitGsiCatalog::GsiTable)
                            .string_len(128)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitGsiCatalog::SecondaryColumn)
                            .string_len(128)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitGsiCatalog::ShardKeyColumn)
                            .string_len(128)
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitGsiCatalog::IsUnique)
                            .boolean()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitGsiCatalog::State)
                            .string_len(16)
                            .not_null(),
                    )
                    .col(ColumnDef::new(ShardkitGsiCatalog::Progress).text().null())
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(ShardkitGsiCatalog::Table).to_owned())
            .await
    }
}
