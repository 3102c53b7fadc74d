//! A newcomer's first hour: `Cluster::setup` creates what shardkit keeps
//! beside the entities' tables (index tables and catalog rows, ticket
//! sequences), and a write that finds one missing names the call to make,
//! writing nothing.

use shardkit::gsi::IndexState;
use shardkit::prelude::*;
use shardkit_tests::models::*;
use shardkit_tests::{TestDbs, backend_tests, count_rows};

backend_tests!(2 =>
    setup_creates_index_tables_and_sequences,
    test_databases_take_a_prefix,
);

async fn setup_creates_index_tables_and_sequences(dbs: &mut TestDbs) {
    let server = dbs.extra("tickets").await;
    let toml = format!(
        "{}\n[groups.Customer]\n[ids]\nservers = [{{ name = \"t\", url = \"{server}\" }}]\n",
        dbs.shards_toml(2)
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();

    // Before setup: the index table and the sequence are missing. Each
    // write fails naming the call, and nothing is written.
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    let err = tx
        .insert(contact::row(1, 7, "a@x", "555"))
        .await
        .unwrap_err();
    let report = err.report().to_string();
    assert!(matches!(err, ShardError::Db { .. }), "{err:?}");
    assert!(report.contains("cluster.setup::<YourEntity>()"), "{report}");
    assert!(report.contains("gsi_contacts_"), "{report}");
    drop(tx);
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    let err = tx
        .insert(invoice::ActiveModel {
            customer_id: Set(7),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::Config { .. }), "{err:?}");
    assert!(
        err.to_string().contains("cluster.setup::<YourEntity>()"),
        "{err}"
    );
    assert!(err.to_string().contains("tickets_invoices"), "{err}");
    drop(tx);
    assert_eq!(count_rows(&cluster, "contacts").await, 0);
    assert_eq!(count_rows(&cluster, "invoices").await, 0);

    // One call for the entities; again at the next start changes nothing.
    for _ in 0..2 {
        let report = cluster
            .setup::<(contact::Entity, invoice::Entity, order::Entity)>()
            .await
            .unwrap();
        let mut indexes = report.indexes.clone();
        indexes.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            indexes,
            vec![
                ("gsi_contacts_email".to_owned(), IndexState::WriteOnly),
                ("gsi_contacts_phone".to_owned(), IndexState::WriteOnly),
            ],
            "{report}"
        );
        assert_eq!(report.sequences, vec!["invoices".to_owned()]);
    }
    assert_eq!(
        cluster.ids().sequences().await.unwrap(),
        vec!["invoices".to_owned()]
    );

    // Now both writes work, and the index is written from the first row on.
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    tx.insert(contact::row(1, 7, "a@x", "555")).await.unwrap();
    let invoice = tx
        .insert(invoice::ActiveModel {
            customer_id: Set(7),
            ..Default::default()
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(invoice.id > 0);
    // A backfill of the (complete) index activates it; lookups then use it.
    cluster
        .gsi()
        .backfill::<contact::Entity>(contact::Column::Email)
        .await
        .unwrap();
    assert_eq!(
        cluster
            .gsi()
            .state::<contact::Entity>(contact::Column::Email)
            .await
            .unwrap(),
        IndexState::Active
    );
    let found = cluster
        .find::<contact::Entity>()
        .by_index(contact::Column::Email, "a@x")
        .all()
        .await
        .unwrap();
    assert_eq!(found.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1]);
    // A unique value is held from setup on: a second owner is refused.
    let tx = cluster.begin::<Customer>(8).await.unwrap();
    let err = tx
        .insert(contact::row(2, 8, "a@x", "555"))
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::UniqueViolation { .. }), "{err:?}");
}

/// `TestShards::create_prefixed` names its databases (or, on SQLite, their
/// directory) `<prefix>_...`, and a cluster runs on them.
async fn test_databases_take_a_prefix(dbs: &mut TestDbs) {
    let mine =
        shardkit::testing::TestShards::create_prefixed(dbs.backend, "myapp_ci", "prefixed", 2)
            .await;
    for name in &mine.names {
        let name = match dbs.backend {
            shardkit_tests::Backend::Sqlite => std::path::Path::new(name)
                .parent()
                .and_then(|dir| dir.file_name())
                .map(|dir| dir.to_string_lossy().into_owned())
                .unwrap_or_default(),
            _ => name.clone(),
        };
        assert!(name.starts_with("myapp_ci_prefixed_"), "{name}");
        assert!(name.len() <= 63, "{name}");
    }
    let toml = format!("{}\n[groups.Customer]\n", mine.shards_toml(2));
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    drop(cluster);
    mine.cleanup().await;
}
