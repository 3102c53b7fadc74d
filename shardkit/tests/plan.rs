//! Read plans, checked without a database: the shards are lazy pools on a
//! closed port, so planning (pure routing here) must not touch them.

use shardkit::prelude::*;
use shardkit::{MergePlan, PlannedRoute, ReadPlan};
use std::time::Duration;

#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Customer;

pub mod order {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "orders")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub total_cents: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Four PostgreSQL shards nobody listens for; nothing connects until used.
async fn cluster() -> Cluster {
    let mut toml = String::from(
        "[pool]\nconnect_lazy = true\n[read]\ntimeout_ms = 250\nmax_concurrency = 3\n\
         [groups.Customer]\nbuckets = 16\n",
    );
    for i in 0..4 {
        toml.push_str(&format!(
            "[[shards]]\nname = \"s{i}\"\nurl = \"postgres://app@127.0.0.1:9/orders_{i}\"\n"
        ));
    }
    Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap()
}

/// Keys 0..40 by shard.
async fn keys_by_shard(cluster: &Cluster) -> std::collections::BTreeMap<String, Vec<i64>> {
    let mut by_shard = std::collections::BTreeMap::<String, Vec<i64>>::new();
    for k in 0..40 {
        let shard = cluster.shard_of::<Customer>(&k).await.unwrap().to_owned();
        by_shard.entry(shard).or_default().push(k);
    }
    by_shard
}

#[tokio::test]
async fn keyed_read_plans_one_statement_on_the_keys_shard() {
    let cluster = cluster().await;
    let plan: ReadPlan = cluster
        .find::<order::Entity>()
        .key(42)
        .filter(order::Column::TotalCents.gt(100))
        .order_by_desc(order::Column::Id)
        .limit(3)
        .explain()
        .await
        .unwrap();
    let target = cluster.route::<Customer>(&42).await.unwrap();
    assert_eq!(
        plan.route,
        PlannedRoute::Key {
            bucket: target.bucket
        }
    );
    assert_eq!(plan.statements.len(), 1);
    let statement = &plan.statements[0];
    assert_eq!(
        statement.shard,
        cluster.shard_of::<Customer>(&42).await.unwrap()
    );
    assert_eq!(
        statement.sql,
        "SELECT \"orders\".\"id\", \"orders\".\"customer_id\", \"orders\".\"total_cents\" \
         FROM \"orders\" WHERE \"orders\".\"total_cents\" > 100 AND \"orders\".\"customer_id\" = 42 \
         ORDER BY \"orders\".\"id\" DESC LIMIT 3"
    );
    assert_eq!(plan.merge, None, "one shard answers as written");
    assert!(!plan.partial);
    assert_eq!(plan.timeout, Some(Duration::from_millis(250)));
    assert_eq!(plan.max_concurrency, 3);
}

#[tokio::test]
async fn multi_key_read_plans_each_shard_with_its_own_keys() {
    let cluster = cluster().await;
    let plan = cluster
        .find::<order::Entity>()
        .keys(0..40)
        .order_by_desc(order::Column::TotalCents)
        .limit(5)
        .offset(2)
        .timeout(Duration::from_millis(40))
        .explain()
        .await
        .unwrap();
    assert_eq!(plan.route, PlannedRoute::Keys { keys: 40 });
    let expected = keys_by_shard(&cluster).await;
    assert_eq!(
        plan.statements
            .iter()
            .map(|s| s.shard.clone())
            .collect::<Vec<_>>(),
        expected.keys().cloned().collect::<Vec<_>>(),
        "one statement per shard holding keys, in shard order"
    );
    for statement in &plan.statements {
        let keys = &expected[&statement.shard];
        let list = keys
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        assert!(
            statement
                .sql
                .contains(&format!("\"orders\".\"customer_id\" IN ({list})")),
            "{} gets exactly its keys: {}",
            statement.shard,
            statement.sql
        );
        assert!(
            statement.sql.ends_with("LIMIT 7"),
            "each shard returns limit + offset rows: {}",
            statement.sql
        );
    }
    assert_eq!(
        plan.merge,
        Some(MergePlan {
            order: vec![("total_cents", true)],
            limit: Some(5),
            offset: 2,
        })
    );
    assert_eq!(plan.timeout, Some(Duration::from_millis(40)));
    let text = plan.to_string();
    assert!(
        text.starts_with("read orders (group Customer) by 40 keys; "),
        "{text}"
    );
    assert!(
        text.ends_with("merge by total_cents DESC, skip 2, keep 5"),
        "{text}"
    );
}

#[tokio::test]
async fn scatter_plans_every_shard_and_its_failure_policy() {
    let cluster = cluster().await;
    let strict = cluster
        .find::<order::Entity>()
        .scatter()
        .explain()
        .await
        .unwrap();
    let partial = cluster
        .find::<order::Entity>()
        .scatter()
        .partial()
        .explain()
        .await
        .unwrap();
    for plan in [&strict, &partial] {
        assert_eq!(plan.route, PlannedRoute::Scatter);
        assert_eq!(
            plan.statements
                .iter()
                .map(|s| s.shard.as_str())
                .collect::<Vec<_>>(),
            ["s0", "s1", "s2", "s3"]
        );
        assert!(plan.statements.iter().all(|s| !s.sql.contains("WHERE")));
    }
    assert!(!strict.partial);
    assert!(partial.partial);
    assert!(
        partial.to_string().contains("failed shards reported"),
        "{partial}"
    );
}

#[tokio::test]
async fn unmergeable_ordering_is_refused_while_planning() {
    let cluster = cluster().await;
    let err = cluster
        .find::<order::Entity>()
        .keys([1, 2, 3])
        .order_by(
            order::Column::Id,
            sea_orm::Order::Field(sea_orm::Values(vec![1i64.into(), 2i64.into()])),
        )
        .explain()
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ShardError::Unmergeable {
                table: "orders",
                ..
            }
        ),
        "{err:?}"
    );
}
