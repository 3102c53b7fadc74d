//! `gsi status`, `create`, `backfill` and `reconcile`: global indexes of
//! registered entities.

use crate::cli::args::GsiAction;
use crate::cli::commands::output::{Outcome, table};
use crate::cli::progress::Progress;
use crate::cli::registry::{AdminEntity, Registry};
use crate::cluster::Cluster;
use crate::error::Result;
use crate::gsi::{BackfillProgress, ReconcileReport};
use serde_json::{Value, json};
use std::fmt::Write as _;

/// Runs a `gsi` action; `json` silences the progress output.
pub(super) async fn gsi(
    cluster: &Cluster,
    registry: &Registry,
    action: GsiAction,
    json: bool,
) -> Result<Outcome> {
    let pick = |table: &Option<String>| -> Result<Vec<&dyn AdminEntity>> {
        match table {
            Some(table) => Ok(vec![registry.entity_named(table)?]),
            None => Ok(registry
                .entities
                .iter()
                .filter(|e| !e.indexes().is_empty())
                .map(|e| &**e)
                .collect()),
        }
    };
    match action {
        GsiAction::Status => {
            let mut rows = Vec::new();
            let mut t = table(&["table", "column", "unique", "state"]);
            for entity in pick(&None)? {
                for (column, unique) in entity.indexes() {
                    let state = entity.index_state(cluster, column).await?.to_string();
                    t.add_row(vec![
                        entity.table().to_owned(),
                        column.to_owned(),
                        unique.to_string(),
                        state.clone(),
                    ]);
                    rows.push(json!({ "table": entity.table(), "column": column, "unique": unique, "state": state }));
                }
            }
            let text = if rows.is_empty() {
                "no registered entity has a global index\n".to_owned()
            } else {
                format!("{t}\n")
            };
            Ok(Outcome {
                json: Value::Array(rows),
                text,
                problem: false,
            })
        }
        GsiAction::Create { table } => {
            let mut created = Vec::new();
            for entity in pick(&table)? {
                entity.index_create(cluster).await?;
                created.push(entity.table());
            }
            Ok(Outcome {
                text: format!(
                    "index tables and catalog rows ready for: {}\n",
                    created.join(", ")
                ),
                json: json!({ "created": created }),
                problem: false,
            })
        }
        GsiAction::Backfill {
            table,
            column,
            chunk,
        } => {
            let entity = registry.entity_named(&table)?;
            let columns: Vec<&str> = match &column {
                Some(c) => vec![c.as_str()],
                None => entity.indexes().into_iter().map(|(c, _)| c).collect(),
            };
            let mut results = Vec::new();
            let mut text = String::new();
            let mut stopped = false;
            for column in columns {
                let progress = Progress::new(format!("gsi backfill {table}.{column}"), None, json);
                let control = progress.control(|bar, p: &BackfillProgress| {
                    let rate = bar.rate(p.rows);
                    bar.report(
                        p.shards_done as u64,
                        Some(p.shards as u64),
                        &format!(
                            "shards, {} rows, {} index rows, {rate:.0} rows/s",
                            p.rows, p.written
                        ),
                    );
                });
                let done = entity
                    .index_backfill(cluster, column, chunk, control)
                    .await?;
                stopped |= progress.stopped() && !done.finished;
                let _ = writeln!(
                    text,
                    "{table}.{column}: {} rows read, {} index rows written, {}",
                    done.rows,
                    done.written,
                    if done.finished {
                        "active"
                    } else {
                        "stopped (run again to resume)"
                    }
                );
                results.push(json!({
                    "table": table, "column": column, "rows": done.rows,
                    "written": done.written, "finished": done.finished,
                }));
                if stopped {
                    break;
                }
            }
            Ok(Outcome {
                json: Value::Array(results),
                text,
                problem: stopped,
            })
        }
        GsiAction::Reconcile { table } => {
            let mut results = Vec::new();
            let mut text = String::new();
            let mut problem = false;
            for entity in pick(&table)? {
                let progress =
                    Progress::new(format!("gsi reconcile {}", entity.table()), None, json);
                let control = progress.control(|bar, r: &ReconcileReport| {
                    bar.report(
                        r.scanned,
                        None,
                        &format!(
                            "index rows scanned, {} dangling removed, {} missing added",
                            r.removed, r.added
                        ),
                    );
                });
                let r = entity.index_reconcile(cluster, control).await?;
                problem |= !r.conflicts.is_empty() || !r.finished;
                let _ = writeln!(
                    text,
                    "{}: {} index rows scanned, {} dangling removed, {} missing added, {} conflicts{}",
                    entity.table(),
                    r.scanned,
                    r.removed,
                    r.added,
                    r.conflicts.len(),
                    if r.finished {
                        ""
                    } else {
                        ", stopped (the next pass starts over)"
                    }
                );
                results.push(json!({
                    "table": entity.table(), "scanned": r.scanned, "removed": r.removed,
                    "added": r.added, "conflicts": r.conflicts.len(), "finished": r.finished,
                }));
                if !r.finished {
                    break;
                }
            }
            Ok(Outcome {
                json: Value::Array(results),
                text,
                problem,
            })
        }
    }
}
