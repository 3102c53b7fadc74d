//! The statements behind reference tables: the versions, a write on the
//! source, applying a write to a copy, and a copy's catch-up from a
//! snapshot of the source (the source's rows against the copy's, row by
//! row: every value typed by the entity, none rebuilt from text).

use crate::entity::{ReferenceEntity, table_name};
use crate::error::{Origin, Result, ShardError, Subsystem, is_unique_violation};
use crate::key::{model_pk, tuple_text, value_text};
use crate::reference::state::{References, SOURCE};
use crate::topology::ShardId;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{
    ActiveModelTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, IntoActiveModel,
    IsolationLevel, Iterable, QueryFilter, TransactionTrait, Value,
};
use std::collections::BTreeMap;
use std::time::Duration;

pub(crate) const VERSIONS: &str = "shardkit_reference_versions";

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
    refs.copy_is(table, SOURCE, v);
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

/// Writes `changes` on the source as the next version of `E`'s table, in one
/// transaction; returns the version.
pub(super) async fn write_source<E>(refs: &References, changes: &[Change<E>]) -> Result<i64>
where
    E: ReferenceEntity,
{
    let table = table_name::<E>();
    let shards = refs.shards();
    let name = shards.shard_name(SOURCE);
    let db = shards.shard_conn(SOURCE);
    let err = |op: &'static str| move |e| db_err(name, table, op, e);
    // Under the source's breaker and the timeout, as the write is.
    let ensure = || async {
        let ensure = async {
            ensure_row(db, table)
                .await
                .map_err(err("create the version of"))
        };
        shards
            .bounded(SOURCE, "reference", refs.bulk_bound(), ensure)
            .await
    };
    if refs.copy(table, SOURCE) == 0 {
        ensure().await?;
    }
    let mut attempt = 0;
    loop {
        attempt += 1;
        // `Ok(Err(_))`: refused by a copy's version, or a copy's error,
        // which is not the source's (its breaker does not count it).
        let write = async {
            let txn = crate::exec::begin_pooled(db).await.map_err(err("begin"))?;
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
                // No version row: the source lost it since this instance
                // last wrote (an empty database put in its place).
                return Ok(Err(None));
            }
            let version = version_of(&txn, table)
                .await
                .map_err(err("read the version of"))?;
            // The table's first version, whatever this instance last saw of
            // the source (another may have written since it was replaced):
            // taken only while no copy has one. (The version row's lock,
            // held meanwhile, keeps other writers of the table waiting.)
            if version == 1
                && let Err(e) = no_copy_ahead::<E>(refs).await
            {
                return Ok(Err(Some(e)));
            }
            for change in changes {
                apply_source::<E, _>(&txn, change)
                    .await
                    .map_err(|e| match e {
                        Applied::Refused(reason) => refused::<E>(reason),
                        Applied::Db(e) => db_err(name, table, "write", e),
                    })?;
            }
            txn.commit().await.map_err(err("commit a write of"))?;
            Ok(Ok(version))
        };
        // A write of many rows is not a read: bounded as a catch-up is.
        match shards
            .bounded(SOURCE, "reference", refs.bulk_bound(), write)
            .await
        {
            Ok(Ok(version)) => {
                refs.copy_is(table, SOURCE, version);
                refs.saw(table, version);
                return Ok(version);
            }
            Ok(Err(Some(refused))) => return Err(refused),
            Ok(Err(None)) if attempt < 5 => ensure().await?,
            Ok(Err(None)) => {
                return Err(ShardError::internal(format!(
                    "reference table `{table}` has no version row on its source `{name}`"
                )));
            }
            // Only a transaction the database aborted (rolled back for
            // sure) is written again: after a timeout or a lost connection
            // the commit may have happened.
            Err(e) if attempt < 5 && e.retry() == crate::Retry::Transaction => {
                tracing::debug!(table, attempt, error = %e.report(), "reference write aborted; writing it again");
            }
            Err(e) => return Err(e),
        }
    }
}

/// A source without a version of `E`'s table takes its first write only
/// while no copy has a version: a source replaced by an empty database
/// (its version row lost) would otherwise be at version 1 with the one
/// written row, and every copy would follow it back, deleting the rest.
/// A copy that cannot be read refuses the write too (it may be ahead).
async fn no_copy_ahead<E: ReferenceEntity>(refs: &References) -> Result<()> {
    let table = table_name::<E>();
    let shards = refs.shards();
    let timeout = shards.read_settings().timeout;
    let count = shards.topology().shards().len() as u32;
    let reads = (1..count).map(ShardId).map(|shard| async move {
        let name = shards.shard_name(shard);
        let read = async {
            version_of(shards.shard_conn(shard), table)
                .await
                .map_err(|e| db_err(name, VERSIONS, "read", e))
        };
        (
            name,
            shards.bounded(shard, "reference", timeout, read).await,
        )
    });
    for (name, version) in futures::future::join_all(reads).await {
        let version = version?;
        if version > 0 {
            return Err(refused::<E>(format!(
                "its source `{}` has no version of the table while the copy on `{name}` is at \
                 {version}: a source replaced by an empty database takes no write (every copy \
                 would be set back to its rows); restore the source's table and its row in \
                 {VERSIONS}",
                shards.shard_name(SOURCE)
            )));
        }
    }
    Ok(())
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
    let rows = Rows::Changes(changes);
    let bound = refs.shards().read_settings().timeout;
    if apply_version::<E>(refs, shard, version - 1, version, rows, bound).await? {
        Ok(version)
    } else {
        catch_up::<E>(refs, shard, bound).await
    }
}

/// What [`apply_version`] writes on a copy.
pub(super) enum Rows<'a, E: ReferenceEntity> {
    /// One version's changes, on a copy at the version before.
    Changes(&'a [Change<E>]),
    /// Every row of the source at the version (a catch-up, a repair).
    Snapshot(&'a [E::Model]),
}

/// Each row's values as text, by primary key (as text): what copies are
/// compared by.
pub(super) fn texts<E: EntityTrait>(rows: &[E::Model]) -> BTreeMap<String, Vec<Option<String>>> {
    rows.iter()
        .map(|r| {
            let values: Vec<Option<String>> = <E::Column as Iterable>::iter()
                .map(|c| value_text(&sea_orm::ModelTrait::get(r, c)))
                .collect();
            (model_pk::<E>(r), values)
        })
        .collect()
}

/// Makes `db`'s copy hold exactly `rows`: the rows that are missing or
/// differ written over (in primary-key order), then the rows the source
/// does not have deleted, each by its own typed primary key (never the
/// whole table: rows of the shard's own tables may reference these; and
/// never a row before the writes, whose delete could cascade to rows a
/// write was about to point elsewhere). Returns the rows changed.
///
/// All in one savepoint first. When a unique or foreign-key constraint
/// refuses a change for now (a unique value another row holds until its
/// own change, a parent row not written yet), that savepoint is rolled
/// back and each change gets one of its own: a refused change waits, the
/// waiting ones are tried again after each change that goes (the latest
/// first, so a chain of values passed along goes in one sweep), then in
/// rounds while a round changes something.
pub(super) async fn sync_rows<E>(
    db: &sea_orm::DatabaseTransaction,
    rows: &[E::Model],
) -> std::result::Result<u64, DbErr>
where
    E: ReferenceEntity,
{
    let here = E::find().all(db).await?;
    let have = texts::<E>(&here);
    let want = texts::<E>(rows);
    let changes: Vec<Sync<'_, E::Model>> = rows
        .iter()
        .filter(|row| {
            let pk = model_pk::<E>(row);
            have.get(&pk) != want.get(&pk)
        })
        .map(Sync::Write)
        .chain(
            here.iter()
                .filter(|row| !want.contains_key(&model_pk::<E>(row)))
                .map(|row| Sync::Delete(crate::key::model_pk_values::<E>(row))),
        )
        .collect();
    let all = db.begin().await?;
    let mut refused = None;
    for change in &changes {
        match change.apply::<E>(&all).await {
            Ok(()) => {}
            Err(e) if constraint_refused(&e) => {
                refused = Some(e);
                break;
            }
            Err(e) => return Err(e),
        }
    }
    if refused.is_none() {
        all.commit().await?;
        return Ok(changes.len() as u64);
    }
    all.rollback().await?;
    let mut changed = 0;
    let mut waiting: Vec<Sync<'_, E::Model>> = Vec::new();
    for change in changes {
        if !change.try_apply::<E>(db, &mut refused).await? {
            waiting.push(change);
            continue;
        }
        changed += 1;
        while let Some(next) = waiting.pop() {
            if !next.try_apply::<E>(db, &mut refused).await? {
                waiting.push(next);
                break;
            }
            changed += 1;
        }
    }
    while !waiting.is_empty() {
        let round = waiting.len();
        let mut still = Vec::new();
        for change in waiting {
            if change.try_apply::<E>(db, &mut refused).await? {
                changed += 1;
            } else {
                still.push(change);
            }
        }
        if still.len() == round {
            let last = refused.map(|e| e.to_string()).unwrap_or_default();
            return Err(DbErr::Custom(format!(
                "{round} change(s) refused by a constraint in every order (two rows swapping unique \
                 values, or a delete of a row the shard's own rows still reference); the last: {last}"
            )));
        }
        waiting = still;
    }
    Ok(changed)
}

/// One change [`sync_rows`] makes.
enum Sync<'a, M> {
    Write(&'a M),
    Delete(Vec<Value>),
}

impl<M: Clone> Sync<'_, M> {
    async fn apply<E>(&self, db: &sea_orm::DatabaseTransaction) -> std::result::Result<(), DbErr>
    where
        E: ReferenceEntity<Model = M>,
    {
        match self {
            Sync::Write(row) => crate::exec::keyset::upsert::<E, _>(db, (*row).clone()).await,
            Sync::Delete(pk) => E::delete_many()
                .filter(pk_condition::<E>(pk))
                .exec(db)
                .await
                .map(|_| ()),
        }
    }

    /// The change in a savepoint of its own: whether it went (a constraint
    /// that refuses it for now is left in `refused`).
    async fn try_apply<E>(
        &self,
        db: &sea_orm::DatabaseTransaction,
        refused: &mut Option<DbErr>,
    ) -> std::result::Result<bool, DbErr>
    where
        E: ReferenceEntity<Model = M>,
    {
        let savepoint = db.begin().await?;
        match self.apply::<E>(&savepoint).await {
            Ok(()) => {
                savepoint.commit().await?;
                Ok(true)
            }
            Err(e) if constraint_refused(&e) => {
                savepoint.rollback().await?;
                *refused = Some(e);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

/// Whether a constraint refused `err`'s statement (unique or foreign key):
/// another change of the same catch-up may lift it.
fn constraint_refused(err: &DbErr) -> bool {
    matches!(
        err.sql_err(),
        Some(
            sea_orm::SqlErr::UniqueConstraintViolation(_)
                | sea_orm::SqlErr::ForeignKeyConstraintViolation(_)
        )
    )
}

/// Refuses to copy `E`'s rows from the source `db` (named `name`) when its
/// table has a column the entity lacks: a migration ahead of this build
/// (a rolling deploy). A copy written from this entity's rows would hold
/// that column's default and count as the source's version; an instance
/// of a build whose entity has the column catches the copies up.
async fn known_columns<E: ReferenceEntity, C: ConnectionTrait>(db: &C, name: &str) -> Result<()> {
    use sea_orm::IdenStatic;
    let table = table_name::<E>();
    let backend = db.get_database_backend();
    let entity = E::default();
    let schema = sea_orm::EntityName::schema_name(&entity);
    let have = crate::exec::columns::table_columns(db, schema, table)
        .await
        .map_err(|e| db_err(name, table, "read the columns of", e))?;
    let known: std::collections::BTreeSet<String> = E::Column::iter()
        .map(|c| crate::exec::columns::named(backend, c.as_str()))
        .collect();
    let unknown: Vec<String> = have.difference(&known).map(|c| format!("`{c}`")).collect();
    if unknown.is_empty() {
        return Ok(());
    }
    Err(refused::<E>(format!(
        "the source `{name}` has column(s) {} that this instance's entity lacks (a migration \
         ahead of this build): its rows are not copied from here, as a copy would hold those \
         columns' defaults; an instance whose entity has them catches the copies up",
        unknown.join(", ")
    )))
}

/// The source at one moment: its version and its rows.
pub(super) struct Snapshot<M> {
    pub(super) version: i64,
    pub(super) rows: Vec<M>,
}

/// In one snapshot of the source: its version, and its rows unless the
/// version is `from` (the copy holds it already); within `bound`.
pub(super) async fn read_source<E: ReferenceEntity>(
    refs: &References,
    from: Option<i64>,
    bound: Option<Duration>,
) -> Result<Snapshot<E::Model>> {
    let table = table_name::<E>();
    let shards = refs.shards();
    let name = shards.shard_name(SOURCE);
    let db = shards.shard_conn(SOURCE);
    let err = |op: &'static str| move |e| db_err(name, table, op, e);
    let read = async {
        let isolation = (db.get_database_backend() != DbBackend::Sqlite)
            .then_some(IsolationLevel::RepeatableRead);
        let options = sea_orm::TransactionOptions {
            isolation_level: isolation,
            ..Default::default()
        };
        let txn = crate::exec::begin_pooled_with(db, options)
            .await
            .map_err(err("begin a snapshot of"))?;
        let version = version_of(&txn, table)
            .await
            .map_err(err("read the version of"))?;
        let rows = if Some(version) == from {
            Vec::new()
        } else {
            // In the snapshot's transaction: a second connection of the
            // pool, while this one is held, could wait for good.
            known_columns::<E, _>(&txn, name).await?;
            crate::exec::keyset::by_pk(E::find())
                .all(&txn)
                .await
                .map_err(err("read"))?
        };
        txn.commit().await.map_err(err("end a snapshot of"))?;
        Ok(Snapshot { version, rows })
    };
    shards.bounded(SOURCE, "reference", bound, read).await
}

/// Moves `shard`'s copy from version `from` to `version` and writes `rows`
/// there, in one transaction within `bound`, when the copy is still at
/// `from` (compare and set); false when it moved meanwhile.
pub(super) async fn apply_version<E: ReferenceEntity>(
    refs: &References,
    shard: ShardId,
    from: i64,
    version: i64,
    rows: Rows<'_, E>,
    bound: Option<Duration>,
) -> Result<bool> {
    let table = table_name::<E>();
    let shards = refs.shards();
    let name = shards.shard_name(shard);
    let db = shards.shard_conn(shard);
    let err = |op: &'static str| move |e| db_err(name, table, op, e);
    // A copy at version 0 may lack its version row. One from a later
    // version has it, or the compare below fails and the catch-up finds
    // the copy at 0.
    let apply = async {
        if from == 0 {
            ensure_row(db, table)
                .await
                .map_err(err("create the version of"))?;
        }
        let txn = crate::exec::begin_pooled(db).await.map_err(err("begin"))?;
        if !move_version(&txn, table, from, version)
            .await
            .map_err(err("move the version of"))?
        {
            return Ok(false);
        }
        match rows {
            Rows::Snapshot(rows) => {
                sync_rows::<E>(&txn, rows).await.map_err(err("write"))?;
                // A copy whose primary key compares otherwise than by bytes
                // (a case-insensitive collation) takes two of the source's
                // keys for one row: a write of `USD` and a delete of `usd`
                // would leave neither. Such a copy is not moved on.
                let count = sea_orm::PaginatorTrait::count(E::find(), &txn)
                    .await
                    .map_err(err("count"))?;
                if count != rows.len() as u64 {
                    return Err(err("write")(DbErr::Custom(format!(
                        "the copy would hold {count} rows where the source holds {}: its primary \
                         key compares keys the source tells apart (a case- or accent-insensitive \
                         collation, or trailing spaces); give the copy's key the source's \
                         collation",
                        rows.len()
                    ))));
                }
            }
            Rows::Changes(changes) => {
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
            }
        }
        txn.commit().await.map_err(err("commit"))?;
        Ok(true)
    };
    let applied = shards.bounded(shard, "reference", bound, apply).await?;
    if applied {
        refs.copy_is(table, shard, version);
    }
    Ok(applied)
}

/// Brings `shard`'s copy of `E`'s table to the source's version (see the
/// module's docs), each step within `bound`; returns the copy's version.
pub(crate) async fn catch_up<E: ReferenceEntity>(
    refs: &References,
    shard: ShardId,
    bound: Option<Duration>,
) -> Result<i64> {
    let table = table_name::<E>();
    if shard == SOURCE {
        return source_version(refs, table).await;
    }
    let shards = refs.shards();
    let name = shards.shard_name(shard);
    let db = shards.shard_conn(shard);
    let err = |op: &'static str| move |e| db_err(name, table, op, e);
    for _ in 0..5 {
        let read = async {
            version_of(db, table)
                .await
                .map_err(err("read the version of"))
        };
        let from = shards.bounded(shard, "reference", bound, read).await?;
        refs.copy_is(table, shard, from);
        let source = read_source::<E>(refs, Some(from), bound).await?;
        if source.version == from {
            return Ok(from);
        }
        if source.version == 0 {
            // A source with no version of the table (a new, empty database
            // in its place, its version row lost) is not followed: setting
            // every copy back to it would delete every copy's rows.
            return Err(ShardError::Unavailable {
                shard: shards.shard_name(SOURCE).to_owned(),
                cause: format!(
                    "the source of reference table `{table}` has no version while the copy on \
                     {name} is at {from}: a source replaced by an empty database is not followed; \
                     restore the source's table and its row in shardkit_reference_versions"
                ),
            });
        }
        if source.version < from {
            // The source lost versions this copy has (restored to an
            // earlier point, or failed over to a replica behind it): the
            // copy follows the source back.
            tracing::warn!(
                table,
                shard = name,
                copy = from,
                source = source.version,
                "a reference copy is ahead of its source: set back to the source's rows and version"
            );
        }
        if apply_version::<E>(
            refs,
            shard,
            from,
            source.version,
            Rows::Snapshot(&source.rows),
            bound,
        )
        .await?
        {
            tracing::debug!(
                table,
                shard = name,
                from,
                to = source.version,
                "reference copy caught up"
            );
            return Ok(source.version);
        }
    }
    Err(ShardError::Unavailable {
        shard: name.to_owned(),
        cause: format!(
            "the copy of reference table `{table}` kept changing under its catch-up (other writers); it is caught up later"
        ),
    })
}
