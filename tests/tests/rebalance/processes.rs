//! Moves by other processes on the same SQLite files, and outcomes pruned
//! on one side of a move.

use super::*;

/// The config (TOML) and the move the child process of
/// [`a_move_run_by_another_process_on_the_same_sqlite_files`] runs.
pub(crate) const CHILD_CONFIG: &str = "SHARDKIT_TEST_MOVE_CONFIG";
pub(crate) const CHILD_MOVE: &str = "SHARDKIT_TEST_MOVE_ID";

/// Two processes on one set of SQLite files: this one writes with eight
/// writers on two instances (pools of 2), another OS process (this test
/// binary run again) runs a move of a quarter of the buckets. The move
/// finishes, no write fails, and every acknowledged row is on its owner.
pub(crate) async fn a_move_run_by_another_process_on_the_same_sqlite_files(dbs: &mut TestDbs) {
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
pub(crate) async fn child_process_mover(_dbs: &mut TestDbs) {
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
pub(crate) async fn move_in_another_process(toml: String, id: i64) {
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
pub(crate) async fn a_process_reads_what_another_process_moved_and_cleaned(dbs: &mut TestDbs) {
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
pub(crate) async fn an_outcome_pruned_on_one_side_of_a_move_does_not_stop_it(dbs: &mut TestDbs) {
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
