//! `transaction_once`: concurrent retries of one request run it once.

use super::*;

/// 8 concurrent retries of one request id run the work once and all get
/// its outcome; another id runs again; a failed run stores nothing.
pub(crate) async fn concurrent_retries_of_a_request_run_it_once(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    open_wallet(&cluster, 7, 0).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let pay = |cluster: Cluster, runs: Arc<AtomicUsize>, request: &'static str| async move {
        cluster
            .transaction_once::<Holder, (i64, String), _>(7, request, |tx| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let w = tx
                        .find::<wallet::Entity>()
                        .lock_exclusive()
                        .one()
                        .await?
                        .unwrap();
                    tx.update(wallet::ActiveModel {
                        id: Set(7),
                        balance: Set(w.balance + 5),
                    })
                    .await?;
                    Ok((w.balance + 5, shardkit::uuid_v7().to_string()))
                }
            })
            .await
    };
    // 8 retries of req-1 at once through `cluster`: their outcomes.
    let eight = |cluster: &Cluster| {
        let tasks: Vec<_> = (0..8)
            .map(|_| tokio::spawn(pay(cluster.clone(), runs.clone(), "req-1")))
            .collect();
        async move {
            let mut outcomes = Vec::new();
            for t in tasks {
                outcomes.push(
                    t.await
                        .unwrap()
                        .unwrap_or_else(|e| panic!("{}", e.report())),
                );
            }
            outcomes
        }
    };
    let outcomes = eight(&cluster).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");
    assert!(outcomes.iter().all(|o| *o == outcomes[0]), "{outcomes:?}");
    assert_eq!(balance(&cluster, 7).await, 5);
    let again = pay(cluster.clone(), runs.clone(), "req-2").await.unwrap();
    assert_eq!((again.0, runs.load(Ordering::SeqCst)), (10, 2));
    // A failing run stores nothing: its retry runs.
    let failed = cluster
        .transaction_once::<Holder, i64, _>(7, "req-3", |_tx| async {
            Err(ShardError::Internal {
                what: "boom".into(),
            })
        })
        .await;
    assert!(matches!(failed, Err(ShardError::Internal { .. })));
    let third = pay(cluster.clone(), runs.clone(), "req-3").await.unwrap();
    assert_eq!(third.0, 15);
    // Bad ids are refused before anything runs.
    let long = "x".repeat(201);
    let err = cluster
        .transaction_once::<Holder, i64, _>(7, &long, |_tx| async { Ok(1) })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::CrossKey { .. }), "{err}");
    assert!(err.to_string().contains("1 to 200 characters"), "{err}");
    let err = cluster
        .transaction_once::<Holder, i64, _>(7, "req-1 ", |_tx| async { Ok(1) })
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("does not end with a space"),
        "{err}"
    );
    // An outcome too big to store is refused, and the work rolled back.
    let big = cluster
        .transaction_once::<Holder, String, _>(7, "req-big", |tx| async move {
            tx.update(wallet::ActiveModel {
                id: Set(7),
                balance: Set(-1),
            })
            .await?;
            Ok("x".repeat(70_000))
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&big, ShardError::CrossKey { reason, .. } if reason.starts_with("its outcome is 70002 bytes of JSON")),
        "{big}"
    );
    assert_eq!(balance(&cluster, 7).await, 15, "nothing was committed");
    // Work that swallows a failed statement: PostgreSQL ended the
    // transaction, and the refusal carries the database's own words.
    if dbs.backend == Backend::Postgres {
        let ended = cluster
            .transaction_once::<Holder, i64, _>(7, "req-swallowed", |tx| async move {
                let _ = tx
                    .unchecked_connection()
                    .execute_unprepared("SELECT * FROM no_such_table")
                    .await;
                Ok(1)
            })
            .await
            .unwrap_err();
        let text = ended.to_string();
        assert!(
            text.contains("the work returned Ok on a transaction the database had ended")
                && text.contains("current transaction is aborted"),
            "{text}"
        );
    }
    // Work that handles a deadlock's error itself and returns Ok: the
    // database ended that run, so nothing of it is stored and it runs
    // again; a retry of the request then gets the second run's outcome.
    if dbs.backend != Backend::Sqlite {
        let shard = cluster.shard_of::<Holder>(&7).await.unwrap().to_owned();
        shardkit_tests::models::create_aborting_function(cluster.connection(&shard).unwrap()).await;
        // Then the same, the work returning the refusal of its next write.
        for (request, then_write) in [("req-aborted", false), ("req-aborted-write", true)] {
            let ran = Arc::new(AtomicUsize::new(0));
            let counted = Arc::clone(&ran);
            let outcome = cluster
                .transaction_once::<Holder, usize, _>(7, request, move |tx| {
                    let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
                    async move {
                        if run == 1 {
                            swallow_an_abort(&tx).await;
                        }
                        if then_write {
                            tx.update(wallet::ActiveModel {
                                id: Set(7),
                                balance: Set(15),
                            })
                            .await?;
                        }
                        Ok(run)
                    }
                })
                .await
                .unwrap();
            assert_eq!((outcome, ran.load(Ordering::SeqCst)), (2, 2), "{request}");
            let again = cluster
                .transaction_once::<Holder, usize, _>(7, request, |_| async { Ok(99) })
                .await
                .unwrap();
            assert_eq!(again, 2, "{request}: the second run's stored outcome");
        }
    }
    // To an instance a day and an hour ahead, req-1's outcome expired: 8
    // retries of it at once run the work once more (MySQL/MariaDB: a
    // retry's delete of the expired row must not take another's new
    // claim), and all get that run's outcome.
    let ahead = Arc::new(shardkit::clock::ManualClock::new(
        shardkit::Clock::now_millis(&shardkit::clock::SystemClock) + 25 * 3_600_000,
    ));
    let later = Cluster::builder(ClusterConfig::from_toml(&toml(dbs, &[])).unwrap())
        .clock(ahead)
        .connect()
        .await
        .unwrap();
    later.refresh_bucket_maps().await.unwrap();
    let outcomes = eight(&later).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        4,
        "the expired request ran once more"
    );
    assert!(outcomes.iter().all(|o| *o == outcomes[0]), "{outcomes:?}");
    assert_eq!(outcomes[0].0, 20);

    // The running relay of an instance two days ahead prunes them all
    // (after its deletes of expired inbox ids and finished sagas, which
    // run first: a failing one would leave the outcomes).
    let stored = shardkit_tests::count_rows(&cluster, "shardkit_requests").await;
    assert!(stored >= 3, "{stored}");
    let ahead = Arc::new(shardkit::clock::ManualClock::new(
        shardkit::Clock::now_millis(&shardkit::clock::SystemClock) + 50 * 3_600_000,
    ));
    let pruner = Cluster::builder(ClusterConfig::from_toml(&toml(dbs, &[])).unwrap())
        .clock(ahead.clone())
        .connect()
        .await
        .unwrap();
    let running = relay(&pruner).poll_every(Duration::from_millis(5)).run();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while shardkit_tests::count_rows(&cluster, "shardkit_requests").await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "expired outcomes not pruned"
        );
        // A shard's prune runs once a minute of its clock: a slow first
        // one is tried again.
        ahead.advance(Duration::from_secs(61));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.stop();
}
