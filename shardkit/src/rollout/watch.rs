//! Instances that write a rollout's old entity without having registered
//! the rollout. Such an instance neither dual-writes nor fills caches, so
//! the rollout's phases do not hold for its writes; it should be visible.
//!
//! Every instance that registers a rollout records the old table in
//! `shardkit_rollout_instances` and renews the row on every phase refresh.
//! An instance re-reads those rows of every group in the background every
//! [`RECHECK`], from its first write on (the cluster's periodic task, which
//! stops with the cluster); a write of an entity this
//! instance has no rollout for, whose table a live row names, is logged once
//! at warn level and listed by
//! [`Cluster::rollouts_not_registered`](crate::Cluster::rollouts_not_registered).
//! Until a read finds a live row, a write pays two atomic loads here (no
//! clock read).

use crate::entity::{ShardedEntity, table_name};
use crate::exec::Shards;
use crate::rollout::state::INSTANCES_TABLE;
use sea_orm::ConnectionTrait;
use sea_orm::sea_query::{Alias, Query};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the rows are re-read.
pub(crate) const RECHECK: Duration = Duration::from_secs(30);

/// A row whose instance has not renewed it for this many refresh intervals
/// (and at least [`RECHECK`]) is a stopped instance's: not counted.
const LIVE_REFRESHES: i64 = 10;

/// What the rows said, as last read.
#[derive(Default)]
struct Seen {
    /// Old table → the rollout another instance registered for it.
    tables: HashMap<String, String>,
    /// (table, rollout) this instance wrote while not registered.
    written: HashSet<(String, String)>,
}

/// The old tables of rollouts registered by live instances.
pub(crate) struct Watch {
    /// Whether the periodic read runs (from the first write on).
    started: AtomicBool,
    /// Whether the last read found any live rollout.
    any: AtomicBool,
    seen: Mutex<Seen>,
}

impl Default for Watch {
    fn default() -> Self {
        Watch {
            started: AtomicBool::new(false),
            any: AtomicBool::new(false),
            seen: Mutex::new(Seen::default()),
        }
    }
}

impl Watch {
    /// Notes a write of `E`, which this instance has no rollout for.
    pub(crate) fn wrote<E: ShardedEntity>(self: &Arc<Self>, shards: &Shards) {
        if !self.started.load(Ordering::Acquire) && !self.started.swap(true, Ordering::AcqRel) {
            let watch = Arc::clone(self);
            crate::exec::periodic::spawn(
                shards,
                RECHECK,
                crate::exec::periodic::FirstPass::Now,
                move |shards: Shards| {
                    let watch = Arc::clone(&watch);
                    async move {
                        let tables = read_live_tables(&shards).await;
                        watch.any.store(!tables.is_empty(), Ordering::Release);
                        watch.seen.lock().unwrap_or_else(|p| p.into_inner()).tables = tables;
                        std::ops::ControlFlow::Continue(())
                    }
                },
            );
        }
        if !self.any.load(Ordering::Acquire) {
            return;
        }
        let table = table_name::<E>();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rollout) = seen.tables.get(table).cloned()
            && seen.written.insert((table.to_owned(), rollout.clone()))
        {
            tracing::warn!(
                rollout = %rollout,
                table,
                "this instance writes `{table}`, the old entity of rollout `{rollout}` that another \
                 instance registered, without registering the rollout: its writes are neither \
                 dual-written nor cached; register the rollout on every instance that writes it"
            );
        }
    }

    /// The (old table, rollout) pairs this instance wrote without having
    /// registered the rollout.
    pub(crate) fn not_registered(&self) -> Vec<(String, String)> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut all: Vec<(String, String)> = seen.written.iter().cloned().collect();
        all.sort();
        all
    }
}

/// Old table → rollout, for every rollout a live instance registered, in
/// every group. A group whose rows cannot be read is skipped (logged).
async fn read_live_tables(shards: &Shards) -> HashMap<String, String> {
    let mut tables = HashMap::new();
    let now = shards.now_ms();
    let mut asked = Vec::new();
    for group in shards.topology().group_names() {
        let Ok(ids) = shards.topology().shards_of(group) else {
            continue;
        };
        let Some(&id) = ids.first() else { continue };
        if asked.contains(&id) {
            continue;
        }
        asked.push(id);
        let (db, shard) = (shards.shard_conn(id), shards.shard_name(id));
        let stmt = Query::select()
            .columns(["old_table", "rollout", "seen_ms", "refresh_ms"].map(Alias::new))
            .from(Alias::new(INSTANCES_TABLE))
            .to_owned();
        let rows = match db.query_all(&stmt).await {
            Ok(rows) => rows,
            Err(err) => {
                tracing::debug!(shard, error = %err, "rollout instances not read");
                continue;
            }
        };
        for row in rows {
            let (Ok(table), Ok(rollout), Ok(seen), Ok(refresh)) = (
                row.try_get::<String>("", "old_table"),
                row.try_get::<String>("", "rollout"),
                row.try_get::<i64>("", "seen_ms"),
                row.try_get::<i64>("", "refresh_ms"),
            ) else {
                continue;
            };
            let live_for = std::cmp::max(
                refresh.saturating_mul(LIVE_REFRESHES),
                RECHECK.as_millis() as i64,
            );
            if now.saturating_sub(seen) <= live_for {
                // A fold's row lists its root's and its parts' tables.
                for table in table.split(',') {
                    tables.insert(table.to_owned(), rollout.clone());
                }
            }
        }
    }
    tables
}
