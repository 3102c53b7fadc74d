//! One error type for everything shardkit does.
//!
//! Every variant says what went wrong and where: which group, which shard, which
//! key or config entry. Database errors keep SeaORM's [`DbErr`](sea_orm::DbErr) as their source.
//! Connection URLs appear only in redacted form (see [`crate::topology::DatabaseUrl`]).

mod classify;
mod driver;
mod origin;
mod shard_error;
#[cfg(test)]
pub(crate) mod tests;

pub(crate) use classify::{
    Synthetic, db_retry, is_capacity, is_lock_wait_timeout, is_missing_table, is_sqlite_busy,
    is_unique_violation, sqlx_is_capacity,
};
pub(crate) use driver::{Bounded, QUOTED_CHARS, SqlxCause, database_code};
pub use driver::{DriverCause, DriverError};
pub(crate) use origin::abort_backoff;
pub use origin::{Origin, Retry, Subsystem};
pub use shard_error::{ErrorKind, Report, Result, ShardError, ShardFailure};
pub(crate) use shard_error::{REPROBE, again_after_abort};
