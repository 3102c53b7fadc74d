//! Globally unique ids on SQLite, PostgreSQL and MySQL/MariaDB: two ticket
//! servers, 8 tasks × 20,000 ids with one server cut off halfway (zero
//! duplicates, every id handed out), ticket round trips counted, Flickr mode,
//! `advance_past`, shard-encoded ids and ids filled in by the derive.

use sea_orm::{ActiveValue::NotSet, EntityTrait, Set};
use shardkit::{Cluster, ClusterConfig, ShardError};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, Proxy, TestDbs};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Two ticket servers (databases of their own); on server backends each sits
/// behind a [`Proxy`] the test can cut.
async fn ticket_cluster(dbs: &mut TestDbs, ids: &str) -> (Cluster, Vec<Proxy>) {
    let mut servers = Vec::new();
    let mut proxies = Vec::new();
    for name in ["tickets_a", "tickets_b"] {
        let mut url = dbs.extra(name).await;
        if dbs.backend != Backend::Sqlite {
            let server = dbs.backend.server_url().unwrap();
            let host_port = server.rsplit('@').next().unwrap().to_owned();
            let proxy = Proxy::start(host_port.clone()).await;
            url = url.replacen(&host_port, &format!("127.0.0.1:{}", proxy.port), 1);
            proxies.push(proxy);
        }
        servers.push(format!("{{ name = \"{name}\", url = \"{url}\" }}"));
    }
    let toml = format!(
        "{}\n[groups.Customer]\nbuckets = 1024\n[ids]\nservers = [{}]\ntimeout_ms = 1000\nretry_after_ms = 200\n{ids}\n",
        dbs.shards_toml(2),
        servers.join(", ")
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    let report = cluster.migrate::<Migrator>().await.unwrap();
    assert!(
        report.databases.iter().any(|d| d.name == "ids:tickets_b"),
        "{report}"
    );
    (cluster, proxies)
}

pub(crate) async fn tickets_survive_losing_a_server(dbs: &mut TestDbs) {
    let (cluster, proxies) = ticket_cluster(dbs, "[ids.sequences.load]\nblock = 50\n").await;
    cluster.ids().create_sequence("load").await.unwrap();
    assert_eq!(
        cluster.ids().sequences().await.unwrap(),
        vec!["load".to_owned()]
    );

    const TASKS: usize = 8;
    const PER_TASK: usize = 20_000;
    let made = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let seq = cluster.ids().sequence("load").unwrap();
        let made = Arc::clone(&made);
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::with_capacity(PER_TASK);
            for _ in 0..PER_TASK {
                ids.push(seq.next().await.expect("an id, whatever fails"));
                made.fetch_add(1, Ordering::Relaxed);
            }
            ids
        }));
    }
    // Halfway through, server b becomes unreachable.
    if let Some(b) = proxies.get(1) {
        while made.load(Ordering::Relaxed) < TASKS * PER_TASK / 2 {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        b.kill();
    }
    let mut all = Vec::with_capacity(TASKS * PER_TASK);
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    assert_eq!(all.len(), TASKS * PER_TASK, "every id accounted for");
    let unique: HashSet<i64> = all.iter().copied().collect();
    assert_eq!(unique.len(), all.len(), "zero duplicates");
    assert!(all.iter().all(|id| *id > 0));
    // Both servers served: blocks come from odd (a) and even (b) tickets.
    let tickets: HashSet<i64> = all.iter().map(|id| id / 50).collect();
    assert!(tickets.iter().any(|t| t % 2 == 1) && tickets.iter().any(|t| t % 2 == 0));
    if !proxies.is_empty() {
        // After the cut, only server a answers: a fresh sequence handle still
        // gets ids, all from odd tickets.
        for _ in 0..200 {
            let id = cluster.ids().next("load").await.unwrap();
            assert!(unique.contains(&id).not(), "{id} handed out twice");
        }
    }
}

trait Not {
    fn not(self) -> bool;
}
impl Not for bool {
    fn not(self) -> bool {
        !self
    }
}

pub(crate) async fn ticket_round_trips_are_counted(dbs: &mut TestDbs) {
    let (cluster, _proxies) = ticket_cluster(dbs, "[ids.sequences.rt]\nblock = 100\n").await;
    let ids = cluster.ids();
    ids.create_sequence("rt").await.unwrap();
    let seq = ids.sequence("rt").unwrap();
    assert_eq!(seq.block(), 100);
    let before = ids.ticket_requests();
    let mut got = Vec::new();
    for _ in 0..1000 {
        got.push(seq.next().await.unwrap());
    }
    // Let a prefetch started by the last block finish.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let used = ids.ticket_requests() - before;
    assert!(
        (10..=11).contains(&used),
        "1,000 ids with B = 100 cost 10 tickets (+1 prefetch), not {used}"
    );
    let unique: HashSet<i64> = got.iter().copied().collect();
    assert_eq!(unique.len(), 1000);
    // Blocks are contiguous runs of 100 inside one ticket's range.
    assert!(got.windows(2).filter(|w| w[1] != w[0] + 1).count() <= 10);
}

pub(crate) async fn flickr_mode_and_advance_past(dbs: &mut TestDbs) {
    let (cluster, _proxies) = ticket_cluster(
        dbs,
        "[ids.sequences.photos]\nblock = 1\n[ids.sequences.accounts]\nblock = 10\n",
    )
    .await;
    let ids = cluster.ids();
    ids.create_sequence("photos").await.unwrap();
    ids.create_sequence("accounts").await.unwrap();
    let mut listed = ids.sequences().await.unwrap();
    listed.sort();
    assert_eq!(listed, vec!["accounts".to_owned(), "photos".to_owned()]);

    // B = 1: each id is a ticket, one round trip each, round-robin: server a
    // hands out odd tickets, server b even ones.
    let before = ids.ticket_requests();
    let mut photos = Vec::new();
    for _ in 0..40 {
        photos.push(ids.next("photos").await.unwrap());
    }
    assert_eq!(
        ids.ticket_requests() - before,
        40,
        "one ticket per id, no prefetch"
    );
    let odd = photos.iter().filter(|t| *t % 2 == 1).count();
    assert_eq!(odd, 20, "{photos:?}");
    let unique: HashSet<i64> = photos.iter().copied().collect();
    assert_eq!(unique.len(), 40);

    // advance_past: an id inserted by hand is never handed out, nor below it.
    let first = ids.next("accounts").await.unwrap();
    let explicit = first + 10_000;
    ids.advance_past("accounts", explicit).await.unwrap();
    for _ in 0..30 {
        let id = ids.next("accounts").await.unwrap();
        assert!(id > explicit, "{id} is not past {explicit}");
    }
    assert!(matches!(
        ids.next("Bad-Name").await,
        Err(ShardError::Config { .. })
    ));
}

pub(crate) async fn generated_primary_keys_and_shard_encoded_ids(dbs: &mut TestDbs) {
    let (cluster, _proxies) = ticket_cluster(dbs, "[ids.sequences.invoices]\nblock = 20\n").await;
    // `invoices` is configured, so `migrate` created it; `orders` is not.
    cluster.ids().create_sequence("orders").await.unwrap();

    // The derive's `id = "..."` fills an unset primary key on insert.
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    let a = tx
        .insert(invoice::ActiveModel {
            id: NotSet,
            customer_id: Set(7),
        })
        .await
        .unwrap();
    let b = tx
        .insert(invoice::ActiveModel {
            id: NotSet,
            customer_id: Set(7),
        })
        .await
        .unwrap();
    let kept = tx
        .insert(invoice::ActiveModel {
            id: Set(-5),
            customer_id: Set(7),
        })
        .await
        .unwrap();
    let e1 = tx
        .insert(event::ActiveModel {
            id: NotSet,
            customer_id: Set(7),
        })
        .await
        .unwrap();
    let e2 = tx
        .insert(event::ActiveModel {
            id: NotSet,
            customer_id: Set(7),
        })
        .await
        .unwrap();
    let c1 = tx
        .insert(click::ActiveModel {
            id: NotSet,
            customer_id: Set(7),
        })
        .await
        .unwrap();
    let c2 = tx
        .insert(click::ActiveModel {
            id: NotSet,
            customer_id: Set(7),
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(a.id > 0 && b.id > a.id, "{a:?} {b:?}");
    assert_eq!(kept.id, -5, "a set primary key is kept");
    assert_eq!(e1.id.get_version_num(), 7);
    assert!(e2.id > e1.id, "UUIDv7 is monotonic within the process");
    assert!(c2.id > c1.id);
    let shard = cluster.shard_of::<Customer>(&7).await.unwrap().to_owned();
    let db = cluster.connection(&shard).unwrap();
    assert_eq!(invoice::Entity::find().all(db).await.unwrap().len(), 3);
    assert_eq!(event::Entity::find().all(db).await.unwrap().len(), 2);

    // `id = "encoded:receipts"`: an insert fills a shard-encoded id, and
    // the id alone finds the shard the row is on.
    cluster.ids().create_sequence("receipts").await.unwrap();
    for key in 1..=20_i64 {
        let tx = cluster.begin::<Customer>(key).await.unwrap();
        let row = tx
            .insert(receipt::ActiveModel {
                id: NotSet,
                customer_id: Set(key),
            })
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let from_id = cluster.route_id::<Customer>(row.id).unwrap();
        assert_eq!(
            from_id,
            cluster.route::<Customer>(&key).await.unwrap(),
            "{row:?}"
        );
        let shard = cluster.topology().shard(from_id.shard).name.clone();
        let stored = receipt::Entity::find_by_id(row.id)
            .one(cluster.connection(&shard).unwrap())
            .await
            .unwrap();
        assert_eq!(stored, Some(row), "on the shard its id names");
    }
    let refused = cluster
        .ids()
        .generate(shardkit::ids::IdStrategy::Encoded("receipts"))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ShardError::Config { message, .. } if message.contains("next_encoded_id")),
        "{refused:?}"
    );

    // Shard-encoded ids name their shard.
    for key in 1..=50_i64 {
        let id = cluster
            .next_encoded_id::<Customer>("orders", &key)
            .await
            .unwrap();
        let from_id = cluster.route_id::<Customer>(id).unwrap();
        let from_key = cluster.route::<Customer>(&key).await.unwrap();
        assert_eq!(from_id, from_key, "key {key} id {id}");
    }
}
