//! A rollout, its handle and its write context.

use crate::entity::{ShardedEntity, table_name};
use crate::exec::Shards;
use crate::gsi::GsiState;
use crate::phase::Phase;
use crate::rollout::TimedCache;
use crate::rollout::parts::{PartDef, PartOf, Parts};
use sea_orm::{EntityTrait, Iterable};
use std::sync::atomic::AtomicU8;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// A user-supplied conversion between the two models.
pub(crate) type ConvertFn<A, B> = dyn Fn(&A) -> B + Send + Sync;
pub(super) type Convert<A, B> = Arc<ConvertFn<A, B>>;
/// A user-supplied fold: the new model of a root row and its parts.
pub(crate) type FoldFn<A, B> = dyn Fn(&A, &Parts) -> B + Send + Sync;
/// A user-supplied split of a new model into the parts folded into it.
pub(crate) type SplitFn<B> = dyn Fn(&B) -> Parts + Send + Sync;
pub(super) type ModelOf<E> = <E as EntityTrait>::Model;

/// The declaration of a rollout from entity `Old` to entity `New` (same group,
/// same primary key values). Register it with [`Cluster::register_rollout`](crate::Cluster::register_rollout).
pub struct Rollout<Old: ShardedEntity, New: ShardedEntity> {
    pub(super) name: String,
    pub(super) to_new: Arc<FoldFn<ModelOf<Old>, ModelOf<New>>>,
    pub(super) to_old: Option<Convert<ModelOf<New>, ModelOf<Old>>>,
    pub(super) parts: Vec<Arc<dyn PartDef<Old>>>,
    pub(super) to_old_parts: Option<Arc<SplitFn<ModelOf<New>>>>,
    pub(super) cache_ttl: Duration,
    pub(super) cache_capacity: u64,
    pub(super) refresh: Duration,
    pub(super) instance: Option<String>,
}

impl<Old: ShardedEntity, New: ShardedEntity> Rollout<Old, New> {
    /// A rollout named `name` (the key of its row in `shardkit_rollouts`)
    /// converting old rows with `to_new`. The conversion must keep the shard
    /// key and the primary key.
    pub fn new(
        name: impl Into<String>,
        to_new: impl Fn(&Old::Model) -> New::Model + Send + Sync + 'static,
    ) -> Self {
        Self::fold(name, move |old, _parts| to_new(old))
    }

    /// A rollout named `name` whose new row folds a root row of `Old` and
    /// the rows of other entities of the group that belong to it (declared
    /// with [`part`](Self::part)): `to_new` gets the root and its
    /// [`Parts`]. A write of the root or of any part re-derives the new row
    /// in the same transaction; backfill and verify fold the same way.
    /// [`new`](Self::new) is the fold of a root with no parts.
    ///
    /// ```
    /// # use shardkit::prelude::*;
    /// # use shardkit::{Parts, Rollout};
    /// # #[derive(EntityGroup)] #[shardkit(key = i64)] pub struct Customer;
    /// # pub mod order {
    /// #     use sea_orm::entity::prelude::*;
    /// #     #[sea_orm::model]
    /// #     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    /// #     #[sea_orm(table_name = "orders")]
    /// #     #[shardkit(group = crate::Customer)]
    /// #     pub struct Model {
    /// #         #[sea_orm(primary_key, auto_increment = false)] pub id: i64,
    /// #         #[shardkit(shard_key)] pub customer_id: i64,
    /// #     }
    /// #     impl ActiveModelBehavior for ActiveModel {}
    /// # }
    /// # pub mod order_line {
    /// #     use sea_orm::entity::prelude::*;
    /// #     #[sea_orm::model]
    /// #     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    /// #     #[sea_orm(table_name = "order_lines")]
    /// #     #[shardkit(group = crate::Customer)]
    /// #     pub struct Model {
    /// #         #[sea_orm(primary_key, auto_increment = false)] pub id: i64,
    /// #         #[shardkit(shard_key)] pub customer_id: i64,
    /// #         pub order_id: i64,
    /// #         pub cents: i64,
    /// #     }
    /// #     impl ActiveModelBehavior for ActiveModel {}
    /// # }
    /// # pub mod order_v2 {
    /// #     use sea_orm::entity::prelude::*;
    /// #     #[sea_orm::model]
    /// #     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    /// #     #[sea_orm(table_name = "orders_v2")]
    /// #     #[shardkit(group = crate::Customer)]
    /// #     pub struct Model {
    /// #         #[sea_orm(primary_key, auto_increment = false)] pub id: i64,
    /// #         #[shardkit(shard_key)] pub customer_id: i64,
    /// #         pub lines: i32,
    /// #         pub total_cents: i64,
    /// #     }
    /// #     impl ActiveModelBehavior for ActiveModel {}
    /// # }
    /// # fn main() {
    /// // orders + order_lines (one to many) → orders_v2, with the total stored
    /// let rollout = Rollout::<order::Entity, order_v2::Entity>::fold("orders_v2", |o, parts| {
    ///     let lines = parts.many::<order_line::Entity>();
    ///     order_v2::Model {
    ///         id: o.id,
    ///         customer_id: o.customer_id,
    ///         lines: lines.len() as i32,
    ///         total_cents: lines.iter().map(|l| l.cents).sum(),
    ///     }
    /// })
    /// .part::<order_line::Entity>(order_line::Column::OrderId);
    /// # let _ = rollout;
    /// # }
    /// ```
    pub fn fold(
        name: impl Into<String>,
        to_new: impl Fn(&Old::Model, &Parts) -> New::Model + Send + Sync + 'static,
    ) -> Self {
        Rollout {
            name: name.into(),
            to_new: Arc::new(to_new),
            to_old: None,
            parts: Vec::new(),
            to_old_parts: None,
            cache_ttl: Duration::from_secs(60),
            cache_capacity: 100_000,
            refresh: Duration::from_secs(5),
            instance: None,
        }
    }

    /// The rollout's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name [`instance`](Self::instance) gave this instance, if any.
    pub fn instance_name(&self) -> Option<&str> {
        self.instance.as_deref()
    }

    /// This instance's name in [`RolloutHandle::status`] (at most 128
    /// characters; default: the process id and a random suffix). Give each
    /// instance of the application a stable, distinct one (a host name, a
    /// pod name) to tell them apart.
    pub fn instance(mut self, name: impl Into<String>) -> Self {
        self.instance = Some(name.into());
        self
    }

    /// The conversion back, new → old. Needed from [`Phase::ReadNew`] on:
    /// reads of the old model are then served from the new table, and old
    /// writes in [`Phase::NewOnly`] are applied to the new row.
    pub fn to_old(
        mut self,
        to_old: impl Fn(&New::Model) -> Old::Model + Send + Sync + 'static,
    ) -> Self {
        self.to_old = Some(Arc::new(to_old));
        self
    }

    /// Declares entity `P` a part of this rollout's fold: its rows whose
    /// `link` column holds a root row's primary key (under the same shard
    /// key) fold into that root's new row. One to one and one to many are
    /// the same declaration; [`Parts::one`] and [`Parts::many`] read them.
    /// The root's primary key must be a single column. From `new_only` on,
    /// reads of `P` are refused (its table is no longer written) and its
    /// writes are applied to the folded row, which needs
    /// [`to_old_parts`](Self::to_old_parts).
    pub fn part<P>(mut self, link: P::Column) -> Self
    where
        P: ShardedEntity<Group = Old::Group>,
    {
        self.parts.push(Arc::new(PartOf::<P>::new(link)));
        self
    }

    /// The split back, new → the parts folded into it (with
    /// [`Parts::with`]): needed from `new_only` on to apply writes of a
    /// part, or an update of the root, to the folded row.
    pub fn to_old_parts(
        mut self,
        to_old_parts: impl Fn(&New::Model) -> Parts + Send + Sync + 'static,
    ) -> Self {
        self.to_old_parts = Some(Arc::new(to_old_parts));
        self
    }

    /// How long a cache object lives (default 60 s).
    pub fn cache_ttl(mut self, ttl: Duration) -> Self {
        self.cache_ttl = ttl;
        self
    }

    /// How many objects each of the two caches holds at most (default 100,000).
    pub fn cache_capacity(mut self, objects: u64) -> Self {
        self.cache_capacity = objects;
        self
    }

    /// How often this instance re-reads the shared phase (default 5 s). A
    /// setting, like [`cache_ttl`](Self::cache_ttl); the `_every` methods
    /// ([`RolloutHandle::verify_every`], [`Gsi::reconcile_every`](crate::gsi::Gsi::reconcile_every))
    /// start a periodic task.
    pub fn refresh_interval(mut self, interval: Duration) -> Self {
        self.refresh = interval;
        self
    }
}

/// Whether every column of `Old` exists in `New` with the same name, type
/// and nullability, so a statement written for `Old` reads the same from
/// `New`'s table. (It assumes what the rollout's own `to_old` does for
/// such columns: copy them.)
pub(crate) fn old_columns_in_new<Old: EntityTrait, New: EntityTrait>() -> bool {
    use sea_orm::{ColumnTrait, IdenStatic};
    <Old::Column as Iterable>::iter().all(|old| {
        let old_def = old.def();
        <New::Column as Iterable>::iter().any(|new| {
            let new_def = new.def();
            new.as_str() == old.as_str()
                && new_def.get_column_type() == old_def.get_column_type()
                && new_def.is_null() == old_def.is_null()
        })
    })
}

/// [`Shared::read_new_table`] for `Old` → `New`.
pub(crate) fn read_new_table<Old: ShardedEntity, New: ShardedEntity>()
-> Option<crate::read::ReadFrom> {
    old_columns_in_new::<Old, New>().then(|| crate::read::ReadFrom {
        table: table_name::<New>(),
        table_ref: sea_orm::EntityName::table_ref(&New::default()),
        indexes: New::GLOBAL_INDEXES
            .iter()
            .map(|(column, unique)| (sea_orm::IdenStatic::as_str(column), *unique))
            .collect(),
    })
}

/// What [`RolloutHandle::status`] reports: the shared state and the
/// instances that registered the rollout.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RolloutStatus {
    /// The rollout's name.
    pub name: String,
    /// The shared phase.
    pub phase: Phase,
    /// When the phase last changed (Unix ms, on the cluster's clock; 0 = never).
    pub changed_ms: i64,
    /// The least time between two phase changes (the longest cache TTL plus
    /// refresh interval of any instance).
    pub gap: Duration,
    /// Whether the backfill has finished (in `dual_write` or later).
    pub backfilled: bool,
    /// Every instance that registered the rollout, most recently seen first.
    pub instances: Vec<RolloutInstance>,
}

/// One instance that registered a rollout ([`RolloutStatus::instances`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RolloutInstance {
    /// Its name ([`Rollout::instance`]).
    pub name: String,
    /// Its cache lifetime.
    pub cache_ttl: Duration,
    /// How often it re-reads the phase.
    pub refresh_interval: Duration,
    /// When it last re-read the phase (Unix ms, on its clock).
    pub seen_ms: i64,
    /// Whether it is the instance asking.
    pub this_instance: bool,
}

/// Counts of a [`RolloutHandle::backfill_with`] run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RolloutBackfill {
    /// Old rows copied to the new table in this run.
    pub rows: u64,
    /// Shards of the group finished so far (including earlier runs).
    pub shards_done: usize,
    /// Shards of the group.
    pub shards: usize,
    /// Whether every shard is done.
    pub finished: bool,
}

/// The shared part of a registered rollout: phase, caches, conversions.
pub(crate) struct Shared<Old: ShardedEntity, New: ShardedEntity> {
    pub(super) name: String,
    pub(super) phase: AtomicU8,
    /// This instance's own phase changes so far, and the lock that orders
    /// them against phases read from the shared state.
    pub(super) phase_epoch: std::sync::atomic::AtomicU64,
    pub(super) phase_lock: std::sync::Mutex<()>,
    pub(super) to_new: Arc<FoldFn<ModelOf<Old>, ModelOf<New>>>,
    pub(super) to_old: Option<Convert<ModelOf<New>, ModelOf<Old>>>,
    /// The entities folded into the root (empty for a one-to-one rollout).
    pub(super) parts: Vec<Arc<dyn PartDef<Old>>>,
    pub(super) to_old_parts: Option<Arc<SplitFn<ModelOf<New>>>>,
    pub(super) old_cache: TimedCache<ModelOf<Old>>,
    pub(super) new_cache: TimedCache<ModelOf<New>>,
    pub(super) gap: Duration,
    /// This instance's name in `shardkit_rollout_instances`.
    pub(super) instance: String,
    /// The new table as old-entity reads use it from `read_new` on, when
    /// every old column is there (see [`old_columns_in_new`]); computed once.
    pub(super) read_new_table: Option<crate::read::ReadFrom>,
    pub(super) me: Weak<Self>,
}

/// A registered rollout: phase changes, phase-aware cached reads, backfill and
/// verification. Cheap to clone.
pub struct RolloutHandle<Old: ShardedEntity, New: ShardedEntity> {
    pub(super) shared: Arc<Shared<Old, New>>,
    pub(super) shards: Shards,
    pub(super) gsi: Arc<GsiState>,
    /// The bucket moves' read guard: reads of the old and new tables are
    /// routed by a map no older than a session's.
    pub(super) moves: Arc<dyn crate::read::ReadGuard>,
}

impl<Old: ShardedEntity, New: ShardedEntity> Clone for RolloutHandle<Old, New> {
    fn clone(&self) -> Self {
        RolloutHandle {
            shared: self.shared.clone(),
            shards: self.shards.clone(),
            gsi: Arc::clone(&self.gsi),
            moves: Arc::clone(&self.moves),
        }
    }
}

impl<Old: ShardedEntity, New: ShardedEntity> std::fmt::Debug for RolloutHandle<Old, New> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutHandle")
            .field("name", &self.shared.name)
            .field("old", &table_name::<Old>())
            .field("new", &table_name::<New>())
            .field("phase", &self.shared.phase())
            .finish()
    }
}
