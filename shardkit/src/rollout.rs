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
//! Registering a rollout ([`Cluster::register_rollout`]) changes nothing in the
//! code that writes the old entity: every [`ShardTx`](crate::ShardTx) write of
//! it consults the rollout's phase. The phase lives in `shardkit_rollouts` on
//! the first shard of the group (a migration in `shardkit-migration`), so every
//! instance agrees; each instance re-reads it every `refresh_every`.
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
//! [moka]: https://docs.rs/moka

use crate::clock::Clock;
use crate::entity::{EntityGroup, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::Shards;
pub(crate) use crate::exec::keyset::{
    after_condition, by_pk, format_cursor, model_pk_values, parse_cursor, tuple_text,
};
use crate::gsi::GsiState;
pub use crate::phase::Phase;
use crate::pipeline::{Replaced, WriteOp, WriteStage, Written};
use crate::topology::ShardId;
use futures::future::BoxFuture;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, OnConflict, Query};
use sea_orm::{
    ActiveModelTrait, ActiveValue, ColumnTrait, Condition, ConnectionTrait, DatabaseConnection,
    DatabaseTransaction, DbErr, EntityTrait, IntoActiveModel, Iterable, ModelTrait,
    PrimaryKeyToColumn, PrimaryKeyTrait, QueryFilter, TryIntoModel, Value,
    sea_query::IntoValueTuple,
};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// A user-supplied conversion between the two models.
pub(crate) type ConvertFn<A, B> = dyn Fn(&A) -> B + Send + Sync;
type Convert<A, B> = Arc<ConvertFn<A, B>>;
type ModelOf<E> = <E as EntityTrait>::Model;
type KeyOf<E> = <<E as ShardedEntity>::Group as EntityGroup>::Key;

/// The declaration of a rollout from entity `Old` to entity `New` (same group,
/// same primary key values). Register it with [`Cluster::register_rollout`].
pub struct Rollout<Old: ShardedEntity, New: ShardedEntity> {
    name: String,
    to_new: Convert<ModelOf<Old>, ModelOf<New>>,
    to_old: Option<Convert<ModelOf<New>, ModelOf<Old>>>,
    cache_ttl: Duration,
    cache_capacity: u64,
    refresh: Duration,
}

impl<Old: ShardedEntity, New: ShardedEntity> Rollout<Old, New> {
    /// A rollout named `name` (the key of its row in `shardkit_rollouts`)
    /// converting old rows with `to_new`. The conversion must keep the shard
    /// key and the primary key.
    pub fn new(
        name: impl Into<String>,
        to_new: impl Fn(&Old::Model) -> New::Model + Send + Sync + 'static,
    ) -> Self {
        Rollout {
            name: name.into(),
            to_new: Arc::new(to_new),
            to_old: None,
            cache_ttl: Duration::from_secs(60),
            cache_capacity: 100_000,
            refresh: Duration::from_secs(5),
        }
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

    /// How often this instance re-reads the shared phase (default 5 s).
    pub fn refresh_every(mut self, interval: Duration) -> Self {
        self.refresh = interval;
        self
    }
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
    name: String,
    phase: AtomicU8,
    to_new: Convert<ModelOf<Old>, ModelOf<New>>,
    to_old: Option<Convert<ModelOf<New>, ModelOf<Old>>>,
    old_cache: TimedCache<ModelOf<Old>>,
    new_cache: TimedCache<ModelOf<New>>,
    gap: Duration,
    me: Weak<Self>,
}

/// A registered rollout: phase changes, phase-aware cached reads, backfill and
/// verification. Cheap to clone.
pub struct RolloutHandle<Old: ShardedEntity, New: ShardedEntity> {
    shared: Arc<Shared<Old, New>>,
    shards: Shards,
    gsi: Arc<GsiState>,
}

impl<Old: ShardedEntity, New: ShardedEntity> Clone for RolloutHandle<Old, New> {
    fn clone(&self) -> Self {
        RolloutHandle {
            shared: self.shared.clone(),
            shards: self.shards.clone(),
            gsi: Arc::clone(&self.gsi),
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

/// What a write of the old entity leaves to do once its transaction commits
/// (fill or invalidate caches).
pub(crate) type AfterCommit = Box<dyn FnOnce() + Send>;

/// Where a dual write runs: the old row's transaction and shard.
pub(crate) struct WriteCtx<'a> {
    pub(crate) shards: &'a Shards,
    pub(crate) gsi: &'a Arc<GsiState>,
    pub(crate) txn: &'a DatabaseTransaction,
    pub(crate) shard: &'a str,
    pub(crate) shard_id: ShardId,
}

/// A row of the old entity as the write pipeline hands it over, whatever
/// the entity's type: its columns' values in `Column::iter()` order. The
/// registry finds a rollout by the entity's type, so the rollout reads the
/// values back as its own `Old` (see [`Shared::old_model`]).
pub(crate) type RowValues = Vec<Value>;

/// An active model of the old entity, the same way (see [`RowValues`]).
pub(crate) type ActiveValues = Vec<ActiveValue<Value>>;

/// The write side of a rollout, keyed in the registry by the old entity's
/// type. The write stage ([`DualWrite`]) calls it for every write of that
/// entity.
pub(crate) trait OldWrites: Send + Sync {
    fn name(&self) -> &str;
    fn phase(&self) -> Phase;
    /// The typed rollout, for [`Cluster::rollout`](crate::Cluster::rollout).
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
    /// After the old row `row` was inserted or updated.
    fn after_write<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        row: RowValues,
    ) -> BoxFuture<'a, Result<Option<AfterCommit>>>;
    /// After the old row named by `model` was deleted (or, from `new_only`
    /// on, instead of deleting it).
    fn after_delete<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        model: ActiveValues,
    ) -> BoxFuture<'a, Result<(u64, Option<AfterCommit>)>>;
    /// `NewOnly`: an insert (`update == false`) or update of the old entity,
    /// applied to the new table only. Returns the old row as written.
    fn write_new_only<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        model: ActiveValues,
        update: bool,
    ) -> BoxFuture<'a, Result<(RowValues, AfterCommit)>>;
}

/// A cache of one model whose entries live `ttl` by the cluster's clock
/// (so a [`ManualClock`](crate::clock::ManualClock) ages them in tests).
/// Expired entries are dropped when next read; the capacity bounds memory.
struct TimedCache<V> {
    entries: moka::sync::Cache<String, (V, i64)>,
    ttl_ms: i64,
    clock: Arc<dyn Clock>,
}

impl<V: Clone + Send + Sync + 'static> TimedCache<V> {
    fn new(ttl: Duration, capacity: u64, clock: Arc<dyn Clock>) -> Self {
        TimedCache {
            entries: moka::sync::Cache::builder().max_capacity(capacity).build(),
            ttl_ms: i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX),
            clock,
        }
    }

    fn get(&self, key: &str) -> Option<V> {
        let (value, at) = self.entries.get(key)?;
        if crate::clock::now_ms(&*self.clock).saturating_sub(at) >= self.ttl_ms {
            self.entries.invalidate(key);
            return None;
        }
        Some(value)
    }

    fn insert(&self, key: String, value: V) {
        self.entries
            .insert(key, (value, crate::clock::now_ms(&*self.clock)));
    }

    fn invalidate(&self, key: &str) {
        self.entries.invalidate(key);
    }

    fn invalidate_all(&self) {
        self.entries.invalidate_all();
    }
}

/// The model [`crate::key::model_values`] took apart.
fn model_from_values<E: ShardedEntity>(values: RowValues) -> std::result::Result<E::Model, DbErr> {
    let values = values.into_iter().map(ActiveValue::Set).collect();
    let (model, _) = crate::key::active_from_values::<E>(values)?;
    E::__try_into_model(model)
}

/// The cache key of a row: shard key and primary key, as text.
fn cache_key(key: &str, pk: &str) -> String {
    format!("{key}\u{1f}{pk}")
}

/// `E`'s primary key columns equal to `values`, in order.
pub(crate) fn pk_condition<E: EntityTrait>(values: &[Value]) -> Condition {
    <E::PrimaryKey as Iterable>::iter()
        .zip(values)
        .fold(Condition::all(), |cond, (pk, v)| {
            cond.add(pk.into_column().eq(v.clone()))
        })
}

/// `E`'s primary key column names, as a tuple when there are several.
fn pk_names<E: EntityTrait>() -> String {
    let names: Vec<&str> = <E::PrimaryKey as Iterable>::iter()
        .map(|pk| sea_orm::IdenStatic::as_str(&pk.into_column()))
        .collect();
    match names.as_slice() {
        [one] => (*one).to_owned(),
        many => format!("({})", many.join(", ")),
    }
}

fn pk_arity<E: EntityTrait>() -> usize {
    <E::PrimaryKey as Iterable>::iter().count()
}

/// Inserts `model`, or overwrites the row with its primary key.
///
/// PostgreSQL and SQLite use `ON CONFLICT (<primary key>) DO UPDATE`, which
/// fires on the primary key only. MySQL's `ON DUPLICATE KEY UPDATE` fires on
/// *any* unique key and would overwrite another row that merely shares a
/// unique value, so there it is an `UPDATE` by primary key (SQLx reports
/// matched rows) and, when none matched, an `INSERT`.
pub(crate) async fn upsert<E, C>(db: &C, model: E::Model) -> std::result::Result<(), DbErr>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
    C: ConnectionTrait,
{
    let active = model.into_active_model().reset_all();
    if db.get_database_backend() == sea_orm::DbBackend::MySql {
        let pk: Vec<Value> = <E::PrimaryKey as Iterable>::iter()
            .map(|c| {
                active
                    .get(c.into_column())
                    .into_value()
                    .unwrap_or(Value::Bool(None))
            })
            .collect();
        let matched = E::update_many()
            .set(active.clone())
            .filter(pk_condition::<E>(&pk))
            .exec(db)
            .await?
            .rows_affected;
        if matched > 0 {
            return Ok(());
        }
        return E::insert(active).exec_without_returning(db).await.map(drop);
    }
    let pks: Vec<E::Column> = <E::PrimaryKey as Iterable>::iter()
        .map(PrimaryKeyToColumn::into_column)
        .collect();
    let others: Vec<E::Column> = <E::Column as Iterable>::iter()
        .filter(|c| {
            !pks.iter()
                .any(|p| sea_orm::IdenStatic::as_str(p) == sea_orm::IdenStatic::as_str(c))
        })
        .collect();
    let mut on_conflict = OnConflict::columns(pks);
    if others.is_empty() {
        on_conflict.do_nothing();
    } else {
        on_conflict.update_columns(others);
    }
    E::insert(active)
        .on_conflict(on_conflict)
        .exec_without_returning(db)
        .await
        .map(drop)
}

impl<Old, New> Shared<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
    Old::Model: Sync,
    New::Model: Sync + IntoActiveModel<New::ActiveModel>,
    New::ActiveModel: Send,
{
    fn db_err(&self, shard: &str, operation: String, source: DbErr) -> ShardError {
        ShardError::Db {
            group: <Old::Group as EntityGroup>::NAME,
            shard: shard.to_owned(),
            operation,
            source,
        }
    }

    /// The old row the pipeline handed over (see [`RowValues`]).
    fn old_model(&self, values: RowValues) -> Result<Old::Model> {
        model_from_values::<Old>(values).map_err(|e| {
            self.refused_err(format!(
                "internal: not a row of `{}`: {e}",
                table_name::<Old>()
            ))
        })
    }

    /// The old active model the pipeline handed over, and which of its
    /// columns were `Set` (see [`ActiveValues`]).
    fn old_active(&self, values: ActiveValues) -> Result<(Old::ActiveModel, Vec<bool>)> {
        crate::key::active_from_values::<Old>(values).map_err(|e| {
            self.refused_err(format!(
                "internal: not a row of `{}`: {e}",
                table_name::<Old>()
            ))
        })
    }

    fn old_key(row: &Old::Model) -> String {
        cache_key(
            &Old::shard_key(row).to_directory_text(),
            &crate::key::model_pk::<Old>(row),
        )
    }

    /// Fills both caches with `row` (an old model) once the write commits.
    fn fill_both(self: &Arc<Self>, row: Old::Model) -> AfterCommit {
        let shared = self.clone();
        Box::new(move || {
            let key = Self::old_key(&row);
            shared.new_cache.insert(key.clone(), (shared.to_new)(&row));
            shared.old_cache.insert(key, row);
        })
    }

    fn invalidate_both(self: &Arc<Self>, key: String) -> AfterCommit {
        let shared = self.clone();
        Box::new(move || {
            shared.old_cache.invalidate(&key);
            shared.new_cache.invalidate(&key);
        })
    }

    /// Writes the new model of `old` in the transaction: its index rows
    /// first (see [`crate::gsi`]), then the row itself, as an upsert (the row
    /// may predate dual writes, or a backfill may have copied it).
    async fn write_new(
        &self,
        ctx: &WriteCtx<'_>,
        old: &Old::Model,
        insert_only: bool,
    ) -> Result<()> {
        let new = (self.to_new)(old);
        // The converted row is a write like any other: it must stay on the
        // old row's key, or it would land on a shard that key does not own.
        let (expected, found) = (Old::shard_key(old), New::shard_key(&new));
        if expected.to_directory_text() != found.to_directory_text() {
            return Err(ShardError::CrossShardWrite {
                entity: table_name::<New>(),
                column: New::SHARD_KEY_FIELD,
                expected: format!("{expected:?}"),
                found: format!("{found:?}"),
            });
        }
        self.index_new(ctx, &new).await?;
        let op = format!("dual write {}", table_name::<New>());
        let res = if insert_only {
            New::insert(new.into_active_model().reset_all())
                .exec_without_returning(ctx.txn)
                .await
                .map(drop)
        } else {
            upsert::<New, _>(ctx.txn, new).await
        };
        res.map_err(|e| self.db_err(ctx.shard, op, e))
    }

    async fn index_new(&self, ctx: &WriteCtx<'_>, new: &New::Model) -> Result<()> {
        if New::GLOBAL_INDEXES.is_empty() {
            return Ok(());
        }
        let key = New::shard_key(new).to_directory_text();
        let owner = crate::key::model_pk::<New>(new);
        for (column, unique) in New::GLOBAL_INDEXES {
            let index = crate::gsi::IndexDef::of::<New>(*column, *unique);
            crate::gsi::Gsi::new(ctx.shards, ctx.gsi)
                .write_entry_from::<New>(
                    &index,
                    &new.get(*column),
                    &key,
                    &owner,
                    Some((ctx.shard_id, ctx.txn)),
                )
                .await?;
        }
        Ok(())
    }

    /// The new row with `pk` under `key`, read within the transaction.
    async fn new_row_in(
        &self,
        ctx: &WriteCtx<'_>,
        key: &KeyOf<New>,
        pk: &[Value],
    ) -> Result<Option<New::Model>> {
        let backend = ctx.txn.get_database_backend();
        New::find()
            .filter(crate::read::key_condition::<New>(
                std::slice::from_ref(key),
                backend,
            ))
            .filter(pk_condition::<New>(pk))
            .one(ctx.txn)
            .await
            .map_err(|e| self.db_err(ctx.shard, format!("select {}", table_name::<New>()), e))
    }
}

impl<Old, New> OldWrites for Shared<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
    Old::Model: Sync + IntoActiveModel<Old::ActiveModel>,
    Old::ActiveModel: TryIntoModel<Old::Model> + Send + Sync,
    New::Model: Sync + IntoActiveModel<New::ActiveModel>,
    New::ActiveModel: Send,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn phase(&self) -> Phase {
        Shared::phase(self)
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }

    fn after_write<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        row: RowValues,
    ) -> BoxFuture<'a, Result<Option<AfterCommit>>> {
        Box::pin(async move {
            let phase = self.phase();
            let row = self.old_model(row)?;
            if phase == Phase::Done {
                return Err(self.refused_err(format!(
                    "the old table `{}` is retired; write `{}` instead",
                    table_name::<Old>(),
                    table_name::<New>()
                )));
            }
            if phase.writes_new() {
                self.write_new(&ctx, &row, false).await?;
            }
            if !phase.caches() {
                return Ok(None);
            }
            let this = self.self_arc();
            Ok(Some(this.fill_both(row)))
        })
    }

    fn after_delete<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        model: ActiveValues,
    ) -> BoxFuture<'a, Result<(u64, Option<AfterCommit>)>> {
        Box::pin(async move {
            let phase = self.phase();
            let (model, _) = self.old_active(model)?;
            if phase == Phase::Done {
                return Err(self.refused_err(format!(
                    "the old table `{}` is retired; delete from `{}` instead",
                    table_name::<Old>(),
                    table_name::<New>()
                )));
            }
            let (Some(key), Some(pk)) =
                (Old::active_shard_key(&model), model.get_primary_key_value())
            else {
                return Ok((0, None));
            };
            let pk: Vec<Value> = pk.into_iter().collect();
            let mut deleted = 0;
            if phase.writes_new() {
                let backend = ctx.txn.get_database_backend();
                deleted = New::delete_many()
                    .filter(crate::read::key_condition::<New>(
                        std::slice::from_ref(&key),
                        backend,
                    ))
                    .filter(pk_condition::<New>(&pk))
                    .exec(ctx.txn)
                    .await
                    .map_err(|e| {
                        self.db_err(ctx.shard, format!("dual delete {}", table_name::<New>()), e)
                    })?
                    .rows_affected;
            }
            // Deletes invalidate both caches whatever the phase: an entry
            // left from an earlier phase must not outlive its row.
            let this = self.self_arc();
            let after = this.invalidate_both(cache_key(&key.to_directory_text(), &tuple_text(&pk)));
            Ok((deleted, Some(after)))
        })
    }

    fn write_new_only<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        model: ActiveValues,
        update: bool,
    ) -> BoxFuture<'a, Result<(RowValues, AfterCommit)>> {
        Box::pin(async move {
            let phase = self.phase();
            let (model, set) = self.old_active(model)?;
            if phase == Phase::Done {
                return Err(self.refused_err(format!(
                    "the old table `{}` is retired; write `{}` instead",
                    table_name::<Old>(),
                    table_name::<New>()
                )));
            }
            let op = |what: &str| {
                format!(
                    "{what} {} (as {})",
                    table_name::<Old>(),
                    table_name::<New>()
                )
            };
            let old = if update {
                // Apply the set columns to the old form of the current new row.
                let Some(key) = Old::active_shard_key(&model) else {
                    return Err(self.refused_err("internal: update without a shard key"));
                };
                let Some(pk) = model.get_primary_key_value() else {
                    return Err(self.db_err(
                        ctx.shard,
                        op("update"),
                        DbErr::PrimaryKeyNotSet { ctx: "rollout" },
                    ));
                };
                let pk: Vec<Value> = pk.into_iter().collect();
                let current = self
                    .new_row_in(&ctx, &key, &pk)
                    .await?
                    .ok_or_else(|| self.db_err(ctx.shard, op("update"), DbErr::RecordNotUpdated))?;
                let Some(to_old) = &self.to_old else {
                    return Err(self.refused_err("no new → old conversion was registered"));
                };
                let mut merged = to_old(&current).into_active_model();
                for (column, set) in <Old::Column as Iterable>::iter().zip(set) {
                    if set {
                        merged.set(
                            column,
                            model.get(column).into_value().unwrap_or(Value::Bool(None)),
                        );
                    }
                }
                Old::__try_into_model(merged)
                    .map_err(|e| self.db_err(ctx.shard, op("update"), e))?
            } else {
                Old::__try_into_model(model).map_err(|e| self.db_err(ctx.shard, op("insert"), e))?
            };
            self.write_new(&ctx, &old, !update).await?;
            let this = self.self_arc();
            let after = this.fill_both(old.clone());
            Ok((crate::key::model_values::<Old>(&old), after))
        })
    }
}

impl<Old: ShardedEntity, New: ShardedEntity> Shared<Old, New> {
    fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Acquire))
    }

    fn set_local_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Release);
    }

    pub(crate) fn to_new_fn(&self) -> &ConvertFn<Old::Model, New::Model> {
        &*self.to_new
    }

    pub(crate) fn to_old_fn(&self) -> Option<&ConvertFn<New::Model, Old::Model>> {
        self.to_old.as_deref()
    }

    pub(crate) fn refused_err(&self, reason: impl Into<String>) -> ShardError {
        ShardError::Rollout {
            rollout: self.name.clone(),
            phase: self.phase(),
            reason: reason.into(),
        }
    }

    /// `self` as the `Arc` the registry holds: cache fills run after the
    /// transaction commits, so their closures must own a reference.
    fn self_arc(&self) -> Arc<Self> {
        self.me
            .upgrade()
            .expect("a rollout is reachable only through its Arc")
    }
}

const STATE_TABLE: &str = "shardkit_rollouts";
const BACKFILL_DONE: &str = "done";

/// A rollout's row in `shardkit_rollouts`.
#[derive(Clone, Debug)]
pub(crate) struct StateRow {
    pub(crate) phase: Phase,
    pub(crate) changed_ms: i64,
    pub(crate) gap_ms: i64,
    pub(crate) backfill: Option<String>,
    pub(crate) verify: Option<String>,
}

/// The database holding the state of group `E::Group`'s rollouts, and its name.
pub(crate) fn state_db<E: ShardedEntity>(shards: &Shards) -> Result<(&DatabaseConnection, &str)> {
    let id = shards
        .topology()
        .shards_of(<E::Group as EntityGroup>::NAME)?[0];
    Ok((shards.shard_conn(id), shards.shard_name(id)))
}

fn state_err(shard: &str, operation: &str, source: DbErr) -> ShardError {
    ShardError::Db {
        group: "rollout",
        shard: shard.to_owned(),
        operation: format!("{operation} {STATE_TABLE}"),
        source,
    }
}

pub(crate) async fn read_state(
    db: &DatabaseConnection,
    shard: &str,
    name: &str,
) -> Result<Option<StateRow>> {
    let stmt = Query::select()
        .columns(["phase", "changed_ms", "gap_ms", "backfill", "verify"].map(Alias::new))
        .from(Alias::new(STATE_TABLE))
        .and_where(Expr::col(Alias::new("name")).eq(name))
        .to_owned();
    let row = db
        .query_one(&stmt)
        .await
        .map_err(|e| state_err(shard, "read", e))?;
    let Some(row) = row else { return Ok(None) };
    let get = |e| state_err(shard, "read", e);
    let phase: String = row.try_get("", "phase").map_err(get)?;
    Ok(Some(StateRow {
        phase: Phase::parse(&phase).ok_or_else(|| {
            ShardError::config(
                format!("{STATE_TABLE}[{name}]"),
                format!("unknown phase {phase:?}"),
            )
        })?,
        changed_ms: row.try_get("", "changed_ms").map_err(get)?,
        gap_ms: row.try_get("", "gap_ms").map_err(get)?,
        backfill: row.try_get("", "backfill").map_err(get)?,
        verify: row.try_get("", "verify").map_err(get)?,
    }))
}

/// Saves a progress column (`backfill` or `verify`) of a rollout.
pub(crate) async fn save_progress(
    db: &DatabaseConnection,
    shard: &str,
    name: &str,
    column: &str,
    value: Option<String>,
) -> Result<()> {
    let stmt = Query::update()
        .table(Alias::new(STATE_TABLE))
        .value(Alias::new(column), value)
        .and_where(Expr::col(Alias::new("name")).eq(name))
        .to_owned();
    db.execute(&stmt)
        .await
        .map(drop)
        .map_err(|e| state_err(shard, "update", e))
}

/// The rollouts registered on a cluster, by the old entity's type.
#[derive(Default)]
pub(crate) struct Registry(std::sync::RwLock<HashMap<TypeId, Arc<dyn OldWrites>>>);

impl Registry {
    /// The rollout registered for the entity with type id `entity`.
    fn get(&self, entity: TypeId) -> Option<Arc<dyn OldWrites>> {
        let map = self.0.read().unwrap_or_else(|p| p.into_inner());
        if map.is_empty() {
            return None;
        }
        map.get(&entity).cloned()
    }

    /// Registers a rollout's write side; `false` if the entity has one.
    fn add(&self, entity: TypeId, writes: Arc<dyn OldWrites>) -> bool {
        let mut map = self.0.write().unwrap_or_else(|p| p.into_inner());
        if map.contains_key(&entity) {
            return false;
        }
        map.insert(entity, writes);
        true
    }
}

/// What [`Cluster::register_rollout`] and [`Cluster::rollout`] act on.
pub(crate) struct Rollouts<'c> {
    pub(crate) registry: &'c Registry,
    pub(crate) shards: &'c Shards,
    pub(crate) gsi: &'c Arc<GsiState>,
}

impl Rollouts<'_> {
    /// Registers a rollout from `Old` to `New`. From now on every
    /// [`ShardTx`](crate::ShardTx) write of `Old` follows the rollout's phase;
    /// the code that writes `Old` does not change.
    ///
    /// Creates the rollout's row in `shardkit_rollouts` (phase `off`) when it
    /// is the first instance to register it, and raises the stored gap to
    /// this instance's cache TTL + refresh interval when that is longer.
    /// Refused when `Old` already has a rollout on this cluster, or when the
    /// two entities' primary keys have different numbers of columns.
    pub(crate) async fn register<Old, New>(
        &self,
        rollout: Rollout<Old, New>,
    ) -> Result<RolloutHandle<Old, New>>
    where
        Old: ShardedEntity,
        New: ShardedEntity<Group = Old::Group>,
        Old::Model: Sync + IntoActiveModel<Old::ActiveModel>,
        Old::ActiveModel: TryIntoModel<Old::Model> + Send + Sync,
        New::Model: Sync + IntoActiveModel<New::ActiveModel>,
        New::ActiveModel: Send,
        New::ActiveModel: Send,
    {
        let entry = format!("rollout {:?}", rollout.name);
        if rollout.name.is_empty() || rollout.name.len() > 128 {
            return Err(ShardError::config(
                entry,
                "a rollout name has 1 to 128 characters",
            ));
        }
        if pk_arity::<Old>() != pk_arity::<New>() {
            return Err(ShardError::config(
                entry,
                format!(
                    "`{}` and `{}` have primary keys of different widths; a rollout keeps the primary key",
                    table_name::<Old>(),
                    table_name::<New>()
                ),
            ));
        }
        let (db, shard) = state_db::<Old>(self.shards)?;
        let gap = rollout.cache_ttl + rollout.refresh;
        let gap_ms = gap.as_millis() as i64;
        let mut state = read_state(db, shard, &rollout.name).await?;
        if state.is_none() {
            let insert = Query::insert()
                .into_table(Alias::new(STATE_TABLE))
                .columns(["name", "phase", "changed_ms", "gap_ms"].map(Alias::new))
                .values_panic([
                    rollout.name.as_str().into(),
                    Phase::Off.as_str().into(),
                    0i64.into(),
                    gap_ms.into(),
                ])
                .to_owned();
            // Another instance may insert first; its row wins.
            let inserted = db.execute(&insert).await;
            state = read_state(db, shard, &rollout.name).await?;
            if state.is_none() {
                return Err(state_err(
                    shard,
                    "insert",
                    inserted.err().unwrap_or(DbErr::RecordNotInserted),
                ));
            }
        }
        let state = state.expect("checked above");
        if state.gap_ms < gap_ms {
            let stmt = Query::update()
                .table(Alias::new(STATE_TABLE))
                .value(Alias::new("gap_ms"), gap_ms)
                .and_where(Expr::col(Alias::new("name")).eq(rollout.name.as_str()))
                .and_where(Expr::col(Alias::new("gap_ms")).lt(gap_ms))
                .to_owned();
            db.execute(&stmt)
                .await
                .map_err(|e| state_err(shard, "update", e))?;
        }
        let shared = Arc::new_cyclic(|me| Shared::<Old, New> {
            name: rollout.name.clone(),
            phase: AtomicU8::new(state.phase as u8),
            to_new: rollout.to_new,
            to_old: rollout.to_old,
            old_cache: TimedCache::new(
                rollout.cache_ttl,
                rollout.cache_capacity,
                Arc::clone(self.shards.clock()),
            ),
            new_cache: TimedCache::new(
                rollout.cache_ttl,
                rollout.cache_capacity,
                Arc::clone(self.shards.clock()),
            ),
            gap,
            me: me.clone(),
        });
        if !self
            .registry
            .add(TypeId::of::<Old>(), shared.clone() as Arc<dyn OldWrites>)
        {
            return Err(ShardError::config(
                entry,
                format!(
                    "`{}` already has a rollout registered on this cluster",
                    table_name::<Old>()
                ),
            ));
        }
        let handle = RolloutHandle {
            shared,
            shards: self.shards.clone(),
            gsi: Arc::clone(self.gsi),
        };
        handle.spawn_every(
            rollout.refresh,
            crate::exec::periodic::FirstPass::AfterInterval,
            |rollout| async move {
                let (db, shard) = match state_db::<Old>(&rollout.shards) {
                    Ok(found) => found,
                    Err(err) => {
                        tracing::warn!(rollout = %rollout.shared.name, error = %err, "rollout phase refresh failed; keeping the last phase");
                        return ControlFlow::Continue(());
                    }
                };
                match read_state(db, shard, &rollout.shared.name).await {
                    Ok(Some(state)) => rollout.shared.set_local_phase(state.phase),
                    Ok(None) => {}
                    Err(err) => {
                        tracing::warn!(rollout = %rollout.shared.name, error = %err, "rollout phase refresh failed; keeping the last phase")
                    }
                }
                ControlFlow::Continue(())
            },
        );
        Ok(handle)
    }

    /// The rollout registered for `Old`, if it goes to `New`.
    pub(crate) fn handle<Old, New>(&self) -> Option<RolloutHandle<Old, New>>
    where
        Old: ShardedEntity,
        New: ShardedEntity<Group = Old::Group>,
        Old::Model: Sync,
        New::Model: Sync,
    {
        let any = self.registry.get(TypeId::of::<Old>())?.as_any();
        let shared = any.downcast::<Shared<Old, New>>().ok()?;
        Some(RolloutHandle {
            shared,
            shards: self.shards.clone(),
            gsi: Arc::clone(self.gsi),
        })
    }
}

impl<Old, New> RolloutHandle<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
    Old::Model: Sync + IntoActiveModel<Old::ActiveModel>,
    Old::ActiveModel: TryIntoModel<Old::Model> + Send + Sync,
    New::Model: Sync + IntoActiveModel<New::ActiveModel>,
    New::ActiveModel: Send,
{
    pub(crate) fn shared(&self) -> &Shared<Old, New> {
        &self.shared
    }

    /// Runs `pass` every `interval` on this rollout (see [`crate::exec::periodic`])
    /// until the cluster is dropped or `pass` breaks. Between passes the task
    /// holds neither the rollout nor the cluster.
    pub(crate) fn spawn_every<F, Fut>(
        &self,
        interval: Duration,
        first: crate::exec::periodic::FirstPass,
        mut pass: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: FnMut(RolloutHandle<Old, New>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ControlFlow<()>> + Send + 'static,
    {
        let shared = Arc::downgrade(&self.shared);
        let gsi = Arc::clone(&self.gsi);
        crate::exec::periodic::spawn(&self.shards, interval, first, move |shards| {
            let run = shared.upgrade().map(|shared| {
                pass(RolloutHandle {
                    shared,
                    shards,
                    gsi: Arc::clone(&gsi),
                })
            });
            async move {
                match run {
                    Some(run) => run.await,
                    None => ControlFlow::Break(()),
                }
            }
        })
    }

    pub(crate) fn shards(&self) -> &Shards {
        &self.shards
    }

    /// The rollout's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The phase this instance acts on (re-read every `refresh_every`).
    pub fn phase(&self) -> Phase {
        self.shared.phase()
    }

    /// The least time between two phase changes this instance asks for
    /// (cache TTL + refresh interval); the stored gap is the longest of all
    /// instances'.
    pub fn gap(&self) -> Duration {
        self.shared.gap
    }

    /// Re-reads the shared phase now.
    pub async fn refresh(&self) -> Result<Phase> {
        Ok(self.state().await?.phase)
    }

    async fn state(&self) -> Result<StateRow> {
        let (db, shard) = state_db::<Old>(&self.shards)?;
        let state = read_state(db, shard, &self.shared.name)
            .await?
            .ok_or_else(|| {
                self.shared
                    .refused_err(format!("its row in {STATE_TABLE} is gone"))
            })?;
        self.shared.set_local_phase(state.phase);
        Ok(state)
    }

    /// Moves to the next phase, for every instance. Refused
    /// ([`ShardError::RolloutTooSoon`]) until the gap has passed since the
    /// previous change; refused ([`ShardError::Rollout`]) into `read_new`
    /// without a new → old conversion or before a finished
    /// [`backfill`](Self::backfill), and when another instance changed the
    /// phase in between.
    pub async fn advance(&self) -> Result<Phase> {
        self.step(true).await
    }

    /// Moves back one phase, at once (no gap: rolling back is what one does
    /// when something is wrong). Going back below `dual_write` forgets the
    /// backfill, since the new table stops being written. Going back from
    /// `new_only` leaves the old table without the writes made in
    /// `new_only`: repair it first with
    /// [`verify`](Self::verify) and [`VerifyOptions::from_new`](crate::verify::VerifyOptions::from_new).
    pub async fn retreat(&self) -> Result<Phase> {
        self.step(false).await
    }

    /// Refuses ([`ShardError::RolloutTooSoon`]) what needs every instance
    /// to act on `state`'s phase (a move to `to`, or a backfill when `to` is
    /// the phase itself) until the gap has passed since the phase changed.
    fn check_gap(&self, state: &StateRow, to: Phase) -> Result<()> {
        let elapsed = std::cmp::max(self.shards.now_ms() - state.changed_ms, 0);
        if elapsed < state.gap_ms {
            return Err(ShardError::RolloutTooSoon {
                rollout: self.shared.name.clone(),
                from: state.phase,
                to,
                elapsed_ms: elapsed as u64,
                gap_ms: state.gap_ms as u64,
                wait_ms: (state.gap_ms - elapsed) as u64,
            });
        }
        Ok(())
    }

    async fn step(&self, forward: bool) -> Result<Phase> {
        let state = self.state().await?;
        let from = state.phase;
        let to = if forward {
            from.next()
        } else {
            from.previous()
        }
        .ok_or_else(|| {
            self.shared.refused_err(format!(
                "there is no phase {} {from}",
                if forward { "after" } else { "before" }
            ))
        })?;
        if forward {
            if to >= Phase::ReadNew && self.shared.to_old.is_none() {
                return Err(self.shared.refused_err(format!(
                    "{to} serves old-model reads from the new table: register a new → old conversion (Rollout::to_old)"
                )));
            }
            if to == Phase::ReadNew && state.backfill.as_deref() != Some(BACKFILL_DONE) {
                return Err(self.shared.refused_err(
                    "the new table is not backfilled: run backfill() while dual writing, then advance",
                ));
            }
            self.check_gap(&state, to)?;
        }
        let mut stmt = Query::update();
        stmt.table(Alias::new(STATE_TABLE))
            .value(Alias::new("phase"), to.as_str())
            .value(Alias::new("changed_ms"), self.shards.now_ms())
            .and_where(Expr::col(Alias::new("name")).eq(self.shared.name.as_str()))
            .and_where(Expr::col(Alias::new("phase")).eq(from.as_str()))
            .and_where(Expr::col(Alias::new("changed_ms")).eq(state.changed_ms));
        if to < Phase::DualWrite {
            stmt.value(Alias::new("backfill"), Option::<String>::None);
        }
        let (db, shard) = state_db::<Old>(&self.shards)?;
        let res = db
            .execute(&stmt)
            .await
            .map_err(|e| state_err(shard, "update", e))?;
        if res.rows_affected() == 0 {
            return Err(self.shared.refused_err(
                "another instance changed the phase first; refresh and decide again",
            ));
        }
        tracing::info!(rollout = %self.shared.name, %from, %to, "rollout phase changed");
        self.shared.set_local_phase(to);
        Ok(to)
    }

    /// The phase a read acts on, its primary key values and its cache key.
    fn read_start(
        &self,
        key: &KeyOf<Old>,
        pk: <Old::PrimaryKey as PrimaryKeyTrait>::ValueType,
    ) -> (Phase, Vec<Value>, String) {
        let pk: Vec<Value> = pk.into_value_tuple().into_iter().collect();
        let ck = cache_key(&key.to_directory_text(), &tuple_text(&pk));
        (self.phase(), pk, ck)
    }

    async fn read_old_table(&self, key: &KeyOf<Old>, pk: &[Value]) -> Result<Option<Old::Model>> {
        crate::read::Find::new(self.shards.clone(), None, Old::find())
            .key(key.clone())
            .filter(pk_condition::<Old>(pk))
            .one()
            .await
    }

    async fn read_new_table(&self, key: &KeyOf<Old>, pk: &[Value]) -> Result<Option<New::Model>> {
        crate::read::Find::new(self.shards.clone(), None, New::find())
            .key(key.clone())
            .filter(pk_condition::<New>(pk))
            .one()
            .await
    }

    fn to_old(&self, new: &New::Model) -> Result<Old::Model> {
        let to_old = self.shared.to_old.as_ref().ok_or_else(|| {
            self.shared
                .refused_err("reading the old model from the new table needs Rollout::to_old")
        })?;
        Ok(to_old(new))
    }

    /// The old model of a row, the way old code reads it: from the old cache,
    /// then (from `read_new` on) the new cache or table converted back,
    /// otherwise the old table. Caches are used from `cache_both` on.
    pub async fn get_old(
        &self,
        key: KeyOf<Old>,
        pk: <Old::PrimaryKey as PrimaryKeyTrait>::ValueType,
    ) -> Result<Option<Old::Model>> {
        let (phase, pk, ck) = self.read_start(&key, pk);
        if phase.caches()
            && let Some(hit) = self.shared.old_cache.get(&ck)
        {
            return Ok(Some(hit));
        }
        let row = if phase.reads_new() {
            let new = match phase
                .caches()
                .then(|| self.shared.new_cache.get(&ck))
                .flatten()
            {
                Some(new) => Some(new),
                None => self.read_new_table(&key, &pk).await?,
            };
            match new {
                Some(new) => {
                    let old = self.to_old(&new)?;
                    self.shared.new_cache.insert(ck.clone(), new);
                    Some(old)
                }
                None => None,
            }
        } else {
            self.read_old_table(&key, &pk).await?
        };
        if let (true, Some(row)) = (phase.caches(), &row) {
            self.shared.old_cache.insert(ck, row.clone());
        }
        Ok(row)
    }

    /// The new model of a row, the way new code reads it: from the new
    /// cache; then, while the old table is still written, derived from the
    /// old cache; then from the new table (from `read_new` on) or converted
    /// from the old table (before).
    pub async fn get_new(
        &self,
        key: KeyOf<Old>,
        pk: <Old::PrimaryKey as PrimaryKeyTrait>::ValueType,
    ) -> Result<Option<New::Model>> {
        let (phase, pk, ck) = self.read_start(&key, pk);
        if phase.caches() {
            if let Some(hit) = self.shared.new_cache.get(&ck) {
                return Ok(Some(hit));
            }
            if phase.writes_old()
                && let Some(old) = self.shared.old_cache.get(&ck)
            {
                let new = (self.shared.to_new)(&old);
                self.shared.new_cache.insert(ck, new.clone());
                return Ok(Some(new));
            }
        }
        let row = if phase.reads_new() {
            self.read_new_table(&key, &pk).await?
        } else {
            match self.read_old_table(&key, &pk).await? {
                Some(old) => {
                    let new = (self.shared.to_new)(&old);
                    if phase.caches() {
                        self.shared.old_cache.insert(ck.clone(), old);
                    }
                    Some(new)
                }
                None => None,
            }
        };
        if let (true, Some(row)) = (phase.caches(), &row) {
            self.shared.new_cache.insert(ck, row.clone());
        }
        Ok(row)
    }

    /// Drops every cache entry of this instance.
    pub fn clear_caches(&self) {
        self.shared.old_cache.invalidate_all();
        self.shared.new_cache.invalidate_all();
    }

    /// Copies every old row to the new table (see [`backfill_with`](Self::backfill_with)).
    pub async fn backfill(&self) -> Result<RolloutBackfill> {
        self.backfill_with(500, |_| ControlFlow::Continue(())).await
    }

    /// Copies old rows to the new table, shard by shard, `chunk` rows per
    /// transaction, in primary-key order. Each chunk's old rows are read
    /// `FOR UPDATE` (PostgreSQL, MySQL) so a dual write to them waits for the
    /// copy instead of being overwritten by it. Progress is saved after every
    /// chunk and a rerun resumes there; `on_progress` is called after every
    /// chunk and can stop the run. Only in `dual_write` and `read_new`: earlier,
    /// writes after the copy would be missing; later, the old table is stale.
    ///
    /// In `dual_write` it starts only once the rollout's gap has passed since
    /// the phase changed ([`ShardError::RolloutTooSoon`] with the wait,
    /// `from == to == dual_write`): until then an instance may still act on
    /// `cache_both` and update old rows after the copy took them. It reads
    /// the shared phase before every chunk and stops
    /// ([`ShardError::Rollout`]) once the phase has changed on any instance;
    /// its progress (and `done`) is recorded only while the phase is still
    /// the one it began in, so a retreat below `dual_write` (which voids the
    /// progress) can never be followed by a record of this run's.
    pub async fn backfill_with(
        &self,
        chunk: u64,
        mut on_progress: impl FnMut(RolloutBackfill) -> ControlFlow<()>,
    ) -> Result<RolloutBackfill> {
        let start_state = self.state().await?;
        if !matches!(start_state.phase, Phase::DualWrite | Phase::ReadNew) {
            return Err(self.shared.refused_err(
                "backfill runs in dual_write or read_new: before, later writes would be missed; after, the old table is stale",
            ));
        }
        let shards = self
            .shards
            .topology()
            .shards_of(<Old::Group as EntityGroup>::NAME)?
            .to_vec();
        let mut progress = RolloutBackfill {
            shards: shards.len(),
            ..Default::default()
        };
        if start_state.backfill.as_deref() == Some(BACKFILL_DONE) {
            progress.shards_done = shards.len();
            progress.finished = true;
            return Ok(progress);
        }
        // Until every instance must have seen dual_write, one may still act
        // on cache_both and write old rows only, after the copy took them.
        if start_state.phase == Phase::DualWrite {
            self.check_gap(&start_state, Phase::DualWrite)?;
        }
        let (start, mut after) = parse_cursor::<Old>(start_state.backfill.as_deref());
        progress.shards_done = start;
        let mut saved = start_state.backfill.clone();
        let chunk = std::cmp::max(chunk, 1);
        for (i, id) in shards.iter().enumerate().skip(start) {
            let db = self.shards.shard_conn(*id);
            let shard = self.shards.shard_name(*id);
            loop {
                // The phase may have moved on any instance since the last
                // chunk: copying on after a retreat below dual_write would
                // miss the writes made meanwhile.
                self.backfill_still_valid(&start_state).await?;
                let copied = self
                    .backfill_chunk(*id, db, shard, after.as_deref(), chunk)
                    .await?;
                let done = (copied.len() as u64) < chunk;
                progress.rows += copied.len() as u64;
                if let Some(last) = copied.last() {
                    after = Some(model_pk_values::<Old>(last));
                }
                let cursor = if done {
                    format_cursor(i + 1, None)
                } else {
                    format_cursor(i, after.as_deref())
                };
                self.save_backfill(&start_state, saved.as_deref(), &cursor)
                    .await?;
                saved = Some(cursor);
                if done {
                    break;
                }
                if on_progress(progress).is_break() {
                    return Ok(progress);
                }
            }
            after = None;
            progress.shards_done = i + 1;
            if on_progress(progress).is_break() && i + 1 < shards.len() {
                return Ok(progress);
            }
        }
        self.save_backfill(&start_state, saved.as_deref(), BACKFILL_DONE)
            .await?;
        progress.finished = true;
        Ok(progress)
    }

    /// The refusal of a backfill that began in `start`'s phase when the
    /// shared phase has changed since.
    async fn backfill_overtaken(&self, start: &StateRow) -> ShardError {
        let (now, next) = match self.state().await {
            Ok(state) if state.phase < Phase::DualWrite => (
                state.phase.to_string(),
                "its progress is void (the new table missed the writes made since): advance to \
                 dual_write and back-fill from the start",
            ),
            Ok(state) => (
                state.phase.to_string(),
                "run it again in dual_write or read_new; it resumes where it stopped",
            ),
            Err(_) => (
                "an unreadable phase".to_owned(),
                "run it again in dual_write or read_new",
            ),
        };
        self.shared.refused_err(format!(
            "the phase changed from {} to {now} while the backfill ran, so it stopped; {next}",
            start.phase
        ))
    }

    /// Errors when the shared phase is no longer the one the backfill
    /// began in.
    async fn backfill_still_valid(&self, start: &StateRow) -> Result<()> {
        let (db, shard) = state_db::<Old>(&self.shards)?;
        let now = read_state(db, shard, &self.shared.name).await?;
        match now {
            Some(now) if now.phase == start.phase && now.changed_ms == start.changed_ms => Ok(()),
            _ => Err(self.backfill_overtaken(start).await),
        }
    }

    /// Records backfill progress `value` only if the phase is still the one
    /// the backfill began in and nothing else changed the progress since it
    /// last wrote `previous` (a compare-and-set: a retreat between the
    /// check and this write voids it).
    async fn save_backfill(
        &self,
        start: &StateRow,
        previous: Option<&str>,
        value: &str,
    ) -> Result<()> {
        let (db, shard) = state_db::<Old>(&self.shards)?;
        let progress = match previous {
            Some(previous) => Expr::col(Alias::new("backfill")).eq(previous),
            None => Expr::col(Alias::new("backfill")).is_null(),
        };
        let stmt = Query::update()
            .table(Alias::new(STATE_TABLE))
            .value(Alias::new("backfill"), value)
            .and_where(Expr::col(Alias::new("name")).eq(self.shared.name.as_str()))
            .and_where(Expr::col(Alias::new("phase")).eq(start.phase.as_str()))
            .and_where(Expr::col(Alias::new("changed_ms")).eq(start.changed_ms))
            .and_where(progress)
            .to_owned();
        let res = db
            .execute(&stmt)
            .await
            .map_err(|e| state_err(shard, "update", e))?;
        if res.rows_affected() == 0 {
            return Err(self.backfill_overtaken(start).await);
        }
        Ok(())
    }

    async fn backfill_chunk(
        &self,
        id: ShardId,
        db: &DatabaseConnection,
        shard: &str,
        after: Option<&[Value]>,
        chunk: u64,
    ) -> Result<Vec<Old::Model>> {
        use sea_orm::QuerySelect;
        let err = |e| {
            self.shared
                .db_err(shard, format!("backfill {}", table_name::<New>()), e)
        };
        let txn = crate::exec::begin_write(db).await.map_err(err)?;
        let rows = by_pk(Old::find().filter(after_condition::<Old>(after)))
            .limit(chunk)
            .lock_exclusive()
            .all(&txn)
            .await
            .map_err(err)?;
        let ctx = WriteCtx {
            shards: &self.shards,
            gsi: &self.gsi,
            txn: &txn,
            shard,
            shard_id: id,
        };
        for row in &rows {
            // Dropping the transaction rolls the whole chunk back.
            self.shared
                .write_new(&ctx, row, false)
                .await
                .map_err(|e| match e {
                    ShardError::CrossShardWrite { .. } => self.shared.refused_err(format!(
                        "backfill stopped at `{}` row {} = {} on shard {shard}: {e}; nothing of \
                         its chunk was copied. The conversion must keep the shard key; fix it \
                         and run the backfill again",
                        table_name::<Old>(),
                        pk_names::<Old>(),
                        crate::key::model_pk::<Old>(row),
                    )),
                    other => other,
                })?;
        }
        txn.commit().await.map_err(err)?;
        Ok(rows)
    }
}

/// The write stage of rollouts (see [`crate::pipeline`]): a write of an
/// entity with a registered rollout follows the rollout's phase — caches
/// filled after the commit, the new row written in the same transaction,
/// and from `new_only` on the new table written instead of the old.
#[doc(hidden)]
pub struct DualWrite {
    registry: Arc<Registry>,
    gsi: Arc<GsiState>,
}

impl DualWrite {
    pub(crate) fn new(registry: Arc<Registry>, gsi: Arc<GsiState>) -> Self {
        DualWrite { registry, gsi }
    }

    fn ctx<'a>(&'a self, ctx: &'a crate::pipeline::WriteCtx<'a>) -> WriteCtx<'a> {
        WriteCtx {
            shards: ctx.shards,
            gsi: &self.gsi,
            txn: ctx.txn,
            shard: ctx.shard_name,
            shard_id: ctx.shard,
        }
    }
}

/// Runs the rollout's cache work once the transaction commits.
fn defer(ctx: &crate::pipeline::WriteCtx<'_>, after: Option<AfterCommit>) {
    if let Some(after) = after {
        ctx.defer(Box::pin(async move { after() }));
    }
}

impl WriteStage for DualWrite {
    async fn replace<E: ShardedEntity>(
        &self,
        ctx: &crate::pipeline::WriteCtx<'_>,
        op: WriteOp,
        model: &E::ActiveModel,
    ) -> Result<Option<Replaced<E::Model>>> {
        let Some(rollout) = self.registry.get(TypeId::of::<E>()) else {
            return Ok(None);
        };
        if rollout.phase() < Phase::NewOnly {
            return Ok(None);
        }
        let values = crate::key::active_values::<E>(model);
        if op == WriteOp::Delete {
            let (deleted, after) = rollout.after_delete(self.ctx(ctx), values).await?;
            defer(ctx, after);
            return Ok(Some(Replaced::Deleted(deleted)));
        }
        let (row, after) = rollout
            .write_new_only(self.ctx(ctx), values, op == WriteOp::Update)
            .await?;
        defer(ctx, Some(after));
        let row = model_from_values::<E>(row).map_err(|e| ShardError::Rollout {
            rollout: rollout.name().to_owned(),
            phase: rollout.phase(),
            reason: format!("internal: not a row of `{}`: {e}", table_name::<E>()),
        })?;
        Ok(Some(Replaced::Saved(row)))
    }

    async fn after_write<E: ShardedEntity>(
        &self,
        ctx: &crate::pipeline::WriteCtx<'_>,
        _op: WriteOp,
        written: Written<'_, E>,
    ) -> Result<()> {
        let Some(rollout) = self.registry.get(TypeId::of::<E>()) else {
            return Ok(());
        };
        let after = match written {
            Written::Saved(row) => {
                let values = crate::key::model_values::<E>(row);
                rollout.after_write(self.ctx(ctx), values).await?
            }
            Written::Deleted { model, .. } => {
                let values = crate::key::active_values::<E>(model);
                rollout.after_delete(self.ctx(ctx), values).await?.1
            }
        };
        defer(ctx, after);
        Ok(())
    }
}
