//! `reference status` and `reference verify`: each shard's version of the
//! registered reference tables, and their comparison with the source.

use crate::cli::args::ReferenceAction;
use crate::cli::commands::output::{Outcome, table};
use crate::cli::registry::{AdminReference, Registry};
use crate::cluster::Cluster;
use crate::error::{Result, ShardError};
use serde_json::{Value, json};

fn chosen<'a>(registry: &'a Registry, only: Option<&str>) -> Result<Vec<&'a dyn AdminReference>> {
    let all: Vec<&dyn AdminReference> = registry.references.iter().map(|r| &**r).collect();
    if all.is_empty() {
        return Err(ShardError::config(
            "shardctl",
            "no reference table registered; add one with Registry::reference::<Entity>()",
        ));
    }
    match only {
        None => Ok(all),
        Some(name) => {
            let known: Vec<&str> = all.iter().map(|r| r.table()).collect();
            let found: Vec<&dyn AdminReference> =
                all.into_iter().filter(|r| r.table() == name).collect();
            if found.is_empty() {
                return Err(ShardError::config(
                    "shardctl",
                    format!(
                        "no registered reference table is named `{name}` (registered: {})",
                        known.join(", ")
                    ),
                ));
            }
            Ok(found)
        }
    }
}

/// Runs a `reference` action.
pub(super) async fn reference(
    cluster: &Cluster,
    registry: &Registry,
    action: ReferenceAction,
) -> Result<Outcome> {
    match action {
        ReferenceAction::Status { table: only } => {
            let mut out = Vec::new();
            let mut t = table(&["table", "shard", "version", "state"]);
            let mut problem = false;
            for r in chosen(registry, only.as_deref())? {
                let status = r.status(cluster).await?;
                let behind = status.behind();
                problem |= !behind.is_empty();
                for c in &status.copies {
                    t.add_row(vec![
                        status.table.to_owned(),
                        c.shard.clone(),
                        match &c.version {
                            Ok(v) => v.to_string(),
                            Err(_) => "?".to_owned(),
                        },
                        match &c.version {
                            Err(e) => format!("UNREADABLE: {e}"),
                            Ok(_) if behind.contains(&c.shard.as_str()) => "BEHIND".to_owned(),
                            Ok(_) => String::new(),
                        },
                    ]);
                }
                out.push(json!({
                    "table": status.table,
                    "source": status.source,
                    "behind": behind,
                    "copies": status.copies.iter().map(|c| json!({
                        "shard": c.shard,
                        "version": c.version.as_ref().ok(),
                        "error": c.version.as_ref().err(),
                    })).collect::<Vec<_>>(),
                }));
            }
            Ok(Outcome {
                json: Value::Array(out),
                text: format!("{t}\n"),
                problem,
            })
        }
        ReferenceAction::Verify {
            table: only,
            repair,
        } => {
            let mut out = Vec::new();
            let mut t = table(&[
                "table",
                "shard",
                "version",
                "missing",
                "extra",
                "differing",
                "state",
            ]);
            let mut problem = false;
            for r in chosen(registry, only.as_deref())? {
                let report = r.verify(cluster, repair).await?;
                for c in &report.copies {
                    problem |= c.differs() && !c.repaired;
                    t.add_row(vec![
                        report.table.to_owned(),
                        c.shard.clone(),
                        format!("{} of {}", c.version, report.version),
                        c.missing.len().to_string(),
                        c.extra.len().to_string(),
                        c.differing.len().to_string(),
                        match (&c.error, c.repaired, c.differs()) {
                            (Some(e), _, _) => format!("ERROR: {e}"),
                            (None, true, _) => "REPAIRED".to_owned(),
                            (None, false, true) => "DIFFERS".to_owned(),
                            (None, false, false) => String::new(),
                        },
                    ]);
                }
                out.push(json!({
                    "table": report.table,
                    "version": report.version,
                    "rows": report.rows,
                    "consistent": report.is_consistent(),
                    "copies": report.copies.iter().map(|c| json!({
                        "shard": c.shard,
                        "version": c.version,
                        "matches": c.matches,
                        "missing": c.missing,
                        "extra": c.extra,
                        "differing": c.differing,
                        "repaired": c.repaired,
                        "error": c.error,
                    })).collect::<Vec<_>>(),
                }));
            }
            Ok(Outcome {
                json: Value::Array(out),
                text: format!("{t}\n"),
                problem,
            })
        }
    }
}
