//! # shardkit
//!
//! A data-access layer on top of [SeaORM](https://www.sea-ql.org/SeaORM/) 2.0
//! for applications whose data is split over many databases (shards).
//! Entities declare their shard key and their transactional entity group;
//! reads are routed by key; writes that would cross shards are refused before
//! any SQL runs.
//!
//! ```no_run
//! use shardkit::prelude::*;
//!
//! #[derive(EntityGroup)]
//! #[shardkit(key = i64)]
//! pub struct Customer;
//!
//! pub mod order {
//!     use sea_orm::entity::prelude::*;
//!
//!     #[sea_orm::model]
//!     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
//!     #[sea_orm(table_name = "orders")]
//!     #[shardkit(group = crate::Customer)]
//!     pub struct Model {
//!         #[sea_orm(primary_key, auto_increment = false)]
//!         pub id: i64,
//!         #[shardkit(shard_key)]
//!         pub customer_id: i64,
//!         pub total_cents: i64,
//!     }
//!
//!     impl ActiveModelBehavior for ActiveModel {}
//! }
//!
//! # async fn run() -> shardkit::Result<()> {
//! let cluster = Cluster::connect(ClusterConfig::from_toml(r#"
//!     shards = [
//!         { name = "s0", url = "sqlite://data/s0.db?mode=rwc" },
//!         { name = "s1", url = "sqlite://data/s1.db?mode=rwc" },
//!     ]
//!     [groups.Customer]
//!     placement = "hash"
//! "#)?).await?;
//!
//! // A write: one group, one key, one shard.
//! let tx = cluster.begin::<Customer>(42).await?;
//! tx.insert(order::ActiveModel {
//!     id: Set(1),
//!     customer_id: Set(42),
//!     total_cents: Set(1_999),
//! })
//! .await?;
//! tx.commit().await?;
//!
//! // A read: the key picks the shard (and is added to the WHERE clause).
//! let mine = cluster
//!     .find::<order::Entity>()
//!     .key(42)
//!     .filter(order::Column::TotalCents.gt(1_000))
//!     .all()
//!     .await?;
//! # let _ = mine;
//! # Ok(())
//! # }
//! # fn main() {}
//! ```
//!
//! ## Tour
//!
//! - [`entity`]: [`EntityGroup`] and [`ShardedEntity`], implemented by
//!   `#[derive(EntityGroup)]` and `#[derive(Sharded)]`.
//! - [`topology`]: buckets → logical shards → hosts; hash (PostgreSQL
//!   partition-compatible), range, modulo and directory placements; the TOML
//!   config ([`ClusterConfig`]) and its validation.
//! - [`cluster`]: [`Cluster`], the entry point and facade: connections,
//!   routing, migrations, directory tables, and the features below.
//! - [`read`]: reads, planned before any I/O ([`Find`], `.explain()`).
//! - [`tx`]: [`ShardTx`], a transaction pinned to one key, whose writes all
//!   pass through the write [`pipeline`].
//! - [`ids`], [`gsi`], [`rollout`], [`verify`]: unique ids, global secondary
//!   indexes, denormalisation rollouts, verification.
//! - [`error`]: [`ShardError`], the one error type.
//!
//! `ARCHITECTURE.md` in the repository maps the modules and their layers.
//!
//! ## Compile-time guarantees
//!
//! An unkeyed read (`cluster.find::<E>().all()`) and a write of another
//! group's entity through a `ShardTx<G>` do not compile; the derives reject a
//! missing, duplicated, nullable or mistyped shard key.

#![warn(missing_docs)]

pub mod clock;
pub mod cluster;
pub mod entity;
pub mod error;
mod exec;
pub mod gsi;
mod id_spec;
pub mod ids;
mod key;
mod phase;
pub mod pipeline;
pub mod read;
pub mod rollout;
#[cfg(feature = "testing")]
pub mod testing;
pub mod topology;
mod trace;
pub mod tx;
pub mod verify;

pub use clock::{Clock, ManualClock, SystemClock};
pub use cluster::{
    Cluster, ClusterBuilder, DatabaseMigrationStatus, Directory, EntitySet, MigrationReport,
    SetupReport, ShardTx, StatementEvent, StatementObserver,
};
pub use entity::{EntityGroup, GroupKey, InGroup, KeyRef, ShardKey, ShardedEntity};
pub use error::{ErrorKind, Origin, Result, Retry, ShardError, ShardFailure, Subsystem};
pub use ids::{Ids, Sequence, Snowflake, SnowflakeLayout, uuid_v7};
pub use read::{
    AllowPartial, ByIndex, Find, KeyOf, Keyed, KeyedPages, KeyedSelect, Keys, MergePlan, Partial,
    PlannedRoute, PlannedStatement, ReadPlan, RowStream, Scatter, TxFind, TxSelect, Unkeyed,
};
pub use rollout::{Phase, Rollout, RolloutBackfill, RolloutHandle};
pub use shardkit_derive::{EntityGroup, Sharded};
pub use topology::{ClusterConfig, DatabaseUrl, ShardId, Target, Topology};
pub use tx::{TxDeleteMany, TxUpdateMany};
pub use verify::{RowDiff, VerifyOptions, VerifyReport};

/// The SeaORM this version of shardkit is built on.
pub use sea_orm;

#[doc(hidden)]
pub use entity::__private;

/// The items most programs need: `use shardkit::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Cluster, ClusterConfig, EntityGroup, InGroup, ShardError, ShardKey, ShardTx, Sharded,
        ShardedEntity,
    };
    pub use sea_orm::{
        ActiveValue::Set, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    };
}
