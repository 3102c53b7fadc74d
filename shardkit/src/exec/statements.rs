//! SeaORM's executors for the statements every request sends, with the
//! statement built before the future is made: the future then holds
//! SeaORM's own boxed query future (a pointer), where SeaORM's `one`, `all`
//! and `exec` hold a chain of futures around copies of the statement
//! (kilobytes, copied from layer to layer and allocated above the
//! allocator's small sizes). What they send and return is SeaORM's.

use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, FromQueryResult, Iterable,
    QueryTrait, Select, Statement,
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
    select: Select<E>,
    conn: &C,
) -> impl Future<Output = std::result::Result<Option<E::Model>, DbErr>> + '_ {
    first_model::<E, C>(conn, one_statement(select, conn.get_database_backend()))
}

/// `Select::one`'s statement: `select` with `LIMIT 1`, built for `backend`.
pub(crate) fn one_statement<E: EntityTrait>(
    mut select: Select<E>,
    backend: DbBackend,
) -> Statement {
    QueryTrait::query(&mut select).limit(1);
    backend.build(QueryTrait::as_query(&select))
}

/// The `RETURNING` clause SeaORM's `exec_with_returning` and `exec` add to
/// an insert or update: every column of `E`, each through its `select_as`.
pub(crate) fn returning_all<E: EntityTrait>(
    backend: DbBackend,
) -> sea_orm::sea_query::ReturningClause {
    sea_orm::sea_query::Query::returning().exprs(returning_exprs::<E>(backend))
}

/// The expressions of [`returning_all`].
pub(crate) fn returning_exprs<E: EntityTrait>(backend: DbBackend) -> Vec<sea_orm::sea_query::Expr> {
    <E::Column as Iterable>::iter()
        .map(|c| c.select_as(c.into_returning_expr(backend)))
        .collect()
}

/// The first row `statement` returns, decoded as `E::Model`, as SeaORM's
/// `Select::one` and the `RETURNING` row of its `exec_with_returning` and
/// `exec` decode it; the future holds SeaORM's boxed query future only.
pub(crate) fn first_model<E: EntityTrait, C: ConnectionTrait>(
    conn: &C,
    statement: Statement,
) -> impl Future<Output = std::result::Result<Option<E::Model>, DbErr>> + '_ {
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
