//! Caches of old and new models by the cluster's clock, and the row helpers they key by.

use crate::clock::Clock;
use crate::entity::ShardedEntity;
use crate::rollout::RowValues;
use sea_orm::{ActiveValue, DbErr, EntityTrait, Iterable, PrimaryKeyToColumn};
use std::sync::Arc;
use std::time::Duration;

/// A cache of one model whose entries live `ttl` by the cluster's clock
/// (so a [`ManualClock`](crate::clock::ManualClock) ages them in tests).
/// Expired entries are dropped when next read; the capacity bounds memory.
pub(super) struct TimedCache<V> {
    entries: moka::sync::Cache<String, (V, i64)>,
    ttl_ms: i64,
    clock: Arc<dyn Clock>,
    metrics: crate::metrics::CacheMetrics,
}

impl<V: Clone + Send + Sync + 'static> TimedCache<V> {
    pub(super) fn new(
        ttl: Duration,
        capacity: u64,
        clock: Arc<dyn Clock>,
        metrics: crate::metrics::CacheMetrics,
    ) -> Self {
        TimedCache {
            entries: moka::sync::Cache::builder().max_capacity(capacity).build(),
            ttl_ms: i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX),
            clock,
            metrics,
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<V> {
        let found = self.lookup(key);
        match &found {
            Some(_) => self.metrics.hit.increment(1),
            None => self.metrics.miss.increment(1),
        }
        found
    }

    fn lookup(&self, key: &str) -> Option<V> {
        let (value, at) = self.entries.get(key)?;
        if crate::clock::now_ms(&*self.clock).saturating_sub(at) >= self.ttl_ms {
            self.entries.invalidate(key);
            return None;
        }
        Some(value)
    }

    pub(super) fn insert(&self, key: String, value: V) {
        self.entries
            .insert(key, (value, crate::clock::now_ms(&*self.clock)));
    }

    pub(super) fn invalidate(&self, key: &str) {
        self.entries.invalidate(key);
    }

    pub(super) fn invalidate_all(&self) {
        self.entries.invalidate_all();
    }
}

/// The model [`crate::key::model_values`] took apart.
pub(super) fn model_from_values<E: ShardedEntity>(
    values: RowValues,
) -> std::result::Result<E::Model, DbErr> {
    let values = values.into_iter().map(ActiveValue::Set).collect();
    let (model, _) = crate::key::active_from_values::<E>(values)?;
    E::__try_into_model(model)
}

/// The cache key of a row: shard key and primary key, as text.
pub(super) fn cache_key(key: &str, pk: &str) -> String {
    format!("{key}\u{1f}{pk}")
}

/// `E`'s primary key column names, as a tuple when there are several.
pub(super) fn pk_names<E: EntityTrait>() -> String {
    let names: Vec<&str> = <E::PrimaryKey as Iterable>::iter()
        .map(|pk| sea_orm::IdenStatic::as_str(&pk.into_column()))
        .collect();
    match names.as_slice() {
        [one] => (*one).to_owned(),
        many => format!("({})", many.join(", ")),
    }
}

pub(super) fn pk_arity<E: EntityTrait>() -> usize {
    <E::PrimaryKey as Iterable>::iter().count()
}
