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

/// shardkit's migrations, in order.
pub fn migrations() -> Vec<Box<dyn MigrationTrait>> {
    vec![Box::new(
        m20261122_000001_create_shardkit_directory::Migration,
    )]
}

/// A migrator holding only shardkit's tables.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        migrations()
    }
}
