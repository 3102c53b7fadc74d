//! The execution layer: the connected databases ([`Shards`]), how a write
//! transaction begins, and (in sibling modules) each shard's breaker
//! ([`crate::exec::health`]), periodic tasks ([`crate::exec::periodic`]) and keyset
//! scans ([`crate::exec::keyset`]).

mod breaker;
mod connect;
mod directory;
pub(crate) mod health;
pub(crate) mod keyset;
mod migrate;
pub(crate) mod periodic;
pub(crate) mod shards;
pub(crate) mod sqlite;

pub use directory::Directory;
pub use migrate::{DatabaseMigrationStatus, MigrationReport};

pub(crate) use connect::{SIDE_LOCK_WAIT_SECS, SIDE_MYSQL_SESSION};
pub(crate) use shards::{Begun, RebalanceSettings, Shards};

use sea_orm::{DbErr, SqliteTransactionMode, TransactionOptions, TransactionTrait};

/// Opens a transaction that may write. On SQLite it takes the write lock up
/// front (`BEGIN IMMEDIATE`), waiting out other writers with the busy
/// timeout ([`sqlite::BUSY_TIMEOUT`]; a transaction that may write another
/// file while it holds this one's takes the cluster's write slot first,
/// [`Shards::sqlite_write_slot`]): a deferred transaction that reads and
/// then writes cannot wait (SQLite refuses the upgrade at once with
/// `database is locked`, since waiting could deadlock). Other backends begin as usual, and inside a
/// transaction this is a savepoint.
pub(crate) async fn begin_write<C: TransactionTrait>(db: &C) -> Result<C::Transaction, DbErr> {
    db.begin_with_options(TransactionOptions {
        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
        ..TransactionOptions::default()
    })
    .await
}
