//! Beginning a write transaction: `BEGIN IMMEDIATE` on SQLite, so a writer takes the write lock before its first statement.

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
