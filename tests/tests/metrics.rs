//! shardkit's metrics (`shardkit::metrics`) through a recording recorder,
//! after a known workload on SQLite, PostgreSQL and MySQL/MariaDB.

use sea_orm::{ActiveValue::Set, ColumnTrait, QueryFilter};
use shardkit::{Cluster, ClusterConfig};
use shardkit_tests::models::*;
use shardkit_tests::recorded::totals;
use shardkit_tests::{TestDbs, backend_tests};
use std::collections::HashMap;

backend_tests!(2 => a_known_workload_is_counted);

async fn a_known_workload_is_counted(dbs: &mut TestDbs) {
    let totals = totals();
    // Shard names of this backend's own, so its labels are its own.
    let tag = format!("{:?}", dbs.backend).to_lowercase();
    let toml = dbs
        .shards_toml(2)
        .replace("name = \"s0\"", &format!("name = \"{tag}0\""))
        .replace("name = \"s1\"", &format!("name = \"{tag}1\""))
        + "[groups.Customer]\n";
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let shard_of = |key: i64| {
        let cluster = cluster.clone();
        async move { cluster.shard_of::<Customer>(&key).await.unwrap().to_owned() }
    };
    let insert_key =
        |shard: &str| format!("shardkit_statement_duration_seconds{{kind=insert,shard={shard}}}");
    let before: HashMap<String, usize> = [format!("{tag}0"), format!("{tag}1")]
        .into_iter()
        .map(|s| (s.clone(), totals.samples(&insert_key(&s)).len()))
        .collect();

    // 6 inserts, one transaction each.
    let mut per_shard: HashMap<String, usize> = HashMap::new();
    for id in 1..=6_i64 {
        let tx = cluster.begin::<Customer>(id).await.unwrap();
        tx.insert(customer::ActiveModel {
            id: Set(id),
            name: Set(format!("c{id}")),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        *per_shard.entry(shard_of(id).await).or_default() += 1;
    }
    for (shard, n) in &per_shard {
        let samples = totals.samples(&insert_key(shard));
        assert_eq!(samples.len() - before[shard], *n, "inserts on {shard}");
        assert!(
            samples.iter().all(|s| *s >= 0.0 && *s < 60.0),
            "{samples:?}"
        );
    }
    // A duplicate primary key: one failed insert.
    let dup_shard = shard_of(3).await;
    let errors = format!("shardkit_statement_errors_total{{kind=insert,shard={dup_shard}}}");
    let errors_before = totals.counter(&errors);
    let tx = cluster.begin::<Customer>(3).await.unwrap();
    assert!(
        tx.insert(customer::ActiveModel {
            id: Set(3),
            name: Set("again".into()),
        })
        .await
        .is_err()
    );
    drop(tx);
    assert_eq!(totals.counter(&errors) - errors_before, 1);
    // Three keyed reads that find nothing, one that finds a row.
    let missing_shard = shard_of(424_242).await;
    let not_found =
        format!("shardkit_rows_not_found_total{{entity=customers,shard={missing_shard}}}");
    let not_found_before = totals.counter(&not_found);
    for _ in 0..3 {
        let none = cluster
            .find::<customer::Entity>()
            .key(424_242)
            .filter(customer::Column::Id.eq(424_242))
            .one()
            .await
            .unwrap();
        assert!(none.is_none());
    }
    let found = cluster
        .find::<customer::Entity>()
        .key(5)
        .filter(customer::Column::Id.eq(5))
        .one()
        .await
        .unwrap();
    assert!(found.is_some());
    assert_eq!(totals.counter(&not_found) - not_found_before, 3);
    // A read of both shards.
    let all = cluster
        .find::<customer::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    assert_eq!(all.len(), 6);
    assert!(
        totals
            .samples("shardkit_scatter_shards{group=Customer}")
            .contains(&2.0)
    );
    // A reconcile that adds the index rows of a row written around shardkit.
    cluster.setup::<contact::Entity>().await.unwrap();
    let shard = shard_of(9).await;
    sea_orm::EntityTrait::insert(contact::row(77, 9, "m@x", "1"))
        .exec_without_returning(cluster.connection(&shard).unwrap())
        .await
        .unwrap();
    let added = "shardkit_gsi_reconciled_total{action=added,entity=contacts}";
    let added_before = totals.counter(added);
    let report = cluster.gsi().reconcile::<contact::Entity>().await.unwrap();
    assert!(report.added >= 2, "{report:?}");
    // At least this pass's (another backend's scenario may add its own).
    assert!(totals.counter(added) - added_before >= report.added);
    // No label holds a key value or a URL.
    for key in totals.all_keys() {
        assert!(
            !key.contains("424242") && !key.contains("://"),
            "a label holds a key or a URL: {key}"
        );
    }
}
