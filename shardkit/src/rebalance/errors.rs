//! The errors of move statements: a failed statement on a shard, a table
//! that is not there yet (a shard not migrated), a driver's error as
//! SeaORM's, and running a statement again after an abort.

use crate::error::{Result, ShardError};
use sea_orm::{DbErr, RuntimeErr};

/// A sqlx error (of a statement SeaORM's connection cannot carry, `COPY`)
/// as SeaORM reports one, so shardkit's classification (a unique violation,
/// a retryable abort, a lost connection) reads it alike.
pub(crate) fn sqlx_err(e: sea_orm::sqlx::Error) -> DbErr {
    DbErr::Exec(RuntimeErr::SqlxError(std::sync::Arc::new(e)))
}

/// A failed statement of the bucket-move machinery on `shard`.
pub(crate) fn db_err(shard: &str, table: &str, operation: &str, source: DbErr) -> ShardError {
    ShardError::db(
        crate::error::Origin::table(crate::error::Subsystem::Rebalance, table),
        shard.to_owned(),
        format!("{operation} {table}"),
        source,
    )
}

/// Whether an error says a shardkit table does not exist (a cluster not
/// migrated yet).
pub(crate) fn missing_table(e: &ShardError) -> bool {
    let text = e.report().to_string().to_ascii_lowercase();
    text.contains("no such table")
        || text.contains("does not exist")
        || text.contains("doesn't exist")
}

/// Runs `work` again when the database aborted it (a deadlock with the
/// shard's own writers of other buckets, on MySQL/MariaDB's gap locks), or
/// after the wait it asks for when the database was busy (SQLite's
/// `database is locked`: another instance's writer held the file for the
/// whole busy timeout): at most 5 attempts.
pub(crate) async fn again<T, F, Fut>(table: &str, shard: &str, mut work: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut attempt = 1;
    loop {
        match work().await {
            Err(e) if attempt < 5 => {
                let wait = match e.retry() {
                    crate::Retry::Transaction => std::time::Duration::ZERO,
                    crate::Retry::After(wait) => wait,
                    _ => return Err(e),
                };
                tracing::debug!(table, shard, attempt, error = %e.report(), ?wait, "move statement aborted or refused by a busy database; again");
                tokio::time::sleep(wait).await;
                attempt += 1;
            }
            other => return other,
        }
    }
}
