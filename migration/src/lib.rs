//! shardkit's own tables, as [sea-orm-migration] migrations.
//!
//! Add them to your application's `Migrator` ahead of your own, then let
//! `cluster.migrate::<Migrator>()` apply everything to every shard:
//!
//! ```text
//! pub struct Migrator;
//!
//! #[async_trait::async_trait]
//! impl MigratorTrait for Migrator {
//!     fn migrations() -> Vec<Box<dyn MigrationTrait>> {
//!         let mut all = shardkit_migration::migrations();
//!         all.push(Box::new(m20260101_000001_create_orders::Migration));
//!         all
//!     }
//! }
//! ```
//!
//! Or run shardkit's alone with [`Migrator`].
//!
//! [sea-orm-migration]: https://docs.rs/sea-orm-migration

use sea_orm_migration::prelude::*;

pub mod m20261122_000001_create_shardkit_directory;
pub mod m20261122_000002_create_ticket_registry;
pub mod m20261122_000003_create_gsi_catalog;
pub mod m20261122_000004_create_rollout_state;
pub mod m20261123_000005_create_rollout_instances;
pub mod m20261123_000006_create_bucket_moves;
pub mod m20261123_000007_add_range_bounds;
pub mod m20261124_000008_create_ticket_place;
pub mod m20261125_000009_add_move_fencing;
pub mod m20261126_000010_create_cross_key;
pub mod m20261127_000011_create_reference;
pub mod m20261128_000012_exact_keys;
pub mod m20261128_000013_add_cleanup_grace;

pub use m20261128_000012_exact_keys::mysql_exact_collation;

/// shardkit's migrations, in order.
pub fn migrations() -> Vec<Box<dyn MigrationTrait>> {
    vec![
        Box::new(m20261122_000001_create_shardkit_directory::Migration),
        Box::new(m20261122_000002_create_ticket_registry::Migration),
        Box::new(m20261122_000003_create_gsi_catalog::Migration),
        Box::new(m20261122_000004_create_rollout_state::Migration),
        Box::new(m20261123_000005_create_rollout_instances::Migration),
        Box::new(m20261123_000006_create_bucket_moves::Migration),
        Box::new(m20261123_000007_add_range_bounds::Migration),
        // For a ticket server that shares a shard's database (one database
        // gets the application's migrator).
        Box::new(m20261124_000008_create_ticket_place::Migration),
        Box::new(m20261125_000009_add_move_fencing::Migration),
        Box::new(m20261126_000010_create_cross_key::Migration),
        Box::new(m20261127_000011_create_reference::Migration),
        Box::new(m20261128_000012_exact_keys::Migration),
        Box::new(m20261128_000013_add_cleanup_grace::Migration),
    ]
}

/// The table of one named ticket sequence, Flickr's `Tickets64`: a 64-bit
/// `id` and a unique one-character `stub`, holding one row.
///
/// On MySQL/MariaDB `id` is `AUTO_INCREMENT` and tickets come from
/// `REPLACE INTO ... (stub) VALUES ('a')` with per-session
/// `auto_increment_increment`/`auto_increment_offset`. On PostgreSQL and
/// SQLite `id` is a plain `BIGINT` advanced by an upsert (`ON CONFLICT (stub)
/// DO UPDATE SET id = id + n RETURNING id`).
///
/// `name` must be a valid sequence name (ASCII lowercase letters, digits and
/// `_`); the table is `tickets_<name>`.
pub fn ticket_table(
    backend: sea_orm_migration::sea_orm::DbBackend,
    name: &str,
) -> TableCreateStatement {
    let mut id = ColumnDef::new(Alias::new("id"));
    id.big_integer().not_null().primary_key();
    if backend == sea_orm_migration::sea_orm::DbBackend::MySql {
        id.auto_increment();
    }
    Table::create()
        .table(Alias::new(format!("tickets_{name}")))
        .if_not_exists()
        .col(id)
        .col(
            ColumnDef::new(Alias::new("stub"))
                .char_len(1)
                .not_null()
                .unique_key(),
        )
        .to_owned()
}

/// A migration creating one ticket sequence's table, for a ticket server's
/// own `Migrator` (sequences can also be created at run time with
/// `cluster.ids().create_sequence(name)`). The servers hand out tickets only
/// once their places are recorded: `cluster.migrate` or
/// `cluster.ids().record_places()` does that.
pub struct CreateTicketSequence {
    migration: String,
    sequence: String,
}

impl CreateTicketSequence {
    /// The migration for sequence `sequence` (table `tickets_<sequence>`).
    pub fn new(sequence: &str) -> Self {
        CreateTicketSequence {
            migration: format!("m20261122_000003_create_tickets_{sequence}"),
            sequence: sequence.to_owned(),
        }
    }
}

impl MigrationName for CreateTicketSequence {
    fn name(&self) -> &str {
        &self.migration
    }
}

#[async_trait::async_trait]
impl MigrationTrait for CreateTicketSequence {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(ticket_table(manager.get_database_backend(), &self.sequence))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(Alias::new(format!("tickets_{}", self.sequence)))
                    .to_owned(),
            )
            .await
    }
}

/// A migrator holding only shardkit's tables.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        migrations()
    }
}

/// The migrator `Cluster::migrate` runs on ticket servers: shardkit's
/// ticket registry and each server's recorded place, and nothing else (the application's own migrator never
/// reaches them). It records its progress in `shardkit_ticket_migrations`,
/// apart from the application's `seaql_migrations`, so a ticket database
/// an older release migrated with the application's migrator is not refused
/// for the application migrations it recorded there.
pub struct TicketMigrator;

#[async_trait::async_trait]
impl MigratorTrait for TicketMigrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261122_000002_create_ticket_registry::Migration),
            Box::new(m20261124_000008_create_ticket_place::Migration),
        ]
    }

    fn migration_table_name() -> DynIden {
        Alias::new("shardkit_ticket_migrations").into_iden()
    }
}

/// The table of one global secondary index, `gsi_<primary table>_<column>`:
/// the secondary value, the owner's shard key and primary key (all as text),
/// and when the row was written (Unix ms, so reconciliation can leave rows of
/// inserts still in flight alone). A unique index's primary key is the value;
/// a non-unique one's is (value, shard key, owner).
pub fn gsi_table(name: &str, unique: bool) -> TableCreateStatement {
    gsi_table_collated(name, unique, None)
}

/// [`gsi_table`] with its text columns in `collation` (`CHARACTER SET
/// utf8mb4 COLLATE <collation>`; MySQL/MariaDB only). Index values compare
/// byte for byte on every backend, so on MySQL/MariaDB the collation must be
/// binary and NO PAD (`utf8mb4_nopad_bin` on MariaDB, `utf8mb4_0900_bin` on
/// MySQL 8): a default collation would make `a@x`, `A@X` and `a@x ` one value.
pub fn gsi_table_collated(
    name: &str,
    unique: bool,
    collation: Option<&str>,
) -> TableCreateStatement {
    let mut pk = Index::create();
    pk.col(Alias::new("value"));
    if !unique {
        pk.col(Alias::new("shard_key")).col(Alias::new("owner_pk"));
    }
    let text = |column: &str| {
        let mut def = ColumnDef::new(Alias::new(column));
        match collation {
            // The character set and collation belong right after the type.
            Some(collation) => def.custom(Alias::new(format!(
                "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {collation}"
            ))),
            None => def.string_len(255),
        };
        def.not_null();
        def
    };
    Table::create()
        .table(Alias::new(name))
        .if_not_exists()
        .col(text("value"))
        .col(text("shard_key"))
        .col(text("owner_pk"))
        .col(
            ColumnDef::new(Alias::new("created_ms"))
                .big_integer()
                .not_null(),
        )
        .primary_key(&mut pk)
        .to_owned()
}
