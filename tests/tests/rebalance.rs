//! Online bucket moves on SQLite, PostgreSQL and MySQL/MariaDB: the
//! Customer group (customers, orders, contacts with global indexes) on four
//! shards grows to a fifth while application instances keep writing.

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

async fn two_instances_write_while_a_quarter_of_the_buckets_move(dbs: &mut TestDbs) {
    // Metrics recorded from here on (the move's copy method, below).
    shardkit_tests::recorded::totals();
    // The mover's instance keeps the `COPY` statements its observer sees.
    let (a, copies) = copy_observed(dbs).await;
    a.refresh_bucket_maps().await.unwrap();
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=120).await;
    // The second instance never refreshes its map on its own; the third
    // neither, and only reads.
    let b = connect(dbs, 0).await;
    let reader = connect(dbs, 0).await;
    assert_eq!((epoch(&a), epoch(&b)), (1, 1));

    let stop = Arc::new(AtomicBool::new(false));
    let writers = eight_writers([&a, &b], &acked, 1..=120, &stop);

    let progress = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&progress);
    let m =
        mover(&a).control(JobControl::new().on_progress(move |p: &MoveProgress| {
            seen.lock().unwrap().push((p.phase, p.rows_copied))
        }));
    let plan = m.plan_buckets(quarter(), "s4").await.unwrap();
    assert_eq!(plan.buckets.len(), 16);
    let started = m.start(&plan).await.unwrap();
    assert_eq!(started.phase, MovePhase::Registered);
    let done = m
        .run(started.id)
        .await
        .unwrap_or_else(|e| panic!("move: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done, "{done:?}");
    assert!(done.rows_copied > 0);
    assert_eq!(epoch(&a), 2);
    assert!(
        progress
            .lock()
            .unwrap()
            .iter()
            .any(|(p, _)| *p == MovePhase::Copying),
        "progress reported while copying"
    );

    // Both instances keep writing after the cut-over: the stale one's
    // writes to moved buckets are refused by the old shard's fence and
    // land on the new owner.
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        assert!(w.await.unwrap() > 1, "every writer wrote through the move");
    }
    assert_eq!(
        epoch(&b),
        2,
        "the stale instance read the new map when a fence refused it"
    );

    check_placement(&a, &acked).await;
    // The reader's map is older than the cleanup grace: its reads of moved
    // keys read the map first and find every row on the new owner, not an
    // empty (cleaned) source.
    for k in (1..=120).filter(|k| bucket(*k).is_multiple_of(4)) {
        let found = reader
            .find::<customer::Entity>()
            .key(k)
            .one()
            .await
            .unwrap()
            .map(|c| c.name);
        assert_eq!(
            found.as_ref(),
            acked.lock().unwrap().customers.get(&k),
            "customer {k}"
        );
    }
    assert_eq!(epoch(&reader), 2);
    // Scatter reads see each row once.
    let all = a.find::<customer::Entity>().scatter().all().await.unwrap();
    assert_eq!(all.len(), acked.lock().unwrap().customers.len());
    // With no move left unfinished, counts and projections of every shard
    // run as they always do.
    let counted = a
        .find::<customer::Entity>()
        .scatter()
        .count()
        .await
        .unwrap();
    assert_eq!(counted as usize, all.len());
    assert_eq!(scatter_names(&a).await.unwrap().len(), all.len());
    let on_s4 = customer::Entity::find()
        .all(a.connection("s4").unwrap())
        .await
        .unwrap();
    assert!(!on_s4.is_empty());
    assert!(on_s4.iter().all(|c| bucket(c.id).is_multiple_of(4)));
    assert!(
        m.list(false).await.unwrap().is_empty(),
        "no move left running"
    );
    // Between PostgreSQL shards the copy ran with `COPY` (other backends'
    // scenarios, side by side in this process, count "insert" only).
    if dbs.backend == Backend::Postgres {
        let copied = shardkit_tests::recorded::totals()
            .counter("shardkit_move_rows_written_total{group=Customer,method=copy}");
        assert!(copied > 0, "no row was copied with COPY");
        // Its statements reached the observer: read on the sources,
        // written on the target.
        let copies = copies.lock().unwrap();
        assert!(
            copies
                .iter()
                .any(|(shard, sql)| shard == "s4" && sql.ends_with("FROM STDIN")),
            "no COPY into s4 observed: {copies:?}"
        );
        assert!(
            copies
                .iter()
                .any(|(shard, sql)| shard != "s4" && sql.ends_with("TO STDOUT")),
            "no COPY out of a source observed: {copies:?}"
        );
    } else {
        assert!(copies.lock().unwrap().is_empty());
    }
}

/// The Customer group as four key ranges of 40 (s0..s3, the last one
/// unbounded above), `movable`.
fn range_config(dbs: &TestDbs, refresh_ms: u64) -> ClusterConfig {
    config_with(
        dbs,
        "placement = \"range\"\nranges = [\n  { shard = \"s0\", to = 40 },\n  { shard = \"s1\", from = 40, to = 80 },\n  { shard = \"s2\", from = 80, to = 120 },\n  { shard = \"s3\", from = 120 },\n]",
        refresh_ms,
    )
}

/// The group's ranges as `(id, from, to, shard)`.
async fn ranges_of(
    m: &Rebalance<Customer>,
    cluster: &Cluster,
) -> Vec<(u32, Option<i64>, Option<i64>, String)> {
    let int = |b: &Option<shardkit::topology::RangeBound>| match b {
        Some(shardkit::topology::RangeBound::Int(v)) => Some(*v),
        None => None,
        Some(other) => panic!("an integer bound, not {other}"),
    };
    m.ranges()
        .await
        .unwrap()
        .iter()
        .map(|u| {
            (
                u.id,
                int(&u.from),
                int(&u.to),
                cluster.topology().shard(u.shard).name.clone(),
            )
        })
        .collect()
}

async fn a_range_splits_and_half_of_it_moves_while_two_instances_write(dbs: &mut TestDbs) {
    let a = Cluster::connect(range_config(dbs, 20)).await.unwrap();
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=160).await;
    // `b` never refreshes on its own: it routes by the ranges it read at
    // connect until a fence refuses it.
    let b = Cluster::connect(range_config(dbs, 0)).await.unwrap();
    b.refresh_bucket_maps().await.unwrap();
    assert_eq!((epoch(&a), epoch(&b)), (1, 1));
    let m = mover(&a);
    let s = |n: &str| n.to_owned();
    assert_eq!(
        ranges_of(&m, &a).await,
        vec![
            (0, None, Some(40), s("s0")),
            (1, Some(40), Some(80), s("s1")),
            (2, Some(80), Some(120), s("s2")),
            (3, Some(120), None, s("s3")),
        ]
    );

    let stop = Arc::new(AtomicBool::new(false));
    let writers = eight_writers([&a, &b], &acked, 1..=160, &stop);

    // Split [80, 120) at 100: both halves stay on s2, under new ids; the
    // old range is fenced there, so `b`'s writes by range 2 are refused
    // and rerouted.
    let split = m
        .split_at(&100)
        .await
        .unwrap_or_else(|e| panic!("split: {}", e.report()));
    assert_eq!((split.retired.id, split.left.id, split.right.id), (2, 4, 5));
    assert_eq!((split.epoch, split.fenced), (2, true));
    let split_again = m.split_at(&80).await.unwrap_err();
    assert!(
        matches!(&split_again, ShardError::Rebalance { reason, .. } if reason.contains("already starts range 4")),
        "{split_again}"
    );
    let even = m.plan_even_out("s4").await.unwrap_err();
    assert!(matches!(even, ShardError::Rebalance { .. }), "{even}");

    // A range a move holds does not split.
    let held = m
        .start(&m.plan_range(&10, "s4").await.unwrap())
        .await
        .unwrap();
    let refused = m.split_at(&20).await.unwrap_err();
    assert!(
        matches!(&refused, ShardError::Rebalance { reason, .. } if reason.contains(&format!("held by move #{}", held.id))),
        "{refused}"
    );
    assert_eq!(m.abort(held.id).await.unwrap().phase, MovePhase::Aborted);

    // [100, 120) moves to s4 while everyone writes.
    let plan = m.plan_range(&107, "s4").await.unwrap();
    assert_eq!(plan.buckets, vec![(5, s("s2"))]);
    let done = m
        .run(m.start(&plan).await.unwrap().id)
        .await
        .unwrap_or_else(|e| panic!("move: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done, "{done:?}");
    assert_eq!(epoch(&a), 3);

    stop.store(true, Ordering::SeqCst);
    for w in writers {
        assert!(
            w.await.unwrap() > 1,
            "every writer wrote through the split and the move"
        );
    }
    assert_eq!(
        epoch(&b),
        3,
        "the stale instance read the new map when a fence refused it"
    );
    assert_eq!(
        ranges_of(&m, &a).await,
        vec![
            (0, None, Some(40), s("s0")),
            (1, Some(40), Some(80), s("s1")),
            (4, Some(80), Some(100), s("s2")),
            (5, Some(100), Some(120), s("s4")),
            (3, Some(120), None, s("s3")),
        ]
    );
    // Every acknowledged row on its range's owner, once; the global index
    // finds every contact.
    check_placement(&a, &acked).await;
    let on = |shard: &'static str| {
        let a = a.clone();
        async move {
            let mut ids: Vec<i64> = customer::Entity::find()
                .all(a.connection(shard).unwrap())
                .await
                .unwrap()
                .into_iter()
                .map(|c| c.id)
                .collect();
            ids.sort_unstable();
            ids
        }
    };
    assert_eq!(on("s4").await, (100..120).collect::<Vec<_>>());
    assert_eq!(on("s2").await, (80..100).collect::<Vec<_>>());
    // Scatter reads see each row once; keyed reads of the moved range go
    // to s4.
    let all = a.find::<customer::Entity>().scatter().all().await.unwrap();
    assert_eq!(all.len(), 160);
    for k in [100, 119] {
        assert_eq!(
            b.find::<customer::Entity>()
                .key(k)
                .one()
                .await
                .unwrap()
                .map(|c| c.name)
                .as_ref(),
            acked.lock().unwrap().customers.get(&k),
        );
    }

    // The same through shardctl: split [-inf, 40) at 20, move [20, 40).
    let ctl = |args: &'static [&'static str]| shardctl_with(range_config(dbs, 20), args);
    let (code, split) = ctl(&["rebalance", "split", "Customer", "--at", "20"]).await;
    assert_eq!(code, 0, "{split:#}");
    assert_eq!(
        (
            split["retired"]["id"].as_u64(),
            split["left"]["to"].as_i64(),
            split["right"]["id"].as_u64()
        ),
        (Some(0), Some(20), Some(7)),
        "{split:#}"
    );
    let (code, bad) = ctl(&["rebalance", "split", "Customer", "--at", "twenty"]).await;
    assert_eq!(code, 1, "{bad:#}");
    assert!(
        bad["error"].as_str().unwrap().contains("not a shard key"),
        "{bad:#}"
    );
    let (code, done) = ctl(&[
        "rebalance",
        "start",
        "Customer",
        "--to",
        "s4",
        "--range-at",
        "30",
    ])
    .await;
    assert_eq!(code, 0, "{done:#}");
    assert_eq!(done["phase"], "done", "{done:#}");
    let (code, status) = ctl(&["rebalance", "status", "Customer"]).await;
    assert_eq!(code, 0, "{status:#}");
    let ranges: Vec<(u64, String)> = status["ranges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_u64().unwrap(),
                r["shard"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        ranges,
        [
            (6, "s0"),
            (7, "s4"),
            (1, "s1"),
            (4, "s2"),
            (5, "s4"),
            (3, "s3")
        ]
        .map(|(id, s)| (id, s.to_owned()))
        .to_vec(),
        "{status:#}"
    );
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
    assert_eq!(on("s4").await, (20..40).chain(100..120).collect::<Vec<_>>());
}

/// The splitting process dies after the map flipped and before the old
/// range was fenced on its shard: an instance that still routes by the old
/// range writes there, unfenced and unlogged, until the next move start
/// fences it; then its writes are refused and rerouted, and the move of the
/// half carries every one of them.
async fn a_split_that_dies_before_fencing_is_finished_by_the_next_move(dbs: &mut TestDbs) {
    let a = Cluster::connect(range_config(dbs, 20)).await.unwrap();
    // Before its map is read, a movable range group routes nothing (its
    // configured ranges' ids could pass a fence they should not).
    let early = a.shard_of_now::<Customer>(&5).unwrap_err();
    assert!(
        matches!(&early, ShardError::Unroutable { reason, .. } if reason.contains("control database")),
        "{early}"
    );
    let acked: Shared = Arc::default();
    seed(&a, &acked, 80..110).await;
    let b = Cluster::connect(range_config(dbs, 0)).await.unwrap();
    b.refresh_bucket_maps().await.unwrap();
    let m = mover(&a);
    {
        let _turn = FAILPOINTS.lock().await;
        fail::cfg(
            "shardkit::rebalance::split",
            &format!("return({})", dbs.names[2]),
        )
        .unwrap();
        let died = m.split_at(&100).await;
        fail::remove("shardkit::rebalance::split");
        let err = died.unwrap_err();
        assert!(err.to_string().contains("failpoint"), "{err}");
    }
    a.refresh_bucket_maps().await.unwrap();
    assert_eq!(epoch(&a), 2, "the map flipped before the process died");
    // `b` routes by range 2, which s2 still owns: its writes land.
    for k in 110..120 {
        insert_customer(&b, &acked, k).await;
    }
    assert_eq!(epoch(&b), 1, "nothing refused b yet");
    let stop = Arc::new(AtomicBool::new(false));
    let writer = writer(
        b.clone(),
        Arc::clone(&acked),
        (95..110).collect(),
        Arc::clone(&stop),
    );
    let plan = m.plan_range(&100, "s4").await.unwrap();
    assert_eq!(plan.buckets, vec![(5, "s2".to_owned())]);
    let done = m
        .run(m.start(&plan).await.unwrap().id)
        .await
        .unwrap_or_else(|e| panic!("move: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done);
    stop.store(true, Ordering::SeqCst);
    assert!(writer.await.unwrap() > 1);
    assert_eq!(epoch(&b), 3, "b was fenced off range 2 and read the map");
    check_placement(&a, &acked).await;
}

async fn the_mover_killed_in_each_phase_is_resumed_by_another_process(dbs: &mut TestDbs) {
    let (a, acked, stop, w) = seeded_with_writer(dbs, 80).await;
    let target_db = dbs.names[4].clone();
    let steps = [
        "registered",
        "copying",
        "copy_chunk",
        "catching_up",
        "verified",
        "cutting_over",
        "fenced",
        "cleaning",
    ];
    // Held to the end: another backend's run of a scenario may name the same database.
    let _turn = FAILPOINTS.lock().await;
    for (i, step) in steps.iter().enumerate() {
        // Two buckets per step, from the four sources in turn.
        let buckets = [i as u32 * 2, i as u32 * 2 + 1].map(|b| (b * 4 + i as u32) % BUCKETS);
        let name = format!("shardkit::rebalance::{step}");
        fail::cfg(&name, &format!("return({target_db})")).unwrap();
        let m = mover(&a);
        let plan = m.plan_buckets(buckets, "s4").await.unwrap();
        let id = m.start(&plan).await.unwrap().id;
        let err = m.run(id).await.unwrap_err();
        assert!(
            matches!(&err, ShardError::Rebalance { reason, .. } if reason.contains(step)),
            "{step}: {err}"
        );
        fail::remove(&name);
        let stopped = m.status(id).await.unwrap();
        assert!(
            stopped.error.as_deref().is_some_and(|e| e.contains(step)),
            "{stopped:?}"
        );
        if *step == "verified" || *step == "cleaning" {
            // Rows are on both shards now: a scatter read counts each once.
            let n = a
                .find::<customer::Entity>()
                .scatter()
                .all()
                .await
                .unwrap()
                .len();
            assert_eq!(n, acked.lock().unwrap().customers.len(), "{step}");
            // So does a count, and the orders' too.
            let counted = a
                .find::<customer::Entity>()
                .scatter()
                .count()
                .await
                .unwrap();
            assert_eq!(counted as usize, n, "{step}");
            // A count has no limit or order, mid-move as at any time.
            let limited = a
                .find::<customer::Entity>()
                .scatter()
                .order_by_desc(customer::Column::Id)
                .limit(3)
                .count()
                .await
                .unwrap();
            assert_eq!(limited as usize, n, "{step}");
            // Reads by key ask each key's owner only: their projections run.
            let keys: Vec<i64> = acked.lock().unwrap().customers.keys().copied().collect();
            let names: Vec<String> = a
                .find::<customer::Entity>()
                .keys(keys.clone())
                .select_only()
                .column(customer::Column::Name)
                .into_tuple::<String>()
                .all()
                .await
                .unwrap();
            assert_eq!(names.len(), keys.len(), "{step}");
            // Orders change under the writer (one transaction at a time,
            // acknowledged after it commits): one off at most, where a
            // count of both copies would be off by the moving buckets'.
            let orders = a.find::<order::Entity>().scatter().count().await.unwrap() as i64;
            let acked_orders = acked.lock().unwrap().orders.len() as i64;
            assert!(
                (orders - acked_orders).abs() <= 1,
                "{step}: {orders} orders counted, {acked_orders} acknowledged"
            );
            // A projection cannot tell the copies apart: refused, saying why.
            let projected = scatter_names(&a).await.unwrap_err();
            assert!(
                matches!(&projected, ShardError::Unmergeable { reason, .. } if reason.contains("move")),
                "{step}: {projected}"
            );
            // A limited page from a shard holding copies it does not own
            // still merges right: the newest ten are the newest ten.
            let top: Vec<i64> = a
                .find::<customer::Entity>()
                .scatter()
                .order_by_desc(customer::Column::Id)
                .limit(10)
                .all()
                .await
                .unwrap()
                .into_iter()
                .map(|c| c.id)
                .collect();
            let want: Vec<i64> = acked
                .lock()
                .unwrap()
                .customers
                .keys()
                .rev()
                .take(10)
                .copied()
                .collect();
            assert_eq!(top, want, "{step}");
        }
        // Another process resumes it.
        let other = connect(dbs, 20).await;
        let done = mover(&other)
            .run(id)
            .await
            .unwrap_or_else(|e| panic!("{step}: {}", e.report()));
        assert_eq!(done.phase, MovePhase::Done, "{step}");
        assert_eq!(done.error, None);
    }
    stop.store(true, Ordering::SeqCst);
    w.await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    assert_eq!(epoch(&a), 1 + steps.len() as u64);
    check_placement(&a, &acked).await;
}

async fn abort_in_each_phase_leaves_the_source_the_owner(dbs: &mut TestDbs) {
    let (a, acked, stop, w) = seeded_with_writer(dbs, 80).await;
    let target_db = dbs.names[4].clone();
    let buckets = quarter();
    // Held to the end: another backend's run of a scenario may name the same database.
    let _turn = FAILPOINTS.lock().await;
    for step in [
        "registered",
        "copying",
        "copy_chunk",
        "catching_up",
        "verified",
        "cutting_over",
        "fenced",
    ] {
        let name = format!("shardkit::rebalance::{step}");
        fail::cfg(&name, &format!("return({target_db})")).unwrap();
        let m = mover(&a);
        let plan = m.plan_buckets(buckets.clone(), "s4").await.unwrap();
        let id = m.start(&plan).await.unwrap().id;
        assert!(m.run(id).await.is_err(), "{step}");
        fail::remove(&name);
        // Another process aborts it.
        let other = connect(dbs, 20).await;
        let aborted = mover(&other)
            .abort(id)
            .await
            .unwrap_or_else(|e| panic!("{step}: {}", e.report()));
        assert_eq!(aborted.phase, MovePhase::Aborted, "{step}");
        assert_eq!(aborted.pending_changes, 0);
        let s4 = a.connection("s4").unwrap();
        assert!(
            customer::Entity::find().all(s4).await.unwrap().is_empty(),
            "{step}: s4 cleaned"
        );
        assert!(
            order::Entity::find().all(s4).await.unwrap().is_empty(),
            "{step}: s4 cleaned"
        );
        assert_eq!(epoch(&a), 1, "{step}: the map never flipped");
    }
    stop.store(true, Ordering::SeqCst);
    w.await.unwrap();
    check_placement(&a, &acked).await;
    // The buckets are free again: a move of them runs to the end.
    let m = mover(&a);
    let plan = m.plan_buckets(buckets, "s4").await.unwrap();
    let id = m.start(&plan).await.unwrap().id;
    assert_eq!(m.run(id).await.unwrap().phase, MovePhase::Done);
    let err = m.abort(id).await.unwrap_err();
    assert!(
        matches!(&err, ShardError::Rebalance { reason, .. } if reason.contains("done")),
        "{err}"
    );
    check_placement(&a, &acked).await;
}

/// A run whose token is cancelled before it starts leaves the move where it
/// is; one cancelled by another task after the first run of copied chunks
/// returns the move in `copying`, its position saved and the move let go;
/// the next run resumes it to the end.
async fn a_cancelled_run_stops_at_a_chunk_and_the_next_run_resumes(dbs: &mut TestDbs) {
    let a = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=120).await;
    let m = mover(&a);
    let plan = m.plan_buckets(quarter(), "s4").await.unwrap();
    let id = m.start(&plan).await.unwrap().id;

    let stop = CancellationToken::new();
    stop.cancel();
    let before = mover(&a)
        .control(JobControl::new().cancel_on(stop))
        .run(id)
        .await
        .unwrap();
    assert_eq!(before.phase, MovePhase::Registered, "{before:?}");

    // Its reports: the phase change to copying, then the first run of chunks.
    let (control, reports) = cancelled_by_another_task::<MoveProgress>(2);
    let stopped = mover(&a).control(control).run(id).await.unwrap();
    assert_eq!(reports.load(Ordering::SeqCst), 2, "{stopped:?}");
    assert_eq!(stopped.phase, MovePhase::Copying, "{stopped:?}");
    assert!(stopped.rows_copied > 0, "{stopped:?}");
    assert_eq!(epoch(&a), 1, "the map never flipped");

    // Let go: another process resumes it.
    let other = connect(dbs, 20).await;
    let done = mover(&other).run(id).await.unwrap();
    assert_eq!(done.phase, MovePhase::Done, "{done:?}");
    assert!(done.rows_copied >= stopped.rows_copied, "{done:?}");
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
}

/// A mover cleans a moved bucket's old rows only after the longest cleanup
/// grace of the processes that read the map: an application instance
/// configured with a longer grace than the mover's (10 minutes against 0
/// here) may route reads by a map that old, so the old copies stay. The
/// recorded grace only grows; lowered by hand, cleaning goes on.
async fn a_mover_cleans_after_the_longest_grace_of_the_instances(dbs: &mut TestDbs) {
    let a = connect(dbs, 0).await;
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=20).await;
    let toml = toml_with(
        dbs,
        &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
        0,
    )
    .replace("cleanup_grace_ms = 0", "cleanup_grace_ms = 600000");
    let patient = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    patient.refresh_bucket_maps().await.unwrap();
    grace_recorded(&a, 600_000).await;
    let source = a.shard_of_now::<Customer>(&1).unwrap().unwrap().to_owned();
    let on_source = || async {
        customer::Entity::find_by_id(1)
            .one(a.connection(&source).unwrap())
            .await
            .unwrap()
            .is_some()
    };
    let m = mover(&a);
    let id = m
        .start(&m.plan_buckets([bucket(1)], "s4").await.unwrap())
        .await
        .unwrap()
        .id;
    let status = m.run(id).await.unwrap();
    assert_eq!(status.phase, MovePhase::Cleaning, "{status:?}");
    assert!(on_source().await, "cleaned before the instance's grace");
    a.connection("s0")
        .unwrap()
        .execute_unprepared("UPDATE shardkit_bucket_epochs SET grace_ms = NULL")
        .await
        .unwrap();
    let status = mover(&a).run(id).await.unwrap();
    assert_eq!(status.phase, MovePhase::Done, "{status:?}");
    assert!(!on_source().await, "not cleaned");
    drop(patient);
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
}

async fn overlapping_moves_are_refused_and_plans_are_minimal(dbs: &mut TestDbs) {
    let a = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=40).await;
    let m = mover(&a);
    // 64 buckets over 5 shards: s4 gets 12, three from each.
    let even = m.plan_even_out("s4").await.unwrap();
    assert_eq!(even.buckets.len(), 12, "{even:?}");
    let mut from: BTreeMap<String, usize> = BTreeMap::new();
    for (_, s) in &even.buckets {
        *from.entry(s.clone()).or_default() += 1;
    }
    assert_eq!(from.values().copied().collect::<Vec<_>>(), vec![3, 3, 3, 3]);

    let first = m
        .start(&m.plan_buckets([1, 2], "s4").await.unwrap())
        .await
        .unwrap();
    let err = m
        .start(&m.plan_buckets([2, 3], "s4").await.unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ShardError::Rebalance { reason, .. } if reason.contains(&format!("move #{}", first.id))),
        "{err}"
    );
    // The refused move held nothing: bucket 3 moves on its own.
    let third = m
        .start(&m.plan_buckets([3], "s4").await.unwrap())
        .await
        .unwrap();
    assert_eq!(m.list(false).await.unwrap().len(), 2);
    // While another process holds a move (its hold not lapsed), `run` and
    // `abort` are refused; once it lapses, the move can be taken over.
    let control = a.connection("s0").unwrap();
    let hold = |lease: i64| {
        sea_orm::Statement::from_string(
            control.get_database_backend(),
            format!(
                "UPDATE shardkit_moves SET runner = 'another-process', lease_ms = {lease} WHERE id = {}",
                first.id
            ),
        )
    };
    let far = 4_102_444_800_000i64; // 2100-01-01
    control.execute_raw(hold(far)).await.unwrap();
    for err in [
        m.run(first.id).await.unwrap_err(),
        m.abort(first.id).await.unwrap_err(),
    ] {
        assert!(
            matches!(&err, ShardError::Rebalance { reason, .. } if reason.contains("another process is running the move")),
            "{err}"
        );
    }
    control.execute_raw(hold(1)).await.unwrap();
    assert_eq!(m.run(first.id).await.unwrap().phase, MovePhase::Done);
    assert_eq!(m.run(third.id).await.unwrap().phase, MovePhase::Done);
    // A resumed move must carry the same tables in the same order.
    let other = m
        .start(&m.plan_buckets([6], "s4").await.unwrap())
        .await
        .unwrap();
    let err = a
        .rebalance::<Customer>()
        .unwrap()
        .entity::<order::Entity>()
        .entity::<customer::Entity>()
        .entity::<contact::Entity>()
        .run(other.id)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("same entities in the same order"),
        "{err}"
    );
    assert_eq!(m.abort(other.id).await.unwrap().phase, MovePhase::Aborted);
    // A bucket moves back to the shard it left: the old owner's fence lets
    // its writes in again.
    let (back_from, key) = (1u32, (1..=40).find(|k| bucket(*k) == 1).unwrap());
    let Some(shardkit::topology::LiveMap::Buckets(owners)) =
        a.topology().live_owners("Customer").unwrap()
    else {
        panic!("a hash group's map");
    };
    let original = owners.configured()[back_from as usize];
    let home = a.topology().shard(original).name.clone();
    let back = m
        .start(&m.plan_buckets([back_from], &home).await.unwrap())
        .await
        .unwrap();
    assert_eq!(m.run(back.id).await.unwrap().phase, MovePhase::Done);
    assert_eq!(
        a.shard_of_now::<Customer>(&key).unwrap(),
        Some(home.as_str())
    );
    write_round(&a, &acked, key, 1).await.unwrap();
    // Bad plans name what is wrong.
    let err = m.plan_buckets([BUCKETS], "s4").await.unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
    let err = m.plan_buckets([1], "s9").await.unwrap_err();
    assert!(err.to_string().contains("no shard is named `s9`"), "{err}");
    let err = m.plan_buckets([2], "s4").await.unwrap_err();
    assert!(err.to_string().contains("already on `s4`"), "{err}");
    let none = a.rebalance::<Customer>().unwrap();
    let err = none
        .start(&m.plan_buckets([5], "s4").await.unwrap())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no entity listed"), "{err}");
    // A group that is not movable is refused before any I/O.
    let err = a.rebalance::<Tenant>().unwrap_err();
    assert!(
        matches!(&err, ShardError::Rebalance { reason, .. } if reason.contains("movable")),
        "{err}"
    );
    check_placement(&a, &acked).await;
    let n: u64 = {
        let db = a.connection("s0").unwrap();
        let row = db
            .query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT COUNT(*) AS n FROM shardkit_move_buckets".to_owned(),
            ))
            .await
            .unwrap()
            .unwrap();
        row.try_get::<i64>("", "n").unwrap() as u64
    };
    assert_eq!(n, 0, "finished moves release their buckets");
}

/// `shardctl --json <args>` over `dbs`' cluster with the group's entities.
async fn shardctl(dbs: &TestDbs, args: &[&str]) -> (u8, serde_json::Value) {
    shardctl_with(config(dbs, 20), args).await
}

async fn shardctl_with(config: ClusterConfig, args: &[&str]) -> (u8, serde_json::Value) {
    let registry = shardkit::cli::Registry::new()
        .migrator::<Migrator>()
        .entity::<customer::Entity>()
        .entity::<order::Entity>()
        .entity::<contact::Entity>();
    let mut out: Vec<u8> = Vec::new();
    let argv = ["shardctl", "--json"].iter().chain(args).copied();
    let code = shardkit::cli::run_with(argv, config, registry, &mut out).await;
    let text = String::from_utf8(out).unwrap();
    let value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("shardctl {args:?}: not JSON ({e}): {text}"));
    (code, value)
}

async fn shardctl_plans_starts_resumes_and_aborts_moves(dbs: &mut TestDbs) {
    let a = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=60).await;

    let (code, plan) = shardctl(dbs, &["rebalance", "plan", "Customer", "--to", "s4"]).await;
    assert_eq!(code, 0, "{plan:#}");
    assert_eq!(plan["buckets"].as_array().unwrap().len(), 12, "{plan:#}");

    let (code, done) = shardctl(
        dbs,
        &[
            "rebalance",
            "start",
            "Customer",
            "--to",
            "s4",
            "--buckets",
            "0,4",
        ],
    )
    .await;
    assert_eq!(code, 0, "{done:#}");
    assert_eq!(done["phase"], "done");

    let _turn = FAILPOINTS.lock().await;
    let name = "shardkit::rebalance::copying";
    fail::cfg(name, &format!("return({})", dbs.names[4])).unwrap();
    let (code, failed) = shardctl(
        dbs,
        &[
            "rebalance",
            "start",
            "Customer",
            "--to",
            "s4",
            "--buckets",
            "8,12",
        ],
    )
    .await;
    assert_eq!(code, 1, "{failed:#}");
    assert!(
        failed["error"].as_str().unwrap().contains("copying"),
        "{failed:#}"
    );
    let (code, status) = shardctl(dbs, &["rebalance", "status", "Customer"]).await;
    assert_eq!(
        code, 1,
        "a move that stopped on an error is a problem: {status:#}"
    );
    let moves = status["moves"].as_array().unwrap();
    assert_eq!(moves.len(), 1, "{status:#}");
    assert_eq!(moves[0]["phase"], "copying");
    let id = moves[0]["id"].as_i64().unwrap();
    let (code, whole) = shardctl(dbs, &["status"]).await;
    assert_eq!(whole["moves"][0]["id"], id, "{whole:#}");
    assert_eq!(code, 1);
    fail::remove(name);
    let (code, resumed) =
        shardctl(dbs, &["rebalance", "resume", "Customer", &id.to_string()]).await;
    assert_eq!(code, 0, "{resumed:#}");
    assert_eq!(resumed["phase"], "done");

    fail::cfg(name, &format!("return({})", dbs.names[4])).unwrap();
    let (code, _) = shardctl(
        dbs,
        &[
            "rebalance",
            "start",
            "Customer",
            "--to",
            "s4",
            "--buckets",
            "16",
        ],
    )
    .await;
    fail::remove(name);
    assert_eq!(code, 1);
    let (_, status) = shardctl(dbs, &["rebalance", "status", "Customer"]).await;
    let id = status["moves"][0]["id"].as_i64().unwrap();
    let (code, aborted) = shardctl(dbs, &["rebalance", "abort", "Customer", &id.to_string()]).await;
    assert_eq!(code, 0, "{aborted:#}");
    assert_eq!(aborted["phase"], "aborted");

    let (code, status) = shardctl(dbs, &["status"]).await;
    assert_eq!(code, 0, "{status:#}");
    assert!(status["moves"].as_array().unwrap().is_empty());
    let customer_group = status["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == "Customer")
        .unwrap();
    assert_eq!(customer_group["epoch"], 3, "{customer_group:#}");
    assert_eq!(customer_group["buckets"]["s4"], 4);
    let (code, all) = shardctl(dbs, &["rebalance", "status", "Customer", "--all"]).await;
    assert_eq!((code, all["moves"].as_array().unwrap().len()), (0, 3));
    let (code, err) = shardctl(dbs, &["rebalance", "plan", "Tenant", "--to", "s4"]).await;
    assert_eq!(code, 1);
    assert!(
        err["error"].as_str().unwrap().contains("no placement"),
        "{err:#}"
    );
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
}

/// The config with s4 reached through `port` (a proxy), a 1 s step timeout.
fn config_through(dbs: &TestDbs, port: u16) -> ClusterConfig {
    let url = match dbs.backend {
        Backend::MySql => format!("mysql://root@127.0.0.1:{port}/{}", dbs.names[4]),
        _ => format!("postgres://postgres@127.0.0.1:{port}/{}", dbs.names[4]),
    };
    let toml = format!(
        "{}\n[[shards]]\nname = \"s4\"\nurl = \"{url}\"\n\n[groups.Customer]\nbuckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true\n\n[rebalance]\nrefresh_ms = 20\ncleanup_grace_ms = 0\nchunk = 40\nstep_timeout_ms = 1000\n",
        dbs.shards_toml_with(
            4,
            "connect_timeout_secs = 1\nacquire_timeout_secs = 2\n",
            &[]
        )
        .replace("max_connections = 4", "max_connections = 2"),
    );
    ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("config: {e}\n{toml}"))
}

async fn a_target_that_refuses_or_hangs_stops_the_mover_and_leaks_nothing(dbs: &mut TestDbs) {
    let a = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=80).await;
    let before = dbs.server_connections().await;
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(
        a.clone(),
        Arc::clone(&acked),
        (1..=80).collect(),
        Arc::clone(&stop),
    );
    let server = dbs.backend.server_address().unwrap();
    // The target refuses, or stops answering, once the copy has begun;
    // or stops answering after the first replay round of catching up, so
    // that the compare's reads wait on it.
    let cases = [
        (false, MovePhase::Copying, 1),
        (true, MovePhase::Copying, 1),
        (true, MovePhase::CatchingUp, 2),
    ];
    for (i, (hang, at, nth)) in cases.into_iter().enumerate() {
        let proxy = Arc::new(Proxy::start(server.clone()).await);
        let b = Cluster::connect(config_through(dbs, proxy.port))
            .await
            .unwrap();
        let cut = Arc::clone(&proxy);
        let seen = std::sync::atomic::AtomicUsize::new(0);
        let m = mover(&b).control(JobControl::new().on_progress(move |p: &MoveProgress| {
            if p.phase == at && seen.fetch_add(1, Ordering::SeqCst) + 1 == nth {
                if hang {
                    cut.freeze();
                } else {
                    cut.kill();
                }
            }
        }));
        let buckets = [i as u32 * 4 + 1, i as u32 * 4 + 2];
        let id = m
            .start(&m.plan_buckets(buckets, "s4").await.unwrap())
            .await
            .unwrap()
            .id;
        let t = std::time::Instant::now();
        let err = m.run(id).await.unwrap_err();
        let took = t.elapsed();
        if hang {
            assert!(
                matches!(err, ShardError::Timeout { ref shard, .. } if shard == "s4"),
                "{err}"
            );
        } else {
            // Refused at once, or (a cut connection being made again) after
            // the step timeout: either way, naming the target.
            assert!(
                matches!(err, ShardError::Db { ref shard, .. } | ShardError::Timeout { ref shard, .. } if shard == "s4"),
                "{err}"
            );
        }
        assert!(
            took < std::time::Duration::from_secs(20),
            "the mover gave up after {took:?}"
        );
        // Writes went on all along; the move resumes from another process
        // that reaches the target.
        drop(m);
        drop(b);
        let done = mover(&a)
            .run(id)
            .await
            .unwrap_or_else(|e| panic!("resume: {}", e.report()));
        assert_eq!(done.phase, MovePhase::Done);
        drop(proxy);
    }
    stop.store(true, Ordering::SeqCst);
    w.await.unwrap();
    check_placement(&a, &acked).await;
    drop(a);
    // Every connection the clusters opened is closed.
    let mut after = dbs.server_connections().await;
    for _ in 0..50 {
        if after <= before {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        after = dbs.server_connections().await;
    }
    assert!(
        after <= before,
        "server connections: {before} before, {after} after"
    );
}

/// Waits (at most 60 s, polling) until `done` says so; `what` names the wait.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..6_000 {
        if done() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("gave up waiting: {what}");
}

/// Waits until the writer acknowledged a new write of one of `keys`.
async fn written_again(acked: &Shared, keys: &[i64], what: &str) {
    let before: Vec<Option<String>> = {
        let a = acked.lock().unwrap();
        keys.iter().map(|k| a.customers.get(k).cloned()).collect()
    };
    until(what, || {
        let a = acked.lock().unwrap();
        keys.iter()
            .zip(&before)
            .any(|(k, b)| a.customers.get(k) != b.as_ref())
    })
    .await;
}

/// A mover paused (a GC pause, a VM stall, a stopped process) before each
/// kind of write it makes, past its hold: another process, whose clock is
/// ahead, takes the move over and finishes it while a writer goes on
/// writing the moving keys on their new owner. When the first mover goes on,
/// the shard it writes refuses it: no acknowledged row goes back to an
/// older version, no deleted row comes back, and no row is left on a shard
/// that does not own its bucket.
async fn a_mover_paused_past_its_hold_is_refused_where_it_writes(dbs: &mut TestDbs) {
    let (a, acked, stop, w) = seeded_with_writer(dbs, 80).await;
    let b = ahead_instance(dbs).await;
    let target_db = dbs.names[4].clone();
    let _turn = FAILPOINTS.lock().await;
    let parked = count_parks();
    let mut used = std::collections::BTreeSet::new();
    for what in ["copy", "replay", "log", "states", "clean"] {
        // Two buckets that hold written keys and have not moved yet.
        let mut keys: Vec<i64> = Vec::new();
        let mut buckets: Vec<u32> = Vec::new();
        for k in 1..=80i64 {
            let b = bucket(k);
            if buckets.contains(&b) {
                keys.push(k);
            } else if buckets.len() < 2 && used.insert(b) {
                buckets.push(b);
                keys.push(k);
            }
        }
        let m = mover(&a);
        let id = m
            .start(&m.plan_buckets(buckets.clone(), "s4").await.unwrap())
            .await
            .unwrap()
            .id;
        // Parked at its first copy write first, so the writer's writes of
        // the moving keys are logged before the mover goes on to `what`.
        let at_copy = "shardkit::rebalance::park::copy";
        let at = format!("shardkit::rebalance::park::{what}");
        let seen = parked.load(Ordering::SeqCst);
        // Only the first mover (generation 1) parks.
        fail::cfg(at_copy, &format!("return({target_db}@1)")).unwrap();
        let first = tokio::spawn(async move { m.run(id).await });
        until(&format!("{what}: parked at copy"), || {
            parked.load(Ordering::SeqCst) > seen
        })
        .await;
        written_again(&acked, &keys, &format!("{what}: a logged write")).await;
        if what != "copy" {
            let seen = parked.load(Ordering::SeqCst);
            fail::cfg(&at, &format!("return({target_db}@1)")).unwrap();
            fail::remove(at_copy);
            until(&format!("{what}: parked"), || {
                parked.load(Ordering::SeqCst) > seen
            })
            .await;
        }
        // The other process takes the move over and finishes it.
        let done = mover(&b)
            .run(id)
            .await
            .unwrap_or_else(|e| panic!("{what}: {}", e.report()));
        assert_eq!(done.phase, MovePhase::Done, "{what}");
        assert!(done.generation >= 2, "{what}: {done:?}");
        // The writer writes the moved keys on their new owner.
        written_again(&acked, &keys, &format!("{what}: a write after the move")).await;
        // The first mover goes on: the shard it writes refuses it.
        fail::remove(&at);
        fail::remove(at_copy);
        let err = first.await.unwrap().unwrap_err();
        assert!(
            matches!(&err, ShardError::Rebalance { id: Some(i), reason, .. }
                if *i == id && reason.contains("took the move over")),
            "{what}: {}",
            err.report()
        );
        // Its error is not recorded over the finished move.
        let after = mover(&a).status(id).await.unwrap();
        assert_eq!(
            (after.phase, after.error),
            (MovePhase::Done, None),
            "{what}"
        );
    }
    fail::remove("shardkit::rebalance::parked");
    stop.store(true, Ordering::SeqCst);
    w.await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
}

/// Carts and their items as acknowledged: cart id → (customer, label), item
/// id → (customer, cart).
#[derive(Default)]
struct AckedCarts {
    carts: BTreeMap<i64, (i64, String)>,
    items: BTreeMap<i64, (i64, i64)>,
}

/// Writes to `keys` without a pause until `stop`: one transaction in ten
/// adds a cart with two items (a parent and its children, joined by a
/// foreign key), the others rename the cart's customer. Every write must
/// succeed.
fn cart_writer(
    cluster: Cluster,
    acked: Arc<Mutex<AckedCarts>>,
    writer: i64,
    keys: Vec<i64>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut n = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let key = keys[n as usize % keys.len()];
            let id = writer * 1_000_000 + n as i64;
            let label = format!("l{id}");
            let result = if n.is_multiple_of(10) {
                cluster
                    .transaction::<Customer, _, _>(key, |tx| {
                        let label = label.clone();
                        async move {
                            tx.insert(cart::ActiveModel {
                                id: Set(id),
                                customer_id: Set(key),
                                label: Set(label),
                            })
                            .await?;
                            for item in [id * 2, id * 2 + 1] {
                                tx.insert(cart_item::ActiveModel {
                                    id: Set(item),
                                    customer_id: Set(key),
                                    cart_id: Set(id),
                                    sku: Set(format!("sku{item}")),
                                    quantity: Set(1),
                                })
                                .await?;
                            }
                            Ok(())
                        }
                    })
                    .await
            } else {
                cluster
                    .transaction::<Customer, _, _>(key, |tx| {
                        let label = label.clone();
                        async move {
                            tx.update(customer::ActiveModel {
                                id: sea_orm::ActiveValue::Unchanged(key),
                                name: Set(label),
                            })
                            .await
                            .map(drop)
                        }
                    })
                    .await
            };
            if let Err(e) = result {
                panic!(
                    "writer {writer}, write {n} of customer {key}: {}",
                    e.report()
                );
            }
            if n.is_multiple_of(10) {
                let mut a = acked.lock().unwrap();
                a.carts.insert(id, (key, format!("l{id}")));
                a.items.insert(id * 2, (key, id));
                a.items.insert(id * 2 + 1, (key, id));
            }
            n += 1;
            tokio::task::yield_now().await;
        }
        n
    })
}

/// A quarter of the buckets move while eight unthrottled writers (pools of
/// 2) add carts with items, a parent and its children joined by a foreign
/// key, to the moving keys: the copy finishes (the rows whose parent came
/// after the parents' table was copied are left to the replay), the cut-over
/// finishes under the load (within 120 s), and every acknowledged cart and
/// item is on its owner once.
async fn a_copy_converges_while_writers_add_parents_and_children(dbs: &mut TestDbs) {
    let a = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=40).await;
    let carts: Arc<Mutex<AckedCarts>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..8i64)
        .map(|w| {
            let keys: Vec<i64> = (1..=40).filter(|k| k % 8 == w).collect();
            cart_writer(
                a.clone(),
                Arc::clone(&carts),
                w + 1,
                keys,
                Arc::clone(&stop),
            )
        })
        .collect();
    // Some carts exist before the move starts.
    until("carts before the move", || {
        carts.lock().unwrap().carts.len() >= 40
    })
    .await;
    let m = mover(&a)
        .entity::<cart::Entity>()
        .entity::<cart_item::Entity>();
    let plan = m.plan_buckets(quarter(), "s4").await.unwrap();
    let id = m.start(&plan).await.unwrap().id;
    let started = std::time::Instant::now();
    let done = m
        .run(id)
        .await
        .unwrap_or_else(|e| panic!("the move: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done);
    // The cut-over finishes under the load (it took 1–5 s here; a cut-over
    // that waited for the log to empty never did).
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(120),
        "the move took {took:?}"
    );
    stop.store(true, Ordering::SeqCst);
    let mut written = 0;
    for w in writers {
        written += w.await.unwrap();
    }
    assert!(written > 0);
    a.refresh_bucket_maps().await.unwrap();
    let owner = owners(&a);
    let mut found_carts = placed::<cart::Entity, _>(&a, |c| (c.id, (c.customer_id, c.label))).await;
    let mut found_items =
        placed::<cart_item::Entity, _>(&a, |i| (i.id, (i.customer_id, i.cart_id))).await;
    let acked_carts = carts.lock().unwrap();
    let moved = acked_carts
        .carts
        .values()
        .filter(|(k, _)| quarter().contains(&bucket(*k)))
        .count();
    assert!(moved > 0, "no cart of a moving bucket");
    for (id, (key, label)) in &acked_carts.carts {
        assert_eq!(
            found_carts.remove(id).unwrap_or_default(),
            vec![(owner(*key), (*key, label.clone()))],
            "cart {id} of customer {key}"
        );
    }
    assert!(
        found_carts.is_empty(),
        "carts never acknowledged: {found_carts:?}"
    );
    for (id, (key, cart)) in &acked_carts.items {
        assert_eq!(
            found_items.remove(id).unwrap_or_default(),
            vec![(owner(*key), (*key, *cart))],
            "item {id} of customer {key}"
        );
    }
    assert!(
        found_items.is_empty(),
        "items never acknowledged: {found_items:?}"
    );
}

/// A mover that dies with its source fenced (parked for good before it
/// hands the bucket to the target, renewing nothing, as a killed process
/// would) holds the bucket's writes back until its hold lapses (10 s after
/// its last renewal); another process that keeps trying takes the move over
/// then and finishes it. The writers of the bucket wait meanwhile (at most
/// 15 s a write) instead of failing.
async fn a_mover_dead_after_fencing_is_taken_over_once_its_hold_lapses(dbs: &mut TestDbs) {
    let (a, acked, stop, w) = seeded_with_writer(dbs, 40).await;
    let target_db = dbs.names[4].clone();
    let _turn = FAILPOINTS.lock().await;
    let parked = count_parks();
    // One bucket, from one source: its state changes are the source's
    // `moving`, the source's fence, then the target's `owned`.
    let m = mover(&a);
    let plan = m.plan_buckets([bucket(1)], "s4").await.unwrap();
    let source = plan.buckets[0].1.clone();
    let id = m.start(&plan).await.unwrap().id;
    let at = "shardkit::rebalance::park::states";
    fail::cfg(at, &format!("return({target_db}@1#3)")).unwrap();
    let first = tokio::spawn(async move { m.run(id).await });
    until("parked with the source fenced", || {
        parked.load(Ordering::SeqCst) > 0
    })
    .await;
    let state = |shard: String| {
        let a = a.clone();
        async move {
            let db = a.connection(&shard).unwrap();
            let sql = format!(
                "SELECT state FROM shardkit_bucket_states WHERE grp = 'Customer' AND bucket = {}",
                bucket(1)
            );
            let row = db
                .query_one_raw(sea_orm::Statement::from_string(
                    db.get_database_backend(),
                    sql,
                ))
                .await
                .unwrap()
                .unwrap();
            row.try_get::<String>("", "state").unwrap()
        }
    };
    assert_eq!(
        (state(source).await, state("s4".to_owned()).await),
        ("moved".to_owned(), "none".to_owned()),
        "parked after the source's fence, before the target owns the bucket"
    );
    let died = std::time::Instant::now();
    // Another process tries until the dead mover's hold lapses.
    let b = connect(dbs, 20).await;
    let done = loop {
        match mover(&b).run(id).await {
            Ok(done) => break done,
            Err(ShardError::Rebalance { reason, .. })
                if reason.contains("another process is running the move") =>
            {
                assert!(
                    died.elapsed() < std::time::Duration::from_secs(60),
                    "the hold never lapsed"
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => panic!("take-over: {}", e.report()),
        }
    };
    assert_eq!(done.phase, MovePhase::Done);
    assert_eq!(done.generation, 2);
    let took = died.elapsed();
    assert!(
        took >= std::time::Duration::from_secs(5),
        "taken over after {took:?}, before the hold could lapse"
    );
    // The bucket's writes waited and went on on the new owner.
    written_again(&acked, &[1], "a write of the moved bucket").await;
    stop.store(true, Ordering::SeqCst);
    w.await.unwrap();
    fail::remove(at);
    fail::remove("shardkit::rebalance::parked");
    let err = first.await.unwrap().unwrap_err();
    assert!(
        matches!(&err, ShardError::Rebalance { reason, .. } if reason.contains("took the move over")),
        "{}",
        err.report()
    );
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
}

/// A fifth shard, empty and not migrated, added to the config of a running
/// movable group: instances connect (the new shard holds no bucket), writes
/// go on, `migrate` prepares it (tables and bucket states), and a move hands
/// it buckets.
async fn a_shard_added_to_the_config_connects_unmigrated_and_takes_buckets_after_migrate(
    dbs: &mut TestDbs,
) {
    let four = ClusterConfig::from_toml(&format!(
        "{}\n[groups.Customer]\nbuckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true\n\n[rebalance]\ncleanup_grace_ms = 0\n",
        dbs.shards_toml(4)
    ))
    .unwrap();
    let old = Cluster::connect(four).await.unwrap();
    let acked: Shared = Arc::default();
    seed(&old, &acked, 1..=20).await;
    // s4 joins the config, its database empty.
    let grown = Cluster::connect(config(dbs, 20))
        .await
        .unwrap_or_else(|e| panic!("connect with an unmigrated shard: {}", e.report()));
    grown.refresh_bucket_maps().await.unwrap();
    for k in 1..=20 {
        write_round(&grown, &acked, k, 1).await.unwrap();
    }
    // A move to it before it is migrated is refused, naming what to do.
    let m = mover(&grown);
    let plan = m.plan_buckets([bucket(1)], "s4").await.unwrap();
    let early = m.start(&plan).await.unwrap();
    let err = m.run(early.id).await.unwrap_err();
    assert!(
        matches!(&err, ShardError::Rebalance { reason, .. }
            if reason.contains("shard `s4` is not migrated") && reason.contains("run `migrate`")),
        "{}",
        err.report()
    );
    let report = grown.migrate::<Migrator>().await.unwrap();
    assert!(report.is_current(), "{report:?}");
    let id = early.id;
    let done = m.run(id).await.unwrap_or_else(|e| panic!("{}", e.report()));
    assert_eq!(done.phase, MovePhase::Done);
    assert_eq!(grown.shard_of_now::<Customer>(&1).unwrap(), Some("s4"));
    for k in 1..=20 {
        write_round(&grown, &acked, k, 2).await.unwrap();
    }
    check_placement(&grown, &acked).await;
}

/// `migrate` on a fresh movable group whose ticket server is down fails,
/// naming the server, and leaves the group writable (its map and every
/// shard's bucket states prepared): a half-done set-up refused every write
/// of the group as moved.
async fn a_migrate_that_fails_on_a_ticket_server_leaves_the_movable_group_writable(
    dbs: &mut TestDbs,
) {
    let toml = format!(
        "{}\n[ids]\nservers = [{{ name = \"tickets_down\", url = \"postgres://postgres@127.0.0.1:9/down\" }}]\n",
        toml_with(
            dbs,
            &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
            20
        )
    );
    // The down server is given up on after 2 s, not the default 30.
    let toml = toml.replace(
        "max_connections = 2",
        "max_connections = 2\nconnect_timeout_secs = 2\nacquire_timeout_secs = 2",
    );
    let config = ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let cluster = Cluster::connect(config).await.unwrap();
    let err = cluster.migrate::<Migrator>().await.unwrap_err();
    assert!(
        err.report().to_string().contains("tickets_down"),
        "{}",
        err.report()
    );
    cluster.setup::<contact::Entity>().await.unwrap();
    let acked: Shared = Arc::default();
    for k in 1..=20 {
        insert_customer(&cluster, &acked, k).await;
    }
    for k in 1..=20 {
        write_round(&cluster, &acked, k, 1)
            .await
            .unwrap_or_else(|e| panic!("customer {k}: {}", e.report()));
    }
    cluster.refresh_bucket_maps().await.unwrap();
    check_placement(&cluster, &acked).await;
}

/// A stale map's background read whose task was dropped before it ran (the
/// runtime that the read spawned it on had shut down) is tried again by the
/// next stale read: it used to stay claimed, and the map was not read again
/// in the background until it expired. SQLite only: the read is polled once
/// on a runtime that has shut down, and a server's connection opened there
/// would be left dead.
async fn a_background_map_read_dropped_unrun_is_tried_again(dbs: &mut TestDbs) {
    let toml = toml_with(
        dbs,
        &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
        0,
    )
    .replace("cleanup_grace_ms = 0", "cleanup_grace_ms = 600000");
    let clock = Arc::new(shardkit::clock::ManualClock::starting_now());
    let cluster = connect_on(ClusterConfig::from_toml(&toml).unwrap(), clock.clone()).await;
    let acked: Shared = Arc::default();
    seed(&cluster, &acked, 1..=2).await;
    let before = map_read_at(&cluster);
    // Past half the grace: a read goes on by the map and reads it in the
    // background.
    clock.advance(std::time::Duration::from_secs(301));
    let ended = cluster.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let handle = runtime.handle().clone();
        drop(runtime);
        let _entered = handle.enter();
        // One poll: the read spawns the map's read, which the runtime drops
        // there and then; what the read does next on a runtime without a
        // timer may panic, and the read is dropped after that poll anyway.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            futures::FutureExt::now_or_never(name_of_first(&ended))
        }));
    })
    .join()
    .unwrap();
    assert_eq!(
        map_read_at(&cluster),
        before,
        "the map was read on the ended runtime"
    );
    // A second later (background reads are a second apart at least), the
    // next stale read reads the map in the background.
    clock.advance(std::time::Duration::from_secs(2));
    assert_eq!(name_of_first(&cluster).await, Some(first_name(1)));
    map_read_again(
        &cluster,
        before,
        "the stale map was not read again in the background",
    )
    .await;
}

/// When `cluster` last read its Customer map (its clock's ms).
fn map_read_at(cluster: &Cluster) -> i64 {
    cluster
        .topology()
        .live_owners("Customer")
        .unwrap()
        .unwrap()
        .read_at_ms()
}

/// Waits (at most 10 s) until `cluster` has read its Customer map since
/// `before`; fails with `otherwise`.
async fn map_read_again(cluster: &Cluster, before: i64, otherwise: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while map_read_at(cluster) == before {
        assert!(std::time::Instant::now() < deadline, "{otherwise}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// After a move's flip, an instance that has not read the map since reads a
/// moved key from the old owner: the row as it was at the flip, never
/// missing while the old copies wait out `cleanup_grace_ms`. A read inside a
/// transaction is the owner's (the transaction checks the bucket's fence on
/// its shard and is rerouted), and the instance's reads follow from then on.
async fn an_instance_that_has_not_refreshed_reads_a_moved_row_as_at_the_flip(dbs: &mut TestDbs) {
    let toml = toml_with(
        dbs,
        &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
        0,
    )
    .replace("cleanup_grace_ms = 0", "cleanup_grace_ms = 600000");
    let config = ClusterConfig::from_toml(&toml).unwrap();
    let a = Cluster::connect(config.clone()).await.unwrap();
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=20).await;
    let stale_clock = Arc::new(shardkit::clock::ManualClock::starting_now());
    let stale = connect_on(config.clone(), stale_clock.clone()).await;
    stale.refresh_bucket_maps().await.unwrap();
    // A third instance, as stale, that only reads with a session.
    let other = Cluster::connect(config).await.unwrap();
    other.refresh_bucket_maps().await.unwrap();
    // On servers, a fourth, as stale, that reaches the control shard (s0)
    // through a proxy, with a read timeout of 500 ms (and a connect timeout
    // of 3 s, which also bounds the wait for a pooled connection).
    let control = match dbs.backend.server_address() {
        Some(server) => {
            let proxy = Proxy::start(server).await;
            let shards = dbs
                .shards_toml_through(5, "connect_timeout_secs = 3\n", &[(0, proxy.port)])
                .replace("max_connections = 4", "max_connections = 2");
            let toml = format!(
                "{shards}\n[groups.Customer]\nbuckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true\n\n[rebalance]\nrefresh_ms = 0\ncleanup_grace_ms = 600000\nchunk = 40\n\n[read]\ntimeout_ms = 500\n"
            );
            let clock = Arc::new(shardkit::clock::ManualClock::starting_now());
            let through = connect_on(ClusterConfig::from_toml(&toml).unwrap(), clock.clone()).await;
            through.refresh_bucket_maps().await.unwrap();
            Some((proxy, through, clock))
        }
        None => None,
    };
    let read = name_of_first;
    assert_eq!(read(&stale).await, Some(first_name(1)));
    let m = mover(&a);
    let id = m
        .start(&m.plan_buckets([bucket(1)], "s4").await.unwrap())
        .await
        .unwrap()
        .id;
    // The old copies wait out the grace period.
    assert_eq!(m.run(id).await.unwrap().phase, MovePhase::Cleaning);
    a.refresh_bucket_maps().await.unwrap();
    write_round(&a, &acked, 1, 1).await.unwrap();
    // The stale instance reads the row as it was at the flip.
    assert_eq!(read(&stale).await, Some(first_name(1)));
    // A transaction reads the owner's row.
    let inside = stale
        .transaction::<Customer, _, _>(
            1,
            |tx| async move { tx.find::<customer::Entity>().one().await },
        )
        .await
        .unwrap()
        .map(|m| m.name);
    assert_eq!(inside.as_deref(), Some("c1-r1"));
    // The rerouted transaction refreshed the map: reads follow.
    assert_eq!(read(&stale).await.as_deref(), Some("c1-r1"));
    // Once its map is older than half the cleanup grace, a read goes on by
    // it and the map is read again in the background; past three quarters,
    // a read reads the map first (the old owner may have cleaned a moved
    // bucket's rows by the time the read's statement runs).
    let before = map_read_at(&stale);
    stale_clock.advance(std::time::Duration::from_secs(301));
    assert_eq!(read(&stale).await.as_deref(), Some("c1-r1"));
    map_read_again(&stale, before, "a stale map was not read in the background").await;
    let before = map_read_at(&stale);
    stale_clock.advance(std::time::Duration::from_secs(451));
    assert_eq!(read(&stale).await.as_deref(), Some("c1-r1"));
    assert!(
        map_read_at(&stale) > before,
        "an expired map was not read before a read"
    );

    // Read-your-writes across instances: a session records the bucket map
    // its commit was routed by, and an instance with an older map reads
    // the map again before it routes the session's read, so it reads the
    // new owner's row, not the old owner's as it was at the flip.
    let session = shardkit::Session::new();
    a.transaction_in::<Customer, _, _>(&session, 1, |tx| async move {
        tx.update(customer::ActiveModel {
            id: sea_orm::ActiveValue::Unchanged(1),
            name: Set("c1-session".to_owned()),
        })
        .await
    })
    .await
    .unwrap();
    let carried: shardkit::Session = session.to_string().parse().unwrap();
    let text = carried.to_string();
    assert!(
        text.ends_with(&format!("Customer=map:{}", epoch(&a))),
        "{text}"
    );
    let before = epoch(&other);
    assert!(before < epoch(&a));
    let with_session = other
        .find::<customer::Entity>()
        .key(1)
        .consistency(shardkit::Consistency::at_least(&carried))
        .one()
        .await
        .unwrap_or_else(|e| panic!("read with the session: {}", e.report()))
        .map(|m| m.name);
    assert_eq!(with_session.as_deref(), Some("c1-session"));
    // A control database that accepts and never answers: the read with the
    // session fails within its timeout, naming the control shard, instead
    // of waiting for the map (or reading the old owner's row).
    if let Some((proxy, through, clock)) = control {
        proxy.freeze();
        let started = std::time::Instant::now();
        let hung = through
            .find::<customer::Entity>()
            .key(1)
            .consistency(shardkit::Consistency::at_least(&carried))
            .one()
            .await
            .unwrap_err();
        assert!(
            matches!(&hung, ShardError::Timeout { shard, .. } if shard == "s0"),
            "{hung}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        // Its map is now older than half the cleanup grace, still safe to
        // route by: a read (without a session) goes on by it while the map
        // is read again in the background, and does not wait for the
        // control database (before, the read waited for the pool: here
        // 3 s, by default 30 s, for good with `test_before_acquire` off).
        clock.advance(std::time::Duration::from_secs(301));
        let started = std::time::Instant::now();
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(20),
            through.find::<customer::Entity>().key(1).one(),
        )
        .await
        .expect("a read waited on a control database that never answers");
        read.unwrap_or_else(|e| {
            panic!("a read after a map refresh that timed out: {}", e.report())
        });
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        // Past three quarters of the grace since the map's last successful
        // read (the attempts since failed), a bucket moved since may have
        // been cleaned from the shard the map names: reads are refused,
        // each within its timeout, rather than routed by it (before, a
        // failed attempt counted as a read, and the read went to the old
        // owner). Eight at once, on pools of 2.
        clock.advance(std::time::Duration::from_secs(150));
        let eight_refused = || async {
            let started = std::time::Instant::now();
            let reads = futures::future::join_all(
                (0..8).map(|_| through.find::<customer::Entity>().key(1).one()),
            )
            .await;
            for read in reads {
                let refused = read.unwrap_err();
                assert!(
                    matches!(
                        &refused,
                        ShardError::BucketMapExpired { group: "Customer", cause, .. }
                            if cause.contains("`s0`")
                    ),
                    "{}",
                    refused.report()
                );
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(2),
                "{:?}",
                started.elapsed()
            );
        };
        eight_refused().await;
        // A control database that refuses connections: the same refusal,
        // at once, saying why.
        proxy.killed().await;
        eight_refused().await;
        // Once the control database answers again, the map is read and
        // reads go on: a refusal is not kept past the outage. (The breaker
        // spaces its probes by the instance's clock, moved on here.)
        let port = proxy.port;
        drop(proxy);
        let server = dbs.backend.server_address().unwrap();
        let back = Proxy::start_on(port, server).await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        let read = loop {
            match through.find::<customer::Entity>().key(1).one().await {
                Ok(row) => break row.map(|m| m.name),
                Err(e) => assert!(
                    std::time::Instant::now() < deadline,
                    "reads still refused after the control database came back: {}",
                    e.report()
                ),
            }
            clock.advance(std::time::Duration::from_secs(1));
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        assert_eq!(read.as_deref(), Some("c1-session"));
        drop(through);
        back.killed().await;
    }
    assert_eq!(epoch(&other), epoch(&a));
    // A session from a map the control database never had (another
    // cluster's, or one made up) is read by the control database's map.
    let ahead: shardkit::Session = format!("Customer=map:{}", epoch(&a) + 100).parse().unwrap();
    for _ in 0..2 {
        let read = other
            .find::<customer::Entity>()
            .key(1)
            .consistency(shardkit::Consistency::at_least(&ahead))
            .one()
            .await
            .unwrap_or_else(|e| panic!("read with a session ahead: {}", e.report()))
            .map(|m| m.name);
        assert_eq!(read.as_deref(), Some("c1-session"));
    }
    assert_eq!(epoch(&other), epoch(&a));
    // A control database that lost the group's map (restored from a copy
    // older than the first move) answers, but is not a read of the map:
    // once the instance's map has expired, its reads are refused, saying
    // why, rather than routed by a map no longer confirmed.
    a.connection("s0")
        .unwrap()
        .execute_unprepared("DELETE FROM shardkit_bucket_epochs; DELETE FROM shardkit_bucket_map")
        .await
        .unwrap();
    stale_clock.advance(std::time::Duration::from_secs(451));
    let refused = stale
        .find::<customer::Entity>()
        .key(1)
        .one()
        .await
        .unwrap_err();
    assert!(
        matches!(
            &refused,
            ShardError::BucketMapExpired { group: "Customer", age: Some(_), cause, .. }
                if cause.contains("holds no bucket map as new as this instance's")
        ),
        "{}",
        refused.report()
    );
}

/// A mover paused inside its write transaction (holding the fence's shared
/// lock, as a process stopped mid-statement would) does not block the
/// process that takes the move over: the server ends the idle transaction
/// after the hold's length (PostgreSQL's
/// `idle_in_transaction_session_timeout`, MariaDB's
/// `idle_transaction_timeout`), the new mover's fence goes in and it
/// finishes the move; the paused mover's write never lands.
async fn a_mover_paused_inside_its_transaction_does_not_block_the_next(dbs: &mut TestDbs) {
    paused_mover_then_take_over(dbs, "shardkit::rebalance::park_open::copy").await;
}

/// A mover paused between two sends of a `COPY`'s data (PostgreSQL to
/// PostgreSQL), the fence's shared lock held: the server's idle bound does
/// not end a `COPY` waiting for its data, so the process that takes the
/// move over ends that session (it is named for the move and its
/// generation), installs its fence and finishes the move; the paused
/// mover's chunk never lands.
async fn a_mover_paused_while_sending_a_copy_does_not_block_the_next(dbs: &mut TestDbs) {
    paused_mover_then_take_over(dbs, "shardkit::rebalance::park_sending::copy").await;
}

/// A table in a named schema (`shardkit_shared_test.notes`) moves like the others while
/// eight writers on pools of 2 add to it, between PostgreSQL shards with
/// `COPY` into the schema's table: its columns are
/// checked there, its rows land there on the target and leave the sources,
/// and the table of the same name in the search path (the migration's
/// `public.notes`, with other columns) is not touched.
async fn a_table_in_a_named_schema_moves_with_copy(dbs: &mut TestDbs) {
    let (a, copies) = copy_observed(dbs).await;
    a.migrate::<Migrator>().await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    let columns = "(id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, body TEXT NOT NULL)";
    for shard in a.topology().shard_names() {
        a.connection(shard)
            .unwrap()
            .execute_unprepared(&format!(
                "CREATE SCHEMA shardkit_shared_test; CREATE TABLE shardkit_shared_test.notes {columns}"
            ))
            .await
            .unwrap();
    }
    // Notes acknowledged to the application: (id, key).
    let acked: Arc<Mutex<Vec<(i64, i64)>>> = Arc::default();
    let add = |cluster: Cluster, acked: Arc<Mutex<Vec<(i64, i64)>>>, key: i64, id: i64| async move {
        cluster
            .transaction::<Customer, _, _>(key, |tx| async move {
                tx.insert_without_returning(server_note::ActiveModel {
                    id: Set(id),
                    customer_id: Set(key),
                    body: Set(first_name(id)),
                })
                .await
            })
            .await
            .unwrap_or_else(|e| panic!("note {id} of {key}: {}", e.report()));
        acked.lock().unwrap().push((id, key));
    };
    for key in 1..=120i64 {
        for id in [key * 10, key * 10 + 1] {
            add(a.clone(), Arc::clone(&acked), key, id).await;
        }
    }
    // Eight writers on the instance's pools of 2 while the move runs (the
    // change log and its replay, in the schema's table).
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..8i64)
        .map(|w| {
            let (a, acked, stop, add) = (a.clone(), Arc::clone(&acked), Arc::clone(&stop), add);
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let key = 1 + (w + 8 * n) % 120;
                    add(a.clone(), Arc::clone(&acked), key, 100_000 + 8 * n + w).await;
                    n += 1;
                }
            })
        })
        .collect();
    let m = mover(&a).entity::<server_note::Entity>();
    let plan = m.plan_buckets(quarter(), "s4").await.unwrap();
    let id = m.start(&plan).await.unwrap().id;
    let done = m
        .run(id)
        .await
        .unwrap_or_else(|e| panic!("the move: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done);
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    a.refresh_bucket_maps().await.unwrap();

    // Every note on its key's owner, once, as written.
    let found = placed::<server_note::Entity, _>(&a, |n| (n.id, (n.customer_id, n.body))).await;
    for shard in a.topology().shard_names() {
        let db = a.connection(shard).unwrap();
        let decoy = db
            .query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT count(*) AS n FROM public.notes",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get::<i64>("", "n")
            .unwrap();
        assert_eq!(decoy, 0, "public.notes on {shard} was written");
    }
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() > 240, "no note written during the move");
    assert_eq!(found.len(), acked.len());
    let owner = owners(&a);
    for &(id, key) in &acked {
        assert_eq!(
            owner(key) == "s4",
            bucket(key).is_multiple_of(4),
            "owner of {key}"
        );
        assert_eq!(
            found[&id],
            vec![(owner(key), (key, first_name(id)))],
            "note {id} (bucket {})",
            bucket(key)
        );
    }
    // Routed to it.
    for key in 1..=120i64 {
        let read = a
            .find::<server_note::Entity>()
            .key(key)
            .all()
            .await
            .unwrap_or_else(|e| panic!("notes of {key}: {}", e.report()));
        let written = acked.iter().filter(|(_, k)| *k == key).count();
        assert_eq!(read.len(), written, "notes of {key}");
    }
    // Written with `COPY` into the schema's table.
    let copies = copies.lock().unwrap();
    assert!(
        copies.iter().any(|(shard, sql)| shard == "s4"
            && sql.starts_with(r#"COPY "shardkit_shared_test"."notes""#)),
        "no COPY into shardkit_shared_test.notes on s4 observed: {copies:?}"
    );
}

/// On MySQL/MariaDB an entity's `schema_name` names a database of the
/// server, so with shards that are databases of one server its table is
/// one table for them all: a move would copy its rows onto themselves and
/// then delete them from the source. The move is refused when it is
/// started, naming the table and the shards, and nothing is registered.
/// Moves that got past the check (as by an earlier build) are aborted, or
/// cleaned up, without deleting a note from the one table: every note is
/// still there, once, and found by its key.
async fn a_table_in_a_database_every_shard_shares_is_not_moved(dbs: &mut TestDbs) {
    let a = connect(dbs, 20).await;
    a.migrate::<Migrator>().await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    let db = a.connection("s0").unwrap();
    for sql in [
        "CREATE DATABASE IF NOT EXISTS shardkit_shared_test",
        "DROP TABLE IF EXISTS shardkit_shared_test.notes",
        "CREATE TABLE shardkit_shared_test.notes \
         (id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, body TEXT NOT NULL)",
    ] {
        db.execute_unprepared(sql).await.unwrap();
    }
    add_notes(&a).await;
    let m = a
        .rebalance::<Customer>()
        .unwrap()
        .entity::<server_note::Entity>();
    let plan = m.plan_buckets(quarter(), "s4").await.unwrap();
    let reason = start_refused(&m, &plan).await;
    assert!(
        reason.starts_with("`shardkit_shared_test.notes` would be the same table on shards `s")
            && reason.contains("and `s4`: they are databases of one MySQL/MariaDB server"),
        "{reason}"
    );
    // Moves that got past the check (registered and run as by a build
    // without it): one aborted, one run to the end. Neither deletes a note
    // from the one table, and each note is found by its key afterwards.
    {
        let _turn = FAILPOINTS.lock().await;
        fail::cfg(
            "shardkit::rebalance::tables_apart_unchecked",
            &format!("return({})", dbs.scope_of(4)),
        )
        .unwrap();
        let aborted = async {
            let id = m.start(&plan).await?.id;
            m.abort(id).await
        }
        .await;
        let done = async {
            let id = m.start(&plan).await?.id;
            m.run(id).await
        }
        .await;
        fail::remove("shardkit::rebalance::tables_apart_unchecked");
        let phase = |r: shardkit::Result<shardkit::rebalance::MoveStatus>| {
            r.unwrap_or_else(|e| panic!("{}", e.report())).phase
        };
        assert_eq!(phase(aborted), MovePhase::Aborted);
        assert_eq!(phase(done), MovePhase::Done);
    }
    a.refresh_bucket_maps().await.unwrap();
    for key in 1..=40i64 {
        let found = a
            .find::<server_note::Entity>()
            .key(key)
            .all()
            .await
            .unwrap_or_else(|e| panic!("notes of {key}: {}", e.report()));
        assert_eq!(found.len(), 1, "notes of {key}");
    }
    let notes = db
        .query_all_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            "SELECT id, customer_id, body FROM shardkit_shared_test.notes ORDER BY id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| {
            let id: i64 = row.try_get("", "id").unwrap();
            let key: i64 = row.try_get("", "customer_id").unwrap();
            let body: String = row.try_get("", "body").unwrap();
            (id, key, body)
        })
        .collect::<Vec<_>>();
    let expected: Vec<_> = (1..=40i64).map(|k| (k, k, first_name(k))).collect();
    assert_eq!(notes, expected);
    db.execute_unprepared("DROP DATABASE shardkit_shared_test")
        .await
        .unwrap();
}

/// Notes 1..=40, each of its own customer, in `server_note`'s table.
async fn add_notes(cluster: &Cluster) {
    for key in 1..=40i64 {
        cluster
            .transaction::<Customer, _, _>(key, |tx| async move {
                tx.insert_without_returning(server_note::ActiveModel {
                    id: Set(key),
                    customer_id: Set(key),
                    body: Set(first_name(key)),
                })
                .await
            })
            .await
            .unwrap_or_else(|e| panic!("note of {key}: {}", e.report()));
    }
}

/// The reason `start` refused `plan` with, before registering anything.
async fn start_refused(m: &Rebalance<Customer>, plan: &shardkit::rebalance::MovePlan) -> String {
    match m.start(plan).await {
        Err(ShardError::Rebalance {
            id: None, reason, ..
        }) => {
            assert_eq!(
                m.list(true).await.unwrap().len(),
                0,
                "a move was registered"
            );
            reason
        }
        other => panic!("a move that would copy rows onto themselves: {other:?}"),
    }
}

/// The config with shard s4 reached by `url` instead of its own database.
fn with_s4_at(dbs: &TestDbs, url: &str) -> ClusterConfig {
    let toml = toml_with(
        dbs,
        &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
        20,
    );
    let own = match dbs.backend {
        Backend::Sqlite => format!(
            "name = \"s4\"\nurl = \"sqlite://{}?mode=rwc\"\n",
            dbs.names[4]
        ),
        _ => format!(
            "name = \"s4\"\nhost = \"server\"\ndatabase = \"{}\"\n",
            dbs.names[4]
        ),
    };
    assert!(toml.contains(&own), "{toml}");
    let toml = toml.replace(&own, &format!("name = \"s4\"\nurl = \"{url}\"\n"));
    ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("config: {e}\n{toml}"))
}

/// Every customer is read by its key, as written.
async fn each_customer_found(cluster: &Cluster, acked: &Shared) {
    let customers = acked.lock().unwrap().customers.clone();
    for (id, name) in customers {
        let found = cluster
            .find::<customer::Entity>()
            .key(id)
            .one()
            .await
            .unwrap_or_else(|e| panic!("customer {id}: {}", e.report()));
        assert_eq!(found.map(|c| c.name), Some(name), "customer {id}");
    }
}

/// Shard s4's URL reaches s0's database, spelled another way (a parameter
/// that changes nothing; for SQLite, the file's path through `./`), so the
/// config's check for one database named twice lets it through. A move
/// from s0 to s4 would copy every row onto itself and then delete the
/// moved buckets' rows: it is refused when it starts, naming the tables and
/// the shards, nothing is registered, and every customer is still found.
async fn a_shard_whose_url_reaches_another_shards_database_takes_no_move(dbs: &mut TestDbs) {
    let alias = match dbs.backend {
        Backend::Sqlite => {
            let path = std::path::Path::new(&dbs.names[0]);
            format!(
                "sqlite://{}/./{}?mode=rwc",
                path.parent().unwrap().display(),
                path.file_name().unwrap().to_string_lossy()
            )
        }
        Backend::Postgres => format!(
            "{}/{}?application_name=alias",
            dbs.backend.server_url().unwrap(),
            dbs.names[0]
        ),
        Backend::MySql => format!(
            "{}/{}?charset=utf8mb4",
            dbs.backend.server_url().unwrap(),
            dbs.names[0]
        ),
    };
    // Seeded by an instance with s4's own database; then s4's URL is
    // changed to the alias (a shard added to the config by mistake at
    // another shard's database) and that instance migrates, which finds
    // every migration applied.
    let seeded = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&seeded, &acked, 1..=40).await;
    drop(seeded);
    let a = Cluster::connect(with_s4_at(dbs, &alias)).await.unwrap();
    a.migrate::<Migrator>().await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    let m = mover(&a);
    let plan = m.plan_buckets(quarter(), "s4").await.unwrap();
    let why = match dbs.backend {
        Backend::Postgres => {
            "they are one PostgreSQL database, and the table each one's search path finds is the same"
        }
        _ => "the two shards' URLs reach one database",
    };
    let reason = start_refused(&m, &plan).await;
    // The group's tables, the outbox's among them.
    assert!(
        reason.starts_with("`customers`, `orders`, `contacts`, `shardkit_outbox`, ")
            && reason.contains(&format!(
                "would each be one table on shards `s0` and `s4`: {why}, so the move would copy the rows onto themselves"
            ))
            && reason.contains("give each shard a database of its own in the config"),
        "{reason}"
    );
    each_customer_found(&a, &acked).await;
}

/// Shard s4 is schema `shard4` of s0's database (its URL sets the search
/// path). Tables the search path finds are each shard's own, and move: the
/// Customer group's quarter of the buckets goes to s4 and every customer and
/// order is then on its owner, once. A table in a named schema (`shardkit_shared_test.notes`)
/// is one table for s0 and s4: a move that lists it is refused at start,
/// naming it, and nothing is registered.
async fn shards_that_are_schemas_of_one_database_move_their_own_tables_only(dbs: &mut TestDbs) {
    let server = dbs.backend.server_url().unwrap();
    let s0 = sea_orm::Database::connect(format!("{server}/{}", dbs.names[0]))
        .await
        .unwrap();
    s0.execute_unprepared("CREATE SCHEMA shard4").await.unwrap();
    let url = format!(
        "{server}/{}?options=-c%20search_path%3Dshard4",
        dbs.names[0]
    );
    let a = Cluster::connect(with_s4_at(dbs, &url)).await.unwrap();
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=40).await;
    let columns = "(id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, body TEXT NOT NULL)";
    for shard in ["s0", "s1", "s2", "s3"] {
        a.connection(shard)
            .unwrap()
            .execute_unprepared(&format!(
                "CREATE SCHEMA shardkit_shared_test; CREATE TABLE shardkit_shared_test.notes {columns}"
            ))
            .await
            .unwrap();
    }
    add_notes(&a).await;
    let with_notes = mover(&a).entity::<server_note::Entity>();
    let plan = with_notes.plan_buckets(quarter(), "s4").await.unwrap();
    let reason = start_refused(&with_notes, &plan).await;
    assert!(
        reason.starts_with(
            "`shardkit_shared_test.notes` would be the same table on shards `s0` and `s4`: they are one PostgreSQL database (each with its own search path)"
        ),
        "{reason}"
    );

    let m = mover(&a);
    let id = m.start(&plan).await.unwrap().id;
    let done = m
        .run(id)
        .await
        .unwrap_or_else(|e| panic!("the move: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done);
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
    let owner = owners(&a);
    assert!(
        (1..=40i64).any(|k| owner(k) == "s4"),
        "no customer moved to s4"
    );
    // In s4's own schema, not s0's tables.
    let in_shard4 = s0
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT count(*) AS n FROM shard4.customers",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get::<i64>("", "n")
        .unwrap();
    let moved = (1..=40i64).filter(|k| owner(*k) == "s4").count();
    assert_eq!(in_shard4, moved as i64);
    s0.close().await.unwrap();
}

/// The first mover parks at failpoint `at` (on the move's target); a
/// second instance's mover takes the move over and finishes it.
async fn paused_mover_then_take_over(dbs: &mut TestDbs, at: &str) {
    let (a, acked, stop, w) = seeded_with_writer(dbs, 40).await;
    let b = ahead_instance(dbs).await;
    let target_db = dbs.names[4].clone();
    let _turn = FAILPOINTS.lock().await;
    let parked = count_parks();
    let m = mover(&a);
    let id = m
        .start(&m.plan_buckets([bucket(1), bucket(2)], "s4").await.unwrap())
        .await
        .unwrap()
        .id;
    fail::cfg(at, &format!("return({target_db}@1)")).unwrap();
    let first = tokio::spawn(async move { m.run(id).await });
    until("parked inside its transaction", || {
        parked.load(Ordering::SeqCst) > 0
    })
    .await;
    let started = std::time::Instant::now();
    let done = mover(&b)
        .run(id)
        .await
        .unwrap_or_else(|e| panic!("take-over: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done);
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(40),
        "the take-over waited {took:?}"
    );
    written_again(&acked, &[1, 2], "a write after the move").await;
    fail::remove(at);
    fail::remove("shardkit::rebalance::parked");
    // Its connection was closed by the server, or its write refused.
    assert!(first.await.unwrap().is_err());
    stop.store(true, Ordering::SeqCst);
    w.await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
}

/// When the database aborts the fence read that opens a write transaction
/// of a movable group (a deadlock with a mover: MariaDB's 1213 during a
/// move; simulated by a failpoint), `begin` rolls back and begins again, at
/// most 5 times: the caller gets its transaction. Past that, the error says
/// to run the transaction again.
async fn a_begin_whose_fence_read_the_database_aborts_begins_again(dbs: &mut TestDbs) {
    const KEY: i64 = 9_999_937;
    // Before the seed: the failpoint names a key, which the backends' runs
    // share.
    let _turn = FAILPOINTS.lock().await;
    let a = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&a, &acked, [KEY]).await;
    let at = "shardkit::begin::fence_aborted";
    fail::cfg(at, &format!("return({KEY}@3)")).unwrap();
    let tx = a
        .begin::<Customer>(KEY)
        .await
        .unwrap_or_else(|e| panic!("begin after three aborts: {}", e.report()));
    tx.update(customer::ActiveModel {
        id: sea_orm::ActiveValue::Unchanged(KEY),
        name: Set("renamed".into()),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    fail::cfg(at, &format!("return({KEY})")).unwrap();
    let err = a.begin::<Customer>(KEY).await.unwrap_err();
    fail::remove(at);
    assert!(
        matches!(&err, ShardError::Db { operation, .. } if operation == "read shardkit_bucket_states")
            && err.retry() == shardkit::Retry::Transaction,
        "{}",
        err.report()
    );
    let name = a
        .find::<customer::Entity>()
        .key(KEY)
        .one()
        .await
        .unwrap()
        .map(|c| c.name);
    assert_eq!(name.as_deref(), Some("renamed"));
}

/// The config (TOML) and the move the child process of
/// [`a_move_run_by_another_process_on_the_same_sqlite_files`] runs.
const CHILD_CONFIG: &str = "SHARDKIT_TEST_MOVE_CONFIG";
const CHILD_MOVE: &str = "SHARDKIT_TEST_MOVE_ID";

/// Two processes on one set of SQLite files: this one writes with eight
/// writers on two instances (pools of 2), another OS process (this test
/// binary run again) runs a move of a quarter of the buckets. The move
/// finishes, no write fails, and every acknowledged row is on its owner.
async fn a_move_run_by_another_process_on_the_same_sqlite_files(dbs: &mut TestDbs) {
    let toml = toml_with(
        dbs,
        &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
        20,
    );
    let a = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=80).await;
    let b = connect(dbs, 20).await;
    let m = mover(&a);
    let id = m
        .start(&m.plan_buckets(quarter(), "s4").await.unwrap())
        .await
        .unwrap()
        .id;
    let stop = Arc::new(AtomicBool::new(false));
    let writers = eight_writers([&a, &b], &acked, 1..=80, &stop);
    move_in_another_process(toml, id).await;
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    assert_eq!(mover(&a).status(id).await.unwrap().phase, MovePhase::Done);
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
}

/// The other process of the scenario above (nothing to do when this binary
/// runs as itself): runs the move the parent registered and prints its
/// phase.
async fn child_process_mover(_dbs: &mut TestDbs) {
    let Ok(toml) = std::env::var(CHILD_CONFIG) else {
        return;
    };
    let id: i64 = std::env::var(CHILD_MOVE).unwrap().parse().unwrap();
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    // Until the move is done: its cleaning waits for the longest cleanup
    // grace an instance recorded.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let done = loop {
        let status = mover(&cluster)
            .run(id)
            .await
            .unwrap_or_else(|e| panic!("the move: {}", e.report()));
        if status.phase != MovePhase::Cleaning || std::time::Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    println!("\nMOVED {}", done.phase);
}

/// Runs [`child_process_mover`] in another OS process on the config `toml`
/// for move `id`, and checks that it finished the move.
async fn move_in_another_process(toml: String, id: i64) {
    let exe = std::env::current_exe().unwrap();
    let child = tokio::task::spawn_blocking(move || {
        std::process::Command::new(exe)
            .args([
                "child_process_mover::sqlite",
                "--exact",
                "--test-threads",
                "1",
            ])
            .env(CHILD_CONFIG, toml)
            .env(CHILD_MOVE, id.to_string())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let out = String::from_utf8_lossy(&child.stdout);
    assert!(
        child.status.success() && out.contains("MOVED done"),
        "the other process: {}\n{out}\n{}",
        child.status,
        String::from_utf8_lossy(&child.stderr)
    );
}

/// Two processes on one set of SQLite files, with different cleanup
/// graces: this one's instances wait 3 s, the other process moves a bucket
/// with none. The mover cleans only after this process's grace (recorded
/// in the control database), and an instance here whose map is from
/// before the move, never refreshed since, reads the moved row from its
/// new owner, as written after the move, not the old owner's emptied
/// copy.
async fn a_process_reads_what_another_process_moved_and_cleaned(dbs: &mut TestDbs) {
    let quick = toml_with(
        dbs,
        &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
        0,
    );
    let patient =
        ClusterConfig::from_toml(&quick.replace("cleanup_grace_ms = 0", "cleanup_grace_ms = 3000"))
            .unwrap();
    let a = Cluster::connect(patient.clone()).await.unwrap();
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=20).await;
    let stale = Cluster::connect(patient).await.unwrap();
    stale.refresh_bucket_maps().await.unwrap();
    let read = name_of_first;
    assert_eq!(read(&stale).await, Some(first_name(1)));
    grace_recorded(&a, 3000).await;
    let source = a.shard_of_now::<Customer>(&1).unwrap().unwrap().to_owned();
    let m = mover(&a);
    let id = m
        .start(&m.plan_buckets([bucket(1)], "s4").await.unwrap())
        .await
        .unwrap()
        .id;
    move_in_another_process(quick, id).await;
    let on_source = customer::Entity::find_by_id(1)
        .one(a.connection(&source).unwrap())
        .await
        .unwrap();
    assert_eq!(on_source, None, "the old owner was not cleaned");
    a.transaction::<Customer, _, _>(1, |tx| async move {
        tx.update(customer::ActiveModel {
            id: sea_orm::ActiveValue::Unchanged(1),
            name: Set("c1-moved".to_owned()),
        })
        .await
    })
    .await
    .unwrap();
    assert_eq!(a.shard_of_now::<Customer>(&1).unwrap(), Some("s4"));
    assert_eq!(read(&stale).await.as_deref(), Some("c1-moved"));
}

/// A relay's prune deletes expired request outcomes on one shard at a
/// time, with no change-log entry: here on a move's source after the copy
/// took them. The move's verify leaves expired rows out: it finds no
/// difference to copy again (a copy again that a prune on the target
/// raced stopped the move), the move finishes, and the expired request
/// runs again on the new owner.
async fn an_outcome_pruned_on_one_side_of_a_move_does_not_stop_it(dbs: &mut TestDbs) {
    let config = config(dbs, 0);
    // An instance two days behind stores outcomes that every other
    // instance finds expired.
    let past = connect_on(
        config.clone(),
        Arc::new(shardkit::clock::ManualClock::new(
            shardkit::Clock::now_millis(&shardkit::clock::SystemClock) - 48 * 3_600_000,
        )),
    )
    .await;
    past.migrate::<Migrator>().await.unwrap();
    past.refresh_bucket_maps().await.unwrap();
    let request = |cluster: &Cluster, value: i64| {
        let cluster = cluster.clone();
        async move {
            cluster
                .transaction_once::<Customer, i64, _>(1, "req-1", |_tx| async move { Ok(value) })
                .await
                .unwrap_or_else(|e| panic!("request: {}", e.report()))
        }
    };
    assert_eq!(request(&past, 1).await, 1);
    // Deletes of outcomes on the target, while `watch` is set.
    let watch = Arc::new(AtomicBool::new(false));
    let deletes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let a = Cluster::builder(config)
        .on_statement({
            let (watch, deletes) = (watch.clone(), deletes.clone());
            move |e| {
                let sql = &e.statement.sql;
                if watch.load(Ordering::SeqCst)
                    && e.shard == "s4"
                    && sql.starts_with("DELETE")
                    && sql.contains("shardkit_requests")
                {
                    deletes.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
        .connect()
        .await
        .unwrap();
    a.refresh_bucket_maps().await.unwrap();
    let owner = |c: &Cluster| {
        let id = c.route_now::<Customer>(&1).unwrap().unwrap().shard;
        c.topology().shard(id).name.clone()
    };
    let (source, target) = (owner(&a), "s4");
    let stored = |shard: String| {
        let a = a.clone();
        async move {
            let db = a.connection(&shard).unwrap();
            db.query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT COUNT(*) AS n FROM shardkit_requests WHERE key_text = '1'",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get::<i64>("", "n")
            .unwrap()
        }
    };
    let _turn = FAILPOINTS.lock().await;
    let name = "shardkit::rebalance::catching_up";
    fail::cfg(name, &format!("return({})", dbs.names[4])).unwrap();
    let m = mover(&a);
    let id = m
        .start(&m.plan_buckets([bucket(1)], target).await.unwrap())
        .await
        .unwrap()
        .id;
    // Stopped after the copy: the outcome is on both shards.
    assert!(m.run(id).await.is_err());
    fail::remove(name);
    assert_eq!(
        (stored(source.clone()).await, stored(target.into()).await),
        (1, 1)
    );
    // What a relay's prune runs on the source.
    let src = a.connection(&source).unwrap();
    src.execute_unprepared(&format!(
        "DELETE FROM shardkit_requests WHERE created_at < {}",
        shardkit::Clock::now_millis(&shardkit::clock::SystemClock) - 24 * 3_600_000
    ))
    .await
    .unwrap();
    watch.store(true, Ordering::SeqCst);
    let done = m
        .run(id)
        .await
        .unwrap_or_else(|e| panic!("the move after the prune: {}", e.report()));
    watch.store(false, Ordering::SeqCst);
    assert_eq!(done.phase, MovePhase::Done);
    assert_eq!(
        deletes.load(Ordering::SeqCst),
        0,
        "the verify copied the expired outcome's key again"
    );
    a.refresh_bucket_maps().await.unwrap();
    assert_eq!(owner(&a), target);
    // Expired on the new owner too: the request runs again.
    assert_eq!(request(&a, 2).await, 2);
    assert_eq!(request(&a, 3).await, 2);
}
