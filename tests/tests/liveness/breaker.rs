//! The circuit breaker under short network cuts and under a shard that
//! stays down: a shard back from a cut serves the first request that needs
//! it (the request probes it, half-open), and a shard that refuses or hangs
//! fails requests at once, one probe at a time, without leaking connections.

use sea_orm::ActiveValue::Set;
use shardkit::{Cluster, ClusterConfig, ManualClock, ShardError};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, Hung, Proxy, TestDbs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A key of `Customer` that lives on `shard`.
async fn key_on(cluster: &Cluster, shard: &str) -> i64 {
    let mut key = 0_i64;
    loop {
        key += 1;
        if cluster.shard_of::<Customer>(&key).await.unwrap() == shard {
            return key;
        }
    }
}

/// A config whose shard s1 is at `url` (s0 is the test's first database).
fn config_with_s1(dbs: &TestDbs, pool: &str, url: &str) -> ClusterConfig {
    let healthy = dbs.shards_toml_with(1, pool, &[]);
    let toml =
        format!("{healthy}\n[[shards]]\nname = \"s1\"\nurl = \"{url}\"\n\n[groups.Customer]\n");
    ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("config: {e}\n{toml}"))
}

/// The URL of the test's second database through a proxy on `port`.
fn proxied_url(dbs: &TestDbs, port: u16) -> String {
    match dbs.backend {
        Backend::MySql => format!("mysql://root@127.0.0.1:{port}/{}", dbs.names[1]),
        _ => format!("postgres://postgres@127.0.0.1:{port}/{}", dbs.names[1]),
    }
}

/// Inserts customer `key` named `name`.
async fn insert(cluster: &Cluster, key: i64, name: &str) {
    let tx = cluster.begin::<Customer>(key).await.unwrap();
    tx.insert(customer::ActiveModel {
        id: Set(key),
        name: Set(name.into()),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// Asserts `err` is `Unavailable` for s1 with a cause that contains `says`.
fn assert_unavailable(err: &ShardError, says: &str) {
    match err {
        ShardError::Unavailable { shard, cause } => {
            assert_eq!(shard, "s1");
            assert!(cause.to_lowercase().contains(says), "{cause}");
        }
        other => panic!("expected Unavailable for s1, got {other:?}"),
    }
}

/// Once the cluster and the proxy are dropped, the server holds no more
/// connections than `before`.
async fn assert_no_connection_left(dbs: &TestDbs, before: usize) {
    let after = dbs.settle_connections(before, Duration::from_secs(5)).await;
    assert!(
        after <= before,
        "server connections: {before} before, {after} after"
    );
}

/// How long after the proxy listens again the shard must serve requests.
const RECOVER: Duration = Duration::from_millis(250);

/// One read: when it was issued and ended (since the start), and how.
struct Op {
    issued: Duration,
    ended: Duration,
    error: Option<ShardError>,
}

/// Four readers read one row of s1 every 2 ms while s1's proxy is cut for
/// 150 ms every 500 ms, eight times. Every failure overlaps a cut (or the
/// first moments after it: [`RECOVER`]); after each cut the shard serves
/// reads again within [`RECOVER`], and no read issued after the first one
/// it served fails; nothing stays connected once the cluster is dropped.
pub(crate) async fn short_cuts_fail_requests_only_until_the_shard_answers(dbs: &mut TestDbs) {
    let server = dbs.backend.server_address().unwrap();
    let before = dbs.server_connections().await;
    let mut proxy = Proxy::start(server.clone()).await;
    let port = proxy.port;
    let config = config_with_s1(dbs, "connect_timeout_secs = 2\n", &proxied_url(dbs, port));
    let cluster = Cluster::connect(config).await.unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let key = key_on(&cluster, "s1").await;
    insert(&cluster, key, "cut").await;

    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let cluster = cluster.clone();
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let mut ops = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let issued = started.elapsed();
                    let read = cluster.find::<customer::Entity>().key(key).one().await;
                    let ended = started.elapsed();
                    let error = match read {
                        Ok(Some(row)) => {
                            assert_eq!(row.name, "cut");
                            None
                        }
                        Ok(None) => panic!("row {key} missing"),
                        Err(err) => Some(err),
                    };
                    ops.push(Op {
                        issued,
                        ended,
                        error,
                    });
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                ops
            })
        })
        .collect();
    // (cut, restored), since the start.
    let mut cuts = Vec::new();
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(350)).await;
        let cut = started.elapsed();
        proxy.kill();
        tokio::time::sleep(Duration::from_millis(150)).await;
        proxy = Proxy::start_on(port, server.clone()).await;
        cuts.push((cut, started.elapsed()));
    }
    tokio::time::sleep(Duration::from_millis(350)).await;
    stop.store(true, Ordering::Relaxed);
    let mut ops = Vec::new();
    for reader in readers {
        ops.extend(reader.await.unwrap());
    }
    ops.sort_by_key(|op| op.issued);
    let failed: Vec<&Op> = ops.iter().filter(|op| op.error.is_some()).collect();
    println!(
        "{:?}: {} of {} reads succeeded under 8 cuts of 150 ms ({} failed)",
        dbs.backend,
        ops.len() - failed.len(),
        ops.len(),
        failed.len()
    );
    let mut kinds = std::collections::BTreeMap::new();
    for op in &failed {
        let err = op.error.as_ref().unwrap();
        let kind = match err {
            ShardError::Unavailable { cause, .. } => format!("Unavailable: {cause}"),
            other => format!("{other:?}"),
        };
        *kinds.entry(kind).or_insert(0) += 1;
    }
    println!("{:?}: failures: {kinds:#?}", dbs.backend);

    for (i, &(cut, restored)) in cuts.iter().enumerate() {
        let next_cut = cuts.get(i + 1).map_or(Duration::MAX, |c| c.0);
        let served = ops
            .iter()
            .find(|op| op.issued >= restored && op.error.is_none())
            .unwrap_or_else(|| panic!("no read served after cut {i}"));
        assert!(
            served.issued < restored + RECOVER,
            "cut {i} ({cut:?}..{restored:?}): the first read served was issued at {:?}",
            served.issued
        );
        let late: Vec<_> = ops
            .iter()
            .filter(|op| op.issued >= served.issued && op.ended < next_cut && op.error.is_some())
            .map(|op| (op.issued, op.error.as_ref().unwrap().to_string()))
            .collect();
        assert!(
            late.is_empty(),
            "cut {i}: reads failed after the shard served one at {:?}: {late:?}",
            served.issued
        );
    }
    // Refused while down; or a read in flight on a connection the cut
    // closed (at most one per reader and cut).
    let refused = "error communicating with database: Connection refused (os error 111)";
    let mut lost = 0;
    for op in &failed {
        match op.error.as_ref().unwrap() {
            ShardError::Unavailable { shard, cause } if shard == "s1" && cause == refused => {}
            ShardError::Db {
                shard,
                operation,
                source: sea_orm::DbErr::Query(_) | sea_orm::DbErr::Conn(_),
                ..
            } if shard == "s1" && operation == "select customers" => lost += 1,
            other => panic!("unexpected failure: {other:?}"),
        }
        assert!(
            cuts.iter()
                .any(|&(cut, restored)| op.ended >= cut && op.issued < restored + RECOVER),
            "a read issued at {:?} failed outside every cut: {:?}",
            op.issued,
            op.error
        );
    }
    assert!(lost <= 4 * cuts.len(), "{lost} reads lost their connection");

    drop(cluster);
    drop(proxy);
    assert_no_connection_left(dbs, before).await;
}

/// Eight readers on spawned tasks wait on s1 (a pool of 2) when it starts
/// refusing, and again when it accepts and never answers (its proxy
/// frozen: the pooled connections stay open, nothing comes back), once with
/// the pool's ping before each acquire and once without it. Every reader
/// fails with the probe's cause (the refusal; no answer within the connect
/// timeout), within the watch's 150 ms plus the probe; the watch then ends
/// (it must not go round for readers it failed while they leave), and
/// nothing stays connected.
///
/// Nothing but the watch ends these waits that fast: refusing, the pool
/// gives up on new connections only after the connect timeout; frozen
/// with the ping, a reader that takes a pooled connection waits for the
/// ping's answer, and without it, for its statement's (bounded by nothing
/// else); the others wait for those connections.
/// (With the watch task disabled, the refusing round fails with `a reader
/// took 1.00 s`, and each frozen one with the readers still waiting after
/// 20 s.)
pub(crate) async fn waiting_readers_fail_together_when_the_watch_finds_the_shard_down(
    dbs: &mut TestDbs,
) {
    // (whether s1 hangs or refuses, the pool's settings, what the cause
    // says, how long a reader may take: 150 ms, then the probe, refused at
    // once or bounded by the 1 s connect timeout)
    let pinged = "connect_timeout_secs = 1\n";
    let unpinged = "connect_timeout_secs = 1\ntest_before_acquire = false\n";
    let faults = [
        (false, pinged, "refused", 1),
        (true, pinged, "within 1000 ms", 3),
        (true, unpinged, "within 1000 ms", 3),
    ];
    for (frozen, pool, says, within) in faults {
        let server = dbs.backend.server_address().unwrap();
        let before = dbs.server_connections().await;
        let proxy = Proxy::start(server.clone()).await;
        let healthy = dbs
            .shards_toml_with(1, pool, &[])
            .replace("max_connections = 4", "max_connections = 2");
        let url = proxied_url(dbs, proxy.port);
        let toml =
            format!("{healthy}\n[[shards]]\nname = \"s1\"\nurl = \"{url}\"\n\n[groups.Customer]\n");
        let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
            .await
            .unwrap();
        cluster.migrate::<Migrator>().await.unwrap();
        let key = key_on(&cluster, "s1").await;
        // (The row is there from the first fault's round on.)
        if cluster
            .find::<customer::Entity>()
            .key(key)
            .one()
            .await
            .unwrap()
            .is_none()
        {
            insert(&cluster, key, "watched").await;
        }

        if frozen {
            proxy.freeze();
        } else {
            proxy.killed().await;
        }
        let readers: Vec<_> = (0..8)
            .map(|_| {
                let cluster = cluster.clone();
                tokio::spawn(async move {
                    let t = Instant::now();
                    let read = cluster.find::<customer::Entity>().key(key).one().await;
                    (read, t.elapsed())
                })
            })
            .collect();
        // A bound on the whole, so that a watch that keeps a worker busy (or
        // a reader nobody watches) fails the scenario instead of hanging it.
        let ended =
            tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(readers))
                .await
                .unwrap_or_else(|_| panic!("{says}: the readers are still waiting after 20 s"));
        for ended in ended {
            let (read, took) = ended.unwrap();
            assert_unavailable(&read.unwrap_err(), says);
            assert!(
                took < Duration::from_secs(within),
                "{says}: a reader took {took:?}"
            );
        }

        drop(cluster);
        drop(proxy);
        assert_no_connection_left(dbs, before).await;
    }
}

/// s1 refuses (its proxy killed) and stays so: the first read fails with
/// the cause once the probe finds the shard down, and every later request
/// at once. The cluster's clock decides when the next probe is due: while
/// it stands, requests fail without I/O, also once the shard is back; once
/// it moves on, the next request probes, finds the shard up and succeeds.
pub(crate) async fn a_refused_shard_fails_fast_and_the_probing_request_succeeds(dbs: &mut TestDbs) {
    let server = dbs.backend.server_address().unwrap();
    let before = dbs.server_connections().await;
    let proxy = Proxy::start(server.clone()).await;
    let port = proxy.port;
    let clock = Arc::new(ManualClock::starting_now());
    let config = config_with_s1(dbs, "connect_timeout_secs = 2\n", &proxied_url(dbs, port));
    let cluster = Cluster::builder(config)
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let key = key_on(&cluster, "s1").await;
    insert(&cluster, key, "back").await;
    let read = || cluster.find::<customer::Entity>().key(key).one();

    // Every pooled connection closed by the time the read runs: it finds
    // the shard refusing, not a connection still open.
    proxy.killed().await;
    let t = Instant::now();
    let err = read().await.unwrap_err();
    let first = t.elapsed();
    assert_unavailable(&err, "refused");
    assert!(first < Duration::from_secs(1), "first read took {first:?}");

    // Down, no probe due: at once.
    let t = Instant::now();
    for _ in 0..20 {
        assert_unavailable(&read().await.unwrap_err(), "refused");
        assert_unavailable(
            &cluster.begin::<Customer>(key).await.unwrap_err(),
            "refused",
        );
    }
    let fast = t.elapsed();
    assert!(
        fast < Duration::from_millis(500),
        "40 requests took {fast:?}"
    );

    // A probe due: the request probes, the shard still refuses.
    clock.advance(Duration::from_secs(1));
    let t = Instant::now();
    assert_unavailable(&read().await.unwrap_err(), "refused");
    let probing = t.elapsed();
    assert!(probing < Duration::from_secs(1), "took {probing:?}");

    // Back, but no probe due yet: still failing fast.
    let _proxy = Proxy::start_on(port, server).await;
    assert_unavailable(&read().await.unwrap_err(), "refused");
    // Due: the request that probes is served.
    clock.advance(Duration::from_secs(1));
    let t = Instant::now();
    let row = read().await.unwrap().unwrap();
    let back = t.elapsed();
    assert_eq!(row.name, "back");
    println!(
        "{:?}: refused: first read {first:?}, 40 requests once down {fast:?}, probing read \
         {probing:?}, read that probed the shard back {back:?}",
        dbs.backend
    );
    for _ in 0..5 {
        assert_eq!(read().await.unwrap().unwrap().name, "back");
    }

    drop(cluster);
    let after = dbs.settle_connections(before, Duration::from_secs(5)).await;
    assert!(
        after <= before,
        "server connections: {before} before, {after} after"
    );
}

/// s1 accepts connections and never answers (connect timeout 1 s): the
/// first request fails after the connect timeout, later ones at once and
/// without a connection. A request that finds a probe due starts it and
/// waits at most 150 ms for it; requests while it runs fail at once, and
/// no second probe starts: one connection per probe, each closed.
pub(crate) async fn a_hung_shard_fails_fast_one_probe_at_a_time(dbs: &mut TestDbs) {
    let hung = Hung::start().await;
    let clock = Arc::new(ManualClock::starting_now());
    let pool = "connect_timeout_secs = 1\nconnect_lazy = true\n";
    let cluster = Cluster::builder(config_with_s1(dbs, pool, &hung.url(dbs.backend)))
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
    let key = key_on(&cluster, "s1").await;
    let says = "within 1000 ms";
    let t = Instant::now();
    let err = cluster.begin::<Customer>(key).await.unwrap_err();
    let first = t.elapsed();
    assert_unavailable(&err, says);
    assert!(first < Duration::from_secs(5), "first begin took {first:?}");
    // The probe's and the pool's connections close.
    wait_until_closed(&hung).await;

    let accepted = hung.accepted();
    let t = Instant::now();
    for _ in 0..20 {
        let err = cluster.find::<customer::Entity>().key(key).one().await;
        assert_unavailable(&err.unwrap_err(), says);
    }
    let fast = t.elapsed();
    assert!(fast < Duration::from_millis(500), "20 reads took {fast:?}");
    assert_eq!(hung.accepted(), accepted, "failing fast opened connections");

    // Due: one request starts the probe and waits for it 150 ms.
    clock.advance(Duration::from_secs(1));
    let t = Instant::now();
    let err = cluster.begin::<Customer>(key).await.unwrap_err();
    let probing = t.elapsed();
    assert_unavailable(&err, says);
    assert!(probing < Duration::from_millis(500), "took {probing:?}");
    // While it runs (for the connect timeout), requests fail at once.
    let t = Instant::now();
    for _ in 0..20 {
        let err = cluster.find::<customer::Entity>().key(key).one().await;
        assert_unavailable(&err.unwrap_err(), says);
    }
    let during = t.elapsed();
    assert!(
        during < Duration::from_millis(500),
        "20 reads took {during:?}"
    );
    assert_eq!(hung.accepted(), accepted + 1, "one probe, one connection");
    wait_until_closed(&hung).await;
    // Over: still no probe due on the clock, nothing opened.
    assert_unavailable(&cluster.begin::<Customer>(key).await.unwrap_err(), says);
    assert_eq!(hung.accepted(), accepted + 1);
    println!(
        "{:?}: hung: first begin {first:?}, 20 reads once down {fast:?}, probing begin \
         {probing:?}, 20 reads while it probes {during:?}",
        dbs.backend
    );
    drop(cluster);
    wait_until_closed(&hung).await;
}

/// Waits (polling, at most 5 s) until nothing is connected to `hung`.
async fn wait_until_closed(hung: &Hung) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while hung.open() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} connections stay open",
            hung.open()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
