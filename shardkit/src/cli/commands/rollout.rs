//! `rollout status`, `advance`, `retreat`, `backfill` and `verify`:
//! registered rollouts.

use crate::cli::args::RolloutAction;
use crate::cli::commands::output::{Outcome, table};
use crate::cli::commands::verify::verify_outcome;
use crate::cli::progress::Progress;
use crate::cli::registry::{AdminRollout, Registry};
use crate::cluster::Cluster;
use crate::error::{Result, ShardError};
use crate::rollout::{Phase, RolloutBackfill};
use crate::verify::{VerifyOptions, VerifyReport};
use serde_json::{Value, json};
use std::time::Duration;

/// Runs a `rollout` action; `json` silences the progress output.
pub(super) async fn rollout(
    cluster: &Cluster,
    registry: &Registry,
    action: RolloutAction,
    json: bool,
) -> Result<Outcome> {
    let named = |name: &str| {
        registry
            .rollouts
            .iter()
            .find(|r| r.name() == name)
            .ok_or_else(|| {
                ShardError::config(
                    "shardctl",
                    format!(
                        "no registered rollout is named `{name}` (registered: {}); add it with \
                         Registry::rollout",
                        registry
                            .rollouts
                            .iter()
                            .map(|r| r.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })
    };
    match action {
        RolloutAction::Status { name } => {
            let mut all = Vec::new();
            let mut text = String::new();
            for decl in &registry.rollouts {
                if name.as_deref().is_some_and(|n| n != decl.name()) {
                    continue;
                }
                let (j, t) = rollout_status(decl.register(cluster).await).await?;
                all.push(j);
                text.push_str(&t);
            }
            if let Some(name) = name.filter(|_| all.is_empty()) {
                named(&name)?;
            }
            Ok(Outcome {
                json: Value::Array(all),
                text,
                problem: false,
            })
        }
        RolloutAction::Advance { name } => {
            let handle = named(&name)?.register(cluster).await?;
            let progress = Progress::new(format!("rollout {name} advance"), None, json);
            let mut on_wait = |next: Phase, left: Duration| {
                progress.report(
                    0,
                    None,
                    &format!("to {next}: waiting {left:.0?} for the gap"),
                );
            };
            let phase = handle.advance(&mut on_wait).await?;
            Ok(Outcome {
                json: json!({ "name": name, "phase": phase.to_string() }),
                text: format!("rollout {name}: now {phase}\n"),
                problem: false,
            })
        }
        RolloutAction::Retreat { name } => {
            let handle = named(&name)?.register(cluster).await?;
            let phase = handle.retreat().await?;
            Ok(Outcome {
                json: json!({ "name": name, "phase": phase.to_string() }),
                text: format!("rollout {name}: now {phase}\n"),
                problem: false,
            })
        }
        RolloutAction::Backfill { name, chunk } => {
            let handle = named(&name)?.register(cluster).await?;
            let progress = Progress::new(format!("rollout {name} backfill"), None, json);
            let control = progress.control(|bar, p: &RolloutBackfill| {
                let rate = bar.rate(p.rows);
                bar.report(
                    p.shards_done as u64,
                    Some(p.shards as u64),
                    &format!("shards, {} rows, {rate:.0} rows/s", p.rows),
                );
            });
            // Right after the move to dual_write the backfill must wait out
            // the gap; an operator's command waits instead of failing.
            let done = match handle.backfill(chunk, control.clone()).await {
                Err(ShardError::RolloutTooSoon { wait_ms, .. }) => {
                    if !json {
                        eprintln!(
                            "rollout {name}: waiting {wait_ms} ms for the gap after dual_write began"
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(wait_ms)).await;
                    handle.backfill(chunk, control).await?
                }
                other => other?,
            };
            Ok(Outcome {
                json: json!({
                    "name": name, "rows": done.rows, "shards_done": done.shards_done,
                    "shards": done.shards, "finished": done.finished,
                }),
                text: format!(
                    "rollout {name}: {} rows copied, {}/{} shards, {}\n",
                    done.rows,
                    done.shards_done,
                    done.shards,
                    if done.finished {
                        "finished"
                    } else {
                        "stopped (run again to resume)"
                    }
                ),
                problem: !done.finished,
            })
        }
        RolloutAction::Verify {
            name,
            repair,
            resume,
            chunk,
        } => {
            let handle = named(&name)?.register(cluster).await?;
            let mut opts = VerifyOptions::default().chunk(chunk);
            if repair {
                opts = opts.repair();
            }
            if resume {
                opts = opts.resume();
            }
            let progress = Progress::new(format!("rollout {name} verify"), None, json);
            let control = progress.control(|bar, r: &VerifyReport| {
                let rate = bar.rate(r.rows);
                bar.report(
                    r.chunks,
                    None,
                    &format!(
                        "chunks, {} rows, {} differences, {rate:.0} rows/s",
                        r.rows,
                        r.differences()
                    ),
                );
            });
            let report = handle.verify(opts, control).await?;
            Ok(verify_outcome(&format!("rollout {name}"), &report))
        }
    }
}

/// A registered rollout's phase, gap, backfill state and instances, as
/// JSON and as text.
pub(super) async fn rollout_status(
    handle: Result<Box<dyn AdminRollout>>,
) -> Result<(Value, String)> {
    let status = handle?.status().await?;
    let mut t = table(&["instance", "cache ttl", "refresh", "last seen (ms)"]);
    let instances: Vec<Value> = status
        .instances
        .iter()
        .map(|i| {
            t.add_row(vec![
                i.name.clone(),
                format!("{:?}", i.cache_ttl),
                format!("{:?}", i.refresh_interval),
                i.seen_ms.to_string(),
            ]);
            json!({
                "name": i.name,
                "cache_ttl_ms": i.cache_ttl.as_millis() as u64,
                "refresh_ms": i.refresh_interval.as_millis() as u64,
                "seen_ms": i.seen_ms,
                "this_instance": i.this_instance,
            })
        })
        .collect();
    let text = format!(
        "rollout {}: phase {}, gap {:?}, backfilled {}\n{t}\n",
        status.name, status.phase, status.gap, status.backfilled
    );
    Ok((
        json!({
            "name": status.name,
            "phase": status.phase.to_string(),
            "changed_ms": status.changed_ms,
            "gap_ms": status.gap.as_millis() as u64,
            "backfilled": status.backfilled,
            "instances": instances,
        }),
        text,
    ))
}
