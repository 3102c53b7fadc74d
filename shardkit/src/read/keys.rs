//! The shard key as a predicate, and the errors and spans of reads.

use crate::entity::{EntityGroup, Joinable, KeyRef, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::read::{ReadFrom, ReadGuard};
use sea_orm::sea_query::{
    Expr, JoinType, MysqlQueryBuilder, PostgresQueryBuilder, QueryBuilder, QueryStatementBuilder,
    Quote, SqlWriter, SqlWriterValues, SqliteQueryBuilder, Values,
};
use sea_orm::{
    Condition, DbBackend, DbErr, EntityTrait, ExprTrait, IdenStatic, ModelTrait, QueryFilter,
    QuerySelect, QueryTrait, Related, Select, Statement,
};
use std::fmt::Write as _;

/// The shard-key predicate of a read or write: `key = ?` or `key IN (...)`,
/// one expression on the column qualified by the table's static name
/// (SeaORM's entity name would be copied into a new string each time, and
/// again when the statement is built).
///
/// MySQL/MariaDB's default collations compare text case- and
/// trailing-space-insensitively (`'acme' = 'Acme '`), which would let one key
/// reach another key's rows on a shared shard; for text keys there the
/// predicate adds the same comparison on `CAST(key AS BINARY)`. The plain
/// comparison stays first so the key's index is still used.
pub(crate) fn key_condition<E: ShardedEntity>(keys: &[KeyOf<E>], backend: DbBackend) -> Expr {
    column_key_condition::<E, KeyOf<E>>(E::shard_key_column(), keys, backend)
}

/// [`key_condition`] of one key: what every statement of a key's
/// transaction and every keyed read carries.
pub(crate) fn key_expr<E: ShardedEntity>(key: &KeyOf<E>, backend: DbBackend) -> Expr {
    key_condition::<E>(std::slice::from_ref(key), backend)
}

/// [`key_condition`] on `column` of `E`.
fn column_key_condition<E: EntityTrait, K: ShardKey>(
    column: E::Column,
    keys: &[K],
    backend: DbBackend,
) -> Expr {
    compare_keys(|| Expr::col((table_name::<E>(), column)), keys, backend)
}

/// `column() = key` (or `IN`), twice for text keys on MySQL/MariaDB (see
/// [`key_condition`]).
fn compare_keys<K: ShardKey>(column: impl Fn() -> Expr, keys: &[K], backend: DbBackend) -> Expr {
    let compare = |expr: Expr| match keys {
        [key] => expr.eq(key.clone()),
        _ => expr.is_in(keys.iter().cloned()),
    };
    let plain = compare(column());
    if binary_text_keys(keys, backend) {
        plain.and(compare(column().cast_as("BINARY")))
    } else {
        plain
    }
}

/// Whether [`key_condition`] compares `keys` twice (text keys on
/// MySQL/MariaDB), binding each twice.
pub(super) fn binary_text_keys<K: ShardKey>(keys: &[K], backend: DbBackend) -> bool {
    backend == DbBackend::MySql
        && keys
            .first()
            .is_some_and(|k| matches!(k.key_ref(), KeyRef::Text(_)))
}

pub(super) fn keyed_select<E: ShardedEntity>(
    mut select: Select<E>,
    key: &KeyOf<E>,
    backend: DbBackend,
) -> Select<E> {
    add_key::<E>(&mut select, key, backend);
    select
}

/// An `UPDATE` or `DELETE` built here (no condition, order, limit or
/// `RETURNING` of its own) as the statement to send, with the predicate of
/// `key` and then `filter`, and `returning`'s expressions if any: `… WHERE
/// key = ? AND (filter) RETURNING …` (only on a backend that has it).
///
/// sea-query renders the statement, then the `WHERE` is written after it on
/// the same writer: the key's comparison as text with its value bound,
/// the filter through sea-query's `prepare_expr`. Every keyed write sends
/// one, so the key's comparison is not built as an expression tree (two
/// boxed operands, two more to join it to the filter, a precedence check at
/// each node, the tree dropped after rendering), and the filter, a
/// `Condition`, is not cloned to be rendered.
/// Safe because nothing of the statement follows its `WHERE` (sea-query
/// writes `ORDER BY`, `LIMIT` and `RETURNING` after it, and none is set
/// on the statement; `RETURNING` is written here after the `WHERE`, as
/// sea-query writes it), and the filter is always in parentheses, so no
/// `OR` in it escapes the key.
///
/// The key's column is not qualified by its table on PostgreSQL and
/// MySQL/MariaDB: the statement has one table, which its top-level `WHERE`
/// names whatever subqueries the filter holds. SQLite keeps the qualifier:
/// it takes a double-quoted name that matches no column for a string, so a
/// table without its key column would compare a constant instead of
/// failing. Text keys on MySQL/MariaDB are compared twice, as
/// [`key_condition`] does.
pub(crate) fn keyed_statement<E: ShardedEntity, S: KeyedWrite>(
    statement: &S,
    key: &KeyOf<E>,
    backend: DbBackend,
    filter: Option<Condition>,
    returning: &[Expr],
) -> Statement {
    let (sql, values) = match backend {
        DbBackend::MySql => render_keyed::<E, _, _>(
            &MysqlQueryBuilder,
            backend,
            statement,
            key,
            filter,
            returning,
        ),
        DbBackend::Postgres => render_keyed::<E, _, _>(
            &PostgresQueryBuilder,
            backend,
            statement,
            key,
            filter,
            returning,
        ),
        _ => render_keyed::<E, _, _>(
            &SqliteQueryBuilder,
            backend,
            statement,
            key,
            filter,
            returning,
        ),
    };
    Statement::from_sql_and_values(backend, sql, values.0)
}

/// The statements [`keyed_statement`] takes: an `UPDATE` or a `DELETE`,
/// whose `WHERE` sea-query writes last when no order, limit or `RETURNING`
/// is set (a `SELECT`'s is followed by its grouping and order).
pub(crate) trait KeyedWrite: QueryStatementBuilder {}

impl KeyedWrite for sea_orm::sea_query::UpdateStatement {}
impl KeyedWrite for sea_orm::sea_query::DeleteStatement {}

/// [`keyed_statement`] with `builder`'s quotes and placeholders.
fn render_keyed<E: ShardedEntity, Q: QueryBuilder, S: QueryStatementBuilder>(
    builder: &Q,
    backend: DbBackend,
    statement: &S,
    key: &KeyOf<E>,
    filter: Option<Condition>,
    returning: &[Expr],
) -> (String, Values) {
    let table = (backend == DbBackend::Sqlite).then(table_name::<E>);
    let column = IdenStatic::as_str(&E::shard_key_column());
    let binary_too = binary_text_keys(std::slice::from_ref(key), backend);
    let (placeholder, numbered) = builder.placeholder();
    let mut sql = SqlWriterValues::new(placeholder, numbered);
    statement.build_collect_any_into(builder, &mut sql);
    let quote = builder.quote();
    let column_ref = |sql: &mut SqlWriterValues| -> std::fmt::Result {
        if let Some(table) = table {
            write_iden(sql, &quote, table)?;
            sql.write_char('.')?;
        }
        write_iden(sql, &quote, column)
    };
    let clause = || -> std::fmt::Result {
        sql.write_str(" WHERE ")?;
        column_ref(&mut sql)?;
        sql.write_str(" = ")?;
        sql.push_param(key.clone().into(), builder);
        if binary_too {
            sql.write_str(" AND CAST(")?;
            column_ref(&mut sql)?;
            sql.write_str(" AS BINARY) = ")?;
            sql.push_param(key.clone().into(), builder);
        }
        if let Some(filter) = filter {
            sql.write_str(" AND (")?;
            builder.prepare_expr(&Expr::from(filter), &mut sql);
            sql.write_char(')')?;
        }
        // sea-query writes no `RETURNING` for MySQL/MariaDB (MariaDB has
        // none on `UPDATE`).
        let returning = if backend == DbBackend::MySql {
            &[]
        } else {
            returning
        };
        for (i, expr) in returning.iter().enumerate() {
            sql.write_str(if i == 0 { " RETURNING " } else { ", " })?;
            builder.prepare_expr(expr, &mut sql);
        }
        Ok(())
    };
    clause().expect("a statement is written to a String");
    sql.into_parts()
}

/// `name` between `quote`'s marks, a mark inside it doubled.
fn write_iden(sql: &mut SqlWriterValues, quote: &Quote, name: &str) -> std::fmt::Result {
    let mark = quote.right();
    sql.write_char(quote.left())?;
    for c in name.chars() {
        if c == mark {
            sql.write_char(c)?;
        }
        sql.write_char(c)?;
    }
    sql.write_char(mark)
}

/// Adds the one-key predicate to a statement in place.
pub(super) fn add_key<E: ShardedEntity>(
    select: &mut Select<E>,
    key: &KeyOf<E>,
    backend: DbBackend,
) {
    QueryTrait::query(select).and_where(key_expr::<E>(key, backend));
}

pub(super) fn read_span<E: ShardedEntity>(
    shard: &str,
    bucket: Option<u32>,
    op: &'static str,
) -> tracing::Span {
    let span = tracing::info_span!(
        "shardkit.read",
        group = <E::Group as EntityGroup>::NAME,
        table = table_name::<E>(),
        shard = shard,
        bucket = tracing::field::Empty,
        op = op,
    );
    if let Some(bucket) = bucket.filter(|_| !span.is_disabled()) {
        span.record("bucket", bucket);
    }
    span
}

pub(super) fn read_err<E: ShardedEntity>(shard: &str, source: DbErr) -> ShardError {
    select_err(
        <E::Group as EntityGroup>::NAME,
        table_name::<E>(),
        shard,
        source,
    )
}

pub(super) fn select_err(
    group: &'static str,
    table: &str,
    shard: &str,
    source: DbErr,
) -> ShardError {
    ShardError::db(
        crate::error::Origin::Group(group),
        shard.to_owned(),
        format!("select {table}"),
        source,
    )
}

/// Joins `R` to a read of `E` along `E`'s relation (through its junction
/// table, when the relation has one), with `R`'s side scoped to `key` in the
/// join's `ON` clause: a row of another key on the same shard is no match,
/// and with a left join it leaves the `E` row in place (with no related row)
/// instead of filtering the `E` row out as a `WHERE` clause would.
pub(super) fn join_related<E, R>(
    mut select: Select<E>,
    join: JoinType,
    key: &KeyOf<E>,
    backend: DbBackend,
    r_from: Option<&ReadFrom>,
) -> Select<E>
where
    E: ShardedEntity + Related<R>,
    R: Joinable<E::Group>,
{
    if let Some(via) = <E as Related<R>>::via() {
        select = QuerySelect::join(select, join, via);
    }
    let rel = <E as Related<R>>::to();
    let to = rel.to_tbl.clone();
    // The relation's own condition (columns, and its `on_condition` however
    // it combines them), and the key (a reference table has none: the key's
    // shard holds one copy of it).
    let mut on = Condition::all().add(Condition::from(rel));
    if let Some(column) = R::__key_column() {
        on = on.add(column_key_condition::<R, KeyOf<E>>(
            column,
            std::slice::from_ref(key),
            backend,
        ));
    }
    match r_from {
        // `R`'s reads go to another table (a rollout's new table): join it
        // under `R`'s name, so the condition still resolves.
        Some(from) => {
            QueryTrait::query(&mut select).join_as(join, from.table_ref.clone(), R::default(), on);
        }
        None => {
            QueryTrait::query(&mut select).join(join, to, on);
        }
    }
    select
}

/// What `guard` says of reads of `R`: its own table, another in its place,
/// or refused.
pub(crate) fn guard_check<R: EntityTrait>(
    guard: Option<&dyn ReadGuard>,
) -> Result<Option<ReadFrom>> {
    match guard {
        Some(guard) => guard.check(std::any::TypeId::of::<R>(), table_name::<R>()),
        None => Ok(None),
    }
}

/// `model.find_related(R)` (SeaORM's), with `M`'s side joined from another
/// table when `M`'s reads go there.
pub(crate) fn related_select<M, R>(model: &M, related: R, m_from: Option<&ReadFrom>) -> Select<R>
where
    M: ModelTrait,
    M::Entity: Related<R>,
    R: sea_orm::EntityTrait,
{
    let Some(from) = m_from.filter(|_| <M::Entity as Related<R>>::via().is_none()) else {
        return model.find_related(related);
    };
    let rel = <M::Entity as Related<R>>::to();
    let mut select = R::find();
    QueryTrait::query(&mut select).join_as(
        JoinType::InnerJoin,
        from.table_ref.clone(),
        M::Entity::default(),
        Condition::from(rel),
    );
    select.belongs_to(model)
}

/// The shard key type of entity `E`.
pub type KeyOf<E> = <<E as ShardedEntity>::Group as EntityGroup>::Key;
