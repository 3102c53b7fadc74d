//! `verify shards`: one entity's rows on two shards, and the report every
//! verification prints.

use crate::cli::commands::output::Outcome;
use crate::cli::commands::usage::USAGE_BUCKET;
use crate::cli::registry::Registry;
use crate::cluster::Cluster;
use crate::error::Result;
use crate::verify::{RowDiff, VerifyOptions, VerifyReport};
use serde_json::{Value, json};
use std::fmt::Write as _;

/// Compares the rows of the entity with table `table` on shard `source`
/// (the truth) and shard `target`, of one bucket or all; `repair` makes the
/// target match.
pub(super) async fn verify_shards(
    cluster: &Cluster,
    registry: &Registry,
    table: &str,
    source: &str,
    target: &str,
    bucket: Option<u32>,
    repair: bool,
) -> Result<Outcome> {
    let mut opts = VerifyOptions::default();
    if repair {
        opts = opts.repair();
    }
    let entity = registry.entity_named(table)?;
    if let Some(bucket) = bucket {
        // A usage error (exit code 2), before anything is read.
        crate::verify::check_bucket(cluster.topology(), entity.group(), bucket, USAGE_BUCKET)?;
    }
    let report = entity
        .verify_shards(cluster, source, target, bucket, opts)
        .await?;
    Ok(verify_outcome(
        &format!("{table} on {source} → {target}"),
        &report,
    ))
}

/// A verification's report: counts, the first differences of each kind,
/// and whether it found a problem (a difference not repaired, or a run
/// that stopped before the end).
pub(super) fn verify_outcome(what: &str, report: &VerifyReport) -> Outcome {
    let list = |diffs: &[RowDiff]| -> Vec<Value> {
        diffs
            .iter()
            .map(|d| json!({ "shard": d.shard, "pk": d.pk }))
            .collect()
    };
    let mut text = format!(
        "{what}: {} rows in {} chunks; {} missing, {} extra, {} different, {} repaired{}\n",
        report.rows,
        report.chunks,
        report.missing.len(),
        report.extra.len(),
        report.different.len(),
        report.repaired,
        if report.finished {
            String::new()
        } else {
            format!(
                " (stopped at {}; run again with --resume)",
                report.cursor.as_deref().unwrap_or("-")
            )
        }
    );
    for (kind, diffs) in [
        ("missing", &report.missing),
        ("extra", &report.extra),
        ("different", &report.different),
    ] {
        for d in diffs.iter().take(20) {
            let _ = writeln!(text, "  {kind}: {} on {}", d.pk, d.shard);
        }
    }
    Outcome {
        json: json!({
            "rows": report.rows,
            "chunks": report.chunks,
            "missing": list(&report.missing),
            "extra": list(&report.extra),
            "different": list(&report.different),
            "repaired": report.repaired,
            "finished": report.finished,
            "cursor": report.cursor,
        }),
        text,
        problem: !report.is_consistent() && report.repaired == 0 || !report.finished,
    }
}
