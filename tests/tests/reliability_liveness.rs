//! Liveness under load and faults: index-first writes on small pools never
//! deadlock, a down or hung shard fails requests fast with its cause (and
//! comes back once reachable), and index reads with `.partial()` report a
//! down index shard instead of failing or hanging.

use sea_orm::{ActiveValue::Unchanged, Set};
use shardkit::topology::pghash::partition_hash_bytes;
use shardkit::{Cluster, ClusterConfig};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, TestDbs, backend_tests, count_rows};
use std::time::Duration;

backend_tests!(2 =>
    index_first_writes_on_small_pools_all_complete,
);

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
async fn index_first_writes_on_small_pools_all_complete(dbs: &mut TestDbs) {
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
