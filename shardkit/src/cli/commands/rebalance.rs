//! `rebalance plan`, `start`, `split`, `status`, `run` and `abort`: bucket
//! moves of a `movable` group, and the moves `status` lists.

use crate::cli::args::RebalanceAction;
use crate::cli::commands::output::{Outcome, table};
use crate::cli::progress::Progress;
use crate::cli::registry::Registry;
use crate::cluster::Cluster;
use crate::error::{Result, ShardError};
use crate::rebalance::{AnyGroup, MovePlan, MoveProgress, MoveStatus, Rebalance};
use crate::topology::{LiveMap, RangeBound, RangeUnit};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// The columns of a table of moves (rows from [`move_row`]).
pub(super) const MOVE_COLUMNS: [&str; 6] = [
    "move",
    "phase",
    "buckets",
    "rows copied",
    "pending",
    "error",
];

/// Moves of `group`, carrying the registered entities of the group in the
/// order they were registered.
pub(super) fn moves_of(
    cluster: &Cluster,
    registry: &Registry,
    group: &str,
) -> Result<Rebalance<AnyGroup>> {
    let mut entities = registry.entities.iter().filter(|e| e.group() == group);
    let Some(first) = entities.next() else {
        cluster.topology().placement(group)?;
        return Err(ShardError::Rebalance {
            group: group.to_owned(),
            id: None,
            reason: "no entity of the group is registered: add each with `Registry::entity`, parents before children".to_owned(),
        });
    };
    entities.try_fold(first.moves(cluster)?, |moves, entity| {
        entity.carried_by(moves)
    })
}

/// A move for `--json`.
pub(super) fn move_json(m: &MoveStatus) -> Value {
    json!({
        "id": m.id, "group": m.group, "target": m.target, "phase": m.phase.as_str(),
        "buckets": m.buckets.iter().map(|(b, s)| json!({ "bucket": b, "from": s })).collect::<Vec<_>>(),
        "rows_copied": m.rows_copied, "changes_applied": m.changes_applied,
        "pending_changes": m.pending_changes, "cutover_ms": m.cutover_ms, "error": m.error,
    })
}

/// A move as a row under [`MOVE_COLUMNS`].
pub(super) fn move_row(m: &MoveStatus) -> Vec<String> {
    vec![
        m.id.to_string(),
        m.phase.to_string(),
        format!("{} → {}", m.buckets.len(), m.target),
        m.rows_copied.to_string(),
        m.pending_changes.to_string(),
        m.error.clone().unwrap_or_default(),
    ]
}

/// Runs a `rebalance` action; `json` silences the progress output.
pub(super) async fn rebalance(
    cluster: &Cluster,
    registry: &Registry,
    action: RebalanceAction,
    json: bool,
) -> Result<Outcome> {
    match action {
        RebalanceAction::Plan {
            group,
            to,
            buckets,
            range_at,
        } => {
            let moves = moves_of(cluster, registry, &group)?;
            let plan = plan_of(&moves, &to, buckets, range_at).await?;
            let mut from: BTreeMap<&str, usize> = Default::default();
            for (_, s) in &plan.buckets {
                *from.entry(s.as_str()).or_default() += 1;
            }
            Ok(Outcome {
                json: json!({
                    "group": plan.group, "target": plan.target,
                    "buckets": plan.buckets.iter().map(|(b, s)| json!({ "bucket": b, "from": s })).collect::<Vec<_>>(),
                }),
                text: format!(
                    "{} buckets of {} to {}: {}\n",
                    plan.buckets.len(),
                    plan.group,
                    plan.target,
                    from.iter()
                        .map(|(s, n)| format!("{n} from {s}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                problem: false,
            })
        }
        RebalanceAction::Start {
            group,
            to,
            buckets,
            range_at,
        } => {
            let moves = moves_of(cluster, registry, &group)?;
            let plan = plan_of(&moves, &to, buckets, range_at).await?;
            let started = moves.start(&plan).await?;
            run_move(moves, started.id, json).await
        }
        RebalanceAction::Run { group, id } => {
            run_move(moves_of(cluster, registry, &group)?, id, json).await
        }
        RebalanceAction::Abort { group, id } => {
            let done = moves_of(cluster, registry, &group)?.abort(id).await?;
            Ok(Outcome {
                json: move_json(&done),
                text: format!("move #{id}: {}; the sources own its buckets\n", done.phase),
                problem: false,
            })
        }
        RebalanceAction::Split { group, at } => {
            let moves = moves_of(cluster, registry, &group)?;
            let at = moves.bound_at(&at)?;
            let split = moves.split_at_bound(at).await?;
            let ranges = moves.ranges().await?;
            Ok(Outcome {
                json: json!({
                    "group": group,
                    "epoch": split.epoch,
                    "retired": range_json(cluster, &split.retired),
                    "left": range_json(cluster, &split.left),
                    "right": range_json(cluster, &split.right),
                    "ranges": ranges.iter().map(|r| range_json(cluster, r)).collect::<Vec<_>>(),
                }),
                text: format!(
                    "{group}: {} split into {} and {} on {} (map epoch {})\n",
                    split.retired,
                    split.left,
                    split.right,
                    cluster.topology().shard(split.left.shard).name,
                    split.epoch
                ),
                problem: false,
            })
        }
        RebalanceAction::Status { group, all } => {
            let moves = moves_of(cluster, registry, &group)?;
            let ranges = match cluster.topology().live_owners(&group)? {
                Some(LiveMap::Ranges(_)) => Some(moves.ranges().await?),
                _ => None,
            };
            let list = moves.list(all).await?;
            let epoch = cluster
                .topology()
                .live_owners(&group)?
                .map_or(0, |o| o.epoch());
            let mut t = table(&MOVE_COLUMNS);
            for m in &list {
                t.add_row(move_row(m));
            }
            let shown = ranges.as_ref().map_or(String::new(), |ranges| {
                ranges
                    .iter()
                    .map(|r| format!("  {r} on {}\n", cluster.topology().shard(r.shard).name))
                    .collect()
            });
            Ok(Outcome {
                json: json!({
                    "group": group,
                    "epoch": epoch,
                    "moves": list.iter().map(move_json).collect::<Vec<_>>(),
                    "ranges": ranges.map(|r| r.iter().map(|r| range_json(cluster, r)).collect::<Vec<_>>()),
                }),
                text: format!("{group}: bucket map epoch {epoch}\n{shown}{t}\n"),
                problem: list
                    .iter()
                    .any(|m| m.error.is_some() && !m.phase.is_finished()),
            })
        }
    }
}

/// The plan `plan` and `start` run: the given buckets, the range holding a
/// key, or an even-out plan.
async fn plan_of(
    moves: &Rebalance<AnyGroup>,
    to: &str,
    buckets: Vec<u32>,
    range_at: Option<String>,
) -> Result<MovePlan> {
    match range_at {
        Some(key) => {
            let at = moves.bound_at(&key)?;
            moves.plan_range_at(&at, to).await
        }
        None if buckets.is_empty() => moves.plan_even_out(to).await,
        None => moves.plan_buckets(buckets, to).await,
    }
}

/// A range for `--json`: its id, bounds and shard.
fn range_json(cluster: &Cluster, r: &RangeUnit) -> Value {
    let bound = |b: &Option<RangeBound>| match b {
        None => Value::Null,
        Some(RangeBound::Int(v)) => json!(v),
        Some(RangeBound::Text(v)) => json!(v),
    };
    json!({
        "id": r.id,
        "from": bound(&r.from),
        "to": bound(&r.to),
        "shard": cluster.topology().shard(r.shard).name,
    })
}

/// Runs move `id` with a progress bar; Ctrl-C stops it at a chunk boundary.
async fn run_move(moves: Rebalance<AnyGroup>, id: i64, json: bool) -> Result<Outcome> {
    let progress = Progress::new(format!("move #{id}"), None, json);
    let moves = moves.control(progress.control(|bar, p: &MoveProgress| {
        bar.report(
            p.rows_copied,
            Some(p.rows_estimated.max(p.rows_copied)),
            &format!(
                "{}: {:.0} rows/s, {} keys behind",
                p.phase, p.rows_per_sec, p.pending_changes
            ),
        );
    }));
    let done = moves.run(id).await?;
    drop(progress);
    let text = if done.phase.is_finished() {
        format!(
            "move #{id}: {}, {} rows copied, {} keys replayed\n",
            done.phase, done.rows_copied, done.changes_applied
        )
    } else {
        format!(
            "move #{id}: stopped in {} (rebalance run to go on)\n",
            done.phase
        )
    };
    Ok(Outcome {
        json: move_json(&done),
        text,
        problem: false,
    })
}
