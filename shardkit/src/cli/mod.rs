//! An operator's command line for a sharded fleet (feature `cli`).
//!
//! As with `sea-orm-migration`'s `cli::run_cli`, the application builds its
//! own admin binary in a few lines, so the typed things — entities, their
//! indexes, rollouts, the migrator — are there for the commands:
//!
//! ```no_run
//! # use shardkit::prelude::*;
//! # #[derive(EntityGroup)] #[shardkit(key = i64)] pub struct Customer;
//! # pub mod order {
//! #     use sea_orm::entity::prelude::*;
//! #     #[sea_orm::model]
//! #     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
//! #     #[sea_orm(table_name = "orders")]
//! #     #[shardkit(group = crate::Customer)]
//! #     pub struct Model {
//! #         #[sea_orm(primary_key, auto_increment = false)] pub id: i64,
//! #         #[shardkit(shard_key)] pub customer_id: i64,
//! #     }
//! #     impl ActiveModelBehavior for ActiveModel {}
//! # }
//! #[tokio::main]
//! async fn main() -> std::process::ExitCode {
//!     let config = ClusterConfig::from_toml(&std::fs::read_to_string("shards.toml").unwrap()).unwrap();
//!     let admin = shardkit::cli::Registry::new()
//!         .migrator::<shardkit::migration::Migrator>()
//!         .entity::<order::Entity>();
//!     shardkit::cli::run(config, admin).await
//! }
//! ```
//!
//! Commands (`--help` lists them; every one takes `--json` for scripts, and
//! with it prints one JSON value whatever happens, usage errors included):
//!
//! | command | what it does |
//! |---|---|
//! | `status` | every shard (reachable, latency, pool, server version), migrations per database with drift marked, placements, index states, rollout phases and instances |
//! | `route <group> <key>` | the key's bucket, shard and host |
//! | `explain <table> --key K…` / `--scatter` | a read's plan |
//! | `migrate up` / `migrate status` | the registered migrator on every database |
//! | `gsi status` / `create` / `backfill` / `reconcile` | global indexes of registered entities |
//! | `rollout status` / `advance` / `retreat` / `backfill` / `verify` | registered rollouts |
//! | `verify shards <table> <source> <target>` | one entity's rows on two shards |
//! | `ids next <sequence>` / `ids status` | ticket sequences and servers |
//! | `rebalance plan` / `start` / `status` / `resume` / `abort` | bucket moves of a `movable` group |
//!
//! The exit code is 0 on success, 1 when a command failed or found a
//! problem (an unreachable shard, a database behind on migrations, a
//! verification difference), 2 on a usage error. Long work (backfills,
//! verification) shows a progress bar on a terminal and a line every few
//! seconds otherwise; Ctrl-C stops it at the next chunk boundary, and the
//! same command resumes it.

mod commands;
mod progress;
mod registry;

pub use registry::Registry;

use crate::ClusterConfig;
use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;

/// The command line (see the [module docs](self)).
#[derive(Debug, Parser)]
#[command(name = "shardctl", about = "See and drive a shardkit fleet", version)]
pub(crate) struct Cli {
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Shards, migrations, placements, indexes and rollouts.
    Status,
    /// Where a key lives: bucket, shard and host.
    Route {
        /// The entity group's name (as in `[groups.<name>]`).
        group: String,
        /// The shard key, as text.
        key: String,
    },
    /// The plan of a read of a registered entity.
    Explain {
        /// The entity's table.
        table: String,
        /// Shard keys to read (repeat for several).
        #[arg(long = "key", required_unless_present = "scatter")]
        keys: Vec<String>,
        /// Read every shard of the group.
        #[arg(long, conflicts_with = "keys")]
        scatter: bool,
    },
    /// The registered migrator on every database.
    Migrate {
        #[command(subcommand)]
        action: MigrateAction,
    },
    /// Global secondary indexes of registered entities.
    Gsi {
        #[command(subcommand)]
        action: GsiAction,
    },
    /// Registered rollouts.
    Rollout {
        #[command(subcommand)]
        action: RolloutAction,
    },
    /// Compare copies of rows.
    Verify {
        #[command(subcommand)]
        action: VerifyAction,
    },
    /// Ticket sequences and servers.
    Ids {
        #[command(subcommand)]
        action: IdsAction,
    },
    /// Bucket moves of a `movable` group (its entities registered).
    Rebalance {
        #[command(subcommand)]
        action: RebalanceAction,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum RebalanceAction {
    /// The buckets a move would take: the given ones, or the fewest that
    /// even the shards out with `--to`.
    Plan {
        /// The group.
        group: String,
        /// The shard the buckets go to.
        #[arg(long)]
        to: String,
        /// These buckets (comma-separated) instead of an even-out plan.
        #[arg(long, value_delimiter = ',', conflicts_with = "range_at")]
        buckets: Vec<u32>,
        /// A range group: the range holding this key.
        #[arg(long)]
        range_at: Option<String>,
    },
    /// Register a move and run it (Ctrl-C stops at a chunk boundary;
    /// `resume` goes on).
    Start {
        /// The group.
        group: String,
        /// The shard the buckets go to.
        #[arg(long)]
        to: String,
        /// These buckets (comma-separated) instead of an even-out plan.
        #[arg(long, value_delimiter = ',', conflicts_with = "range_at")]
        buckets: Vec<u32>,
        /// A range group: the range holding this key.
        #[arg(long)]
        range_at: Option<String>,
    },
    /// Split a range group's range at a key: both halves stay on its shard
    /// (no row is copied) and can then move on their own.
    Split {
        /// The group.
        group: String,
        /// The key the right half starts at.
        #[arg(long)]
        at: String,
    },
    /// The group's moves that are not finished (`--all`: every move).
    Status {
        /// The group.
        group: String,
        /// Finished moves too.
        #[arg(long)]
        all: bool,
    },
    /// Run a move from its stored phase (after a crash, a Ctrl-C, an error).
    Resume {
        /// The group.
        group: String,
        /// The move's id.
        id: i64,
    },
    /// Abort a move before its cut-over: the sources keep the buckets.
    Abort {
        /// The group.
        group: String,
        /// The move's id.
        id: i64,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum MigrateAction {
    /// Apply pending migrations on every shard, directory and ticket server.
    Up,
    /// Applied and pending migrations per database.
    Status,
}

#[derive(Debug, Subcommand)]
pub(crate) enum GsiAction {
    /// Each index's state (`write_only` or `active`).
    Status,
    /// Create the index tables and catalog rows.
    Create {
        /// Only this entity's table.
        table: Option<String>,
    },
    /// Fill indexes from the primary tables (resumable), then mark them active.
    Backfill {
        /// The entity's table.
        table: String,
        /// Only this column's index.
        column: Option<String>,
        /// Primary rows per chunk.
        #[arg(long, default_value_t = 500)]
        chunk: u64,
    },
    /// Remove dangling index rows and add missing ones.
    Reconcile {
        /// Only this entity's table.
        table: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum RolloutAction {
    /// Phase, gap, backfill state and registered instances.
    Status {
        /// Only this rollout.
        name: Option<String>,
    },
    /// One phase forward, waiting out the gap.
    Advance {
        /// The rollout's name.
        name: String,
    },
    /// One phase back, at once.
    Retreat {
        /// The rollout's name.
        name: String,
    },
    /// Copy old rows into the new table (resumable).
    Backfill {
        /// The rollout's name.
        name: String,
        /// Old rows per chunk.
        #[arg(long, default_value_t = 500)]
        chunk: u64,
    },
    /// Compare old (converted) and new rows.
    Verify {
        /// The rollout's name.
        name: String,
        /// Fix every difference from the old rows.
        #[arg(long)]
        repair: bool,
        /// Continue where the last run stopped.
        #[arg(long)]
        resume: bool,
        /// Keys per chunk.
        #[arg(long, default_value_t = 1_000)]
        chunk: u64,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum VerifyAction {
    /// One registered entity's rows on two shards (or one bucket's).
    Shards {
        /// The entity's table.
        table: String,
        /// The shard whose rows are the truth.
        source: String,
        /// The shard checked against it.
        target: String,
        /// Only rows of this bucket.
        #[arg(long)]
        bucket: Option<u32>,
        /// Make the target match.
        #[arg(long)]
        repair: bool,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum IdsAction {
    /// Draw the next id of a ticket sequence.
    Next {
        /// The sequence's name.
        sequence: String,
    },
    /// Ticket servers and the sequences they hold.
    Status,
    /// Record the places of ticket servers that handed out tickets before
    /// shardkit recorded places, after checking each sequence's counter
    /// against `ids.servers` (run once, with the list as it was set up).
    AdoptPlaces,
    /// Remove the unconfirmed place records a stopped set-up, or two lists
    /// setting up at once, left behind; run while no set-up runs, then set
    /// up again.
    ClearUnconfirmedPlaces,
}

/// What a command printed, and whether it found a problem.
pub(crate) struct Outcome {
    /// For `--json`.
    pub(crate) json: serde_json::Value,
    /// For a reader.
    pub(crate) text: String,
    /// Exit with 1 although the command ran (an unreachable shard, a
    /// difference found).
    pub(crate) problem: bool,
}

/// Runs the command line of this process against `config`'s cluster, with
/// `registry`'s typed things, printing to stdout (errors to stderr).
pub async fn run(config: ClusterConfig, registry: Registry) -> ExitCode {
    let mut out = std::io::stdout();
    let code = run_with(std::env::args_os(), config, registry, &mut out).await;
    ExitCode::from(code)
}

/// [`run`] with the arguments given (the first is the program's name) and
/// output to `out`; returns the exit code. Errors go to `out` too, as
/// `error: ...` (or `{"error": ...}` with `--json`; a usage error as
/// `{"error": ..., "usage": true}`, `--help` as `{"help": ...}`). With
/// `--json` the output is always one JSON value. For tests and for
/// embedding the commands in another program.
pub async fn run_with<I, T>(
    args: I,
    config: ClusterConfig,
    registry: Registry,
    out: &mut (dyn Write + Send),
) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(err) => {
            let usage = err.use_stderr();
            let code = if usage { 2 } else { 0 };
            // `--json` asked for (anywhere: it is global) although the rest
            // did not parse: scripts still get one JSON object.
            let body = if args.iter().skip(1).any(|a| a == "--json") {
                let text = err.render().to_string();
                let text = text.trim_end();
                let value = if usage {
                    serde_json::json!({
                        "error": text.strip_prefix("error: ").unwrap_or(text),
                        "usage": true,
                    })
                } else {
                    // `--help`, `--version`.
                    serde_json::json!({ "help": text })
                };
                value.to_string() + "\n"
            } else {
                err.render().to_string()
            };
            let _ = out.write_all(body.as_bytes());
            let _ = out.flush();
            return code;
        }
    };
    let json = cli.json;
    // Boxed as a trait object: the commands' futures nest deeply, and an
    // admin binary's `main` should not need a raised `recursion_limit`.
    let execute: futures::future::BoxFuture<'_, crate::Result<Outcome>> =
        Box::pin(commands::execute(cli, config, registry, out));
    let result = execute.await;
    let (body, code) = match result {
        Ok(outcome) => {
            let body = if json {
                serde_json::to_string_pretty(&outcome.json).unwrap_or_default() + "\n"
            } else {
                outcome.text
            };
            (body, u8::from(outcome.problem))
        }
        Err(err) => {
            // The message with its root cause (a database error's driver
            // message), once.
            let message = err.report().to_string();
            let usage = commands::is_usage(&err);
            let body = if json && usage {
                serde_json::json!({ "error": message, "usage": true }).to_string() + "\n"
            } else if json {
                serde_json::json!({ "error": message }).to_string() + "\n"
            } else {
                // One line, whatever the message quotes (a key the
                // operator typed may hold a newline or a terminal escape).
                format!("error: {}\n", crate::read::escape_controls(&message))
            };
            (body, if usage { 2 } else { 1 })
        }
    };
    let _ = out.write_all(body.as_bytes());
    let _ = out.flush();
    code
}
