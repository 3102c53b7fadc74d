//! What an instance keeps of its reference tables: the newest version it
//! has seen of each, what it knows of every copy's version, the tables it
//! has registered, and the background catch-up of copies that are behind.

use crate::entity::ReferenceTable;
use crate::error::Result;
use crate::exec::Shards;
use crate::topology::ShardId;
use sea_orm::DatabaseConnection;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

/// The shard whose copy every other one follows.
pub(crate) const SOURCE: ShardId = ShardId(0);

/// What the background task keeps between passes: nothing alive.
pub(super) struct WeakReferences(Weak<Inner>);

impl WeakReferences {
    pub(super) fn upgrade(&self) -> Option<References> {
        self.0.upgrade().map(|inner| References { inner })
    }
}

/// An instance's reference tables (one per cluster, shared by its handles).
#[derive(Clone)]
pub(crate) struct References {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Shards,
    /// The newest version of each table this instance has read or written.
    seen: Mutex<HashMap<&'static str, i64>>,
    /// A version each copy is known to hold (or be past): `(table, shard)`.
    copies: Mutex<HashMap<(&'static str, u32), i64>>,
    tables: Mutex<Vec<&'static dyn ReferenceTable>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Per `(table, shard)`: one catch-up at a time, and when the last one
    /// failed.
    flights: Mutex<HashMap<(&'static str, u32), Arc<Flight>>>,
}

/// The catch-ups of one copy: one at a time (a read that finds the copy
/// behind waits for the one under way instead of starting its own), and
/// the time (ms) the last one failed.
#[derive(Default)]
pub(super) struct Flight {
    running: tokio::sync::Mutex<()>,
    failed_at: Mutex<Option<i64>>,
}

/// How long after a failed catch-up of a copy reads of it are refused
/// without trying again (the background pass tries every second).
const FAILED_HOLDS_MS: i64 = 1_000;

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().ok().and_then(Option::take) {
            task.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl References {
    pub(crate) fn new(shards: Shards) -> Self {
        References {
            inner: Arc::new(Inner {
                shards,
                seen: Mutex::default(),
                copies: Mutex::default(),
                tables: Mutex::default(),
                task: Mutex::default(),
                flights: Mutex::default(),
            }),
        }
    }

    pub(crate) fn shards(&self) -> &Shards {
        &self.inner.shards
    }

    /// The newest version of `table` this instance has seen.
    pub(super) fn seen(&self, table: &'static str) -> i64 {
        lock(&self.inner.seen).get(table).copied().unwrap_or(0)
    }

    /// This instance has seen `version` of `table`.
    pub(super) fn saw(&self, table: &'static str, version: i64) {
        let mut seen = lock(&self.inner.seen);
        let v = seen.entry(table).or_default();
        *v = (*v).max(version);
    }

    /// The version `shard`'s copy of `table` was last seen at.
    pub(super) fn copy(&self, table: &'static str, shard: ShardId) -> i64 {
        lock(&self.inner.copies)
            .get(&(table, shard.0))
            .copied()
            .unwrap_or(0)
    }

    /// `shard`'s copy of `table` holds `version`, as read or written just
    /// now (lower than what was known when the copy lost versions: the
    /// background catch-up and the read fence then see it).
    pub(super) fn copy_is(&self, table: &'static str, shard: ShardId, version: i64) {
        lock(&self.inner.copies).insert((table, shard.0), version);
        crate::metrics::reference_copy_version(table, self.inner.shards.shard_name(shard), version);
    }

    /// The shard whose own pool `conn` is (not a replica's).
    pub(super) fn shard_of(&self, conn: &DatabaseConnection) -> Option<ShardId> {
        let shards = &self.inner.shards;
        (0..shards.topology().shards().len() as u32)
            .map(ShardId)
            .find(|id| std::ptr::eq(shards.shard_conn(*id), conn))
    }

    /// Adds `table` to the registered ones; false when it was there.
    pub(super) fn add_table(&self, table: &'static dyn ReferenceTable) -> bool {
        let mut tables = lock(&self.inner.tables);
        if tables.iter().any(|t| t.entity() == table.entity()) {
            return false;
        }
        tables.push(table);
        true
    }

    /// Starts the background task with `start` (given a weak handle) unless
    /// it runs, or there is no copy to keep (one shard).
    pub(super) fn start_task(
        &self,
        start: impl FnOnce(WeakReferences) -> tokio::task::JoinHandle<()>,
    ) {
        let mut task = lock(&self.inner.task);
        if task.is_none() && self.inner.shards.topology().shards().len() > 1 {
            *task = Some(start(WeakReferences(Arc::downgrade(&self.inner))));
        }
    }

    pub(super) fn tables(&self) -> Vec<&'static dyn ReferenceTable> {
        lock(&self.inner.tables).clone()
    }

    /// How long a step of a catch-up that is not a read's (and of a write
    /// on the source) may take: a mover's step timeout (`[rebalance]
    /// step_timeout_ms`, 60 s by default), or the read timeout when that is
    /// longer. Bounded without a read timeout too: a step waiting on a
    /// lock (a transaction left open on a copy) would otherwise hold the
    /// copy's catch-up, and the background pass with it, for as long.
    pub(crate) fn bulk_bound(&self) -> Option<std::time::Duration> {
        let shards = &self.inner.shards;
        let step = shards.rebalance_settings().step_timeout;
        Some(shards.read_settings().timeout.map_or(step, |t| t.max(step)))
    }

    /// Brings `shard`'s copy of every registered table up to its source
    /// (a bucket move's target, before it takes buckets).
    pub(crate) async fn catch_up_all(&self, shard: ShardId) -> Result<()> {
        for table in self.tables() {
            self.catch_up(table, shard, None).await?;
        }
        Ok(())
    }

    /// `table.catch_up` on `shard`, one at a time per copy: a caller that
    /// finds one under way waits for it. With `need` (a read's fence), the
    /// copy known to be at `need` after the wait is not caught up again,
    /// and a catch-up that failed within the last second is not tried
    /// again: the read gets `Ok(None)` (a copy still behind) at once, so a
    /// copy stuck on a constraint does not make every read of it run a
    /// whole catch-up and hold a connection waiting for the others.
    ///
    /// A read's catch-up, and its wait for one under way, take at most the
    /// read timeout (then `Ok(None)`); any other (the background pass, a
    /// move's, [`Reference::catch_up`](crate::reference::Reference::catch_up))
    /// [`bulk_bound`](Self::bulk_bound) per step, so that a copy that needs
    /// many rows is caught up in the end however short the read timeout.
    pub(super) async fn catch_up(
        &self,
        table: &'static dyn ReferenceTable,
        shard: ShardId,
        need: Option<i64>,
    ) -> Result<Option<i64>> {
        let name = table.table();
        let flight = Arc::clone(
            lock(&self.inner.flights)
                .entry((name, shard.0))
                .or_default(),
        );
        let held = || {
            let now = self.inner.shards.now_ms();
            need.is_some()
                && lock(&flight.failed_at).is_some_and(|at| now >= at && now - at < FAILED_HOLDS_MS)
        };
        if held() {
            return Ok(None);
        }
        // A read's share: half its timeout, so that the read, not its
        // timeout, says the copy is behind.
        let read_share = self.inner.shards.read_settings().timeout.map(|t| t / 2);
        let (bound, _one) = match (need, read_share) {
            (Some(_), Some(within)) => {
                match tokio::time::timeout(within, flight.running.lock()).await {
                    Ok(one) => (read_share, one),
                    Err(_) => return Ok(None),
                }
            }
            (Some(_), None) => (None, flight.running.lock().await),
            (None, _) => (self.bulk_bound(), flight.running.lock().await),
        };
        if let Some(need) = need {
            let known = self.copy(name, shard);
            if known >= need {
                return Ok(Some(known));
            }
            if held() {
                return Ok(None);
            }
        }
        match table.catch_up(self, shard.0 as usize, bound).await {
            Ok(version) => {
                *lock(&flight.failed_at) = None;
                Ok(Some(version))
            }
            Err(e) => {
                *lock(&flight.failed_at) = Some(self.inner.shards.now_ms());
                Err(e)
            }
        }
    }
}
