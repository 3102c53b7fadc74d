//! Moves under control and under faults: overlapping plans, `shardctl`, a
//! target shard that refuses connections or hangs.

use super::*;

pub(crate) async fn overlapping_moves_are_refused_and_plans_are_minimal(dbs: &mut TestDbs) {
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
pub(crate) async fn shardctl(dbs: &TestDbs, args: &[&str]) -> (u8, serde_json::Value) {
    shardctl_with(config(dbs, 20), args).await
}

pub(crate) async fn shardctl_with(config: ClusterConfig, args: &[&str]) -> (u8, serde_json::Value) {
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

pub(crate) async fn shardctl_plans_starts_resumes_and_aborts_moves(dbs: &mut TestDbs) {
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
pub(crate) fn config_through(dbs: &TestDbs, port: u16) -> ClusterConfig {
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

pub(crate) async fn a_target_that_refuses_or_hangs_stops_the_mover_and_leaks_nothing(
    dbs: &mut TestDbs,
) {
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
pub(crate) async fn until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..6_000 {
        if done() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("gave up waiting: {what}");
}

/// Waits until the writer acknowledged a new write of one of `keys`.
pub(crate) async fn written_again(acked: &Shared, keys: &[i64], what: &str) {
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
