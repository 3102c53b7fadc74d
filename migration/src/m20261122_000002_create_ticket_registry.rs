//! The ticket-server registry: which named sequences a ticket server holds.
//! Each sequence then has its own `tickets_<name>` table (see
//! [`crate::ticket_table`]).

use sea_orm_migration::prelude::*;

/// Creates `shardkit_ticket_sequences (name)`.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261122_000002_create_ticket_registry"
    }
}

#[derive(DeriveIden)]
enum ShardkitTicketSequences {
    Table,
    Name,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ShardkitTicketSequences::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ShardkitTicketSequences::Name)
                            .string_len(64)
                            .not_null()
                            .primary_key(),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(ShardkitTicketSequences::Table)
                    .to_owned(),
            )
            .await
    }
}
