//! # shardkit
//!
//! A data-access layer on top of [SeaORM](https://www.sea-ql.org/SeaORM/) 2.0
//! for applications whose data is split over many databases (shards).
//! Entities declare their shard key and their transactional entity group;
//! reads are routed by key; writes that would cross shards are refused before
//! any SQL runs.
//!
//! ```
//! use shardkit::prelude::*;
//!
//! #[derive(EntityGroup)]
//! #[shardkit(key = i64)]                   // every member is sharded by an i64
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
//!         #[shardkit(id = "snowflake")]     // filled on insert when unset
//!         pub id: i64,
//!         #[shardkit(shard_key)]
//!         pub customer_id: i64,
//!         #[shardkit(global_index(unique))] // findable without the shard key
//!         pub reference: String,
//!         pub total_cents: i64,
//!         #[sea_orm(has_many)]
//!         pub lines: HasMany<super::line::Entity>,
//!     }
//!
//!     impl ActiveModelBehavior for ActiveModel {}
//! }
//!
//! pub mod line {
//!     use sea_orm::entity::prelude::*;
//!
//!     #[sea_orm::model]
//!     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
//!     #[sea_orm(table_name = "order_lines")]
//!     #[shardkit(group = crate::Customer)]
//!     pub struct Model {
//!         #[sea_orm(primary_key, auto_increment = false)]
//!         #[shardkit(id = "uuid_v7")]
//!         pub id: Uuid,
//!         #[shardkit(shard_key)]            // lines live with their order
//!         pub customer_id: i64,
//!         pub order_id: i64,
//!         pub sku: String,
//!         #[sea_orm(belongs_to, from = "order_id", to = "id")]
//!         pub order: BelongsTo<super::order::Entity>,
//!     }
//!
//!     impl ActiveModelBehavior for ActiveModel {}
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Four shards, here in-memory SQLite databases.
//! let cluster = Cluster::connect(ClusterConfig::from_toml(r#"
//!     shards = [
//!         { name = "s0", url = "sqlite::memory:" }, { name = "s1", url = "sqlite::memory:" },
//!         { name = "s2", url = "sqlite::memory:" }, { name = "s3", url = "sqlite::memory:" },
//!     ]
//!     [groups.Customer]
//! "#)?).await?;
//! cluster.migrate::<shardkit::migration::Migrator>().await?; // shardkit's tables; yours too
//! # for shard in ["s0", "s1", "s2", "s3"] {
//! #     use sea_orm::ConnectionTrait;
//! #     let db = cluster.connection(shard).unwrap();
//! #     let schema = sea_orm::Schema::new(db.get_database_backend());
//! #     db.execute(&schema.create_table_from_entity(order::Entity)).await?;
//! #     db.execute(&schema.create_table_from_entity(line::Entity)).await?;
//! # }
//! cluster.setup::<(order::Entity, line::Entity)>().await?;    // index tables, sequences
//!
//! // Writes: a transaction is pinned to one group and one key.
//! let placed = cluster.transaction::<Customer, _, _>(42, |tx| async move {
//!     let order = tx.insert(order::ActiveModel {
//!         customer_id: Set(42),
//!         reference: Set("A-1001".into()),
//!         total_cents: Set(1_999),
//!         ..Default::default()                 // the id: a snowflake
//!     }).await?;
//!     tx.insert_many(["pen", "ink"].map(|sku| line::ActiveModel {
//!         customer_id: Set(42),
//!         order_id: Set(order.id),
//!         sku: Set(sku.into()),
//!         ..Default::default()
//!     })).await?;
//!     Ok(order)                                 // Ok commits, Err rolls back
//! }).await?;
//!
//! // A row of another key is refused before any SQL runs.
//! let tx = cluster.begin::<Customer>(42).await?;
//! let err = tx.insert(order::ActiveModel { customer_id: Set(7), ..Default::default() }).await;
//! assert!(matches!(err, Err(ShardError::CrossShardWrite { .. })));
//! drop(tx);                                     // rolled back
//!
//! // Reads: the key picks the shard and is added to the WHERE clause;
//! // SeaORM's select API works inside it.
//! let orders = cluster.find::<order::Entity>().key(42)
//!     .filter(order::Column::TotalCents.gt(1_000))
//!     .all().await?;
//! assert_eq!(orders, vec![placed.clone()]);
//! let with_lines = cluster.find::<order::Entity>().key(42)
//!     .find_with_related(line::Entity).await?;
//! assert_eq!(with_lines[0].1.len(), 2);
//! let skus: Vec<String> = cluster.find::<line::Entity>().key(42)
//!     .select_only().column(line::Column::Sku).order_by_asc(line::Column::Sku)
//!     .into_tuple().all().await?;
//! assert_eq!(skus, ["ink", "pen"]);
//!
//! // Several keys, or every shard on purpose: merged like one database.
//! let top = cluster.find::<order::Entity>().scatter()
//!     .order_by_desc(order::Column::TotalCents).limit(10).all().await?;
//! assert_eq!(top.len(), 1);
//! println!("{}", cluster.find::<order::Entity>().keys([1, 2, 42]).explain().await?);
//!
//! // Global secondary index: found without the shard key.
//! cluster.gsi().backfill::<order::Entity>(order::Column::Reference).await?; // activates it
//! let found = cluster.find::<order::Entity>()
//!     .by_index(order::Column::Reference, "A-1001").all().await?;
//! assert_eq!(found, vec![placed]);
//!
//! // Ids unique across every shard, without a ticket server.
//! let id = cluster.ids().snowflake()?;
//! assert!(id > 0);
//! # Ok(())
//! # }
//! ```
//!
//! ## Tour
//!
//! - [`entity`]: [`EntityGroup`] and [`ShardedEntity`], implemented by
//!   `#[derive(EntityGroup)]` and `#[derive(Sharded)]` (every attribute is
//!   listed, with an example, on the derives).
//! - [`topology`]: buckets → logical shards → hosts; hash (PostgreSQL
//!   partition-compatible), range, modulo and directory placements; the TOML
//!   config ([`ClusterConfig`]) and its validation.
//! - [`cluster`]: [`Cluster`], the entry point and facade: connections,
//!   routing, migrations and [`Cluster::setup`], directory tables, the
//!   transaction closure, and the features below.
//! - [`read`]: reads, planned before any I/O ([`Find`], `.explain()`):
//!   keyed reads with SeaORM's select API (projections, relations,
//!   `paginate`, `stream`), multi-key and scatter reads merged like one
//!   database, partial results.
//! - [`tx`]: [`ShardTx`], a transaction pinned to one key, whose writes
//!   (`insert`, `insert_many`, `update`, `save`, `update_many`,
//!   `delete_many`, `delete`) all pass through the write [`pipeline`].
//! - [`gsi`]: global secondary indexes, written index-first; backfill,
//!   lookups, reconciliation.
//! - [`ids`]: ticket sequences (Flickr), shard-encoded ids, snowflakes,
//!   UUIDv7.
//! - [`rollout`]: denormalisation rollouts (PayPal): phases every instance
//!   agrees on, dual writes, caches of both models, backfill; [`verify`]
//!   compares and repairs.
//! - [`error`]: [`ShardError`], the one error type, and `retry()`.
//! - `testing` (feature `testing`): fresh shard databases for each test.
//!
//! `ARCHITECTURE.md` in the repository maps the modules and their layers.
//!
//! ## Compile-time guarantees
//!
//! An unkeyed read (`cluster.find::<E>().all()`) and a write of another
//! group's entity through a `ShardTx<G>` do not compile; the derives reject a
//! missing, duplicated, nullable or mistyped shard key.

#![warn(missing_docs)]
#![deny(clippy::wildcard_imports)]

mod boxed;
#[cfg(feature = "cli")]
pub mod cli;
pub mod clock;
pub mod cluster;
pub mod entity;
pub mod error;
mod exec;
pub mod gsi;
mod id_spec;
pub mod ids;
pub mod job;
mod key;
pub mod metrics;
pub mod outbox;
mod phase;
pub mod pipeline;
pub mod read;
pub mod rebalance;
pub mod reference;
pub mod rollout;
#[cfg(feature = "testing")]
pub mod testing;
pub mod topology;
mod trace;
pub mod tx;
pub mod verify;

pub use clock::{Clock, ManualClock, SystemClock};
pub use cluster::{
    Cluster, ClusterBuilder, DatabaseMigrationStatus, Directory, EntitySet, MigrateOptions,
    MigrationProgress, MigrationReport, SetupReport, ShardTx, StatementEvent, StatementObserver,
    TransactionError,
};
pub use entity::{
    EntityGroup, GroupKey, InGroup, Joinable, KeyRef, ReferenceEntity, ShardKey, ShardedEntity,
};
pub use error::{
    DriverError, ErrorKind, Origin, Result, Retry, ShardError, ShardFailure, Subsystem,
};
pub use exec::{Consistency, ReplicaStatus, Session};
pub use ids::{Ids, Sequence, ServerPlace, Snowflake, SnowflakeLayout, TicketPlace, uuid_v7};
pub use job::{CancellationToken, JobControl};
pub use outbox::{
    BoxError, Message, Outbox, OutboxStatus, ParkedMessage, RelayReport, RelayTask, Saga,
    SagaReport, SagaState, SagaStatus, Sagas, ShardOutbox,
};
pub use read::{
    AllowPartial, ByIndex, Find, KeyOf, Keyed, KeyedPages, KeyedSelect, Keys, MergePlan,
    MultiSelect, MultiShard, Partial, PlannedRoute, PlannedStatement, ReadPlan, RowStream, Scatter,
    TxFind, TxSelect, Unkeyed,
};
pub use rollout::{
    Parts, Phase, Rollout, RolloutBackfill, RolloutHandle, RolloutInstance, RolloutStatus,
};
pub use shardkit_derive::{EntityGroup, Sharded};
pub use topology::{ClusterConfig, ConnectionBudget, DatabaseUrl, ShardId, Target, Topology};
pub use tx::{TxDeleteMany, TxUpdateMany};
pub use verify::{RowDiff, VerifyOptions, VerifyReport};

/// The SeaORM this version of shardkit is built on.
pub use sea_orm;

/// shardkit's own migrations (`shardkit_migration`): put
/// `shardkit::migration::migrations()` into your migrator, or run
/// `shardkit::migration::Migrator` when you have none.
pub use shardkit_migration as migration;

#[doc(hidden)]
pub use entity::__private;

/// The items most programs need: `use shardkit::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Cluster, ClusterConfig, Consistency, EntityGroup, InGroup, Message, Session, ShardError,
        ShardKey, ShardTx, Sharded, ShardedEntity,
    };
    pub use sea_orm::{
        ActiveValue::Set, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    };
}

// Where the guide's chapter links point in rustdoc. Each chapter ends with
// its own definitions for GitHub (`[gsi]: gsi.md`); these come first in
// each module's docs, and the first definition of a label wins.
#[cfg(all(doc, not(doctest)))]
macro_rules! guide_links {
    () => {
        "[readme]: https://github.com/shardkit/shardkit#readme\n\
         [architecture]: https://github.com/shardkit/shardkit/blob/main/ARCHITECTURE.md\n\
         [benchmarks]: https://github.com/shardkit/shardkit/blob/main/BENCHMARKS.md\n\
         [tests-readme]: https://github.com/shardkit/shardkit/blob/main/tests/README.md\n\
         [readme-test]: https://github.com/shardkit/shardkit/blob/main/examples/tests/readme.rs\n\
         [guide]: crate::guide\n[basics]: crate::guide::basics\n[seaorm]: crate::guide::seaorm\n\
         [topology]: crate::guide::topology\n[gsi]: crate::guide::gsi\n\
         [rollouts]: crate::guide::rollouts\n[ids]: crate::guide::ids\n\
         [rebalance]: crate::guide::rebalance\n[replicas]: crate::guide::replicas\n\
         [outbox]: crate::guide::outbox\n[reference]: crate::guide::reference\n\
         [cli]: crate::guide::cli\n\
         [troubleshooting]: crate::guide::troubleshooting\n\
         [contributing]: crate::guide::contributing\n\
         [sqlite]: crate::guide::troubleshooting#several-instances-on-sqlite\n\
         [budget]: crate::guide::troubleshooting#connection-budget\n\
         [adding]: crate::guide::rebalance#adding-a-shard\n\n"
    };
}

// The guide: `shardkit/docs/*.md`, one module per chapter (rustdoc only).
#[cfg(all(doc, not(doctest)))]
pub mod guide {
    #![doc = guide_links!()]
    #![doc = include_str!("../docs/README.md")]
    pub mod basics {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/basics.md")]
    }
    pub mod seaorm {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/seaorm.md")]
    }
    pub mod topology {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/topology.md")]
    }
    pub mod gsi {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/gsi.md")]
    }
    pub mod rollouts {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/rollouts.md")]
    }
    pub mod ids {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/ids.md")]
    }
    pub mod rebalance {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/rebalance.md")]
    }
    pub mod replicas {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/replicas.md")]
    }
    pub mod outbox {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/outbox.md")]
    }
    pub mod reference {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/reference.md")]
    }
    pub mod cli {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/cli.md")]
    }
    pub mod troubleshooting {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/troubleshooting.md")]
    }
    pub mod contributing {
        #![doc = guide_links!()]
        #![doc = include_str!("../docs/contributing.md")]
    }
}
