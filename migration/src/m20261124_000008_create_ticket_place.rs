//! A ticket server's place among the ticket servers.
//!
//! Server `i` of `n` hands out tickets `≡ i + 1 (mod n)`. Setting up the ids
//! (`cluster.migrate`, `create_sequence`) records on every server, once, its
//! place and the whole `ids.servers` list (one row, `stub = 'a'`), then marks
//! the row `confirmed` once every server's record agrees. A server hands out
//! tickets only to a config that matches its confirmed record: a config that
//! moved a server, or added or removed one, would hand out tickets another
//! server has already given.

use sea_orm_migration::prelude::*;

/// Creates `shardkit_ticket_place (stub, position, servers, confirmed)`.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261124_000008_create_ticket_place"
    }
}

#[derive(DeriveIden)]
enum ShardkitTicketPlace {
    Table,
    /// Always `'a'`: the table holds one row.
    Stub,
    /// The server's place, 1-based: it hands out tickets `≡ position (mod servers)`.
    Position,
    /// The names of all ticket servers, in order (a JSON array).
    Servers,
    /// Every server of `servers` holds a record that agrees.
    Confirmed,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ShardkitTicketPlace::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ShardkitTicketPlace::Stub)
                            .char_len(1)
                            .not_null()
                            .primary_key(),
                    )
                    .col(
                        ColumnDef::new(ShardkitTicketPlace::Position)
                            .integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitTicketPlace::Servers)
                            .text()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(ShardkitTicketPlace::Confirmed)
                            .boolean()
                            .not_null()
                            .default(false),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(ShardkitTicketPlace::Table).to_owned())
            .await
    }
}
