//! A copy chunk between PostgreSQL shards, read with `COPY (SELECT …) TO
//! STDOUT` and written with `COPY … FROM STDIN`: the server's bulk path,
//! where a multi-row `INSERT` parses one parameter per column and row and
//! inserts row by row, and the client decodes every value into a model. The
//! mover reads each row's line only for its shard key (which bucket) and,
//! at the chunk's end, its primary key (where the next chunk starts); the
//! moving rows' lines go to the target as they came. SeaORM's connection
//! cannot carry `COPY`, so these statements run on sqlx connections of the
//! shards' pools; the write, in one transaction under the same fence as
//! every other mover write ([`Token::begin_pg`]).

use crate::error::{Result, ShardError};
use crate::rebalance::errors::sqlx_err;
use crate::rebalance::fencing::Token;
use sea_orm::{DatabaseConnection, DbErr, Value};
use std::borrow::Cow;
use std::fmt::Write as _;
use std::ops::Range;

/// The output of `COPY (select) TO STDOUT` on `db`, in `COPY`'s text
/// format: a line per row, columns in the select's order.
pub(crate) async fn copy_out(db: &DatabaseConnection, select: &str) -> Result<Vec<u8>, DbErr> {
    use futures::StreamExt;
    let mut conn = db
        .get_postgres_connection_pool()
        .acquire()
        .await
        .map_err(sqlx_err)?;
    let mut stream = conn
        .copy_out_raw(&format!("COPY ({select}) TO STDOUT"))
        .await
        .map_err(sqlx_err)?;
    let mut text = Vec::new();
    while let Some(bytes) = stream.next().await {
        text.extend_from_slice(&bytes.map_err(sqlx_err)?);
    }
    Ok(text)
}

/// Each row's line in `text` (its newline included): a newline in a value
/// is escaped, so every newline byte ends a row.
pub(crate) fn lines(text: &[u8]) -> impl Iterator<Item = Range<usize>> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= text.len() {
            return None;
        }
        let end = text[start..]
            .iter()
            .position(|b| *b == b'\n')
            .map_or(text.len(), |i| start + i + 1);
        let line = start..end;
        start = end;
        Some(line)
    })
}

/// Column `index` of a row's line, its escapes undone; `None` for NULL
/// (`\N`), a missing column or text that is not UTF-8.
pub(crate) fn field(line: &[u8], index: usize) -> Option<Cow<'_, str>> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let raw = line.split(|b| *b == b'\t').nth(index)?;
    if raw == b"\\N" {
        return None;
    }
    let raw = std::str::from_utf8(raw).ok()?;
    if !raw.contains('\\') {
        return Some(Cow::Borrowed(raw));
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next()? {
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'v' => '\u{b}',
            // PostgreSQL writes no octal or hex escapes; a backslash before
            // any other character stands for that character.
            other => other,
        });
    }
    Some(Cow::Owned(out))
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

/// A table's columns for a copy: all of them in the order of the rows'
/// text, and which of them are the primary key.
pub(crate) struct Columns<'a> {
    pub(crate) table: &'a str,
    pub(crate) all: Vec<&'a str>,
    pub(crate) key: Vec<&'a str>,
}

/// Writes `text` (rows in `COPY`'s text format) into `columns.table` on
/// `db` over whatever it has under their primary keys: a plain `COPY`
/// first; when a row is there already, the rows go through a temporary
/// table and an `INSERT … ON CONFLICT (primary key) DO UPDATE`. Each in one
/// transaction under the mover's fence, run again when the database aborts
/// it.
pub(crate) async fn write(
    token: &Token,
    (db, shard): (&DatabaseConnection, &str),
    what: &str,
    columns: &Columns<'_>,
    text: &[u8],
) -> Result<()> {
    let once = |upsert| copy_in(token, (db, shard), what, columns, text, upsert);
    if let Copied::Written = super::errors::again(columns.table, shard, || once(false)).await? {
        return Ok(());
    }
    super::errors::again(columns.table, shard, || once(true))
        .await
        .map(|_| ())
}

/// One transaction of [`write`]; with `upsert`, through a temporary table.
async fn copy_in(
    token: &Token,
    (db, shard): (&DatabaseConnection, &str),
    what: &str,
    columns: &Columns<'_>,
    text: &[u8],
    upsert: bool,
) -> Result<Copied> {
    let q = |name: &str| crate::exec::quoted(sea_orm::DbBackend::Postgres, name);
    let table = columns.table;
    let list = |cols: &[&str]| cols.iter().map(|c| q(c)).collect::<Vec<_>>().join(", ");
    let all = list(&columns.all);
    // The rows land in the table itself, or in a temporary table the
    // upsert reads (dropped with the transaction, whatever its end).
    const ROWS: &str = "shardkit_copy_rows";
    let into = if upsert { q(ROWS) } else { q(table) };
    let statement = format!("COPY {into} ({all}) FROM STDIN");
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
        use sea_orm::sqlx::{AssertSqlSafe, raw_sql};
        if upsert {
            raw_sql(AssertSqlSafe(format!(
                "CREATE TEMPORARY TABLE {into} (LIKE {}) ON COMMIT DROP",
                q(table)
            )))
            .execute(&mut *txn)
            .await?;
        }
        let mut copy = txn.copy_in_raw(&statement).await?;
        if let Err(e) = copy.send(text).await {
            let _ = copy.abort("shardkit: the copy's data could not be sent").await;
            return Err(e);
        }
        copy.finish().await?;
        if upsert {
            let key = list(&columns.key);
            let others: Vec<&str> = columns
                .all
                .iter()
                .copied()
                .filter(|c| !columns.key.contains(c))
                .collect();
            // A table of primary-key columns only sets the key to itself.
            let set = if others.is_empty() { &columns.key } else { &others };
            let set = set
                .iter()
                .map(|c| format!("{0} = EXCLUDED.{0}", q(c)))
                .collect::<Vec<_>>()
                .join(", ");
            raw_sql(AssertSqlSafe(format!(
                "INSERT INTO {} ({all}) SELECT {all} FROM {into} ON CONFLICT ({key}) DO UPDATE SET {set}",
                q(table)
            )))
            .execute(&mut *txn)
            .await?;
        }
        Ok(())
    }
    .await
    .map_err(sqlx_err);
    match copied {
        Ok(()) => {
            txn.commit().await.map_err(|e| err(sqlx_err(e)))?;
            Ok(Copied::Written)
        }
        Err(e) if !upsert && crate::error::is_unique_violation(&e) => {
            txn.rollback().await.map_err(|e| err(sqlx_err(e)))?;
            Ok(Copied::Conflict)
        }
        Err(e) => Err(err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_fields() {
        let text = b"1\tab\\tc\t\\N\n2\tx\\\\y\tz\n";
        let rows: Vec<_> = lines(text).collect();
        assert_eq!(rows, vec![0..11, 11..20]);
        let first = &text[rows[0].clone()];
        assert_eq!(field(first, 0).as_deref(), Some("1"));
        assert_eq!(field(first, 1).as_deref(), Some("ab\tc"));
        assert_eq!(field(first, 2), None);
        assert_eq!(field(first, 3), None);
        assert_eq!(field(&text[rows[1].clone()], 1).as_deref(), Some("x\\y"));
    }

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
