//! What a move reads and touches: an instance that has not refreshed, paused
//! movers, tables in schemas and shared databases, shards that reach one
//! database, a fence read the database aborts.

use super::*;

/// After a move's flip, an instance that has not read the map since reads a
/// moved key from the old owner: the row as it was at the flip, never
/// missing while the old copies wait out `cleanup_grace_ms`. A read inside a
/// transaction is the owner's (the transaction checks the bucket's fence on
/// its shard and is rerouted), and the instance's reads follow from then on.
pub(crate) async fn an_instance_that_has_not_refreshed_reads_a_moved_row_as_at_the_flip(
    dbs: &mut TestDbs,
) {
    let toml = toml_with(
        dbs,
        &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
        0,
    )
    .replace("cleanup_grace_ms = 0", "cleanup_grace_ms = 600000");
    let config = ClusterConfig::from_toml(&toml).unwrap();
    let a = Cluster::connect(config.clone()).await.unwrap();
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=20).await;
    let stale_clock = Arc::new(shardkit::clock::ManualClock::starting_now());
    let stale = connect_on(config.clone(), stale_clock.clone()).await;
    stale.refresh_bucket_maps().await.unwrap();
    // A third instance, as stale, that only reads with a session.
    let other = Cluster::connect(config).await.unwrap();
    other.refresh_bucket_maps().await.unwrap();
    // On servers, a fourth, as stale, that reaches the control shard (s0)
    // through a proxy, with a read timeout of 500 ms (and a connect timeout
    // of 3 s, which also bounds the wait for a pooled connection).
    let control = match dbs.backend.server_address() {
        Some(server) => {
            let proxy = Proxy::start(server).await;
            let shards = dbs
                .shards_toml_through(5, "connect_timeout_secs = 3\n", &[(0, proxy.port)])
                .replace("max_connections = 4", "max_connections = 2");
            let toml = format!(
                "{shards}\n[groups.Customer]\nbuckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true\n\n[rebalance]\nrefresh_ms = 0\ncleanup_grace_ms = 600000\nchunk = 40\n\n[read]\ntimeout_ms = 500\n"
            );
            let clock = Arc::new(shardkit::clock::ManualClock::starting_now());
            let through = connect_on(ClusterConfig::from_toml(&toml).unwrap(), clock.clone()).await;
            through.refresh_bucket_maps().await.unwrap();
            Some((proxy, through, clock))
        }
        None => None,
    };
    let read = name_of_first;
    assert_eq!(read(&stale).await, Some(first_name(1)));
    let m = mover(&a);
    let id = m
        .start(&m.plan_buckets([bucket(1)], "s4").await.unwrap())
        .await
        .unwrap()
        .id;
    // The old copies wait out the grace period.
    assert_eq!(m.run(id).await.unwrap().phase, MovePhase::Cleaning);
    a.refresh_bucket_maps().await.unwrap();
    write_round(&a, &acked, 1, 1).await.unwrap();
    // The stale instance reads the row as it was at the flip.
    assert_eq!(read(&stale).await, Some(first_name(1)));
    // A transaction reads the owner's row.
    let inside = stale
        .transaction::<Customer, _, _>(
            1,
            |tx| async move { tx.find::<customer::Entity>().one().await },
        )
        .await
        .unwrap()
        .map(|m| m.name);
    assert_eq!(inside.as_deref(), Some("c1-r1"));
    // The rerouted transaction refreshed the map: reads follow.
    assert_eq!(read(&stale).await.as_deref(), Some("c1-r1"));
    // Once its map is older than half the cleanup grace, a read goes on by
    // it and the map is read again in the background; past three quarters,
    // a read reads the map first (the old owner may have cleaned a moved
    // bucket's rows by the time the read's statement runs).
    let before = map_read_at(&stale);
    stale_clock.advance(std::time::Duration::from_secs(301));
    assert_eq!(read(&stale).await.as_deref(), Some("c1-r1"));
    map_read_again(&stale, before, "a stale map was not read in the background").await;
    let before = map_read_at(&stale);
    stale_clock.advance(std::time::Duration::from_secs(451));
    assert_eq!(read(&stale).await.as_deref(), Some("c1-r1"));
    assert!(
        map_read_at(&stale) > before,
        "an expired map was not read before a read"
    );

    // Read-your-writes across instances: a session records the bucket map
    // its commit was routed by, and an instance with an older map reads
    // the map again before it routes the session's read, so it reads the
    // new owner's row, not the old owner's as it was at the flip.
    let session = shardkit::Session::new();
    a.transaction_in::<Customer, _, _>(&session, 1, |tx| async move {
        tx.update(customer::ActiveModel {
            id: sea_orm::ActiveValue::Unchanged(1),
            name: Set("c1-session".to_owned()),
        })
        .await
    })
    .await
    .unwrap();
    let carried: shardkit::Session = session.to_string().parse().unwrap();
    let text = carried.to_string();
    assert!(
        text.ends_with(&format!("Customer=map:{}", epoch(&a))),
        "{text}"
    );
    let before = epoch(&other);
    assert!(before < epoch(&a));
    let with_session = other
        .find::<customer::Entity>()
        .key(1)
        .consistency(shardkit::Consistency::at_least(&carried))
        .one()
        .await
        .unwrap_or_else(|e| panic!("read with the session: {}", e.report()))
        .map(|m| m.name);
    assert_eq!(with_session.as_deref(), Some("c1-session"));
    // A control database that accepts and never answers: the read with the
    // session fails within its timeout, naming the control shard, instead
    // of waiting for the map (or reading the old owner's row).
    if let Some((proxy, through, clock)) = control {
        proxy.freeze();
        let started = std::time::Instant::now();
        let hung = through
            .find::<customer::Entity>()
            .key(1)
            .consistency(shardkit::Consistency::at_least(&carried))
            .one()
            .await
            .unwrap_err();
        assert!(
            matches!(&hung, ShardError::Timeout { shard, .. } if shard == "s0"),
            "{hung}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        // Its map is now older than half the cleanup grace, still safe to
        // route by: a read (without a session) goes on by it while the map
        // is read again in the background, and does not wait for the
        // control database (before, the read waited for the pool: here
        // 3 s, by default 30 s, for good with `test_before_acquire` off).
        clock.advance(std::time::Duration::from_secs(301));
        let started = std::time::Instant::now();
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(20),
            through.find::<customer::Entity>().key(1).one(),
        )
        .await
        .expect("a read waited on a control database that never answers");
        read.unwrap_or_else(|e| {
            panic!("a read after a map refresh that timed out: {}", e.report())
        });
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        // Past three quarters of the grace since the map's last successful
        // read (the attempts since failed), a bucket moved since may have
        // been cleaned from the shard the map names: reads are refused,
        // each within its timeout, rather than routed by it (before, a
        // failed attempt counted as a read, and the read went to the old
        // owner). Eight at once, on pools of 2.
        clock.advance(std::time::Duration::from_secs(150));
        let eight_refused = || async {
            let started = std::time::Instant::now();
            let reads = futures::future::join_all(
                (0..8).map(|_| through.find::<customer::Entity>().key(1).one()),
            )
            .await;
            for read in reads {
                let refused = read.unwrap_err();
                assert!(
                    matches!(
                        &refused,
                        ShardError::BucketMapExpired { group: "Customer", cause, .. }
                            if cause.contains("`s0`")
                    ),
                    "{}",
                    refused.report()
                );
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(2),
                "{:?}",
                started.elapsed()
            );
        };
        eight_refused().await;
        // A control database that refuses connections: the same refusal,
        // at once, saying why.
        proxy.killed().await;
        eight_refused().await;
        // Once the control database answers again, the map is read and
        // reads go on: a refusal is not kept past the outage. (The breaker
        // spaces its probes by the instance's clock, moved on here.)
        let port = proxy.port;
        drop(proxy);
        let server = dbs.backend.server_address().unwrap();
        let back = Proxy::start_on(port, server).await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        let read = loop {
            match through.find::<customer::Entity>().key(1).one().await {
                Ok(row) => break row.map(|m| m.name),
                Err(e) => assert!(
                    std::time::Instant::now() < deadline,
                    "reads still refused after the control database came back: {}",
                    e.report()
                ),
            }
            clock.advance(std::time::Duration::from_secs(1));
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        assert_eq!(read.as_deref(), Some("c1-session"));
        drop(through);
        back.killed().await;
    }
    assert_eq!(epoch(&other), epoch(&a));
    // A session from a map the control database never had (another
    // cluster's, or one made up) is read by the control database's map.
    let ahead: shardkit::Session = format!("Customer=map:{}", epoch(&a) + 100).parse().unwrap();
    for _ in 0..2 {
        let read = other
            .find::<customer::Entity>()
            .key(1)
            .consistency(shardkit::Consistency::at_least(&ahead))
            .one()
            .await
            .unwrap_or_else(|e| panic!("read with a session ahead: {}", e.report()))
            .map(|m| m.name);
        assert_eq!(read.as_deref(), Some("c1-session"));
    }
    assert_eq!(epoch(&other), epoch(&a));
    // A control database that lost the group's map (restored from a copy
    // older than the first move) answers, but is not a read of the map:
    // once the instance's map has expired, its reads are refused, saying
    // why, rather than routed by a map no longer confirmed.
    a.connection("s0")
        .unwrap()
        .execute_unprepared("DELETE FROM shardkit_bucket_epochs; DELETE FROM shardkit_bucket_map")
        .await
        .unwrap();
    stale_clock.advance(std::time::Duration::from_secs(451));
    let refused = stale
        .find::<customer::Entity>()
        .key(1)
        .one()
        .await
        .unwrap_err();
    assert!(
        matches!(
            &refused,
            ShardError::BucketMapExpired { group: "Customer", age: Some(_), cause, .. }
                if cause.contains("holds no bucket map as new as this instance's")
        ),
        "{}",
        refused.report()
    );
}

/// A mover paused inside its write transaction (holding the fence's shared
/// lock, as a process stopped mid-statement would) does not block the
/// process that takes the move over: the server ends the idle transaction
/// after the hold's length (PostgreSQL's
/// `idle_in_transaction_session_timeout`, MariaDB's
/// `idle_transaction_timeout`), the new mover's fence goes in and it
/// finishes the move; the paused mover's write never lands.
pub(crate) async fn a_mover_paused_inside_its_transaction_does_not_block_the_next(
    dbs: &mut TestDbs,
) {
    paused_mover_then_take_over(dbs, "shardkit::rebalance::park_open::copy").await;
}

/// A mover paused between two sends of a `COPY`'s data (PostgreSQL to
/// PostgreSQL), the fence's shared lock held: the server's idle bound does
/// not end a `COPY` waiting for its data, so the process that takes the
/// move over ends that session (it is named for the move and its
/// generation), installs its fence and finishes the move; the paused
/// mover's chunk never lands.
pub(crate) async fn a_mover_paused_while_sending_a_copy_does_not_block_the_next(dbs: &mut TestDbs) {
    paused_mover_then_take_over(dbs, "shardkit::rebalance::park_sending::copy").await;
}

/// A table in a named schema (`shardkit_shared_test.notes`) moves like the others while
/// eight writers on pools of 2 add to it, between PostgreSQL shards with
/// `COPY` into the schema's table: its columns are
/// checked there, its rows land there on the target and leave the sources,
/// and the table of the same name in the search path (the migration's
/// `public.notes`, with other columns) is not touched.
pub(crate) async fn a_table_in_a_named_schema_moves_with_copy(dbs: &mut TestDbs) {
    let (a, copies) = copy_observed(dbs).await;
    a.migrate::<Migrator>().await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    let columns = "(id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, body TEXT NOT NULL)";
    for shard in a.topology().shard_names() {
        a.connection(shard)
            .unwrap()
            .execute_unprepared(&format!(
                "CREATE SCHEMA shardkit_shared_test; CREATE TABLE shardkit_shared_test.notes {columns}"
            ))
            .await
            .unwrap();
    }
    // Notes acknowledged to the application: (id, key).
    let acked: Arc<Mutex<Vec<(i64, i64)>>> = Arc::default();
    let add = |cluster: Cluster, acked: Arc<Mutex<Vec<(i64, i64)>>>, key: i64, id: i64| async move {
        cluster
            .transaction::<Customer, _, _>(key, |tx| async move {
                tx.insert_without_returning(server_note::ActiveModel {
                    id: Set(id),
                    customer_id: Set(key),
                    body: Set(first_name(id)),
                })
                .await
            })
            .await
            .unwrap_or_else(|e| panic!("note {id} of {key}: {}", e.report()));
        acked.lock().unwrap().push((id, key));
    };
    for key in 1..=120i64 {
        for id in [key * 10, key * 10 + 1] {
            add(a.clone(), Arc::clone(&acked), key, id).await;
        }
    }
    // Eight writers on the instance's pools of 2 while the move runs (the
    // change log and its replay, in the schema's table).
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..8i64)
        .map(|w| {
            let (a, acked, stop, add) = (a.clone(), Arc::clone(&acked), Arc::clone(&stop), add);
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let key = 1 + (w + 8 * n) % 120;
                    add(a.clone(), Arc::clone(&acked), key, 100_000 + 8 * n + w).await;
                    n += 1;
                }
            })
        })
        .collect();
    let m = mover(&a).entity::<server_note::Entity>();
    let plan = m.plan_buckets(quarter(), "s4").await.unwrap();
    let id = m.start(&plan).await.unwrap().id;
    let done = m
        .run(id)
        .await
        .unwrap_or_else(|e| panic!("the move: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done);
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    a.refresh_bucket_maps().await.unwrap();

    // Every note on its key's owner, once, as written.
    let found = placed::<server_note::Entity, _>(&a, |n| (n.id, (n.customer_id, n.body))).await;
    for shard in a.topology().shard_names() {
        let db = a.connection(shard).unwrap();
        let decoy = db
            .query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT count(*) AS n FROM public.notes",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get::<i64>("", "n")
            .unwrap();
        assert_eq!(decoy, 0, "public.notes on {shard} was written");
    }
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() > 240, "no note written during the move");
    assert_eq!(found.len(), acked.len());
    let owner = owners(&a);
    for &(id, key) in &acked {
        assert_eq!(
            owner(key) == "s4",
            bucket(key).is_multiple_of(4),
            "owner of {key}"
        );
        assert_eq!(
            found[&id],
            vec![(owner(key), (key, first_name(id)))],
            "note {id} (bucket {})",
            bucket(key)
        );
    }
    // Routed to it.
    for key in 1..=120i64 {
        let read = a
            .find::<server_note::Entity>()
            .key(key)
            .all()
            .await
            .unwrap_or_else(|e| panic!("notes of {key}: {}", e.report()));
        let written = acked.iter().filter(|(_, k)| *k == key).count();
        assert_eq!(read.len(), written, "notes of {key}");
    }
    // Written with `COPY` into the schema's table.
    let copies = copies.lock().unwrap();
    assert!(
        copies.iter().any(|(shard, sql)| shard == "s4"
            && sql.starts_with(r#"COPY "shardkit_shared_test"."notes""#)),
        "no COPY into shardkit_shared_test.notes on s4 observed: {copies:?}"
    );
}

/// On MySQL/MariaDB an entity's `schema_name` names a database of the
/// server, so with shards that are databases of one server its table is
/// one table for them all: a move would copy its rows onto themselves and
/// then delete them from the source. The move is refused when it is
/// started, naming the table and the shards, and nothing is registered.
/// Moves that got past the check (as by an earlier build) are aborted, or
/// cleaned up, without deleting a note from the one table: every note is
/// still there, once, and found by its key.
pub(crate) async fn a_table_in_a_database_every_shard_shares_is_not_moved(dbs: &mut TestDbs) {
    let a = connect(dbs, 20).await;
    a.migrate::<Migrator>().await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    let db = a.connection("s0").unwrap();
    for sql in [
        "CREATE DATABASE IF NOT EXISTS shardkit_shared_test",
        "DROP TABLE IF EXISTS shardkit_shared_test.notes",
        "CREATE TABLE shardkit_shared_test.notes \
         (id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, body TEXT NOT NULL)",
    ] {
        db.execute_unprepared(sql).await.unwrap();
    }
    add_notes(&a).await;
    let m = a
        .rebalance::<Customer>()
        .unwrap()
        .entity::<server_note::Entity>();
    let plan = m.plan_buckets(quarter(), "s4").await.unwrap();
    let reason = start_refused(&m, &plan).await;
    assert!(
        reason.starts_with("`shardkit_shared_test.notes` would be the same table on shards `s")
            && reason.contains("and `s4`: they are databases of one MySQL/MariaDB server"),
        "{reason}"
    );
    // Moves that got past the check (registered and run as by a build
    // without it): one aborted, one run to the end. Neither deletes a note
    // from the one table, and each note is found by its key afterwards.
    {
        let _turn = FAILPOINTS.lock().await;
        fail::cfg(
            "shardkit::rebalance::tables_apart_unchecked",
            &format!("return({})", dbs.scope_of(4)),
        )
        .unwrap();
        let aborted = async {
            let id = m.start(&plan).await?.id;
            m.abort(id).await
        }
        .await;
        let done = async {
            let id = m.start(&plan).await?.id;
            m.run(id).await
        }
        .await;
        fail::remove("shardkit::rebalance::tables_apart_unchecked");
        let phase = |r: shardkit::Result<shardkit::rebalance::MoveStatus>| {
            r.unwrap_or_else(|e| panic!("{}", e.report())).phase
        };
        assert_eq!(phase(aborted), MovePhase::Aborted);
        assert_eq!(phase(done), MovePhase::Done);
    }
    a.refresh_bucket_maps().await.unwrap();
    for key in 1..=40i64 {
        let found = a
            .find::<server_note::Entity>()
            .key(key)
            .all()
            .await
            .unwrap_or_else(|e| panic!("notes of {key}: {}", e.report()));
        assert_eq!(found.len(), 1, "notes of {key}");
    }
    let notes = db
        .query_all_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            "SELECT id, customer_id, body FROM shardkit_shared_test.notes ORDER BY id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| {
            let id: i64 = row.try_get("", "id").unwrap();
            let key: i64 = row.try_get("", "customer_id").unwrap();
            let body: String = row.try_get("", "body").unwrap();
            (id, key, body)
        })
        .collect::<Vec<_>>();
    let expected: Vec<_> = (1..=40i64).map(|k| (k, k, first_name(k))).collect();
    assert_eq!(notes, expected);
    db.execute_unprepared("DROP DATABASE shardkit_shared_test")
        .await
        .unwrap();
}

/// Notes 1..=40, each of its own customer, in `server_note`'s table.
pub(crate) async fn add_notes(cluster: &Cluster) {
    for key in 1..=40i64 {
        cluster
            .transaction::<Customer, _, _>(key, |tx| async move {
                tx.insert_without_returning(server_note::ActiveModel {
                    id: Set(key),
                    customer_id: Set(key),
                    body: Set(first_name(key)),
                })
                .await
            })
            .await
            .unwrap_or_else(|e| panic!("note of {key}: {}", e.report()));
    }
}

/// The reason `start` refused `plan` with, before registering anything.
pub(crate) async fn start_refused(
    m: &Rebalance<Customer>,
    plan: &shardkit::rebalance::MovePlan,
) -> String {
    match m.start(plan).await {
        Err(ShardError::Rebalance {
            id: None, reason, ..
        }) => {
            assert_eq!(
                m.list(true).await.unwrap().len(),
                0,
                "a move was registered"
            );
            reason
        }
        other => panic!("a move that would copy rows onto themselves: {other:?}"),
    }
}

/// The config with shard s4 reached by `url` instead of its own database.
pub(crate) fn with_s4_at(dbs: &TestDbs, url: &str) -> ClusterConfig {
    let toml = toml_with(
        dbs,
        &format!("buckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]"),
        20,
    );
    let own = match dbs.backend {
        Backend::Sqlite => format!(
            "name = \"s4\"\nurl = \"sqlite://{}?mode=rwc\"\n",
            dbs.names[4]
        ),
        _ => format!(
            "name = \"s4\"\nhost = \"server\"\ndatabase = \"{}\"\n",
            dbs.names[4]
        ),
    };
    assert!(toml.contains(&own), "{toml}");
    let toml = toml.replace(&own, &format!("name = \"s4\"\nurl = \"{url}\"\n"));
    ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("config: {e}\n{toml}"))
}

/// Every customer is read by its key, as written.
pub(crate) async fn each_customer_found(cluster: &Cluster, acked: &Shared) {
    let customers = acked.lock().unwrap().customers.clone();
    for (id, name) in customers {
        let found = cluster
            .find::<customer::Entity>()
            .key(id)
            .one()
            .await
            .unwrap_or_else(|e| panic!("customer {id}: {}", e.report()));
        assert_eq!(found.map(|c| c.name), Some(name), "customer {id}");
    }
}

/// Shard s4's URL reaches s0's database, spelled another way (a parameter
/// that changes nothing; for SQLite, the file's path through `./`), so the
/// config's check for one database named twice lets it through. A move
/// from s0 to s4 would copy every row onto itself and then delete the
/// moved buckets' rows: it is refused when it starts, naming the tables and
/// the shards, nothing is registered, and every customer is still found.
pub(crate) async fn a_shard_whose_url_reaches_another_shards_database_takes_no_move(
    dbs: &mut TestDbs,
) {
    let alias = match dbs.backend {
        Backend::Sqlite => {
            let path = std::path::Path::new(&dbs.names[0]);
            format!(
                "sqlite://{}/./{}?mode=rwc",
                path.parent().unwrap().display(),
                path.file_name().unwrap().to_string_lossy()
            )
        }
        Backend::Postgres => format!(
            "{}/{}?application_name=alias",
            dbs.backend.server_url().unwrap(),
            dbs.names[0]
        ),
        Backend::MySql => format!(
            "{}/{}?charset=utf8mb4",
            dbs.backend.server_url().unwrap(),
            dbs.names[0]
        ),
    };
    // Seeded by an instance with s4's own database; then s4's URL is
    // changed to the alias (a shard added to the config by mistake at
    // another shard's database) and that instance migrates, which finds
    // every migration applied.
    let seeded = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&seeded, &acked, 1..=40).await;
    drop(seeded);
    let a = Cluster::connect(with_s4_at(dbs, &alias)).await.unwrap();
    a.migrate::<Migrator>().await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    let m = mover(&a);
    let plan = m.plan_buckets(quarter(), "s4").await.unwrap();
    let why = match dbs.backend {
        Backend::Postgres => {
            "they are one PostgreSQL database, and the table each one's search path finds is the same"
        }
        _ => "the two shards' URLs reach one database",
    };
    let reason = start_refused(&m, &plan).await;
    // The group's tables, the outbox's among them.
    assert!(
        reason.starts_with("`customers`, `orders`, `contacts`, `shardkit_outbox`, ")
            && reason.contains(&format!(
                "would each be one table on shards `s0` and `s4`: {why}, so the move would copy the rows onto themselves"
            ))
            && reason.contains("give each shard a database of its own in the config"),
        "{reason}"
    );
    each_customer_found(&a, &acked).await;
}

/// Shard s4 is schema `shard4` of s0's database (its URL sets the search
/// path). Tables the search path finds are each shard's own, and move: the
/// Customer group's quarter of the buckets goes to s4 and every customer and
/// order is then on its owner, once. A table in a named schema (`shardkit_shared_test.notes`)
/// is one table for s0 and s4: a move that lists it is refused at start,
/// naming it, and nothing is registered.
pub(crate) async fn shards_that_are_schemas_of_one_database_move_their_own_tables_only(
    dbs: &mut TestDbs,
) {
    let server = dbs.backend.server_url().unwrap();
    let s0 = sea_orm::Database::connect(format!("{server}/{}", dbs.names[0]))
        .await
        .unwrap();
    s0.execute_unprepared("CREATE SCHEMA shard4").await.unwrap();
    let url = format!(
        "{server}/{}?options=-c%20search_path%3Dshard4",
        dbs.names[0]
    );
    let a = Cluster::connect(with_s4_at(dbs, &url)).await.unwrap();
    let acked: Shared = Arc::default();
    seed(&a, &acked, 1..=40).await;
    let columns = "(id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, body TEXT NOT NULL)";
    for shard in ["s0", "s1", "s2", "s3"] {
        a.connection(shard)
            .unwrap()
            .execute_unprepared(&format!(
                "CREATE SCHEMA shardkit_shared_test; CREATE TABLE shardkit_shared_test.notes {columns}"
            ))
            .await
            .unwrap();
    }
    add_notes(&a).await;
    let with_notes = mover(&a).entity::<server_note::Entity>();
    let plan = with_notes.plan_buckets(quarter(), "s4").await.unwrap();
    let reason = start_refused(&with_notes, &plan).await;
    assert!(
        reason.starts_with(
            "`shardkit_shared_test.notes` would be the same table on shards `s0` and `s4`: they are one PostgreSQL database (each with its own search path)"
        ),
        "{reason}"
    );

    let m = mover(&a);
    let id = m.start(&plan).await.unwrap().id;
    let done = m
        .run(id)
        .await
        .unwrap_or_else(|e| panic!("the move: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done);
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
    let owner = owners(&a);
    assert!(
        (1..=40i64).any(|k| owner(k) == "s4"),
        "no customer moved to s4"
    );
    // In s4's own schema, not s0's tables.
    let in_shard4 = s0
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT count(*) AS n FROM shard4.customers",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get::<i64>("", "n")
        .unwrap();
    let moved = (1..=40i64).filter(|k| owner(*k) == "s4").count();
    assert_eq!(in_shard4, moved as i64);
    s0.close().await.unwrap();
}

/// The first mover parks at failpoint `at` (on the move's target); a
/// second instance's mover takes the move over and finishes it.
pub(crate) async fn paused_mover_then_take_over(dbs: &mut TestDbs, at: &str) {
    let (a, acked, stop, w) = seeded_with_writer(dbs, 40).await;
    let b = ahead_instance(dbs).await;
    let target_db = dbs.names[4].clone();
    let _turn = FAILPOINTS.lock().await;
    let parked = count_parks();
    let m = mover(&a);
    let id = m
        .start(&m.plan_buckets([bucket(1), bucket(2)], "s4").await.unwrap())
        .await
        .unwrap()
        .id;
    fail::cfg(at, &format!("return({target_db}@1)")).unwrap();
    let first = tokio::spawn(async move { m.run(id).await });
    until("parked inside its transaction", || {
        parked.load(Ordering::SeqCst) > 0
    })
    .await;
    let started = std::time::Instant::now();
    let done = mover(&b)
        .run(id)
        .await
        .unwrap_or_else(|e| panic!("take-over: {}", e.report()));
    assert_eq!(done.phase, MovePhase::Done);
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(40),
        "the take-over waited {took:?}"
    );
    written_again(&acked, &[1, 2], "a write after the move").await;
    fail::remove(at);
    fail::remove("shardkit::rebalance::parked");
    // Its connection was closed by the server, or its write refused.
    assert!(first.await.unwrap().is_err());
    stop.store(true, Ordering::SeqCst);
    w.await.unwrap();
    a.refresh_bucket_maps().await.unwrap();
    check_placement(&a, &acked).await;
}

/// When the database aborts the fence read that opens a write transaction
/// of a movable group (a deadlock with a mover: MariaDB's 1213 during a
/// move; simulated by a failpoint), `begin` rolls back and begins again, at
/// most 5 times: the caller gets its transaction. Past that, the error says
/// to run the transaction again.
pub(crate) async fn a_begin_whose_fence_read_the_database_aborts_begins_again(dbs: &mut TestDbs) {
    const KEY: i64 = 9_999_937;
    // Before the seed: the failpoint names a key, which the backends' runs
    // share.
    let _turn = FAILPOINTS.lock().await;
    let a = connect(dbs, 20).await;
    let acked: Shared = Arc::default();
    seed(&a, &acked, [KEY]).await;
    let at = "shardkit::begin::fence_aborted";
    fail::cfg(at, &format!("return({KEY}@3)")).unwrap();
    let tx = a
        .begin::<Customer>(KEY)
        .await
        .unwrap_or_else(|e| panic!("begin after three aborts: {}", e.report()));
    tx.update(customer::ActiveModel {
        id: sea_orm::ActiveValue::Unchanged(KEY),
        name: Set("renamed".into()),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    fail::cfg(at, &format!("return({KEY})")).unwrap();
    let err = a.begin::<Customer>(KEY).await.unwrap_err();
    fail::remove(at);
    assert!(
        matches!(&err, ShardError::Db { operation, .. } if operation == "read shardkit_bucket_states")
            && err.retry() == shardkit::Retry::Transaction,
        "{}",
        err.report()
    );
    let name = a
        .find::<customer::Entity>()
        .key(KEY)
        .one()
        .await
        .unwrap()
        .map(|c| c.name);
    assert_eq!(name.as_deref(), Some("renamed"));
}
