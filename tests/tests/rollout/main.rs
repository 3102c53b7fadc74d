//! Denormalisation rollouts on SQLite, PostgreSQL and MySQL/MariaDB: the
//! `rollout` test binary, its scenarios in these files:
//!
//! - `basics.rs`: two application instances sharing the phase, dual writes
//!   that commit or fail together, caches of both models, backfill, reads
//!   that follow the phase, and the verifier.
//! - `folds.rs`: rollouts that fold several tables into one (`users` +
//!   `user_profiles`, `orders` + `order_lines`), written by two instances
//!   through every phase.
//! - `keys.rs`: a conversion that changes the shard key is refused like any
//!   cross-shard write.
//! - `races.rs`: clusters dropped while their periodic tasks run, phases
//!   that move while a backfill runs, and instances that act on an older
//!   phase.
//!
//! Failpoints are process-wide: a scenario that arms one scopes it to its
//! own databases or rows (the failpoint's argument).

mod basics;
mod folds;
mod keys;
mod races;

use basics::{
    advance_when_ready_waits_out_the_gap, an_instance_without_the_rollout_is_visible,
    backfill_when_ready_waits_out_the_gap_and_resumes_after_a_timeout,
    cancelled_backfill_stops_at_a_chunk_and_resumes, failed_new_write_rolls_back_old,
    full_rollout_walk, old_index_reads_follow_the_phase, old_reads_follow_the_phase,
    old_reads_follow_the_phase_into_a_named_schema, phase_gap_is_enforced,
    status_lists_the_instances, verify_finds_injected_differences, verify_shards_compares_copies,
};
use folds::{
    a_failed_part_dual_write_rolls_back_the_transaction,
    concurrent_part_writes_on_a_small_pool_fold_every_line, fold_declarations_are_checked,
    fold_walk_with_two_instances, new_only_part_inserts_keep_primary_key_order,
    part_writes_and_root_writes_never_deadlock, verify_and_repair_the_folded_form,
};
use keys::conversion_that_moves_the_key_is_refused;
use races::{
    backfill_waits_until_every_instance_dual_writes,
    dropping_the_cluster_stops_its_tasks_and_closes_its_pools,
    new_only_write_that_moves_the_key_is_refused,
    retreat_during_backfill_stops_it_and_voids_its_progress,
    two_retreats_at_once_go_back_one_phase,
};
use shardkit_tests::backend_tests;

backend_tests!(4 =>
    // basics.rs
    full_rollout_walk,
    failed_new_write_rolls_back_old,
    phase_gap_is_enforced,
    verify_finds_injected_differences,
    verify_shards_compares_copies,
    advance_when_ready_waits_out_the_gap,
    backfill_when_ready_waits_out_the_gap_and_resumes_after_a_timeout,
    cancelled_backfill_stops_at_a_chunk_and_resumes,
    old_reads_follow_the_phase,
    [Postgres] old_reads_follow_the_phase_into_a_named_schema,
    old_index_reads_follow_the_phase,
    status_lists_the_instances,
    an_instance_without_the_rollout_is_visible,
    // folds.rs
    fold_walk_with_two_instances,
    a_failed_part_dual_write_rolls_back_the_transaction,
    concurrent_part_writes_on_a_small_pool_fold_every_line,
    fold_declarations_are_checked,
    verify_and_repair_the_folded_form,
    part_writes_and_root_writes_never_deadlock,
    new_only_part_inserts_keep_primary_key_order,
    // keys.rs
    conversion_that_moves_the_key_is_refused,
    // races.rs
    dropping_the_cluster_stops_its_tasks_and_closes_its_pools,
    retreat_during_backfill_stops_it_and_voids_its_progress,
    backfill_waits_until_every_instance_dual_writes,
    new_only_write_that_moves_the_key_is_refused,
    two_retreats_at_once_go_back_one_phase,
);
