//! The merge of a multi-shard read: per-shard rows into one ordered,
//! paged result, and the value order it sorts by.

use crate::entity::{ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::read::request::Read;
use crate::topology::ShardId;
use sea_orm::{DbBackend, IdenStatic, ModelTrait, Order, Value};
use std::cmp::Ordering;

impl<E: ShardedEntity> Read<E> {
    /// Merges per-shard rows into one ordered, paged result.
    pub(super) fn merge(
        &self,
        parts: Vec<(ShardId, Vec<E::Model>)>,
        limit: Option<u64>,
        offset: u64,
    ) -> Result<Vec<E::Model>> {
        let first_shard = parts.first().map(|(id, _)| *id);
        let rows = parts.into_iter().flat_map(|(_, rows)| rows);
        let offset = offset as usize;
        let limit = limit.map_or(usize::MAX, |l| l as usize);
        if self.order.is_empty() {
            return Ok(rows.skip(offset).take(limit).collect());
        }
        // PostgreSQL sorts NULL above every value; MySQL and SQLite below.
        let nulls_high = first_shard.is_some_and(|id| {
            self.shards.shard_conn(id).get_database_backend() == DbBackend::Postgres
        });
        let mut keyed: Vec<(Vec<Value>, E::Model)> = rows
            .map(|row| (self.order.iter().map(|(c, _)| row.get(*c)).collect(), row))
            .collect();
        for (i, (column, _)) in self.order.iter().enumerate() {
            if let Some((values, _)) = keyed
                .iter()
                .find(|(v, _)| compare_values(&v[i], &v[i], nulls_high).is_none())
            {
                return Err(ShardError::Unmergeable {
                    table: table_name::<E>(),
                    reason: format!(
                        "cannot order rows from several shards by `{}`: values like {:?} have no merge order",
                        column.as_str(),
                        values[i]
                    ),
                });
            }
        }
        keyed.sort_by(|(a, _), (b, _)| {
            for (i, (_, order)) in self.order.iter().enumerate() {
                let ord = compare_values(&a[i], &b[i], nulls_high).unwrap_or(Ordering::Equal);
                let ord = if matches!(order, Order::Desc) {
                    ord.reverse()
                } else {
                    ord
                };
                if ord != Ordering::Equal {
                    return ord;
                }
            }
            Ordering::Equal
        });
        Ok(keyed
            .into_iter()
            .map(|(_, row)| row)
            .skip(offset)
            .take(limit)
            .collect())
    }
}

pub(super) fn count_shards<T>(parts: &[(ShardId, T)]) -> usize {
    let mut ids: Vec<ShardId> = parts.iter().map(|(id, _)| *id).collect();
    ids.dedup();
    ids.len()
}

pub(crate) fn compare_values(a: &Value, b: &Value, nulls_high: bool) -> Option<Ordering> {
    pub(super) fn int(v: &Value) -> Option<Option<i128>> {
        Some(match v {
            Value::TinyInt(x) => x.map(i128::from),
            Value::SmallInt(x) => x.map(i128::from),
            Value::Int(x) => x.map(i128::from),
            Value::BigInt(x) => x.map(i128::from),
            Value::TinyUnsigned(x) => x.map(i128::from),
            Value::SmallUnsigned(x) => x.map(i128::from),
            Value::Unsigned(x) => x.map(i128::from),
            Value::BigUnsigned(x) => x.map(i128::from),
            Value::Bool(x) => x.map(i128::from),
            _ => return None,
        })
    }
    pub(super) fn float(v: &Value) -> Option<Option<f64>> {
        Some(match v {
            Value::Float(x) => x.map(f64::from),
            Value::Double(x) => *x,
            _ => return None,
        })
    }
    pub(super) fn nulls<T>(
        a: Option<T>,
        b: Option<T>,
        nulls_high: bool,
        cmp: impl FnOnce(T, T) -> Option<Ordering>,
    ) -> Option<Ordering> {
        match (a, b) {
            (Some(a), Some(b)) => cmp(a, b),
            (None, None) => Some(Ordering::Equal),
            (None, Some(_)) => Some(if nulls_high {
                Ordering::Greater
            } else {
                Ordering::Less
            }),
            (Some(_), None) => Some(if nulls_high {
                Ordering::Less
            } else {
                Ordering::Greater
            }),
        }
    }
    if let (Some(x), Some(y)) = (int(a), int(b)) {
        return nulls(x, y, nulls_high, |x, y| Some(x.cmp(&y)));
    }
    if let (Some(x), Some(y)) = (float(a), float(b)) {
        return nulls(x, y, nulls_high, |x, y| x.partial_cmp(&y));
    }
    match (a, b) {
        (Value::String(x), Value::String(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::Char(x), Value::Char(y)) => nulls(*x, *y, nulls_high, |x, y| Some(x.cmp(&y))),
        (Value::Bytes(x), Value::Bytes(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::Uuid(x), Value::Uuid(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoDate(x), Value::ChronoDate(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoTime(x), Value::ChronoTime(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoDateTime(x), Value::ChronoDateTime(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoDateTimeUtc(x), Value::ChronoDateTimeUtc(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoDateTimeWithTimeZone(x), Value::ChronoDateTimeWithTimeZone(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        _ => None,
    }
}
