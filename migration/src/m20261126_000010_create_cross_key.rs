//! Cross-key work: the outbox, the inbox, sagas and idempotent requests.
//!
//! Every row names the group and key it belongs to (`grp`, `key_text`: the
//! key's directory text), lives on that key's shard and moves with the
//! key's bucket. Each table has one text primary key, `id`.
//!
//! - `shardkit_outbox`: messages a transaction of `(grp, key_text)` sent to
//!   `(to_grp, to_key)`, pending or parked; a delivered message's row is
//!   deleted. `seq` orders a key's messages.
//! - `shardkit_inbox`: the ids of the messages (and saga steps) applied to
//!   a key, written in the transaction that applied them.
//! - `shardkit_sagas`: a saga's state on its originating key's shard.
//! - `shardkit_requests`: the stored outcome of an idempotent request.

use sea_orm_migration::prelude::*;

/// Creates the outbox, inbox, saga and request tables.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261126_000010_create_cross_key"
    }
}

fn text(name: &str, len: u32) -> ColumnDef {
    ColumnDef::new(Alias::new(name))
        .string_len(len)
        .not_null()
        .to_owned()
}

fn big(name: &str) -> ColumnDef {
    ColumnDef::new(Alias::new(name))
        .big_integer()
        .not_null()
        .to_owned()
}

fn long(name: &str) -> ColumnDef {
    ColumnDef::new(Alias::new(name)).text().null().to_owned()
}

/// A table of an `id` primary key, the owning `grp` and `key_text`, then
/// `columns`, with an index on `(grp, key_text)`.
fn table(name: &str, id_len: u32, columns: Vec<ColumnDef>) -> TableCreateStatement {
    let mut t = Table::create();
    t.table(Alias::new(name))
        .if_not_exists()
        .col(text("id", id_len).primary_key())
        .col(text("grp", 128))
        .col(text("key_text", 255));
    for c in columns {
        t.col(c);
    }
    t.to_owned()
}

fn key_index(table: &str, extra: &[&str]) -> IndexCreateStatement {
    let mut i = Index::create();
    i.name(format!("{table}_key"))
        .table(Alias::new(table))
        .if_not_exists()
        .col(Alias::new("grp"))
        .col(Alias::new("key_text"));
    for c in extra {
        i.col(Alias::new(*c));
    }
    i.to_owned()
}

const TABLES: [&str; 4] = [
    "shardkit_outbox",
    "shardkit_inbox",
    "shardkit_sagas",
    "shardkit_requests",
];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let outbox = table(
            TABLES[0],
            40,
            vec![
                big("seq"),
                text("to_grp", 128),
                text("to_key", 255),
                text("kind", 128),
                ColumnDef::new(Alias::new("payload"))
                    .text()
                    .not_null()
                    .to_owned(),
                text("state", 16),
                ColumnDef::new(Alias::new("attempts"))
                    .integer()
                    .not_null()
                    .to_owned(),
                big("next_at"),
                big("created_at"),
                long("last_error"),
            ],
        );
        let inbox = table(TABLES[1], 96, vec![big("received_at")]);
        let sagas = table(
            TABLES[2],
            40,
            vec![
                text("name", 128),
                ColumnDef::new(Alias::new("step"))
                    .integer()
                    .not_null()
                    .to_owned(),
                text("state", 16),
                ColumnDef::new(Alias::new("data"))
                    .text()
                    .not_null()
                    .to_owned(),
                ColumnDef::new(Alias::new("attempts"))
                    .integer()
                    .not_null()
                    .to_owned(),
                big("next_at"),
                big("created_at"),
                big("updated_at"),
                long("error"),
            ],
        );
        let requests = table(
            TABLES[3],
            512,
            vec![text("request_id", 200), long("outcome"), big("created_at")],
        );
        for t in [outbox, inbox, sagas, requests] {
            manager.create_table(t).await?;
        }
        manager.create_index(key_index(TABLES[0], &["seq"])).await?;
        for t in &TABLES[1..] {
            manager.create_index(key_index(t, &[])).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for t in TABLES {
            manager
                .drop_table(Table::drop().table(Alias::new(t)).if_exists().to_owned())
                .await?;
        }
        Ok(())
    }
}
