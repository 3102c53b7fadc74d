//! One entity's part in a move: copy, replay, compare and delete the rows of
//! the moving buckets, behind an object the mover calls by table.

use crate::entity::{EntityGroup, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::keyset;
use crate::exec::keyset::{model_pk_values, tuple_text};
use crate::rebalance::db_err;
use crate::rebalance::errors::again;
use crate::rebalance::fencing::Token;
use crate::topology::{RangeBound, RangeUnit};
use futures::future::BoxFuture;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, OnConflict, Query};
use sea_orm::{
    ActiveModelTrait, Condition, ConnectionTrait, DatabaseConnection, DatabaseTransaction,
    DbBackend, DbErr, EntityTrait, IntoActiveModel, Iterable, PrimaryKeyToColumn, QueryFilter,
    QuerySelect, Value,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The moving buckets of a hash group (a membership table over all
/// buckets), or the moving ranges of a range group.
pub(crate) enum Buckets {
    Hash { moving: Vec<bool> },
    Ranges(Vec<RangeUnit>),
}

impl Buckets {
    pub(crate) fn hash(count: u32, moving: impl IntoIterator<Item = u32>) -> Self {
        let mut set = vec![false; count as usize];
        for b in moving {
            if let Some(slot) = set.get_mut(b as usize) {
                *slot = true;
            }
        }
        Buckets::Hash { moving: set }
    }

    pub(crate) fn holds<K: ShardKey>(&self, key: &K) -> bool {
        match self {
            Buckets::Hash { moving } => {
                moving[(key.partition_hash() % moving.len() as u64) as usize]
            }
            Buckets::Ranges(units) => units.iter().any(|u| u.holds(key)),
        }
    }
}

/// A chunk's outcome.
pub(crate) struct Chunk {
    /// Rows of the moving buckets it copied or deleted.
    pub(crate) rows: u64,
    /// Where the next chunk starts; `None` at the end of the table.
    pub(crate) next: Option<String>,
}

/// What comparing one table found.
#[derive(Default)]
pub(crate) struct Compared {
    pub(crate) rows: u64,
    /// Keys (as text) whose rows differ between source and target.
    pub(crate) keys: Vec<String>,
}

/// A moving table: its name and the schema its entity names, if any
/// (PostgreSQL's schema, MySQL/MariaDB's database, SQLite's attached
/// database; SeaORM's `schema_name`).
/// Shown as `schema.name`, or `name`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MovingTable {
    pub(crate) schema: Option<String>,
    pub(crate) name: &'static str,
}

impl MovingTable {
    pub(crate) fn new(schema: Option<&str>, name: &'static str) -> Self {
        MovingTable {
            schema: schema.map(str::to_owned),
            name,
        }
    }

    pub(crate) fn of<E: EntityTrait>() -> Self {
        Self::new(
            sea_orm::EntityName::schema_name(&E::default()),
            table_name::<E>(),
        )
    }

    /// The table in a statement for `backend`: quoted, and qualified with
    /// its schema when it has one.
    pub(crate) fn quoted(&self, backend: DbBackend) -> String {
        let name = crate::exec::quoted(backend, self.name);
        match &self.schema {
            Some(schema) => format!("{}.{name}", crate::exec::quoted(backend, schema)),
            None => name,
        }
    }
}

impl std::fmt::Display for MovingTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "{schema}.{}", self.name),
            None => f.write_str(self.name),
        }
    }
}

/// An entity of the moving group, type-erased for the mover.
pub(crate) trait MoveEntity: Send + Sync {
    fn table(&self) -> &MovingTable;

    /// Whether every move carries it without being listed (shardkit's own
    /// keyed tables), after the listed entities.
    fn implicit(&self) -> bool {
        false
    }

    /// The columns the move copies (the entity's), checked against the
    /// table on each side before copying and cutting over; none for an
    /// implicit table (shardkit's own, migrated with shardkit).
    fn columns(&self) -> Vec<&'static str> {
        Vec::new()
    }

    /// The range bound at a shard key given as text (its directory text:
    /// an integer, a string, a UUID); `None` when it is not a key.
    fn bound_at(&self, key: &str) -> Option<RangeBound>;

    /// Whether its chunks from a `src` shard to a `dst` shard are read and
    /// written with `COPY` (see [`pg_copy`](super::pg_copy)), which sets
    /// their size ([`RebalanceSettings::copy_chunk`](crate::exec::RebalanceSettings::copy_chunk)).
    fn by_copy(&self, src: DbBackend, dst: DbBackend) -> bool {
        let _ = (src, dst);
        false
    }

    /// Copies the moving buckets' rows of the next `chunks` source chunks
    /// (primary key after `after`) to the target, over what the target has
    /// under those primary keys; each chunk is read while the one before is
    /// written. With `skip_logged`, a row whose key has a pending entry in
    /// the source's change log is left to the replay (which writes a key's
    /// rows parents first): a row whose parent the target lacks was written
    /// while its bucket moved, so its key is logged.
    #[allow(clippy::too_many_arguments)]
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
    ) -> BoxFuture<'a, Result<Chunk>>;

    /// Writes the source's rows of `keys` on the target (entities in the
    /// listed order: a row's parent first), read in `src`, one snapshot of
    /// the source for every entity (a child read later than its parent
    /// could have a parent that was not read).
    fn upsert_keys<'a>(
        &'a self,
        token: &'a Token,
        src: (&'a DatabaseTransaction, &'a str),
        dst: (&'a DatabaseConnection, &'a str),
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<u64>>;

    /// Deletes the target's rows of `keys` the source no longer has
    /// (entities in reverse order: a row's children first).
    fn prune_keys<'a>(
        &'a self,
        token: &'a Token,
        src: (&'a DatabaseTransaction, &'a str),
        dst: (&'a DatabaseConnection, &'a str),
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<u64>>;

    /// Deletes the moving buckets' rows of the next chunk of `db`'s table,
    /// all rows of a key in one statement (a reader sees a key's rows all
    /// there or all gone).
    fn delete_chunk<'a>(
        &'a self,
        token: &'a Token,
        db: (&'a DatabaseConnection, &'a str),
        after: Option<&'a str>,
        chunk: u64,
        buckets: &'a Buckets,
    ) -> BoxFuture<'a, Result<Chunk>>;

    /// Compares the moving buckets' rows on source and target.
    fn compare<'a>(
        &'a self,
        src: (&'a DatabaseConnection, &'a str),
        dst: (&'a DatabaseConnection, &'a str),
        chunk: u64,
        buckets: &'a Buckets,
        step: Duration,
    ) -> BoxFuture<'a, Result<Compared>>;
}

pub(crate) struct Mover<E> {
    table: MovingTable,
    _entity: std::marker::PhantomData<fn() -> E>,
}

impl<E: EntityTrait> Mover<E> {
    pub(crate) fn new() -> Self {
        Mover {
            table: MovingTable::of::<E>(),
            _entity: std::marker::PhantomData,
        }
    }
}

fn err<'a, E: EntityTrait>(shard: &'a str, what: &str) -> impl Fn(DbErr) -> ShardError + 'a {
    let table = table_name::<E>();
    let what = what.to_owned();
    move |source| {
        ShardError::db(
            crate::error::Origin::table(crate::error::Subsystem::Rebalance, table),
            shard.to_owned(),
            format!("{what} {table}"),
            source,
        )
    }
}

/// Rows per `INSERT` so a statement stays under the backend's limit of
/// bound parameters (65,535 on PostgreSQL and MySQL, 32,766 on SQLite).
fn rows_per_insert<E: EntityTrait>(backend: DbBackend) -> usize {
    let columns = <E::Column as Iterable>::iter().count().max(1);
    let limit = match backend {
        DbBackend::Sqlite => 32_000,
        _ => 65_000,
    };
    (limit / columns).max(1)
}

/// `work` (one step of a move of `group` against `shard`) bounded by
/// `step`: a shard that stops answering fails the mover instead of
/// holding it.
pub(crate) async fn bounded<T>(
    group: &'static str,
    step: Duration,
    shard: &str,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(step, work)
        .await
        .map_err(|_| ShardError::Timeout {
            group,
            shard: shard.to_owned(),
            after: step,
        })?
}

/// How [`upsert_rows`] writes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    /// A plain `INSERT` first (on PostgreSQL, `COPY … FROM STDIN`, see
    /// [`pg_copy`](super::pg_copy)): a copy's rows are new to the target unless
    /// the copy runs again (a move taken over, or sent back to copying),
    /// and the database inserts rows faster when it need not check each
    /// for a conflict (PostgreSQL's speculative insertion for `ON
    /// CONFLICT` made the copy about a third slower). When a row is there
    /// already, the unique violation rolls the transaction back, nothing
    /// written, and the chunk is written again as an upsert.
    InsertFirst,
    /// `INSERT … ON CONFLICT (primary key) DO UPDATE`.
    Upsert,
}

/// Writes `rows` on `db` over whatever it has under their primary keys, in
/// one transaction under the mover's fence (run again when the database
/// aborts it).
async fn upsert_rows<E>(
    token: &Token,
    (db, shard): (&DatabaseConnection, &str),
    what: &str,
    rows: Vec<E::Model>,
    write: Write,
) -> Result<()>
where
    E: ShardedEntity,
{
    if rows.is_empty() {
        return Ok(());
    }
    if write == Write::InsertFirst
        && again(table_name::<E>(), shard, || {
            upsert_once::<E>(token, (db, shard), what, rows.clone(), Write::InsertFirst)
        })
        .await?
    {
        return Ok(());
    }
    again(table_name::<E>(), shard, || {
        upsert_once::<E>(token, (db, shard), what, rows.clone(), Write::Upsert)
    })
    .await
    .map(|_| ())
}

/// A copy chunk's moving rows, as the target gets them.
enum Moving<M> {
    /// Models, written with a multi-row `INSERT` (between shards other than
    /// PostgreSQL, or a table whose primary key `COPY`'s text does not
    /// carry, see [`plain_pk`]).
    Models(Vec<M>),
    /// Rows in `COPY`'s text format, for a PostgreSQL target (see
    /// [`pg_copy`](super::pg_copy)).
    Text { text: Vec<u8>, rows: u64 },
}

impl<M> Moving<M> {
    fn rows(&self) -> u64 {
        match self {
            Moving::Models(rows) => rows.len() as u64,
            Moving::Text { rows, .. } => *rows,
        }
    }
}

/// Writes a copy chunk's moving rows on the target.
async fn write_moving<E: ShardedEntity>(
    token: &Token,
    dst: (&DatabaseConnection, &str),
    table: &MovingTable,
    moving: Moving<E::Model>,
) -> Result<()> {
    let group = <E::Group as EntityGroup>::NAME;
    match moving {
        Moving::Models(rows) => {
            let n = rows.len() as u64;
            upsert_rows::<E>(token, dst, "copy", rows, Write::InsertFirst).await?;
            crate::metrics::move_written(group, "insert", n);
            Ok(())
        }
        Moving::Text { rows: 0, .. } => Ok(()),
        Moving::Text { text, rows } => {
            let names = |cols: Vec<E::Column>| {
                cols.into_iter()
                    .map(|c| sea_orm::IdenStatic::as_str(&c))
                    .collect()
            };
            let (key, update) = crate::key::upsert_columns::<E>();
            let (shown, quoted) = (table.to_string(), table.quoted(DbBackend::Postgres));
            let columns = super::pg_copy::Columns {
                table: &shown,
                quoted: &quoted,
                all: names(<E::Column as Iterable>::iter().collect()),
                key: names(key),
                update: names(update),
            };
            super::pg_copy::write(token, dst, "copy", &columns, &text).await?;
            crate::metrics::move_written(group, "copy", rows);
            Ok(())
        }
    }
}

/// Whether `E`'s primary key columns are of types whose text, as
/// PostgreSQL writes it, [`typed_value`](crate::key::typed_value) reads
/// back as the value a bound parameter compares with (a copy read with
/// `COPY` takes the next chunk's start from the text).
fn plain_pk<E: EntityTrait>() -> bool {
    <E::PrimaryKey as Iterable>::iter()
        .all(|pk| crate::key::text_type::<E>(pk.into_column()).is_some())
}

/// The chunk of `E`'s rows after `after` on a PostgreSQL source, read with
/// `COPY (SELECT …) TO STDOUT`: the moving rows' lines and the next chunk's
/// start. `None` when a row's shard key or primary key does not read back
/// from its text (the caller reads the chunk as models instead).
async fn read_by_copy<E: ShardedEntity>(
    token: &Token,
    src: (&DatabaseConnection, &str),
    (after, chunk): (Option<&[Value]>, u64),
    buckets: &Buckets,
    skip_logged: bool,
) -> Result<Option<(Moving<E::Model>, Option<Vec<Value>>)>> {
    use super::pg_copy::{field, lines};
    // The stored values, column by column (no column's `select_as`): the
    // lines go to the target's table as they are.
    let mut select = Query::select();
    select
        .columns(<E::Column as Iterable>::iter())
        .from(sea_orm::EntityName::table_ref(&E::default()))
        .cond_where(keyset::after_condition::<E>(after))
        .limit(chunk);
    for pk in <E::PrimaryKey as Iterable>::iter() {
        select.order_by(pk.into_column(), sea_orm::Order::Asc);
    }
    let select = select.to_string(sea_orm::sea_query::PostgresQueryBuilder);
    let text = super::pg_copy::copy_out(token, src, &select)
        .await
        .map_err(err::<E>(src.1, "copy from"))?;
    let columns: Vec<E::Column> = <E::Column as Iterable>::iter().collect();
    let at = |column: E::Column| {
        let name = sea_orm::IdenStatic::as_str(&column);
        columns
            .iter()
            .position(|c| sea_orm::IdenStatic::as_str(c) == name)
    };
    let Some(key_at) = at(E::shard_key_column()) else {
        return Ok(None);
    };
    let mut kept: Vec<(<E::Group as EntityGroup>::Key, std::ops::Range<usize>)> = Vec::new();
    let (mut count, mut last) = (0u64, None);
    for line in lines(&text) {
        let row = &text[line.clone()];
        let Some(key) = field(row, key_at)
            .and_then(|k| <<E::Group as EntityGroup>::Key as ShardKey>::from_directory_text(&k))
        else {
            return Ok(None);
        };
        if buckets.holds(&key) {
            kept.push((key, line.clone()));
        }
        count += 1;
        last = Some(line);
    }
    let next = match last {
        Some(line) if count == chunk => {
            let row = &text[line];
            let mut pk = Vec::new();
            for column in <E::PrimaryKey as Iterable>::iter().map(PrimaryKeyToColumn::into_column) {
                let Some(value) = at(column).and_then(|i| field(row, i)) else {
                    return Ok(None);
                };
                pk.push(crate::key::typed_value::<E>(column, &value));
            }
            Some(pk)
        }
        _ => None,
    };
    if skip_logged {
        drop_logged(src, token.id(), &mut kept, |(k, _)| k.to_directory_text()).await?;
    }
    let mut moving = Vec::with_capacity(kept.iter().map(|(_, r)| r.len()).sum());
    for (_, line) in &kept {
        moving.extend_from_slice(&text[line.clone()]);
    }
    Ok(Some((
        Moving::Text {
            text: moving,
            rows: kept.len() as u64,
        },
        next,
    )))
}

/// One transaction of [`upsert_rows`]: `false` when a plain insert found a
/// row there (rolled back, nothing written).
async fn upsert_once<E>(
    token: &Token,
    (db, shard): (&DatabaseConnection, &str),
    what: &str,
    rows: Vec<E::Model>,
    write: Write,
) -> Result<bool>
where
    E: ShardedEntity,
{
    let e = err::<E>(shard, "copy to");
    let on_conflict = (write == Write::Upsert).then(|| {
        let (pks, set) = crate::key::upsert_columns::<E>();
        let mut on_conflict = OnConflict::columns(pks);
        on_conflict.update_columns(set);
        on_conflict
    });
    let txn = token.begin((db, shard), what).await?;
    let per = rows_per_insert::<E>(db.get_database_backend());
    let mut rows = rows.into_iter().peekable();
    while rows.peek().is_some() {
        let batch: Vec<E::ActiveModel> = rows
            .by_ref()
            .take(per)
            .map(|m| m.into_active_model().reset_all())
            .collect();
        let insert = E::insert_many(batch);
        let written = match &on_conflict {
            Some(on_conflict) => {
                insert
                    .on_conflict(on_conflict.clone())
                    .exec_without_returning(&txn)
                    .await
            }
            None => insert.exec_without_returning(&txn).await,
        };
        match written {
            Ok(_) => {}
            Err(err) if on_conflict.is_none() && crate::error::is_unique_violation(&err) => {
                txn.rollback().await.map_err(&e)?;
                return Ok(false);
            }
            Err(err) => return Err(e(err)),
        }
    }
    txn.commit().await.map_err(&e)?;
    Ok(true)
}

/// Deletes the rows of these primary keys on `db`, each batch in a
/// transaction under the mover's fence.
async fn delete_pks<E: ShardedEntity>(
    token: &Token,
    (db, shard): (&DatabaseConnection, &str),
    pks: &[Vec<Value>],
) -> Result<u64> {
    let single = <E::PrimaryKey as Iterable>::iter().count() == 1;
    let mut deleted = 0;
    for pks in pks.chunks(500) {
        let cond = if single {
            let col = <E::PrimaryKey as Iterable>::iter()
                .next()
                .expect("a primary key")
                .into_column();
            Condition::all().add(sea_orm::ColumnTrait::is_in(
                &col,
                pks.iter().map(|pk| pk[0].clone()),
            ))
        } else {
            pks.iter().fold(Condition::any(), |c, pk| {
                c.add(keyset::pk_condition::<E>(pk))
            })
        };
        deleted += again(table_name::<E>(), shard, || async {
            let e = err::<E>(shard, "delete from");
            let txn = token.begin((db, shard), "prune").await?;
            let n = E::delete_many()
                .filter(cond.clone())
                .exec(&txn)
                .await
                .map_err(&e)?
                .rows_affected;
            txn.commit().await.map_err(&e)?;
            Ok(n)
        })
        .await?;
    }
    Ok(deleted)
}

/// Drops the `rows` of a chunk whose key (`key`, as directory text) has a
/// pending entry in move `move_id`'s change log on the source. Read after
/// the chunk: the log entry of every row in it committed with the row.
async fn drop_logged<T>(
    src: (&DatabaseConnection, &str),
    move_id: i64,
    rows: &mut Vec<T>,
    key: impl Fn(&T) -> String,
) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let keys: Vec<String> = rows.iter().map(key).collect();
    let logged = logged_keys(src, move_id, &keys).await?;
    // The keys once: `retain` visits the rows in order.
    let mut keys = keys.iter();
    rows.retain(|_| keys.next().is_some_and(|k| !logged.contains(k)));
    Ok(())
}

/// Which of `keys` have a pending entry in move `move_id`'s change log on
/// `db`.
pub(super) async fn logged_keys(
    (db, shard): (&DatabaseConnection, &str),
    move_id: i64,
    keys: &[String],
) -> Result<std::collections::HashSet<String>> {
    let mut keys = keys.to_vec();
    keys.sort();
    keys.dedup();
    let mut logged = std::collections::HashSet::new();
    for chunk in keys.chunks(500) {
        let stmt = Query::select()
            .distinct()
            .column(Alias::new("key_text"))
            .from(Alias::new(crate::rebalance::map::CHANGES))
            .and_where(Expr::col(Alias::new("move_id")).eq(move_id))
            .and_where(Expr::col(Alias::new("key_text")).is_in(chunk.iter().map(String::as_str)))
            .to_owned();
        let rows = db
            .query_all(&stmt)
            .await
            .map_err(|e| db_err(shard, crate::rebalance::map::CHANGES, "read", e))?;
        for row in rows {
            logged.insert(
                row.try_get::<String>("", "key_text")
                    .map_err(|e| db_err(shard, crate::rebalance::map::CHANGES, "read", e))?,
            );
        }
    }
    Ok(logged)
}

/// The rows of `keys` on `db`.
async fn rows_of_keys<E: ShardedEntity, C: ConnectionTrait>(
    db: &C,
    shard: &str,
    keys: &[String],
) -> Result<Vec<E::Model>> {
    let values: Vec<Value> = keys
        .iter()
        .filter_map(|k| <<E::Group as EntityGroup>::Key as ShardKey>::from_directory_text(k))
        .map(Into::into)
        .collect();
    let mut rows = Vec::new();
    for chunk in values.chunks(500) {
        rows.extend(
            E::find()
                .filter(sea_orm::ColumnTrait::is_in(
                    &E::shard_key_column(),
                    chunk.iter().cloned(),
                ))
                .all(db)
                .await
                .map_err(err::<E>(shard, "replay"))?,
        );
    }
    Ok(rows)
}

impl<E> MoveEntity for Mover<E>
where
    E: ShardedEntity,
{
    fn table(&self) -> &MovingTable {
        &self.table
    }

    fn columns(&self) -> Vec<&'static str> {
        <E::Column as Iterable>::iter()
            .map(|c| sea_orm::IdenStatic::as_str(&c))
            .collect()
    }

    fn bound_at(&self, key: &str) -> Option<RangeBound> {
        <<E::Group as EntityGroup>::Key as ShardKey>::from_directory_text(key)
            .and_then(|k| RangeBound::at_key(&k))
    }

    /// Between PostgreSQL shards.
    fn by_copy(&self, src: DbBackend, dst: DbBackend) -> bool {
        (src, dst) == (DbBackend::Postgres, DbBackend::Postgres) && plain_pk::<E>()
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
            // Cleared when a chunk's text does not read back: the chunks
            // after it are read as models at once, not tried with `COPY`
            // first.
            let by_copy = AtomicBool::new(
                self.by_copy(src.0.get_database_backend(), dst.0.get_database_backend()),
            );
            let by_copy = &by_copy;
            // Reads the chunk after `after`: its moving rows and where the
            // next starts.
            let read = |after: Option<Vec<Value>>| async move {
                if by_copy.load(Ordering::Relaxed)
                    && let Some(read) = read_by_copy::<E>(
                        token,
                        src,
                        (after.as_deref(), chunk),
                        buckets,
                        skip_logged,
                    )
                    .await?
                {
                    return Ok(read);
                }
                by_copy.store(false, Ordering::Relaxed);
                let rows = keyset::chunk::<E>(after.as_deref(), chunk)
                    .all(src.0)
                    .await
                    .map_err(err::<E>(src.1, "copy from"))?;
                let next = (rows.len() as u64 == chunk)
                    .then(|| rows.last().map(model_pk_values::<E>))
                    .flatten();
                let mut moving: Vec<E::Model> = rows
                    .into_iter()
                    .filter(|m| buckets.holds(&E::shard_key(m)))
                    .collect();
                if skip_logged {
                    drop_logged(src, token.id(), &mut moving, |m| {
                        E::shard_key(m).to_directory_text()
                    })
                    .await?;
                }
                Ok::<_, ShardError>((Moving::Models(moving), next))
            };
            let mut copied = 0u64;
            let mut current = read(after.map(|a| parse_pk::<E>(a))).await?;
            for i in 0..chunks.max(1) {
                let (moving, next) = current;
                copied += moving.rows();
                // The next chunk is read while this one is written.
                match next {
                    Some(next) if i + 1 < chunks => {
                        let (written, read_next) = futures::join!(
                            write_moving::<E>(token, dst, &self.table, moving),
                            read(Some(next))
                        );
                        written?;
                        current = read_next?;
                    }
                    next => {
                        write_moving::<E>(token, dst, &self.table, moving).await?;
                        return Ok(Chunk {
                            rows: copied,
                            next: next.map(|pk| tuple_text(&pk)),
                        });
                    }
                }
            }
            unreachable!("the last chunk returns")
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
            let rows = rows_of_keys::<E, _>(src.0, src.1, keys).await?;
            let n = rows.len() as u64;
            upsert_rows::<E>(token, dst, "replay", rows, Write::Upsert).await?;
            Ok(n)
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
            let there: std::collections::HashSet<String> = rows_of_keys::<E, _>(src.0, src.1, keys)
                .await?
                .iter()
                .map(|m| tuple_text(&model_pk_values::<E>(m)))
                .collect();
            let gone: Vec<Vec<Value>> = rows_of_keys::<E, _>(dst.0, dst.1, keys)
                .await?
                .iter()
                .map(model_pk_values::<E>)
                .filter(|pk| !there.contains(&tuple_text(pk)))
                .collect();
            delete_pks::<E>(token, dst, &gone).await
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
            let after = after.map(|a| parse_pk::<E>(a));
            let rows = keyset::chunk::<E>(after.as_deref(), chunk)
                .all(db.0)
                .await
                .map_err(err::<E>(db.1, "clean"))?;
            let next = (rows.len() as u64 == chunk)
                .then(|| rows.last().map(|m| tuple_text(&model_pk_values::<E>(m))))
                .flatten();
            let mut keys: Vec<<E::Group as EntityGroup>::Key> = rows
                .iter()
                .map(|m| E::shard_key(m))
                .filter(|k| buckets.holds(k))
                .collect();
            keys.sort_by_key(|k| k.to_directory_text());
            keys.dedup();
            let mut deleted = 0;
            for keys in keys.chunks(500) {
                deleted += again(table_name::<E>(), db.1, || async {
                    let e = err::<E>(db.1, "clean");
                    let txn = token.begin(db, "clean").await?;
                    let n = E::delete_many()
                        .filter(sea_orm::ColumnTrait::is_in(
                            &E::shard_key_column(),
                            keys.iter().cloned().map(Into::<Value>::into),
                        ))
                        .exec(&txn)
                        .await
                        .map_err(&e)?
                        .rows_affected;
                    txn.commit().await.map_err(&e)?;
                    Ok(n)
                })
                .await?;
            }
            Ok(Chunk {
                rows: deleted,
                next,
            })
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
            // Both sides walk the table in primary-key order over the same
            // key range: the source's chunk decides where the range ends.
            let mut out = Compared::default();
            let mut after: Option<Vec<Value>> = None;
            loop {
                // Each chunk's read is a step, bounded like every other
                // step of the mover against a shard.
                let rows = bounded(<E::Group as EntityGroup>::NAME, step, src.1, async {
                    keyset::chunk::<E>(after.as_deref(), chunk)
                        .all(src.0)
                        .await
                        .map_err(err::<E>(src.1, "verify"))
                })
                .await?;
                let last = (rows.len() as u64 == chunk)
                    .then(|| rows.last().map(model_pk_values::<E>))
                    .flatten();
                // The target's rows in the same key range, in pages of
                // `chunk` (the target may hold many rows of its own there),
                // keeping those of the moving buckets.
                let mut theirs: Vec<E::Model> = Vec::new();
                let mut page_after = after.clone();
                loop {
                    let page = bounded(<E::Group as EntityGroup>::NAME, step, dst.1, async {
                        keyset::by_pk(
                            E::find()
                                .filter(keyset::after_condition::<E>(page_after.as_deref()))
                                .filter(keyset::upto_condition::<E>(last.as_deref())),
                        )
                        .limit(chunk)
                        .all(dst.0)
                        .await
                        .map_err(err::<E>(dst.1, "verify"))
                    })
                    .await?;
                    let more = page.len() as u64 == chunk;
                    page_after = page.last().map(model_pk_values::<E>);
                    theirs.extend(page.into_iter().filter(|m| buckets.holds(&E::shard_key(m))));
                    if !more {
                        break;
                    }
                }
                let mine: std::collections::BTreeMap<String, (String, Vec<Value>)> = rows
                    .iter()
                    .filter(|m| buckets.holds(&E::shard_key(m)))
                    .map(|m| {
                        (
                            tuple_text(&model_pk_values::<E>(m)),
                            (
                                E::shard_key(m).to_directory_text(),
                                crate::key::model_values::<E>(m),
                            ),
                        )
                    })
                    .collect();
                out.rows += mine.len() as u64;
                let mut seen = 0;
                for m in theirs.iter().filter(|m| buckets.holds(&E::shard_key(m))) {
                    let pk = tuple_text(&model_pk_values::<E>(m));
                    match mine.get(&pk) {
                        Some((_, values)) if *values == crate::key::model_values::<E>(m) => {
                            seen += 1
                        }
                        Some((key, _)) => {
                            seen += 1;
                            out.keys.push(key.clone());
                        }
                        None => out.keys.push(E::shard_key(m).to_directory_text()),
                    }
                }
                if seen < mine.len() {
                    let there: std::collections::HashSet<String> = theirs
                        .iter()
                        .map(|m| tuple_text(&model_pk_values::<E>(m)))
                        .collect();
                    out.keys.extend(
                        mine.iter()
                            .filter(|(pk, _)| !there.contains(*pk))
                            .map(|(_, (key, _))| key.clone()),
                    );
                }
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

fn parse_pk<E: ShardedEntity>(text: &str) -> Vec<Value> {
    keyset::parse_cursor::<E>(Some(&format!("0:{text}")))
        .1
        .unwrap_or_default()
}
