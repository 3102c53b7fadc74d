//! SQLite shards queue writers instead of failing them: write transactions
//! take the write lock up front (`BEGIN IMMEDIATE`) and wait with the busy
//! timeout, and shards run in WAL mode.

use sea_orm::ConnectionTrait;
use shardkit::prelude::*;
use shardkit_tests::models::*;
use shardkit_tests::{TestDbs, backend_tests, count_rows};

backend_tests!(1 =>
    [Sqlite] concurrent_read_then_write_transactions_all_commit,
);

async fn concurrent_read_then_write_transactions_all_commit(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(1, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let db = cluster.connection("s0").unwrap();
    let mode = db
        .query_one_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            "PRAGMA journal_mode",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index::<String>(0)
        .unwrap();
    assert_eq!(mode, "wal");

    // 80 transactions on 8 keys of one shard: each reads its key's rows,
    // then writes one (the read-then-write that a deferred SQLite
    // transaction cannot upgrade while another holds the write lock).
    let tasks: Vec<_> = (0..80_i64)
        .map(|i| {
            let cluster = cluster.clone();
            tokio::spawn(async move {
                let key = i % 8;
                let tx = cluster.begin::<Customer>(key).await?;
                let before = tx.find::<order::Entity>().count().await?;
                tx.insert(order::ActiveModel {
                    id: Set(i),
                    customer_id: Set(key),
                    total_cents: Set(i64::try_from(before).unwrap_or(0)),
                })
                .await?;
                tx.commit().await
            })
        })
        .collect();
    let mut failed = Vec::new();
    for task in tasks {
        if let Err(err) = task.await.unwrap() {
            failed.push(err.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 80 failed: {failed:?}",
        failed.len()
    );
    assert_eq!(count_rows(&cluster, "orders").await, 80);
}
