//! `route`: where a key lives.

use crate::cli::commands::output::Outcome;
use crate::cli::registry::Registry;
use crate::cluster::Cluster;
use crate::error::{Result, ShardError};
use serde_json::json;

/// The bucket, shard and host of `key` (as text) of group `group`, whose
/// key type a registered entity of the group gives.
pub(super) async fn route(
    cluster: &Cluster,
    registry: &Registry,
    group: &str,
    key: &str,
) -> Result<Outcome> {
    let entity = registry
        .entities
        .iter()
        .find(|e| e.group() == group)
        .ok_or_else(|| {
            ShardError::config(
                "shardctl",
                format!(
                    "no registered entity belongs to group `{group}`, so its key type is \
                     unknown here; register one with Registry::entity"
                ),
            )
        })?;
    let target = entity.route(cluster, key).await?;
    let spec = cluster.topology().shard(target.shard);
    let host = spec
        .host
        .clone()
        .or_else(|| spec.url.host())
        .unwrap_or_else(|| "-".to_owned());
    Ok(Outcome {
        json: json!({
            "group": group,
            "key": key,
            "bucket": target.bucket,
            "shard": spec.name,
            "host": host,
            "url": spec.url.redacted(),
        }),
        text: format!(
            "{group} {key}: bucket {}, shard {} on {host} ({})\n",
            target
                .bucket
                .map_or_else(|| "-".to_owned(), |b| b.to_string()),
            spec.name,
            spec.url.redacted()
        ),
        problem: false,
    })
}
