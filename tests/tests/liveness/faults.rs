//! Liveness under load and faults: index-first writes on small pools never
//! deadlock, a down or hung shard fails requests fast with its cause (and
//! comes back once reachable), and index reads with `.partial()` report a
//! down index shard instead of failing or hanging.

use sea_orm::{ActiveValue::Unchanged, EntityTrait, Set};
use shardkit::topology::pghash::partition_hash_bytes;
use shardkit::{Cluster, ClusterConfig, ShardError};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, Hung, Proxy, TestDbs, count_rows};
use std::time::Duration;
use std::time::Instant;

/// The shard (by name) that index rows of `value` live on.
fn index_shard_of(cluster: &Cluster, value: &str) -> String {
    let shards = cluster.topology().shards_of("Customer").unwrap();
    let id = shards[(partition_hash_bytes(value.as_bytes()) % shards.len() as u64) as usize];
    cluster.topology().shard(id).name.clone()
}

/// A value `{prefix}{n}` whose index rows live on a shard other than `owner`.
fn value_elsewhere(cluster: &Cluster, prefix: &str, owner: &str, from: &mut u32) -> String {
    loop {
        *from += 1;
        let value = format!("{prefix}{from}");
        if index_shard_of(cluster, &value) != owner {
            return value;
        }
    }
}

/// 8 writers per shard on pools of 2 connections, every index row on the
/// other shard: each transaction holds its own shard's connection while it
/// writes index rows on the other one. Every insert and every update that
/// moves the unique value must complete, and nothing stays connected once
/// the cluster is dropped.
pub(crate) async fn index_first_writes_on_small_pools_all_complete(dbs: &mut TestDbs) {
    let toml = format!(
        "{}\n[groups.Customer]\n",
        dbs.shards_toml(2)
            .replace("max_connections = 4", "max_connections = 2")
    );
    let config = ClusterConfig::from_toml(&toml).unwrap();
    let cluster = Cluster::connect(config).await.unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    cluster
        .gsi()
        .backfill::<contact::Entity>(contact::Column::Email)
        .await
        .unwrap();
    cluster
        .gsi()
        .backfill::<contact::Entity>(contact::Column::Phone)
        .await
        .unwrap();

    // 8 customers on each shard, with values indexed on the other shard.
    let mut writers = Vec::new();
    let mut n = 0;
    let mut key = 0_i64;
    for shard in ["s0", "s1"] {
        let mut on_shard = 0;
        while on_shard < 8 {
            key += 1;
            if cluster.shard_of::<Customer>(&key).await.unwrap() != shard {
                continue;
            }
            on_shard += 1;
            let email = value_elsewhere(&cluster, "e", shard, &mut n);
            let phone = value_elsewhere(&cluster, "p", shard, &mut n);
            let moved = value_elsewhere(&cluster, "m", shard, &mut n);
            writers.push((key, email, phone, moved));
        }
    }

    // Every writer first opens its transaction and waits for the others to
    // open theirs (the pools then hand out all their connections at once),
    // as concurrent requests do in production.
    // (On SQLite a second transaction of one shard waits for the first's
    // write lock, so only the first writer of each shard takes part.)
    let meeting = if dbs.backend == Backend::Sqlite { 1 } else { 2 };
    let opened = std::sync::Arc::new(tokio::sync::Barrier::new(2 * meeting));
    let tasks: Vec<_> = writers
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, (key, email, phone, moved))| {
            let cluster = cluster.clone();
            let opened = opened.clone();
            tokio::spawn(async move {
                let tx = cluster.begin::<Customer>(key).await?;
                // The first two writers of each shard meet with their
                // transactions open: both shards' pools are then fully
                // held by transactions that need the other shard.
                // (A writer whose partner cannot begin goes on alone.)
                if i % 8 < meeting {
                    let _ = tokio::time::timeout(Duration::from_secs(1), opened.wait()).await;
                }
                tx.insert(contact::ActiveModel {
                    id: Set(key),
                    customer_id: Set(key),
                    email: Set(email),
                    phone: Set(phone),
                })
                .await?;
                tx.commit().await?;
                let tx = cluster.begin::<Customer>(key).await?;
                tx.update(contact::ActiveModel {
                    id: Unchanged(key),
                    customer_id: Unchanged(key),
                    email: Set(moved),
                    ..Default::default()
                })
                .await?;
                tx.commit().await
            })
        })
        .collect();
    let started = std::time::Instant::now();
    let mut failed = Vec::new();
    for task in tasks {
        if let Err(err) = task.await.unwrap() {
            failed.push(err.to_string());
        }
    }
    println!(
        "{:?}: 16 writers on pools of 2 took {:?}",
        dbs.backend,
        started.elapsed()
    );
    assert!(
        failed.is_empty(),
        "{} of 16 writers failed: {failed:?}",
        failed.len()
    );
    assert_eq!(count_rows(&cluster, "contacts").await, 16);
    // Every row is found through its moved value, and the old values are gone.
    for (key, email, _, moved) in &writers {
        let found = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, moved.as_str())
            .all()
            .await
            .unwrap();
        assert_eq!(found.len(), 1, "{moved}");
        assert_eq!(found[0].id, *key);
        let old = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, email.as_str())
            .all()
            .await
            .unwrap();
        assert!(old.is_empty(), "{email} still finds {old:?}");
    }
    assert_eq!(count_rows(&cluster, "gsi_contacts_email").await, 16);

    drop(cluster);
    let left = dbs.settle_connections(0, Duration::from_secs(5)).await;
    assert_eq!(
        left, 0,
        "server connections left after dropping the cluster"
    );
}

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

/// Asserts `err` is `Unavailable` for `shard` with a cause containing one
/// of `causes`.
fn assert_unavailable(err: &ShardError, shard: &str, causes: &[&str]) {
    match err {
        ShardError::Unavailable { shard: s, cause } => {
            assert_eq!(s, shard);
            let lower = cause.to_lowercase();
            assert!(
                causes.iter().any(|c| lower.contains(c)),
                "cause {cause:?} names none of {causes:?}"
            );
        }
        other => panic!("expected Unavailable for {shard}, got {other:?}"),
    }
}

/// A config whose shard s1 is at `url` (s0 is the test's first database).
fn config_with_s1(dbs: &TestDbs, pool: &str, url: &str, extra: &str) -> ClusterConfig {
    let healthy = dbs.shards_toml_with(1, pool, &[]);
    let toml = format!(
        "{healthy}\n[[shards]]\nname = \"s1\"\nurl = \"{url}\"\n\n{extra}\n[groups.Customer]\n"
    );
    ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("config: {e}\n{toml}"))
}

fn closed_port_url(backend: Backend) -> &'static str {
    match backend {
        Backend::MySql => "mysql://root@127.0.0.1:9/down",
        _ => "postgres://postgres@127.0.0.1:9/down",
    }
}

/// A shard on a closed port: `Cluster::connect` fails within the connect
/// timeout with "connection refused" (not the pool's 30 s "timed out"); a
/// lazily connected cluster fails the first keyed read, `begin` and
/// `.partial()` read with the cause, and every later one at once.
pub(crate) async fn refused_shard_fails_fast_with_its_cause(dbs: &mut TestDbs) {
    let refused = ["refused"];
    let url = closed_port_url(dbs.backend);
    let started = Instant::now();
    let err = Cluster::connect(config_with_s1(dbs, "", url, ""))
        .await
        .unwrap_err();
    let connect_took = started.elapsed();
    match &err {
        ShardError::Connect { shard, cause, .. } => {
            assert_eq!(shard, "s1");
            assert!(
                cause.message().to_lowercase().contains("refused"),
                "{cause}"
            );
            // The chain goes on to the driver's error, redacted and typed.
            let source = std::error::Error::source(&err).expect("a connect error has a source");
            let driver = source
                .downcast_ref::<shardkit::DriverError>()
                .expect("the source is the driver's error");
            assert_eq!(driver, cause);
            assert!(std::error::Error::source(driver).is_none());
        }
        other => panic!("expected Connect, got {other:?}"),
    }
    assert!(
        connect_took < Duration::from_secs(5),
        "connect took {connect_took:?}"
    );

    let cluster = Cluster::connect(config_with_s1(dbs, "connect_lazy = true\n", url, ""))
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap_err(); // s1 cannot be migrated
    let down = key_on(&cluster, "s1").await;
    let up = key_on(&cluster, "s0").await;

    let started = Instant::now();
    let err = cluster
        .find::<customer::Entity>()
        .key(down)
        .all()
        .await
        .unwrap_err();
    let first = started.elapsed();
    assert_unavailable(&err, "s1", &refused);
    assert!(first < Duration::from_secs(5), "first read took {first:?}");

    // Marked down: later requests fail at once, with the same cause.
    let started = Instant::now();
    let err = cluster.begin::<Customer>(down).await.unwrap_err();
    let second = started.elapsed();
    assert_unavailable(&err, "s1", &refused);
    let started = Instant::now();
    let partial = cluster
        .find::<customer::Entity>()
        .scatter()
        .partial()
        .all()
        .await
        .unwrap();
    let scatter = started.elapsed();
    assert_eq!(partial.failed_shards(), vec!["s1"]);
    assert_unavailable(&partial.failed[0].error, "s1", &refused);
    println!(
        "{:?}: connect {connect_took:?}, first read {first:?}, begin once down {second:?}, \
         partial scatter {scatter:?}",
        dbs.backend
    );
    assert!(second < Duration::from_millis(200), "begin took {second:?}");
    // The healthy shard is unaffected (its table is missing: migrate
    // stopped at s1, so only the routing is checked here).
    assert_eq!(cluster.shard_of::<Customer>(&up).await.unwrap(), "s0");
}

/// `create_databases` with `connect_lazy`: a shard on a closed port or on a
/// server that never answers used to hold `Cluster::connect` for the whole
/// acquire timeout (30 s) and then fail with "database does not exist and
/// could not be created: ... pool timed out". Now the lazy shard is passed
/// over (with a warning) within the connect timeout and the reachable shard
/// works; without `connect_lazy` the connect fails with the driver's own
/// cause. A ticket server down never stops the connect.
pub(crate) async fn create_databases_skips_a_lazy_shard_that_is_down(dbs: &mut TestDbs) {
    // s0's tables, by a cluster of s0 alone.
    let alone = ClusterConfig::from_toml(&format!(
        "{}
[groups.Customer]
",
        dbs.shards_toml(1)
    ))
    .unwrap();
    Cluster::connect(alone)
        .await
        .unwrap()
        .migrate::<Migrator>()
        .await
        .unwrap();

    let hung = Hung::start().await;
    let refused = closed_port_url(dbs.backend);
    let tickets = format!("[ids]\nservers = [{{ name = \"t0\", url = \"{refused}\" }}]\n");
    let lazy = "connect_timeout_secs = 1\ncreate_databases = true\nconnect_lazy = true\n";
    for (url, cause_says) in [
        (refused.to_owned(), "refused"),
        (hung.url(dbs.backend), "within 1000 ms"),
    ] {
        let started = Instant::now();
        let cluster = Cluster::connect(config_with_s1(dbs, lazy, &url, &tickets))
            .await
            .unwrap_or_else(|e| panic!("{url}: {}", e.report()));
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(4),
            "{url}: connect took {took:?}"
        );

        let up = key_on(&cluster, "s0").await;
        let tx = cluster.begin::<Customer>(up).await.unwrap();
        tx.insert(customer::ActiveModel {
            id: Set(up),
            name: Set("up".into()),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let found = cluster
            .find::<customer::Entity>()
            .key(up)
            .all()
            .await
            .unwrap();
        assert_eq!(found.len(), 1);
        customer::Entity::delete_by_id(up)
            .exec(cluster.connection("s0").unwrap())
            .await
            .unwrap();

        let down = key_on(&cluster, "s1").await;
        let err = cluster.begin::<Customer>(down).await.unwrap_err();
        assert_unavailable(&err, "s1", &[cause_says]);
        println!("{:?}: lazy connect with s1 at {url}: {took:?}", dbs.backend);

        // Not lazy: the shard's own cause, at once, not "could not be created".
        let eager = "connect_timeout_secs = 1\ncreate_databases = true\n";
        let started = Instant::now();
        let err = Cluster::connect(config_with_s1(dbs, eager, &url, ""))
            .await
            .unwrap_err();
        let took = started.elapsed();
        match &err {
            ShardError::Connect { shard, cause, .. } => {
                assert_eq!(shard, "s1");
                assert!(
                    cause.message().to_lowercase().contains(cause_says),
                    "{cause}"
                );
                assert!(!cause.message().contains("could not be created"), "{cause}");
            }
            other => panic!("expected Connect, got {other:?}"),
        }
        assert!(
            took < Duration::from_secs(4),
            "{url}: connect took {took:?}"
        );
    }
}

/// A shard that accepts connections and never answers: the first request
/// fails after the connect timeout (1 s here) instead of the acquire
/// timeout, later ones at once and without opening a connection.
pub(crate) async fn hung_shard_fails_fast_with_its_cause(dbs: &mut TestDbs) {
    let hung = Hung::start().await;
    let url = hung.url(dbs.backend);
    let pool = "connect_timeout_secs = 1\n";
    let started = Instant::now();
    let err = Cluster::connect(config_with_s1(dbs, pool, &url, ""))
        .await
        .unwrap_err();
    let connect_took = started.elapsed();
    assert!(
        matches!(&err, ShardError::Connect { shard, cause, .. } if shard == "s1" && cause.message().contains("within 1000 ms")),
        "{err:?}"
    );
    assert!(
        connect_took < Duration::from_secs(5),
        "connect took {connect_took:?}"
    );

    let pool = "connect_timeout_secs = 1\nconnect_lazy = true\n";
    let cluster = Cluster::connect(config_with_s1(dbs, pool, &url, ""))
        .await
        .unwrap();
    let down = key_on(&cluster, "s1").await;
    let started = Instant::now();
    let err = cluster.begin::<Customer>(down).await.unwrap_err();
    let first = started.elapsed();
    assert_unavailable(&err, "s1", &["within 1000 ms"]);
    assert!(first < Duration::from_secs(5), "first begin took {first:?}");

    let accepted = hung.accepted();
    let started = Instant::now();
    let err = cluster
        .find::<customer::Entity>()
        .key(down)
        .one()
        .await
        .unwrap_err();
    let second = started.elapsed();
    assert_unavailable(&err, "s1", &["within 1000 ms"]);
    println!(
        "{:?}: hung connect {connect_took:?}, first begin {first:?}, read once down {second:?}",
        dbs.backend
    );
    assert!(second < Duration::from_millis(200), "read took {second:?}");
    // Failing fast opened nothing (the background probe may, later).
    assert!(hung.accepted() <= accepted + 1);

    // The background probe keeps trying (each try is a connection the hung
    // server accepts) while the cluster lives, and stops once it is dropped.
    let before = hung.accepted();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(hung.accepted() > before, "no background probe ran");
    drop(cluster);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after_drop = hung.accepted();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        hung.accepted(),
        after_drop,
        "a probe ran after the cluster was dropped"
    );
}

/// A shard cut off (its proxy killed) is marked down; once the proxy
/// listens again, the background probe brings it back and requests succeed.
pub(crate) async fn down_shard_comes_back_once_reachable(dbs: &mut TestDbs) {
    let server = dbs.backend.server_address().unwrap();
    let proxy = Proxy::start(server.clone()).await;
    let port = proxy.port;
    let url = match dbs.backend {
        Backend::MySql => format!("mysql://root@127.0.0.1:{port}/{}", dbs.names[1]),
        _ => format!("postgres://postgres@127.0.0.1:{port}/{}", dbs.names[1]),
    };
    let cluster = Cluster::connect(config_with_s1(dbs, "", &url, ""))
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let key = key_on(&cluster, "s1").await;
    let tx = cluster.begin::<Customer>(key).await.unwrap();
    tx.insert(customer::ActiveModel {
        id: Set(key),
        name: Set("back".into()),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();

    proxy.kill();
    // Pooled connections die with the proxy; the shard is marked down once
    // a request finds no way to connect.
    let deadline = Instant::now() + Duration::from_secs(10);
    let cause = loop {
        match cluster.find::<customer::Entity>().key(key).one().await {
            Err(ShardError::Unavailable { cause, .. }) => break cause,
            _ if Instant::now() < deadline => {}
            other => panic!("the shard was never marked down: {other:?}"),
        }
    };
    assert!(cause.to_lowercase().contains("refused"), "{cause}");

    let _proxy = Proxy::start_on(port, server).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let row = loop {
        match cluster.find::<customer::Entity>().key(key).one().await {
            Ok(row) => break row,
            Err(ShardError::Unavailable { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("the shard did not come back: {other:?}"),
        }
    };
    assert_eq!(row.map(|r| r.name), Some("back".to_owned()));
}

/// A read the application gives up on mid-statement (a timeout, a dropped
/// request) while its server answers nothing on that connection: the
/// connection goes back to the pool still waiting for the answer, and the
/// pool closes it instead of keeping it (its check is bounded): the next
/// read on the pool of one gets a new connection, and nothing stays open.
pub(crate) async fn a_connection_left_mid_statement_is_closed_not_kept(dbs: &mut TestDbs) {
    let server = dbs.backend.server_address().unwrap();
    let before = dbs.server_connections().await;
    let proxy = Proxy::start(server).await;
    // Without TLS: sqlx closes a TLS connection by waiting for its peer's
    // answer, which a server that answers nothing never sends.
    let url = match dbs.backend {
        Backend::MySql => format!(
            "mysql://root@127.0.0.1:{}/{}?ssl-mode=disabled",
            proxy.port, dbs.names[0]
        ),
        _ => format!(
            "postgres://postgres@127.0.0.1:{}/{}?sslmode=disable",
            proxy.port, dbs.names[0]
        ),
    };
    // The acquire timeout is well past the pool's bound on its check; no
    // ping before a connection is handed out, so the read's statement is
    // what meets the frozen connection (a ping there would be dropped with
    // the read, and its connection with it).
    let toml = format!(
        "[pool]\nmax_connections = 1\nacquire_timeout_secs = 30\ntest_before_acquire = false\n\n\
         [[shards]]\nname = \"s0\"\nurl = \"{url}\"\n\n[groups.Customer]\n"
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let tx = cluster.begin::<Customer>(1).await.unwrap();
    tx.insert(customer::ActiveModel {
        id: Set(1),
        name: Set("kept".into()),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // Back in the pool (its return, a ping, has been answered), the pool's
    // one connection stops answering; the read is given up.
    let db = cluster.connection("s0").unwrap();
    let idle = || match dbs.backend {
        Backend::MySql => db.get_mysql_connection_pool().num_idle(),
        _ => db.get_postgres_connection_pool().num_idle(),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while idle() == 0 {
        assert!(
            Instant::now() < deadline,
            "the connection never went back to its pool"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.freeze_open();
    let given_up = tokio::time::timeout(
        Duration::from_millis(300),
        cluster.find::<customer::Entity>().key(1).one(),
    )
    .await;
    assert!(given_up.is_err(), "the frozen read answered: {given_up:?}");
    let row = cluster
        .find::<customer::Entity>()
        .key(1)
        .one()
        .await
        .expect("a new connection once the stuck one is closed");
    assert_eq!(row.map(|r| r.name), Some("kept".to_owned()));
    drop(cluster);
    // The proxy holds the frozen connection's server side open.
    proxy.killed().await;
    dbs.assert_connections_settle(before).await;
}

/// `by_index(..).partial()` when the shard holding the index row is down
/// (refused, an empty SQLite file) or hung: the healthy owners' rows come
/// back with that shard in `failed`, within the read's timeout; a strict
/// read fails naming it.
pub(crate) async fn index_read_partial_reports_a_down_index_shard(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    for column in [contact::Column::Email, contact::Column::Phone] {
        cluster
            .gsi()
            .backfill::<contact::Entity>(column)
            .await
            .unwrap();
    }
    // Three customers on s0 share a phone number indexed on s1.
    let mut n = 0;
    let phone = value_elsewhere(&cluster, "phone", "s0", &mut n);
    let mut owners = Vec::new();
    let mut key = 0_i64;
    while owners.len() < 3 {
        key += 1;
        if cluster.shard_of::<Customer>(&key).await.unwrap() != "s0" {
            continue;
        }
        let tx = cluster.begin::<Customer>(key).await.unwrap();
        tx.insert(contact::ActiveModel {
            id: Set(key),
            customer_id: Set(key),
            email: Set(format!("c{key}@x")),
            phone: Set(phone.clone()),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        owners.push(key);
    }
    drop(cluster);

    let read = |cluster: Cluster, timeout: Option<Duration>| {
        let phone = phone.clone();
        async move {
            let mut find = cluster
                .find::<contact::Entity>()
                .by_index(contact::Column::Phone, phone.as_str());
            if let Some(t) = timeout {
                find = find.timeout(t);
            }
            let started = Instant::now();
            let partial = find.partial().all().await.unwrap();
            (partial, started.elapsed())
        }
    };
    let check = |partial: &shardkit::read::Partial<Vec<contact::Model>>| {
        let mut ids: Vec<i64> = partial.rows.iter().map(|r| r.id).collect();
        ids.sort();
        assert_eq!(ids, owners);
        assert_eq!(partial.failed_shards(), vec!["s1"]);
    };

    // Refused (an empty database on SQLite): no timeout needed.
    let down = Cluster::connect(
        ClusterConfig::from_toml(&format!(
            "{}\n[groups.Customer]\n",
            dbs.shards_toml_with(2, "connect_lazy = true\n", &[1])
        ))
        .unwrap(),
    )
    .await
    .unwrap();
    let (partial, took) = read(down.clone(), None).await;
    check(&partial);
    println!(
        "{:?}: by_index partial, index shard down: {took:?}",
        dbs.backend
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let strict = down
        .find::<contact::Entity>()
        .by_index(contact::Column::Phone, phone.as_str())
        .all()
        .await
        .unwrap_err();
    assert!(
        matches!(&strict, ShardError::ShardsFailed { failures, .. } if failures.iter().any(|f| f.shard == "s1")),
        "{strict:?}"
    );

    if dbs.backend == Backend::Sqlite {
        return;
    }
    // Hung: bounded by `.timeout`, and by `read.timeout_ms` without one.
    let hung = Hung::start().await;
    let pool = "connect_lazy = true\n";
    let by_call = Cluster::connect(config_with_s1(dbs, pool, &hung.url(dbs.backend), ""))
        .await
        .unwrap();
    let (partial, took) = read(by_call, Some(Duration::from_millis(300))).await;
    check(&partial);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let by_config = Cluster::connect(config_with_s1(
        dbs,
        pool,
        &hung.url(dbs.backend),
        "[read]\ntimeout_ms = 300\n",
    ))
    .await
    .unwrap();
    let (partial, took2) = read(by_config, None).await;
    check(&partial);
    println!(
        "{:?}: by_index partial, index shard hung: .timeout {took:?}, read.timeout_ms {took2:?}",
        dbs.backend
    );
    assert!(took2 < Duration::from_secs(5), "took {took2:?}");
}
