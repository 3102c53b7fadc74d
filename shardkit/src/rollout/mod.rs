//! Denormalisation rollouts: an old entity and its new (denormalised) form,
//! written side by side while a mixed fleet moves from one to the other.
//!
//! This is PayPal's recipe, in Stripe's phases:
//!
//! | phase | old table | new table | caches | reads (`get_old` / `get_new`) |
//! |---|---|---|---|---|
//! | [`Off`](Phase::Off) | written | — | — | old table (converted for `get_new`) |
//! | [`CacheBoth`](Phase::CacheBoth) | written | — | every write fills both | caches, then old table |
//! | [`DualWrite`](Phase::DualWrite) | written | written in the same transaction | both | caches, then old table |
//! | [`ReadNew`](Phase::ReadNew) | written | written in the same transaction | both | caches, then new table |
//! | [`NewOnly`](Phase::NewOnly) | not written | written | both | caches, then new table |
//! | [`Done`](Phase::Done) | writes refused | written | both | caches, then new table |
//!
//! Registering a rollout ([`Cluster::register_rollout`](crate::Cluster::register_rollout)) changes nothing in the
//! code that writes the old entity: every [`ShardTx`](crate::ShardTx) write of
//! it consults the rollout's phase. The phase lives in `shardkit_rollouts` on
//! the first shard of the group (a migration in `shardkit-migration`), so every
//! instance agrees; each instance re-reads it every `refresh_interval`.
//!
//! A phase can move one step at a time, and forward only once the previous
//! change is older than the rollout's *gap*: the longest cache TTL plus refresh
//! interval of any instance that registered it. By then no instance can still
//! serve a cache object, or act on a phase, from before the previous change
//! (PayPal's wait between "cache both" and "dual write").
//!
//! Caches ([moka]) are per instance: a write fills the caches of the instance
//! that made it, after its transaction commits; other instances' entries
//! expire within the TTL. A new-path read that misses the new cache derives
//! the object from the old cache before it goes to a database; this is what
//! keeps "insert through the old path, read through the new path" from
//! seeing two different objects.
//!
//! The new row may fold several old tables ([`Rollout::fold`]): a root row
//! and the rows of other entities of its group that name it (see the
//! `fold` module's notes on how concurrent writes of one root's parts are
//! ordered).
//!
//! A walk from `off` to `read_new` on in-memory shards, with an injected
//! clock standing in for the wait between phases:
//!
//! ```
//! use shardkit::prelude::*;
//! use shardkit::{ManualClock, Phase, Rollout, VerifyOptions};
//! use std::sync::Arc;
//!
//! #[derive(EntityGroup)]
//! #[shardkit(key = i64)]
//! pub struct Customer;
//!
//! pub mod person_v1 {                              // first and last name
//!     use sea_orm::entity::prelude::*;
//!     #[sea_orm::model]
//!     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
//!     #[sea_orm(table_name = "people")]
//!     #[shardkit(group = crate::Customer)]
//!     pub struct Model {
//!         #[sea_orm(primary_key, auto_increment = false)]
//!         pub id: i64,
//!         #[shardkit(shard_key)]
//!         pub customer_id: i64,
//!         pub first: String,
//!         pub last: String,
//!     }
//!     impl ActiveModelBehavior for ActiveModel {}
//! }
//!
//! pub mod person_v2 {                              // ... and the display name, stored
//!     use sea_orm::entity::prelude::*;
//!     #[sea_orm::model]
//!     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
//!     #[sea_orm(table_name = "people_v2")]
//!     #[shardkit(group = crate::Customer)]
//!     pub struct Model {
//!         #[sea_orm(primary_key, auto_increment = false)]
//!         pub id: i64,
//!         #[shardkit(shard_key)]
//!         pub customer_id: i64,
//!         pub first: String,
//!         pub last: String,
//!         pub display: String,
//!     }
//!     impl ActiveModelBehavior for ActiveModel {}
//! }
//!
//! fn to_v2(p: &person_v1::Model) -> person_v2::Model {
//!     person_v2::Model {
//!         id: p.id,
//!         customer_id: p.customer_id,
//!         first: p.first.clone(),
//!         last: p.last.clone(),
//!         display: format!("{} {}", p.first, p.last),
//!     }
//! }
//!
//! fn to_v1(p: &person_v2::Model) -> person_v1::Model {
//!     person_v1::Model { id: p.id, customer_id: p.customer_id, first: p.first.clone(), last: p.last.clone() }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let clock = Arc::new(ManualClock::starting_now());
//! let config = ClusterConfig::from_toml(r#"
//!     shards = [{ name = "s0", url = "sqlite::memory:" }, { name = "s1", url = "sqlite::memory:" }]
//!     [groups.Customer]
//! "#)?;
//! let cluster = Cluster::builder(config).clock(clock.clone()).connect().await?;
//! cluster.migrate::<shardkit::migration::Migrator>().await?;
//! # for shard in ["s0", "s1"] {
//! #     use sea_orm::ConnectionTrait;
//! #     let db = cluster.connection(shard).unwrap();
//! #     let schema = sea_orm::Schema::new(db.get_database_backend());
//! #     db.execute(&schema.create_table_from_entity(person_v1::Entity)).await?;
//! #     db.execute(&schema.create_table_from_entity(person_v2::Entity)).await?;
//! # }
//! let ann = person_v1::ActiveModel {
//!     id: Set(1), customer_id: Set(7), first: Set("Ann".into()), last: Set("Lee".into()),
//! };
//! cluster.transaction::<Customer, _, _>(7, |tx| { let ann = ann.clone(); async move {
//!     tx.insert(ann).await
//! }}).await?;                                       // written before the rollout: only the old table
//!
//! let people = cluster
//!     .register_rollout(Rollout::<person_v1::Entity, person_v2::Entity>::new("people_v2", to_v2).to_old(to_v1))
//!     .await?;
//! for phase in [Phase::CacheBoth, Phase::DualWrite] {
//!     assert_eq!(people.advance().await?, phase);
//!     clock.advance(people.gap());                  // every instance has seen the change
//! }
//! assert!(people.backfill().await?.finished);      // old rows copied into the new table
//! let report = people.verify(VerifyOptions::default()).await?;
//! assert_eq!(report.rows, 1);                       // old (converted) and new agree
//! assert_eq!(people.advance().await?, Phase::ReadNew);
//! let new = people.get_new(7, 1).await?.unwrap();   // served from the new table now
//! assert_eq!(new.display, "Ann Lee");
//! # Ok(()) }
//! ```
//!
//! [moka]: https://docs.rs/moka

mod backfill;
mod cache;
mod dual;
mod fold;
mod handle;
mod part_writes;
mod parts;
pub use crate::phase::Phase;
mod phases;
mod reads;
mod registry;
mod state;
mod verify;
mod watch;
mod writes;

use crate::rollout::cache::{TimedCache, cache_key, model_from_values, pk_arity, pk_names};
use crate::rollout::parts::PartDef;
pub use dual::DualWrite;
pub(crate) use handle::{ConvertFn, Shared, read_new_table};
pub use handle::{Rollout, RolloutBackfill, RolloutHandle, RolloutInstance, RolloutStatus};
pub use parts::Parts;
pub(crate) use registry::{Registry, Rollouts};
pub(crate) use writes::OldReads;
pub(crate) use writes::{ActiveValues, CacheUpdate, DualCtx, OldWrites, RowValues};
