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
//! | `rebalance plan` / `start` / `split` / `status` / `run` / `abort` | bucket moves of a `movable` group (`resume` is another name for `run`) |
//!
//! The exit code is 0 on success, 1 when a command failed or found a
//! problem (an unreachable shard, a database behind on migrations, a
//! verification difference), 2 on a usage error. Long work (backfills,
//! verification) shows a progress bar on a terminal and a line every few
//! seconds otherwise; Ctrl-C stops it at the next chunk boundary, and the
//! same command resumes it.

mod args;
mod commands;
mod progress;
mod registry;

pub use registry::Registry;

use crate::cli::args::Cli;
use crate::cli::commands::dispatch::execute;
use crate::cli::commands::output::Outcome;
use crate::cli::commands::usage::is_usage;
use crate::error::Result;
use crate::read::escape_controls;
use crate::topology::ClusterConfig;
use clap::Parser;
use futures::future::BoxFuture;
use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;

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
    let command: BoxFuture<'_, Result<Outcome>> = Box::pin(execute(cli, config, registry, out));
    let result = command.await;
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
            let usage = is_usage(&err);
            let body = if json && usage {
                serde_json::json!({ "error": message, "usage": true }).to_string() + "\n"
            } else if json {
                serde_json::json!({ "error": message }).to_string() + "\n"
            } else {
                // One line, whatever the message quotes (a key the
                // operator typed may hold a newline or a terminal escape).
                format!("error: {}\n", escape_controls(&message))
            };
            (body, if usage { 2 } else { 1 })
        }
    };
    let _ = out.write_all(body.as_bytes());
    let _ = out.flush();
    code
}
