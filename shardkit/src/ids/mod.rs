//! Globally unique ids.
//!
//! - **Tickets** (Flickr): a ticket server is a database with one
//!   `tickets_<sequence>` table per named sequence. Server `i` of `n` hands out
//!   tickets `≡ i + 1 (mod n)`, so two (or `n`) servers never overlap and any
//!   one of them can serve alone. On MySQL/MariaDB a ticket is Flickr's
//!   `REPLACE INTO tickets_x (stub) VALUES ('a')` with `auto_increment_increment`
//!   / `auto_increment_offset` set on every session the pool opens; on
//!   PostgreSQL and SQLite it is an upsert `... DO UPDATE SET id = id + n
//!   RETURNING id`. Either way, one round trip. Requests round-robin over the
//!   servers; a server that errors or times out is skipped for
//!   `retry_after_ms` and the next one is asked.
//! - **Segments** (hi-lo, Meituan Leaf): ticket `t` reserves the block of ids
//!   `[t·B, (t+1)·B)`. Blocks are handed out from memory; once 10% of the
//!   current block is used, the next block is fetched in the background
//!   (double buffering), so [`Sequence::next`] does not wait on a database in
//!   steady state. `B = 1` is exactly Flickr: one ticket per id, no prefetch.
//!   **A crash loses at most the unused rest of the current and the prefetched
//!   block** (gaps, never duplicates).
//! - **UUIDv7** ([`uuid_v7`]): time-ordered, index-friendly, monotonic within
//!   the process.
//! - **Snowflake** ([`Snowflake`]): 64-bit `time | worker | sequence`
//!   (default 41/10/12 bits) from a fixed epoch, with a clock-rollback policy.
//! - **Shard-encoded** ([`Cluster::next_encoded_id`](crate::Cluster::next_encoded_id), [`Cluster::route_id`](crate::Cluster::route_id)): a
//!   sequence id with the row's bucket in its low 13 bits (Instagram), so the
//!   shard is known from the id alone ([`Cluster::next_encoded_id`](crate::Cluster::next_encoded_id)).

mod encoded;
mod handle;
mod lock;
mod place_setup;
mod places;
mod sequence;
mod servers;
mod snowflake;
mod stage;
mod tickets;

pub use crate::clock::{Clock, SystemClock};
pub use crate::id_spec::{
    BUCKET_BITS, DEFAULT_BLOCK, IdStrategy, MAX_BLOCK, SNOWFLAKE_EPOCH_MS, SnowflakeLayout,
};
pub(crate) use encoded::route_id;
pub use handle::Ids;
pub use places::{ServerPlace, TicketPlace};
pub use sequence::Sequence;
pub(crate) use servers::TicketServer;
pub use snowflake::{Snowflake, uuid_v7};
pub use stage::FillIds;
