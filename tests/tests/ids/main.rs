//! Globally unique ids on SQLite, PostgreSQL and MySQL/MariaDB: the `ids`
//! test binary, its scenarios in these files:
//!
//! - `basics.rs`: two ticket servers, 8 tasks × 20,000 ids with one server
//!   cut off halfway (zero duplicates, every id handed out), ticket round
//!   trips counted, Flickr mode, `advance_past`, shard-encoded ids and ids
//!   filled in by the derive.
//! - `failures.rs`: ticket sequences under the conditions that used to break
//!   them: dropped clusters, missing sequence tables, failing and hung
//!   servers, migrations, Flickr mode under concurrency, and configs whose
//!   `ids.servers` differ.
//!
//! Failpoints are process-wide: a scenario that arms one names it after a
//! sequence or ticket server no other scenario here uses.

mod basics;
mod failures;

use basics::{
    flickr_mode_and_advance_past, generated_primary_keys_and_shard_encoded_ids,
    ticket_round_trips_are_counted, tickets_survive_losing_a_server,
};
use failures::{
    a_clear_that_races_a_set_up_leaves_no_server_without_its_place,
    a_hung_or_refusing_ticket_server_fails_set_up_not_tickets,
    a_list_that_sets_up_between_anothers_read_and_write_wins_alone,
    a_missing_sequence_is_a_config_error_not_an_outage,
    a_prefetch_dropped_with_its_runtime_leaves_the_sequence_serving,
    a_set_up_that_stops_while_confirming_is_finished_by_the_next,
    a_sqlite_ticket_server_that_cannot_be_opened_is_opened_on_first_use,
    a_ticket_server_serves_only_the_list_it_was_set_up_with,
    an_exhausted_sequence_is_refused_never_negative,
    configs_setting_up_at_once_confirm_no_split_places,
    dropping_the_cluster_closes_the_ticket_pools, failed_servers_are_reported_once,
    flickr_requests_run_concurrently, migrate_runs_only_shardkit_migrations_on_ticket_servers,
    servers_set_up_before_places_are_adopted_not_guessed,
};
use shardkit_tests::backend_tests;

backend_tests!(2 =>
    // basics.rs
    tickets_survive_losing_a_server,
    ticket_round_trips_are_counted,
    flickr_mode_and_advance_past,
    generated_primary_keys_and_shard_encoded_ids,
    // failures.rs
    [Postgres, MySql] dropping_the_cluster_closes_the_ticket_pools,
    a_missing_sequence_is_a_config_error_not_an_outage,
    a_prefetch_dropped_with_its_runtime_leaves_the_sequence_serving,
    failed_servers_are_reported_once,
    migrate_runs_only_shardkit_migrations_on_ticket_servers,
    flickr_requests_run_concurrently,
    an_exhausted_sequence_is_refused_never_negative,
    a_ticket_server_serves_only_the_list_it_was_set_up_with,
    configs_setting_up_at_once_confirm_no_split_places,
    a_set_up_that_stops_while_confirming_is_finished_by_the_next,
    a_list_that_sets_up_between_anothers_read_and_write_wins_alone,
    a_clear_that_races_a_set_up_leaves_no_server_without_its_place,
    servers_set_up_before_places_are_adopted_not_guessed,
    [Postgres, MySql] a_hung_or_refusing_ticket_server_fails_set_up_not_tickets,
    [Sqlite] a_sqlite_ticket_server_that_cannot_be_opened_is_opened_on_first_use,
);
