//! Phase-aware reads through the caches: `get_old` and `get_new`.

use super::*;

impl<Old, New> RolloutHandle<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
    Old::Model: Sync + IntoActiveModel<Old::ActiveModel>,
    Old::ActiveModel: TryIntoModel<Old::Model> + Send + Sync,
    New::Model: Sync + IntoActiveModel<New::ActiveModel>,
    New::ActiveModel: Send,
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
    ) -> Result<Option<Old::Model>> {
        crate::read::Find::new(self.shards.clone(), None, None, Old::find())
            .key(key.clone())
            .filter(pk_condition::<Old>(pk))
            .one()
            .await
    }

    pub(super) async fn read_new_table(
        &self,
        key: &KeyOf<Old>,
        pk: &[Value],
    ) -> Result<Option<New::Model>> {
        crate::read::Find::new(self.shards.clone(), None, None, New::find())
            .key(key.clone())
            .filter(pk_condition::<New>(pk))
            .one()
            .await
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
}
