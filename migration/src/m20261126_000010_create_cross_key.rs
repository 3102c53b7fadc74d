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
use sea_orm_migration::sea_orm::DbBackend;

/// Creates the outbox, inbox, saga and request tables.
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261126_000010_create_cross_key"
    }
}

/// A text column compared byte for byte: MySQL/MariaDB's default
/// collations would make keys, ids and request ids that differ only in case
/// or accents equal.
pub(crate) fn text(backend: DbBackend, name: &str, len: u32) -> ColumnDef {
    let mut def = ColumnDef::new(Alias::new(name));
    match backend {
        DbBackend::MySql => def.custom(Alias::new(format!(
            "VARCHAR({len}) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
        ))),
        _ => def.string_len(len),
    };
    def.not_null().to_owned()
}

pub(crate) fn big(name: &str) -> ColumnDef {
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
fn table(
    backend: DbBackend,
    name: &str,
    id_len: u32,
    columns: Vec<ColumnDef>,
) -> TableCreateStatement {
    let mut t = Table::create();
    t.table(Alias::new(name))
        .if_not_exists()
        .col(text(backend, "id", id_len).primary_key())
        .col(text(backend, "grp", 128))
        .col(text(backend, "key_text", 255));
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
        let b = manager.get_database_backend();
        let text = |name: &str, len: u32| text(b, name, len);
        let outbox = table(
            b,
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
        let inbox = table(b, TABLES[1], 96, vec![big("received_at")]);
        let sagas = table(
            b,
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
            b,
            TABLES[3],
            640,
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
