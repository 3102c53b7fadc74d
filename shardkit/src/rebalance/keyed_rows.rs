//! A move's part for shardkit's own keyed tables (outbox, inbox, sagas,
//! requests): the moving group's rows of each, by `grp` and the bucket of
//! `key_text`, carried like an entity's rows. A move carries them after the
//! entities listed (nothing of an application's points at them).

use crate::clock::Clock;
use crate::entity::ShardKey;
use crate::error::Result;
use crate::exec::keyed_tables::{KeyedTable, text_at};
use crate::rebalance::db_err;
use crate::rebalance::entity::{
    Buckets, Chunk, Compared, MoveEntity, MovingTable, bounded, logged_keys,
};
use crate::rebalance::errors::again;
use crate::rebalance::fencing::Token;
use crate::topology::RangeBound;
use futures::future::BoxFuture;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, OnConflict, Order, Query, SelectStatement};
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, Value};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// How long before its expiry a row is left out of a move's verify as if
/// it had expired: a relay whose clock runs up to this much ahead of the
/// mover's prunes it earlier, on one side of the move only.
const EXPIRY_MARGIN: Duration = Duration::from_secs(3600);

/// The rows of `table` that belong to keys of type `K` in group `group`.
pub(crate) struct KeyedRows<K> {
    group: &'static str,
    table: &'static KeyedTable,
    moving: MovingTable,
    /// The cluster's clock: which rows have gone by age.
    clock: Arc<dyn Clock>,
    _key: std::marker::PhantomData<fn() -> K>,
}

impl<K: ShardKey> KeyedRows<K> {
    pub(crate) fn new(
        group: &'static str,
        table: &'static KeyedTable,
        clock: Arc<dyn Clock>,
    ) -> Self {
        KeyedRows {
            group,
            table,
            moving: MovingTable::new(None, table.name),
            clock,
            _key: std::marker::PhantomData,
        }
    }

    fn select(&self) -> SelectStatement {
        let mut q = Query::select();
        q.columns(self.table.names())
            .from(Alias::new(self.table.name))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group));
        q
    }

    fn moving(&self, buckets: &Buckets, row: &[Value]) -> bool {
        K::from_directory_text(text_at(row, 2)).is_some_and(|k| buckets.holds(&k))
    }

    async fn rows<C: ConnectionTrait>(
        &self,
        db: &C,
        shard: &str,
        stmt: &SelectStatement,
        what: &str,
    ) -> Result<Vec<Vec<Value>>> {
        let err = |e| db_err(shard, self.table.name, what, e);
        db.query_all(stmt)
            .await
            .map_err(err)?
            .iter()
            .map(|r| self.table.read(r).map_err(err))
            .collect()
    }

    /// The chunk of rows after `after` (by `id`), at most `chunk`, up to
    /// `upto` when given.
    async fn chunk<C: ConnectionTrait>(
        &self,
        (db, shard): (&C, &str),
        after: Option<&str>,
        upto: Option<&str>,
        chunk: u64,
        what: &str,
    ) -> Result<Vec<Vec<Value>>> {
        let mut q = self.select();
        if let Some(after) = after {
            q.and_where(Expr::col(Alias::new("id")).gt(after));
        }
        if let Some(upto) = upto {
            q.and_where(Expr::col(Alias::new("id")).lte(upto));
        }
        q.order_by(Alias::new("id"), Order::Asc).limit(chunk);
        self.rows(db, shard, &q, what).await
    }

    async fn of_keys<C: ConnectionTrait>(
        &self,
        (db, shard): (&C, &str),
        keys: &[String],
        what: &str,
    ) -> Result<Vec<Vec<Value>>> {
        let mut rows = Vec::new();
        for chunk in keys.chunks(500) {
            let mut q = self.select();
            q.and_where(Expr::col(Alias::new("key_text")).is_in(chunk.iter().map(String::as_str)));
            // MySQL/MariaDB's padding also matches `'k '` for `'k'`: another
            // key's rows.
            let wanted: HashSet<&str> = chunk.iter().map(String::as_str).collect();
            rows.extend(
                self.rows(db, shard, &q, what)
                    .await?
                    .into_iter()
                    .filter(|r| wanted.contains(text_at(r, 2))),
            );
        }
        Ok(rows)
    }

    /// Writes `rows` over what `db` has under their ids, under the fence.
    async fn upsert(
        &self,
        token: &Token,
        (db, shard): (&DatabaseConnection, &str),
        what: &str,
        rows: &[Vec<Value>],
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let per = match db.get_database_backend() {
            DbBackend::Sqlite => 32_000,
            _ => 65_000,
        } / self.table.columns.len();
        again(self.table.name, shard, || async {
            let err = |e| db_err(shard, self.table.name, what, e);
            let txn = token.begin((db, shard), what).await?;
            for batch in rows.chunks(per) {
                let mut q = Query::insert();
                q.into_table(Alias::new(self.table.name))
                    .columns(self.table.names())
                    .on_conflict(
                        OnConflict::column(Alias::new("id"))
                            .update_columns(self.table.names().skip(1))
                            .to_owned(),
                    );
                for row in batch {
                    q.values_panic(row.iter().cloned().map(Into::into));
                }
                txn.execute(&q).await.map_err(err)?;
            }
            txn.commit().await.map_err(err)
        })
        .await
    }

    /// Deletes the rows of `column IN values` on `db`, under the fence.
    async fn delete_in(
        &self,
        token: &Token,
        (db, shard): (&DatabaseConnection, &str),
        what: &str,
        column: &str,
        values: &[String],
    ) -> Result<u64> {
        let mut deleted = 0;
        for chunk in values.chunks(500) {
            deleted += again(self.table.name, shard, || async {
                let err = |e| db_err(shard, self.table.name, what, e);
                let txn = token.begin((db, shard), what).await?;
                let q = Query::delete()
                    .from_table(Alias::new(self.table.name))
                    .and_where(Expr::col(Alias::new("grp")).eq(self.group))
                    .and_where(
                        Expr::col(Alias::new(column)).is_in(chunk.iter().map(String::as_str)),
                    )
                    .to_owned();
                let n = txn.execute(&q).await.map_err(err)?.rows_affected();
                txn.commit().await.map_err(err)?;
                Ok(n)
            })
            .await?;
        }
        Ok(deleted)
    }
}

fn next_of(rows: &[Vec<Value>], chunk: u64) -> Option<String> {
    (rows.len() as u64 == chunk)
        .then(|| rows.last().map(|r| text_at(r, 0).to_owned()))
        .flatten()
}

impl<K: ShardKey> MoveEntity for KeyedRows<K> {
    fn table(&self) -> &MovingTable {
        &self.moving
    }

    fn implicit(&self) -> bool {
        true
    }

    fn bound_at(&self, key: &str) -> Option<RangeBound> {
        K::from_directory_text(key).and_then(|k| RangeBound::at_key(&k))
    }

    fn copy_chunks<'a>(
        &'a self,
        token: &'a Token,
        src: (&'a DatabaseConnection, &'a str),
        dst: (&'a DatabaseConnection, &'a str),
        after: Option<&'a str>,
        chunk: u64,
        chunks: usize,
        buckets: &'a Buckets,
        skip_logged: bool,
    ) -> BoxFuture<'a, Result<Chunk>> {
        Box::pin(async move {
            let mut after = after.map(str::to_owned);
            let mut copied = 0;
            for _ in 0..chunks.max(1) {
                let rows = self
                    .chunk(src, after.as_deref(), None, chunk, "copy from")
                    .await?;
                let next = next_of(&rows, chunk);
                let mut moving: Vec<Vec<Value>> = rows
                    .into_iter()
                    .filter(|r| self.moving(buckets, r))
                    .collect();
                if skip_logged && !moving.is_empty() {
                    let keys: Vec<String> =
                        moving.iter().map(|r| text_at(r, 2).to_owned()).collect();
                    let logged = logged_keys(src, token.id(), &keys).await?;
                    moving.retain(|r| !logged.contains(text_at(r, 2)));
                }
                copied += moving.len() as u64;
                self.upsert(token, dst, "copy", &moving).await?;
                after = next;
                if after.is_none() {
                    break;
                }
            }
            Ok(Chunk {
                rows: copied,
                next: after,
            })
        })
    }

    fn upsert_keys<'a>(
        &'a self,
        token: &'a Token,
        src: (&'a DatabaseTransaction, &'a str),
        dst: (&'a DatabaseConnection, &'a str),
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<u64>> {
        Box::pin(async move {
            let rows = self.of_keys(src, keys, "replay").await?;
            self.upsert(token, dst, "replay", &rows).await?;
            Ok(rows.len() as u64)
        })
    }

    fn prune_keys<'a>(
        &'a self,
        token: &'a Token,
        src: (&'a DatabaseTransaction, &'a str),
        dst: (&'a DatabaseConnection, &'a str),
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<u64>> {
        Box::pin(async move {
            let there: HashSet<String> = self
                .of_keys(src, keys, "replay")
                .await?
                .iter()
                .map(|r| text_at(r, 0).to_owned())
                .collect();
            let gone: Vec<String> = self
                .of_keys((dst.0, dst.1), keys, "replay")
                .await?
                .iter()
                .map(|r| text_at(r, 0).to_owned())
                .filter(|id| !there.contains(id))
                .collect();
            self.delete_in(token, dst, "prune", "id", &gone).await
        })
    }

    fn delete_chunk<'a>(
        &'a self,
        token: &'a Token,
        db: (&'a DatabaseConnection, &'a str),
        after: Option<&'a str>,
        chunk: u64,
        buckets: &'a Buckets,
    ) -> BoxFuture<'a, Result<Chunk>> {
        Box::pin(async move {
            let rows = self.chunk(db, after, None, chunk, "clean").await?;
            let next = next_of(&rows, chunk);
            // By id: under MySQL/MariaDB's padding, `key_text IN ('k')`
            // would also take the rows of a key `'k '` that does not move.
            let ids: Vec<String> = rows
                .iter()
                .filter(|r| self.moving(buckets, r))
                .map(|r| text_at(r, 0).to_owned())
                .collect();
            let rows = self.delete_in(token, db, "clean", "id", &ids).await?;
            Ok(Chunk { rows, next })
        })
    }

    fn compare<'a>(
        &'a self,
        src: (&'a DatabaseConnection, &'a str),
        dst: (&'a DatabaseConnection, &'a str),
        chunk: u64,
        buckets: &'a Buckets,
        step: Duration,
    ) -> BoxFuture<'a, Result<Compared>> {
        Box::pin(async move {
            let mut out = Compared::default();
            let mut after: Option<String> = None;
            // Rows that have gone by age (or go within the margin) are left
            // out on both sides: a relay's prune deletes them on one side
            // only, with no change-log entry, and an expired row is as good
            // as gone (see `Expiry`).
            let now = crate::clock::now_ms(&*self.clock);
            let compared = |r: &Vec<Value>| {
                self.moving(buckets, r) && !self.table.expires(r, now, EXPIRY_MARGIN)
            };
            loop {
                let rows = bounded(self.group, step, src.1, async {
                    self.chunk(src, after.as_deref(), None, chunk, "verify")
                        .await
                })
                .await?;
                let last = next_of(&rows, chunk);
                let mut theirs = Vec::new();
                let mut page_after = after.clone();
                loop {
                    let page = bounded(self.group, step, dst.1, async {
                        self.chunk(dst, page_after.as_deref(), last.as_deref(), chunk, "verify")
                            .await
                    })
                    .await?;
                    let more = page.len() as u64 == chunk;
                    page_after = page.last().map(|r| text_at(r, 0).to_owned());
                    theirs.extend(page.into_iter().filter(compared));
                    if !more {
                        break;
                    }
                }
                let mine: BTreeMap<&str, &Vec<Value>> = rows
                    .iter()
                    .filter(|r| compared(r))
                    .map(|r| (text_at(r, 0), r))
                    .collect();
                out.rows += mine.len() as u64;
                let mut seen = HashSet::new();
                for r in &theirs {
                    let id = text_at(r, 0);
                    match mine.get(id) {
                        Some(m) if *m == r => {}
                        Some(m) => out.keys.push(text_at(m, 2).to_owned()),
                        None => out.keys.push(text_at(r, 2).to_owned()),
                    }
                    seen.insert(id);
                }
                out.keys.extend(
                    mine.iter()
                        .filter(|(id, _)| !seen.contains(**id))
                        .map(|(_, r)| text_at(r, 2).to_owned()),
                );
                match last {
                    Some(last) => after = Some(last),
                    None => break,
                }
            }
            out.keys.sort();
            out.keys.dedup();
            Ok(out)
        })
    }
}
