//! The statements behind reference tables: the versions, a write on the
//! source with its log, applying a write to a copy, and a copy's catch-up
//! from a snapshot of the source.

use crate::entity::{ReferenceEntity, table_name};
use crate::error::{Origin, Result, ShardError, Subsystem, is_unique_violation};
use crate::key::{TUPLE_SEPARATOR, model_pk, tuple_text, typed_value};
use crate::reference::state::{References, SOURCE};
use crate::topology::ShardId;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{
    ActiveModelTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, IntoActiveModel,
    IsolationLevel, Iterable, PrimaryKeyToColumn, QueryFilter, TransactionTrait, Value,
};
use std::collections::BTreeSet;

pub(crate) const VERSIONS: &str = "shardkit_reference_versions";
pub(crate) const LOG: &str = "shardkit_reference_log";

/// The longest primary key (as text) a reference table's log keeps.
const MAX_PK_TEXT: usize = 500;
/// Past this many changed keys, a catch-up copies the whole table.
const MAX_DELTA: usize = 10_000;

/// One change of a reference write.
pub(crate) enum Change<E: EntityTrait> {
    /// A new row: refused when its primary key is there.
    Insert(E::Model),
    /// A row's new values: refused when its primary key is not there.
    Update(E::Model),
    /// A new row or a row's new values.
    Upsert(E::Model),
    /// The row of this primary key: refused when it is not there.
    Delete(Vec<Value>),
}

impl<E: EntityTrait> Change<E> {
    fn pk(&self) -> String {
        match self {
            Change::Insert(m) | Change::Update(m) | Change::Upsert(m) => model_pk::<E>(m),
            Change::Delete(pk) => tuple_text(pk),
        }
    }
}

pub(super) fn db_err(shard: &str, table: &str, operation: &str, source: DbErr) -> ShardError {
    ShardError::db(
        Origin::table(Subsystem::Reference, table),
        shard.to_owned(),
        format!("{operation} {table}"),
        source,
    )
}

/// The version `db`'s copy of `table` holds (0: none yet).
pub(crate) async fn version_of<C: ConnectionTrait>(
    db: &C,
    table: &str,
) -> std::result::Result<i64, DbErr> {
    let stmt = Query::select()
        .column(Alias::new("version"))
        .from(Alias::new(VERSIONS))
        .and_where(Expr::col(Alias::new("tbl")).eq(table))
        .to_owned();
    match db.query_one(&stmt).await? {
        Some(row) => row.try_get::<i64>("", "version"),
        None => Ok(0),
    }
}

/// The source's version of `table`.
pub(crate) async fn source_version(refs: &References, table: &'static str) -> Result<i64> {
    let shards = refs.shards();
    let name = shards.shard_name(SOURCE);
    let db = shards.shard_conn(SOURCE);
    let read = async {
        version_of(db, table)
            .await
            .map_err(|e| db_err(name, VERSIONS, "read", e))
    };
    let v = shards
        .bounded(SOURCE, "reference", shards.read_settings().timeout, read)
        .await?;
    refs.copy_at(table, SOURCE, v);
    Ok(v)
}

/// Makes sure `db` has `table`'s version row (at 0 when new).
async fn ensure_row<C: ConnectionTrait>(db: &C, table: &str) -> std::result::Result<(), DbErr> {
    let stmt = Query::insert()
        .into_table(Alias::new(VERSIONS))
        .columns([Alias::new("tbl"), Alias::new("version")])
        .values_panic([table.into(), 0i64.into()])
        .to_owned();
    match db.execute(&stmt).await {
        Ok(_) => Ok(()),
        Err(e) if is_unique_violation(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Moves `db`'s copy of `table` from version `from` to `to`; false when it
/// is not at `from`.
async fn move_version<C: ConnectionTrait>(
    db: &C,
    table: &str,
    from: i64,
    to: i64,
) -> std::result::Result<bool, DbErr> {
    let stmt = Query::update()
        .table(Alias::new(VERSIONS))
        .value(Alias::new("version"), to)
        .and_where(Expr::col(Alias::new("tbl")).eq(table))
        .and_where(Expr::col(Alias::new("version")).eq(from))
        .to_owned();
    Ok(db.execute(&stmt).await?.rows_affected() == 1)
}

fn refused<E: EntityTrait>(reason: String) -> ShardError {
    ShardError::Reference {
        table: table_name::<E>(),
        reason,
    }
}

fn pk_condition<E: EntityTrait>(pk: &[Value]) -> sea_orm::Condition {
    crate::exec::keyset::pk_condition::<E>(pk)
}

/// The primary key values of a row's text key.
fn parse_pk<E: EntityTrait>(text: &str) -> Vec<Value> {
    let columns: Vec<E::Column> = <E::PrimaryKey as Iterable>::iter()
        .map(PrimaryKeyToColumn::into_column)
        .collect();
    if columns.len() == 1 {
        return vec![typed_value::<E>(columns[0], text)];
    }
    columns
        .into_iter()
        .zip(text.split(TUPLE_SEPARATOR))
        .map(|(c, t)| typed_value::<E>(c, t))
        .collect()
}

/// Writes `changes` on the source as the next version of `E`'s table, with
/// the log of their keys, in one transaction; returns the version.
pub(super) async fn write_source<E>(refs: &References, changes: &[Change<E>]) -> Result<i64>
where
    E: ReferenceEntity,
{
    let table = table_name::<E>();
    let mut pks: Vec<String> = changes.iter().map(Change::pk).collect();
    if let Some(long) = pks.iter().find(|pk| pk.len() > MAX_PK_TEXT) {
        return Err(refused::<E>(format!(
            "the primary key `{}` is longer than the {MAX_PK_TEXT} characters the change log keeps",
            long.chars().take(40).collect::<String>()
        )));
    }
    pks.sort();
    pks.dedup();
    let shards = refs.shards();
    let name = shards.shard_name(SOURCE);
    let db = shards.shard_conn(SOURCE);
    let err = |op: &'static str| move |e| db_err(name, table, op, e);
    if refs.copy(table, SOURCE) == 0 {
        ensure_row(db, table)
            .await
            .map_err(err("create the version of"))?;
    }
    let mut attempt = 0;
    loop {
        attempt += 1;
        let write = async {
            let txn = crate::exec::begin_write(db).await.map_err(err("begin"))?;
            let bump = Query::update()
                .table(Alias::new(VERSIONS))
                .value(
                    Alias::new("version"),
                    Expr::col(Alias::new("version")).add(1),
                )
                .and_where(Expr::col(Alias::new("tbl")).eq(table))
                .to_owned();
            if txn
                .execute(&bump)
                .await
                .map_err(err("take a version of"))?
                .rows_affected()
                != 1
            {
                return Err(ShardError::internal(format!(
                    "reference table `{table}` has no version row on its source `{name}`"
                )));
            }
            let version = version_of(&txn, table)
                .await
                .map_err(err("read the version of"))?;
            for change in changes {
                apply_source::<E, _>(&txn, change)
                    .await
                    .map_err(|e| match e {
                        Applied::Refused(reason) => refused::<E>(reason),
                        Applied::Db(e) => db_err(name, table, "write", e),
                    })?;
            }
            for chunk in pks.chunks(200) {
                let mut insert = Query::insert();
                insert.into_table(Alias::new(LOG)).columns([
                    Alias::new("tbl"),
                    Alias::new("version"),
                    Alias::new("pk"),
                ]);
                for pk in chunk {
                    insert.values_panic([table.into(), version.into(), pk.clone().into()]);
                }
                txn.execute(&insert).await.map_err(err("log a change of"))?;
            }
            txn.commit().await.map_err(err("commit a write of"))?;
            Ok(version)
        };
        match shards
            .bounded(SOURCE, "reference", shards.read_settings().timeout, write)
            .await
        {
            Ok(version) => {
                refs.copy_at(table, SOURCE, version);
                refs.saw(table, version);
                return Ok(version);
            }
            Err(e)
                if attempt < 5
                    && matches!(e.retry(), crate::Retry::Transaction | crate::Retry::Now) =>
            {
                tracing::debug!(table, attempt, error = %e.report(), "reference write aborted; writing it again");
            }
            Err(e) => return Err(e),
        }
    }
}

enum Applied {
    Refused(String),
    Db(DbErr),
}

impl From<DbErr> for Applied {
    fn from(e: DbErr) -> Self {
        Applied::Db(e)
    }
}

/// One change on the source, refused when it does not fit what is there.
async fn apply_source<E, C>(db: &C, change: &Change<E>) -> std::result::Result<(), Applied>
where
    E: ReferenceEntity,
    C: ConnectionTrait,
{
    match change {
        Change::Insert(row) => {
            match E::insert(row.clone().into_active_model())
                .exec_without_returning(db)
                .await
            {
                Ok(_) => Ok(()),
                Err(e) if is_unique_violation(&e) => Err(Applied::Refused(format!(
                    "insert of primary key `{}`: the table has a row with that key (or another unique value of it); nothing was written",
                    model_pk::<E>(row)
                ))),
                Err(e) => Err(e.into()),
            }
        }
        Change::Update(row) => {
            let pk = crate::key::model_pk_values::<E>(row);
            let matched = E::update_many()
                .set(row.clone().into_active_model().reset_all())
                .filter(pk_condition::<E>(&pk))
                .exec(db)
                .await?
                .rows_affected;
            if matched == 0 {
                return Err(Applied::Refused(format!(
                    "update of primary key `{}`: the table has no such row; nothing was written",
                    tuple_text(&pk)
                )));
            }
            Ok(())
        }
        Change::Upsert(row) => Ok(crate::exec::keyset::upsert::<E, _>(db, row.clone()).await?),
        Change::Delete(pk) => {
            let deleted = E::delete_many()
                .filter(pk_condition::<E>(pk))
                .exec(db)
                .await?
                .rows_affected;
            if deleted == 0 {
                return Err(Applied::Refused(format!(
                    "delete of primary key `{}`: the table has no such row; nothing was written",
                    tuple_text(pk)
                )));
            }
            Ok(())
        }
    }
}

/// Applies version `version` (`changes`) to `shard`'s copy when it holds
/// the version before; otherwise catches the copy up. Returns the copy's
/// version.
pub(super) async fn push<E>(
    refs: &References,
    shard: ShardId,
    version: i64,
    changes: &[Change<E>],
) -> Result<i64>
where
    E: ReferenceEntity,
{
    let table = table_name::<E>();
    let shards = refs.shards();
    let name = shards.shard_name(shard);
    let db = shards.shard_conn(shard);
    let err = |op: &'static str| move |e| db_err(name, table, op, e);
    let fresh = refs.copy(table, shard) == 0;
    let apply = async {
        if fresh {
            ensure_row(db, table)
                .await
                .map_err(err("create the version of"))?;
        }
        let txn = crate::exec::begin_write(db).await.map_err(err("begin"))?;
        if !move_version(&txn, table, version - 1, version)
            .await
            .map_err(err("move the version of"))?
        {
            return Ok(false);
        }
        for change in changes {
            match change {
                Change::Insert(row) | Change::Update(row) | Change::Upsert(row) => {
                    crate::exec::keyset::upsert::<E, _>(&txn, row.clone())
                        .await
                        .map_err(err("write"))?;
                }
                Change::Delete(pk) => {
                    E::delete_many()
                        .filter(pk_condition::<E>(pk))
                        .exec(&txn)
                        .await
                        .map_err(err("delete from"))?;
                }
            }
        }
        txn.commit().await.map_err(err("commit"))?;
        Ok(true)
    };
    let applied = shards
        .bounded(shard, "reference", shards.read_settings().timeout, apply)
        .await?;
    if applied {
        refs.copy_at(table, shard, version);
        Ok(version)
    } else {
        catch_up::<E>(refs, shard).await
    }
}

/// Makes `db`'s copy hold exactly `rows`: each written over what is there,
/// then the rows the source does not have deleted (row by row, never the
/// whole table: rows of the shard's own tables may reference these).
pub(super) async fn replace_rows<E, C>(db: &C, rows: &[E::Model]) -> std::result::Result<(), DbErr>
where
    E: ReferenceEntity,
    C: ConnectionTrait,
{
    let keep: BTreeSet<String> = rows.iter().map(model_pk::<E>).collect();
    for row in rows {
        crate::exec::keyset::upsert::<E, _>(db, row.clone()).await?;
    }
    for row in E::find().all(db).await? {
        if !keep.contains(&model_pk::<E>(&row)) {
            E::delete_many()
                .filter(pk_condition::<E>(&crate::key::model_pk_values::<E>(&row)))
                .exec(db)
                .await?;
        }
    }
    Ok(())
}

/// Deletes the source's log of `table` up to version `upto` (what no copy
/// needs: every copy is known to hold `upto` or later).
pub(super) async fn prune_log(refs: &References, table: &'static str, upto: i64) -> Result<u64> {
    let shards = refs.shards();
    let name = shards.shard_name(SOURCE);
    let db = shards.shard_conn(SOURCE);
    let stmt = Query::delete()
        .from_table(Alias::new(LOG))
        .and_where(Expr::col(Alias::new("tbl")).eq(table))
        .and_where(Expr::col(Alias::new("version")).lte(upto))
        .to_owned();
    let prune = async {
        db.execute(&stmt)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| db_err(name, LOG, "prune", e))
    };
    shards
        .bounded(SOURCE, "reference", shards.read_settings().timeout, prune)
        .await
}

/// What a copy at version `from` takes to reach the source's version.
struct Delta<M> {
    version: i64,
    /// Every row (the copy is replaced), or only those of `keys`.
    whole: bool,
    keys: Vec<String>,
    rows: Vec<M>,
}

/// In one snapshot of the source: its version and, when it is past
/// `from`, the rows changed since (or every row).
async fn read_source<E: ReferenceEntity>(refs: &References, from: i64) -> Result<Delta<E::Model>> {
    let table = table_name::<E>();
    let shards = refs.shards();
    let name = shards.shard_name(SOURCE);
    let db = shards.shard_conn(SOURCE);
    let err = |op: &'static str| move |e| db_err(name, table, op, e);
    let read = async {
        let isolation = (db.get_database_backend() != DbBackend::Sqlite)
            .then_some(IsolationLevel::RepeatableRead);
        let txn = db
            .begin_with_config(isolation, None)
            .await
            .map_err(err("begin a snapshot of"))?;
        let version = version_of(&txn, table)
            .await
            .map_err(err("read the version of"))?;
        let mut delta = Delta {
            version,
            whole: from == 0,
            keys: Vec::new(),
            rows: Vec::new(),
        };
        if version <= from {
            txn.commit().await.map_err(err("end a snapshot of"))?;
            return Ok(delta);
        }
        if !delta.whole {
            // A log pruned past `from` cannot say what changed since: the
            // copy is written whole.
            let oldest = Query::select()
                .expr_as(Expr::col(Alias::new("version")).min(), Alias::new("oldest"))
                .from(Alias::new(LOG))
                .and_where(Expr::col(Alias::new("tbl")).eq(table))
                .to_owned();
            let oldest = match txn
                .query_one(&oldest)
                .await
                .map_err(err("read the log of"))?
            {
                Some(row) => row
                    .try_get::<Option<i64>>("", "oldest")
                    .map_err(err("read the log of"))?,
                None => None,
            };
            delta.whole = oldest.is_none_or(|o| o > from + 1);
        }
        if !delta.whole {
            let stmt = Query::select()
                .distinct()
                .column(Alias::new("pk"))
                .from(Alias::new(LOG))
                .and_where(Expr::col(Alias::new("tbl")).eq(table))
                .and_where(Expr::col(Alias::new("version")).gt(from))
                .and_where(Expr::col(Alias::new("version")).lte(version))
                .to_owned();
            let rows = txn.query_all(&stmt).await.map_err(err("read the log of"))?;
            delta.keys = rows
                .iter()
                .map(|r| r.try_get::<String>("", "pk"))
                .collect::<std::result::Result<_, _>>()
                .map_err(err("read the log of"))?;
            delta.whole = delta.keys.len() > MAX_DELTA;
        }
        if delta.whole {
            delta.keys.clear();
            delta.rows = E::find().all(&txn).await.map_err(err("read"))?;
        } else {
            for chunk in delta.keys.chunks(100) {
                let any = chunk.iter().fold(sea_orm::Condition::any(), |c, pk| {
                    c.add(pk_condition::<E>(&parse_pk::<E>(pk)))
                });
                delta
                    .rows
                    .extend(E::find().filter(any).all(&txn).await.map_err(err("read"))?);
            }
        }
        txn.commit().await.map_err(err("end a snapshot of"))?;
        Ok(delta)
    };
    shards
        .bounded(SOURCE, "reference", shards.read_settings().timeout, read)
        .await
}

/// Brings `shard`'s copy of `E`'s table to the source's version (see the
/// module's docs); returns the copy's version.
pub(crate) async fn catch_up<E: ReferenceEntity>(refs: &References, shard: ShardId) -> Result<i64> {
    let table = table_name::<E>();
    if shard == SOURCE {
        return source_version(refs, table).await;
    }
    let shards = refs.shards();
    let name = shards.shard_name(shard);
    let db = shards.shard_conn(shard);
    let err = |op: &'static str| move |e| db_err(name, table, op, e);
    let timeout = shards.read_settings().timeout;
    for _ in 0..5 {
        let read = async {
            version_of(db, table)
                .await
                .map_err(err("read the version of"))
        };
        let from = shards.bounded(shard, "reference", timeout, read).await?;
        refs.copy_at(table, shard, from);
        let delta = read_source::<E>(refs, from).await?;
        if delta.version <= from {
            return Ok(from);
        }
        let apply = async {
            if from == 0 {
                ensure_row(db, table)
                    .await
                    .map_err(err("create the version of"))?;
            }
            let txn = crate::exec::begin_write(db).await.map_err(err("begin"))?;
            if !move_version(&txn, table, from, delta.version)
                .await
                .map_err(err("move the version of"))?
            {
                return Ok(false);
            }
            if delta.whole {
                replace_rows::<E, _>(&txn, &delta.rows)
                    .await
                    .map_err(err("copy"))?;
            } else {
                let present: BTreeSet<String> = delta.rows.iter().map(model_pk::<E>).collect();
                for row in &delta.rows {
                    crate::exec::keyset::upsert::<E, _>(&txn, row.clone())
                        .await
                        .map_err(err("write"))?;
                }
                for pk in delta.keys.iter().filter(|k| !present.contains(*k)) {
                    E::delete_many()
                        .filter(pk_condition::<E>(&parse_pk::<E>(pk)))
                        .exec(&txn)
                        .await
                        .map_err(err("delete from"))?;
                }
            }
            txn.commit().await.map_err(err("commit"))?;
            Ok(true)
        };
        if shards.bounded(shard, "reference", timeout, apply).await? {
            refs.copy_at(table, shard, delta.version);
            tracing::debug!(
                table,
                shard = name,
                from,
                to = delta.version,
                "reference copy caught up"
            );
            return Ok(delta.version);
        }
    }
    Err(ShardError::Reference {
        table,
        reason: format!(
            "the copy on `{name}` kept changing under its catch-up; it is caught up later"
        ),
    })
}
