//! Instances that write a rollout's old entity without having registered
//! the rollout. Such an instance neither dual-writes nor fills caches, so
//! the rollout's phases do not hold for its writes; it should be visible.
//!
//! Every instance that registers a rollout records the old table in
//! `shardkit_rollout_instances`. A write of an entity this instance has no
//! rollout for checks a per-group list of those tables, re-read in the
//! background at most every [`RECHECK`]; a table on it is logged once at
//! warn level and listed by [`Cluster::rollouts_not_registered`](crate::Cluster::rollouts_not_registered).

use super::*;
use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Instant;

/// How often a group's list of old tables is re-read.
pub(crate) const RECHECK: Duration = Duration::from_secs(30);

/// What one group's `shardkit_rollout_instances` says, as last read.
#[derive(Default)]
struct GroupWatch {
    read_at: Option<Instant>,
    reading: bool,
    /// Old table → the rollout registered for it elsewhere.
    tables: HashMap<String, String>,
    /// Tables this instance wrote while not registered, with the rollout.
    written: HashSet<(String, String)>,
}

/// Per group, the old tables of rollouts registered by any instance.
#[derive(Default)]
pub(crate) struct Watch {
    groups: Mutex<HashMap<&'static str, GroupWatch>>,
}

impl Watch {
    /// Notes a write of `E`, which this instance has no rollout for.
    pub(crate) fn wrote<E: ShardedEntity>(self: &Arc<Self>, shards: &Shards) {
        let group = <E::Group as EntityGroup>::NAME;
        let table = table_name::<E>();
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        let watch = groups.entry(group).or_default();
        if let Some(rollout) = watch.tables.get(table)
            && watch.written.insert((table.to_owned(), rollout.clone()))
        {
            tracing::warn!(
                rollout = %rollout,
                table,
                "this instance writes `{table}`, the old entity of rollout `{rollout}` that another \
                 instance registered, without registering the rollout: its writes are neither \
                 dual-written nor cached; register the rollout on every instance that writes it"
            );
        }
        let due = watch.read_at.is_none_or(|at| at.elapsed() >= RECHECK);
        if due && !watch.reading {
            watch.reading = true;
            let shards = shards.for_task();
            let me = Arc::clone(self);
            tokio::spawn(async move {
                let read = read_old_tables::<E>(&shards).await;
                let mut groups = me.groups.lock().unwrap_or_else(|p| p.into_inner());
                let watch = groups.entry(group).or_default();
                watch.reading = false;
                watch.read_at = Some(Instant::now());
                match read {
                    Ok(tables) => watch.tables = tables,
                    Err(err) => {
                        tracing::debug!(group, error = %err.report(), "rollout instances not read")
                    }
                }
            });
        }
    }

    /// The (old table, rollout) pairs this instance wrote without having
    /// registered the rollout.
    pub(crate) fn not_registered(&self) -> Vec<(String, String)> {
        let groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        let mut all: Vec<(String, String)> = groups
            .values()
            .flat_map(|w| w.written.iter().cloned())
            .collect();
        all.sort();
        all
    }
}

/// Old table → rollout, for every rollout of `E`'s group registered by any
/// instance.
async fn read_old_tables<E: ShardedEntity>(shards: &Shards) -> Result<HashMap<String, String>> {
    let (db, shard) = state_db::<E>(shards)?;
    let stmt = Query::select()
        .columns(["old_table", "rollout"].map(Alias::new))
        .distinct()
        .from(Alias::new(INSTANCES_TABLE))
        .to_owned();
    let rows = db.query_all(&stmt).await.map_err(|e| ShardError::Db {
        origin: Box::new(crate::error::Origin::table(
            crate::error::Subsystem::Rollout,
            INSTANCES_TABLE,
        )),
        shard: shard.to_owned(),
        operation: format!("read {INSTANCES_TABLE}"),
        source: e,
    })?;
    let mut tables = HashMap::new();
    for row in rows {
        let (Ok(table), Ok(rollout)) = (
            row.try_get::<String>("", "old_table"),
            row.try_get::<String>("", "rollout"),
        ) else {
            continue;
        };
        tables.insert(table, rollout);
    }
    Ok(tables)
}
