//! Moves while application instances write: a quarter of the buckets, a
//! range split, movers killed or aborted in each phase, a cancelled run, the
//! cleanup after the instances' grace.

use super::*;

pub(crate) async fn two_instances_write_while_a_quarter_of_the_buckets_move(dbs: &mut TestDbs) {
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
pub(crate) fn range_config(dbs: &TestDbs, refresh_ms: u64) -> ClusterConfig {
    config_with(
        dbs,
        "placement = \"range\"\nranges = [\n  { shard = \"s0\", to = 40 },\n  { shard = \"s1\", from = 40, to = 80 },\n  { shard = \"s2\", from = 80, to = 120 },\n  { shard = \"s3\", from = 120 },\n]",
        refresh_ms,
    )
}

/// The group's ranges as `(id, from, to, shard)`.
pub(crate) async fn ranges_of(
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

pub(crate) async fn a_range_splits_and_half_of_it_moves_while_two_instances_write(
    dbs: &mut TestDbs,
) {
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
pub(crate) async fn a_split_that_dies_before_fencing_is_finished_by_the_next_move(
    dbs: &mut TestDbs,
) {
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

pub(crate) async fn the_mover_killed_in_each_phase_is_resumed_by_another_process(
    dbs: &mut TestDbs,
) {
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

pub(crate) async fn abort_in_each_phase_leaves_the_source_the_owner(dbs: &mut TestDbs) {
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
pub(crate) async fn a_cancelled_run_stops_at_a_chunk_and_the_next_run_resumes(dbs: &mut TestDbs) {
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
pub(crate) async fn a_mover_cleans_after_the_longest_grace_of_the_instances(dbs: &mut TestDbs) {
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
