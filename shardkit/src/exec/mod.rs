//! The execution layer: the connected databases ([`Shards`]), how a write
//! transaction begins, and (in sibling modules) each shard's breaker
//! ([`crate::exec::health`]) and the requests it watches
//! ([`crate::exec::watchdog`]), periodic tasks ([`crate::exec::periodic`]) and keyset
//! scans ([`crate::exec::keyset`]).

mod begin;
mod breaker;
pub(crate) mod columns;
mod connect;
mod directory;
pub(crate) mod health;
pub(crate) mod keyed_tables;
pub(crate) mod keyset;
mod migrate;
pub(crate) mod periodic;
mod replica_reads;
pub(crate) mod replicas;
pub(crate) mod shards;
pub(crate) mod sqlite;
pub(crate) mod statements;
pub(crate) mod watchdog;

pub(crate) use begin::{BeginWrite, begin_pooled, begin_pooled_with};

/// An identifier quoted for `backend`.
pub(crate) fn quoted(backend: sea_orm::DbBackend, name: &str) -> String {
    match backend {
        sea_orm::DbBackend::MySql => format!("`{}`", name.replace('`', "``")),
        _ => format!("\"{}\"", name.replace('"', "\"\"")),
    }
}
pub(crate) use connect::{SIDE_LOCK_WAIT_SECS, SIDE_MYSQL_SESSION};
pub use directory::Directory;
pub use migrate::{DatabaseMigrationStatus, MigrateOptions, MigrationProgress, MigrationReport};
pub(crate) use replica_reads::{ReadOn, ReadTime};
pub use replicas::{Consistency, ReplicaStatus, Session};
pub(crate) use shards::{BeginHook, Begun, RebalanceSettings, Shards};
