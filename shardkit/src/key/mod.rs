//! Keys and values as text and as hashes: the exact encodings shardkit stores.
//!
//! Index rows, rollout cache keys, resumable cursors and verify reports all
//! name a value or a primary key by the text [`value_text`] gives. That text
//! is stored and compared across processes and versions, so it is defined
//! here value type by value type, never through `Debug` (whose output a
//! dependency may change). [`pghash`] is PostgreSQL's partition hash, which
//! places hash-sharded keys.
//!
//! A leaf of the crate: it imports nothing of shardkit's.

pub mod pghash;

use sea_orm::sea_query::{PostgresQueryBuilder, QueryBuilder};
use sea_orm::{ActiveModelTrait, ActiveValue, EntityTrait, Iterable, ModelTrait};
use sea_orm::{PrimaryKeyToColumn, Value};

/// Separates the columns of a composite key in [`tuple_text`].
pub(crate) const TUPLE_SEPARATOR: char = '\u{1f}';

/// The text stored for a value; `None` for NULL (not indexed).
///
/// | value | text |
/// |---|---|
/// | integers, `bool`, `char`, strings, enums | their plain text (`42`, `true`, `x`, the string, the variant's value) |
/// | `f32`, `f64` | Rust's shortest round-trip form (`0.1`, `1e300`, `NaN`) |
/// | bytes | `0x` and lowercase hex |
/// | UUID | hyphenated lowercase |
/// | dates, times, date-times | ISO 8601 (`2026-11-23`, `10:20:30`, `2026-11-23 10:20:30`); with a zone, RFC 3339 |
/// | JSON | compact JSON (`serde_json`) |
/// | anything else a SeaORM feature adds | its SQL literal as SeaQuery writes it for PostgreSQL |
pub(crate) fn value_text(value: &Value) -> Option<String> {
    Some(match value {
        Value::Bool(v) => v.map(|v| v.to_string())?,
        Value::TinyInt(v) => v.map(|v| v.to_string())?,
        Value::SmallInt(v) => v.map(|v| v.to_string())?,
        Value::Int(v) => v.map(|v| v.to_string())?,
        Value::BigInt(v) => v.map(|v| v.to_string())?,
        Value::TinyUnsigned(v) => v.map(|v| v.to_string())?,
        Value::SmallUnsigned(v) => v.map(|v| v.to_string())?,
        Value::Unsigned(v) => v.map(|v| v.to_string())?,
        Value::BigUnsigned(v) => v.map(|v| v.to_string())?,
        Value::Float(v) => v.map(|v| v.to_string())?,
        Value::Double(v) => v.map(|v| v.to_string())?,
        Value::String(v) => v.clone()?,
        Value::Char(v) => v.map(|v| v.to_string())?,
        Value::Enum(v) => match v {
            sea_orm::sea_query::OptionEnum::Some(e) => e.value.to_string(),
            sea_orm::sea_query::OptionEnum::None(_) => return None,
        },
        Value::Bytes(v) => {
            let bytes = v.as_ref()?;
            let mut text = String::with_capacity(2 + 2 * bytes.len());
            text.push_str("0x");
            for b in bytes {
                text.push_str(&format!("{b:02x}"));
            }
            text
        }
        Value::Json(v) => serde_json::to_string(v.as_deref()?).ok()?,
        Value::Uuid(v) => v.map(|v| v.hyphenated().to_string())?,
        Value::ChronoDate(v) => v.map(|v| v.to_string())?,
        Value::ChronoTime(v) => v.map(|v| v.to_string())?,
        Value::ChronoDateTime(v) => v.map(|v| v.to_string())?,
        Value::ChronoDateTimeUtc(v) => v.map(|v| v.to_rfc3339())?,
        Value::ChronoDateTimeLocal(v) => v.map(|v| v.to_rfc3339())?,
        Value::ChronoDateTimeWithTimeZone(v) => v.map(|v| v.to_rfc3339())?,
        // Types behind SeaORM features shardkit does not enable itself (an
        // application's own features turn them on): SeaQuery's literal.
        #[allow(unreachable_patterns)]
        other => {
            let literal = PostgresQueryBuilder.value_to_string(other);
            if literal == "NULL" {
                return None;
            }
            literal
        }
    })
}

/// Values as text joined by [`TUPLE_SEPARATOR`] (a NULL is empty): how
/// reports, cache keys and cursors name a primary key.
pub(crate) fn tuple_text(values: &[Value]) -> String {
    let mut text = String::new();
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            text.push(TUPLE_SEPARATOR);
        }
        text.push_str(&value_text(v).unwrap_or_default());
    }
    text
}

/// The column types whose stored text [`typed_value`] reads back as the
/// value a bound parameter compares with.
pub(crate) enum TextType {
    BigInt,
    Int,
    Uuid,
    Text,
}

/// `column`'s [`TextType`]; `None` for a type whose text is kept as text
/// and may not compare like the column's values.
pub(crate) fn text_type<E: EntityTrait>(column: E::Column) -> Option<TextType> {
    use sea_orm::ColumnTrait;
    use sea_orm::sea_query::ColumnType;
    match column.def().get_column_type() {
        ColumnType::BigInteger | ColumnType::BigUnsigned => Some(TextType::BigInt),
        ColumnType::Integer
        | ColumnType::Unsigned
        | ColumnType::SmallInteger
        | ColumnType::TinyInteger => Some(TextType::Int),
        ColumnType::Uuid => Some(TextType::Uuid),
        ColumnType::String(_) | ColumnType::Text | ColumnType::Char(_) => Some(TextType::Text),
        _ => None,
    }
}

/// A value from its stored text, typed like `column` (so a comparison with
/// the column compares like with like). Text that does not parse as the
/// column's type stays text.
pub(crate) fn typed_value<E: EntityTrait>(column: E::Column, text: &str) -> Value {
    match text_type::<E>(column) {
        Some(TextType::BigInt) => text
            .parse::<i64>()
            .map_or_else(|_| text.into(), Value::from),
        Some(TextType::Int) => text
            .parse::<i32>()
            .map_or_else(|_| text.into(), Value::from),
        Some(TextType::Uuid) => {
            uuid::Uuid::parse_str(text).map_or_else(|_| text.into(), Value::from)
        }
        Some(TextType::Text) | None => text.into(),
    }
}

/// The primary key values of a model, in key order.
pub(crate) fn model_pk_values<E: EntityTrait>(row: &E::Model) -> Vec<Value> {
    <E::PrimaryKey as Iterable>::iter()
        .map(|pk| row.get(pk.into_column()))
        .collect()
}

/// A model's primary key as [`tuple_text`].
pub(crate) fn model_pk<E: EntityTrait>(row: &E::Model) -> String {
    tuple_text(&model_pk_values::<E>(row))
}

/// An active model's primary key as [`tuple_text`] (an unset column is empty).
pub(crate) fn active_pk<A: ActiveModelTrait>(model: &A) -> String {
    let values: Vec<Value> = <<A::Entity as EntityTrait>::PrimaryKey as Iterable>::iter()
        .map(|pk| match model.get(pk.into_column()) {
            ActiveValue::Set(v) | ActiveValue::Unchanged(v) => v,
            ActiveValue::NotSet => Value::String(None),
        })
        .collect();
    tuple_text(&values)
}

/// `E`'s primary-key columns, and the others (what an upsert updates).
pub(crate) fn key_and_other_columns<E: EntityTrait>() -> (Vec<E::Column>, Vec<E::Column>) {
    let pks: Vec<E::Column> = <E::PrimaryKey as Iterable>::iter()
        .map(PrimaryKeyToColumn::into_column)
        .collect();
    let others = <E::Column as Iterable>::iter()
        .filter(|c| {
            !pks.iter()
                .any(|p| sea_orm::IdenStatic::as_str(p) == sea_orm::IdenStatic::as_str(c))
        })
        .collect();
    (pks, others)
}

/// What an upsert of `E` matches on and what it sets: the primary-key
/// columns, and the others (a table of primary-key columns only sets the
/// key to itself, since an upsert must set something).
pub(crate) fn upsert_columns<E: EntityTrait>() -> (Vec<E::Column>, Vec<E::Column>) {
    let (pks, others) = key_and_other_columns::<E>();
    let set = if others.is_empty() {
        pks.clone()
    } else {
        others
    };
    (pks, set)
}

/// A model's column values, in `Column::iter()` order: how the write
/// pipeline hands a row to a feature that finds it by entity type.
pub(crate) fn model_values<E: EntityTrait>(row: &E::Model) -> Vec<Value> {
    <E::Column as Iterable>::iter()
        .map(|c| row.get(c))
        .collect()
}

/// An active model's column values, in `Column::iter()` order.
pub(crate) fn active_values<E: EntityTrait>(model: &E::ActiveModel) -> Vec<ActiveValue<Value>> {
    <E::Column as Iterable>::iter()
        .map(|c| model.get(c))
        .collect()
}

/// The active model [`active_values`] took apart (an `Unchanged` column
/// comes back `Set`), and which columns were `Set`.
pub(crate) fn active_from_values<E: EntityTrait>(
    values: Vec<ActiveValue<Value>>,
) -> Result<(E::ActiveModel, Vec<bool>), sea_orm::DbErr> {
    let columns = <E::Column as Iterable>::iter().count();
    if values.len() != columns {
        return Err(sea_orm::DbErr::Type(format!(
            "{} values for {columns} columns",
            values.len()
        )));
    }
    let mut model = <E::ActiveModel as ActiveModelTrait>::default();
    let mut set = Vec::with_capacity(columns);
    for (column, value) in <E::Column as Iterable>::iter().zip(values) {
        set.push(matches!(value, ActiveValue::Set(_)));
        match value {
            ActiveValue::Set(v) | ActiveValue::Unchanged(v) => model.try_set(column, v)?,
            ActiveValue::NotSet => {}
        }
    }
    Ok((model, set))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_has_its_own_exact_text() {
        let cases: Vec<(Value, Option<&str>)> = vec![
            (Value::BigInt(Some(-42)), Some("-42")),
            (Value::Bool(Some(true)), Some("true")),
            (Value::Double(Some(0.1)), Some("0.1")),
            (Value::Float(Some(1.5)), Some("1.5")),
            (Value::Bytes(Some(vec![0, 0xab, 0x10])), Some("0x00ab10")),
            (Value::String(Some("ünï".into())), Some("ünï")),
            (Value::Char(Some('x')), Some("x")),
            (
                Value::Json(Some(Box::new(serde_json::json!({"b": 1, "a": [true]})))),
                Some(r#"{"a":[true],"b":1}"#),
            ),
            (
                Value::ChronoDate(Some(
                    sea_orm::prelude::ChronoDate::from_ymd_opt(2026, 11, 23).unwrap(),
                )),
                Some("2026-11-23"),
            ),
            (Value::BigInt(None), None),
            (Value::String(None), None),
            (Value::Bytes(None), None),
        ];
        for (value, text) in cases {
            assert_eq!(value_text(&value).as_deref(), text, "{value:?}");
        }
    }

    #[test]
    fn tuples_join_with_the_unit_separator_and_null_is_empty() {
        let text = tuple_text(&[Value::Int(Some(1)), Value::String(None), "a".into()]);
        assert_eq!(text, "1\u{1f}\u{1f}a");
    }
}
