//! Transfers between 1,000 accounts through the outbox under faults, and
//! the relay process the scenario kills.

use super::*;

pub(crate) async fn seed(cluster: &Cluster) {
    cluster.migrate::<Migrator>().await.unwrap();
    let mut tasks = Vec::new();
    for part in 0..4 {
        let c = cluster.clone();
        tasks.push(tokio::spawn(async move {
            for id in (1..=ACCOUNTS).filter(|i| i % 4 == part) {
                open_wallet(&c, id, START).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Debits `from` and sends the credit to `to`, in one transaction of
/// `from`; the transfer id when it committed.
pub(crate) async fn transfer_as(
    cluster: &Cluster,
    id: String,
    from: i64,
    to: i64,
    amount: i64,
) -> Result<String, ShardError> {
    let t = id.clone();
    cluster
        .transaction::<Holder, _, _>(from, |tx| {
            let t = t.clone();
            async move {
                let w = tx
                    .find::<wallet::Entity>()
                    .lock_exclusive()
                    .one()
                    .await?
                    .expect("wallet");
                tx.update(wallet::ActiveModel {
                    id: Set(from),
                    balance: Set(w.balance - amount),
                })
                .await?;
                tx.send(
                    to,
                    &Credit {
                        transfer: t,
                        amount,
                        seq: 0,
                    },
                )
                .await?;
                Ok(())
            }
        })
        .await?;
    Ok(id)
}

/// Sums of every shard's rows of the owners' buckets: balances, credits
/// per transfer, outbox debits pending, parked messages.
pub(crate) struct Books {
    balances: i64,
    credits: BTreeMap<String, usize>,
    pending: i64,
    parked: usize,
}

pub(crate) async fn books(cluster: &Cluster) -> Books {
    let wallets = cluster
        .find::<wallet::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    let credits = cluster
        .find::<credit::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    let mut by_transfer = BTreeMap::new();
    for c in &credits {
        *by_transfer.entry(c.transfer.clone()).or_insert(0) += 1;
    }
    let mut pending = 0;
    let mut parked = 0;
    let mut seen = BTreeSet::new();
    for name in cluster
        .topology()
        .shard_names()
        .map(str::to_owned)
        .collect::<Vec<_>>()
    {
        let db = cluster.connection(&name).unwrap();
        let rows = db
            .query_all_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT id, key_text, payload, state FROM shardkit_outbox",
            ))
            .await
            .unwrap();
        for r in rows {
            let id: String = r.try_get("", "id").unwrap();
            let key: String = r.try_get("", "key_text").unwrap();
            let owner = cluster
                .shard_of_now::<Holder>(&key.parse().unwrap())
                .unwrap()
                .unwrap();
            if owner != name || !seen.insert(id) {
                continue;
            }
            let payload: String = r.try_get("", "payload").unwrap();
            let c: Credit = serde_json::from_str(&payload).unwrap();
            // Applied by a relay that stopped before deleting it.
            if !by_transfer.contains_key(&c.transfer) {
                pending += c.amount;
            }
            parked += usize::from(r.try_get::<String>("", "state").unwrap() == "parked");
        }
    }
    Books {
        balances: wallets.iter().map(|w| w.balance).sum(),
        credits: by_transfer,
        pending,
        parked,
    }
}

/// Transfer id → (from, to, amount), every transfer attempted.
pub(crate) type Tried = BTreeMap<String, (i64, i64, i64)>;

/// Prints the wallets whose balance is not what the credits and the
/// outbox say it should be.
pub(crate) async fn explain(cluster: &Cluster, tried: &Tried) {
    let credits = cluster
        .find::<credit::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    let credited: BTreeSet<String> = credits.iter().map(|c| c.transfer.clone()).collect();
    let mut outbox = BTreeSet::new();
    for name in cluster
        .topology()
        .shard_names()
        .map(str::to_owned)
        .collect::<Vec<_>>()
    {
        let db = cluster.connection(&name).unwrap();
        for r in db
            .query_all_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT payload FROM shardkit_outbox",
            ))
            .await
            .unwrap()
        {
            let c: Credit =
                serde_json::from_str(&r.try_get::<String>("", "payload").unwrap()).unwrap();
            outbox.insert(c.transfer);
        }
    }
    let mut expect: BTreeMap<i64, i64> = (1..=ACCOUNTS).map(|i| (i, START)).collect();
    for (id, (from, to, amount)) in tried {
        if credited.contains(id) || outbox.contains(id) {
            *expect.get_mut(from).unwrap() -= amount;
        }
        if credited.contains(id) {
            *expect.get_mut(to).unwrap() += amount;
        }
    }
    for w in cluster
        .find::<wallet::Entity>()
        .scatter()
        .all()
        .await
        .unwrap()
    {
        if expect[&w.id] != w.balance {
            let bucket = shardkit::ShardKey::partition_hash(&w.id) % u64::from(BUCKETS);
            eprintln!(
                "wallet {} (bucket {bucket}, on {:?}): {} expected {}; transfers {:?}",
                w.id,
                cluster.shard_of_now::<Holder>(&w.id),
                w.balance,
                expect[&w.id],
                tried
                    .iter()
                    .filter(|(_, (f, t, _))| *f == w.id || *t == w.id)
                    .map(|(id, x)| (id, x, credited.contains(id), outbox.contains(id)))
                    .collect::<Vec<_>>()
            );
        }
    }
}

/// Delivers until no message is pending (at most `within`).
pub(crate) async fn drain(outbox: &shardkit::Outbox, cluster: &Cluster, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        outbox.deliver().await.unwrap();
        let status = outbox.status().await.unwrap();
        let left: u64 = status.shards.iter().map(|s| s.pending).sum();
        if left == 0 || tokio::time::Instant::now() > deadline {
            assert_eq!(left, 0, "messages still pending: {status:?}");
            let _ = cluster;
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) const CHILD: &str = "SHARDKIT_OUTBOX_CHILD_CONFIG";

/// 16 tasks transfer between accounts on different keys while two
/// instances relay (one with relays dying after applying, before
/// deleting), another process relays and is killed with SIGKILL, a
/// quarter of the buckets move, and (on servers) one shard refuses
/// connections for a while and another hangs. Afterwards: balances plus
/// undelivered debits equal the start, then every acknowledged transfer
/// is credited exactly once, nothing is parked, nothing leaked.
pub(crate) async fn transfers_keep_the_money_under_faults_and_a_move(dbs: &mut TestDbs) {
    let _fp = FAILPOINTS.lock().await;
    let plain = toml(dbs, &[]);
    let b = connect(&plain).await;
    seed(&b).await;
    let servers = dbs.backend != Backend::Sqlite;
    let target = dbs.backend.server_address().unwrap_or_default();
    let (refusing, hanging) = if servers {
        (
            Some(Proxy::start(target.clone()).await),
            Some(Proxy::start(target.clone()).await),
        )
    } else {
        (None, None)
    };
    let through: Vec<(usize, u16)> = [(1, &refusing), (2, &hanging)]
        .into_iter()
        .filter_map(|(i, p)| p.as_ref().map(|p| (i, p.port)))
        .collect();
    let faulty = toml(dbs, &through);
    let a = connect(&faulty).await;
    let before = dbs.server_connections().await;

    // Relays: one per instance, the faulty instance's dying after applying
    // one message in five.
    fail::cfg(
        "shardkit::outbox::after_apply",
        &format!("20%return({})", dbs.scope()),
    )
    .unwrap();
    let relay_a = relay(&a).poll_every(Duration::from_millis(10)).run();
    let relay_b = relay(&b).poll_every(Duration::from_millis(10)).run();

    // Another process relays and is killed with SIGKILL while it does.
    let exe = std::env::current_exe().unwrap();
    let name = match dbs.backend {
        Backend::Sqlite => "child_relay::sqlite",
        Backend::Postgres => "child_relay::postgres",
        Backend::MySql => "child_relay::mysql",
    };
    let mut child = std::process::Command::new(exe)
        .args([name, "--exact", "--test-threads", "1"])
        .env(CHILD, &plain)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();

    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let tried: Arc<Mutex<Tried>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..16i64 {
        let (c, acked, stop) = (
            if t % 2 == 0 { a.clone() } else { b.clone() },
            acked.clone(),
            stop.clone(),
        );
        let tried = tried.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = t * 7919;
            while !stop.load(Ordering::SeqCst) {
                n = (n * 1_103_515_245 + 12_345) % 2_147_483_648;
                let from = n % ACCOUNTS + 1;
                let to = (n / ACCOUNTS) % ACCOUNTS + 1;
                if from == to {
                    continue;
                }
                // A transfer the shard refused, or whose commit is unknown
                // (a lost connection during it), is not acknowledged.
                let id = shardkit::uuid_v7().to_string();
                tried
                    .lock()
                    .unwrap()
                    .insert(id.clone(), (from, to, 1 + n % 10));
                if let Ok(id) = transfer_as(&c, id, from, to, 1 + n % 10).await {
                    acked.lock().unwrap().push(id);
                }
            }
        }));
    }

    // A quarter of the buckets move to s4 meanwhile.
    let mover = b
        .rebalance::<Holder>()
        .unwrap()
        .entity::<wallet::Entity>()
        .entity::<credit::Entity>();
    let quarter: Vec<u32> = (0..BUCKETS).filter(|b| b % 4 == 1).collect();
    let plan = mover.plan_buckets(quarter, "s4").await.unwrap();
    let started = mover.start(&plan).await.unwrap();
    let moving = tokio::spawn({
        let mover = mover.clone();
        async move { mover.run(started.id).await }
    });

    tokio::time::sleep(Duration::from_millis(600)).await;
    let _ = child.kill();
    let _ = child.wait();
    if let (Some(refusing), Some(hanging)) = (&refusing, &hanging) {
        refusing.kill();
        hanging.freeze();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        hanging.kill();
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Both come back on their ports.
        let r = Proxy::start_on(refusing.port, target.clone()).await;
        let h = Proxy::start_on(hanging.port, target.clone()).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        stop.store(true, Ordering::SeqCst);
        for t in tasks.drain(..) {
            t.await.unwrap();
        }
        std::mem::forget((r, h));
    } else {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.store(true, Ordering::SeqCst);
        for t in tasks.drain(..) {
            t.await.unwrap();
        }
    }
    let moved = moving
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("the move: {}", e.report()));
    assert_eq!(moved.phase, shardkit::rebalance::MovePhase::Done);
    a.refresh_bucket_maps().await.unwrap();
    b.refresh_bucket_maps().await.unwrap();

    // With the relays stopped mid-flight: the balances and the debits not
    // applied yet add up to the start.
    relay_a.stop();
    relay_b.stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    fail::remove("shardkit::outbox::after_apply");
    let mid = books(&b).await;
    if mid.balances + mid.pending != ACCOUNTS * START {
        let tried = tried.lock().unwrap().clone();
        explain(&b, &tried).await;
    }
    assert_eq!(
        mid.balances + mid.pending,
        ACCOUNTS * START,
        "money created or lost in flight"
    );
    let outbox = relay(&b);
    drain(&outbox, &b, Duration::from_secs(30)).await;

    let end = books(&b).await;
    assert_eq!(end.balances, ACCOUNTS * START, "the money invariant");
    assert_eq!((end.pending, end.parked), (0, 0));
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() > 100, "only {} transfers made", acked.len());
    for id in &acked {
        assert_eq!(end.credits.get(id), Some(&1), "transfer {id} credited once");
    }
    // Credits of transfers whose commit was unknown to the sender are
    // real transfers too; none is credited twice.
    assert!(
        end.credits.values().all(|&n| n == 1),
        "a transfer credited twice"
    );
    let statuses = outbox.status().await.unwrap();
    assert!(
        statuses
            .shards
            .iter()
            .all(|s| s.parked_count == 0 && s.error.is_none()),
        "{statuses:?}"
    );

    // Every row on its owner.
    for c in b.find::<credit::Entity>().scatter().all().await.unwrap() {
        let owner = b
            .shard_of_now::<Holder>(&c.wallet_id)
            .unwrap()
            .unwrap()
            .to_owned();
        let there = b
            .find::<credit::Entity>()
            .key(c.wallet_id)
            .all()
            .await
            .unwrap();
        assert!(
            there.iter().any(|x| x.id == c.id),
            "credit {} not on {owner}",
            c.id
        );
    }

    drop((relay_a, relay_b, outbox, mover));
    drop(a);
    drop(refusing);
    drop(hanging);
    dbs.assert_connections_settle(before + 12).await;
    drop(b);
}

/// The other process of the scenario above: relays until it is killed.
pub(crate) async fn child_relay(_dbs: &mut TestDbs) {
    let Ok(toml) = std::env::var(CHILD) else {
        return;
    };
    let cluster = connect(&toml).await;
    let _relay = relay(&cluster).poll_every(Duration::from_millis(5)).run();
    tokio::time::sleep(Duration::from_secs(60)).await;
}
