//! Reference tables: the version of each shard's copy.
//!
//! `shardkit_reference_versions` holds one row per reference table (`tbl`)
//! on every shard: the version its copy holds. On the source shard (the
//! cluster's first) it is also the counter a write takes its version from.

use crate::m20261126_000010_create_cross_key::{big, text};
use sea_orm_migration::prelude::*;

/// Creates the reference tables' version table.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261127_000011_create_reference"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let b = manager.get_database_backend();
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("shardkit_reference_versions"))
                    .if_not_exists()
                    .col(text(b, "tbl", 128).primary_key())
                    .col(big("version"))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(Alias::new("shardkit_reference_versions"))
                    .if_exists()
                    .to_owned(),
            )
            .await
    }
}
