//! Beginning a write transaction: `BEGIN IMMEDIATE` on SQLite, so a writer takes the write lock before its first statement.

use futures::future::BoxFuture;
use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbErr, SqliteTransactionMode, TransactionOptions,
    TransactionTrait,
};
use std::pin::Pin;
use std::task::{Context, Poll};

/// Opens a transaction that may write. On SQLite it takes the write lock up
/// front (`BEGIN IMMEDIATE`), waiting out other writers with the busy
/// timeout ([`sqlite::BUSY_TIMEOUT`]; a transaction that may write another
/// file while it holds this one's takes the cluster's write slot first,
/// [`Shards::sqlite_write_slot`]): a deferred transaction that reads and
/// then writes cannot wait (SQLite refuses the upgrade at once with
/// `database is locked`, since waiting could deadlock). Other backends begin as usual, and inside a
/// transaction this is a savepoint.
///
/// On a pool (a `DatabaseConnection`), see [`begin_pooled`]: what a caller
/// that stops waiting leaves behind.
pub(crate) async fn begin_write<C: TransactionTrait>(db: &C) -> Result<C::Transaction, DbErr> {
    db.begin_with_options(write_options()).await
}

fn write_options() -> TransactionOptions {
    TransactionOptions {
        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
        ..TransactionOptions::default()
    }
}

/// [`begin_write`] on a pool, finished even when its caller stops waiting
/// (a timeout, a request dropped) after `BEGIN` was sent: sqlx 0.9 counts
/// the transaction only once the server's answer is read, so a begin cut
/// off before that leaves a connection that is inside a transaction and
/// that neither SQLx nor SeaORM rolls back. The pool would hand it out
/// again: every later statement on it would run in that transaction, never
/// committed (or all refused once one failed). Stopped, the rest of the
/// begin runs in a task of its own, and the transaction it makes is dropped
/// there, which rolls it back before the connection is used again.
pub(crate) fn begin_pooled(
    db: &DatabaseConnection,
) -> impl Future<Output = Result<DatabaseTransaction, DbErr>> + Send + 'static {
    begin_pooled_with(db, write_options())
}

/// [`begin_pooled`] with `options` (a snapshot's isolation level, say).
pub(crate) fn begin_pooled_with(
    db: &DatabaseConnection,
    options: TransactionOptions,
) -> impl Future<Output = Result<DatabaseTransaction, DbErr>> + Send + 'static {
    let db = db.clone();
    Finished {
        future: Some(Box::pin(
            async move { db.begin_with_options(options).await },
        )),
        polled: false,
    }
}

/// How a write transaction begins on a connection shardkit holds as either
/// kind: on a pool through [`begin_pooled`], inside a transaction as a
/// savepoint ([`begin_write`]; sqlx rolls a savepoint back however it was
/// cut off).
pub(crate) trait BeginWrite: TransactionTrait<Transaction = DatabaseTransaction> {
    fn begin_for_write(&self) -> BoxFuture<'_, Result<DatabaseTransaction, DbErr>>;
}

impl BeginWrite for DatabaseConnection {
    fn begin_for_write(&self) -> BoxFuture<'_, Result<DatabaseTransaction, DbErr>> {
        Box::pin(begin_pooled(self))
    }
}

impl BeginWrite for DatabaseTransaction {
    fn begin_for_write(&self) -> BoxFuture<'_, Result<DatabaseTransaction, DbErr>> {
        Box::pin(begin_write(self))
    }
}

/// How long the rest of a begin its caller stopped waiting for may take:
/// one still waiting for a connection of a saturated pool then gives up
/// (it sent nothing), instead of holding its place in the pool's queue
/// ahead of live requests, while one whose `BEGIN` was sent has its answer
/// long before.
const FINISH_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// A future run to its end: dropped part-way, its rest runs in a task.
struct Finished<T: Send + 'static> {
    future: Option<BoxFuture<'static, T>>,
    polled: bool,
}

impl<T: Send + 'static> Future for Finished<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        self.polled = true;
        let Some(future) = self.future.as_mut() else {
            panic!("a begin polled after it finished");
        };
        let out = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for Finished<T> {
    fn drop(&mut self) {
        // Never polled: nothing was sent.
        if let Some(future) = self.future.take().filter(|_| self.polled)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                drop(tokio::time::timeout(FINISH_WITHIN, future).await);
            });
        }
    }
}
