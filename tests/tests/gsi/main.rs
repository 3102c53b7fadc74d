//! Global secondary indexes on SQLite, PostgreSQL and MySQL/MariaDB: the
//! `gsi` test binary, its scenarios in these files:
//!
//! - `basics.rs`: index rows written first, lookups that ask only the shards
//!   the index names and verify every row, unique violations and takeover of
//!   dangling rows, updates that move the entry, backfill and reconciliation.
//! - `races.rs`: races, faults and hostile input: concurrent updates of one
//!   row, unique conflicts in reconcile, byte-for-byte values, backfill
//!   beside deletes, failed unique claims.
//!
//! `faults.rs` and `servers.rs` beside them are test binaries of their own
//! (`gsi_faults` and `gsi_servers` in tests/Cargo.toml): each arms a
//! failpoint for the whole process that the scenarios here must not meet.

mod basics;
mod races;

use basics::{
    a_failed_index_write_names_its_table, by_index_reports_a_failed_owner_shard,
    cancelled_backfill_stops_at_a_chunk_and_resumes, index_rows_beside_their_owner_commit_relaxed,
    lookups_follow_the_index, pinned_index_lives_on_one_shard,
    reconcile_removes_dangling_and_adds_missing, unique_violation_and_takeover,
    write_only_scatters_until_backfilled,
};
use races::{
    backfill_indexes_every_owner_despite_concurrent_deletes, failed_claim_is_not_a_duplicate,
    index_tables_of_an_older_release_are_converted, index_values_compare_byte_for_byte,
    long_value_is_refused_with_a_bounded_message, reconcile_reports_unique_conflicts_and_goes_on,
    unique_race_reports_only_real_duplicates, update_race_keeps_the_unique_index_row,
};
use sea_orm::{ConnectionTrait, Statement};
use shardkit::Cluster;
use shardkit_tests::backend_tests;
use std::collections::BTreeSet;

backend_tests!(4 =>
    // basics.rs
    lookups_follow_the_index,
    unique_violation_and_takeover,
    write_only_scatters_until_backfilled,
    cancelled_backfill_stops_at_a_chunk_and_resumes,
    reconcile_removes_dangling_and_adds_missing,
    pinned_index_lives_on_one_shard,
    index_rows_beside_their_owner_commit_relaxed,
    by_index_reports_a_failed_owner_shard,
    a_failed_index_write_names_its_table,
    // races.rs
    update_race_keeps_the_unique_index_row,
    reconcile_reports_unique_conflicts_and_goes_on,
    index_values_compare_byte_for_byte,
    [MySql] index_tables_of_an_older_release_are_converted,
    backfill_indexes_every_owner_despite_concurrent_deletes,
    unique_race_reports_only_real_duplicates,
    failed_claim_is_not_a_duplicate,
    long_value_is_refused_with_a_bounded_message,
);

/// Index rows of `table` across all shards, as (value, shard key).
pub(crate) async fn index_rows(cluster: &Cluster, table: &str) -> BTreeSet<(String, String)> {
    let mut rows = BTreeSet::new();
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        let found = db
            .query_all_raw(Statement::from_string(
                db.get_database_backend(),
                format!("SELECT value, shard_key FROM {table}"),
            ))
            .await
            .unwrap();
        for row in found {
            rows.insert((
                row.try_get::<String>("", "value").unwrap(),
                row.try_get::<String>("", "shard_key").unwrap(),
            ));
        }
    }
    rows
}
