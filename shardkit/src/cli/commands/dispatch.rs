//! Connects to the cluster and hands the parsed command to its file.

use crate::cli::args::{Cli, Command, VerifyAction};
use crate::cli::commands::explain::explain;
use crate::cli::commands::gsi::gsi;
use crate::cli::commands::ids::ids;
use crate::cli::commands::migrate::migrate;
use crate::cli::commands::outbox::{outbox, saga};
use crate::cli::commands::output::Outcome;
use crate::cli::commands::rebalance::rebalance;
use crate::cli::commands::reference::reference;
use crate::cli::commands::rollout::rollout;
use crate::cli::commands::route::route;
use crate::cli::commands::status::status;
use crate::cli::commands::verify::verify_shards;
use crate::cli::registry::Registry;
use crate::cluster::Cluster;
use crate::error::Result;
use crate::topology::ClusterConfig;

/// Runs `cli`'s command against `config`'s cluster with `registry`'s typed
/// things.
pub(crate) async fn execute(
    cli: Cli,
    config: ClusterConfig,
    registry: Registry,
    _out: &mut (dyn std::io::Write + Send),
) -> Result<Outcome> {
    let json = cli.json;
    // Lazily: `status` must report a shard that is down, not fail on it;
    // every other command fails on the first statement it sends there.
    let mut config = config;
    // The application's budget: the same config, before `connect_lazy`.
    let budget = config.connection_budget()?;
    config.pool.connect_lazy = Some(true);
    let cluster = Cluster::connect(config).await?;
    for reference in &registry.references {
        reference.register(&cluster);
    }
    match cli.command {
        Command::Status => status(&cluster, &registry, &budget).await,
        Command::Route { group, key } => route(&cluster, &registry, &group, &key).await,
        Command::Explain {
            table,
            keys,
            scatter: _,
        } => explain(&cluster, &registry, &table, &keys).await,
        Command::Migrate { action } => migrate(&cluster, &registry, action, json).await,
        Command::Gsi { action } => gsi(&cluster, &registry, action, json).await,
        Command::Rollout { action } => rollout(&cluster, &registry, action, json).await,
        Command::Verify {
            action:
                VerifyAction::Shards {
                    table,
                    source,
                    target,
                    bucket,
                    repair,
                },
        } => {
            verify_shards(
                &cluster, &registry, &table, &source, &target, bucket, repair,
            )
            .await
        }
        Command::Ids { action } => ids(&cluster, action).await,
        Command::Rebalance { action } => rebalance(&cluster, &registry, action, json).await,
        Command::Outbox { action } => outbox(&cluster, &registry, action, json).await,
        Command::Reference { action } => reference(&cluster, &registry, action).await,
        Command::Saga { action } => saga(&cluster, action).await,
    }
}
