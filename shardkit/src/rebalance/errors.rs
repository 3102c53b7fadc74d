//! The errors of move statements: a failed statement on a shard, and a
//! table that is not there yet (a shard not migrated).

use crate::error::ShardError;
use sea_orm::DbErr;

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
