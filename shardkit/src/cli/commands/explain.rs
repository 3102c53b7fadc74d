//! `explain`: a read's plan.

use crate::Cluster;
use crate::cli::commands::output::Outcome;
use crate::cli::registry::Registry;
use crate::error::Result;
use crate::read::{PlannedRoute, ReadPlan};
use serde_json::{Value, json};

/// The plan of a read of the entity with table `table`: by `keys`, or a
/// scatter when there are none.
pub(super) async fn explain(
    cluster: &Cluster,
    registry: &Registry,
    table: &str,
    keys: &[String],
) -> Result<Outcome> {
    let plan = registry.entity_named(table)?.explain(cluster, keys).await?;
    Ok(Outcome {
        json: plan_json(table, &plan),
        text: format!("{plan}\n"),
        problem: false,
    })
}

/// A read's plan for `--json`: the text `explain` prints (`plan`) and its
/// parts, each statement's SQL as the backend quotes its values.
fn plan_json(table: &str, plan: &ReadPlan) -> Value {
    let route = match &plan.route {
        PlannedRoute::Key { bucket } => json!({ "by": "key", "bucket": bucket }),
        PlannedRoute::Keys { keys } => json!({ "by": "keys", "keys": keys }),
        PlannedRoute::Scatter => json!({ "by": "scatter" }),
        PlannedRoute::Index { index, keys } => {
            json!({ "by": "index", "index": index, "keys": keys })
        }
    };
    let merge = plan.merge.as_ref().map(|m| {
        json!({
            "order": m
                .order
                .iter()
                .map(|(column, desc)| json!({ "column": column, "desc": desc }))
                .collect::<Vec<_>>(),
            "limit": m.limit,
            "offset": m.offset,
        })
    });
    json!({
        "table": table,
        "plan": plan.to_string(),
        "route": route,
        "statements": plan
            .statements
            .iter()
            .map(|s| json!({ "shard": s.shard, "sql": s.sql }))
            .collect::<Vec<_>>(),
        "merge": merge,
        "partial": plan.partial,
        "timeout_ms": plan.timeout.map(|t| t.as_millis() as u64),
        "max_concurrency": plan.max_concurrency,
    })
}
