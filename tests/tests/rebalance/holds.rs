//! Holds and fences: a mover paused past its hold, a copy under foreign
//! keys, a mover dead after fencing, a shard added, a failed migrate, map
//! reads.

use super::*;

/// A mover paused (a GC pause, a VM stall, a stopped process) before each
/// kind of write it makes, past its hold: another process, whose clock is
/// ahead, takes the move over and finishes it while a writer goes on
/// writing the moving keys on their new owner. When the first mover goes on,
/// the shard it writes refuses it: no acknowledged row goes back to an
/// older version, no deleted row comes back, and no row is left on a shard
/// that does not own its bucket.
pub(crate) async fn a_mover_paused_past_its_hold_is_refused_where_it_writes(dbs: &mut TestDbs) {
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
pub(crate) struct AckedCarts {
    carts: BTreeMap<i64, (i64, String)>,
    items: BTreeMap<i64, (i64, i64)>,
}

/// Writes to `keys` without a pause until `stop`: one transaction in ten
/// adds a cart with two items (a parent and its children, joined by a
/// foreign key), the others rename the cart's customer. Every write must
/// succeed.
pub(crate) fn cart_writer(
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
pub(crate) async fn a_copy_converges_while_writers_add_parents_and_children(dbs: &mut TestDbs) {
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
pub(crate) async fn a_mover_dead_after_fencing_is_taken_over_once_its_hold_lapses(
    dbs: &mut TestDbs,
) {
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
pub(crate) async fn a_shard_added_to_the_config_connects_unmigrated_and_takes_buckets_after_migrate(
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
pub(crate) async fn a_migrate_that_fails_on_a_ticket_server_leaves_the_movable_group_writable(
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
pub(crate) async fn a_background_map_read_dropped_unrun_is_tried_again(dbs: &mut TestDbs) {
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
pub(crate) fn map_read_at(cluster: &Cluster) -> i64 {
    cluster
        .topology()
        .live_owners("Customer")
        .unwrap()
        .unwrap()
        .read_at_ms()
}

/// Waits (at most 10 s) until `cluster` has read its Customer map since
/// `before`; fails with `otherwise`.
pub(crate) async fn map_read_again(cluster: &Cluster, before: i64, otherwise: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while map_read_at(cluster) == before {
        assert!(std::time::Instant::now() < deadline, "{otherwise}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}
