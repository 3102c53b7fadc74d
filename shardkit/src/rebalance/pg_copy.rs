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

use crate::error::Result;
use crate::rebalance::errors::sqlx_err;
use crate::rebalance::fencing::Token;
use sea_orm::sqlx::Postgres;
use sea_orm::sqlx::pool::PoolConnection;
use sea_orm::{DatabaseConnection, DbErr};
use std::borrow::Cow;
use std::ops::Range;

/// A pooled connection for a `COPY`, closed instead of returned to its
/// pool unless the work on it finished: a `COPY` cut off midway (the
/// mover's step timeout drops it) can leave the connection's replies out of
/// step with its next statements, and the pool is shared with every other
/// statement of the shard.
pub(crate) struct CopyConn {
    conn: PoolConnection<Postgres>,
    done: bool,
}

impl CopyConn {
    pub(crate) async fn acquire(db: &DatabaseConnection) -> Result<CopyConn, DbErr> {
        let conn = db
            .get_postgres_connection_pool()
            .acquire()
            .await
            .map_err(sqlx_err)?;
        Ok(CopyConn { conn, done: false })
    }

    /// The work finished: the connection goes back to its pool.
    fn done(&mut self) {
        self.done = true;
    }
}

impl Drop for CopyConn {
    fn drop(&mut self) {
        if !self.done {
            self.conn.close_on_drop();
        }
    }
}

/// The output of `COPY (select) TO STDOUT` on `db`, in `COPY`'s text
/// format: a line per row, columns in the select's order.
pub(crate) async fn copy_out(
    token: &Token,
    (db, shard): (&DatabaseConnection, &str),
    select: &str,
) -> Result<Vec<u8>, DbErr> {
    use futures::StreamExt;
    let mut conn = CopyConn::acquire(db).await?;
    let statement = format!("COPY ({select}) TO STDOUT");
    let mut text = Vec::new();
    let read = async {
        let mut stream = conn.conn.copy_out_raw(&statement).await?;
        while let Some(bytes) = stream.next().await {
            text.extend_from_slice(&bytes?);
        }
        Ok(())
    };
    token
        .observed(shard, &statement, read)
        .await
        .map_err(sqlx_err)?;
    conn.done();
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
    /// The table in messages (with its schema, if it has one).
    pub(crate) table: &'a str,
    /// The table in statements: quoted, and qualified with its schema.
    pub(crate) quoted: &'a str,
    pub(crate) all: Vec<&'a str>,
    pub(crate) key: Vec<&'a str>,
    /// What the upsert sets ([`upsert_columns`](crate::key::upsert_columns)).
    pub(crate) update: Vec<&'a str>,
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
    let table = columns.quoted;
    let list = |cols: &[&str]| cols.iter().map(|c| q(c)).collect::<Vec<_>>().join(", ");
    let all = list(&columns.all);
    // The rows land in the table itself, or in a temporary table the
    // upsert reads (dropped with the transaction, whatever its end).
    const ROWS: &str = "shardkit_copy_rows";
    let into = if upsert { q(ROWS) } else { table.to_owned() };
    let statement = format!("COPY {into} ({all}) FROM STDIN");
    let err = |e: DbErr| super::errors::db_err(shard, columns.table, "copy to", e);
    let mut conn = CopyConn::acquire(db).await.map_err(err)?;
    let mut txn = token.begin_pg(&mut conn.conn, shard, what).await?;
    let copied = async {
        if upsert {
            // The copied columns only, with their types: no constraint,
            // default or identity of the table's comes along.
            let create = format!(
                "CREATE TEMPORARY TABLE {into} ON COMMIT DROP AS SELECT {all} FROM {table} WITH NO DATA"
            );
            execute(&mut txn, token, shard, &create).await?;
        }
        let sent = send(&mut txn, &statement, text, token, what);
        token.observed(shard, &statement, sent).await?;
        if upsert {
            let key = list(&columns.key);
            let set = columns
                .update
                .iter()
                .map(|c| format!("{0} = EXCLUDED.{0}", q(c)))
                .collect::<Vec<_>>()
                .join(", ");
            // A `GENERATED ALWAYS` identity column takes the source's
            // value, as `COPY` gives it.
            let insert = format!(
                "INSERT INTO {table} ({all}) OVERRIDING SYSTEM VALUE SELECT {all} FROM {into} \
                 ON CONFLICT ({key}) DO UPDATE SET {set}"
            );
            execute(&mut txn, token, shard, &insert).await?;
        }
        Ok(())
    }
    .await
    .map_err(sqlx_err);
    let outcome = match copied {
        Ok(()) => txn.commit().await.map(|_| Copied::Written),
        Err(e) if !upsert && crate::error::is_unique_violation(&e) => {
            txn.rollback().await.map(|_| Copied::Conflict)
        }
        Err(e) => return Err(err(e)),
    };
    let outcome = outcome.map_err(|e| err(sqlx_err(e)))?;
    conn.done();
    Ok(outcome)
}

/// Runs `sql` in `txn`, reported as SeaORM reports its own statements
/// ([`Token::observed`]).
async fn execute(
    txn: &mut sea_orm::sqlx::Transaction<'_, Postgres>,
    token: &Token,
    shard: &str,
    sql: &str,
) -> Result<(), sea_orm::sqlx::Error> {
    use sea_orm::sqlx::{AssertSqlSafe, raw_sql};
    let done = raw_sql(AssertSqlSafe(sql)).execute(&mut **txn);
    token.observed(shard, sql, done).await.map(drop)
}

/// `COPY … FROM STDIN` of `text` in `txn`: the data in two sends, split at
/// a line, with a parking point between them (a process paused while
/// sending, see [`Token::park_sending`]).
async fn send(
    txn: &mut sea_orm::sqlx::Transaction<'_, Postgres>,
    statement: &str,
    text: &[u8],
    token: &Token,
    what: &str,
) -> Result<(), sea_orm::sqlx::Error> {
    let mut copy = txn.copy_in_raw(statement).await?;
    let half = text[..text.len() / 2]
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |i| i + 1);
    let (head, tail) = text.split_at(half);
    for (i, part) in [head, tail].into_iter().enumerate() {
        if i == 1 {
            token.park_sending(what).await;
        }
        if part.is_empty() {
            continue;
        }
        if let Err(e) = copy.send(part).await {
            let _ = copy
                .abort("shardkit: the copy's data could not be sent")
                .await;
            return Err(e);
        }
    }
    copy.finish().await.map(drop)
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
}
