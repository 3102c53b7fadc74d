//! Global secondary indexes (PayPal's GSI, Vitess's `consistent_lookup`).
//!
//! A field marked `#[shardkit(global_index)]` (or `global_index(unique)`) gets
//! an index table `gsi_<table>_<column>` on every shard of its group: the
//! secondary value, the owner's shard key and primary key (as text), and when
//! the row was written. An index row lives on the shard its *value* hashes to
//! (PostgreSQL's text hash over the group's shards), so there is no single
//! index database to lose.
//!
//! **Index first.** On insert the index row commits before the primary row's
//! transaction (or, when it lives on the owner's own shard, atomically with
//! it, in the same transaction); on an update of an indexed column the new index row commits
//! first and the old one is removed after the primary commits; on delete the
//! index row is removed after the primary commits. A failure in between leaves
//! a *dangling* index row, never a primary row without one. Lookups verify the
//! owner (the read filters on the indexed column), so a dangling or stale row
//! never yields a wrong row, and [`Gsi::reconcile`] removes dangling rows older
//! than a grace period.
//!
//! **Durability.** An index row on another shard commits on its own, so an
//! insert pays two durable commits. When that shard is a database of the same
//! PostgreSQL server as the owner's (one WAL), the index row commits with
//! `synchronous_commit = off`: its commit record precedes the owner's in the
//! WAL, and the owner's flushed commit flushes everything before it, so a
//! committed owner never loses its index row in a crash; what a crash can lose
//! is an index row whose owner did not commit — a dangling row, as after any
//! failed insert. Across servers, and on SQLite and MySQL/MariaDB, every index
//! row commits flushed. `[gsi] relaxed_commit = false` turns this off. Removals
//! (after the owner's commit) are relaxed on any PostgreSQL shard: losing one
//! leaves a dangling row.
//!
//! A catalog (`shardkit_gsi_catalog`, on every shard of the group) records each
//! index and its state: `write_only` while [`Gsi::backfill`] fills it
//! (lookups fall back to a scatter read), `active` after.

use crate::entity::{EntityGroup, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, Retry, ShardError};
use crate::exec::Shards;
use crate::exec::keyset;
pub(crate) use crate::key::{active_pk as owner_pk, model_pk, typed_value, value_text};
use crate::pipeline::{WriteCtx, WriteOp, WriteStage, Written};
use crate::read::{IndexLookup, IndexQuery, KeyOf, exact_eq, key_condition};
use crate::topology::ShardId;
use crate::topology::pghash::partition_hash_bytes;
use sea_orm::sea_query::{
    Alias, Expr, OnConflict, PostgresQueryBuilder, Query, QueryStatementWriter,
};
use sea_orm::{
    ActiveModelTrait, ActiveValue, ConnectionTrait, DatabaseConnection, DbBackend, DbErr,
    ExprTrait, IdenStatic, ModelTrait, QueryFilter, Statement, StatementBuilder,
    TransactionSession, TransactionTrait, Value,
};
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Whether lookups may use an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexState {
    /// Written on every write, not yet complete: lookups scatter.
    WriteOnly,
    /// Complete: lookups use it.
    Active,
}

impl IndexState {
    fn as_str(self) -> &'static str {
        match self {
            IndexState::WriteOnly => "write_only",
            IndexState::Active => "active",
        }
    }
}

/// What [`Gsi::reconcile`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Index rows examined.
    pub scanned: u64,
    /// Dangling index rows removed.
    pub removed: u64,
    /// Index rows added for owners that had none.
    pub added: u64,
    /// Owners without an index row whose value a unique index already lists
    /// for another live row: two rows hold one unique value, which shardkit
    /// cannot settle for the application. The pass goes on past them.
    pub conflicts: Vec<ReconcileConflict>,
}

/// A row whose unique value another live row already holds in the index
/// ([`ReconcileReport::conflicts`]).
#[derive(Clone, PartialEq, Eq)]
pub struct ReconcileConflict {
    /// The index table.
    pub index: String,
    /// The value both rows hold.
    pub value: String,
    /// The shard key of the row left without an index row.
    pub key: String,
    /// Its primary key (as text).
    pub owner: String,
}

impl std::fmt::Debug for ReconcileConflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReconcileConflict")
            .field("index", &self.index)
            .field("value", &crate::error::Bounded(&self.value))
            .field("key", &self.key)
            .field("owner", &self.owner)
            .finish()
    }
}

/// Rows per chunk of a reconcile scan.
const RECONCILE_CHUNK: u64 = 500;

/// The prefix of a keyset backfill position in the catalog.
const BACKFILL_CURSOR: &str = "pk/";

/// Progress of a [`Gsi::backfill`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackfillProgress {
    /// Primary rows read so far.
    pub rows: u64,
    /// Index rows written so far.
    pub written: u64,
    /// Shards finished.
    pub shards_done: usize,
    /// Shards in all.
    pub shards: usize,
    /// Whether the index is complete and now `active` (false when the
    /// callback stopped the run; call again to resume).
    pub finished: bool,
}

/// One index of one entity.
#[derive(Clone, Debug)]
pub(crate) struct IndexDef {
    pub(crate) table: String,
    pub(crate) column: &'static str,
    pub(crate) unique: bool,
}

impl IndexDef {
    pub(crate) fn of<E: ShardedEntity>(column: E::Column, unique: bool) -> Self {
        let column = column.as_str();
        index_of(&IndexQuery {
            group: <E::Group as EntityGroup>::NAME,
            entity: table_name::<E>(),
            column,
            unique,
        })
    }

    /// The index of `column`, if `E` declares one.
    pub(crate) fn find<E: ShardedEntity>(column: E::Column) -> Result<Self> {
        E::GLOBAL_INDEXES
            .iter()
            .find(|(c, _)| c.as_str() == column.as_str())
            .map(|(c, unique)| IndexDef::of::<E>(*c, *unique))
            .ok_or_else(|| {
                ShardError::config(
                    format!("{}.{}", table_name::<E>(), column.as_str()),
                    "no global index on this column: add `#[shardkit(global_index)]` to the field",
                )
            })
    }
}

fn gsi_err(shard: &str, operation: String, source: DbErr) -> ShardError {
    ShardError::Db {
        group: "gsi",
        shard: shard.to_owned(),
        operation,
        source,
    }
}

/// An index row to remove after the primary transaction commits.
#[derive(Clone, Debug)]
pub(crate) struct Removal {
    pub(crate) shard: ShardId,
    pub(crate) index: IndexDef,
    pub(crate) value: String,
    pub(crate) key: String,
    pub(crate) owner: String,
    /// The row's `created_ms` when the removal was decided: its version.
    pub(crate) version: i64,
}

/// The GSI service of a cluster: `cluster.gsi()`.
pub struct Gsi<'c> {
    shards: &'c Shards,
    state: &'c Arc<GsiState>,
}

/// A cluster's global-index settings (`[gsi]`) and cached index states.
pub(crate) struct GsiState {
    states: StateCache,
    grace: Duration,
    pins: HashMap<String, ShardId>,
    /// `[gsi] relaxed_commit`.
    relaxed: bool,
}

impl GsiState {
    pub(crate) fn new(
        config: &crate::topology::ClusterConfig,
        topology: &crate::topology::Topology,
    ) -> Self {
        GsiState {
            states: StateCache::default(),
            grace: Duration::from_millis(config.gsi.grace_ms.unwrap_or(30_000)),
            pins: config
                .gsi
                .pin
                .iter()
                .filter_map(|(index, shard)| Some((index.clone(), topology.shard_id(shard)?)))
                .collect(),
            relaxed: config.gsi.relaxed_commit.unwrap_or(true),
        }
    }
}

/// How an index row is made durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Durability {
    /// Written in the owner's own transaction (same shard): commits with it.
    OwnerTxn,
    /// Its own commit, flushed before it returns.
    Flushed,
    /// Its own commit, not waiting for the WAL flush (PostgreSQL
    /// `synchronous_commit = off`); see the module docs for when it is safe.
    Relaxed,
}

/// The binary NO PAD collation index tables use on a MySQL/MariaDB shard, so
/// values compare byte for byte (`a@x`, `A@X` and `a@x ` are three values):
/// `utf8mb4_nopad_bin` on MariaDB, `utf8mb4_0900_bin` on MySQL 8.
async fn mysql_exact_collation(db: &DatabaseConnection, shard: &str) -> Result<&'static str> {
    const CANDIDATES: [&str; 2] = ["utf8mb4_nopad_bin", "utf8mb4_0900_bin"];
    let stmt = Statement::from_sql_and_values(
        DbBackend::MySql,
        "SELECT COLLATION_NAME AS name FROM information_schema.COLLATIONS \
         WHERE COLLATION_NAME IN (?, ?)",
        CANDIDATES.map(Value::from),
    );
    let rows = db
        .query_all_raw(stmt)
        .await
        .map_err(|e| gsi_err(shard, "read collations".into(), e))?;
    let names: Vec<String> = rows
        .iter()
        .filter_map(|r| r.try_get::<String>("", "name").ok())
        .collect();
    CANDIDATES
        .into_iter()
        .find(|c| names.iter().any(|n| n == c))
        .ok_or_else(|| {
            ShardError::config(
                format!("shards ({shard})"),
                "global indexes on MySQL/MariaDB need a binary NO PAD collation \
                 (utf8mb4_nopad_bin on MariaDB 10.2+, utf8mb4_0900_bin on MySQL 8); \
                 this server has neither",
            )
        })
}

/// Converts an index table made before index values compared exactly (its
/// text columns in the server's default, case- and trailing-space-blind
/// collation) to `collation`. Rows are kept; owners whose values such a table
/// merged into one row get theirs back from [`Gsi::reconcile`].
async fn convert_to_collation(
    db: &DatabaseConnection,
    shard: &str,
    table: &str,
    collation: &str,
) -> Result<()> {
    let err = |e| gsi_err(shard, format!("convert {table} to {collation}"), e);
    let stmt = Statement::from_sql_and_values(
        DbBackend::MySql,
        "SELECT COUNT(*) AS n FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() \
         AND TABLE_NAME = ? AND COLUMN_NAME IN ('value', 'shard_key', 'owner_pk') \
         AND COLLATION_NAME <> ?",
        [Value::from(table), Value::from(collation)],
    );
    let stale: i64 = db
        .query_one_raw(stmt)
        .await
        .map_err(err)?
        .map(|r| r.try_get("", "n"))
        .transpose()
        .map_err(err)?
        .unwrap_or(0);
    if stale == 0 {
        return Ok(());
    }
    tracing::info!(
        shard,
        table,
        collation,
        "converting a global index table to exact comparison"
    );
    let column = |c: &str| {
        format!("MODIFY `{c}` VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL")
    };
    let sql = format!(
        "ALTER TABLE `{table}` {}, {}, {}",
        column("value"),
        column("shard_key"),
        column("owner_pk")
    );
    db.execute_unprepared(&sql).await.map_err(err)?;
    Ok(())
}

/// Cached index states, so writes and lookups do not read the catalog each time.
#[derive(Default)]
pub(crate) struct StateCache(Mutex<HashMap<String, (IndexState, Instant)>>);

const STATE_TTL: Duration = Duration::from_secs(1);

impl<'c> Gsi<'c> {
    pub(crate) fn new(shards: &'c Shards, state: &'c Arc<GsiState>) -> Self {
        Gsi { shards, state }
    }

    /// The shard an index row for `value` lives on: the value's hash over the
    /// group's shards, or the shard the config pins the index to.
    pub(crate) fn index_shard(
        &self,
        group: &'static str,
        index: &IndexDef,
        value: &str,
    ) -> Result<ShardId> {
        if let Some(pinned) = self.state.pins.get(&index.table).copied() {
            return Ok(pinned);
        }
        let shards = self.shards.topology().shards_of(group)?;
        let hash = partition_hash_bytes(value.as_bytes());
        Ok(shards[(hash % shards.len() as u64) as usize])
    }

    fn conn(&self, id: ShardId) -> (&'c DatabaseConnection, &'c str) {
        (self.shards.shard_conn(id), self.shards.shard_name(id))
    }

    fn group_shards(&self, group: &'static str) -> Result<Vec<ShardId>> {
        Ok(self.shards.topology().shards_of(group)?.to_vec())
    }

    /// Creates the index tables of `E` on every shard of its group and
    /// registers them in the catalog as `write_only` (unless already there).
    pub async fn create<E: ShardedEntity>(&self) -> Result<()> {
        for id in self.group_shards(<E::Group as EntityGroup>::NAME)? {
            let (db, shard) = self.conn(id);
            let collation = match db.get_database_backend() {
                DbBackend::MySql => Some(mysql_exact_collation(db, shard).await?),
                _ => None,
            };
            for (column, unique) in E::GLOBAL_INDEXES {
                let index = IndexDef::of::<E>(*column, *unique);
                db.execute(&shardkit_migration::gsi_table_collated(
                    &index.table,
                    index.unique,
                    collation,
                ))
                .await
                .map_err(|e| gsi_err(shard, format!("create {}", index.table), e))?;
                if let Some(collation) = collation {
                    convert_to_collation(db, shard, &index.table, collation).await?;
                }
                let insert = Query::insert()
                    .into_table(Alias::new("shardkit_gsi_catalog"))
                    .columns(
                        [
                            "name",
                            "primary_table",
                            "gsi_table",
                            "secondary_column",
                            "shard_key_column",
                            "is_unique",
                            "state",
                        ]
                        .map(Alias::new),
                    )
                    .values_panic([
                        index.table.clone().into(),
                        table_name::<E>().into(),
                        index.table.clone().into(),
                        index.column.into(),
                        E::SHARD_KEY_FIELD.into(),
                        index.unique.into(),
                        IndexState::WriteOnly.as_str().into(),
                    ])
                    .on_conflict(
                        OnConflict::column(Alias::new("name"))
                            .update_column(Alias::new("primary_table"))
                            .to_owned(),
                    )
                    .to_owned();
                db.execute(&insert)
                    .await
                    .map_err(|e| gsi_err(shard, format!("register {}", index.table), e))?;
            }
        }
        Ok(())
    }

    /// The state of `E`'s index on `column`.
    pub async fn state<E: ShardedEntity>(&self, column: E::Column) -> Result<IndexState> {
        let index = IndexDef::find::<E>(column)?;
        self.state_of(<E::Group as EntityGroup>::NAME, &index).await
    }

    pub(crate) async fn state_of(
        &self,
        group: &'static str,
        index: &IndexDef,
    ) -> Result<IndexState> {
        if let Some((state, at)) = self
            .state
            .states
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&index.table)
            && at.elapsed() < STATE_TTL
        {
            return Ok(*state);
        }
        let state = match self.catalog(group, index, "state").await? {
            Some(Some(s)) if s == "active" => IndexState::Active,
            Some(_) => IndexState::WriteOnly,
            None => {
                return Err(ShardError::config(
                    index.table.clone(),
                    "the index is not in the catalog: run `cluster.gsi().create::<E>()` (and backfill)",
                ));
            }
        };
        self.state
            .states
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(index.table.clone(), (state, Instant::now()));
        Ok(state)
    }

    async fn set_state<E: ShardedEntity>(
        &self,
        index: &IndexDef,
        state: IndexState,
        progress: Option<String>,
    ) -> Result<()> {
        for id in self.group_shards(<E::Group as EntityGroup>::NAME)? {
            let (db, shard) = self.conn(id);
            let stmt = Query::update()
                .table(Alias::new("shardkit_gsi_catalog"))
                .value(Alias::new("state"), state.as_str())
                .value(Alias::new("progress"), progress.clone())
                .and_where(Expr::col(Alias::new("name")).eq(index.table.as_str()))
                .to_owned();
            db.execute(&stmt)
                .await
                .map_err(|e| gsi_err(shard, "update gsi catalog".into(), e))?;
        }
        self.state
            .states
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&index.table);
        Ok(())
    }

    async fn progress<E: ShardedEntity>(&self, index: &IndexDef) -> Result<Option<String>> {
        Ok(self
            .catalog(<E::Group as EntityGroup>::NAME, index, "progress")
            .await?
            .flatten())
    }

    /// One column of an index's catalog row: `None` when the index is not
    /// registered, `Some(None)` when the column is NULL.
    async fn catalog(
        &self,
        group: &'static str,
        index: &IndexDef,
        column: &str,
    ) -> Result<Option<Option<String>>> {
        let id = self.group_shards(group)?[0];
        let (db, shard) = self.conn(id);
        let stmt = Query::select()
            .column(Alias::new(column))
            .from(Alias::new("shardkit_gsi_catalog"))
            .and_where(Expr::col(Alias::new("name")).eq(index.table.as_str()))
            .to_owned();
        let row = db
            .query_one(&stmt)
            .await
            .map_err(|e| gsi_err(shard, "read gsi catalog".into(), e))?;
        row.map(|r| r.try_get::<Option<String>>("", column))
            .transpose()
            .map_err(|e| gsi_err(shard, "read gsi catalog".into(), e))
    }

    /// Whether the owner row of an index entry exists: a row of shard key
    /// `key` whose indexed column holds `value`.
    async fn owner_alive<E: ShardedEntity>(
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
            .map_err(|e| gsi_err(shard, format!("check owner in {}", table_name::<E>()), e))?;
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
    async fn execute_index_write<C, S>(
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
    async fn write_on<E: ShardedEntity, C: ConnectionTrait + TransactionTrait>(
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
        let err = |e| gsi_err(shard, format!("write {}", index.table), e);
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
            let result = match crate::exec::begin_write(db).await {
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
                Err(e) if attempt < CLAIM_ATTEMPTS && e.retry() == Retry::Transaction => {
                    tracing::debug!(index = %index.table, attempt, error = %e, "unique claim aborted by the database; retrying");
                    tokio::time::sleep(claim_backoff(attempt)).await;
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
    async fn check_holder<E: ShardedEntity, C: ConnectionTrait>(
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
    async fn claim<E: ShardedEntity, C: ConnectionTrait>(
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
        // Tests: the claim's statement fails as a lost connection would.
        fail::fail_point!("shardkit::gsi::claim", |_| Err(err(DbErr::Conn(
            sea_orm::RuntimeErr::SqlxError(std::sync::Arc::new(sea_orm::sqlx::Error::Io(
                std::io::Error::from(std::io::ErrorKind::ConnectionReset)
            )))
        ))));
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
            .map_err(|e| gsi_err(shard, format!("remove from {}", removal.index.table), e))
    }

    /// The shard keys an active index lists for `value`, or `None` while the
    /// index is `write_only` (the caller scatters).
    pub(crate) async fn lookup_texts(
        &self,
        group: &'static str,
        index: &IndexDef,
        value: &Value,
    ) -> Result<Option<Vec<String>>> {
        if self.state_of(group, index).await? != IndexState::Active {
            return Ok(None);
        }
        let Some(text) = value_text(value) else {
            return Ok(Some(Vec::new()));
        };
        if text.chars().count() > MAX_VALUE_CHARS {
            return Ok(Some(Vec::new())); // never indexed, so no row holds it
        }
        let id = self.index_shard(group, index, &text)?;
        let (db, shard) = self.conn(id);
        let stmt = Query::select()
            .column(Alias::new("shard_key"))
            .from(Alias::new(index.table.as_str()))
            .and_where(Expr::col(Alias::new("value")).eq(text.as_str()))
            .to_owned();
        let rows = db
            .query_all(&stmt)
            .await
            .map_err(|e| gsi_err(shard, format!("lookup in {}", index.table), e))?;
        let mut keys = Vec::with_capacity(rows.len());
        for row in rows {
            let text: String = row
                .try_get("", "shard_key")
                .map_err(|e| gsi_err(shard, format!("lookup in {}", index.table), e))?;
            keys.push(text);
        }
        Ok(Some(keys))
    }

    /// Fills `E`'s index on `column` from the primary tables, shard by shard in
    /// chunks, then marks it `active`. Resumable: progress is saved in the
    /// catalog after every chunk and a rerun continues from it (index writes
    /// are idempotent, so a repeated chunk is harmless).
    pub async fn backfill<E: ShardedEntity>(&self, column: E::Column) -> Result<BackfillProgress> {
        self.backfill_with::<E>(column, 500, |_| ControlFlow::Continue(()))
            .await
    }

    /// [`backfill`](Self::backfill) with a chunk size and a progress callback,
    /// called after every chunk and every shard. Returning
    /// `ControlFlow::Break(())` stops after the current chunk with the index
    /// still `write_only` (`finished: false`); the next call resumes there.
    pub async fn backfill_with<E: ShardedEntity>(
        &self,
        column: E::Column,
        chunk: u64,
        mut on_progress: impl FnMut(BackfillProgress) -> ControlFlow<()>,
    ) -> Result<BackfillProgress> {
        let index = IndexDef::find::<E>(column)?;
        let shards = self.group_shards(<E::Group as EntityGroup>::NAME)?;
        let chunk = Ord::max(chunk, 1);
        // Progress: "pk/<shard index>:<last primary key done on it>", a
        // keyset position (see `crate::exec::keyset`). An older "<shard>:<offset>"
        // restarts that shard from its start (index writes are idempotent).
        let (start_shard, mut after) = match self.progress::<E>(&index).await? {
            Some(p) => match p.strip_prefix(BACKFILL_CURSOR) {
                Some(cursor) => keyset::parse_cursor::<E>(Some(cursor)),
                None => (
                    p.split_once(':')
                        .and_then(|(a, _)| a.parse::<usize>().ok())
                        .unwrap_or(0),
                    None,
                ),
            },
            None => (0, None),
        };
        let mut progress = BackfillProgress {
            shards: shards.len(),
            shards_done: start_shard,
            ..Default::default()
        };
        for (i, id) in shards.iter().enumerate().skip(start_shard) {
            let (db, shard) = self.conn(*id);
            if i != start_shard {
                after = None;
            }
            loop {
                let rows = keyset::chunk::<E>(after.as_deref(), chunk)
                    .all(db)
                    .await
                    .map_err(|e| gsi_err(shard, format!("backfill {}", index.table), e))?;
                let read = rows.len() as u64;
                for row in &rows {
                    let value = row.get(column);
                    let key = E::shard_key(row).to_directory_text();
                    let owner = model_pk::<E>(row);
                    self.write_entry::<E>(&index, &value, &key, &owner).await?;
                    progress.written += u64::from(value_text(&value).is_some());
                }
                progress.rows += read;
                if let Some(last) = rows.last() {
                    after = Some(keyset::model_pk_values::<E>(last));
                }
                let cursor = keyset::format_cursor(i, after.as_deref());
                self.set_state::<E>(
                    &index,
                    IndexState::WriteOnly,
                    Some(format!("{BACKFILL_CURSOR}{cursor}")),
                )
                .await?;
                if on_progress(progress).is_break() {
                    return Ok(progress);
                }
                if read < chunk {
                    break;
                }
            }
            progress.shards_done = i + 1;
            if on_progress(progress).is_break() && i + 1 < shards.len() {
                return Ok(progress);
            }
        }
        self.set_state::<E>(&index, IndexState::Active, None)
            .await?;
        progress.finished = true;
        Ok(progress)
    }

    /// Removes dangling index rows of `E` older than the grace period and adds
    /// index rows for owners that have none. Run it periodically
    /// ([`reconcile_every`](Self::reconcile_every)).
    pub async fn reconcile<E: ShardedEntity>(&self) -> Result<ReconcileReport> {
        let grace = self.state.grace.as_millis() as i64;
        let mut report = ReconcileReport::default();
        for (column, unique) in E::GLOBAL_INDEXES {
            let index = IndexDef::of::<E>(*column, *unique);
            for id in self.group_shards(<E::Group as EntityGroup>::NAME)? {
                let (db, shard) = self.conn(id);
                let err = |e| gsi_err(shard, format!("reconcile {}", index.table), e);
                let mut after: Vec<Value> = Vec::new();
                let mut dangling = Vec::new();
                const COLUMNS: [&str; 3] = ["value", "shard_key", "owner_pk"];
                loop {
                    let stmt = Query::select()
                        .columns(["value", "shard_key", "owner_pk", "created_ms"].map(Alias::new))
                        .from(Alias::new(index.table.as_str()))
                        .cond_where(keyset::after_columns(&COLUMNS, &after))
                        .order_by(Alias::new("value"), sea_orm::Order::Asc)
                        .order_by(Alias::new("shard_key"), sea_orm::Order::Asc)
                        .order_by(Alias::new("owner_pk"), sea_orm::Order::Asc)
                        .limit(RECONCILE_CHUNK)
                        .to_owned();
                    let rows = db.query_all(&stmt).await.map_err(err)?;
                    for row in &rows {
                        report.scanned += 1;
                        let value: String = row.try_get("", "value").map_err(err)?;
                        let key: String = row.try_get("", "shard_key").map_err(err)?;
                        let owner: String = row.try_get("", "owner_pk").map_err(err)?;
                        let created: i64 = row.try_get("", "created_ms").map_err(err)?;
                        after = vec![
                            value.clone().into(),
                            key.clone().into(),
                            owner.clone().into(),
                        ];
                        if self.shards.now_ms() - created < grace {
                            continue; // an insert may still be in flight
                        }
                        let typed = typed_value::<E>(*column, &value);
                        if !self.owner_alive::<E>(&index, &key, &typed).await? {
                            dangling.push(Removal {
                                shard: id,
                                index: index.clone(),
                                value,
                                key,
                                owner,
                                version: created,
                            });
                        }
                    }
                    if (rows.len() as u64) < RECONCILE_CHUNK {
                        break;
                    }
                }
                for removal in &dangling {
                    report.removed += self.remove_entry(removal).await?;
                }
            }
            // Owners without an index row.
            for id in self.group_shards(<E::Group as EntityGroup>::NAME)? {
                let (db, shard) = self.conn(id);
                let mut after: Option<Vec<Value>> = None;
                loop {
                    let rows = keyset::chunk::<E>(after.as_deref(), RECONCILE_CHUNK)
                        .all(db)
                        .await
                        .map_err(|e| gsi_err(shard, format!("reconcile {}", index.table), e))?;
                    if let Some(last) = rows.last() {
                        after = Some(keyset::model_pk_values::<E>(last));
                    }
                    let read = rows.len() as u64;
                    for row in rows {
                        let value = row.get(*column);
                        let Some(text) = value_text(&value) else {
                            continue;
                        };
                        let key = E::shard_key(&row).to_directory_text();
                        if !self.entry_exists::<E>(&index, &text, &key).await? {
                            let owner = model_pk::<E>(&row);
                            match self.write_entry::<E>(&index, &value, &key, &owner).await {
                                Ok(()) => report.added += 1,
                                // Another live owner holds the value: two rows
                                // claim one unique value. Report it and go on.
                                Err(ShardError::UniqueViolation { .. }) => {
                                    report.conflicts.push(ReconcileConflict {
                                        index: index.table.clone(),
                                        value: text,
                                        key,
                                        owner,
                                    });
                                }
                                Err(e) => return Err(e),
                            }
                        }
                    }
                    if read < RECONCILE_CHUNK {
                        break;
                    }
                }
            }
        }
        Ok(report)
    }

    async fn entry_exists<E: ShardedEntity>(
        &self,
        index: &IndexDef,
        value: &str,
        key: &str,
    ) -> Result<bool> {
        let id = self.index_shard(<E::Group as EntityGroup>::NAME, index, value)?;
        let (db, shard) = self.conn(id);
        let stmt = Query::select()
            .expr(Expr::val(1))
            .from(Alias::new(index.table.as_str()))
            .and_where(Expr::col(Alias::new("value")).eq(value))
            .and_where(Expr::col(Alias::new("shard_key")).eq(key))
            .to_owned();
        Ok(db
            .query_one(&stmt)
            .await
            .map_err(|e| gsi_err(shard, format!("check {}", index.table), e))?
            .is_some())
    }

    /// Runs [`reconcile`](Self::reconcile) every `interval` (the first pass at
    /// once) until the handle is aborted or the cluster is dropped (the task
    /// does not keep the cluster alive); each pass's report (or error) is
    /// logged.
    pub fn reconcile_every<E: ShardedEntity>(
        &self,
        interval: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let state = Arc::clone(self.state);
        crate::exec::periodic::spawn(
            self.shards,
            interval,
            crate::exec::periodic::FirstPass::Now,
            move |shards: Shards| {
                let state = Arc::clone(&state);
                async move {
                    match Gsi::new(&shards, &state).reconcile::<E>().await {
                        Ok(report) => tracing::info!(
                            table = table_name::<E>(),
                            scanned = report.scanned,
                            removed = report.removed,
                            added = report.added,
                            conflicts = report.conflicts.len(),
                            "gsi reconcile"
                        ),
                        Err(err) => {
                            tracing::warn!(table = table_name::<E>(), error = %err, "gsi reconcile failed")
                        }
                    }
                    ControlFlow::Continue(())
                }
            },
        )
    }
}

/// How a claim learns whether the owner of the index row it found is alive.
#[derive(Clone, Copy)]
enum OwnerCheck<'a> {
    /// Read the owner's shard now (the claim runs in the owner's own
    /// transaction, which may wait for a side connection).
    Inline,
    /// Checked before the claim's side connection was taken; `None` when
    /// there was no row then.
    Before(Option<&'a Holder>),
}

/// An index row's holder and whether its owner row was alive.
struct Holder {
    key: String,
    owner: String,
    created: i64,
    alive: bool,
}

fn entry_insert(
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
fn check_len(index: &IndexDef, value: &str) -> Result<()> {
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
const CLAIM_ATTEMPTS: u32 = 5;

/// A short, growing, jittered pause between claim attempts, so racing
/// claims do not collide again in lockstep.
fn claim_backoff(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    // A fresh random seed per call: jitter without a clock or an RNG crate.
    let jitter = std::hash::RandomState::new().build_hasher().finish() % 4_000_000;
    Duration::from_millis(2u64 << Ord::min(attempt, 6)) + Duration::from_nanos(jitter)
}

fn is_unique_violation(e: &DbErr) -> bool {
    matches!(
        e.sql_err(),
        Some(sea_orm::SqlErr::UniqueConstraintViolation(_))
    )
}

/// An index write's failure: a duplicate only when the database says so by
/// its unique-violation code; anything else (a deadlock, a lost connection)
/// is the database error, which [`ShardError::retry`] classifies.
fn write_err(index: &IndexDef, value: &str, shard: &str, e: DbErr) -> ShardError {
    if is_unique_violation(&e) {
        ShardError::UniqueViolation {
            index: index.table.clone(),
            value: value.to_owned(),
        }
    } else {
        gsi_err(shard, format!("write {}", index.table), e)
    }
}

/// An identifier quoted for `backend`.
fn quoted(backend: DbBackend, name: &str) -> String {
    match backend {
        DbBackend::MySql => format!("`{}`", name.replace('`', "``")),
        _ => format!("\"{}\"", name.replace('"', "\"\"")),
    }
}

/// The SQL of an index row's next version when it is written again: later
/// than any version it had (so a removal that read an earlier one misses
/// it), and `stamp` (now) when that is later still.
fn version_bump(backend: DbBackend, table: &str, stamp: i64) -> String {
    let created = format!(
        "{}.{}",
        quoted(backend, table),
        quoted(backend, "created_ms")
    );
    format!("CASE WHEN {created} >= {stamp} THEN {created} + 1 ELSE {stamp} END")
}

/// The write stage of global indexes (see [`crate::pipeline`]): an insert's
/// or update's index rows are written before the row (index-first), and an
/// update's or delete's replaced index rows are removed after the commit.
#[doc(hidden)]
pub struct IndexFirst {
    state: Arc<GsiState>,
}

impl IndexFirst {
    pub(crate) fn new(state: Arc<GsiState>) -> Self {
        IndexFirst { state }
    }

    /// Queues removal of `row`'s index rows for the indexes `changed`
    /// selects, after the commit, each as the version it has now.
    async fn queue_removals<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        row: &E::Model,
        changed: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let gsi = Gsi::new(ctx.shards, &self.state);
        let owner = model_pk::<E>(row);
        for (column, unique) in E::GLOBAL_INDEXES {
            if !changed(column.as_str()) {
                continue;
            }
            let index = IndexDef::of::<E>(*column, *unique);
            let removal = gsi
                .removal::<E>(
                    &index,
                    &row.get(*column),
                    ctx.key,
                    &owner,
                    Some((ctx.shard, ctx.txn)),
                )
                .await?;
            if let Some(removal) = removal {
                let shards = ctx.shards.for_task();
                let state = Arc::clone(&self.state);
                // Old index rows go only once the row's commit made them
                // stale; a failure leaves a dangling row, which lookups
                // ignore and reconciliation removes.
                ctx.defer(Box::pin(async move {
                    if let Err(err) = Gsi::new(&shards, &state).remove_entry(&removal).await {
                        tracing::warn!(index = %removal.index.table, error = %err, "index row left for reconciliation");
                    }
                }));
            }
        }
        Ok(())
    }
}

impl WriteStage for IndexFirst {
    fn needs_current<E: ShardedEntity>(&self, op: WriteOp) -> bool {
        op != WriteOp::Insert && !E::GLOBAL_INDEXES.is_empty()
    }

    /// Writes the index rows of `model`'s indexed values, each committed on
    /// its own before the primary write. For an update (`current` is the row
    /// as it is), only changed values are written, and the replaced rows are
    /// queued for removal after the commit.
    async fn before_write<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        op: WriteOp,
        model: &E::ActiveModel,
        current: Option<&E::Model>,
    ) -> Result<()> {
        if E::GLOBAL_INDEXES.is_empty() || (op == WriteOp::Update && current.is_none()) {
            return Ok(());
        }
        let owner = owner_pk(model);
        let gsi = Gsi::new(ctx.shards, &self.state);
        let mut changed = Vec::new();
        for (column, unique) in E::GLOBAL_INDEXES {
            let value = match (model.get(*column), current) {
                (ActiveValue::Set(v), _) | (ActiveValue::Unchanged(v), None) => v,
                _ => continue,
            };
            if let Some(current) = current {
                if value_text(&current.get(*column)) == value_text(&value) {
                    continue;
                }
                changed.push(column.as_str());
            }
            let index = IndexDef::of::<E>(*column, *unique);
            gsi.write_entry_from::<E>(&index, &value, ctx.key, &owner, Some((ctx.shard, ctx.txn)))
                .await?;
        }
        fail::fail_point!("shardkit::gsi::after_index_write", |_| Err(
            ShardError::Db {
                group: <E::Group as EntityGroup>::NAME,
                shard: ctx.shard_name.to_owned(),
                operation: format!("{} {}", op.as_str(), table_name::<E>()),
                source: DbErr::Custom("failpoint shardkit::gsi::after_index_write".into()),
            }
        ));
        if let Some(current) = current {
            self.queue_removals::<E>(ctx, current, |c| changed.contains(&c))
                .await?;
        }
        Ok(())
    }

    /// A deleted row's index rows go after the commit.
    async fn after_write<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        _op: WriteOp,
        written: Written<'_, E>,
    ) -> Result<()> {
        if let Written::Deleted {
            current: Some(current),
            rows: 1..,
            ..
        } = written
        {
            self.queue_removals::<E>(ctx, current, |_| true).await?;
        }
        Ok(())
    }
}

/// Planning's index step for reads ([`IndexLookup`]): the cluster hands it
/// to the reads it starts.
pub(crate) struct GsiLookup {
    state: Arc<GsiState>,
}

impl GsiLookup {
    pub(crate) fn new(state: Arc<GsiState>) -> Self {
        GsiLookup { state }
    }
}

fn index_of(query: &IndexQuery) -> IndexDef {
    IndexDef {
        table: format!("gsi_{}_{}", query.entity, query.column),
        column: query.column,
        unique: query.unique,
    }
}

impl IndexLookup for GsiLookup {
    fn table(&self, query: &IndexQuery) -> String {
        index_of(query).table
    }

    fn index_shard(&self, shards: &Shards, query: &IndexQuery, text: &str) -> Result<ShardId> {
        Gsi::new(shards, &self.state).index_shard(query.group, &index_of(query), text)
    }

    fn lookup<'a>(
        &'a self,
        shards: &'a Shards,
        query: &'a IndexQuery,
        value: &'a Value,
    ) -> futures::future::BoxFuture<'a, Result<Option<Vec<String>>>> {
        Box::pin(async move {
            Gsi::new(shards, &self.state)
                .lookup_texts(query.group, &index_of(query), value)
                .await
        })
    }
}
