//! Registering rollouts and finding them by the old entity's type.

use crate::entity::{ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::gsi::GsiState;
use crate::phase::Phase;
use crate::rollout::part_writes::PartWrites;
use crate::rollout::state::{
    InstanceRow, STATE_TABLE, instance_seen, read_state, register_instance, state_db, state_err,
};
use crate::rollout::watch::Watch;
use crate::rollout::{
    OldReads, OldWrites, Rollout, RolloutHandle, Shared, TimedCache, pk_arity, read_new_table,
};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DbErr};
use std::any::TypeId;
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::AtomicU8;
use std::time::Duration;

/// The rollouts registered on a cluster, by the old entity's type.
#[derive(Default)]
pub(crate) struct Registry {
    map: std::sync::RwLock<HashMap<TypeId, Arc<dyn OldWrites>>>,
    /// Whether any rollout is registered: most clusters have none, and every
    /// write asks.
    any: std::sync::atomic::AtomicBool,
    /// Rollouts other instances registered for entities this one writes.
    pub(crate) watch: Arc<Watch>,
}

impl Registry {
    /// The rollout registered for the entity with type id `entity`.
    pub(super) fn get(&self, entity: TypeId) -> Option<Arc<dyn OldWrites>> {
        if !self.any.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        map.get(&entity).cloned()
    }

    /// The table of the first of `entities` that already has a rollout.
    fn taken(&self, entities: &[(TypeId, &'static str)]) -> Option<&'static str> {
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        entities
            .iter()
            .find(|(id, _)| map.contains_key(id))
            .map(|(_, table)| *table)
    }

    /// Registers a rollout's write sides (its root's and its parts'), all
    /// or none; `Err` names the first entity that already has one.
    fn add(
        &self,
        entries: Vec<(TypeId, &'static str, Arc<dyn OldWrites>)>,
    ) -> std::result::Result<(), &'static str> {
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        if let Some((_, table, _)) = entries.iter().find(|(id, _, _)| map.contains_key(id)) {
            return Err(table);
        }
        for (entity, _, writes) in entries {
            map.insert(entity, writes);
        }
        self.any.store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }
}

/// What [`Cluster::register_rollout`] and [`Cluster::rollout`] act on.
pub(crate) struct Rollouts<'c> {
    pub(crate) registry: &'c Registry,
    pub(crate) shards: &'c Shards,
    pub(crate) gsi: &'c Arc<GsiState>,
    /// The bucket moves' read guard, for the rollout's reads.
    pub(crate) moves: &'c Arc<dyn crate::read::ReadGuard>,
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
    {
        let entry = format!("rollout {:?}", rollout.name);
        if rollout.name.is_empty() || rollout.name.len() > 128 {
            return Err(ShardError::config(
                entry,
                "a rollout name has 1 to 128 characters",
            ));
        }
        let instance = rollout.instance.clone().unwrap_or_else(|| {
            let suffix = crate::ids::uuid_v7().simple().to_string();
            format!("pid{}-{}", std::process::id(), &suffix[suffix.len() - 8..])
        });
        if instance.is_empty() || instance.len() > 128 {
            return Err(ShardError::config(
                entry,
                "an instance name has 1 to 128 characters",
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
        if !rollout.parts.is_empty() && pk_arity::<Old>() != 1 {
            return Err(ShardError::config(
                entry,
                format!(
                    "`{}` has a primary key of {} columns; a fold links its parts to a root by a \
                     single-column primary key",
                    table_name::<Old>(),
                    pk_arity::<Old>()
                ),
            ));
        }
        let mut tables = vec![TypeId::of::<Old>(), TypeId::of::<New>()];
        let mut written = vec![(TypeId::of::<Old>(), table_name::<Old>())];
        for part in &rollout.parts {
            written.push((part.entity(), part.table()));
            if tables.contains(&part.entity()) {
                return Err(ShardError::config(
                    entry,
                    format!(
                        "`{}` is declared a part twice, or is the rollout's own old or new entity",
                        part.table()
                    ),
                ));
            }
            tables.push(part.entity());
        }
        // The old tables the rollout writes through: the root's and its
        // parts', as many as the column holds (128 characters).
        let mut old_tables = table_name::<Old>().to_owned();
        for part in &rollout.parts {
            old_tables.push(',');
            old_tables.push_str(part.table());
        }
        if old_tables.len() > 128 {
            return Err(ShardError::config(
                entry,
                format!(
                    "the root and part tables ({old_tables}) take more than the 128 characters \
                     shardkit_rollout_instances records for a rollout; fold fewer parts into \
                     one rollout"
                ),
            ));
        }
        // Checked again when it is added (another registration may race).
        if let Some(table) = self.registry.taken(&written) {
            return Err(taken_err(entry, table));
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
        // Recorded before the rollout acts here: a failure leaves nothing
        // registered on this instance, and a retry starts afresh.
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        register_instance(
            db,
            shard,
            InstanceRow {
                rollout: &rollout.name,
                instance: &instance,
                old_table: &old_tables,
                cache_ttl_ms: ms(rollout.cache_ttl),
                refresh_ms: ms(rollout.refresh),
                seen_ms: self.shards.now_ms(),
            },
        )
        .await?;
        let shared = Arc::new_cyclic(|me| Shared::<Old, New> {
            name: rollout.name.clone(),
            phase: AtomicU8::new(state.phase as u8),
            phase_epoch: std::sync::atomic::AtomicU64::new(0),
            phase_lock: std::sync::Mutex::new(()),
            to_new: rollout.to_new,
            to_old: rollout.to_old,
            parts: rollout.parts,
            to_old_parts: rollout.to_old_parts,
            old_cache: TimedCache::new(
                rollout.cache_ttl,
                rollout.cache_capacity,
                Arc::clone(self.shards.clock()),
                crate::metrics::CacheMetrics::new(&rollout.name, "old"),
            ),
            new_cache: TimedCache::new(
                rollout.cache_ttl,
                rollout.cache_capacity,
                Arc::clone(self.shards.clock()),
                crate::metrics::CacheMetrics::new(&rollout.name, "new"),
            ),
            gap,
            instance: instance.clone(),
            read_new_table: read_new_table::<Old, New>(),
            me: me.clone(),
        });
        crate::metrics::rollout_phase(&rollout.name, state.phase);
        let mut writes: Vec<(TypeId, &'static str, Arc<dyn OldWrites>)> = vec![(
            TypeId::of::<Old>(),
            table_name::<Old>(),
            shared.clone() as Arc<dyn OldWrites>,
        )];
        for (i, part) in shared.parts.iter().enumerate() {
            writes.push((
                part.entity(),
                part.table(),
                Arc::new(PartWrites {
                    shared: shared.clone(),
                    part: i,
                }),
            ));
        }
        if let Err(table) = self.registry.add(writes) {
            return Err(taken_err(entry, table));
        }
        let handle = RolloutHandle {
            shared,
            shards: self.shards.clone(),
            gsi: Arc::clone(self.gsi),
            moves: Arc::clone(self.moves),
        };
        handle.spawn_every(
            rollout.refresh,
            crate::exec::periodic::FirstPass::AfterInterval,
            |rollout| async move {
                let (db, shard) = match state_db::<Old>(&rollout.shards) {
                    Ok(found) => found,
                    Err(err) => {
                        tracing::warn!(rollout = %rollout.shared.name, error = %err.report(), "rollout phase refresh failed; keeping the last phase");
                        return ControlFlow::Continue(());
                    }
                };
                let seen = rollout.shards.now_ms();
                if let Err(err) =
                    instance_seen(db, shard, &rollout.shared.name, &rollout.shared.instance, seen)
                        .await
                {
                    tracing::warn!(rollout = %rollout.shared.name, error = %err.report(), "rollout instance refresh not recorded");
                }
                let epoch = rollout.shared.phase_epoch();
                match read_state(db, shard, &rollout.shared.name).await {
                    Ok(Some(state)) => rollout.shared.set_read_phase(state.phase, epoch),
                    Ok(None) => {}
                    Err(err) => {
                        tracing::warn!(rollout = %rollout.shared.name, error = %err.report(), "rollout phase refresh failed; keeping the last phase")
                    }
                }
                ControlFlow::Continue(())
            },
        );
        Ok(handle)
    }

    /// The rollout registered for `Old`, if it goes to `New`.
    pub(crate) fn handle<Old, New>(&self) -> Result<RolloutHandle<Old, New>>
    where
        Old: ShardedEntity,
        New: ShardedEntity<Group = Old::Group>,
    {
        let (old, new) = (table_name::<Old>(), table_name::<New>());
        let entry = format!("rollout {old} -> {new}");
        let Some(registered) = self.registry.get(TypeId::of::<Old>()) else {
            return Err(ShardError::config(
                entry,
                format!(
                    "no rollout of `{old}` is registered on this cluster \
                     (`cluster.register_rollout(..)` first)"
                ),
            ));
        };
        let name = registered.name().to_owned();
        let Ok(shared) = registered.as_any().downcast::<Shared<Old, New>>() else {
            return Err(ShardError::config(
                entry,
                format!(
                    "`{old}`'s registered rollout `{name}` goes to another entity than `{new}`"
                ),
            ));
        };
        Ok(RolloutHandle {
            shared,
            shards: self.shards.clone(),
            gsi: Arc::clone(self.gsi),
            moves: Arc::clone(self.moves),
        })
    }
}

fn taken_err(entry: String, table: &str) -> ShardError {
    ShardError::config(
        entry,
        format!(
            "`{table}` already has a rollout registered on this cluster (as its old entity or a \
             folded part)"
        ),
    )
}

/// Reads of an old entity follow its rollout's phase: from `read_new` on
/// they are served from the new table (from `new_only` on, refused when it
/// cannot stand in).
impl crate::read::ReadGuard for Registry {
    fn check(&self, entity: TypeId, _table: &'static str) -> Result<Option<crate::read::ReadFrom>> {
        let Some(rollout) = self.get(entity) else {
            return Ok(None);
        };
        match rollout.old_reads() {
            OldReads::Old => Ok(None),
            OldReads::New(from) => Ok(Some(from)),
            OldReads::Refused(reason) => Err(ShardError::Rollout {
                rollout: rollout.name().to_owned(),
                phase: rollout.phase(),
                reason,
            }),
        }
    }
}
