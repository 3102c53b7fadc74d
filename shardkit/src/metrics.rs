//! Metrics through the [`metrics`] facade: the application installs the
//! recorder (a Prometheus exporter, say) and shardkit reports to it. Install
//! it before [`Cluster::connect`](crate::Cluster::connect): each shard's
//! statement metrics are registered once, when its pool is made.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `shardkit_statement_duration_seconds` | histogram | `shard`, `kind` | every statement a shard ran (`kind`: `select`, `insert`, `update`, `delete`, `other`) |
//! | `shardkit_statement_errors_total` | counter | `shard`, `kind` | statements that failed |
//! | `shardkit_rows_not_found_total` | counter | `shard`, `entity` | keyed `one()` reads that found no row (PayPal's "pattern deviation": a spike says a write path or a cache is wrong) |
//! | `shardkit_scatter_shards` | histogram | `group` | shards a multi-shard read asked |
//! | `shardkit_scatter_partial_total` | counter | `group` | multi-shard reads that returned without some shard |
//! | `shardkit_rollout_cache_total` | counter | `rollout`, `model` (`old`, `new`), `result` (`hit`, `miss`) | rollout cache lookups |
//! | `shardkit_rollout_phase` | gauge | `rollout` | the phase this instance acts on (0 `off` … 5 `done`) |
//! | `shardkit_shard_errors_total` | counter | `shard`, `kind` (`timeout`, `unavailable`, `error`) | requests to a shard that failed under its breaker |
//! | `shardkit_ticket_requests_total` | counter | `server` | ticket statements sent |
//! | `shardkit_ticket_failovers_total` | counter | `server` | times a ticket server failed and the next was tried |
//! | `shardkit_gsi_reconciled_total` | counter | `entity`, `action` (`removed`, `added`) | dangling index rows removed and missing ones added |
//! | `shardkit_bucket_map_epoch` | gauge | `group` | the epoch of the bucket map this instance routes by |
//! | `shardkit_bucket_fenced_total` | counter | `group` | write transactions a shard's fence refused (rerouted after a map refresh) |
//! | `shardkit_move_rows_copied_total` | counter | `group` | rows a bucket move copied to its target |
//! | `shardkit_move_rows_written_total` | counter | `group`, `method` | rows a move's copy wrote on its target, with `COPY` (`copy`, between PostgreSQL shards) or multi-row `INSERT`s (`insert`) |
//! | `shardkit_move_changes_applied_total` | counter | `group` | logged keys a bucket move replayed on its target |
//! | `shardkit_move_pending_changes` | gauge | `group` | keys logged and not yet replayed (the move's lag) |
//! | `shardkit_move_phase` | gauge | `group` | the running move's phase (0 `registered` … 6 `done`, 7 `aborted`) |
//! | `shardkit_replica_reads_total` | counter | `shard`, `replica` | reads a replica answered |
//! | `shardkit_replica_fallbacks_total` | counter | `shard`, `reason` (`lag`: none within `max_lag`; `behind`: not past the session's writes in time; `down`: none in the rotation; `failed`: the replica failed the read; `timeout`: the read's timeout ran out before the replica answered; `movable`: a movable group) | reads that asked for a replica and were answered by the shard itself |
//! | `shardkit_replica_token_wait_seconds` | histogram | | how long a read with a session waited for a replica to replay past its writes |
//! | `shardkit_replica_lag_seconds` | gauge | `replica` | each replica's last measured lag (`NaN`: unknown, out of the rotation) |
//! | `shardkit_outbox_pending` | gauge | `shard` | messages waiting in a shard's outbox, as the relay last counted (about once a second) |
//! | `shardkit_outbox_parked` | gauge | `shard` | messages parked after their last attempt, waiting for `retry` or `discard` |
//! | `shardkit_outbox_delivery_lag_seconds` | histogram | `kind` | from a message's send to the commit of its handler's transaction |
//! | `shardkit_outbox_retries_total` | counter | `kind` | handler attempts that failed (retried later, or parked) |
//! | `shardkit_outbox_parked_total` | counter | `kind` | messages parked after their last attempt |
//! | `shardkit_sagas_compensated_total` | counter | `saga` | sagas whose compensations all ran after a step failed |
//! | `shardkit_reference_version` | gauge | `table` | the newest version of a reference table this instance wrote |
//! | `shardkit_reference_copy_version` | gauge | `table`, `shard` | a copy's version, as this instance last learnt it (a write, a catch-up, a read, `status`) |
//! | `shardkit_reference_drift` | gauge | `table`, `shard` | 1 when the last verify found the copy different from the source, else 0 |
//!
//! No label ever holds a key value, a row value or a URL.

use metrics::{Counter, Histogram, counter, histogram};
use std::time::Duration;

/// A statement's kind, from its first word (after any whitespace, as
/// `str::trim_start` sees it). On bytes: it runs for every statement, and a
/// statement that starts with a letter, as every one sea-query builds does,
/// needs no trimming.
fn kind(sql: &str) -> usize {
    let sql = match sql.as_bytes().first() {
        Some(b) if b.is_ascii_alphabetic() => sql,
        _ => sql.trim_start(),
    };
    let Some(&[a, b, c, d, e, f]) = sql.as_bytes().get(..6) else {
        return 4;
    };
    // The six bytes as one number, each with 0x20 set: that lowers an ASCII
    // letter and makes no other byte a lower-case letter, so comparing with
    // the lower-case words is `eq_ignore_ascii_case`, in one comparison.
    let word = u64::from_le_bytes([a, b, c, d, e, f, 0, 0]) | LOWER;
    [SELECT, INSERT, UPDATE, DELETE]
        .iter()
        .position(|kind| word == *kind)
        .unwrap_or(4)
}

const LOWER: u64 = 0x2020_2020_2020;
const SELECT: u64 = word(b"select");
const INSERT: u64 = word(b"insert");
const UPDATE: u64 = word(b"update");
const DELETE: u64 = word(b"delete");

const fn word(w: &[u8; 6]) -> u64 {
    u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], 0, 0])
}

const KINDS: [&str; 5] = ["select", "insert", "update", "delete", "other"];

/// One shard's statement metrics, registered once.
pub(crate) struct ShardMetrics {
    duration: [Histogram; 5],
    errors: [Counter; 5],
}

impl ShardMetrics {
    pub(crate) fn new(shard: &str) -> Self {
        let shard = shard.to_owned();
        ShardMetrics {
            duration: KINDS.map(|kind| {
                histogram!("shardkit_statement_duration_seconds", "shard" => shard.clone(), "kind" => kind)
            }),
            errors: KINDS.map(|kind| {
                counter!("shardkit_statement_errors_total", "shard" => shard.clone(), "kind" => kind)
            }),
        }
    }

    /// Records one statement.
    pub(crate) fn record(&self, sql: &str, elapsed: Duration, failed: bool) {
        let kind = kind(sql);
        self.duration[kind].record(elapsed.as_secs_f64());
        if failed {
            self.errors[kind].increment(1);
        }
    }
}

/// A keyed `one()` that found no row.
pub(crate) fn not_found(shard: &str, entity: &'static str) {
    counter!("shardkit_rows_not_found_total", "shard" => shard.to_owned(), "entity" => entity)
        .increment(1);
}

/// A multi-shard read over `shards` shards; `partial` when some did not answer.
pub(crate) fn scatter(group: &'static str, shards: usize, partial: bool) {
    histogram!("shardkit_scatter_shards", "group" => group).record(shards as f64);
    if partial {
        counter!("shardkit_scatter_partial_total", "group" => group).increment(1);
    }
}

/// A rollout cache's hit and miss counters.
pub(crate) struct CacheMetrics {
    pub(crate) hit: Counter,
    pub(crate) miss: Counter,
}

impl CacheMetrics {
    pub(crate) fn new(rollout: &str, model: &'static str) -> Self {
        let rollout = rollout.to_owned();
        CacheMetrics {
            hit: counter!("shardkit_rollout_cache_total", "rollout" => rollout.clone(), "model" => model, "result" => "hit"),
            miss: counter!("shardkit_rollout_cache_total", "rollout" => rollout, "model" => model, "result" => "miss"),
        }
    }
}

/// The phase a rollout acts on here.
pub(crate) fn rollout_phase(rollout: &str, phase: crate::phase::Phase) {
    metrics::gauge!("shardkit_rollout_phase", "rollout" => rollout.to_owned())
        .set(phase as u8 as f64);
}

/// A request to `shard` that failed under its breaker.
pub(crate) fn request_failed(shard: &str, err: &crate::error::ShardError) {
    let kind = match err {
        crate::error::ShardError::Timeout { .. } => "timeout",
        crate::error::ShardError::Unavailable { .. } => "unavailable",
        _ => "error",
    };
    counter!("shardkit_shard_errors_total", "shard" => shard.to_owned(), "kind" => kind)
        .increment(1);
}

/// A ticket statement sent to `server`.
pub(crate) fn ticket_request(server: &str) {
    counter!("shardkit_ticket_requests_total", "server" => server.to_owned()).increment(1);
}

/// Ticket server `server` failed; the next one is tried.
pub(crate) fn ticket_failover(server: &str) {
    counter!("shardkit_ticket_failovers_total", "server" => server.to_owned()).increment(1);
}

/// A reconcile pass of `entity`'s indexes.
pub(crate) fn reconciled(entity: &'static str, removed: u64, added: u64) {
    counter!("shardkit_gsi_reconciled_total", "entity" => entity, "action" => "removed")
        .increment(removed);
    counter!("shardkit_gsi_reconciled_total", "entity" => entity, "action" => "added")
        .increment(added);
}

/// A replica of `shard` answered a read.
pub(crate) fn replica_read(shard: &str, replica: &str) {
    counter!("shardkit_replica_reads_total", "shard" => shard.to_owned(), "replica" => replica.to_owned())
        .increment(1);
}

/// A read that asked for a replica of `shard` read the shard itself.
pub(crate) fn replica_fallback(shard: &str, reason: &'static str) {
    counter!("shardkit_replica_fallbacks_total", "shard" => shard.to_owned(), "reason" => reason)
        .increment(1);
}

/// A read with a session waited `waited` for a replica.
pub(crate) fn token_wait(waited: Duration) {
    histogram!("shardkit_replica_token_wait_seconds").record(waited.as_secs_f64());
}

/// Replica `replica`'s lag as last measured (`None`: unknown).
pub(crate) fn replica_lag(replica: &str, lag: Option<Duration>) {
    metrics::gauge!("shardkit_replica_lag_seconds", "replica" => replica.to_owned())
        .set(lag.map_or(f64::NAN, |l| l.as_secs_f64()));
}

pub(crate) fn map_epoch(group: &str, epoch: u64) {
    metrics::gauge!("shardkit_bucket_map_epoch", "group" => group.to_owned()).set(epoch as f64);
}

pub(crate) fn fenced(group: &'static str) {
    counter!("shardkit_bucket_fenced_total", "group" => group).increment(1);
}

pub(crate) fn move_copied(group: &str, rows: u64) {
    counter!("shardkit_move_rows_copied_total", "group" => group.to_owned()).increment(rows);
}

/// A move's copy wrote `rows` on its target, with `COPY` (`method="copy"`,
/// between PostgreSQL shards) or multi-row `INSERT`s (`"insert"`).
pub(crate) fn move_written(group: &'static str, method: &'static str, rows: u64) {
    counter!("shardkit_move_rows_written_total", "group" => group, "method" => method)
        .increment(rows);
}

pub(crate) fn move_applied(group: &str, keys: u64) {
    counter!("shardkit_move_changes_applied_total", "group" => group.to_owned()).increment(keys);
}

pub(crate) fn move_pending(group: &str, pending: u64) {
    metrics::gauge!("shardkit_move_pending_changes", "group" => group.to_owned())
        .set(pending as f64);
}

pub(crate) fn move_phase(group: &str, phase: u8) {
    metrics::gauge!("shardkit_move_phase", "group" => group.to_owned()).set(f64::from(phase));
}

/// Messages pending (`state` `pending`) and parked (`parked`) in `shard`'s
/// outbox, as last counted.
pub(crate) fn outbox_counts(shard: &str, pending: u64, parked: u64) {
    metrics::gauge!("shardkit_outbox_pending", "shard" => shard.to_owned()).set(pending as f64);
    metrics::gauge!("shardkit_outbox_parked", "shard" => shard.to_owned()).set(parked as f64);
}

/// A message was applied `lag` after it was sent.
pub(crate) fn outbox_delivered(kind: &'static str, lag: Duration) {
    histogram!("shardkit_outbox_delivery_lag_seconds", "kind" => kind).record(lag.as_secs_f64());
}

/// A message's handler failed; `parked`: it will not be tried again.
pub(crate) fn outbox_failed(kind: &'static str, parked: bool) {
    counter!("shardkit_outbox_retries_total", "kind" => kind).increment(1);
    if parked {
        counter!("shardkit_outbox_parked_total", "kind" => kind).increment(1);
    }
}

/// A saga named `saga` ran its compensations to the end.
pub(crate) fn saga_compensated(saga: &'static str) {
    counter!("shardkit_sagas_compensated_total", "saga" => saga).increment(1);
}

/// This instance wrote `version` of reference table `table`.
pub(crate) fn reference_version(table: &'static str, version: i64) {
    metrics::gauge!("shardkit_reference_version", "table" => table).set(version as f64);
}

/// `shard`'s copy of reference table `table` is at `version`.
pub(crate) fn reference_copy_version(table: &'static str, shard: &str, version: i64) {
    metrics::gauge!("shardkit_reference_copy_version", "table" => table, "shard" => shard.to_owned())
        .set(version as f64);
}

/// Whether the last verify found `shard`'s copy of `table` different.
pub(crate) fn reference_drift(table: &'static str, shard: &str, differs: bool) {
    metrics::gauge!("shardkit_reference_drift", "table" => table, "shard" => shard.to_owned())
        .set(if differs { 1.0 } else { 0.0 });
}

#[cfg(test)]
mod tests {
    use super::{KINDS, kind};

    #[test]
    fn a_statement_is_counted_under_its_first_word() {
        for (sql, expected) in [
            ("SELECT 1", "select"),
            ("  \n\tselect * FROM t", "select"),
            ("Insert INTO t VALUES (1)", "insert"),
            ("UPDATE t SET a = 1", "update"),
            ("delete FROM t", "delete"),
            ("BEGIN", "other"),
            ("WITH x AS (SELECT 1) SELECT * FROM x", "other"),
            ("selec", "other"),
            ("", "other"),
            ("   ", "other"),
            ("é SELECT", "other"),
            ("\x0BSELECT 1", "select"),
            ("\u{00A0}\u{2028}UPDATE t SET a = 1", "update"),
            ("uPdAtE t SET a = 1", "update"),
            ("DELETE", "delete"),
            // Near misses: a letter's byte less 0x40 ('3' for 's'), a
            // control byte, a letter beside the one asked for.
            ("3elect 1", "other"),
            ("s\x05lect 1", "other"),
            ("selecu", "other"),
            ("insert\u{0}", "insert"),
        ] {
            assert_eq!(KINDS[kind(sql)], expected, "{sql:?}");
        }
    }
}
