//! The global-index handle ([`Gsi`]), index definitions, states and their cache.

use crate::entity::{EntityGroup, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::read::IndexQuery;
use crate::topology::ShardId;
use crate::topology::pghash::partition_hash_bytes;
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, DbErr, IdenStatic, Statement, Value,
};
use std::collections::HashMap;
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
    pub(super) fn as_str(self) -> &'static str {
        match self {
            IndexState::WriteOnly => "write_only",
            IndexState::Active => "active",
        }
    }
}

/// `write_only` or `active`, as the catalog stores it.
impl std::fmt::Display for IndexState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
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
    /// Whether the pass went through every index and shard (false when it
    /// was cancelled through its [`JobControl`](crate::JobControl); a pass
    /// saves no position, so the next one starts over).
    pub finished: bool,
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
pub(super) const RECONCILE_CHUNK: u64 = 500;

/// The prefix of a keyset backfill position in the catalog.
pub(super) const BACKFILL_CURSOR: &str = "pk/";

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
    /// run was cancelled through its [`JobControl`](crate::JobControl); call
    /// again to resume).
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

/// The table of every index's state.
pub(super) const CATALOG_TABLE: &str = "shardkit_gsi_catalog";

pub(super) fn gsi_err(shard: &str, table: &str, operation: String, source: DbErr) -> ShardError {
    // A deployment step was skipped: say which call makes the table.
    let operation = if crate::error::is_missing_table(&source) {
        // Which table is missing, from the driver's message (only the hint
        // depends on it).
        let said = source.to_string();
        let hint = if said.contains("shardkit_") {
            "a table of shardkit's is missing: run `cluster.migrate` with a migrator that \
             includes `shardkit::migration::migrations()`"
        } else if said.contains("gsi_") {
            "the index table is missing: create the entity's global indexes once, after \
             `cluster.migrate`, with `cluster.setup::<YourEntity>()` or \
             `cluster.gsi().create::<YourEntity>()`"
        } else {
            "a table is missing: run `cluster.migrate` with your migrator on every shard"
        };
        format!("{operation} ({hint})")
    } else {
        operation
    };
    ShardError::db(
        crate::error::Origin::table(crate::error::Subsystem::Gsi, table),
        shard.to_owned(),
        operation,
        source,
    )
}

/// The index a read or write of `query` uses.
pub(super) fn index_of(query: &IndexQuery) -> IndexDef {
    IndexDef {
        table: format!("gsi_{}_{}", query.entity, query.column),
        column: query.column,
        unique: query.unique,
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

/// The GSI service of a cluster: `cluster.gsi()`. A handle: owned, cheap
/// to clone, and usable after the `Cluster` value it came from is dropped
/// (while another clone of the cluster keeps its pools open).
#[derive(Clone)]
pub struct Gsi {
    pub(super) shards: Shards,
    pub(super) state: Arc<GsiState>,
}

impl std::fmt::Debug for Gsi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gsi")
            .field("relaxed_commit", &self.state.relaxed)
            .finish_non_exhaustive()
    }
}

/// A cluster's global-index settings (`[gsi]`) and cached index states.
pub(crate) struct GsiState {
    pub(super) states: StateCache,
    pub(super) grace: Duration,
    pins: HashMap<String, ShardId>,
    /// `[gsi] relaxed_commit`.
    pub(super) relaxed: bool,
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
pub(super) enum Durability {
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
pub(super) async fn mysql_exact_collation(
    db: &DatabaseConnection,
    shard: &str,
) -> Result<&'static str> {
    shardkit_migration::mysql_exact_collation(db)
        .await
        .map_err(|e| {
            gsi_err(
                shard,
                "information_schema.COLLATIONS",
                "read collations".into(),
                e,
            )
        })?
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
pub(super) async fn convert_to_collation(
    db: &DatabaseConnection,
    shard: &str,
    table: &str,
    collation: &str,
) -> Result<()> {
    let err = |e| gsi_err(shard, table, format!("convert {table} to {collation}"), e);
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
pub(crate) struct StateCache(pub(super) Mutex<HashMap<String, (IndexState, Instant)>>);

pub(super) const STATE_TTL: Duration = Duration::from_secs(1);

impl Gsi {
    pub(crate) fn new(shards: &Shards, state: &Arc<GsiState>) -> Self {
        Gsi {
            shards: shards.clone(),
            state: Arc::clone(state),
        }
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

    pub(super) fn conn(&self, id: ShardId) -> (&DatabaseConnection, &str) {
        (self.shards.shard_conn(id), self.shards.shard_name(id))
    }

    /// The shards index tables live on (the configured ones).
    pub(super) fn group_shards(&self, group: &'static str) -> Result<Vec<ShardId>> {
        Ok(self.shards.topology().shards_of(group)?.to_vec())
    }

    /// The shards owner rows may be on (with those a bucket move added).
    pub(super) fn owner_shards(&self, group: &'static str) -> Result<Vec<ShardId>> {
        self.shards.topology().scatter_shards(group)
    }
}
