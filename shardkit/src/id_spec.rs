//! What an id is, without the services that hand ids out: the strategies
//! `#[shardkit(id = "...")]` names, sequence names and the snowflake layout.
//! A leaf, so entity declarations and the config can name them; the id
//! services live in [`crate::ids`].

use crate::error::{Result, ShardError};

/// Default ids per ticket.
pub const DEFAULT_BLOCK: u64 = 1000;
/// The most ids one ticket may reserve (`[ids.sequences.<name>] block`).
pub const MAX_BLOCK: u64 = 1_000_000_000;
/// Bits of a shard-encoded id that hold the bucket (up to 8,192 buckets).
pub const BUCKET_BITS: u32 = 13;
/// The snowflake epoch: 2026-01-01T00:00:00Z, in Unix milliseconds.
pub const SNOWFLAKE_EPOCH_MS: u64 = 1_767_225_600_000;

/// How `#[shardkit(id = "...")]` fills a primary key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdStrategy {
    /// `ticket:<sequence>`: the next id of a ticket sequence.
    Ticket(&'static str),
    /// `encoded:<sequence>`: the next id of a ticket sequence with the
    /// row's bucket in its low [`BUCKET_BITS`] bits, so
    /// [`Cluster::route_id`](crate::Cluster::route_id) finds the row's shard
    /// from the id alone (see
    /// [`Cluster::next_encoded_id`](crate::Cluster::next_encoded_id); the
    /// group needs a hash placement with at most 8,192 buckets).
    Encoded(&'static str),
    /// `uuid_v7`: [`uuid_v7`](crate::ids::uuid_v7).
    UuidV7,
    /// `snowflake`: this process's snowflake worker.
    Snowflake,
}

/// A sequence name: it becomes part of a table name (`tickets_<name>`).
pub(crate) fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 48
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(ShardError::config(
            format!("ids.sequences.{name}"),
            "a sequence name is 1-48 ASCII lowercase letters, digits and `_`",
        ));
    }
    Ok(())
}

/// Bit layout of a snowflake id: `time | worker | sequence`, most significant
/// first, under a zero sign bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnowflakeLayout {
    /// Milliseconds since [`SNOWFLAKE_EPOCH_MS`].
    pub time_bits: u8,
    /// Worker id.
    pub worker_bits: u8,
    /// Per-millisecond counter.
    pub sequence_bits: u8,
}

impl Default for SnowflakeLayout {
    fn default() -> Self {
        SnowflakeLayout {
            time_bits: 41,
            worker_bits: 10,
            sequence_bits: 12,
        }
    }
}

impl SnowflakeLayout {
    /// The layout `[ids.snowflake]` describes, checked.
    pub(crate) fn from_bits(time_bits: u8, worker_bits: u8, sequence_bits: u8) -> Result<Self> {
        let layout = SnowflakeLayout {
            time_bits,
            worker_bits,
            sequence_bits,
        };
        layout.check()?;
        Ok(layout)
    }

    /// The bits fit under the sign bit, with at least 30 bits of time (12
    /// days) and a sequence: anything else would shift ids out of range.
    pub(crate) fn check(&self) -> Result<()> {
        let total =
            u32::from(self.time_bits) + u32::from(self.worker_bits) + u32::from(self.sequence_bits);
        if total > 63 || self.time_bits < 30 || self.sequence_bits == 0 {
            return Err(ShardError::config(
                "ids.snowflake",
                format!(
                    "time_bits + worker_bits + sequence_bits must be at most 63 with time_bits ≥ 30 and sequence_bits ≥ 1 (got {} + {} + {} = {total})",
                    self.time_bits, self.worker_bits, self.sequence_bits
                ),
            ));
        }
        Ok(())
    }

    /// Whether `worker` fits in the worker bits.
    pub(crate) fn check_worker(&self, worker: u64) -> Result<()> {
        if worker >> self.worker_bits != 0 {
            return Err(ShardError::config(
                "ids.worker_id",
                format!(
                    "worker id {worker} does not fit in {} bits (at most {})",
                    self.worker_bits,
                    (1u64 << self.worker_bits) - 1
                ),
            ));
        }
        Ok(())
    }
}

/// The SQL that sets a MySQL session up for server `index` of `count`.
pub(crate) fn mysql_session_sql(index: usize, count: usize) -> String {
    format!(
        "SET SESSION auto_increment_increment = {count}, auto_increment_offset = {}",
        index + 1
    )
}
