//! Planning's index step: how a read finds the keys of an indexed value
//! ([`IndexLookup`], which the global-index feature implements).

use crate::error::Result;
use crate::exec::Shards;
use crate::topology::ShardId;
use sea_orm::sea_query::Expr;
use sea_orm::{Condition, DbBackend, ExprTrait, Value};

/// An index read's question (see [`IndexLookup`]).
pub(crate) struct IndexQuery {
    pub(crate) group: &'static str,
    /// The indexed entity's table.
    pub(crate) entity: &'static str,
    pub(crate) column: &'static str,
    pub(crate) unique: bool,
}

/// How a read finds the keys an indexed value lives under: planning's
/// index step. The global-index feature ([`crate::gsi`]) implements it, and
/// the cluster hands it to the reads it starts.
pub(crate) trait IndexLookup: Send + Sync {
    /// The index table the read consults (for its plan).
    fn table(&self, query: &IndexQuery) -> String;
    /// The shard holding the index rows of `text`.
    fn index_shard(&self, shards: &Shards, query: &IndexQuery, text: &str) -> Result<ShardId>;
    /// The shard keys (as [`ShardKey::to_directory_text`]) listed for
    /// `value`; `None` while the index is not active (the read scatters).
    fn lookup<'a>(
        &'a self,
        shards: &'a Shards,
        query: &'a IndexQuery,
        value: &'a Value,
    ) -> futures::future::BoxFuture<'a, Result<Option<Vec<String>>>>;
}

/// `column = value` as an index lookup's owner check: exact, byte for byte,
/// as index values are. On MySQL/MariaDB a text column's collation usually
/// ignores case and trailing spaces, so a text value is also compared as
/// `CAST(column AS BINARY)`; the plain comparison stays first so the
/// column's own index can still be used.
pub(crate) fn exact_eq(column: Expr, value: &Value, backend: DbBackend) -> Condition {
    let cond = Condition::all().add(column.clone().eq(value.clone()));
    if backend == DbBackend::MySql && matches!(value, Value::String(_) | Value::Char(_)) {
        cond.add(column.cast_as("BINARY").eq(value.clone()))
    } else {
        cond
    }
}
