//! Online bucket moves on SQLite, PostgreSQL and MySQL/MariaDB: the
//! Customer group (customers, orders, contacts with global indexes) on four
//! shards grows to a fifth while application instances keep writing. The
//! `rebalance` test binary: its shared steps here, its scenarios in
//! `writers.rs`, `control.rs`, `holds.rs`, `placement.rs` and
//! `processes.rs` (see each file's opening).

use sea_orm::{ActiveValue::Set, ConnectionTrait, EntityTrait};
use shardkit::rebalance::{MovePhase, MoveProgress, Rebalance};
use shardkit::{CancellationToken, Cluster, ClusterConfig, JobControl, ShardError};
use shardkit_tests::models::*;
use shardkit_tests::{
    Backend, Proxy, TestDbs, backend_tests, cancelled_by_another_task, contacts_by_index,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

mod control;
mod holds;
mod placement;
mod processes;
mod writers;

use control::*;
use holds::*;
use placement::*;
use processes::*;
use writers::*;

backend_tests!(5 =>
    two_instances_write_while_a_quarter_of_the_buckets_move,
    the_mover_killed_in_each_phase_is_resumed_by_another_process,
    abort_in_each_phase_leaves_the_source_the_owner,
    overlapping_moves_are_refused_and_plans_are_minimal,
    shardctl_plans_starts_resumes_and_aborts_moves,
    a_range_splits_and_half_of_it_moves_while_two_instances_write,
    a_split_that_dies_before_fencing_is_finished_by_the_next_move,
    [Postgres, MySql] a_target_that_refuses_or_hangs_stops_the_mover_and_leaks_nothing,
    a_mover_paused_past_its_hold_is_refused_where_it_writes,
    a_copy_converges_while_writers_add_parents_and_children,
    a_mover_dead_after_fencing_is_taken_over_once_its_hold_lapses,
    a_shard_added_to_the_config_connects_unmigrated_and_takes_buckets_after_migrate,
    a_migrate_that_fails_on_a_ticket_server_leaves_the_movable_group_writable,
    an_instance_that_has_not_refreshed_reads_a_moved_row_as_at_the_flip,
    [Sqlite] a_background_map_read_dropped_unrun_is_tried_again,
    [Postgres, MySql] a_mover_paused_inside_its_transaction_does_not_block_the_next,
    [Postgres] a_mover_paused_while_sending_a_copy_does_not_block_the_next,
    [Postgres] a_table_in_a_named_schema_moves_with_copy,
    [MySql] a_table_in_a_database_every_shard_shares_is_not_moved,
    a_shard_whose_url_reaches_another_shards_database_takes_no_move,
    [Postgres] shards_that_are_schemas_of_one_database_move_their_own_tables_only,
    a_begin_whose_fence_read_the_database_aborts_begins_again,
    [Sqlite] a_move_run_by_another_process_on_the_same_sqlite_files,
    [Sqlite] child_process_mover,
    [Sqlite] a_process_reads_what_another_process_moved_and_cleaned,
    a_cancelled_run_stops_at_a_chunk_and_the_next_run_resumes,
    an_outcome_pruned_on_one_side_of_a_move_does_not_stop_it,
    a_mover_cleans_after_the_longest_grace_of_the_instances,
);

const BUCKETS: u32 = 64;

/// Failpoints are configured per name for the whole process: the scenarios
/// that set them (on every backend) take turns.
static FAILPOINTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config(dbs: &TestDbs, refresh_ms: u64) -> ClusterConfig {
    config_with(
        dbs,
        &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
        refresh_ms,
    )
}

/// Five shards on pools of 2 and the movable Customer group placed by
/// `placement` (its TOML lines).
fn config_with(dbs: &TestDbs, placement: &str, refresh_ms: u64) -> ClusterConfig {
    let toml = toml_with(dbs, placement, refresh_ms);
    ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("config: {e}\n{toml}"))
}

fn toml_with(dbs: &TestDbs, placement: &str, refresh_ms: u64) -> String {
    format!(
        "{}\n[groups.Customer]\n{placement}\nmovable = true\n\n[rebalance]\nrefresh_ms = {refresh_ms}\ncleanup_grace_ms = 0\nchunk = 40\n",
        dbs.shards_toml(5)
            .replace("max_connections = 4", "max_connections = 2"),
    )
}

async fn connect(dbs: &TestDbs, refresh_ms: u64) -> Cluster {
    let cluster = Cluster::connect(config(dbs, refresh_ms)).await.unwrap();
    cluster.refresh_bucket_maps().await.unwrap();
    cluster
}

fn mover(cluster: &Cluster) -> Rebalance<Customer> {
    cluster
        .rebalance::<Customer>()
        .unwrap()
        .entity::<customer::Entity>()
        .entity::<order::Entity>()
        .entity::<contact::Entity>()
}

fn bucket(key: i64) -> u32 {
    (shardkit::ShardKey::partition_hash(&key) % u64::from(BUCKETS)) as u32
}

fn epoch(cluster: &Cluster) -> u64 {
    cluster
        .topology()
        .live_owners("Customer")
        .unwrap()
        .unwrap()
        .epoch()
}

/// What the application was told it wrote: each customer's name and each
/// order (id → customer, total).
#[derive(Default)]
struct Acked {
    customers: BTreeMap<i64, String>,
    orders: BTreeMap<i64, (i64, i64)>,
}

type Shared = Arc<Mutex<Acked>>;

/// An order row as found: the shard, and (customer, total).
type Placed = (String, (i64, i64));

/// A customer's first name: with the characters a copy must carry
/// unchanged (`COPY`'s delimiters and escape, a quote, a non-ASCII letter).
/// Waits (at most 10 s) until the control database (s0) holds `ms` as the
/// longest cleanup grace an instance recorded (recorded in the background
/// once an instance's map counts as read).
async fn grace_recorded(a: &Cluster, ms: i64) {
    let control = a.connection("s0").unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let row = control
            .query_one_raw(sea_orm::Statement::from_string(
                control.get_database_backend(),
                "SELECT grace_ms FROM shardkit_bucket_epochs",
            ))
            .await
            .unwrap()
            .unwrap();
        if row.try_get::<Option<i64>>("", "grace_ms").unwrap() == Some(ms) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the instance's grace was never recorded"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Customer 1's name, read by `c` (outside a transaction).
async fn name_of_first(c: &Cluster) -> Option<String> {
    c.find::<customer::Entity>()
        .key(1)
        .one()
        .await
        .unwrap_or_else(|e| panic!("read: {}", e.report()))
        .map(|m| m.name)
}

fn first_name(id: i64) -> String {
    format!("c{id}\t\\N\n\\'é")
}

async fn insert_customer(cluster: &Cluster, acked: &Shared, id: i64) {
    cluster
        .transaction::<Customer, _, _>(id, |tx| async move {
            tx.insert(customer::ActiveModel {
                id: Set(id),
                name: Set(first_name(id)),
            })
            .await?;
            tx.insert(contact::row(
                id,
                id,
                &format!("m{id}@x"),
                &format!("p{}", id % 7),
            ))
            .await?;
            tx.insert(order::ActiveModel {
                id: Set(id * 1000),
                customer_id: Set(id),
                total_cents: Set(1),
            })
            .await
        })
        .await
        .unwrap_or_else(|e| panic!("insert customer {id}: {}", e.report()));
    let mut a = acked.lock().unwrap();
    a.customers.insert(id, first_name(id));
    a.orders.insert(id * 1000, (id, 1));
}

/// One round of writes to customer `id`: rename it, add an order, delete
/// the order of two rounds ago, bump the first order.
async fn write_round(
    cluster: &Cluster,
    acked: &Shared,
    id: i64,
    round: i64,
) -> Result<(), ShardError> {
    let name = format!("c{id}-r{round}");
    let new_order = id * 1000 + round;
    let old_order = id * 1000 + round - 2;
    let had_old = round >= 3 && acked.lock().unwrap().orders.contains_key(&old_order);
    cluster
        .transaction::<Customer, _, _>(id, |tx| {
            let name = name.clone();
            async move {
                tx.update(customer::ActiveModel {
                    id: sea_orm::ActiveValue::Unchanged(id),
                    name: Set(name),
                })
                .await?;
                tx.insert(order::ActiveModel {
                    id: Set(new_order),
                    customer_id: Set(id),
                    total_cents: Set(round),
                })
                .await?;
                if had_old {
                    tx.delete(order::ActiveModel {
                        id: sea_orm::ActiveValue::Unchanged(old_order),
                        customer_id: sea_orm::ActiveValue::Unchanged(id),
                        total_cents: sea_orm::ActiveValue::NotSet,
                    })
                    .await?;
                }
                tx.update(order::ActiveModel {
                    id: sea_orm::ActiveValue::Unchanged(id * 1000),
                    customer_id: sea_orm::ActiveValue::Unchanged(id),
                    total_cents: Set(round),
                })
                .await?;
                Ok(())
            }
        })
        .await?;
    let mut a = acked.lock().unwrap();
    a.customers.insert(id, name);
    a.orders.insert(new_order, (id, round));
    if had_old {
        a.orders.remove(&old_order);
    }
    a.orders.insert(id * 1000, (id, round));
    Ok(())
}

/// Writes rounds to `keys` until `stop`, then one more round; returns the
/// rounds written. Every write must succeed.
fn writer(
    cluster: Cluster,
    acked: Shared,
    keys: Vec<i64>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let mut round = 1;
        loop {
            let last = stop.load(Ordering::SeqCst);
            for &k in &keys {
                if let Err(e) = write_round(&cluster, &acked, k, round).await {
                    panic!("write of customer {k} in round {round}: {}", e.report());
                }
            }
            round += 1;
            if last {
                return round;
            }
            tokio::task::yield_now().await;
        }
    })
}

/// Every customer's name, projected from every shard.
async fn scatter_names(cluster: &Cluster) -> Result<Vec<String>, ShardError> {
    cluster
        .find::<customer::Entity>()
        .scatter()
        .select_only()
        .column(customer::Column::Name)
        .into_tuple::<String>()
        .all()
        .await
}

/// Eight writers, four per instance, each on its own keys of `keys` (the
/// test configs give every shard a pool of 2).
fn eight_writers(
    instances: [&Cluster; 2],
    acked: &Shared,
    keys: std::ops::RangeInclusive<i64>,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<i64>> {
    (0..8i64)
        .map(|w| {
            let mine: Vec<i64> = keys.clone().filter(|k| k % 8 == w).collect();
            let on = instances[(w % 2) as usize];
            writer(on.clone(), Arc::clone(acked), mine, Arc::clone(stop))
        })
        .collect()
}

/// Each key's owner by `cluster`'s map as it is now.
fn owners(cluster: &Cluster) -> impl Fn(i64) -> String + '_ {
    let map = cluster
        .topology()
        .live_owners("Customer")
        .unwrap()
        .unwrap()
        .snapshot();
    move |key| {
        cluster
            .topology()
            .shard(map.owner_of(&key).expect("every key has an owner"))
            .name
            .clone()
    }
}

/// Every row of `E` on every shard, by the id `row` gives with its value:
/// the shards it is on, each with that value.
async fn placed<E: EntityTrait, T>(
    cluster: &Cluster,
    row: impl Fn(E::Model) -> (i64, T),
) -> BTreeMap<i64, Vec<(String, T)>> {
    let mut found: BTreeMap<i64, Vec<(String, T)>> = BTreeMap::new();
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        for model in E::find().all(db).await.unwrap() {
            let (id, value) = row(model);
            found.entry(id).or_default().push((shard.to_owned(), value));
        }
    }
    found
}

/// Every acknowledged row is on its bucket's owner (as `cluster`'s map says)
/// exactly once, with what was acknowledged; no other row exists; the
/// global indexes find every contact.
async fn check_placement(cluster: &Cluster, acked: &Shared) {
    let acked = {
        let a = acked.lock().unwrap();
        Acked {
            customers: a.customers.clone(),
            orders: a.orders.clone(),
        }
    };
    let owner = owners(cluster);
    let mut customers = placed::<customer::Entity, _>(cluster, |c| (c.id, c.name)).await;
    let mut orders: BTreeMap<i64, Vec<Placed>> =
        placed::<order::Entity, _>(cluster, |o| (o.id, (o.customer_id, o.total_cents))).await;
    for (id, name) in &acked.customers {
        let found = customers.remove(id).unwrap_or_default();
        assert_eq!(
            found,
            vec![(owner(*id), name.clone())],
            "customer {id} (bucket {})",
            bucket(*id)
        );
    }
    assert!(
        customers.is_empty(),
        "customers never acknowledged or not deleted: {customers:?}"
    );
    for (id, row) in &acked.orders {
        let found = orders.remove(id).unwrap_or_default();
        assert_eq!(
            found,
            vec![(owner(row.0), *row)],
            "order {id} of customer {} (bucket {})",
            row.0,
            bucket(row.0)
        );
    }
    assert!(
        orders.is_empty(),
        "orders never acknowledged or not deleted: {orders:?}"
    );
    for id in acked.customers.keys() {
        assert_eq!(
            contacts_by_index(cluster, contact::Column::Email, &format!("m{id}@x")).await,
            vec![*id],
            "the email index finds contact {id}"
        );
    }
}

async fn seed(cluster: &Cluster, acked: &Shared, keys: impl IntoIterator<Item = i64>) {
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.setup::<contact::Entity>().await.unwrap();
    cluster
        .gsi()
        .backfill::<contact::Entity>(contact::Column::Email)
        .await
        .unwrap();
    cluster.refresh_bucket_maps().await.unwrap();
    for k in keys {
        insert_customer(cluster, acked, k).await;
    }
}

/// An instance (refreshing every 20 ms) with customers `1..=n` seeded and a
/// writer writing all of them until the flag is set.
async fn seeded_with_writer(
    dbs: &TestDbs,
    n: i64,
) -> (
    Cluster,
    Shared,
    Arc<AtomicBool>,
    tokio::task::JoinHandle<i64>,
) {
    let a = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=n).await;
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(
        a.clone(),
        Arc::clone(&acked),
        (1..=n).collect(),
        Arc::clone(&stop),
    );
    (a, acked, stop, w)
}

/// An instance of `config` on `clock`.
async fn connect_on(config: ClusterConfig, clock: Arc<dyn shardkit::Clock>) -> Cluster {
    Cluster::builder(config)
        .clock(clock)
        .connect()
        .await
        .unwrap()
}

/// Another instance whose clock is 10 minutes ahead: to it, a mover's hold
/// taken by an instance on the system clock lapsed long ago (a mover frozen
/// past its hold, without waiting for it).
async fn ahead_instance(dbs: &TestDbs) -> Cluster {
    let ahead = Arc::new(shardkit::clock::ManualClock::new(
        shardkit::Clock::now_millis(&shardkit::clock::SystemClock) + 600_000,
    ));
    connect_on(config(dbs, 20), ahead).await
}

/// Counts the movers that park at a `shardkit::rebalance::park::*`
/// failpoint (until the failpoint `shardkit::rebalance::parked` is removed).
fn count_parks() -> Arc<std::sync::atomic::AtomicUsize> {
    let parked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&parked);
    fail::cfg_callback("shardkit::rebalance::parked", move || {
        count.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    parked
}

/// Every fourth bucket: 16 of 64, four from each of s0..s3.
fn quarter() -> Vec<u32> {
    (0..BUCKETS).step_by(4).collect()
}

/// The `COPY` statements an instance's observer saw: (shard, SQL).
type Copies = Arc<Mutex<Vec<(String, String)>>>;

/// An instance (`config(dbs, 20)`) that keeps the `COPY` statements its
/// observer sees.
async fn copy_observed(dbs: &TestDbs) -> (Cluster, Copies) {
    let copies: Copies = Arc::default();
    let kept = Arc::clone(&copies);
    let cluster = Cluster::builder(config(dbs, 20))
        .on_statement(move |e| {
            if e.statement.sql.starts_with("COPY") {
                let sql = e.statement.sql.clone();
                kept.lock().unwrap().push((e.shard.to_owned(), sql));
            }
        })
        .connect()
        .await
        .unwrap();
    (cluster, copies)
}
