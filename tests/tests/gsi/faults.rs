//! Failure injection between the index write and the primary write (the
//! `fail` crate's failpoint `shardkit::gsi::after_index_write`, compiled in by
//! shardkit's `failpoints` feature): 1,000 inserts with ~20% of them failing
//! after their index rows committed. Every committed row is reachable by its
//! indexes, dangling rows are ignored by lookups, and one reconcile pass
//! removes all of them; nothing that committed is lost.
//!
//! This binary holds only this scenario: the failpoint is process-wide, and
//! all three backends want it at 20%.

use sea_orm::{EntityTrait, Set};
use shardkit_tests::models::*;
use shardkit_tests::{TestDbs, backend_tests, count_rows};
use std::collections::{BTreeSet, HashMap};

backend_tests!(4 => injected_failures_leave_only_dangling_index_rows);

async fn injected_failures_leave_only_dangling_index_rows(dbs: &mut TestDbs) {
    let clock = std::sync::Arc::new(shardkit::ManualClock::starting_now());
    let cluster = shardkit::Cluster::builder(dbs.config(4, "[groups.Customer]\n"))
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
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

    fail::cfg("shardkit::gsi::after_index_write", "20%return").unwrap();
    let mut committed: HashMap<String, i64> = HashMap::new();
    let mut failed: Vec<String> = Vec::new();
    for i in 0..1000_i64 {
        let (customer, email, phone) = (i % 50, format!("f{i}@x"), format!("p{}", i % 37));
        let tx = cluster.begin::<Customer>(customer).await.unwrap();
        let written = tx
            .insert(contact::ActiveModel {
                id: Set(i),
                customer_id: Set(customer),
                email: Set(email.clone()),
                phone: Set(phone),
            })
            .await;
        match written {
            Ok(_) => {
                tx.commit().await.unwrap();
                committed.insert(email, i);
            }
            Err(err) => {
                assert!(
                    err.report().to_string().contains("failpoint"),
                    "{}",
                    err.report()
                );
                drop(tx);
                failed.push(email);
            }
        }
    }
    // Left on: the other backends' runs in this binary may still be inserting,
    // and nothing below passes the failpoint.
    assert!(
        (100..=320).contains(&failed.len()),
        "~20% injected failures, got {}",
        failed.len()
    );
    assert_eq!(committed.len() + failed.len(), 1000);
    assert_eq!(
        count_rows(&cluster, "contacts").await,
        committed.len() as u64,
        "every committed row is there"
    );

    // Every committed row is reachable through each index.
    for (email, id) in &committed {
        let rows = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, email.as_str())
            .all()
            .await
            .unwrap();
        assert_eq!(
            rows.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![*id],
            "{email}"
        );
    }
    for p in 0..37 {
        let phone = format!("p{p}");
        let rows = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Phone, phone.as_str())
            .all()
            .await
            .unwrap();
        let want: BTreeSet<i64> = committed
            .values()
            .copied()
            .filter(|i| i % 37 == p)
            .collect();
        assert_eq!(
            rows.iter().map(|r| r.id).collect::<BTreeSet<_>>(),
            want,
            "{phone}"
        );
    }
    // Dangling rows (index rows on another shard than their failed owner)
    // are there, and ignored.
    let email_rows = count_rows(&cluster, "gsi_contacts_email").await;
    let phone_rows = count_rows(&cluster, "gsi_contacts_phone").await;
    let dangling = email_rows + phone_rows - 2 * committed.len() as u64;
    assert!(dangling > 0);
    for email in &failed {
        let rows = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, email.as_str())
            .all()
            .await
            .unwrap();
        assert!(rows.is_empty(), "{email} never committed");
    }

    // Past the grace period, one reconcile pass removes every dangling row
    // and nothing else.
    clock.advance(std::time::Duration::from_secs(31));
    let report = cluster.gsi().reconcile::<contact::Entity>().await.unwrap();
    assert_eq!(report.removed, dangling, "{report:?}");
    assert_eq!(report.added, 0, "{report:?}");
    assert_eq!(
        count_rows(&cluster, "gsi_contacts_email").await,
        committed.len() as u64
    );
    assert_eq!(
        count_rows(&cluster, "gsi_contacts_phone").await,
        committed.len() as u64
    );
    assert_eq!(
        count_rows(&cluster, "contacts").await,
        committed.len() as u64,
        "nothing that committed is lost"
    );
    let all = contact::Entity::find()
        .all(cluster.connection("s0").unwrap())
        .await
        .unwrap();
    assert!(all.iter().all(|r| committed.contains_key(&r.email)));
}
