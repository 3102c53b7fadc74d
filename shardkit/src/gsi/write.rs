//! The write path of index rows: claims (unique indexes take over a
//! dangling row older than the grace period), index-first writes from a
//! shard transaction, and removals after the owner's commit.

use crate::entity::{EntityGroup, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::quoted;
use crate::gsi::{Durability, Gsi, IndexDef, Removal, gsi_err};
use crate::key::value_text;
use crate::read::{KeyOf, exact_eq, key_condition};
use crate::topology::ShardId;
use sea_orm::sea_query::{
    Alias, Expr, OnConflict, PostgresQueryBuilder, Query, QueryStatementWriter,
};
use sea_orm::{
    ConnectionTrait, DbBackend, DbErr, ExprTrait, QueryFilter, Statement, StatementBuilder, Value,
};
use std::time::Instant;

impl Gsi {
    /// Whether the owner row of an index entry exists: a row of shard key
    /// `key` whose indexed column holds `value`.
    pub(super) async fn owner_alive<E: ShardedEntity>(
        &self,
        index: &IndexDef,
        key: &str,
        value: &Value,
    ) -> Result<bool> {
        let Some(key) = KeyOf::<E>::from_directory_text(key) else {
            return Ok(false);
        };
        let target = self.shards.route::<E::Group>(&key).await?;
        // The side pool: claims check owners from inside a transaction.
        let (db, shard) = (
            self.shards.side_conn(target.shard),
            self.shards.shard_name(target.shard),
        );
        let owner = E::find()
            .filter(key_condition::<E>(
                std::slice::from_ref(&key),
                db.get_database_backend(),
            ))
            .filter(exact_eq(
                Expr::col((E::default(), Alias::new(index.column))),
                value,
                db.get_database_backend(),
            ))
            .one(db)
            .await
            .map_err(|e| {
                gsi_err(
                    shard,
                    table_name::<E>(),
                    format!("check owner in {}", table_name::<E>()),
                    e,
                )
            })?;
        Ok(owner.is_some())
    }

    /// Writes (idempotently) the index row `value → key/owner`, committing it
    /// on its own before the primary write. A unique index refuses a value a
    /// live owner holds, and takes over a dangling row older than the grace
    /// period.
    pub(crate) async fn write_entry<E: ShardedEntity>(
        &self,
        index: &IndexDef,
        raw_value: &Value,
        key: &str,
        owner: &str,
    ) -> Result<()> {
        self.write_entry_from::<E>(index, raw_value, key, owner, None)
            .await
    }

    /// [`write_entry`](Self::write_entry) from inside a shard transaction:
    /// an index row that lives on the transaction's own shard is written
    /// through it (it then commits atomically with the primary row, which is
    /// stronger than index-first, and SQLite's single writer is not asked
    /// for a second write lock it would wait on forever).
    pub(crate) async fn write_entry_from<E: ShardedEntity>(
        &self,
        index: &IndexDef,
        raw_value: &Value,
        key: &str,
        owner: &str,
        local: Option<(ShardId, &sea_orm::DatabaseTransaction)>,
    ) -> Result<()> {
        let Some(value) = value_text(raw_value) else {
            return Ok(());
        };
        check_len(index, &value)?;
        let id = self.index_shard(<E::Group as EntityGroup>::NAME, index, &value)?;
        match local {
            Some((local_id, txn)) if local_id == id => {
                self.write_on::<E, _>(
                    txn,
                    Durability::OwnerTxn,
                    self.shards.shard_name(id),
                    index,
                    raw_value,
                    &value,
                    key,
                    owner,
                )
                .await
            }
            _ => {
                // Relaxed only ahead of an owner's commit on the same WAL;
                // backfill and reconcile (no owner transaction) flush.
                let durability = match local {
                    Some((owner_shard, _))
                        if self.state.relaxed
                            && self.shards.same_pg_server(owner_shard, id).await =>
                    {
                        Durability::Relaxed
                    }
                    _ => Durability::Flushed,
                };
                // The side pool: the caller may hold a connection of the
                // main pools (see `Cluster::side_conn`).
                let (db, shard) = (self.shards.side_conn(id), self.shards.shard_name(id));
                self.write_on::<E, _>(db, durability, shard, index, raw_value, &value, key, owner)
                    .await
            }
        }
    }

    /// Runs an autocommitted index write; `relaxed` (PostgreSQL only) sends
    /// it behind `SET LOCAL synchronous_commit = off` in one simple-protocol
    /// round trip, where the two statements form one implicit transaction, so
    /// the setting lasts for this write alone. Values are inlined by
    /// sea-query's PostgreSQL writer, which escapes them.
    pub(super) async fn execute_index_write<C, S>(
        &self,
        db: &C,
        shard: &str,
        stmt: &S,
        relaxed: bool,
    ) -> std::result::Result<u64, DbErr>
    where
        C: ConnectionTrait,
        S: StatementBuilder + QueryStatementWriter,
    {
        if !relaxed {
            return db.execute(stmt).await.map(|r| r.rows_affected());
        }
        let sql = format!(
            "SET LOCAL synchronous_commit = off; {}",
            stmt.to_string(PostgresQueryBuilder)
        );
        let started = Instant::now();
        let res = db.execute_unprepared(&sql).await;
        self.shards.observe(
            shard,
            &Statement::from_string(DbBackend::Postgres, sql),
            started.elapsed(),
            res.is_err(),
        );
        res.map(|r| r.rows_affected())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn write_on<E: ShardedEntity, C: ConnectionTrait + crate::exec::BeginWrite>(
        &self,
        db: &C,
        durability: Durability,
        shard: &str,
        index: &IndexDef,
        raw_value: &Value,
        value: &str,
        key: &str,
        owner: &str,
    ) -> Result<()> {
        let err = |e| gsi_err(shard, &index.table, format!("write {}", index.table), e);
        if !index.unique {
            // Writing a row that exists bumps its version, so a removal
            // queued before (which deletes only the version it read) leaves
            // it in place.
            let bump = version_bump(
                db.get_database_backend(),
                &index.table,
                self.shards.now_ms(),
            );
            let insert = entry_insert(index, value, key, owner, self.shards.now_ms())
                .on_conflict(
                    OnConflict::columns(["value", "shard_key", "owner_pk"].map(Alias::new))
                        .value(Alias::new("created_ms"), Expr::cust(bump))
                        .to_owned(),
                )
                .to_owned();
            self.execute_index_write(db, shard, &insert, durability == Durability::Relaxed)
                .await
                .map_err(err)?;
            return Ok(());
        }
        if durability == Durability::OwnerTxn {
            // In the owner's transaction itself, without a savepoint: the
            // claim's statements never fail on a conflict (they upsert), and
            // a deadlock rolls back the whole transaction on MySQL/MariaDB,
            // savepoint included (sqlx would then fail the transaction's next
            // statement with `SAVEPOINT _sqlx_savepoint_1 does not exist`).
            // The caller makes the transaction rollback-only on such errors.
            return self
                .claim::<E, C>(
                    db,
                    shard,
                    index,
                    raw_value,
                    value,
                    key,
                    owner,
                    OwnerCheck::Inline,
                )
                .await;
        }
        // Fast path: the value is usually free, and one autocommitted INSERT
        // claims it. Only a conflict takes the checked path below.
        let insert = entry_insert(index, value, key, owner, self.shards.now_ms());
        match self
            .execute_index_write(db, shard, &insert, durability == Durability::Relaxed)
            .await
        {
            Ok(_) => return Ok(()),
            Err(e) if is_unique_violation(&e) => {}
            Err(e) => return Err(write_err(index, value, shard, e)),
        }
        // The checked claim in a transaction of its own, retried a few times
        // when the database aborts it (a deadlock among racing claims): no
        // one else's work is lost by running it again.
        let mut attempt = 1;
        loop {
            let holder = self
                .check_holder::<E, _>(db, shard, index, raw_value, value)
                .await?;
            let result = match crate::exec::BeginWrite::begin_for_write(db).await {
                Ok(txn) => match self
                    .claim::<E, _>(
                        &txn,
                        shard,
                        index,
                        raw_value,
                        value,
                        key,
                        owner,
                        OwnerCheck::Before(holder.as_ref()),
                    )
                    .await
                {
                    Ok(()) => txn.commit().await.map_err(err),
                    Err(e) => {
                        // The driver's rollback error adds nothing to the claim's.
                        let _ = txn.rollback().await;
                        Err(e)
                    }
                },
                Err(e) => Err(err(e)),
            };
            match result {
                Err(e)
                    if crate::error::again_after_abort(&e, false, attempt, CLAIM_ATTEMPTS)
                        .await =>
                {
                    tracing::debug!(index = %index.table, attempt, error = %e, "unique claim aborted by the database; retried");
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// The holder of unique `value`'s index row, read without a lock, and
    /// whether its owner row is alive: checked before a claim transaction
    /// takes a side connection, because checking the owner reads the owner's
    /// shard, and a side connection must never wait for another connection
    /// (see `Cluster::side_conn`).
    pub(super) async fn check_holder<E: ShardedEntity, C: ConnectionTrait>(
        &self,
        db: &C,
        shard: &str,
        index: &IndexDef,
        raw_value: &Value,
        value: &str,
    ) -> Result<Option<Holder>> {
        let err = |e| write_err(index, value, shard, e);
        let select = Query::select()
            .columns(["shard_key", "owner_pk", "created_ms"].map(Alias::new))
            .from(Alias::new(index.table.as_str()))
            .and_where(Expr::col(Alias::new("value")).eq(value))
            .to_owned();
        let Some(row) = db.query_one(&select).await.map_err(err)? else {
            return Ok(None);
        };
        let key: String = row.try_get("", "shard_key").map_err(err)?;
        let owner: String = row.try_get("", "owner_pk").map_err(err)?;
        let created: i64 = row.try_get("", "created_ms").map_err(err)?;
        // Only a row past the grace period can be taken over.
        let settled = self.shards.now_ms() - created >= self.state.grace.as_millis() as i64;
        let alive = !settled || self.owner_alive::<E>(index, &key, raw_value).await?;
        Ok(Some(Holder {
            key,
            owner,
            created,
            alive,
        }))
    }

    /// Claims unique `value` for `key`/`owner` through `conn` (the claim's
    /// own transaction, or the owner's): an upsert that inserts the row, or
    /// bumps its version when the row is already this owner's, and locks it
    /// either way; a row of another owner is then taken over when it is
    /// dangling (older than the grace period, its owner gone), or the claim
    /// is a [`ShardError::UniqueViolation`]. No statement fails on a
    /// conflict, so a PostgreSQL transaction stays usable after a refusal.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn claim<E: ShardedEntity, C: ConnectionTrait>(
        &self,
        conn: &C,
        shard: &str,
        index: &IndexDef,
        raw_value: &Value,
        value: &str,
        key: &str,
        owner: &str,
        check: OwnerCheck<'_>,
    ) -> Result<()> {
        let err = |e| write_err(index, value, shard, e);
        let backend = conn.get_database_backend();
        let stamp = self.shards.now_ms();
        let bump = version_bump(backend, &index.table, stamp);
        let table = quoted(backend, &index.table);
        let mut on_conflict = OnConflict::column(Alias::new("value"));
        if backend == DbBackend::MySql {
            // MySQL has no conditional upsert: the update leaves another
            // owner's row as it is (1 affected row, like an insert, since
            // sqlx asks for found rows) and bumps this owner's (2).
            on_conflict.value(
                Alias::new("created_ms"),
                Expr::cust(format!(
                    "IF({table}.`shard_key` = VALUES(`shard_key`) AND {table}.`owner_pk` = VALUES(`owner_pk`), {bump}, {table}.`created_ms`)"
                )),
            );
        } else {
            // Updates (and counts) only this owner's row; another owner's
            // row is locked all the same (PostgreSQL), or the transaction
            // holds SQLite's write lock.
            on_conflict
                .value(Alias::new("created_ms"), Expr::cust(bump.clone()))
                .action_and_where(Expr::cust(format!(
                    "{table}.\"shard_key\" = excluded.\"shard_key\" AND {table}.\"owner_pk\" = excluded.\"owner_pk\""
                )));
        }
        let mut upsert = Query::insert();
        upsert
            .into_table(Alias::new(index.table.as_str()))
            .columns(["value", "shard_key", "owner_pk", "created_ms"].map(Alias::new))
            .values_panic([value.into(), key.into(), owner.into(), stamp.into()])
            .on_conflict(on_conflict);
        // Tests: the claim of the value the failpoint's argument names
        // fails as a lost connection would.
        #[cfg(feature = "failpoints")]
        if fail::eval("shardkit::gsi::claim", |arg| arg)
            .is_some_and(|arg| arg.as_deref() == Some(value))
        {
            return Err(err(DbErr::Conn(sea_orm::RuntimeErr::SqlxError(
                std::sync::Arc::new(sea_orm::sqlx::Error::Io(std::io::Error::from(
                    std::io::ErrorKind::ConnectionReset,
                ))),
            ))));
        }
        let affected = conn.execute(&upsert).await.map_err(err)?.rows_affected();
        let ours = match backend {
            DbBackend::MySql => affected == 2,
            _ => affected == 1,
        };
        if ours {
            return Ok(());
        }
        let mut select = Query::select();
        select
            .columns(["shard_key", "owner_pk", "created_ms"].map(Alias::new))
            .from(Alias::new(index.table.as_str()))
            .and_where(Expr::col(Alias::new("value")).eq(value));
        if backend != DbBackend::Sqlite {
            select.lock_exclusive();
        }
        let row = conn.query_one(&select).await.map_err(err)?.ok_or_else(|| {
            err(DbErr::RecordNotFound(format!(
                "the index row the claim just locked in {}",
                index.table
            )))
        })?;
        let other_key: String = row.try_get("", "shard_key").map_err(err)?;
        let other_owner: String = row.try_get("", "owner_pk").map_err(err)?;
        let created: i64 = row.try_get("", "created_ms").map_err(err)?;
        if other_key == key && other_owner == owner {
            // MySQL: the upsert inserted it.
            return Ok(());
        }
        let alive = || async {
            match check {
                OwnerCheck::Inline => self.owner_alive::<E>(index, &other_key, raw_value).await,
                OwnerCheck::Before(Some(h))
                    if h.key == other_key && h.owner == other_owner && h.created == created =>
                {
                    Ok(h.alive)
                }
                // Changed since it was checked, so written within the grace
                // period: a claim in flight.
                OwnerCheck::Before(_) => Ok(true),
            }
        };
        if self.shards.now_ms() - created < self.state.grace.as_millis() as i64 || alive().await? {
            // A live owner, or a write still in flight: not ours to take.
            return Err(ShardError::UniqueViolation {
                index: index.table.clone(),
                value: value.to_owned(),
            });
        }
        let take = Query::update()
            .table(Alias::new(index.table.as_str()))
            .value(Alias::new("shard_key"), key)
            .value(Alias::new("owner_pk"), owner)
            .value(Alias::new("created_ms"), Expr::cust(bump))
            .and_where(Expr::col(Alias::new("value")).eq(value))
            .to_owned();
        conn.execute(&take).await.map_err(err)?;
        tracing::debug!(index = %index.table, "took over a dangling unique index row");
        Ok(())
    }

    /// The removal of index row `value → key/owner` as it stands now (its
    /// version), to run after the primary commits; `None` when there is no
    /// such row. Read before the owner's commit, under the owner's row lock:
    /// a later write of the same value by the same owner (which can only
    /// follow this commit) bumps the version, and the removal then leaves
    /// the row alone. An index row on the owner's own shard is read through
    /// `local` (the owner's transaction), not a second connection. When the
    /// row cannot be read the removal is skipped: a dangling row, which
    /// lookups ignore and [`reconcile`](Self::reconcile) removes.
    pub(crate) async fn removal<E: ShardedEntity>(
        &self,
        index: &IndexDef,
        value: &Value,
        key: &str,
        owner: &str,
        local: Option<(ShardId, &sea_orm::DatabaseTransaction)>,
    ) -> Result<Option<Removal>> {
        let Some(value) = value_text(value) else {
            return Ok(None);
        };
        if value.chars().count() > MAX_VALUE_CHARS {
            return Ok(None); // never indexed
        }
        let id = self.index_shard(<E::Group as EntityGroup>::NAME, index, &value)?;
        let stmt = Query::select()
            .column(Alias::new("created_ms"))
            .from(Alias::new(index.table.as_str()))
            .and_where(Expr::col(Alias::new("value")).eq(value.as_str()))
            .and_where(Expr::col(Alias::new("shard_key")).eq(key))
            .and_where(Expr::col(Alias::new("owner_pk")).eq(owner))
            .to_owned();
        // The side pool: the owner's transaction holds a main connection.
        let (db, shard) = (self.shards.side_conn(id), self.shards.shard_name(id));
        let found = match local {
            Some((local_id, txn)) if local_id == id => txn.query_one(&stmt).await,
            _ => db.query_one(&stmt).await,
        };
        let version = match found
            .and_then(|row| row.map(|r| r.try_get::<i64>("", "created_ms")).transpose())
        {
            Ok(Some(version)) => version,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::warn!(index = %index.table, shard, error = %e, "index row version unknown: left for reconciliation");
                return Ok(None);
            }
        };
        Ok(Some(Removal {
            shard: id,
            index: index.clone(),
            value,
            key: key.to_owned(),
            owner: owner.to_owned(),
            version,
        }))
    }

    /// Removes an index row if it is still the version the removal read
    /// (compare-and-delete; idempotent).
    pub(crate) async fn remove_entry(&self, removal: &Removal) -> Result<u64> {
        let (db, shard) = (
            self.shards.side_conn(removal.shard),
            self.shards.shard_name(removal.shard),
        );
        let delete = Query::delete()
            .from_table(Alias::new(removal.index.table.as_str()))
            .and_where(Expr::col(Alias::new("value")).eq(removal.value.as_str()))
            .and_where(Expr::col(Alias::new("shard_key")).eq(removal.key.as_str()))
            .and_where(Expr::col(Alias::new("owner_pk")).eq(removal.owner.as_str()))
            .and_where(Expr::col(Alias::new("created_ms")).eq(removal.version))
            .to_owned();
        // After the owner's commit: losing a removal in a crash leaves a
        // dangling row, so it need not wait for a flush.
        let relaxed = self.state.relaxed && db.get_database_backend() == DbBackend::Postgres;
        self.execute_index_write(db, shard, &delete, relaxed)
            .await
            .map_err(|e| {
                gsi_err(
                    shard,
                    &removal.index.table,
                    format!("remove from {}", removal.index.table),
                    e,
                )
            })
    }
}

/// How a claim learns whether the owner of the index row it found is alive.
#[derive(Clone, Copy)]
pub(super) enum OwnerCheck<'a> {
    /// Read the owner's shard now (the claim runs in the owner's own
    /// transaction, which may wait for a side connection).
    Inline,
    /// Checked before the claim's side connection was taken; `None` when
    /// there was no row then.
    Before(Option<&'a Holder>),
}

/// An index row's holder and whether its owner row was alive.
pub(super) struct Holder {
    key: String,
    owner: String,
    created: i64,
    alive: bool,
}

pub(super) fn entry_insert(
    index: &IndexDef,
    value: &str,
    key: &str,
    owner: &str,
    now_ms: i64,
) -> sea_orm::sea_query::InsertStatement {
    Query::insert()
        .into_table(Alias::new(index.table.as_str()))
        .columns(["value", "shard_key", "owner_pk", "created_ms"].map(Alias::new))
        .values_panic([value.into(), key.into(), owner.into(), now_ms.into()])
        .to_owned()
}

/// The longest value a global index holds, in characters (the index
/// tables' `value` column; checked before any I/O on every backend).
pub const MAX_VALUE_CHARS: usize = 255;

/// Refuses, before any I/O, a value longer than an index holds (a database
/// would refuse it too, or on MySQL without strict mode cut it short, and
/// SQLite would store it whole), quoting only its start.
pub(super) fn check_len(index: &IndexDef, value: &str) -> Result<()> {
    let chars = value.chars().count();
    if chars > MAX_VALUE_CHARS {
        return Err(ShardError::IndexValueTooLong {
            index: index.table.clone(),
            chars,
            max: MAX_VALUE_CHARS,
            prefix: value.chars().take(crate::error::QUOTED_CHARS).collect(),
        });
    }
    Ok(())
}

/// How many times a unique claim runs when the database aborts it.
pub(super) const CLAIM_ATTEMPTS: u32 = 5;

pub(super) use crate::error::is_unique_violation;

/// An index write's failure: a duplicate only when the database says so by
/// its unique-violation code; anything else (a deadlock, a lost connection)
/// is the database error, which [`ShardError::retry`] classifies.
pub(super) fn write_err(index: &IndexDef, value: &str, shard: &str, e: DbErr) -> ShardError {
    if is_unique_violation(&e) {
        ShardError::UniqueViolation {
            index: index.table.clone(),
            value: value.to_owned(),
        }
    } else {
        gsi_err(shard, &index.table, format!("write {}", index.table), e)
    }
}

/// The SQL of an index row's next version when it is written again: later
/// than any version it had (so a removal that read an earlier one misses
/// it), and `stamp` (now) when that is later still.
pub(super) fn version_bump(backend: DbBackend, table: &str, stamp: i64) -> String {
    let created = format!(
        "{}.{}",
        quoted(backend, table),
        quoted(backend, "created_ms")
    );
    format!("CASE WHEN {created} >= {stamp} THEN {created} + 1 ELSE {stamp} END")
}
