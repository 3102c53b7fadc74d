//! Phase-aware reads through the caches: `get_old` and `get_new`.

use crate::entity::{EntityGroup, ShardKey, ShardedEntity};
use crate::error::Result;
use crate::exec::Consistency;
use crate::exec::keyset::{pk_condition, tuple_text};
use crate::phase::Phase;
use crate::read::KeyOf;
use crate::rollout::parts::Parts;
use crate::rollout::{RolloutHandle, cache_key};
use sea_orm::sea_query::IntoValueTuple;
use sea_orm::{PrimaryKeyTrait, QueryFilter, Value};
use std::sync::Arc;

impl<Old, New> RolloutHandle<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    /// The phase a read acts on, its primary key values and its cache key.
    pub(super) fn read_start(
        &self,
        key: &KeyOf<Old>,
        pk: <Old::PrimaryKey as PrimaryKeyTrait>::ValueType,
    ) -> (Phase, Vec<Value>, String) {
        let pk: Vec<Value> = pk.into_value_tuple().into_iter().collect();
        let ck = cache_key(&key.to_directory_text(), &tuple_text(&pk));
        (self.phase(), pk, ck)
    }

    pub(super) async fn read_old_table(
        &self,
        key: &KeyOf<Old>,
        pk: &[Value],
        consistency: &Consistency,
    ) -> Result<Option<Old::Model>> {
        self.read_table::<Old>(key, pk, consistency).await
    }

    pub(super) async fn read_new_table(
        &self,
        key: &KeyOf<Old>,
        pk: &[Value],
        consistency: &Consistency,
    ) -> Result<Option<New::Model>> {
        self.read_table::<New>(key, pk, consistency).await
    }

    /// The row of `E` (the old or the new entity) with primary key `pk`,
    /// routed by the bucket moves' guard alone (the rollout chose the table).
    async fn read_table<E: ShardedEntity<Group = Old::Group>>(
        &self,
        key: &KeyOf<Old>,
        pk: &[Value],
        consistency: &Consistency,
    ) -> Result<Option<E::Model>> {
        crate::read::Find::new(
            self.shards.clone(),
            None,
            Some(Arc::clone(&self.moves)),
            E::find(),
        )
        .key(key.clone())
        .filter(pk_condition::<E>(pk))
        .consistency(consistency.clone())
        .one()
        .await
    }

    /// The consistency a rollout read runs with: a read of a fold before
    /// `read_new` reads its parts on the shard, so its root is read there
    /// too (a root from a replica folded with parts from the shard would
    /// mix two moments).
    fn read_consistency(&self, phase: Phase, consistency: &Consistency) -> Consistency {
        if self.shared.folds() && !phase.reads_new() {
            Consistency::Primary
        } else {
            consistency.clone()
        }
    }

    pub(super) fn to_old(&self, new: &New::Model) -> Result<Old::Model> {
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
        self.get_old_with(key, pk, &Consistency::Primary).await
    }

    /// [`get_old`](Self::get_old) with the read's consistency (see
    /// [`Consistency`]): a read that may be answered by a replica skips
    /// this instance's caches (an entry cached from the shard is not what
    /// the replica holds, and a replica's row must not replace it) and
    /// reads the tables on a replica as the consistency allows.
    pub async fn get_old_with(
        &self,
        key: KeyOf<Old>,
        pk: <Old::PrimaryKey as PrimaryKeyTrait>::ValueType,
        consistency: &Consistency,
    ) -> Result<Option<Old::Model>> {
        let (phase, pk, ck) = self.read_start(&key, pk);
        let consistency = self.read_consistency(phase, consistency);
        let caches = phase.caches() && matches!(consistency, Consistency::Primary);
        if caches && let Some(hit) = self.shared.old_cache.get(&ck) {
            return Ok(Some(hit));
        }
        let row = if phase.reads_new() {
            let new = match caches.then(|| self.shared.new_cache.get(&ck)).flatten() {
                Some(new) => Some(new),
                None => self.read_new_table(&key, &pk, &consistency).await?,
            };
            match new {
                Some(new) => {
                    let old = self.to_old(&new)?;
                    if caches {
                        self.shared.new_cache.insert(ck.clone(), new);
                    }
                    Some(old)
                }
                None => None,
            }
        } else {
            self.read_old_table(&key, &pk, &consistency).await?
        };
        if let (true, Some(row)) = (caches, &row) {
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
        self.get_new_with(key, pk, &Consistency::Primary).await
    }

    /// [`get_new`](Self::get_new) with the read's consistency, as
    /// [`get_old_with`](Self::get_old_with). A fold read before `read_new`
    /// reads its parts, and so its root, on the shard.
    pub async fn get_new_with(
        &self,
        key: KeyOf<Old>,
        pk: <Old::PrimaryKey as PrimaryKeyTrait>::ValueType,
        consistency: &Consistency,
    ) -> Result<Option<New::Model>> {
        let (phase, pk, ck) = self.read_start(&key, pk);
        let consistency = self.read_consistency(phase, consistency);
        let caches = phase.caches() && matches!(consistency, Consistency::Primary);
        if caches {
            if let Some(hit) = self.shared.new_cache.get(&ck) {
                return Ok(Some(hit));
            }
            // A fold needs the parts, which no cache holds.
            if phase.writes_old()
                && !self.shared.folds()
                && let Some(old) = self.shared.old_cache.get(&ck)
            {
                let new = self.shared.convert_alone(&old);
                self.shared.new_cache.insert(ck, new.clone());
                return Ok(Some(new));
            }
        }
        let row = if phase.reads_new() {
            self.read_new_table(&key, &pk, &consistency).await?
        } else {
            match self.read_old_table(&key, &pk, &consistency).await? {
                Some(old) => {
                    let new = self.fold_read(&key, &old).await?;
                    if caches {
                        self.shared.old_cache.insert(ck.clone(), old);
                    }
                    Some(new)
                }
                None => None,
            }
        };
        if let (true, Some(row)) = (caches, &row) {
            self.shared.new_cache.insert(ck, row.clone());
        }
        Ok(row)
    }

    /// The parts folded into `roots` (all under `key`), read on their shard
    /// under its breaker and the read timeout.
    async fn parts_read(&self, key: &KeyOf<Old>, roots: &[Old::Model]) -> Result<Vec<Parts>> {
        let mut parts: Vec<Parts> = roots.iter().map(|_| Parts::default()).collect();
        if !self.shared.folds() || roots.is_empty() {
            return Ok(parts);
        }
        let id = self.shards.route::<Old::Group>(key).await?.shard;
        let shard = self.shards.shard_name(id);
        let db = sea_orm::DatabaseExecutor::Connection(self.shards.shard_conn(id));
        let timeout = self.shards.read_settings().timeout;
        self.shards
            .bounded(id, <Old::Group as EntityGroup>::NAME, timeout, async {
                for part in &self.shared.parts {
                    part.load(&db, roots, &mut parts, false)
                        .await
                        .map_err(|e| {
                            self.shared
                                .db_err(shard, format!("select {}", part.table()), e)
                        })?;
                }
                Ok(())
            })
            .await?;
        Ok(parts)
    }

    /// Before `read_new`: the new model of `old`, folded with its parts.
    pub(super) async fn fold_read(&self, key: &KeyOf<Old>, old: &Old::Model) -> Result<New::Model> {
        let parts = self.parts_read(key, std::slice::from_ref(old)).await?;
        Ok((self.shared.to_new)(old, &parts[0]))
    }

    /// The parts folded into the root `pk` under `key`, or `None` when the
    /// root does not exist: from the old tables before `read_new`, then
    /// from the new row, split with [`Rollout::to_old_parts`](crate::rollout::Rollout::to_old_parts). What old
    /// code reads instead of a part's table once that table is no longer
    /// written (`new_only` on).
    pub async fn get_parts(
        &self,
        key: KeyOf<Old>,
        pk: <Old::PrimaryKey as PrimaryKeyTrait>::ValueType,
    ) -> Result<Option<Parts>> {
        let (phase, pk, _) = self.read_start(&key, pk);
        if phase.reads_new() {
            let Some(new) = self
                .read_new_table(&key, &pk, &Consistency::Primary)
                .await?
            else {
                return Ok(None);
            };
            let split = self.shared.to_old_parts.as_ref().ok_or_else(|| {
                self.shared
                    .refused_err("reading the parts from the new table needs Rollout::to_old_parts")
            })?;
            return Ok(Some(split(&new)));
        }
        let Some(root) = self
            .read_old_table(&key, &pk, &Consistency::Primary)
            .await?
        else {
            return Ok(None);
        };
        Ok(self
            .parts_read(&key, std::slice::from_ref(&root))
            .await?
            .pop())
    }

    /// Drops every cache entry of this instance.
    pub fn clear_caches(&self) {
        self.shared.old_cache.invalidate_all();
        self.shared.new_cache.invalidate_all();
    }
}
