//! Liveness on PostgreSQL and MySQL/MariaDB (and SQLite where it applies):
//! the `liveness` test binary, its scenarios in these files:
//!
//! - `breaker.rs`: the circuit breaker under short network cuts and under a
//!   shard that stays down: a shard back from a cut serves the first request
//!   that needs it, and a shard that refuses or hangs fails requests at once,
//!   one probe at a time, without leaking connections.
//! - `faults.rs`: liveness under load and faults: index-first writes on small
//!   pools never deadlock, a down or hung shard fails requests fast with its
//!   cause (and comes back once reachable), and index reads with
//!   `.partial()` report a down index shard instead of failing or hanging;
//!   a connection left mid-statement is closed, not kept by its pool.

mod breaker;
mod faults;

use breaker::{
    a_hung_shard_fails_fast_one_probe_at_a_time,
    a_refused_shard_fails_fast_and_the_probing_request_succeeds,
    short_cuts_fail_requests_only_until_the_shard_answers,
    waiting_readers_fail_together_when_the_watch_finds_the_shard_down,
};
use faults::{
    a_connection_left_mid_statement_is_closed_not_kept,
    create_databases_skips_a_lazy_shard_that_is_down, down_shard_comes_back_once_reachable,
    hung_shard_fails_fast_with_its_cause, index_first_writes_on_small_pools_all_complete,
    index_read_partial_reports_a_down_index_shard, refused_shard_fails_fast_with_its_cause,
};
use shardkit_tests::backend_tests;

backend_tests!(2 =>
    // breaker.rs
    [Postgres, MySql] short_cuts_fail_requests_only_until_the_shard_answers,
    [Postgres, MySql] a_refused_shard_fails_fast_and_the_probing_request_succeeds,
    [Postgres, MySql] a_hung_shard_fails_fast_one_probe_at_a_time,
    [Postgres, MySql] waiting_readers_fail_together_when_the_watch_finds_the_shard_down,
    // faults.rs
    index_first_writes_on_small_pools_all_complete,
    [Postgres, MySql] refused_shard_fails_fast_with_its_cause,
    [Postgres, MySql] hung_shard_fails_fast_with_its_cause,
    [Postgres, MySql] down_shard_comes_back_once_reachable,
    [Postgres, MySql] create_databases_skips_a_lazy_shard_that_is_down,
    index_read_partial_reports_a_down_index_shard,
    [Postgres, MySql] a_connection_left_mid_statement_is_closed_not_kept,
);
