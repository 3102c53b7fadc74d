//! Keyset (primary-key) scans: the one way shardkit walks a table in chunks.
//!
//! Rollout backfill, rollout verify and GSI backfill/reconcile all read a
//! shard's rows `after` the last key they saw, ordered by primary key, and
//! save that key as their resumable position. Unlike `OFFSET` paging, a
//! concurrent delete or insert cannot shift the window: a row is skipped only
//! if it is deleted before the scan reaches it.

use crate::entity::ShardedEntity;
pub(crate) use crate::key::{model_pk_values, tuple_text};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, OnConflict, SimpleExpr};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, Condition, ConnectionTrait, DbErr, EntityTrait, IntoActiveModel,
    Iterable, PrimaryKeyToColumn, QueryFilter, QuerySelect, Value,
};

/// A resumable position: `<shard index>:<primary key text>` (an empty key is
/// the start of that shard).
pub(crate) fn parse_cursor<E: ShardedEntity>(text: Option<&str>) -> (usize, Option<Vec<Value>>) {
    let Some((shard, pk)) = text.and_then(|t| t.split_once(':')) else {
        return (0, None);
    };
    let Ok(shard) = shard.parse() else {
        return (0, None);
    };
    if pk.is_empty() {
        return (shard, None);
    }
    let values = <E::PrimaryKey as Iterable>::iter()
        .zip(pk.split('\u{1f}'))
        .map(|(col, text)| crate::key::typed_value::<E>(col.into_column(), text))
        .collect();
    (shard, Some(values))
}

pub(crate) fn format_cursor(shard: usize, after: Option<&[Value]>) -> String {
    format!("{shard}:{}", after.map(tuple_text).unwrap_or_default())
}

/// Rows of `E` whose primary key comes after `after`, in key order.
pub(crate) fn after_condition<E: EntityTrait>(after: Option<&[Value]>) -> Condition {
    pk_bound::<E>(after, true)
}

/// Rows of `E` whose primary key is at most `upto`.
pub(crate) fn upto_condition<E: EntityTrait>(upto: Option<&[Value]>) -> Condition {
    pk_bound::<E>(upto, false)
}

/// `pk > bound` (`after`) or `pk <= bound`, comparing composite keys as
/// row values; no bound is no condition.
fn pk_bound<E: EntityTrait>(bound: Option<&[Value]>, after: bool) -> Condition {
    let Some(bound) = bound else {
        return Condition::all();
    };
    let cols: Vec<E::Column> = <E::PrimaryKey as Iterable>::iter()
        .map(PrimaryKeyToColumn::into_column)
        .collect();
    let expr = match (cols.as_slice(), bound) {
        ([col], [v]) if after => col.gt(v.clone()),
        ([col], [v]) => col.lte(v.clone()),
        _ => {
            let left = Expr::tuple(cols.iter().map(|c| Expr::col((E::default(), *c))));
            let right = Expr::tuple(bound.iter().map(|v| Expr::val(v.clone())));
            if after {
                left.gt(right)
            } else {
                left.lte(right)
            }
        }
    };
    Condition::all().add(expr)
}

/// `select` ordered by `E`'s primary key.
pub(crate) fn by_pk<E: EntityTrait>(mut select: sea_orm::Select<E>) -> sea_orm::Select<E> {
    for pk in <E::PrimaryKey as Iterable>::iter() {
        select = sea_orm::QueryOrder::order_by_asc(select, pk.into_column());
    }
    select
}

/// The next chunk of `E`'s rows: at most `limit` rows whose primary key
/// comes after `after`, in primary-key order.
pub(crate) fn chunk<E: EntityTrait>(after: Option<&[Value]>, limit: u64) -> sea_orm::Select<E> {
    by_pk(E::find().filter(after_condition::<E>(after))).limit(limit)
}

/// `(columns) > (after)` for a table that is not an entity (an index table),
/// comparing as row values; `after` empty is no condition.
pub(crate) fn after_columns(columns: &[&str], after: &[Value]) -> Condition {
    if after.is_empty() {
        return Condition::all();
    }
    let left = Expr::tuple(
        columns
            .iter()
            .map(|c| SimpleExpr::from(Expr::col(Alias::new(*c)))),
    );
    let right = Expr::tuple(after.iter().map(|v| SimpleExpr::from(Expr::val(v.clone()))));
    Condition::all().add(left.gt(right))
}

/// `E`'s primary key columns equal to `values`, in order.
pub(crate) fn pk_condition<E: EntityTrait>(values: &[Value]) -> Condition {
    <E::PrimaryKey as Iterable>::iter()
        .zip(values)
        .fold(Condition::all(), |cond, (pk, v)| {
            cond.add(pk.into_column().eq(v.clone()))
        })
}

/// Inserts `model`, or overwrites the row with its primary key.
///
/// PostgreSQL and SQLite use `ON CONFLICT (<primary key>) DO UPDATE`, which
/// fires on the primary key only. MySQL's `ON DUPLICATE KEY UPDATE` fires on
/// *any* unique key and would overwrite another row that merely shares a
/// unique value, so there it is an `UPDATE` by primary key (SQLx reports
/// matched rows) and, when none matched, an `INSERT`.
pub(crate) async fn upsert<E, C>(db: &C, model: E::Model) -> std::result::Result<(), DbErr>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
    C: ConnectionTrait,
{
    let active = model.into_active_model().reset_all();
    if db.get_database_backend() == sea_orm::DbBackend::MySql {
        let pk: Vec<Value> = <E::PrimaryKey as Iterable>::iter()
            .map(|c| {
                active
                    .get(c.into_column())
                    .into_value()
                    .unwrap_or(Value::Bool(None))
            })
            .collect();
        let matched = E::update_many()
            .set(active.clone())
            .filter(pk_condition::<E>(&pk))
            .exec(db)
            .await?
            .rows_affected;
        if matched > 0 {
            return Ok(());
        }
        return E::insert(active).exec_without_returning(db).await.map(drop);
    }
    let (pks, others) = crate::key::key_and_other_columns::<E>();
    let mut on_conflict = OnConflict::columns(pks);
    if others.is_empty() {
        on_conflict.do_nothing();
    } else {
        on_conflict.update_columns(others);
    }
    E::insert(active)
        .on_conflict(on_conflict)
        .exec_without_returning(db)
        .await
        .map(drop)
}
