//! SeaORM's toolbox inside one shard key, on SQLite, PostgreSQL and
//! MySQL/MariaDB: the `seaorm` test binary, its scenarios in these files:
//!
//! - `parity.rs`: relations, streams, batch writes. Each read must return the
//!   key's rows only, even when another key's rows share the shard and the
//!   join; each write must touch only the key's rows.
//! - `reads.rs`: reads that used to compile and then fail or panic: partial
//!   selects decoded through `into_tuple` / `into_model` / `into_json`,
//!   `u64` keys above `i64::MAX`, and pagination within a key.

mod parity;
mod reads;

use parity::{
    a_stream_from_a_shard_that_hangs_mid_statement_fails, batch_writes_keep_global_indexes,
    batch_writes_on_a_small_pool_all_complete, batch_writes_touch_only_the_key,
    keyed_streams_return_the_keys_rows, multi_shard_projections_merge_or_refuse,
    related_reads_stay_within_the_key, save_inserts_or_updates,
    writes_without_returning_send_one_statement,
};
use reads::{
    keyed_partial_selects_decode_projections, keyed_reads_paginate_within_their_key,
    u64_keys_above_i64_max,
};
use shardkit_tests::backend_tests;

backend_tests!(2 =>
    // parity.rs
    related_reads_stay_within_the_key,
    keyed_streams_return_the_keys_rows,
    [Postgres, MySql] a_stream_from_a_shard_that_hangs_mid_statement_fails,
    batch_writes_touch_only_the_key,
    batch_writes_keep_global_indexes,
    save_inserts_or_updates,
    batch_writes_on_a_small_pool_all_complete,
    multi_shard_projections_merge_or_refuse,
    writes_without_returning_send_one_statement,
    // reads.rs
    keyed_partial_selects_decode_projections,
    u64_keys_above_i64_max,
    keyed_reads_paginate_within_their_key,
);
