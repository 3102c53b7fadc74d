//! The relay: parked messages, order, backlogs, racing relays, handlers
//! that fail, swallow a failed statement or a refusal, or meet a message
//! applied before.

use super::*;

/// Panics whose message is `expected` are not printed (the scenario
/// makes them on purpose); every other panic is, as before.
pub(crate) fn quiet_panics(expected: &'static str) {
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| {
        let print = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&expected) {
                print(info);
            }
        }));
    });
}

/// A handler that fails for one amount parks its message after the
/// attempts; the status lists it; retry and discard work on it; the other
/// messages of the pair are applied in the order they were sent.
pub(crate) async fn parked_messages_are_listed_retried_and_discarded_and_order_holds(
    dbs: &mut TestDbs,
) {
    let metrics = shardkit_tests::recorded::totals();
    // A group whose buckets never move: the sender's outbox rows change
    // with one statement each, not in a fenced transaction (the transfers
    // scenario covers the movable path).
    let cluster = connect(&toml(dbs, &[]).replace("movable = true", "movable = false")).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 0).await;
    }
    let fail_13 = Arc::new(AtomicBool::new(true));
    let seen_3 = Arc::new(AtomicBool::new(false));
    let outbox = {
        let fail_13 = fail_13.clone();
        let seen_3 = seen_3.clone();
        relay(&cluster)
            .max_attempts(2)
            .backoff(Duration::ZERO, Duration::ZERO)
            .handle::<Credit, _, _, _>(move |tx, c: Credit| {
                let fail_13 = fail_13.load(Ordering::SeqCst);
                // The 3rd message fails its first attempt: the ones after
                // it wait for it.
                let first_of_3 = c.seq == 3 && !seen_3.swap(true, Ordering::SeqCst);
                async move {
                    if first_of_3 {
                        return Err(shardkit::BoxError::from("not yet"));
                    }
                    if c.amount == 13 && fail_13 {
                        // 70 KB: longer than MySQL/MariaDB's TEXT, which
                        // holds the message's last error.
                        let why = format!("thirteen is unlucky{}", " (and so on)".repeat(6000));
                        return Err(shardkit::BoxError::from(why));
                    }
                    if c.amount == 66 {
                        quiet_panics("sixty-six");
                        panic!("sixty-six");
                    }
                    apply_credit(&tx, c).await
                }
            })
            .handle::<Gift, _, _, _>(|_tx, _g: Gift| async { Ok::<(), shardkit::BoxError>(()) })
    };
    // 20 messages from 1 to 2, each in its own transaction; the 5th is 13.
    let mut parked_id = String::new();
    for seq in 1..=20 {
        let amount = if seq == 5 { 13 } else { 1 };
        let id = send_credit(&cluster, 1, 2, seq, amount).await;
        if seq == 5 {
            parked_id = id;
        }
    }
    let report = outbox.deliver().await.unwrap();
    assert_eq!(
        (report.applied, report.parked, report.failed),
        (19, 1, 3),
        "{report:?}"
    );
    let seqs: Vec<i64> = {
        let mut credits = cluster.find::<credit::Entity>().key(2).all().await.unwrap();
        credits.sort_by(|a, b| a.id.cmp(&b.id));
        credits.iter().map(|c| c.seq).collect()
    };
    assert_eq!(
        seqs,
        (1..=20).filter(|&s| s != 5).collect::<Vec<_>>(),
        "applied in order"
    );
    let parked = all_parked(&outbox).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].id, parked_id);
    assert_eq!(parked[0].attempts, 2);
    // The error kept is cut to 8 KB, saying so (the whole text would not
    // fit MySQL/MariaDB's column: the message was then never parked).
    let kept = parked[0].last_error.as_deref().unwrap_or_default();
    assert!(
        kept.starts_with("thirteen is unlucky (and so on)") && kept.ends_with(" more bytes cut)"),
        "{}",
        &kept[kept.len().saturating_sub(60)..]
    );
    assert!(kept.len() < 8300, "{}", kept.len());
    // Retry: applied once the handler accepts it.
    fail_13.store(false, Ordering::SeqCst);
    // A pending message is neither retried nor discarded.
    let unknown = outbox.discard("no-such-id").await.unwrap_err();
    assert!(
        unknown.to_string().contains("no shard's outbox holds it"),
        "{unknown}"
    );
    // On servers: with a shard that does not hold it refusing connections,
    // the message is still retried (an outage is when operators clear
    // parked messages); an id no readable shard holds fails with the down
    // shard's error (it may hold it).
    let holder = cluster.shard_of::<Holder>(&1).await.unwrap().to_owned();
    match dbs.backend.server_address() {
        Some(server) => {
            let down = (0..5).find(|i| format!("s{i}") != holder).unwrap();
            let proxy = Proxy::start(server).await;
            let partial = connect(&toml(dbs, &[(down, proxy.port)])).await;
            proxy.killed().await;
            let partial = partial.outbox().message::<Credit>();
            let unknown = partial.discard("no-such-id").await.unwrap_err();
            assert!(
                matches!(&unknown, ShardError::Unavailable { shard, .. } if *shard == format!("s{down}")),
                "{}",
                unknown.report()
            );
            partial
                .retry(&parked_id)
                .await
                .unwrap_or_else(|e| panic!("retry with s{down} down: {}", e.report()));
        }
        None => outbox.retry(&parked_id).await.unwrap(),
    }
    let err = outbox.retry(&parked_id).await.unwrap_err();
    assert!(err.to_string().contains("not parked"), "{err}");
    assert_eq!(outbox.deliver().await.unwrap().applied, 1);
    assert_eq!(balance(&cluster, 2).await, 19 + 13);
    // Discard: parked, then gone without being applied.
    fail_13.store(true, Ordering::SeqCst);
    let id = send_credit(&cluster, 1, 2, 21, 13).await;
    assert_eq!(outbox.deliver().await.unwrap().parked, 1);
    outbox.discard(&id).await.unwrap();
    assert_eq!(
        outbox.deliver().await.unwrap(),
        shardkit::RelayReport::default()
    );
    assert_eq!(balance(&cluster, 2).await, 32);
    // A handler that panics fails the attempt as an error would: parked
    // after its attempts with the panic's message, nothing applied, and
    // the message sent after it is applied (the relay goes on).
    let id = send_credit(&cluster, 1, 2, 24, 66).await;
    send_credit(&cluster, 1, 2, 25, 1).await;
    let report = outbox.deliver().await.unwrap();
    assert_eq!((report.applied, report.parked), (1, 1), "{report:?}");
    let parked = all_parked(&outbox).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].id, id);
    assert_eq!(
        parked[0].last_error.as_deref(),
        Some("the handler panicked: sixty-six")
    );
    outbox.discard(&id).await.unwrap();
    assert_eq!(balance(&cluster, 2).await, 33);
    // A send in a transaction that read before two other transactions of
    // its key sent and committed goes after their messages. (On
    // MySQL/MariaDB its number came from the read's snapshot, which missed
    // them: it took the first one's number and was applied before the
    // second.) Not on SQLite, whose write transactions take the file's
    // lock at begin: the other two would wait for this one.
    if dbs.backend != Backend::Sqlite {
        let reader = cluster.begin::<Holder>(1).await.unwrap();
        reader.find::<wallet::Entity>().one().await.unwrap();
        send_credit(&cluster, 1, 2, 40, 1).await;
        send_credit(&cluster, 1, 2, 41, 1).await;
        let late = Credit {
            transfer: "t42".into(),
            amount: 1,
            seq: 42,
        };
        reader.send(2, &late).await.unwrap();
        reader.commit().await.unwrap();
        assert_eq!(outbox.deliver().await.unwrap().applied, 3);
        let mut credits = cluster.find::<credit::Entity>().key(2).all().await.unwrap();
        credits.retain(|c| c.seq >= 40);
        credits.sort_by(|a, b| a.id.cmp(&b.id));
        let seqs: Vec<i64> = credits.iter().map(|c| c.seq).collect();
        assert_eq!(seqs, [40, 41, 42], "applied in the order sent");
        assert_eq!(balance(&cluster, 2).await, 36);
    }
    // A message to a key no shard holds (outside every range) counts its
    // attempts like a failed handler and is parked after them, naming the
    // key, instead of being put off for ever.
    let id = cluster
        .transaction::<Holder, _, _>(1, |tx| async move {
            tx.send(NO_SHARD, &Gift { amount: 5 }).await
        })
        .await
        .unwrap();
    let report = outbox.deliver().await.unwrap();
    assert_eq!(
        (report.failed, report.parked, report.deferred),
        (2, 1, 0),
        "{report:?}"
    );
    let parked = all_parked(&outbox).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(
        (parked[0].id.as_str(), parked[0].attempts),
        (id.as_str(), 2)
    );
    assert!(
        parked[0].last_error.as_deref().is_some_and(
            |e| e.starts_with(&format!("cannot route group `Account` key {NO_SHARD}: "))
        ),
        "{:?}",
        parked[0].last_error
    );
    outbox.discard(&id).await.unwrap();
    let status = outbox.status().await.unwrap();
    assert!(
        status
            .shards
            .iter()
            .all(|s| s.pending == 0 && s.parked_count == 0),
        "{status:?}"
    );
    // The metrics count the failed attempts, the parking and the lag.
    assert!(metrics.counter("shardkit_outbox_retries_total{kind=credit}") >= 2);
    assert!(metrics.counter("shardkit_outbox_parked_total{kind=credit}") >= 1);
    assert!(
        metrics
            .samples("shardkit_outbox_delivery_lag_seconds{kind=credit}")
            .len()
            >= 20,
        "{:?}",
        metrics.all_keys()
    );
    // The command line lists a parked message and retries it.
    fail_13.store(true, Ordering::SeqCst);
    let id = send_credit(&cluster, 1, 2, 23, 13).await;
    assert_eq!(outbox.deliver().await.unwrap().parked, 1);
    let shardctl = |args: &'static [&'static str]| {
        let config = ClusterConfig::from_toml(&toml(dbs, &[])).unwrap();
        async move {
            let mut out: Vec<u8> = Vec::new();
            let registry = shardkit::cli::Registry::new().outbox(|o| o.message::<Credit>());
            let argv = ["shardctl", "--json"].iter().chain(args).copied();
            let code = shardkit::cli::run_with(argv, config, registry, &mut out).await;
            (
                code,
                serde_json::from_slice::<serde_json::Value>(&out).unwrap(),
            )
        }
    };
    let (code, status) = shardctl(&["outbox", "status"]).await;
    assert_eq!(code, 1, "a parked message is a problem: {status}");
    let listed: Vec<&str> = status["shards"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["parked"].as_array().unwrap())
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, [id.as_str()]);
    let argv: &'static [&'static str] = Box::leak(Box::new([
        "outbox",
        "discard",
        Box::leak(id.into_boxed_str()),
    ]));
    let (code, out) = shardctl(argv).await;
    assert_eq!(code, 0, "{out}");
    let (code, status) = shardctl(&["outbox", "status"]).await;
    assert_eq!(code, 0, "{status}");
    let (code, sagas) = shardctl(&["saga", "status"]).await;
    assert_eq!((code, sagas), (0, serde_json::json!([])));
    // A message that rolls back with its transaction is never sent.
    let _ = cluster
        .transaction::<Holder, (), _>(1, |tx| async move {
            tx.send(
                2,
                &Credit {
                    transfer: "t22".into(),
                    amount: 1,
                    seq: 22,
                },
            )
            .await?;
            Err(ShardError::Internal {
                what: "rolled back".into(),
            })
        })
        .await;
    assert_eq!(
        outbox.deliver().await.unwrap(),
        shardkit::RelayReport::default()
    );
    // A handler slower than the step timeout: cut off, its transaction
    // rolled back, and put off by the backoff without counting an attempt
    // (not run again back to back, holding the receiving key's rows); put
    // off again, it waits twice as long (it waited 30 s each time).
    let slow = relay(&cluster)
        .step_timeout(Duration::from_millis(300))
        .backoff(Duration::from_secs(30), Duration::from_secs(600))
        .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
            if c.amount == 77 {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            apply_credit(&tx, c).await
        });
    let id = send_credit(&cluster, 1, 2, 26, 77).await;
    let shard = cluster.shard_of::<Holder>(&1).await.unwrap();
    let db = cluster.connection(shard).unwrap();
    let sql = |sql: &str| {
        let sql = match db.get_database_backend() {
            sea_orm::DbBackend::Postgres => sql.replace('?', "$1"),
            _ => sql.to_owned(),
        };
        sea_orm::Statement::from_sql_and_values(db.get_database_backend(), sql, [id.clone().into()])
    };
    let now = || shardkit::Clock::now_millis(cluster.clock().as_ref()) as i64;
    for (round, waits) in [(1, 30_000), (2, 60_000)] {
        let report = slow.deliver().await.unwrap();
        assert_eq!((report.applied, report.deferred), (0, 1), "{report:?}");
        let row = db
            .query_one_raw(sql(
                "SELECT attempts, next_at, last_error FROM shardkit_outbox WHERE id = ?",
            ))
            .await
            .unwrap()
            .expect("the message is pending");
        let attempts: i32 = row.try_get("", "attempts").unwrap();
        let next_at: i64 = row.try_get("", "next_at").unwrap();
        let error: Option<String> = row.try_get("", "last_error").unwrap();
        assert_eq!(attempts, 0);
        let wait = next_at - now();
        assert!(
            wait > waits - 5_000 && wait <= waits,
            "put off {round} time(s): waits {wait} ms"
        );
        assert!(
            error
                .as_deref()
                .is_some_and(|e| e.starts_with("not applied within the step timeout (300ms)")),
            "{error:?}"
        );
        // Due again at once.
        db.execute_raw(sql("UPDATE shardkit_outbox SET next_at = 0 WHERE id = ?"))
            .await
            .unwrap();
    }
    db.execute_raw(sql(
        "UPDATE shardkit_outbox SET next_at = 9000000000000 WHERE id = ?",
    ))
    .await
    .unwrap();
    assert_eq!(
        slow.deliver().await.unwrap(),
        shardkit::RelayReport::default()
    );
    let credited = if dbs.backend == Backend::Sqlite {
        33
    } else {
        36
    };
    assert_eq!(balance(&cluster, 2).await, credited);
    // The inbox keeps ids 7 days. Messages sent 8 days ago (by an instance
    // whose clock says so): one never tried is parked, and so is one last
    // tried 8 days ago (an attempt then may have been applied, its id
    // since pruned; it was applied again); one put off a moment ago is
    // applied. `retry` applies a parked one anyway.
    let past = Arc::new(shardkit::clock::ManualClock::new(
        shardkit::Clock::now_millis(cluster.clock().as_ref()) - 8 * 86_400_000,
    ));
    let old_sender = Cluster::builder(
        ClusterConfig::from_toml(&toml(dbs, &[]).replace("movable = true", "movable = false"))
            .unwrap(),
    )
    .clock(past.clone())
    .connect()
    .await
    .unwrap();
    let never = send_credit(&old_sender, 1, 2, 50, 1).await;
    let long_ago = send_credit(&old_sender, 1, 2, 51, 1).await;
    let lately = send_credit(&old_sender, 1, 2, 52, 1).await;
    let now = shardkit::Clock::now_millis(cluster.clock().as_ref()) as i64;
    let tried_at = shardkit::Clock::now_millis(past.as_ref()) as i64;
    edit_row(
        &cluster,
        "shardkit_outbox",
        &long_ago,
        &format!("attempts = 1, last_error = 'then', next_at = {tried_at}"),
    )
    .await;
    edit_row(
        &cluster,
        "shardkit_outbox",
        &lately,
        &format!("last_error = 'put off', next_at = {}", now - 1000),
    )
    .await;
    // The slow message before them (put off far ahead above) is due, and
    // the scenario's relay applies it first.
    edit_row(&cluster, "shardkit_outbox", &id, "next_at = 0").await;
    let report = outbox.deliver().await.unwrap();
    assert_eq!((report.applied, report.parked), (2, 2), "{report:?}");
    let mut parked: Vec<String> = all_parked(&outbox)
        .await
        .into_iter()
        .map(|p| {
            assert!(
                p.last_error
                    .as_deref()
                    .is_some_and(|e| e.starts_with("sent or last tried more than 7 days ago")),
                "{p:?}"
            );
            p.id
        })
        .collect();
    parked.sort();
    let mut expected = vec![never.clone(), long_ago.clone()];
    expected.sort();
    assert_eq!(parked, expected);
    outbox.retry(&never).await.unwrap();
    assert_eq!(outbox.deliver().await.unwrap().applied, 1);
    outbox.discard(&long_ago).await.unwrap();
    assert_eq!(balance(&cluster, 2).await, credited + 77 + 2);
}

/// One sending key with more messages waiting than a pass reads (its
/// first one failed and backs off for a minute, the rest of its pair wait
/// behind it) holds up neither the keys after it on its shard nor its own
/// messages to another receiver, sent after them (applied in order), also
/// for the running relay while 8 tasks send.
pub(crate) async fn a_sender_with_a_backlog_hides_no_other_sender(dbs: &mut TestDbs) {
    let before = dbs.server_connections().await;
    let cluster = connect(&toml(dbs, &[]).replace("movable = true", "movable = false")).await;
    cluster.migrate::<Migrator>().await.unwrap();
    open_wallet(&cluster, 2, 0).await;
    open_wallet(&cluster, 3, 0).await;
    // A sender after key 1 in the outbox's order, on key 1's shard.
    let shard = cluster.shard_of::<Holder>(&1).await.unwrap().to_owned();
    let mut later = 10;
    while cluster.shard_of::<Holder>(&later).await.unwrap() != shard {
        later += 1;
    }
    // 2,001 messages of key 1 (a pass reads 2,000 per shard), the first
    // of them refused.
    cluster
        .transaction::<Holder, _, _>(1, |tx| async move {
            for seq in 1..=2001 {
                let amount = if seq == 1 { 13 } else { 1 };
                let credit = Credit {
                    transfer: format!("t{seq}"),
                    amount,
                    seq,
                };
                tx.send(2, &credit).await?;
            }
            Ok(())
        })
        .await
        .unwrap();
    send_credit(&cluster, later, 2, 1, 100).await;
    send_credit(&cluster, 1, 3, 1, 50).await;
    send_credit(&cluster, 1, 3, 2, 60).await;
    let outbox = relay(&cluster)
        .backoff(Duration::from_secs(60), Duration::from_secs(60))
        .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
            if c.amount == 13 {
                return Err(shardkit::BoxError::from("thirteen is unlucky"));
            }
            apply_credit(&tx, c).await
        });
    let report = outbox.deliver().await.unwrap();
    assert_eq!((report.applied, report.failed), (3, 1), "{report:?}");
    assert_eq!(balance(&cluster, 2).await, 100, "the later sender's credit");
    assert_eq!(balance(&cluster, 3).await, 110, "key 1's credits to key 3");
    let mut to_three: Vec<credit::Model> =
        cluster.find::<credit::Entity>().key(3).all().await.unwrap();
    // Ids are uuid v7: the order they were applied in.
    to_three.sort_by(|a, b| a.id.cmp(&b.id));
    let order: Vec<i64> = to_three.iter().map(|c| c.seq).collect();
    assert_eq!(order, [1, 2], "key 1's credits to key 3, in order");
    let pending: u64 = outbox
        .status()
        .await
        .unwrap()
        .shards
        .iter()
        .map(|s| s.pending)
        .sum();
    assert_eq!(pending, 2001, "key 1's messages wait, in order");

    // The running relay, while 8 tasks on pools of 2 send: 4 from key 1 to
    // key 3, after its backlog, and 4 from the later key to key 2.
    let running = outbox.clone().poll_every(Duration::from_millis(5)).run();
    let senders: Vec<_> = (0..8)
        .map(|t| {
            let cluster = cluster.clone();
            tokio::spawn(async move {
                let (from, to) = if t < 4 { (1, 3) } else { (later, 2) };
                for n in 0..5 {
                    send_credit(&cluster, from, to, 10 + t * 5 + n, 1).await;
                }
            })
        })
        .collect();
    for sender in senders {
        sender.await.unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while (balance(&cluster, 3).await, balance(&cluster, 2).await) != (130, 120) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the running relay applied {} and {} of 20 credits each",
            balance(&cluster, 3).await - 110,
            balance(&cluster, 2).await - 100
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.stop();
    while !running.is_finished() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Each task's credits, applied in the order it sent them.
    for (to, tasks) in [(3, 0..4), (2, 4..8)] {
        let mut applied: Vec<credit::Model> = cluster
            .find::<credit::Entity>()
            .key(to)
            .all()
            .await
            .unwrap();
        applied.sort_by(|a, b| a.id.cmp(&b.id));
        for t in tasks {
            let sent = 10 + t * 5..15 + t * 5;
            let seqs: Vec<i64> = applied
                .iter()
                .map(|c| c.seq)
                .filter(|seq| sent.contains(seq))
                .collect();
            assert_eq!(seqs, sent.collect::<Vec<_>>(), "task {t}'s credits to {to}");
        }
    }
    drop((outbox, cluster));
    dbs.assert_connections_settle(before).await;
}

/// Relays with different handlers: one that has no handler for a pair's
/// first message does not apply the pair's later ones before another
/// relay applies it.
pub(crate) async fn a_pair_waits_for_its_message_another_relay_applies(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[]).replace("movable = true", "movable = false")).await;
    cluster.migrate::<Migrator>().await.unwrap();
    open_wallet(&cluster, 2, 0).await;
    cluster
        .transaction::<Holder, _, _>(1, |tx| async move {
            tx.send(2, &Memo { amount: 7 }).await?;
            let credit = Credit {
                transfer: "after the memo".to_owned(),
                amount: 100,
                seq: 1,
            };
            tx.send(2, &credit).await
        })
        .await
        .unwrap();
    let credits = cluster
        .outbox()
        .handle::<Credit, _, _, _>(|tx, c: Credit| async move { apply_credit(&tx, c).await });
    let memos = cluster
        .outbox()
        .handle::<Memo, _, _, _>(|tx, m: Memo| async move { add(&tx, m.amount).await });
    let report = credits.deliver().await.unwrap();
    assert_eq!(report.applied, 0, "{report:?}");
    assert_eq!(
        balance(&cluster, 2).await,
        0,
        "the credit waits for the memo"
    );
    assert_eq!(memos.deliver().await.unwrap().applied, 1);
    assert_eq!(balance(&cluster, 2).await, 7);
    assert_eq!(credits.deliver().await.unwrap().applied, 1);
    assert_eq!(balance(&cluster, 2).await, 107);
}

/// A handler that sends a message on, from the key it received on into
/// that key's shard's outbox: one `deliver` applies both, though that
/// shard had nothing to deliver when it was first read.
pub(crate) async fn a_message_a_handler_sends_goes_in_the_same_deliver(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[]).replace("movable = true", "movable = false")).await;
    cluster.migrate::<Migrator>().await.unwrap();
    let first = cluster.shard_of::<Holder>(&1).await.unwrap().to_owned();
    let mut mid = 2;
    while cluster.shard_of::<Holder>(&mid).await.unwrap() == first {
        mid += 1;
    }
    for id in [1, mid] {
        open_wallet(&cluster, id, 0).await;
    }
    let outbox = relay(&cluster).handle::<Credit, _, _, _>(|tx, c: Credit| async move {
        if c.amount == 7 {
            let on = Credit {
                transfer: "forwarded".to_owned(),
                amount: 1,
                seq: 1,
            };
            tx.send(1, &on).await?;
        }
        apply_credit(&tx, c).await
    });
    send_credit(&cluster, 1, mid, 1, 7).await;
    let report = outbox.deliver().await.unwrap();
    assert_eq!(report.applied, 2, "{report:?}");
    assert_eq!(
        (balance(&cluster, mid).await, balance(&cluster, 1).await),
        (7, 1)
    );
}

/// A handler that swallows a failed statement and returns `Ok` on
/// PostgreSQL, whose transaction is then aborted (its COMMIT would roll
/// back without an error): the message is not taken for applied, nothing
/// is credited, and the parked message says why.
pub(crate) async fn a_handler_that_swallows_a_failed_statement_commits_nothing(dbs: &mut TestDbs) {
    let why = parked_at_once(dbs, |cluster| {
        cluster
            .outbox()
            .max_attempts(1)
            .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
                apply_credit(&tx, c).await?;
                let _ignored = tx
                    .unchecked_connection()
                    .execute_unprepared("SELECT * FROM no_such_table")
                    .await;
                Ok::<_, shardkit::BoxError>(())
            })
    })
    .await;
    assert!(
        why.contains("returned Ok on a transaction the database had ended")
            && why.contains("25P02"),
        "{why}"
    );
}

/// Sends one credit from wallet 1 to wallet 2 and delivers it through
/// `relay`'s outbox, whose handler fails: nothing is credited, the message
/// is parked at once; its last error.
pub(crate) async fn parked_at_once(
    dbs: &TestDbs,
    relay: fn(&Cluster) -> shardkit::Outbox,
) -> String {
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 0).await;
    }
    let outbox = relay(&cluster);
    let id = send_credit(&cluster, 1, 2, 1, 5).await;
    let report = outbox.deliver().await.unwrap();
    assert_eq!((report.applied, report.parked), (0, 1), "{report:?}");
    assert_eq!(balance(&cluster, 2).await, 0, "nothing credited");
    let parked = all_parked(&outbox).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].id, id);
    parked[0].last_error.clone().unwrap_or_default()
}

/// A message applied before whose sender's row was not deleted then (the
/// relay stopped between the two) is delivered again; its handler refuses
/// it, having done the work ("already credited", as a unique transfer id
/// would). It is a duplicate, deleted, not a failure counted and parked
/// (on PostgreSQL, where the inbox row is checked after the handler, it
/// was parked with the handler's error).
pub(crate) async fn a_message_applied_before_that_its_handler_refuses_is_not_parked(
    dbs: &mut TestDbs,
) {
    use sea_orm::{ColumnTrait, QueryFilter};
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 0).await;
    }
    let outbox =
        cluster
            .outbox()
            .max_attempts(1)
            .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
                let done = tx
                    .find::<credit::Entity>()
                    .filter(credit::Column::Transfer.eq(c.transfer.clone()))
                    .one()
                    .await?;
                if done.is_some() {
                    return Err(format!("transfer {} already credited", c.transfer).into());
                }
                apply_credit(&tx, c).await
            });
    let id = send_credit(&cluster, 1, 2, 1, 5).await;
    {
        let _turn = FAILPOINTS.lock().await;
        fail::cfg(
            "shardkit::outbox::after_apply",
            &format!("return({})", dbs.scope()),
        )
        .unwrap();
        let stopped = outbox.deliver().await;
        fail::remove("shardkit::outbox::after_apply");
        stopped.unwrap();
    }
    assert_eq!(balance(&cluster, 2).await, 5, "applied once");
    let again = outbox.deliver().await.unwrap();
    assert_eq!(
        (again.applied, again.duplicates, again.parked),
        (0, 1, 0),
        "{again:?}"
    );
    assert_eq!(balance(&cluster, 2).await, 5, "applied once");
    assert!(all_parked(&outbox).await.is_empty());
    let status = outbox.status().await.unwrap();
    let pending: u64 = status.shards.iter().map(|s| s.pending).sum();
    assert_eq!(pending, 0, "message {id} still pending: {status:?}");
}

/// A message whose sending key this release cannot read (the group's key
/// type changed between releases; here the row's key text is set by hand)
/// is applied once and its row deleted on the shard it was read from: the
/// row used to be deleted in a transaction of its key, which could not
/// begin, so the message was found a duplicate again at every pass, with a
/// debug line only. (Such a key has no bucket a move could take.)
pub(crate) async fn a_message_whose_sending_key_cannot_be_read_is_applied_once(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 0).await;
    }
    let id = send_credit(&cluster, 1, 2, 1, 5).await;
    let shard = cluster.shard_of::<Holder>(&1).await.unwrap().to_owned();
    cluster
        .connection(&shard)
        .unwrap()
        .execute_unprepared(&format!(
            "UPDATE shardkit_outbox SET key_text = 'not-a-key' WHERE id = '{id}'"
        ))
        .await
        .unwrap();
    let outbox = relay(&cluster);
    let report = outbox.deliver().await.unwrap();
    assert_eq!(
        (report.applied, report.duplicates, report.parked),
        (1, 0, 0),
        "{report:?}"
    );
    assert_eq!(balance(&cluster, 2).await, 5);
    let again = outbox.deliver().await.unwrap();
    assert_eq!((again.applied, again.duplicates), (0, 0), "{again:?}");
    assert_eq!(balance(&cluster, 2).await, 5, "applied once");
    assert!(all_parked(&outbox).await.is_empty());
    let status = outbox.status().await.unwrap();
    let pending: u64 = status.shards.iter().map(|s| s.pending).sum();
    assert_eq!(pending, 0, "{status:?}");
}

/// A handler that swallows a refusal of shardkit's (a write of another
/// key's row, which leaves its transaction rollback-only) and returns `Ok`:
/// nothing is committed, and the delivery is a failure counted and parked
/// with the reason, not put off at every pass for good. (Its relay's
/// durations are `Duration::MAX`, "no bound": taken as a year, they
/// panicked computing a deadline.)
pub(crate) async fn a_handler_that_swallows_a_refusal_is_parked(dbs: &mut TestDbs) {
    let why = parked_at_once(dbs, |cluster| {
        cluster
            .outbox()
            .max_attempts(1)
            .step_timeout(Duration::MAX)
            .backoff(Duration::MAX, Duration::MAX)
            .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
                apply_credit(&tx, c).await?;
                let _ignored = tx
                    .insert(wallet::ActiveModel {
                        id: Set(*tx.key() + 1000),
                        balance: Set(1),
                    })
                    .await;
                Ok::<_, shardkit::BoxError>(())
            })
    })
    .await;
    assert!(why.contains("rollback-only"), "{why}");
}
