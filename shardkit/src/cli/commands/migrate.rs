//! `migrate up` and `migrate status`, and the migration report `status`
//! shows too.

use crate::cli::args::MigrateAction;
use crate::cli::commands::output::{Outcome, table};
use crate::cli::progress::Progress;
use crate::cli::registry::Registry;
use crate::cluster::{Cluster, MigrateOptions, MigrationProgress, MigrationReport};
use crate::error::{Result, ShardError};
use comfy_table::Table;
use serde_json::{Value, json};

/// Runs the registered migrator (`up`) or reads where it stands (`status`)
/// on every database.
pub(super) async fn migrate(
    cluster: &Cluster,
    registry: &Registry,
    action: MigrateAction,
    json: bool,
) -> Result<Outcome> {
    let migrator = registry.migrator.as_ref().ok_or_else(|| {
        ShardError::config(
            "shardctl",
            "no migrator registered; add one with Registry::migrator::<Migrator>()",
        )
    })?;
    let report = match action {
        MigrateAction::Up { concurrency } => {
            let progress = Progress::new("migrate", None, json);
            let control = progress.control(|bar, p: &MigrationProgress| {
                bar.report(
                    p.done as u64,
                    Some(p.total as u64),
                    &format!("databases, {} failed, last {}", p.failed, p.last),
                );
            });
            let mut options = MigrateOptions::new().control(control);
            if let Some(n) = concurrency {
                options = options.concurrency(n);
            }
            migrator.up(cluster, options).await?
        }
        MigrateAction::Status => migrator.status(cluster).await?,
    };
    Ok(Outcome {
        json: migration_json(&report),
        text: format!("{}\n", migration_table(&report)),
        problem: !report.is_current(),
    })
}

/// A migration report for `--json`: each database's applied and pending
/// migrations, and whether it is behind.
pub(super) fn migration_json(report: &MigrationReport) -> Value {
    let behind: Vec<&str> = report.behind().iter().map(|d| d.name.as_str()).collect();
    json!({
        "current": report.is_current(),
        "databases": report.databases.iter().map(|d| json!({
            "name": d.name,
            "applied": d.applied,
            "pending": d.pending,
            "ran": d.ran,
            "error": d.error,
            "behind": behind.contains(&d.name.as_str()),
        })).collect::<Vec<_>>(),
        "versions": report.versions().iter().map(|(last, dbs)| json!({
            "last_applied": last,
            "databases": dbs,
        })).collect::<Vec<_>>(),
    })
}

/// A migration report as a table, one database a row, drift marked.
pub(super) fn migration_table(report: &MigrationReport) -> Table {
    let mut t = table(&["database", "last applied", "pending", "ran now", "drift"]);
    for d in &report.databases {
        t.add_row(vec![
            d.name.clone(),
            match (&d.error, d.applied.last()) {
                (Some(_), _) if d.applied.is_empty() && d.pending.is_empty() => "?".to_owned(),
                (_, Some(last)) => format!("{last} ({})", d.applied.len()),
                (_, None) => "none".to_owned(),
            },
            if d.pending.is_empty() {
                "0".to_owned()
            } else {
                format!("{} ({})", d.pending.len(), d.pending.join(", "))
            },
            d.ran.join(", "),
            match &d.error {
                Some(error) => format!("FAILED: {error}"),
                None if !d.pending.is_empty() => "BEHIND".to_owned(),
                None => String::new(),
            },
        ]);
    }
    t
}
