//! A copy chunk between PostgreSQL shards written with `COPY … FROM STDIN`:
//! the server's bulk path, where a multi-row `INSERT` parses one parameter
//! per column and row and inserts row by row. SeaORM's transaction cannot
//! carry `COPY`, so the chunk's transaction runs on a sqlx connection of
//! the target's pool, under the same fence as every other mover write
//! ([`Token::begin_pg`]).

use crate::error::{Result, ShardError};
use crate::rebalance::fencing::Token;
use sea_orm::{DatabaseConnection, DbErr, RuntimeErr, Value};
use std::fmt::Write as _;
use std::sync::Arc;

/// A sqlx error as SeaORM reports one, so shardkit's classification (a
/// unique violation, a retryable abort, a lost connection) reads it alike.
pub(crate) fn db_err(e: sea_orm::sqlx::Error) -> DbErr {
    DbErr::Exec(RuntimeErr::SqlxError(Arc::new(e)))
}

/// Appends `values` to `out` as one row of `COPY`'s text format; `false`
/// (and `out` as it was) when a value has a type this renders no text for,
/// so the caller writes the chunk another way.
pub(crate) fn row_text(values: &[Value], out: &mut String) -> bool {
    let start = out.len();
    for (i, value) in values.iter().enumerate() {
        if i > 0 {
            out.push('\t');
        }
        if !value_text(value, out) {
            out.truncate(start);
            return false;
        }
    }
    out.push('\n');
    true
}

/// One value in `COPY`'s text format: `\N` for NULL; otherwise the text
/// PostgreSQL's input function for the column's type reads, with the
/// format's escapes.
fn value_text(value: &Value, out: &mut String) -> bool {
    macro_rules! shown {
        ($v:expr) => {
            match $v {
                Some(v) => {
                    let _ = write!(out, "{v}");
                }
                None => out.push_str("\\N"),
            }
        };
    }
    match value {
        Value::Bool(v) => match v {
            Some(b) => out.push(if *b { 't' } else { 'f' }),
            None => out.push_str("\\N"),
        },
        Value::TinyInt(v) => shown!(v),
        Value::SmallInt(v) => shown!(v),
        Value::Int(v) => shown!(v),
        Value::BigInt(v) => shown!(v),
        Value::TinyUnsigned(v) => shown!(v),
        Value::SmallUnsigned(v) => shown!(v),
        Value::Unsigned(v) => shown!(v),
        Value::BigUnsigned(v) => shown!(v),
        Value::Float(v) => float(v.map(f64::from), out),
        Value::Double(v) => float(*v, out),
        Value::String(v) => match v {
            Some(s) => escaped(s, out),
            None => out.push_str("\\N"),
        },
        Value::Char(v) => match v {
            Some(c) => escaped(c.encode_utf8(&mut [0; 4]), out),
            None => out.push_str("\\N"),
        },
        Value::Bytes(v) => match v {
            // bytea's hex input, `\x…`, its backslash escaped.
            Some(bytes) => {
                out.push_str("\\\\x");
                for b in bytes {
                    let _ = write!(out, "{b:02x}");
                }
            }
            None => out.push_str("\\N"),
        },
        Value::Json(v) => match v {
            Some(json) => escaped(&json.to_string(), out),
            None => out.push_str("\\N"),
        },
        Value::ChronoDate(v) => shown!(v),
        Value::ChronoTime(v) => shown!(v),
        Value::ChronoDateTime(v) => shown!(v),
        Value::ChronoDateTimeUtc(v) => shown!(v.map(|t| t.to_rfc3339())),
        Value::ChronoDateTimeLocal(v) => shown!(v.map(|t| t.to_rfc3339())),
        Value::ChronoDateTimeWithTimeZone(v) => shown!(v.map(|t| t.to_rfc3339())),
        Value::Uuid(v) => shown!(v),
        // A PostgreSQL enum's label.
        Value::Enum(v) => match v {
            sea_orm::sea_query::OptionEnum::Some(e) => escaped(&e.value, out),
            sea_orm::sea_query::OptionEnum::None(_) => out.push_str("\\N"),
        },
        // Decimals, arrays, network types, the time and jiff crates' types
        // (features an application may turn on): the multi-row `INSERT`
        // binds them as SeaORM does.
        _ => return false,
    }
    true
}

fn float(v: Option<f64>, out: &mut String) {
    match v {
        None => out.push_str("\\N"),
        Some(f) if f.is_nan() => out.push_str("NaN"),
        Some(f) if f.is_infinite() => out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" }),
        // Rust's shortest text that reads back as the same value.
        Some(f) => {
            let _ = write!(out, "{f:?}");
        }
    }
}

/// Text with `COPY`'s escapes: backslash, and the row and column
/// delimiters.
fn escaped(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
}

/// What [`copy_in`] did.
pub(crate) enum Copied {
    /// The rows are on the target.
    Written,
    /// A row was there already: rolled back, nothing written.
    Conflict,
}

/// Copies `text` (rows in `COPY`'s text format) into `table`'s `columns`
/// on `db`, in one transaction under the mover's fence.
pub(crate) async fn copy_in(
    token: &Token,
    (db, shard): (&DatabaseConnection, &str),
    what: &str,
    table: &str,
    columns: &[&str],
    text: String,
) -> Result<Copied> {
    let q = |name: &str| crate::exec::quoted(sea_orm::DbBackend::Postgres, name);
    let statement = format!(
        "COPY {} ({}) FROM STDIN",
        q(table),
        columns.iter().map(|c| q(c)).collect::<Vec<_>>().join(", ")
    );
    let err = |e: DbErr| {
        ShardError::db(
            crate::error::Origin::table(crate::error::Subsystem::Rebalance, table),
            shard.to_owned(),
            format!("copy to {table}"),
            e,
        )
    };
    let mut txn = token.begin_pg((db, shard), what).await?;
    let copied = async {
        let mut copy = txn.copy_in_raw(&statement).await?;
        if let Err(e) = copy.send(text.into_bytes()).await {
            let _ = copy
                .abort("shardkit: the copy's data could not be sent")
                .await;
            return Err(e);
        }
        copy.finish().await
    }
    .await
    .map_err(db_err);
    match copied {
        Ok(_) => {
            txn.commit().await.map_err(|e| err(db_err(e)))?;
            Ok(Copied::Written)
        }
        Err(e) if crate::error::is_unique_violation(&e) => {
            txn.rollback().await.map_err(|e| err(db_err(e)))?;
            Ok(Copied::Conflict)
        }
        Err(e) => Err(err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_in_copy_text() {
        let mut out = String::new();
        assert!(row_text(
            &[
                Value::BigInt(Some(-7)),
                Value::String(Some("a\tb\nc\\d\re".into())),
                Value::Bool(Some(true)),
                Value::Double(Some(0.1)),
                Value::Double(Some(f64::NEG_INFINITY)),
                Value::Bytes(Some(vec![0, 255])),
                Value::Int(None),
            ],
            &mut out
        ));
        assert_eq!(
            out,
            "-7\ta\\tb\\nc\\\\d\\re\tt\t0.1\t-Infinity\t\\\\x00ff\t\\N\n"
        );
        let mut out = String::new();
        let label = sea_orm::sea_query::Enum {
            type_name: "mood".into(),
            value: "o\tk".into(),
        };
        assert!(row_text(
            &[Value::Enum(sea_orm::sea_query::OptionEnum::Some(Box::new(
                label
            )))],
            &mut out
        ));
        assert_eq!(out, "o\\tk\n");
    }
}
