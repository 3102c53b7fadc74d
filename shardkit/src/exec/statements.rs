//! SeaORM's executors for the statements every request sends, with the
//! statement built before the future is made: the future then holds
//! SeaORM's own boxed query future (a pointer), where SeaORM's `one`, `all`
//! and `exec` hold a chain of futures around copies of the statement
//! (kilobytes, copied from layer to layer and allocated above the
//! allocator's small sizes). What they send and return is SeaORM's.

use sea_orm::{
    ConnectionTrait, DbErr, EntityTrait, FromQueryResult, QueryTrait, Select, Statement,
};
use std::future::Future;

/// SeaORM's `Select::all` decoding `E::Model`s, its statement built before
/// the future is made, as [`one_model`] does.
pub(crate) fn all_models<E: EntityTrait, C: ConnectionTrait>(
    select: Select<E>,
    conn: &C,
) -> impl Future<Output = std::result::Result<Vec<E::Model>, DbErr>> + '_ {
    let statement = conn
        .get_database_backend()
        .build(QueryTrait::as_query(&select));
    let rows = conn.query_all_raw(statement);
    async move {
        rows.await?
            .iter()
            .map(|row| E::Model::from_query_result(row, ""))
            .collect()
    }
}

/// SeaORM's `Select::one` (`LIMIT 1`, the row decoded as `E::Model`), with
/// the statement built before the future is made: the future holds SeaORM's
/// own boxed query future, a pointer, where `Select::one`'s is a 3.4 KB
/// chain of futures around copies of the statement. A keyed read boxes what
/// this returns (see `Read::single`), and a box that small is one of the
/// allocator's cheap sizes; a read in a transaction holds it as is.
pub(crate) fn one_model<E: EntityTrait, C: ConnectionTrait>(
    mut select: Select<E>,
    conn: &C,
) -> impl Future<Output = std::result::Result<Option<E::Model>, DbErr>> + '_ {
    QueryTrait::query(&mut select).limit(1);
    let statement = conn
        .get_database_backend()
        .build(QueryTrait::as_query(&select));
    let row = conn.query_one_raw(statement);
    async move {
        row.await?
            .map(|row| E::Model::from_query_result(&row, ""))
            .transpose()
    }
}

/// The rows `statement` changed (SeaORM's `exec` of an update, delete or
/// insert without `RETURNING`: `rows_affected`). Takes the statement built:
/// a write's future then holds SeaORM's boxed future, not the sea-query
/// statement it was built from (hundreds of bytes, which would push a boxed
/// write's future past the allocator's cached sizes).
pub(crate) fn rows_affected<C: ConnectionTrait>(
    conn: &C,
    statement: Statement,
) -> impl Future<Output = std::result::Result<u64, DbErr>> + '_ {
    let done = conn.execute_raw(statement);
    async move { Ok(done.await?.rows_affected()) }
}
