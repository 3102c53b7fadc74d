//! The command line's arguments: the commands, their actions and options,
//! as clap parses them.

use clap::{Parser, Subcommand};

/// The command line (see the [module docs](crate::cli)).
#[derive(Debug, Parser)]
#[command(name = "shardctl", about = "See and drive a shardkit fleet", version)]
pub(crate) struct Cli {
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
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
    /// Messages between keys (the message types registered with
    /// `Registry::outbox`).
    Outbox {
        #[command(subcommand)]
        action: OutboxAction,
    },
    /// Reference tables (registered with `Registry::reference`): each
    /// shard's version, and their comparison with the source.
    Reference {
        #[command(subcommand)]
        action: ReferenceAction,
    },
    /// Sagas, as stored on their origins' shards.
    Saga {
        #[command(subcommand)]
        action: SagaAction,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum OutboxAction {
    /// Pending and parked messages of every shard.
    Status,
    /// Relays: applies messages until Ctrl-C (or once, with `--once`).
    Run {
        /// Deliver what can be delivered now, then stop.
        #[arg(long)]
        once: bool,
    },
    /// Makes a parked message pending again.
    Retry {
        /// The message id.
        id: String,
    },
    /// Deletes a parked message without applying it.
    Discard {
        /// The message id.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum ReferenceAction {
    /// Every shard's version of each reference table (or of one).
    Status {
        /// Only this table.
        table: Option<String>,
    },
    /// Compares every copy with the source, row by row.
    Verify {
        /// Only this table.
        table: Option<String>,
        /// Repair every copy that differs from the source.
        #[arg(long)]
        repair: bool,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum SagaAction {
    /// Unfinished sagas (every saga with `--all`).
    Status {
        /// Finished sagas too.
        #[arg(long)]
        all: bool,
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
    /// `run` goes on).
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
    #[command(visible_alias = "resume")]
    Run {
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
    /// Apply pending migrations on every shard, directory and ticket server
    /// (a database that fails does not stop the others; run it again to
    /// finish: what ran elsewhere never runs twice).
    Up {
        /// At most this many databases at a time (default: all at once).
        #[arg(long)]
        concurrency: Option<usize>,
    },
    /// Applied and pending migrations per database, and which database is
    /// on which migration.
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
    /// Remove dangling index rows and add missing ones (Ctrl-C stops at a
    /// chunk boundary; the next pass starts over).
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
