//! Read replicas against real replicated servers (`scripts/replicas.sh
//! start`: a PostgreSQL 15 primary with a streaming replica, a MariaDB
//! primary with a GTID replica). The scenarios of a pair that cannot be
//! reached are ignored, or fail with `CI=true`.
//!
//! Each scenario makes its own databases on the primary (the replica gets
//! them through replication) and drops them at the end.

use libtest_mimic::{Arguments, Trial};
use sea_orm::{ActiveValue::Set, ConnectionTrait, DbBackend};
use shardkit::{Cluster, ClusterConfig, Consistency, Session, ShardError};
use shardkit_tests::models::{
    Customer, Migrator, order, person_to_v2, person_v1, person_v2, server_note,
};
use shardkit_tests::{Proxy, recorded};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A primary and its replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pair {
    Postgres,
    MySql,
}

impl Pair {
    fn urls(self) -> (String, String) {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
        match self {
            Pair::Postgres => (
                var(
                    "SHARDKIT_PG_PRIMARY_URL",
                    "postgres://postgres@127.0.0.1:5442",
                ),
                var(
                    "SHARDKIT_PG_REPLICA_URL",
                    "postgres://postgres@127.0.0.1:5443",
                ),
            ),
            Pair::MySql => (
                var("SHARDKIT_MYSQL_PRIMARY_URL", "mysql://root@127.0.0.1:3316"),
                var("SHARDKIT_MYSQL_REPLICA_URL", "mysql://root@127.0.0.1:3317"),
            ),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Pair::Postgres => "postgres",
            Pair::MySql => "mysql",
        }
    }

    fn reachable(self) -> bool {
        let (primary, replica) = self.urls();
        [primary, replica].iter().all(|url| {
            let address = url.rsplit('@').next().unwrap_or(url);
            address
                .parse()
                .ok()
                .and_then(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(1)).ok())
                .is_some()
        })
    }
}

/// Databases `<prefix>_0..n` on the primary, present on the replica too.
struct Dbs {
    pair: Pair,
    names: Vec<String>,
}

impl Dbs {
    async fn create(pair: Pair, prefix: &str, n: usize) -> Dbs {
        let (primary, replica) = pair.urls();
        let names: Vec<String> = (0..n).map(|i| format!("skr_{prefix}_{i}")).collect();
        // A scenario that failed while replay was stopped left it stopped.
        replay(pair, &replica, true).await;
        let admin = sea_orm::Database::connect(&primary).await.expect("primary");
        let backend = admin.get_database_backend();
        for name in &names {
            let quoted = quote(backend, name);
            admin
                .execute_unprepared(&format!("DROP DATABASE IF EXISTS {quoted}"))
                .await
                .expect("drop");
            admin
                .execute_unprepared(&format!("CREATE DATABASE {quoted}"))
                .await
                .expect("create");
        }
        // The replica replays the CREATE DATABASE.
        let deadline = Instant::now() + Duration::from_secs(30);
        for name in &names {
            loop {
                if sea_orm::Database::connect(format!("{replica}/{name}"))
                    .await
                    .is_ok()
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{name} never reached the replica"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Dbs { pair, names }
    }

    fn config(&self, replica_url: Option<&str>, extra: &str) -> ClusterConfig {
        self.config_with(replica_url, extra, "[groups.Customer]\n")
    }

    fn config_with(&self, replica_url: Option<&str>, extra: &str, groups: &str) -> ClusterConfig {
        let (primary, replica) = self.pair.urls();
        let replica = replica_url.map_or(replica, str::to_owned);
        let mut toml = format!("[pool]\nmax_connections = 2\n{extra}\n");
        for (i, name) in self.names.iter().enumerate() {
            toml.push_str(&format!(
                "[[shards]]\nname = \"s{i}\"\nurl = \"{primary}/{name}\"\nreplicas = [{{ name = \"s{i}r1\", url = \"{replica}/{name}\" }}]\n"
            ));
        }
        toml.push_str(groups);
        ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("config: {e}\n{toml}"))
    }

    async fn drop_all(self) {
        let (primary, _) = self.pair.urls();
        let admin = sea_orm::Database::connect(&primary).await.expect("primary");
        let backend = admin.get_database_backend();
        for name in &self.names {
            let _ = admin
                .execute_unprepared(&format!("DROP DATABASE IF EXISTS {}", quote(backend, name)))
                .await;
        }
    }
}

fn quote(backend: DbBackend, name: &str) -> String {
    match backend {
        DbBackend::MySql => format!("`{name}`"),
        _ => format!("\"{name}\""),
    }
}

/// Makes the replica apply changes `delay` late (PostgreSQL
/// `recovery_min_apply_delay`, MariaDB `MASTER_DELAY` in whole seconds).
async fn set_apply_delay(pair: Pair, delay: Duration) {
    let (_, replica) = pair.urls();
    let db = sea_orm::Database::connect(&replica).await.expect("replica");
    match pair {
        Pair::Postgres => {
            db.execute_unprepared(&format!(
                "ALTER SYSTEM SET recovery_min_apply_delay = '{}ms'",
                delay.as_millis()
            ))
            .await
            .expect("apply delay");
            db.execute_unprepared("SELECT pg_reload_conf()")
                .await
                .expect("reload");
        }
        Pair::MySql => {
            for sql in [
                "STOP SLAVE".to_owned(),
                format!("CHANGE MASTER TO MASTER_DELAY = {}", delay.as_secs()),
                "START SLAVE".to_owned(),
            ] {
                db.execute_unprepared(&sql).await.expect("apply delay");
            }
        }
    }
    db.close().await.ok();
}

/// A cluster whose reads of `orders` on replicas (`s<i>r1`) are counted.
async fn counted(config: ClusterConfig) -> (Cluster, Arc<AtomicU64>) {
    let on_replica = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&on_replica);
    let cluster = Cluster::builder(config)
        .on_statement(move |e| {
            // Reads of the scenarios' table only: the lag probe's
            // statements run on the replicas too.
            if e.shard.ends_with("r1") && e.statement.sql.contains("orders") {
                seen.fetch_add(1, Ordering::Relaxed);
            }
        })
        .connect()
        .await
        .expect("connect");
    (cluster, on_replica)
}

/// 8 writers each bump their own row's version and read it right back:
/// with their session no read is older than the write; with any replica
/// some are (the same run, so the test can fail).
async fn read_your_writes(pair: Pair) {
    let dbs = Dbs::create(pair, "ryw", 2).await;
    let delay = match pair {
        Pair::Postgres => Duration::from_millis(300),
        Pair::MySql => Duration::from_secs(1),
    };
    let wait_ms = delay.as_millis() as u64 * 3;
    let (cluster, on_replica) = counted(dbs.config(
        None,
        &format!("[read]\nreplica_wait_ms = {wait_ms}\nreplica_probe_ms = 100\n"),
    ))
    .await;
    cluster.migrate::<Migrator>().await.expect("migrate");
    // The replica has the tables before the delay starts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    set_apply_delay(pair, delay).await;
    // Each writer reads its row back `reads` times after every commit:
    // the first read waits for the replica, the later ones find it past
    // the session's position already (thousands of reads in all).
    let (rounds, reads) = match pair {
        Pair::Postgres => (12, 25),
        Pair::MySql => (4, 40),
    };
    let stale = |consistency: fn(&Session) -> Consistency, base: i64| {
        let cluster = cluster.clone();
        async move {
            let tasks = (base..base + 8).map(|task| {
                let cluster = cluster.clone();
                tokio::spawn(async move {
                    let session = Session::new();
                    let (mut stale, mut done) = (0u64, 0u64);
                    for version in 1..=rounds {
                        let tx = cluster.begin::<Customer>(task).await.expect("begin");
                        let row = order::ActiveModel {
                            id: Set(task),
                            customer_id: Set(task),
                            total_cents: Set(version),
                        };
                        if version == 1 {
                            tx.insert(row).await.expect("insert");
                        } else {
                            tx.update(row).await.expect("update");
                        }
                        tx.commit_in(&session).await.expect("commit");
                        for _ in 0..reads {
                            let seen = cluster
                                .find::<order::Entity>()
                                .key(task)
                                .consistency(consistency(&session))
                                .one()
                                .await
                                .expect("read");
                            done += 1;
                            if seen.is_none_or(|r| r.total_cents < version) {
                                stale += 1;
                            }
                        }
                    }
                    (stale, done)
                })
            });
            let (mut stale, mut done) = (0, 0);
            for task in futures::future::join_all(tasks).await {
                let (s, d) = task.expect("writer");
                stale += s;
                done += d;
            }
            (stale, done)
        }
    };
    let before = on_replica.load(Ordering::Relaxed);
    let (with_session, reads_done) = stale(Consistency::at_least, 0).await;
    let replica_reads = on_replica.load(Ordering::Relaxed) - before;
    let (any_replica, _) = stale(|_| Consistency::Replica { max_lag: None }, 1000).await;
    an_interrupted_commit_reads_the_shard(&cluster, &dbs.names[0]).await;
    set_apply_delay(pair, Duration::ZERO).await;
    assert_eq!(reads_done, 8 * rounds as u64 * reads);
    assert_eq!(
        with_session, 0,
        "reads with the session saw older rows ({with_session} of {reads_done})"
    );
    let waits = recorded::totals().samples("shardkit_replica_token_wait_seconds{}");
    assert!(!waits.is_empty(), "no token wait recorded");
    assert!(
        replica_reads > 0,
        "no read with the session went to the replica"
    );
    assert!(
        any_replica > 0,
        "reads of any replica never saw an older row: the delay did not take"
    );

    // A session carried as text to another instance still reads its writes.
    let other = Cluster::connect(dbs.config(None, "[read]\nreplica_wait_ms = 3000\n"))
        .await
        .expect("second instance");
    let session = Session::new();
    cluster
        .transaction_in::<Customer, _, _>(&session, 100, |tx| async move {
            tx.insert(order::ActiveModel {
                id: Set(100),
                customer_id: Set(100),
                total_cents: Set(7),
            })
            .await
            .map(|_| ())
        })
        .await
        .unwrap();
    assert!(
        !session.is_empty(),
        "the closure's commit is in the session"
    );
    // A group that cannot move records no bucket map.
    assert!(!session.to_string().contains("map:"), "{session}");
    let carried: Session = session.to_string().parse().unwrap();
    let row = other
        .find::<order::Entity>()
        .key(100)
        .consistency(Consistency::at_least(&carried))
        .one()
        .await
        .unwrap();
    assert_eq!(row.map(|r| r.total_cents), Some(7), "token: {carried}");
    a_busy_replica_pool_is_not_a_failed_replica(pair, &dbs, &carried).await;
    drop((cluster, other));
    dbs.drop_all().await;
}

/// A `commit_in` that stops after its commit landed (a request's timeout
/// dropping its future, a process going down) leaves the session reading
/// the shard itself: the replica, which applies late here, does not have
/// the row yet. `scope` is a part of the cluster's shard URLs.
async fn an_interrupted_commit_reads_the_shard(cluster: &Cluster, scope: &str) {
    let session = Session::new();
    let tx = cluster.begin::<Customer>(300).await.expect("begin");
    tx.insert(order::ActiveModel {
        id: Set(300),
        customer_id: Set(300),
        total_cents: Set(3),
    })
    .await
    .expect("insert");
    fail::cfg("shardkit::tx::commit_in", &format!("return({scope})")).unwrap();
    let stopped = tx.commit_in(&session).await;
    fail::remove("shardkit::tx::commit_in");
    let err = stopped.expect_err("the failpoint stops commit_in");
    assert!(err.to_string().contains("failpoint"), "{err}");
    let row = cluster
        .find::<order::Entity>()
        .key(300)
        .consistency(Consistency::at_least(&session))
        .one()
        .await
        .expect("read");
    assert_eq!(row.map(|r| r.total_cents), Some(3), "session: {session}");
}

/// 8 reads at once with a session ahead of the replica, on a pool of 2:
/// MariaDB's wait for the position holds a connection for all of
/// `replica_wait_ms`, so most reads wait for a connection first
/// (PostgreSQL's wait looks again and again, each look on a connection of
/// its own). Every read is answered (by the shard), and the replica stays
/// in the rotation: waiting for a connection of a busy pool is not the
/// replica failing to answer (on MariaDB it was taken out: the last reads'
/// bound ran out while they queued).
async fn a_busy_replica_pool_is_not_a_failed_replica(pair: Pair, dbs: &Dbs, carried: &Session) {
    let (busy, on_replica) = counted(dbs.config(
        None,
        "[read]\nreplica_wait_ms = 400\nreplica_timeout_ms = 1000\nreplica_probe_ms = 60000\n",
    ))
    .await;
    let shard = busy.shard_of::<Customer>(&100).await.unwrap().to_owned();
    let far = match pair {
        Pair::MySql => "gtid:0-1-999999999",
        Pair::Postgres => "pg:FFFFFFF0/0",
    };
    let ahead: Session = format!("{shard}={far}").parse().unwrap();
    ahead.merge(carried);
    let reads = futures::future::join_all((0..8).map(|_| {
        busy.find::<order::Entity>()
            .key(100)
            .consistency(Consistency::at_least(&ahead))
            .one()
    }))
    .await;
    for read in reads {
        assert_eq!(read.unwrap().map(|r| r.total_cents), Some(7));
    }
    // Still in the rotation: it answers the next read. (Not asked through
    // `Cluster::replicas`, which probes the replicas first.)
    let before = on_replica.load(Ordering::Relaxed);
    let read = busy
        .find::<order::Entity>()
        .key(100)
        .consistency(Consistency::Replica { max_lag: None })
        .one()
        .await
        .unwrap();
    assert_eq!(read.map(|r| r.total_cents), Some(7));
    assert!(
        on_replica.load(Ordering::Relaxed) > before,
        "the replica left the rotation"
    );
}

/// A replica that refuses connections, then one that hangs: reads fall
/// back to the shard within the replica timeout and return its rows; the
/// replica that comes back rejoins the rotation.
async fn replica_faults(pair: Pair) {
    let dbs = Dbs::create(pair, "faults", 1).await;
    let (_, replica) = pair.urls();
    let target = replica.rsplit('@').next().unwrap().to_owned();
    let proxy = Proxy::start(target.clone()).await;
    let scheme = replica.split("://").next().unwrap();
    let user = replica
        .split("://")
        .nth(1)
        .and_then(|r| r.split_once('@'))
        .map_or("", |(u, _)| u);
    let through = format!("{scheme}://{user}@127.0.0.1:{}", proxy.port);
    let (cluster, on_replica) = counted(dbs.config(
        Some(&through),
        "[read]\nreplica_timeout_ms = 300\nreplica_probe_ms = 100\ntimeout_ms = 5000\n",
    ))
    .await;
    cluster.migrate::<Migrator>().await.expect("migrate");
    let tx = cluster.begin::<Customer>(1).await.unwrap();
    tx.insert(order::ActiveModel {
        id: Set(1),
        customer_id: Set(1),
        total_cents: Set(5),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let any = || Consistency::Replica { max_lag: None };
    let read = || async {
        cluster
            .find::<order::Entity>()
            .key(1)
            .consistency(any())
            .one()
            .await
    };
    // The replica answers once it has the row.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if read().await.unwrap().is_some() && on_replica.load(Ordering::Relaxed) > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the replica never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A stream is answered by the replica too.
    let before = on_replica.load(Ordering::Relaxed);
    let streamed: Vec<order::Model> = {
        use futures::TryStreamExt;
        cluster
            .find::<order::Entity>()
            .key(1)
            .consistency(any())
            .stream()
            .await
            .expect("stream")
            .try_collect()
            .await
            .expect("rows")
    };
    assert_eq!(
        streamed.iter().map(|r| r.total_cents).collect::<Vec<_>>(),
        [5]
    );
    assert!(
        on_replica.load(Ordering::Relaxed) > before,
        "the stream read the shard"
    );
    // Two instances whose replica may take 3 s and a session's wait 2 s:
    // a read's own timeout (1 s) bounds them. One waits for a session's
    // commit, the other reads from any replica.
    let session = Session::new();
    let mut timed = Vec::new();
    for key in [2, 3] {
        let (instance, _) = counted(dbs.config(
            Some(&through),
            "[read]\nreplica_timeout_ms = 3000\nreplica_wait_ms = 2000\nreplica_probe_ms = 60000\n",
        ))
        .await;
        let tx = instance.begin::<Customer>(key).await.unwrap();
        tx.insert(order::ActiveModel {
            id: Set(key),
            customer_id: Set(key),
            total_cents: Set(key),
        })
        .await
        .unwrap();
        tx.commit_in(&session).await.unwrap();
        assert!(instance.replicas().await[0].in_rotation);
        timed.push((instance, key));
    }
    // Hangs: answered by the shard within the replica timeout.
    proxy.freeze();
    let started = Instant::now();
    let row = read().await.expect("a hung replica falls back");
    assert_eq!(row.map(|r| r.total_cents), Some(5));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "fell back after {:?}",
        started.elapsed()
    );
    // The read's timeout holds whoever answers: the hung replica has half
    // of it, the shard the rest (before, the wait alone took 2 s, or the
    // replica 3 s, and then the shard answered).
    for ((instance, key), consistency) in timed.iter().zip([Consistency::at_least(&session), any()])
    {
        let started = Instant::now();
        let row = instance
            .find::<order::Entity>()
            .key(*key)
            .consistency(consistency.clone())
            .timeout(Duration::from_secs(1))
            .one()
            .await
            .expect("a hung replica falls back");
        assert_eq!(row.map(|r| r.total_cents), Some(*key));
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{consistency:?}: answered after {:?}",
            started.elapsed()
        );
    }
    // Cut short by the read's timeout, not by its own, the replica was not
    // taken for a failed one: the next read asks it again (and waits its
    // half of the timeout for it) rather than going to the shard at once.
    let (instance, key) = &timed[1];
    let started = Instant::now();
    let row = instance
        .find::<order::Entity>()
        .key(*key)
        .consistency(any())
        .timeout(Duration::from_secs(1))
        .one()
        .await
        .expect("a hung replica falls back");
    assert_eq!(row.map(|r| r.total_cents), Some(*key));
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(1),
        "the replica was not asked again, or the read took too long: {took:?}"
    );
    // Eight at once on pools of 2, with and without a session: each
    // answered by the shard within its own timeout, though the hung
    // replica's connections are taken by the reads before them.
    let started = Instant::now();
    let reads = futures::future::join_all((0..8).map(|i| {
        let (instance, key) = &timed[i % 2];
        let consistency = if i % 2 == 0 {
            Consistency::at_least(&session)
        } else {
            any()
        };
        async move {
            let started = Instant::now();
            let row = instance
                .find::<order::Entity>()
                .key(*key)
                .consistency(consistency)
                .timeout(Duration::from_secs(1))
                .one()
                .await;
            (row, *key, started.elapsed())
        }
    }))
    .await;
    for (row, key, took) in reads {
        let row = row.unwrap_or_else(|e| panic!("read {key} on a hung replica: {}", e.report()));
        assert_eq!(row.map(|r| r.total_cents), Some(key));
        assert!(took < Duration::from_secs(1), "answered after {took:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    drop(timed);
    // Refuses: answered by the shard; the status says why it is out.
    proxy.kill();
    for _ in 0..5 {
        let row = read().await.expect("a refusing replica falls back");
        assert_eq!(row.map(|r| r.total_cents), Some(5));
    }
    let status = cluster.replicas().await;
    assert_eq!(status.len(), 1, "{status:?}");
    assert_eq!(
        (status[0].name.as_str(), status[0].shard.as_str()),
        ("s0r1", "s0")
    );
    assert!(
        !status[0].in_rotation && status[0].error.is_some() && status[0].lag.is_none(),
        "{status:?}"
    );
    // The probe says it refuses, with the driver's cause (the pool's retries
    // of a refused connection made it "no answer within 300ms").
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = cluster.replicas().await;
        let error = status[0].error.clone().unwrap_or_default();
        if error.to_lowercase().contains("refused") {
            assert!(!status[0].in_rotation, "{status:?}");
            break;
        }
        assert!(Instant::now() < deadline, "{status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Back: it rejoins the rotation after a good probe.
    let proxy = Proxy::start_on(proxy.port, target.clone()).await;
    let before = on_replica.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        read().await.unwrap();
        if on_replica.load(Ordering::Relaxed) > before + 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the replica never rejoined");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = cluster.replicas().await;
    assert!(
        status[0].in_rotation && status[0].error.is_none(),
        "{status:?}"
    );
    // A replica that failed stays out until a good probe, not for a time:
    // an instance that probes once a minute, its clock moved on, reads
    // from the shard until it probes, though the replica is back.
    let clock = Arc::new(shardkit::clock::ManualClock::new(
        shardkit::Clock::now_millis(&shardkit::clock::SystemClock),
    ));
    let on_slow = Arc::new(AtomicU64::new(0));
    let slow = Cluster::builder(dbs.config(
        Some(&through),
        "[read]\nreplica_timeout_ms = 3000\nreplica_probe_ms = 60000\ntimeout_ms = 5000\n",
    ))
    .clock(clock.clone())
    .on_statement({
        let seen = Arc::clone(&on_slow);
        move |e| {
            if e.shard.ends_with("r1") && e.statement.sql.contains("orders") {
                seen.fetch_add(1, Ordering::Relaxed);
            }
        }
    })
    .connect()
    .await
    .expect("connect");
    let slow_read = || async {
        let row = slow
            .find::<order::Entity>()
            .key(1)
            .consistency(any())
            .one()
            .await
            .expect("a read");
        assert_eq!(row.map(|r| r.total_cents), Some(5));
    };
    slow_read().await;
    proxy.killed().await;
    // Its probe fails: out of the rotation.
    assert!(!slow.replicas().await[0].in_rotation);
    let proxy = Proxy::start_on(proxy.port, target).await;
    clock.advance(Duration::from_secs(10));
    let before = on_slow.load(Ordering::Relaxed);
    for _ in 0..3 {
        slow_read().await;
    }
    assert_eq!(
        on_slow.load(Ordering::Relaxed),
        before,
        "a replica no probe found good since it failed took reads"
    );
    // A probe finds it good: reads go to it again.
    let deadline = Instant::now() + Duration::from_secs(15);
    while !slow.replicas().await[0].in_rotation {
        assert!(Instant::now() < deadline, "no probe found the replica good");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    while on_slow.load(Ordering::Relaxed) == before {
        assert!(
            Instant::now() < deadline,
            "the replica took no read after its probe"
        );
        slow_read().await;
    }
    drop(slow);
    drop(proxy);
    drop(cluster);
    // Nothing of the cluster stays connected to the replica.
    let left = settle_connections(&replica, &dbs.names[0]).await;
    assert_eq!(left, 0, "connections left on the replica");
    dbs.drop_all().await;
}

/// Connections to database `db` on the server at `url`, once they have
/// had a few seconds to close.
async fn settle_connections(url: &str, db: &str) -> usize {
    let admin = sea_orm::Database::connect(url).await.expect("server");
    let names = [db.to_owned()];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = shardkit::testing::connections_to(&admin, &names).await;
        if n == 0 || Instant::now() >= deadline {
            admin.close().await.ok();
            return n;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A replica whose replay stops falls out of `Replica { max_lag }` reads
/// (the shard answers with the newest rows), and rejoins once it catches
/// up; a read without a bound may still use it.
async fn lag_bound(pair: Pair) {
    let dbs = Dbs::create(pair, "lag", 1).await;
    let (_, replica) = pair.urls();
    let (cluster, on_replica) = counted(dbs.config(None, "[read]\nreplica_probe_ms = 50\n")).await;
    cluster.migrate::<Migrator>().await.expect("migrate");
    let write = |cents: i64| {
        let cluster = cluster.clone();
        async move {
            let tx = cluster.begin::<Customer>(1).await.unwrap();
            let row = order::ActiveModel {
                id: Set(1),
                customer_id: Set(1),
                total_cents: Set(cents),
            };
            if cents == 1 {
                tx.insert(row).await.unwrap();
            } else {
                tx.update(row).await.unwrap();
            }
            tx.commit().await.unwrap();
        }
    };
    let bounded = || Consistency::Replica {
        max_lag: Some(Duration::from_millis(500)),
    };
    let read = |consistency: Consistency| {
        let cluster = cluster.clone();
        async move {
            cluster
                .find::<order::Entity>()
                .key(1)
                .consistency(consistency)
                .one()
                .await
                .unwrap()
                .map(|r| r.total_cents)
        }
    };
    write(1).await;
    // Caught up: bounded reads use the replica.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let before = on_replica.load(Ordering::Relaxed);
        if read(bounded()).await == Some(1) && on_replica.load(Ordering::Relaxed) > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "bounded reads never used the replica"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    replay(pair, &replica, false).await;
    write(2).await;
    // Its lag grows past the bound (MariaDB stops reporting it): bounded
    // reads are answered by the shard, with the newest row.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = on_replica.load(Ordering::Relaxed);
    for _ in 0..10 {
        assert_eq!(
            read(bounded()).await,
            Some(2),
            "a bounded read saw an old row"
        );
    }
    let skipped = on_replica.load(Ordering::Relaxed) == before;
    // A replica that is only behind stays in the rotation when a session's
    // wait for it runs out, even one cut short by the read's timeout (an
    // instance that probes once a minute, so no probe puts it back).
    let (patient, on_patient) =
        counted(dbs.config(None, "[read]\nreplica_probe_ms = 60000\n")).await;
    let session = Session::new();
    let tx = patient.begin::<Customer>(2).await.unwrap();
    tx.insert(order::ActiveModel {
        id: Set(2),
        customer_id: Set(2),
        total_cents: Set(7),
    })
    .await
    .unwrap();
    tx.commit_in(&session).await.unwrap();
    let mine = patient
        .find::<order::Entity>()
        .key(2)
        .consistency(Consistency::at_least(&session))
        .timeout(Duration::from_secs(1))
        .one()
        .await
        .expect("a session read of a replica that is behind");
    assert_eq!(mine.map(|r| r.total_cents), Some(7));
    let before = on_patient.load(Ordering::Relaxed);
    let row = patient
        .find::<order::Entity>()
        .key(1)
        .consistency(Consistency::Replica { max_lag: None })
        .one()
        .await
        .unwrap();
    assert_eq!(row.map(|r| r.total_cents), Some(1), "the replica's row");
    assert_eq!(
        on_patient.load(Ordering::Relaxed),
        before + 1,
        "a replica that was only behind left the rotation"
    );
    drop(patient);
    replay(pair, &replica, true).await;
    assert!(skipped, "a replica past the bound answered");
    // The metrics tell it too (this binary's recorder; shard names are the
    // scenario's own only within one pair, so read after the fact).
    let metrics = recorded::totals();
    assert!(
        metrics.counter("shardkit_replica_fallbacks_total{reason=lag,shard=s0}") >= 10,
        "{:?}",
        metrics.all_keys()
    );
    assert!(metrics.counter("shardkit_replica_reads_total{replica=s0r1,shard=s0}") > 0);
    assert!(
        metrics
            .gauge("shardkit_replica_lag_seconds{replica=s0r1}")
            .is_some(),
        "no lag gauge"
    );
    // Caught up again: it rejoins.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let before = on_replica.load(Ordering::Relaxed);
        if read(bounded()).await == Some(2) && on_replica.load(Ordering::Relaxed) > before {
            break;
        }
        assert!(Instant::now() < deadline, "the replica never rejoined");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rollout_reads_follow_the_consistency(pair, &cluster, &replica).await;
    drop(cluster);
    dbs.drop_all().await;
}

/// A rollout's `get_old_with`/`get_new_with` read where the consistency
/// says: a replica that has not replayed a write answers `Replica` reads
/// with the row before it, and a session that made the write reads it.
async fn rollout_reads_follow_the_consistency(pair: Pair, cluster: &Cluster, replica: &str) {
    let people: shardkit::RolloutHandle<person_v1::Entity, person_v2::Entity> = cluster
        .register_rollout(shardkit::rollout::Rollout::new("people_v2", person_to_v2))
        .await
        .unwrap();
    let city = |city: &'static str| person_v1::ActiveModel {
        id: Set(9),
        customer_id: Set(1),
        first_name: Set("Ada".into()),
        last_name: Set("L".into()),
        city: Set(city.into()),
    };
    let tx = cluster.begin::<Customer>(1).await.unwrap();
    tx.insert(city("Paris")).await.unwrap();
    tx.commit().await.unwrap();
    let any = Consistency::Replica { max_lag: None };
    let deadline = Instant::now() + Duration::from_secs(10);
    while people.get_old_with(1, 9, &any).await.unwrap().is_none() {
        assert!(Instant::now() < deadline, "the replica never had the row");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    replay(pair, replica, false).await;
    let session = Session::new();
    let tx = cluster.begin::<Customer>(1).await.unwrap();
    tx.update(city("Oslo")).await.unwrap();
    tx.commit_in(&session).await.unwrap();
    let old = people
        .get_old_with(1, 9, &any)
        .await
        .unwrap()
        .map(|p| p.city);
    let new = people
        .get_new_with(1, 9, &any)
        .await
        .unwrap()
        .map(|p| p.city);
    let mine = people
        .get_old_with(1, 9, &Consistency::at_least(&session))
        .await
        .unwrap()
        .map(|p| p.city);
    let primary = people.get_new(1, 9).await.unwrap().map(|p| p.city);
    replay(pair, replica, true).await;
    assert_eq!(
        old.as_deref(),
        Some("Paris"),
        "get_old_with(Replica) read the replica"
    );
    assert_eq!(
        new.as_deref(),
        Some("Paris"),
        "get_new_with(Replica) read the replica"
    );
    assert_eq!(mine.as_deref(), Some("Oslo"), "the session reads its write");
    assert_eq!(primary.as_deref(), Some("Oslo"));
}

/// A bucket move onto a shard whose replica applies changes late: right
/// after the cut-over and the cleaning, replica reads of the moved buckets
/// find every row (the new owner's replica answers only once past the
/// copies, else the shard does), and once it catches up it answers them.
async fn moved_buckets(pair: Pair) {
    let dbs = Dbs::create(pair, "moves", 2).await;
    let (cluster, on_replica) = counted(dbs.config_with(
        None,
        "[read]\nreplica_probe_ms = 50\n[rebalance]\nrefresh_ms = 50\ncleanup_grace_ms = 0\n",
        "[groups.Customer]\nbuckets = 16\nshards = [\"s0\"]\nmovable = true\n",
    ))
    .await;
    cluster.migrate::<Migrator>().await.expect("migrate");
    cluster.refresh_bucket_maps().await.expect("maps");
    for id in 1..=40i64 {
        let tx = cluster.begin::<Customer>(id).await.unwrap();
        tx.insert(order::ActiveModel {
            id: Set(id),
            customer_id: Set(id),
            total_cents: Set(id),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let delay = match pair {
        Pair::Postgres => Duration::from_millis(400),
        Pair::MySql => Duration::from_secs(1),
    };
    // The replica has every row before its replay slows down.
    tokio::time::sleep(Duration::from_millis(500)).await;
    set_apply_delay(pair, delay).await;
    let missing = |cluster: Cluster| async move {
        let mut missing = Vec::new();
        for id in 1..=40i64 {
            let row = cluster
                .find::<order::Entity>()
                .key(id)
                .consistency(Consistency::Replica { max_lag: None })
                .one()
                .await
                .unwrap();
            if row.is_none_or(|r| r.total_cents != id) {
                missing.push(id);
            }
        }
        missing
    };
    let moves = cluster
        .rebalance::<Customer>()
        .unwrap()
        .entity::<order::Entity>();
    let plan = moves.plan_buckets(0..16, "s1").await.unwrap();
    let started = moves.start(&plan).await.unwrap();
    let done = moves.run(started.id).await.unwrap();
    assert_eq!(done.phase, shardkit::rebalance::MovePhase::Done, "{done:?}");
    // At once: the source is cleaned, the target's replica is behind.
    let gone = missing(cluster.clone()).await;
    // Later: the replica has replayed the copies and answers.
    let before = on_replica.load(Ordering::Relaxed);
    let deadline = Instant::now() + delay * 4 + Duration::from_secs(5);
    let late = loop {
        let late = missing(cluster.clone()).await;
        if on_replica.load(Ordering::Relaxed) > before + 20 || Instant::now() >= deadline {
            break late;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let replica_reads = on_replica.load(Ordering::Relaxed) - before;
    set_apply_delay(pair, Duration::ZERO).await;
    assert!(
        gone.is_empty(),
        "rows missing right after the move: {gone:?}"
    );
    assert!(late.is_empty(), "rows missing later: {late:?}");
    assert!(
        replica_reads > 20,
        "the new owner's replica never answered for the moved buckets"
    );
    drop(cluster);
    dbs.drop_all().await;
}

/// Stops or resumes the replica's replay.
async fn replay(pair: Pair, replica: &str, on: bool) {
    let db = sea_orm::Database::connect(replica).await.expect("replica");
    let sql = match (pair, on) {
        (Pair::Postgres, false) => "SELECT pg_wal_replay_pause()",
        (Pair::Postgres, true) => "SELECT pg_wal_replay_resume()",
        (Pair::MySql, false) => "STOP SLAVE SQL_THREAD",
        (Pair::MySql, true) => "START SLAVE SQL_THREAD",
    };
    db.execute_unprepared(sql).await.expect("replay");
    db.close().await.ok();
}

/// SQLite shards have no replicas: a config error naming the entry.
fn sqlite_replica_is_a_config_error() {
    let refused = |toml: &str| match ClusterConfig::from_toml(toml) {
        Ok(_) => panic!("accepted:\n{toml}"),
        Err(err) => err,
    };
    let err = refused(
        "[[shards]]\nname = \"s0\"\nurl = \"sqlite::memory:\"\nreplicas = [{ name = \"s0r1\", url = \"sqlite::memory:\" }]\n",
    );
    assert!(
        matches!(&err, ShardError::Config { entry, message }
            if entry.ends_with(".replicas[0]") && entry.contains("s0") && message.contains("SQLite")),
        "{err}"
    );
    // Names are unique across shards and replicas.
    let err = refused(
        "[[shards]]\nname = \"s0\"\nurl = \"postgres://h/a\"\nreplicas = [{ name = \"s0\", url = \"postgres://h2/a\" }]\n",
    );
    assert!(
        matches!(&err, ShardError::Config { entry, message }
            if entry == "shards[0].replicas[0]" && message.contains("taken")),
        "{err}"
    );
    // A replica speaks its shard's protocol.
    let err = refused(
        "[[shards]]\nname = \"s0\"\nurl = \"postgres://h/a\"\nreplicas = [{ name = \"s0r1\", url = \"mysql://h2/a\" }]\n",
    );
    assert!(
        matches!(&err, ShardError::Config { message, .. } if message.contains("a replica serves")),
        "{err}"
    );
    // A replica serves its shard's database, on a server of its own: not
    // another database of the replica's server, not the shard itself, not
    // another shard, not a replica of another shard too.
    let err = refused(
        "[[shards]]\nname = \"s0\"\nurl = \"postgres://h/a\"\nreplicas = [{ name = \"s0r1\", url = \"postgres://h2/b\" }]\n",
    );
    assert!(
        matches!(&err, ShardError::Config { entry, message } if entry.ends_with(".replicas[0]")
            && message.contains("names database `b`, and shard `s0` is database `a`")),
        "{err}"
    );
    let err = refused(
        "[[shards]]\nname = \"s0\"\nurl = \"postgres://u:secret@h:5432/a\"\nreplicas = [{ name = \"s0r1\", url = \"postgres://u@h:5432/a\" }]\n",
    );
    assert!(
        matches!(&err, ShardError::Config { message, .. }
            if message.contains("is the database shard `s0` is") && !message.contains("secret")),
        "{err}"
    );
    let err = refused(
        "[[shards]]\nname = \"s0\"\nurl = \"postgres://h/a\"\n\
         [[shards]]\nname = \"s1\"\nurl = \"postgres://h2/a\"\nreplicas = [{ name = \"s1r1\", url = \"postgres://h/a\" }]\n",
    );
    assert!(
        matches!(&err, ShardError::Config { entry, message } if entry == "shards[1].replicas[0]"
            && message.contains("is the database shard `s0` is")),
        "{err}"
    );
    let err = refused(
        "[[shards]]\nname = \"s0\"\nurl = \"postgres://h/a\"\nreplicas = [{ name = \"r\", url = \"postgres://h3/a\" }]\n\
         [[shards]]\nname = \"s1\"\nurl = \"postgres://h2/a\"\nreplicas = [{ name = \"r2\", url = \"postgres://h3/a\" }]\n",
    );
    assert!(
        matches!(&err, ShardError::Config { message, .. } if message.contains("replica `r`")),
        "{err}"
    );
}

/// On MySQL/MariaDB a `schema_name` names a database of the server: between
/// shards on two servers (the default server and the replica pair's
/// primary), `shardkit_shared_test.notes` is each server's own, so a move of
/// its buckets is not refused as one within a server is (`rebalance/placement.rs`),
/// and the notes leave the source's server for the target's.
async fn named_database_moves_between_servers() {
    let (primary, _) = Pair::MySql.urls();
    let default = std::env::var("SHARDKIT_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".to_owned());
    let servers = [default.clone(), primary.clone()];
    for url in &servers {
        let admin = sea_orm::Database::connect(url).await.expect("server");
        for sql in [
            "DROP DATABASE IF EXISTS skr_apart",
            "CREATE DATABASE skr_apart",
            "CREATE DATABASE IF NOT EXISTS shardkit_shared_test",
            "DROP TABLE IF EXISTS shardkit_shared_test.notes",
            "CREATE TABLE shardkit_shared_test.notes \
             (id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, body TEXT NOT NULL)",
        ] {
            admin.execute_unprepared(sql).await.expect(sql);
        }
    }
    let toml = format!(
        "[pool]\nmax_connections = 2\n[rebalance]\nrefresh_ms = 50\ncleanup_grace_ms = 0\n\
         [[shards]]\nname = \"s0\"\nurl = \"{default}/skr_apart\"\n\
         [[shards]]\nname = \"s1\"\nurl = \"{primary}/skr_apart\"\n\
         [groups.Customer]\nbuckets = 16\nshards = [\"s0\"]\nmovable = true\n"
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.expect("migrate");
    cluster.refresh_bucket_maps().await.expect("maps");
    for key in 1..=40i64 {
        let tx = cluster.begin::<Customer>(key).await.unwrap();
        tx.insert_without_returning(server_note::ActiveModel {
            id: Set(key),
            customer_id: Set(key),
            body: Set(format!("note {key}")),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let moves = cluster
        .rebalance::<Customer>()
        .unwrap()
        .entity::<server_note::Entity>();
    let plan = moves.plan_buckets(0..16, "s1").await.unwrap();
    let started = moves
        .start(&plan)
        .await
        .unwrap_or_else(|e| panic!("start: {}", e.report()));
    let done = moves
        .run(started.id)
        .await
        .unwrap_or_else(|e| panic!("run: {}", e.report()));
    assert_eq!(done.phase, shardkit::rebalance::MovePhase::Done, "{done:?}");
    cluster.refresh_bucket_maps().await.expect("maps");
    for key in 1..=40i64 {
        let found = cluster
            .find::<server_note::Entity>()
            .key(key)
            .all()
            .await
            .unwrap();
        assert_eq!(found.len(), 1, "notes of {key}");
    }
    drop(cluster);
    let mut counts = Vec::new();
    for url in &servers {
        let admin = sea_orm::Database::connect(url).await.expect("server");
        let n = admin
            .query_one_raw(sea_orm::Statement::from_string(
                DbBackend::MySql,
                "SELECT COUNT(*) AS n FROM shardkit_shared_test.notes",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get::<i64>("", "n")
            .unwrap();
        counts.push(n);
        for sql in [
            "DROP DATABASE skr_apart",
            "DROP DATABASE shardkit_shared_test",
        ] {
            admin.execute_unprepared(sql).await.expect(sql);
        }
    }
    assert_eq!(
        counts,
        [0, 40],
        "notes on the source's server, the target's"
    );
}

fn main() -> std::process::ExitCode {
    let args = Arguments::from_args();
    // Before any cluster: metrics register with the recorder there is.
    recorded::totals();
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let mut trials = vec![Trial::test("sqlite_replica_is_a_config_error", || {
        sqlite_replica_is_a_config_error();
        Ok(())
    })];
    for pair in [Pair::Postgres, Pair::MySql] {
        let up = pair.reachable();
        if !up {
            eprintln!(
                "the {} primary and replica are unreachable ({:?}): {}",
                pair.name(),
                pair.urls(),
                if ci {
                    "CI=true, so their scenarios run and fail"
                } else {
                    "their scenarios are ignored (start them with scripts/replicas.sh start)"
                }
            );
        }
        type Scenario = fn(Pair) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;
        let scenarios: [(&str, Scenario); 4] = [
            ("read_your_writes", |p| Box::pin(read_your_writes(p))),
            ("replica_faults", |p| Box::pin(replica_faults(p))),
            ("lag_bound", |p| Box::pin(lag_bound(p))),
            ("moved_buckets", |p| Box::pin(moved_buckets(p))),
        ];
        for (name, scenario) in scenarios {
            trials.push(
                Trial::test(format!("{name}::{}", pair.name()), move || {
                    // One scenario at a time per pair: some change the
                    // replica's replay (its delay, a pause).
                    static PAIRS: [std::sync::Mutex<()>; 2] =
                        [std::sync::Mutex::new(()), std::sync::Mutex::new(())];
                    let _turn = PAIRS[pair as usize]
                        .lock()
                        .unwrap_or_else(|p| p.into_inner());
                    tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .enable_all()
                        .build()
                        .unwrap()
                        .block_on(scenario(pair));
                    Ok(())
                })
                .with_ignored_flag(!up && !ci),
            );
        }
    }
    // Two MySQL servers: the default one and the pair's primary.
    let up = Pair::MySql.reachable();
    trials.push(
        Trial::test("named_database_moves_between_servers::mysql", || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap()
                .block_on(named_database_moves_between_servers());
            Ok(())
        })
        .with_ignored_flag(!up && !ci),
    );
    libtest_mimic::run(&args, trials).exit_code()
}
