//! Ticket sequences under the conditions that used to break them: a cluster
//! dropped with ids drawn or a prefetch in flight (the ticket pools must
//! close), a prefetch dropped with its runtime before it ran, a sequence whose table was never created (a configuration error,
//! not an outage), servers that fail (one clear message), migrations (the
//! application's tables never reach a ticket server), Flickr mode under
//! concurrency (requests run side by side) and configs whose `ids.servers`
//! differ (a server refuses a list it was not set up with).

use sea_orm::{ConnectionTrait, Database, DatabaseConnection, Statement};
use sea_orm_migration::MigratorTrait;
use shardkit::prelude::*;
use shardkit::{Cluster, ClusterConfig, DatabaseUrl};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, Hung, TestDbs};
use std::collections::HashSet;
use std::time::Duration;

/// Failpoints are process-wide and the backends' scenarios run at once:
/// a scenario holds this while it has one configured.
static FAILPOINT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Two ticket servers (databases of their own) with `ids` appended to
/// `[ids]`; returns the config and the servers' URLs.
async fn ticket_config(dbs: &mut TestDbs, ids: &str) -> (ClusterConfig, Vec<String>) {
    ticket_config_with_pool(dbs, ids, 4).await
}

/// [`ticket_config`] with pools of `pool` connections.
async fn ticket_config_with_pool(
    dbs: &mut TestDbs,
    ids: &str,
    pool: u32,
) -> (ClusterConfig, Vec<String>) {
    let mut urls = Vec::new();
    for name in ["tickets_a", "tickets_b"] {
        urls.push(dbs.extra(name).await);
    }
    let servers: Vec<String> = ["tickets_a", "tickets_b"]
        .iter()
        .zip(&urls)
        .map(|(name, url)| format!("{{ name = \"{name}\", url = \"{url}\" }}"))
        .collect();
    let toml = format!(
        "{}\n[groups.Customer]\n[ids]\nservers = [{}]\n{ids}\n",
        dbs.shards_toml(2)
            .replace("max_connections = 4", &format!("max_connections = {pool}")),
        servers.join(", ")
    );
    let config = ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    (config, urls)
}

async fn direct(url: &str) -> DatabaseConnection {
    Database::connect(url)
        .await
        .expect("connect to a ticket database")
}

/// Dropping the cluster and every handle closes the ticket pools: after
/// Flickr ids, after blocks, and while a prefetch is still in flight.
pub(crate) async fn dropping_the_cluster_closes_the_ticket_pools(dbs: &mut TestDbs) {
    let (config, _) = ticket_config(
        dbs,
        "[ids.sequences.flickr]\nblock = 1\n[ids.sequences.blocks]\nblock = 100\n",
    )
    .await;
    {
        let cluster = Cluster::connect(config.clone()).await.unwrap();
        cluster.migrate::<Migrator>().await.unwrap();
        cluster.ids().create_sequence("flickr").await.unwrap();
        cluster.ids().create_sequence("blocks").await.unwrap();
    }
    let baseline = dbs.settle_connections(0, Duration::from_secs(10)).await;
    assert_eq!(baseline, 0, "connections left by the setup cluster");

    for case in ["flickr", "blocks", "prefetch in flight"] {
        let failpoint = FAILPOINT.lock().await;
        let cluster = Cluster::connect(config.clone()).await.unwrap();
        match case {
            "flickr" => {
                for _ in 0..10 {
                    cluster.ids().next("flickr").await.unwrap();
                }
            }
            "blocks" => {
                // 150 ids: the first block, the prefetched second one, and
                // the prefetch of a third.
                let seq = cluster.ids().sequence("blocks").unwrap();
                for _ in 0..150 {
                    seq.next().await.unwrap();
                }
            }
            _ => {
                // The next prefetch (the sequence's next ticket request) waits
                // 1 s before it asks; the cluster is gone by then.
                let seq = cluster.ids().sequence("blocks").unwrap();
                seq.next().await.unwrap();
                fail::cfg("shardkit::ids::ticket::blocks", "1*return(1000)").unwrap();
                // Past 10% of the block: the prefetch starts.
                for _ in 0..20 {
                    seq.next().await.unwrap();
                }
            }
        }
        assert!(
            dbs.server_connections().await > 0,
            "{case}: the cluster holds connections"
        );
        drop(cluster);
        let left = dbs.settle_connections(0, Duration::from_secs(15)).await;
        fail::remove("shardkit::ids::ticket::blocks");
        drop(failpoint);
        assert_eq!(left, 0, "{case}: connections still open after the drop");
    }
}

/// A prefetch whose task its runtime dropped before it ran (a sequence used
/// from a runtime that then ended: a test's, a short job's) leaves the
/// sequence serving: the next caller that needs a block, on another
/// runtime, fetches it instead of waiting for a fetch that never ends.
pub(crate) async fn a_prefetch_dropped_with_its_runtime_leaves_the_sequence_serving(
    dbs: &mut TestDbs,
) {
    let (config, _) = ticket_config(dbs, "[ids.sequences.orphaned]\nblock = 10\n").await;
    let cluster = Cluster::connect(config).await.unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.ids().create_sequence("orphaned").await.unwrap();
    let seq = cluster.ids().sequence("orphaned").unwrap();
    // The first id fetches the first block and, a tenth into it, spawns the
    // prefetch of the next; its runtime ends with that id, before the
    // prefetch's task ever runs.
    let first = {
        let seq = std::sync::Arc::clone(&seq);
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(seq.next())
        })
        .join()
        .unwrap()
        .unwrap()
    };
    let mut ids = HashSet::from([first]);
    for _ in 0..25 {
        let id = tokio::time::timeout(Duration::from_secs(10), seq.next())
            .await
            .expect("the caller waited for the prefetch its runtime dropped")
            .unwrap();
        assert!(ids.insert(id), "{id} handed out twice");
    }
}

/// A sequence whose `tickets_<name>` table does not exist is refused as a
/// configuration error naming `create_sequence`, and no server is marked
/// down for it: the next ids still come from both servers.
pub(crate) async fn a_missing_sequence_is_a_config_error_not_an_outage(dbs: &mut TestDbs) {
    let (config, urls) = ticket_config(
        dbs,
        "retry_after_ms = 600000\n[ids.sequences.real]\nblock = 1\n[ids.sequences.ghost]\nblock = 1\n[ids.sequences.ghost_blocks]\nblock = 10\n",
    )
    .await;
    let cluster = Cluster::connect(config).await.unwrap();
    // `migrate` creates every configured sequence...
    cluster.migrate::<Migrator>().await.unwrap();
    for url in &urls {
        let db = direct(url).await;
        for name in ["real", "ghost", "ghost_blocks"] {
            let table = format!("tickets_{name}");
            let probe = Statement::from_string(
                db.get_database_backend(),
                format!("SELECT COUNT(*) AS n FROM {table}"),
            );
            assert!(db.query_one_raw(probe).await.is_ok(), "{url}: {table}");
        }
        // ...so the ghosts' tables are dropped behind the cluster's back.
        for ghost in ["ghost", "ghost_blocks"] {
            db.execute_unprepared(&format!("DROP TABLE tickets_{ghost}"))
                .await
                .unwrap();
        }
    }

    for ghost in ["ghost", "ghost_blocks"] {
        match cluster.ids().next(ghost).await {
            Err(ShardError::Config { entry, message }) => {
                assert_eq!(entry, format!("ids.sequences.{ghost}"));
                assert!(
                    message.contains("create_sequence")
                        && message.contains(&format!("tickets_{ghost}")),
                    "{message}"
                );
            }
            other => panic!("{ghost}: expected a config error, got {other:?}"),
        }
    }
    // Had the servers been marked down (for ten minutes), every ticket would
    // come from whichever one was asked first.
    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(cluster.ids().next("real").await.unwrap());
    }
    let odd = ids.iter().filter(|id| *id % 2 == 1).count();
    assert_eq!(odd, 10, "round-robin over both servers: {ids:?}");
}

/// Every server failing gives one `IdsUnavailable` whose message states its
/// prefix once and names each server's failure.
pub(crate) async fn failed_servers_are_reported_once(dbs: &mut TestDbs) {
    // It draws `blocks`, whose ticket requests another scenario holds with a
    // failpoint.
    let _failpoint = FAILPOINT.lock().await;
    let (config, urls) = ticket_config(
        dbs,
        "retry_after_ms = 1\n[ids.sequences.flickr]\nblock = 1\n[ids.sequences.blocks]\nblock = 10\n",
    )
    .await;
    let cluster = Cluster::connect(config).await.unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    for name in ["flickr", "blocks"] {
        cluster.ids().create_sequence(name).await.unwrap();
        cluster.ids().next(name).await.unwrap();
    }
    // Replace both servers' ticket tables with ones without an `id`: every
    // request fails on every server (it is not a missing table).
    for url in &urls {
        let db = direct(url).await;
        for name in ["flickr", "blocks"] {
            db.execute_unprepared(&format!("DROP TABLE tickets_{name}"))
                .await
                .unwrap();
            db.execute_unprepared(&format!("CREATE TABLE tickets_{name} (stub CHAR(1))"))
                .await
                .unwrap();
        }
    }
    let seq = cluster.ids().sequence("blocks").unwrap();
    // Drain the buffered blocks; then a caller needs a fresh one.
    let mut failure = None;
    for _ in 0..100 {
        if let Err(err) = seq.next().await {
            failure = Some(err);
            break;
        }
    }
    for (name, err) in [
        ("blocks", failure.expect("the blocks ran out")),
        ("flickr", cluster.ids().next("flickr").await.unwrap_err()),
    ] {
        let ShardError::IdsUnavailable { sequence, .. } = &err else {
            panic!("{name}: expected IdsUnavailable, got {err:?}");
        };
        assert_eq!(sequence, name);
        let message = err.to_string();
        assert_eq!(
            message.matches("no ticket server could serve").count(),
            1,
            "{message}"
        );
        assert!(
            message.contains("tickets_a: ") && message.contains("tickets_b: "),
            "{message}"
        );
        // `source()` walks from the ids error to the last server's failed
        // statement and on to the driver's error.
        let mut chain: Vec<&(dyn std::error::Error + 'static)> = Vec::new();
        let mut next = std::error::Error::source(&err);
        while let Some(e) = next {
            chain.push(e);
            next = e.source();
        }
        let last = chain
            .first()
            .and_then(|e| e.downcast_ref::<std::sync::Arc<ShardError>>())
            .unwrap_or_else(|| panic!("{name}: the source is the last server's error: {err:?}"));
        // The source is one server's own failure, as the message lists it.
        assert!(
            message.contains(&last.report().to_string()),
            "{name}: {last:?} in {message}"
        );
        match &**last {
            // A failed statement (PostgreSQL, SQLite: no `id` column): the
            // chain goes on to SeaORM's error.
            ShardError::Db { shard, .. } => {
                assert!(
                    shard == "tickets_a" || shard == "tickets_b",
                    "{name}: {last:?}"
                );
                assert!(
                    chain[1..]
                        .iter()
                        .any(|e| e.downcast_ref::<sea_orm::DbErr>().is_some()),
                    "{name}: the chain reaches SeaORM's error: {chain:?}"
                );
            }
            // MySQL/MariaDB accept the `REPLACE` and hand out no id: the
            // server's table is wrong, which the server's error names.
            ShardError::Config { entry, .. } => {
                assert!(entry.contains("tickets_"), "{name}: {last:?}")
            }
            other => panic!("{name}: unexpected source {other:?}"),
        }
    }
}

/// `Cluster::migrate` with the application's migrator creates the
/// application's tables on the shards only; ticket servers get shardkit's
/// ticket registry and place table, reported as such.
pub(crate) async fn migrate_runs_only_shardkit_migrations_on_ticket_servers(dbs: &mut TestDbs) {
    let (config, urls) = ticket_config(dbs, "").await;
    let cluster = Cluster::connect(config).await.unwrap();
    let report = cluster.migrate::<Migrator>().await.unwrap();
    assert!(report.is_current(), "{report}");
    let shard = report.databases.iter().find(|d| d.name == "s0").unwrap();
    assert!(
        shard.applied.iter().any(|m| m.contains("orders")),
        "{shard:?}"
    );
    for server in ["ids:tickets_a", "ids:tickets_b"] {
        let status = report
            .databases
            .iter()
            .find(|d| d.name == server)
            .unwrap_or_else(|| panic!("{server} missing from {report}"));
        assert_eq!(
            status.applied,
            vec![
                "m20261122_000002_create_ticket_registry".to_owned(),
                "m20261124_000008_create_ticket_place".to_owned()
            ],
            "{server}"
        );
    }
    for url in &urls {
        let db = direct(url).await;
        let count = |table: &str| {
            db.query_one_raw(Statement::from_string(
                db.get_database_backend(),
                format!("SELECT COUNT(*) AS n FROM {table}"),
            ))
        };
        assert!(
            count("orders").await.is_err(),
            "the application's table reached a ticket server"
        );
        assert!(count("customers").await.is_err());
        assert!(count("shardkit_ticket_sequences").await.is_ok());
    }
    // Migrating again is a no-op, and sequences work.
    assert!(cluster.migrate::<Migrator>().await.unwrap().is_current());
    cluster.ids().create_sequence("after").await.unwrap();
    assert!(cluster.ids().next("after").await.unwrap() > 0);
}

/// With `block = 1` each caller's ticket request runs on its own: one held
/// request does not stop the others, and concurrent callers all get
/// distinct ids (on MariaDB, concurrent `REPLACE INTO`s of one stub deadlock
/// now and then: the statement is run again, the server is not given up).
pub(crate) async fn flickr_requests_run_concurrently(dbs: &mut TestDbs) {
    let (config, _) =
        ticket_config_with_pool(dbs, "[ids.sequences.held_photos]\nblock = 1\n", 8).await;
    let cluster = Cluster::connect(config.clone()).await.unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.ids().create_sequence("held_photos").await.unwrap();

    // One of eight concurrent requests (whichever comes first) waits a
    // minute before it asks a server; the other seven must not wait behind it.
    // The failpoint is the process's: its sequence is named for this
    // scenario, so the other scenarios of the binary never meet it.
    let failpoint = FAILPOINT.lock().await;
    fail::cfg("shardkit::ids::ticket::held_photos", "1*return(60000)").unwrap();
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let cluster = cluster.clone();
        callers.spawn(async move { cluster.ids().next("held_photos").await });
    }
    let mut ids = HashSet::new();
    for _ in 0..7 {
        let id = tokio::time::timeout(Duration::from_secs(20), callers.join_next())
            .await
            .expect("the callers waited behind the held ticket request")
            .expect("a caller")
            .unwrap()
            .unwrap();
        ids.insert(id);
    }
    assert_eq!(callers.len(), 1, "the held request is still waiting");
    callers.abort_all();
    fail::remove("shardkit::ids::ticket::held_photos");
    assert_eq!(ids.len(), 7);

    // 16 callers × 50 ids at once on a pool of 8 of one server (no other
    // server to fall back on): all distinct, none refused. The one server is
    // a ticket server of its own: the two above are set up as a pair and
    // serve no other list. A request may wait for 8 others (on SQLite, each
    // a commit of its own): what is asserted is that none is refused, so
    // the wait allowed is not the 2 s default, which a loaded machine's
    // disk exceeded once in 40 runs.
    let mut one_server = config.clone();
    one_server.ids.timeout_ms = Some(20_000);
    one_server.ids.servers.truncate(1);
    one_server.ids.servers[0].name = "tickets_single".into();
    one_server.ids.servers[0].url = Some(DatabaseUrl::new(dbs.extra("tickets_single").await));
    let single = Cluster::connect(one_server).await.unwrap();
    single.migrate::<Migrator>().await.unwrap();
    let mut ids = HashSet::new();
    draw_at_once(&single, "held_photos", 16, 50, &mut ids).await;
    assert_eq!(ids.len(), 800);
    // Held to here: another backend's run arms the failpoint of this same
    // sequence, whose one shot a draw above would take (holding a request
    // a minute, and leaving that run no held request).
    drop(failpoint);
}

/// [`ticket_config`] with one sequence `sequence` (block 1) and server names
/// of this scenario and backend's own (`tickets_a_<sequence>_sqlite`, ...),
/// so a failpoint naming a server stops this scenario only (scenarios and
/// backends run at once); returns the config, the URLs and the two names.
async fn named_ticket_config(
    dbs: &mut TestDbs,
    sequence: &str,
) -> (ClusterConfig, Vec<String>, String, String) {
    let ids = format!("[ids.sequences.{sequence}]\nblock = 1\n");
    let (mut config, urls) = ticket_config(dbs, &ids).await;
    let backend = format!("{:?}", dbs.backend).to_lowercase();
    for server in &mut config.ids.servers {
        server.name = format!("{}_{sequence}_{backend}", server.name);
    }
    let (a, b) = (
        format!("tickets_a_{sequence}_{backend}"),
        format!("tickets_b_{sequence}_{backend}"),
    );
    (config, urls, a, b)
}

/// Creates the ticket servers' tables and sequence `sequence`'s, as an
/// application's own migrations would (no place is recorded).
async fn ticket_tables(urls: &[String], sequence: &str) {
    for url in urls {
        let db = direct(url).await;
        shardkit_migration::TicketMigrator::up(&db, None)
            .await
            .unwrap();
        let table = shardkit_migration::ticket_table(db.get_database_backend(), sequence);
        db.execute(&table).await.unwrap();
        db.close().await.unwrap();
    }
}

/// Each server's place record (position, list, confirmed), in server order.
async fn place_rows(urls: &[String]) -> Vec<Option<(i32, String, bool)>> {
    let mut rows = Vec::new();
    for url in urls {
        let db = direct(url).await;
        let row = db
            .query_one_raw(Statement::from_string(
                db.get_database_backend(),
                "SELECT position, servers, confirmed FROM shardkit_ticket_place",
            ))
            .await
            .unwrap();
        rows.push(row.map(|r| {
            (
                r.try_get("", "position").unwrap(),
                r.try_get("", "servers").unwrap(),
                r.try_get("", "confirmed").unwrap(),
            )
        }));
        db.close().await.unwrap();
    }
    rows
}

/// Runs `set_up` with the failpoint `shardkit::ids::<point>::<server>` on:
/// the process stops there, as if it died.
async fn stop_at(
    point: &str,
    server: &str,
    set_up: impl std::future::Future<Output = Result<(), ShardError>>,
) {
    let name = format!("shardkit::ids::{point}::{server}");
    fail::cfg(&name, "return").unwrap();
    let died = set_up.await;
    fail::remove(&name);
    assert!(
        matches!(&died, Err(ShardError::Db { source, .. }) if source.to_string().contains(point)),
        "{died:?}"
    );
}

/// Expects no ticket, for want of a place: a server recorded for another
/// list refuses the config; servers whose place this list has not
/// confirmed are passed over, and with none left no ticket is drawn.
#[track_caller]
fn no_ticket(what: &str, drawn: Result<i64, ShardError>) {
    match drawn {
        Err(ShardError::Config { message, .. })
            if message.contains("another list") || message.contains("was set up as server") => {}
        Err(ShardError::IdsUnavailable { causes, .. }) if causes.contains("no confirmed place") => {
        }
        other => panic!("{what}: expected no ticket for want of a place, got {other:?}"),
    }
}

/// Runs `sql` on every server.
async fn on_each(urls: &[String], sql: &str) {
    for url in urls {
        let db = direct(url).await;
        db.execute_unprepared(sql).await.unwrap();
        db.close().await.unwrap();
    }
}

/// Expects a config error naming `entry` whose message holds `says`.
#[track_caller]
fn config_error<T: std::fmt::Debug>(result: Result<T, ShardError>, entry: &str, says: &str) {
    match result {
        Err(ShardError::Config { entry: e, message }) => {
            assert_eq!(e, entry, "{message}");
            assert!(message.contains(says), "{message}");
        }
        other => panic!("expected a config error naming {entry}, got {other:?}"),
    }
}

/// `tasks` tasks each draw `each` ids of `sequence` at once; every id must
/// be new to `ids`, which gains them.
async fn draw_at_once(
    cluster: &Cluster,
    sequence: &'static str,
    tasks: usize,
    each: usize,
    ids: &mut HashSet<i64>,
) {
    let tasks: Vec<_> = (0..tasks)
        .map(|_| {
            let cluster = cluster.clone();
            tokio::spawn(async move {
                let mut got = Vec::with_capacity(each);
                for _ in 0..each {
                    got.push(cluster.ids().next(sequence).await.unwrap());
                }
                got
            })
        })
        .collect();
    for task in tasks {
        for id in task.await.unwrap() {
            assert!(ids.insert(id), "{id} handed out twice");
        }
    }
}

/// Each sequence's ticket row on each server, in server order.
async fn ticket_rows(urls: &[String], sequence: &str) -> Vec<Option<i64>> {
    let mut rows = Vec::new();
    for url in urls {
        let db = direct(url).await;
        let row = db
            .query_one_raw(Statement::from_string(
                db.get_database_backend(),
                format!("SELECT id FROM tickets_{sequence}"),
            ))
            .await
            .unwrap();
        rows.push(row.map(|r| r.try_get::<i64>("", "id").unwrap()));
        db.close().await.unwrap();
    }
    rows
}

/// Server `i` of `n` hands out tickets `≡ i + 1 (mod n)`. A second process
/// whose `ids.servers` lost a server (server 1 would go on in steps of 1,
/// onto server 2's tickets) or swapped two (each would hand out the other's)
/// draws no ticket, sets nothing up and moves no sequence: it gets a config
/// error naming the server and both lists, while processes of the set-up
/// list go on (one of them with 8 tasks on pools of 2).
pub(crate) async fn a_ticket_server_serves_only_the_list_it_was_set_up_with(dbs: &mut TestDbs) {
    let (config, urls) = ticket_config(dbs, "[ids.sequences.places]\nblock = 1\n").await;
    let set_up = Cluster::connect(config.clone()).await.unwrap();
    set_up.migrate::<Migrator>().await.unwrap();
    let mut ids = HashSet::new();
    for _ in 0..5 {
        assert!(ids.insert(set_up.ids().next("places").await.unwrap()));
    }
    // Another process of the same list, on pools of 2: 8 tasks draw at once
    // while it checks each server's place for the first time.
    let mut small = config.clone();
    small.pool.max_connections = Some(2);
    let small = Cluster::connect(small).await.unwrap();
    draw_at_once(&small, "places", 8, 25, &mut ids).await;
    drop(small);
    let before = ticket_rows(&urls, "places").await;

    let mut removed = config.clone();
    removed.ids.servers.truncate(1);
    let mut swapped = config.clone();
    swapped.ids.servers.swap(0, 1);
    // The error names the server asked and both lists.
    let expect =
        |what: &str, result: Result<_, ShardError>, entries: &[&str], list: &str| match result {
            Err(ShardError::Config { entry, message }) => {
                assert!(entries.contains(&entry.as_str()), "{what}: {entry}");
                assert!(
                    message.contains(list)
                        && message.contains(r#"of 2 (["tickets_a","tickets_b"])"#),
                    "{what}: {message}"
                );
            }
            other => panic!("{what}: expected a config error, got {other:?}"),
        };
    let first_a = r#"ids.servers[0] ("tickets_a")"#;
    let first_b = r#"ids.servers[0] ("tickets_b")"#;
    let second_a = r#"ids.servers[1] ("tickets_a")"#;
    for (what, other, asked, list) in [
        (
            "removed",
            removed,
            &[first_a][..],
            r#"server 1 of 1 (["tickets_a"])"#,
        ),
        (
            "swapped",
            swapped,
            &[first_b, second_a][..],
            r#"of 2 (["tickets_b","tickets_a"])"#,
        ),
    ] {
        let other = Cluster::connect(other).await.unwrap();
        for _ in 0..4 {
            // Requests take turns over the servers: each one refuses.
            let drawn = other.ids().next("places").await.map(|_| ());
            expect(what, drawn, asked, list);
        }
        // Set-up steps ask the first server first.
        let asked = &asked[..1];
        expect(
            what,
            other.migrate::<Migrator>().await.map(|_| ()),
            asked,
            list,
        );
        expect(what, other.ids().create_sequence("more").await, asked, list);
        expect(
            what,
            other.ids().advance_past("places", 1_000).await,
            asked,
            list,
        );
    }
    // A new database under a set-up server's name (a server "replaced"):
    // it would start again at its position, onto its predecessor's tickets.
    let mut replaced = config.clone();
    let fresh = dbs.extra("tickets_b_new").await;
    replaced.ids.servers[1].url = Some(DatabaseUrl::new(fresh.clone()));
    let replaced = Cluster::connect(replaced).await.unwrap();
    config_error(
        replaced.migrate::<Migrator>().await,
        r#"ids.servers[1] ("tickets_b")"#,
        "`tickets_a` was confirmed with this list",
    );
    assert_eq!(place_rows(&[fresh]).await, [None]);
    assert_eq!(
        ticket_rows(&urls, "places").await,
        before,
        "a refused config drew or moved a ticket"
    );
    for _ in 0..5 {
        let id = set_up.ids().next("places").await.unwrap();
        assert!(ids.insert(id), "{id} handed out twice");
    }
}

/// Two processes with the servers in opposite orders set up. One stops
/// after recording its place on its first server (a process that dies
/// between two steps): the other is refused and writes nothing, until the
/// unconfirmed record is cleared. Then the two set up at once, round after
/// round: at most one list is confirmed, the other draws nothing (before the
/// check, both would hand out 1, 3, 5... from different servers).
pub(crate) async fn configs_setting_up_at_once_confirm_no_split_places(dbs: &mut TestDbs) {
    let (config, urls, a, b) = named_ticket_config(dbs, "split").await;
    let mut reversed_config = config.clone();
    reversed_config.ids.servers.reverse();
    ticket_tables(&urls, "split").await;
    let forward = Cluster::connect(config.clone()).await.unwrap();
    let reversed = Cluster::connect(reversed_config.clone()).await.unwrap();

    stop_at("place_recorded", &a, forward.ids().record_places()).await;
    let forward_list = format!(r#"["{a}","{b}"]"#);
    assert_eq!(
        place_rows(&urls).await,
        [Some((1, forward_list.clone(), false)), None]
    );
    // The reversed list finds a taken before it writes anything.
    let entry_a = format!("ids.servers[1] ({a:?})");
    config_error(
        reversed.ids().record_places().await,
        &entry_a,
        "holds an unconfirmed place for another list",
    );
    config_error(
        reversed.migrate::<Migrator>().await,
        &entry_a,
        "clear_unconfirmed_places",
    );
    assert_eq!(place_rows(&urls).await[1], None);
    for (name, cluster) in [("forward", &forward), ("reversed", &reversed)] {
        for _ in 0..4 {
            no_ticket(name, cluster.ids().next("split").await);
        }
    }
    assert_eq!(
        ticket_rows(&urls, "split").await,
        [None, None],
        "a ticket was drawn"
    );
    // Cleared, the reversed list sets up; the forward one is now refused.
    assert_eq!(reversed.ids().clear_unconfirmed_places().await.unwrap(), 1);
    reversed.ids().record_places().await.unwrap();
    reversed.ids().next("split").await.unwrap();
    config_error(
        forward.ids().record_places().await,
        &format!("ids.servers[0] ({a:?})"),
        "was set up as server 2 of 2",
    );

    // Both at once, on fresh records, round after round.
    let mut splits = 0;
    for round in 0..12 {
        // Fresh servers: no place, no ticket handed out.
        on_each(&urls, "DELETE FROM shardkit_ticket_place").await;
        on_each(&urls, "DELETE FROM tickets_split").await;
        let forward = Cluster::connect(config.clone()).await.unwrap();
        let reversed = Cluster::connect(reversed_config.clone()).await.unwrap();
        let (forward_ids, reversed_ids) = (forward.ids(), reversed.ids());
        let (f, r) = tokio::join!(forward_ids.record_places(), reversed_ids.record_places());
        assert!(
            !(f.is_ok() && r.is_ok()),
            "round {round}: both lists confirmed"
        );
        for (result, cluster) in [(&f, &forward), (&r, &reversed)] {
            match result {
                Ok(()) => {
                    cluster.ids().next("split").await.unwrap();
                }
                Err(ShardError::Config { .. }) => {
                    for _ in 0..4 {
                        no_ticket(&format!("round {round}"), cluster.ids().next("split").await);
                    }
                }
                Err(other) => panic!("round {round}: {other:?}"),
            }
        }
        let rows = place_rows(&urls).await;
        let confirmed: Vec<_> = rows.iter().flatten().filter(|r| r.2).collect();
        assert!(
            confirmed.iter().all(|r| r.1 == confirmed[0].1),
            "round {round}: {rows:?}"
        );
        if f.is_err() && r.is_err() {
            splits += 1;
            assert!(confirmed.is_empty(), "round {round}: {rows:?}");
        }
    }
    eprintln!("{splits} of 12 rounds split the servers between the lists");
}

/// While one list's set-up is between reading the servers (nothing
/// recorded) and recording them, the reversed list sets up from start to
/// end. The first list's records are no-ops on servers already taken, and
/// its read-back refuses it: only the reversed list serves.
pub(crate) async fn a_list_that_sets_up_between_anothers_read_and_write_wins_alone(
    dbs: &mut TestDbs,
) {
    let (config, urls, a, b) = named_ticket_config(dbs, "late").await;
    ticket_tables(&urls, "late").await;
    let mut reversed = config.clone();
    reversed.ids.servers.reverse();
    let point = format!("shardkit::ids::places_read::{a}");
    set_up_meanwhile_at(&point, reversed.clone());
    let forward = Cluster::connect(config.clone()).await.unwrap();
    let refused = forward.ids().record_places().await;
    fail::remove(&point);
    config_error(
        refused,
        &format!("ids.servers[0] ({a:?})"),
        "was set up as server 2 of 2",
    );
    let reversed_list = format!(r#"["{b}","{a}"]"#);
    assert_eq!(
        place_rows(&urls).await,
        [
            Some((2, reversed_list.clone(), true)),
            Some((1, reversed_list, true))
        ]
    );
    let reversed = Cluster::connect(reversed).await.unwrap();
    let mut ids = HashSet::new();
    for _ in 0..4 {
        assert!(ids.insert(reversed.ids().next("late").await.unwrap()));
        assert!(matches!(
            forward.ids().next("late").await,
            Err(ShardError::Config { .. })
        ));
    }
}

/// Runs `work` on a runtime of its own, on another thread, and waits:
/// from a failpoint callback, which the scenario's set-up waits on.
fn meanwhile<F: std::future::Future<Output = ()> + Send + 'static>(work: F) {
    std::thread::spawn(move || tokio::runtime::Runtime::new().unwrap().block_on(work))
        .join()
        .unwrap();
}

/// At failpoint `point`, a process with `config` sets up from start to end
/// (and must succeed) while the one that reached the point waits.
fn set_up_meanwhile_at(point: &str, config: ClusterConfig) {
    fail::cfg_callback(point, move || {
        let config = config.clone();
        meanwhile(async move {
            let cluster = Cluster::connect(config).await.unwrap();
            cluster.ids().record_places().await.unwrap();
        })
    })
    .unwrap();
}

/// `clear_unconfirmed_places` run while a set-up of the same list runs
/// (which its docs advise against) must not leave a server of a list with
/// a confirmed server without its record: another list could take it and
/// serve its residue. Both orders: the clear deletes a record the set-up
/// already read back (the set-up records it again), and a set-up confirms
/// the list while the clear is under way (the clear restores what it
/// deleted and says so).
pub(crate) async fn a_clear_that_races_a_set_up_leaves_no_server_without_its_place(
    dbs: &mut TestDbs,
) {
    let (config, urls, a, b) = named_ticket_config(dbs, "race").await;
    ticket_tables(&urls, "race").await;
    let list = format!(r#"["{a}","{b}"]"#);

    // 1. The set-up has confirmed a; b's record goes (a clear's delete).
    let point = format!("shardkit::ids::place_confirmed::{a}");
    let b_url = urls[1].clone();
    fail::cfg_callback(&point, move || {
        let url = b_url.clone();
        meanwhile(async move {
            let db = Database::connect(&url).await.unwrap();
            db.execute_unprepared("DELETE FROM shardkit_ticket_place")
                .await
                .unwrap();
            db.close().await.unwrap();
        })
    })
    .unwrap();
    let set_up = Cluster::connect(config.clone()).await.unwrap();
    let done = set_up.ids().record_places().await;
    fail::remove(&point);
    done.unwrap();
    assert_eq!(
        place_rows(&urls).await,
        [Some((1, list.clone(), true)), Some((2, list.clone(), true))]
    );

    // 2. A clear has deleted a's unconfirmed record when the set-up of the
    //    list runs and confirms both.
    on_each(&urls, "UPDATE shardkit_ticket_place SET confirmed = FALSE").await;
    let point = format!("shardkit::ids::place_cleared::{a}");
    set_up_meanwhile_at(&point, config.clone());
    let clearing = Cluster::connect(config.clone()).await.unwrap();
    let cleared = clearing.ids().clear_unconfirmed_places().await;
    fail::remove(&point);
    config_error(
        cleared,
        &format!("ids.servers[0] ({a:?})"),
        "the cleared places are restored",
    );
    assert_eq!(
        place_rows(&urls).await,
        [Some((1, list.clone(), true)), Some((2, list, true))]
    );
    let mut ids = HashSet::new();
    for _ in 0..4 {
        assert!(ids.insert(clearing.ids().next("race").await.unwrap()));
    }
}

/// A set-up that stops after confirming the first server: the second
/// holds this list's record, unconfirmed, and serves no ticket (requests go
/// on to the first, whose tickets are its own). It cannot be cleared, only
/// finished, and running the set-up again finishes it.
pub(crate) async fn a_set_up_that_stops_while_confirming_is_finished_by_the_next(
    dbs: &mut TestDbs,
) {
    let (config, urls, a, b) = named_ticket_config(dbs, "halfway").await;
    ticket_tables(&urls, "halfway").await;
    let stopped = Cluster::connect(config.clone()).await.unwrap();
    stop_at("place_confirmed", &a, stopped.ids().record_places()).await;
    let list = format!(r#"["{a}","{b}"]"#);
    assert_eq!(
        place_rows(&urls).await,
        [
            Some((1, list.clone(), true)),
            Some((2, list.clone(), false))
        ]
    );
    // Requests that reach b go on to a: every ticket is a's.
    let next = Cluster::connect(config.clone()).await.unwrap();
    let mut drawn = HashSet::new();
    for _ in 0..6 {
        let id = next.ids().next("halfway").await.unwrap();
        assert_eq!(id % 2, 1, "{id} is not server a's");
        assert!(drawn.insert(id));
    }
    // Half confirmed, it is finished, never cleared: cleared, another list
    // could give b the residue a serves. Nor does a config that does not
    // list a clear it.
    config_error(
        next.ids().clear_unconfirmed_places().await,
        &format!("ids.servers[0] ({a:?})"),
        "finish it",
    );
    let mut elsewhere = config.clone();
    elsewhere.ids.servers.swap(0, 1);
    elsewhere.ids.servers[1].name = format!("{b}_c");
    let c = dbs.extra("tickets_c").await;
    ticket_tables(std::slice::from_ref(&c), "halfway").await;
    elsewhere.ids.servers[1].url = Some(DatabaseUrl::new(c));
    let elsewhere = Cluster::connect(elsewhere).await.unwrap();
    config_error(
        elsewhere.ids().clear_unconfirmed_places().await,
        &format!("ids.servers[0] ({b:?})"),
        &format!("names `{a}`, a server this config does not list"),
    );
    assert_eq!(
        place_rows(&urls).await,
        [
            Some((1, list.clone(), true)),
            Some((2, list.clone(), false))
        ]
    );
    next.ids().record_places().await.unwrap();
    assert_eq!(
        place_rows(&urls).await,
        [Some((1, list.clone(), true)), Some((2, list, true))]
    );
    for _ in 0..6 {
        let id = next.ids().next("halfway").await.unwrap();
        assert!(drawn.insert(id), "{id} handed out twice");
    }
}

/// Ticket servers set up before places were recorded: they have handed out
/// tickets and hold no record. Set-up does not let the first list to come
/// along record itself (a list with a server removed would go on in steps of
/// 1); it asks for `adopt_places`, which refuses a list the counters
/// contradict and writes nothing until it accepts one.
pub(crate) async fn servers_set_up_before_places_are_adopted_not_guessed(dbs: &mut TestDbs) {
    let (config, urls) = ticket_config(dbs, "[ids.sequences.old]\nblock = 1\n").await;
    let before = Cluster::connect(config.clone()).await.unwrap();
    before.migrate::<Migrator>().await.unwrap();
    let mut ids = HashSet::new();
    for _ in 0..6 {
        assert!(ids.insert(before.ids().next("old").await.unwrap()));
    }
    drop(before);
    // As an older release leaves them: the place table, empty.
    on_each(&urls, "DELETE FROM shardkit_ticket_place").await;
    let counters = ticket_rows(&urls, "old").await;

    let same = Cluster::connect(config.clone()).await.unwrap();
    match same.ids().next("old").await {
        Err(ShardError::IdsUnavailable { causes, .. }) => {
            assert!(causes.contains("no confirmed place"), "{causes}")
        }
        other => panic!("expected no ticket, got {other:?}"),
    }
    let mut removed = config.clone();
    removed.ids.servers.truncate(1);
    let removed = Cluster::connect(removed).await.unwrap();
    config_error(
        removed.migrate::<Migrator>().await,
        r#"ids.servers[0] ("tickets_a")"#,
        "adopt_places",
    );
    let mut swapped = config.clone();
    swapped.ids.servers.swap(0, 1);
    let swapped = Cluster::connect(swapped).await.unwrap();
    config_error(
        swapped.ids().adopt_places().await,
        r#"ids.servers[0] ("tickets_b")"#,
        "which is not ≡ 1 (mod 2)",
    );
    config_error(
        same.ids().record_places().await,
        r#"ids.servers[0] ("tickets_a")"#,
        "adopt_places",
    );
    assert_eq!(
        place_rows(&urls).await,
        [None, None],
        "a refused list wrote"
    );
    assert_eq!(ticket_rows(&urls, "old").await, counters);

    same.ids().adopt_places().await.unwrap();
    for _ in 0..6 {
        let id = same.ids().next("old").await.unwrap();
        assert!(ids.insert(id), "{id} handed out twice");
    }
    config_error(
        removed.ids().next("old").await,
        r#"ids.servers[0] ("tickets_a")"#,
        "was set up as server 1 of 2",
    );
}

/// A process whose second ticket server hangs (accepts, never answers) or
/// refuses connections: setting up fails within `timeout_ms`, naming the
/// server, instead of hanging; tickets still come from the first server,
/// whose place checks without the second; and once the cluster is gone no
/// socket to the hung server is left open.
pub(crate) async fn a_hung_or_refusing_ticket_server_fails_set_up_not_tickets(dbs: &mut TestDbs) {
    let (config, _) = ticket_config(
        dbs,
        "timeout_ms = 3000\nretry_after_ms = 600000\n[ids.sequences.hung]\nblock = 1\n",
    )
    .await;
    let set_up = Cluster::connect(config.clone()).await.unwrap();
    set_up.migrate::<Migrator>().await.unwrap();
    let mut ids = HashSet::new();
    for _ in 0..2 {
        assert!(ids.insert(set_up.ids().next("hung").await.unwrap()));
    }
    drop(set_up);

    let hung = Hung::start().await;
    // Port 9 (discard) refuses connections.
    let refusing = match dbs.backend {
        Backend::MySql => "mysql://root@127.0.0.1:9/down",
        _ => "postgres://postgres@127.0.0.1:9/down",
    };
    for (what, url) in [
        ("hung", hung.url(dbs.backend)),
        ("refusing", refusing.into()),
    ] {
        let mut broken = config.clone();
        broken.ids.servers[1].url = Some(DatabaseUrl::new(url));
        let cluster = Cluster::connect(broken).await.unwrap();
        let set_up = tokio::time::timeout(Duration::from_secs(60), cluster.ids().record_places())
            .await
            .unwrap_or_else(|_| panic!("{what}: set-up hung"));
        match set_up {
            Err(ShardError::Db { shard, source, .. }) => {
                assert_eq!(shard, "tickets_b", "{what}");
                if what == "hung" {
                    assert!(source.to_string().contains("no answer within"), "{source}");
                }
            }
            other => panic!("{what}: expected the server's error, got {other:?}"),
        }
        // What an operator sees (`shardctl ids status`).
        let places = cluster.ids().places().await;
        assert!(places[0].serves, "{what}: {places:?}");
        assert!(
            !places[1].serves && places[1].recorded.is_err(),
            "{what}: {places:?}"
        );
        for _ in 0..4 {
            let id = tokio::time::timeout(Duration::from_secs(60), cluster.ids().next("hung"))
                .await
                .unwrap_or_else(|_| panic!("{what}: a ticket request hung"))
                .unwrap();
            assert_eq!(id % 2, 1, "{what}: {id} is not server a's");
            assert!(ids.insert(id), "{what}: {id} handed out twice");
        }
        drop(cluster);
    }
    for _ in 0..500 {
        if hung.open() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(hung.open(), 0, "sockets left open to the hung server");
    assert!(hung.accepted() > 0, "the hung server was never asked");
}

/// The largest block a config may give, on a sequence advanced to the top of
/// the `i64` range: the next block would pass `i64::MAX`, so the sequence is
/// refused as exhausted instead of handing out ids that wrapped negative.
pub(crate) async fn an_exhausted_sequence_is_refused_never_negative(dbs: &mut TestDbs) {
    let (config, _) = ticket_config(dbs, "[ids.sequences.big]\nblock = 1000000000\n").await;
    let cluster = Cluster::connect(config).await.unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let ids = cluster.ids();
    ids.create_sequence("big").await.unwrap();
    let first = ids.next("big").await.unwrap();
    assert!(first >= 1_000_000_000, "{first}");
    ids.advance_past("big", i64::MAX - 10).await.unwrap();
    // Its own error, never retried (it used to be a `Config` error).
    let err = ids.next("big").await.unwrap_err();
    let ticket = match &err {
        ShardError::SequenceExhausted {
            sequence,
            ticket,
            block,
        } => {
            assert_eq!(sequence, "big");
            assert_eq!(*block, 1_000_000_000);
            assert!(
                (ticket + 1)
                    .checked_mul(*block)
                    .is_none_or(|end| end - 1 > i64::MAX as u64),
                "{ticket}"
            );
            *ticket
        }
        other => panic!("expected an exhausted sequence, got {other:?}"),
    };
    assert_eq!(err.retry(), shardkit::Retry::Never);
    assert_eq!(err.kind(), shardkit::ErrorKind::Refused);
    assert_eq!(
        err.to_string(),
        format!(
            "sequence `big` is exhausted: ticket {ticket} × block 1000000000 is past the largest \
             id, 9223372036854775807"
        )
    );
    // A second call (the failure replayed to waiters, or a new fetch) says
    // the same.
    let again = ids.next("big").await.unwrap_err();
    assert!(
        matches!(&again, ShardError::SequenceExhausted { sequence, .. } if sequence == "big"),
        "{again:?}"
    );
}

/// A SQLite ticket server whose file cannot be opened yet (its directory is
/// missing) used to fail `Cluster::connect` ("unable to open database
/// file"), although ticket pools open on first use so that a process starts
/// while a server is down. Now the cluster connects, set-up reports the
/// server, and once the directory exists the same cluster opens the file on
/// first use and draws from it.
pub(crate) async fn a_sqlite_ticket_server_that_cannot_be_opened_is_opened_on_first_use(
    dbs: &mut TestDbs,
) {
    let a = dbs.extra("tickets_a").await;
    let path_a = a.trim_start_matches("sqlite://").split('?').next().unwrap();
    let later = std::path::Path::new(path_a).parent().unwrap().join("later");
    let _ = std::fs::remove_dir_all(&later);
    let b = format!("sqlite://{}?mode=rwc", later.join("tickets_b.db").display());
    let toml = format!(
        "{}\n[groups.Customer]\n[ids]\nservers = [{{ name = \"tickets_a\", url = \"{a}\" }}, \
         {{ name = \"tickets_b\", url = \"{b}\" }}]\n",
        dbs.shards_toml(2)
    );
    let config = ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let cluster = Cluster::connect(config)
        .await
        .unwrap_or_else(|e| panic!("connect: {}", e.report()));
    let err = cluster.migrate::<Migrator>().await.unwrap_err();
    let report = err.report().to_string();
    assert!(report.contains("tickets_b"), "{report}");
    assert!(report.contains("unable to open database file"), "{report}");

    std::fs::create_dir_all(&later).unwrap();
    cluster
        .migrate::<Migrator>()
        .await
        .unwrap_or_else(|e| panic!("migrate: {}", e.report()));
    let ids = cluster.ids();
    ids.create_sequence("orders").await.unwrap();
    let places = ids.places().await;
    assert_eq!(
        places
            .iter()
            .map(|p| (p.name.as_str(), p.serves))
            .collect::<Vec<_>>(),
        [("tickets_a", true), ("tickets_b", true)]
    );
    let mut seen = HashSet::new();
    for _ in 0..5 {
        assert!(seen.insert(ids.next("orders").await.unwrap()));
    }
}
