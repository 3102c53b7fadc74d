//! `outbox status|run|retry|discard` and `saga status`: the messages
//! between keys, and the sagas.

use crate::cli::args::{OutboxAction, SagaAction};
use crate::cli::commands::output::{Outcome, table};
use crate::cli::progress::Progress;
use crate::cli::registry::Registry;
use crate::cluster::Cluster;
use crate::error::Result;
use crate::outbox::{Outbox, RelayReport};
use serde_json::json;
use std::fmt::Write as _;

fn configured(cluster: &Cluster, registry: &Registry) -> Outbox {
    match &registry.outbox {
        Some(configure) => configure(cluster.outbox()),
        None => cluster.outbox(),
    }
}

pub(super) async fn outbox(
    cluster: &Cluster,
    registry: &Registry,
    action: OutboxAction,
    json: bool,
) -> Result<Outcome> {
    let outbox = configured(cluster, registry);
    match action {
        OutboxAction::Status => {
            let status = outbox.status().await?;
            let mut t = table(&[
                "shard",
                "pending",
                "oldest pending (ms ago)",
                "parked",
                "error",
            ]);
            let now = cluster.shards().now_ms();
            for s in &status.shards {
                t.add_row(vec![
                    s.shard.clone(),
                    s.pending.to_string(),
                    s.oldest_pending_ms
                        .map_or_else(|| "-".to_owned(), |at| (now - at).max(0).to_string()),
                    s.parked_count.to_string(),
                    s.error.clone().unwrap_or_default(),
                ]);
            }
            let mut text = format!("{t}\n");
            let parked: Vec<_> = status.shards.iter().flat_map(|s| &s.parked).collect();
            if !parked.is_empty() {
                let mut p = table(&[
                    "parked message",
                    "kind",
                    "from",
                    "to",
                    "attempts",
                    "last error",
                ]);
                for m in &parked {
                    p.add_row(vec![
                        m.id.clone(),
                        m.kind.clone(),
                        format!("{} {}", m.from.0, m.from.1),
                        format!("{} {}", m.to.0, m.to.1),
                        m.attempts.to_string(),
                        m.last_error.clone().unwrap_or_default(),
                    ]);
                }
                let _ = writeln!(text, "{p}\n`shardctl outbox retry ID` or `discard ID`");
            }
            let problem = status
                .shards
                .iter()
                .any(|s| s.error.is_some() || s.parked_count > 0);
            Ok(Outcome {
                json: serde_json::to_value(&status).unwrap_or_default(),
                text,
                problem,
            })
        }
        OutboxAction::Run { once } => {
            let progress = Progress::new("outbox relay", None, json);
            let mut total = RelayReport::default();
            loop {
                total.add(outbox.deliver().await?);
                progress.report(
                    total.applied,
                    None,
                    &format!("{} applied, {} parked", total.applied, total.parked),
                );
                if once || progress.stopped() {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                if progress.stopped() {
                    break;
                }
            }
            Ok(Outcome {
                json: serde_json::to_value(total).unwrap_or_default(),
                text: format!(
                    "applied {}, already applied {}, failed {}, parked {}, put off {}, shards not read {}\n",
                    total.applied,
                    total.duplicates,
                    total.failed,
                    total.parked,
                    total.deferred,
                    total.shards_failed
                ),
                problem: total.parked > 0 || total.shards_failed > 0,
            })
        }
        OutboxAction::Retry { id } => {
            outbox.retry(&id).await?;
            Ok(Outcome {
                json: json!({ "retried": id }),
                text: format!("message {id} is pending again\n"),
                problem: false,
            })
        }
        OutboxAction::Discard { id } => {
            outbox.discard(&id).await?;
            Ok(Outcome {
                json: json!({ "discarded": id }),
                text: format!("message {id} discarded (not applied)\n"),
                problem: false,
            })
        }
    }
}

pub(super) async fn saga(cluster: &Cluster, action: SagaAction) -> Result<Outcome> {
    match action {
        SagaAction::Status { all } => {
            let sagas = cluster.saga_status(all).await?;
            let mut t = table(&[
                "saga", "name", "origin", "state", "step", "attempts", "error",
            ]);
            for s in &sagas {
                t.add_row(vec![
                    s.id.clone(),
                    s.name.clone(),
                    format!("{} {}", s.origin.0, s.origin.1),
                    serde_json::to_value(s.state)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default(),
                    s.step.to_string(),
                    s.attempts.to_string(),
                    s.error.clone().unwrap_or_default(),
                ]);
            }
            Ok(Outcome {
                json: serde_json::to_value(&sagas).unwrap_or_default(),
                text: format!("{t}\n"),
                problem: false,
            })
        }
    }
}
