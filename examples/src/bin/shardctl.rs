//! `shardctl`: an operator's command line over the examples' entities, built
//! the way an application builds its own admin binary (see `shardkit::cli`).
//!
//! By default it looks at the quickstart's four SQLite shards (run
//! `cargo run -p shardkit-examples --bin quickstart` first); set
//! `SHARDKIT_CONFIG` to a cluster TOML file to point it elsewhere.
//!
//! ```text
//! cargo run -p shardkit-examples --bin shardctl -- status
//! cargo run -p shardkit-examples --bin shardctl -- route Customer 7
//! cargo run -p shardkit-examples --bin shardctl -- explain orders --key 7
//! cargo run -p shardkit-examples --bin shardctl -- --json migrate status
//! ```

use shardkit::ClusterConfig;
use shardkit::cli::Registry;
use shardkit_examples::{Migrator, customer, order};
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let toml = match std::env::var("SHARDKIT_CONFIG") {
        Ok(path) => match std::fs::read_to_string(&path) {
            Ok(toml) => toml,
            Err(err) => {
                eprintln!("error: SHARDKIT_CONFIG={path}: {err}");
                return ExitCode::from(2);
            }
        },
        Err(_) => match shardkit_examples::existing_sqlite_shards("quickstart", 4) {
            Ok((_, toml)) => toml + shardkit_examples::QUICKSTART_GROUPS,
            Err(err) => {
                eprintln!("error: the quickstart's data directory: {err}");
                return ExitCode::from(2);
            }
        },
    };
    let config = match ClusterConfig::from_toml(&toml) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
    };
    let admin = Registry::new()
        .migrator::<Migrator>()
        .entity::<customer::Entity>()
        .entity::<order::Entity>();
    shardkit::cli::run(config, admin).await
}
