//! The cluster configuration as users write it (TOML), and its validation.
//!
//! ```toml
//! [[shards]]
//! name = "s0"
//! url = "sqlite://data/s0.db?mode=rwc"
//!
//! [[hosts]]                      # a physical server holding several shards
//! name = "pg1"
//! url = "postgres://app:secret@10.0.0.5:5432"
//!
//! [[shards]]
//! name = "s1"
//! host = "pg1"
//! database = "orders_1"
//!
//! [groups.Customer]              # one table per entity group
//! placement = "hash"             # hash (default) | range | modulo | directory
//! buckets = 1024                 # default 1024
//! bucket_ranges = [              # optional: default spreads buckets evenly
//!   { shard = "s0", first = 0,   last = 511 },
//!   { shard = "s1", first = 512, last = 1023 },
//! ]
//! ```

use crate::error::{Result, ShardError};
use crate::topology::url::{DatabaseUrl, redact_urls};
use serde::Deserialize;
use std::collections::BTreeMap;

/// The whole cluster: hosts, logical shards and one placement per entity group.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Physical database servers that several logical shards share. Optional:
    /// a shard may give its own `url` instead.
    #[serde(default)]
    pub hosts: Vec<HostConfig>,
    /// The logical shards, in order. A shard's position is its index in routing
    /// tables; its name is what the rest of the config refers to.
    pub shards: Vec<ShardConfig>,
    /// Placement of each entity group, keyed by the group's name
    /// (`EntityGroup::NAME`, the type's name unless `#[shardkit(name = ...)]`).
    #[serde(default)]
    pub groups: BTreeMap<String, GroupConfig>,
    /// Connection pool settings applied to every shard.
    #[serde(default)]
    pub pool: PoolConfig,
    /// Defaults for reads that span several shards.
    #[serde(default)]
    pub read: ReadConfig,
    /// Globally unique ids: ticket servers, sequences, snowflake worker.
    #[serde(default)]
    pub ids: IdsConfig,
    /// Global secondary indexes.
    #[serde(default)]
    pub gsi: GsiConfig,
    /// Bucket moves of `movable` groups.
    #[serde(default)]
    pub rebalance: RebalanceConfig,
}

/// `[rebalance]`: the live bucket map and bucket moves.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RebalanceConfig {
    /// Milliseconds between two reads of the bucket map's epoch by each
    /// instance (default 5,000; `0` reads it only at connect and when a
    /// shard's fence refuses a write).
    pub refresh_ms: Option<u64>,
    /// Milliseconds a cut-over waits for the moving buckets' in-flight
    /// write transactions before it gives up and tries again later
    /// (default 200; at least 1). Writes to the moving buckets wait at
    /// most this long, plus the final catch-up.
    pub cutover_wait_ms: Option<u64>,
    /// Milliseconds after a cut-over before the source's copies of the
    /// moved buckets are deleted (default 60,000): longer than any
    /// instance takes to refresh its map and finish a read it routed by
    /// the old one.
    pub cleanup_grace_ms: Option<u64>,
    /// Milliseconds one step of a mover (a run of copied chunks, a replay
    /// batch, a cleaning chunk) may take before the mover stops with
    /// [`ShardError::Timeout`](crate::ShardError::Timeout): a shard that
    /// hangs fails the move instead of holding it (default 60,000; 100 to
    /// 3,600,000). The move resumes where it stopped.
    pub step_timeout_ms: Option<u64>,
    /// Rows per copy chunk (default 20,000; 1 to 100,000). A chunk is read
    /// while the one before is written, so two are in memory at once.
    pub chunk: Option<u64>,
    /// Milliseconds a move waits for the moving tables' columns to agree
    /// between its sources, its target and its entities (a migration
    /// applied to some shards and not yet to others) before it copies and
    /// before it cuts over; past it the move stops with an error that names
    /// the table, the shard and the columns, and resumes when run again
    /// (default 60,000; 0 to 3,600,000).
    pub schema_wait_ms: Option<u64>,
}

/// `[gsi]`: global secondary index settings.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GsiConfig {
    /// Milliseconds an index row without an owner is left alone, because the
    /// insert that wrote it may still be in flight (default 30,000; 1,000 to
    /// 86,400,000). Applies to reconciliation and to unique-index takeover,
    /// so it must exceed the longest write transaction: a shorter grace lets
    /// a second row take a unique value whose first owner has not committed
    /// yet.
    pub grace_ms: Option<u64>,
    /// Indexes kept on one shard instead of spread by value hash, keyed by
    /// index table (`gsi_<table>_<column>`), e.g.
    /// `pin = { gsi_customers_email = "s0" }`.
    #[serde(default)]
    pub pin: BTreeMap<String, String>,
    /// Whether an index row whose shard is a database of the same PostgreSQL
    /// server as its owner's shard commits without waiting for its WAL flush
    /// (`synchronous_commit = off` for that one write; default `true`). Index
    /// first still holds: the owner's commit, flushed after it on the same
    /// WAL, flushes the index row too. Index rows on another server always
    /// commit flushed. Set `false` to flush every index row on its own.
    pub relaxed_commit: Option<bool>,
}

/// `[ids]`: where unique ids come from.
///
/// ```toml
/// [ids]
/// servers = [
///   { name = "tickets_a", url = "mysql://app:pw@10.0.0.7/tickets" },
///   { name = "tickets_b", url = "mysql://app:pw@10.0.0.8/tickets" },
/// ]
/// worker_id = 3                      # snowflake worker of this process
/// [ids.sequences.orders]
/// block = 1000                       # ids reserved per ticket (1 = Flickr)
/// ```
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdsConfig {
    /// Ticket servers. Server `i` of `n` hands out tickets `≡ i + 1 (mod n)`,
    /// so the servers never overlap and either can serve alone. The list is
    /// fixed once set up: each server records its place
    /// ([`Ids::record_places`](crate::ids::Ids::record_places)) and serves
    /// only a config that matches it. Keep a server that is down; it is
    /// skipped.
    #[serde(default)]
    pub servers: Vec<ShardConfig>,
    /// Per-sequence settings, keyed by sequence name (1-48 ASCII lowercase
    /// letters, digits and `_`); a sequence not listed uses the defaults.
    #[serde(default)]
    pub sequences: BTreeMap<String, SequenceConfig>,
    /// Milliseconds a failed ticket server is skipped before it is tried again
    /// (default 1000; at most 3,600,000, an hour).
    pub retry_after_ms: Option<u64>,
    /// Milliseconds one ticket request may take before the next server is
    /// tried (default 2000; 1 to 600,000).
    pub timeout_ms: Option<u64>,
    /// This process's snowflake worker id (default 0); it must fit in the
    /// layout's `worker_bits` (0 to 1023 with the default layout).
    pub worker_id: Option<u64>,
    /// Snowflake bit layout (default 41/10/12; the three sum to at most 63,
    /// with `time_bits` ≥ 30 and `sequence_bits` ≥ 1).
    pub snowflake: Option<SnowflakeConfig>,
}

/// One sequence's settings.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SequenceConfig {
    /// Ids per ticket (the block, B). Default 1000; 1 is Flickr's one ticket
    /// per id; at most 1,000,000,000 (ticket × block must stay an `i64` for
    /// billions of tickets).
    pub block: Option<u64>,
}

/// Snowflake layout: `time_bits + worker_bits + sequence_bits` ≤ 63.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnowflakeConfig {
    /// Milliseconds since the epoch (default 41: 69 years).
    pub time_bits: u8,
    /// Worker id bits (default 10).
    pub worker_bits: u8,
    /// Per-millisecond sequence bits (default 12: 4,096 ids/ms).
    pub sequence_bits: u8,
}

impl SnowflakeConfig {
    /// The layout it describes, checked.
    pub(crate) fn layout(&self) -> Result<crate::id_spec::SnowflakeLayout> {
        crate::id_spec::SnowflakeLayout::from_bits(
            self.time_bits,
            self.worker_bits,
            self.sequence_bits,
        )
    }
}

/// Defaults for multi-shard reads; each can be overridden per query.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadConfig {
    /// Milliseconds a shard may take to answer a read before it counts as
    /// failed and its query is cancelled (1 to 86,400,000, a day). No timeout
    /// when omitted.
    pub timeout_ms: Option<u64>,
    /// How many shards one read queries at once (default 16; 1 to 10,000),
    /// so a fan-out over hundreds of shards does not open hundreds of
    /// connections at once.
    pub max_concurrency: Option<usize>,
    /// Milliseconds a read with a session ([`Consistency::AtLeast`](crate::Consistency::AtLeast))
    /// waits for a replica to replay past the session's writes before it
    /// reads the shard itself instead (default 500; less when the read's
    /// timeout leaves less, see `replica_timeout_ms`).
    pub replica_wait_ms: Option<u64>,
    /// Milliseconds a replica may take to answer before the read goes to
    /// the shard itself and the replica leaves the rotation until its next
    /// good probe (default 1,000). A read with a timeout (`timeout_ms`, or
    /// the read's own) gives its replica at most half of that timeout, the
    /// session's wait included; a replica cut off by it goes on serving
    /// other reads.
    pub replica_timeout_ms: Option<u64>,
    /// Milliseconds between two measurements of each replica's lag
    /// (default 1,000).
    pub replica_probe_ms: Option<u64>,
}

/// A physical database server.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    /// Name shards use to refer to this host.
    pub name: String,
    /// Server URL without a database, e.g. `postgres://user:pw@10.0.0.5:5432`.
    pub url: DatabaseUrl,
}

/// A logical shard: one database.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardConfig {
    /// Unique shard name, used in placements, errors and traces.
    pub name: String,
    /// Full database URL. Give either this, or `host` and `database`.
    pub url: Option<DatabaseUrl>,
    /// Name of a `[[hosts]]` entry this shard's database lives on.
    pub host: Option<String>,
    /// Database name on `host`.
    pub database: Option<String>,
    /// Read replicas of this shard's database (PostgreSQL streaming
    /// replicas, MySQL/MariaDB replicas), which reads may use when they ask
    /// for it ([`Consistency`](crate::Consistency)); writes and transactions
    /// always go to the shard itself. None for a SQLite shard.
    #[serde(default)]
    pub replicas: Vec<ReplicaConfig>,
}

/// A read replica of a shard (`replicas = [{ name = "s0r1", url = "..." }]`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Unique among shards and replicas; used in metrics, errors and
    /// `shardctl status`.
    pub name: String,
    /// The replica's database URL (the same database name as its shard's).
    pub url: DatabaseUrl,
}

/// How a group's keys are placed on shards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlacementKind {
    /// PostgreSQL-compatible hash → bucket → shard (PayPal's scuttles).
    #[default]
    Hash,
    /// Ordered key ranges, `[from, to)`, each on one shard.
    Range,
    /// `key mod n` picks the shard from a list (integer keys only).
    Modulo,
    /// A lookup table `key → shard` in a database of its own.
    Directory,
}

/// One entity group's placement.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// The placement strategy; `hash` when omitted.
    #[serde(default)]
    pub placement: PlacementKind,
    /// `hash`: number of buckets (virtual shards), default 1024. Fixed for the
    /// life of the data: rebalancing moves buckets, it never changes this.
    pub buckets: Option<u32>,
    /// `hash`: which shard owns which buckets (inclusive `first..=last`). When
    /// omitted, buckets are spread evenly over `shards` (or every shard).
    pub bucket_ranges: Option<Vec<BucketRange>>,
    /// `range`: key ranges `[from, to)`, without gaps or overlaps.
    pub ranges: Option<Vec<KeyRange>>,
    /// `modulo`: the shards `key mod n` indexes into. `hash` without
    /// `bucket_ranges`: the shards buckets are spread over.
    pub shards: Option<Vec<String>>,
    /// `directory`: where the lookup table lives.
    pub directory: Option<DirectoryConfig>,
    /// `hash`: the group's buckets can move between shards while the
    /// application runs ([`Cluster::rebalance`](crate::Cluster::rebalance));
    /// `range`: its ranges can split and move. Its bucket map (or ranges)
    /// is then read from the database (seeded from this file on first use)
    /// and every write transaction checks its bucket's (range's) fence on
    /// its shard: one more statement per transaction. Every instance of the
    /// application must agree on it. Default `false`.
    #[serde(default)]
    pub movable: bool,
}

/// `first..=last` buckets on one shard.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketRange {
    /// The owning shard.
    pub shard: String,
    /// First bucket (inclusive).
    pub first: u32,
    /// Last bucket (inclusive).
    pub last: u32,
}

/// Keys in `[from, to)` on one shard. A missing `from` is unbounded below
/// (first range only); a missing `to` is unbounded above (last range only).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRange {
    /// The owning shard.
    pub shard: String,
    /// Lower bound, inclusive.
    pub from: Option<RangeBound>,
    /// Upper bound, exclusive.
    pub to: Option<RangeBound>,
}

/// A range bound: an integer for integer keys, a string for text and UUID keys
/// (UUIDs compare in their lowercase hyphenated form, which is byte order).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(untagged)]
pub enum RangeBound {
    /// Integer bound.
    Int(i64),
    /// String bound.
    Text(String),
}

impl std::fmt::Display for RangeBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RangeBound::Int(v) => write!(f, "{v}"),
            RangeBound::Text(v) => write!(f, "{v:?}"),
        }
    }
}

/// Where a directory placement keeps its lookup table.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirectoryConfig {
    /// Full database URL. Give either this, or `host` and `database`.
    pub url: Option<DatabaseUrl>,
    /// Name of a `[[hosts]]` entry.
    pub host: Option<String>,
    /// Database name on `host`.
    pub database: Option<String>,
    /// Lookup table name; default `shardkit_directory` (created by the
    /// `shardkit-migration` crate).
    pub table: Option<String>,
}

/// Connection pool settings.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Maximum connections per shard (sqlx's default, 10, when omitted;
    /// 1 to 10,000).
    pub max_connections: Option<u32>,
    /// Minimum idle connections per shard (at most `max_connections`).
    pub min_connections: Option<u32>,
    /// Connections per shard in its side pool, besides `max_connections`
    /// (default 2; 1 to 10,000): single autocommitted statements of
    /// shardkit's own (global-index claims and removals, bucket-map reads,
    /// owner checks), opened on first use. See the README's connection
    /// budget.
    pub side_connections: Option<u32>,
    /// Seconds to wait for a new connection (1 to 3,600).
    pub connect_timeout_secs: Option<u64>,
    /// Seconds to wait for a pooled connection (1 to 3,600).
    pub acquire_timeout_secs: Option<u64>,
    /// Ping a pooled connection before handing it out (SQLx's default: true).
    /// Turning it off saves a round trip per statement.
    pub test_before_acquire: Option<bool>,
    /// Open connections on first use instead of at [`Cluster::connect`]
    /// (default false). With it, a shard that is down does not stop the
    /// cluster from starting; reads that need it fail instead. (SQLite files
    /// are still opened at connect: SeaORM reads their version.) Ticket
    /// servers' pools always open on first use: a process starts while one
    /// is down and draws from the others.
    ///
    /// [`Cluster::connect`]: crate::Cluster::connect
    pub connect_lazy: Option<bool>,
    /// Create a PostgreSQL or MySQL/MariaDB database (shard, directory or
    /// ticket server) that does not exist yet, when connecting (default
    /// false). shardkit connects to the server's `postgres` database
    /// (PostgreSQL) or to no database (MySQL) with the same credentials and
    /// runs `CREATE DATABASE`; the user needs that privilege. SQLite files
    /// are created by the URL's `mode=rwc`. Each server is reached first,
    /// all at once, within `connect_timeout_secs`: one that cannot be
    /// reached fails the connect with its cause, except a ticket server or,
    /// with `connect_lazy`, any database, which is passed over with a
    /// warning (its requests fail until it answers; its database is created
    /// by a later connect).
    pub create_databases: Option<bool>,
}

/// Connections per shard in its side pool when `[pool] side_connections`
/// is not set.
pub(crate) const DEFAULT_SIDE_CONNECTIONS: u32 = 2;

/// The most connections one instance of a cluster holds open at once, per
/// database server ([`ClusterConfig::connection_budget`]).
///
/// On each server: every shard's pool (`max_connections`) and side pool
/// (`side_connections`), one breaker probe per shard (opened while the
/// shard is checked, then closed), and every directory's and ticket
/// server's pool (`max_connections` each). A private in-memory SQLite
/// shard has one connection and no side pool; SQLite files have no server
/// and are listed as `sqlite`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionBudget {
    /// `[pool] max_connections` (or its default, 10).
    pub max_connections: u32,
    /// `[pool] side_connections` (or its default, 2).
    pub side_connections: u32,
    /// Each server (`host:port`, or `sqlite`), in the order first named.
    pub servers: Vec<ServerBudget>,
}

/// One server's part of a [`ConnectionBudget`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerBudget {
    /// `host:port`, or `sqlite` for SQLite files.
    pub server: String,
    /// Shards on it.
    pub shards: u32,
    /// Directory databases on it.
    pub directories: u32,
    /// Ticket servers on it.
    pub ticket_servers: u32,
    /// The most connections one instance opens to it.
    pub connections: u32,
}

impl ConnectionBudget {
    /// Every server's connections added up.
    pub fn total(&self) -> u32 {
        self.servers.iter().map(|s| s.connections).sum()
    }
}

impl ClusterConfig {}

/// One pool's size: `max_connections`, one for a private in-memory SQLite
/// database.
pub(super) fn pool_size(url: &DatabaseUrl, max_connections: u32) -> u32 {
    if url.is_sqlite_memory() {
        1
    } else {
        max_connections
    }
}

impl ClusterConfig {
    /// Parses and validates a TOML cluster config.
    ///
    /// Parse errors name the line and say what is wrong, without echoing the
    /// source line (it may hold a password).
    pub fn from_toml(text: &str) -> Result<Self> {
        let line = |err: &toml::de::Error| {
            err.span()
                .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1)
        };
        let deserializer = toml::de::Deserializer::parse(text).map_err(|err| {
            let entry = line(&err).map_or("the document".to_owned(), |n| format!("line {n}"));
            ShardError::config(entry, redact_urls(err.message()))
        })?;
        // The path of the value that failed (`groups.Customer.buckets`), not
        // only its line.
        let config: ClusterConfig =
            serde_path_to_error::deserialize(deserializer).map_err(|err| {
                let path = err.path().to_string();
                let err = err.into_inner();
                let entry = match (path.as_str(), line(&err)) {
                    ("." | "", Some(n)) => format!("line {n}"),
                    ("." | "", None) => "the document".to_owned(),
                    (path, Some(n)) => format!("{path} (line {n})"),
                    (path, None) => path.to_owned(),
                };
                ShardError::config(entry, redact_urls(err.message()))
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every setting outside the topology against its documented
    /// bounds, so none can panic later (an `Instant` or a shift overflowing)
    /// or break a guarantee (ids wrapping negative).
    pub(crate) fn check_settings(&self) -> Result<()> {
        let pool = &self.pool;
        let max_connections = pool.max_connections.unwrap_or(SQLX_MAX_CONNECTIONS);
        within(
            "pool.max_connections",
            pool.max_connections,
            1,
            MAX_CONNECTIONS,
        )?;
        within(
            "pool.min_connections",
            pool.min_connections,
            0,
            max_connections,
        )
        .map_err(|_| {
            ShardError::config(
                "pool.min_connections",
                format!(
                    "must be at most pool.max_connections ({max_connections}{})",
                    if pool.max_connections.is_none() {
                        ", the default"
                    } else {
                        ""
                    }
                ),
            )
        })?;
        within(
            "pool.side_connections",
            pool.side_connections,
            1,
            MAX_CONNECTIONS,
        )?;
        within(
            "pool.connect_timeout_secs",
            pool.connect_timeout_secs,
            1,
            MAX_POOL_TIMEOUT_SECS,
        )?;
        within(
            "pool.acquire_timeout_secs",
            pool.acquire_timeout_secs,
            1,
            MAX_POOL_TIMEOUT_SECS,
        )?;
        within(
            "read.timeout_ms",
            self.read.timeout_ms,
            1,
            MAX_READ_TIMEOUT_MS,
        )?;
        within(
            "read.max_concurrency",
            self.read.max_concurrency,
            1,
            MAX_READ_CONCURRENCY,
        )?;

        within(
            "gsi.grace_ms",
            self.gsi.grace_ms,
            MIN_GRACE_MS,
            MAX_GRACE_MS,
        )?;

        let rebalance = &self.rebalance;
        within("rebalance.refresh_ms", rebalance.refresh_ms, 0, 86_400_000)?;
        within(
            "rebalance.cutover_wait_ms",
            rebalance.cutover_wait_ms,
            1,
            60_000,
        )?;
        within(
            "rebalance.cleanup_grace_ms",
            rebalance.cleanup_grace_ms,
            0,
            MAX_GRACE_MS,
        )?;
        within("rebalance.chunk", rebalance.chunk, 1, 100_000)?;
        within(
            "rebalance.step_timeout_ms",
            rebalance.step_timeout_ms,
            100,
            3_600_000,
        )?;
        within(
            "rebalance.schema_wait_ms",
            rebalance.schema_wait_ms,
            0,
            3_600_000,
        )?;

        let ids = &self.ids;
        within("ids.timeout_ms", ids.timeout_ms, 1, MAX_TICKET_TIMEOUT_MS)?;
        within(
            "ids.retry_after_ms",
            ids.retry_after_ms,
            0,
            MAX_RETRY_AFTER_MS,
        )?;
        for (name, sequence) in &ids.sequences {
            crate::id_spec::check_name(name)?;
            within(
                &format!("ids.sequences.{name}.block"),
                sequence.block,
                1,
                crate::id_spec::MAX_BLOCK,
            )?;
        }
        let layout = match ids.snowflake {
            Some(layout) => layout.layout()?,
            None => crate::id_spec::SnowflakeLayout::default(),
        };
        layout.check_worker(ids.worker_id.unwrap_or(0))?;
        Ok(())
    }
}

/// sqlx's pool size when `pool.max_connections` is omitted.
pub(super) const SQLX_MAX_CONNECTIONS: u32 = 10;
const MAX_CONNECTIONS: u32 = 10_000;
const MAX_POOL_TIMEOUT_SECS: u64 = 3_600;
const MAX_READ_TIMEOUT_MS: u64 = 86_400_000;
const MAX_READ_CONCURRENCY: usize = 10_000;
const MAX_TICKET_TIMEOUT_MS: u64 = 600_000;
const MAX_RETRY_AFTER_MS: u64 = 3_600_000;
const MIN_GRACE_MS: u64 = 1_000;
const MAX_GRACE_MS: u64 = 86_400_000;

/// `value`, when given, lies in `min..=max`; the error names `key`.
fn within<T>(key: &str, value: Option<T>, min: T, max: T) -> Result<()>
where
    T: PartialOrd + std::fmt::Display + Copy,
{
    match value {
        Some(v) if v < min || v > max => Err(ShardError::config(
            key,
            format!("{v} is out of range: must be {min} to {max}"),
        )),
        _ => Ok(()),
    }
}

/// The longest database name PostgreSQL keeps, in bytes (`NAMEDATALEN - 1`);
/// it truncates a longer one without an error.
pub(super) const POSTGRES_MAX_NAME_BYTES: usize = 63;
/// The longest database name MySQL and MariaDB accept, in characters.
pub(super) const MYSQL_MAX_NAME_CHARS: usize = 64;

/// Checks the database name a PostgreSQL or MySQL/MariaDB URL names
/// (percent-decoded, as the driver reads it) against the server's limit.
/// PostgreSQL truncates a longer name silently, so `create_databases`
/// would create one database and every later start find it under another
/// name, and two names sharing their first 63 bytes would be one database.
pub(super) fn check_database_name(entry: &str, url: &DatabaseUrl) -> Result<()> {
    let Some((_, name)) = url.server_and_database() else {
        return Ok(());
    };
    let postgres = matches!(url.scheme(), Some("postgres" | "postgresql"));
    if postgres && name.len() > POSTGRES_MAX_NAME_BYTES {
        return Err(ShardError::config(
            entry,
            format!(
                "database name {name:?} is {} bytes long; PostgreSQL keeps at most \
                 {POSTGRES_MAX_NAME_BYTES} bytes of a name and would silently truncate it",
                name.len()
            ),
        ));
    }
    let chars = name.chars().count();
    if !postgres && chars > MYSQL_MAX_NAME_CHARS {
        return Err(ShardError::config(
            entry,
            format!(
                "database name {name:?} is {chars} characters long; MySQL and MariaDB accept \
                 at most {MYSQL_MAX_NAME_CHARS}"
            ),
        ));
    }
    Ok(())
}

pub(super) const SUPPORTED_SCHEMES: &[&str] = &["sqlite", "postgres", "postgresql", "mysql"];

/// Checks a URL's syntax and scheme without ever printing it.
pub(super) fn check_url(entry: &str, url: &DatabaseUrl) -> Result<()> {
    let parsed = url::Url::parse(url.expose())
        .map_err(|err| ShardError::config(entry, format!("malformed database URL ({err})")))?;
    if !SUPPORTED_SCHEMES.contains(&parsed.scheme()) {
        return Err(ShardError::config(
            entry,
            format!(
                "unsupported database URL scheme `{}`; expected one of {}",
                parsed.scheme(),
                SUPPORTED_SCHEMES.join(", ")
            ),
        ));
    }
    Ok(())
}
