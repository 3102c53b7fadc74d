//! Reads that used to compile and then fail or panic: partial selects on a
//! key (`select_only().column(..)`) decode through `into_tuple` /
//! `into_model` / `into_json`, and `u64` keys above `i64::MAX` are refused
//! before any I/O on backends that store 64-bit integers signed.

use sea_orm::{ConnectionTrait, DbBackend, FromQueryResult, QuerySelect, Schema};
use shardkit::prelude::*;
use shardkit_tests::models::*;
use shardkit_tests::{Backend, TestDbs};

#[derive(Debug, PartialEq, Eq, FromQueryResult)]
struct OrderTotal {
    id: i64,
    total_cents: i64,
}

pub(crate) async fn keyed_partial_selects_decode_projections(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    for (customer, ids) in [(7_i64, [1_i64, 2]), (8, [3, 4])] {
        let tx = cluster.begin::<Customer>(customer).await.unwrap();
        for id in ids {
            tx.insert(order::ActiveModel {
                id: Set(id),
                customer_id: Set(customer),
                total_cents: Set(id * 100),
            })
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }

    let tuples: Vec<(i64, i64)> = cluster
        .find::<order::Entity>()
        .key(7)
        .select_only()
        .column(order::Column::Id)
        .column(order::Column::TotalCents)
        .order_by_asc(order::Column::Id)
        .into_tuple()
        .all()
        .await
        .unwrap();
    assert_eq!(tuples, vec![(1, 100), (2, 200)], "only key 7's rows");

    let one: Option<i64> = cluster
        .find::<order::Entity>()
        .key(8)
        .select_only()
        .column(order::Column::TotalCents)
        .order_by_desc(order::Column::Id)
        .into_tuple()
        .one()
        .await
        .unwrap();
    assert_eq!(one, Some(400));

    let models: Vec<OrderTotal> = cluster
        .find::<order::Entity>()
        .key(8)
        .select_only()
        .column(order::Column::Id)
        .column(order::Column::TotalCents)
        .order_by_asc(order::Column::Id)
        .into_model()
        .all()
        .await
        .unwrap();
    assert_eq!(
        models,
        vec![
            OrderTotal {
                id: 3,
                total_cents: 300
            },
            OrderTotal {
                id: 4,
                total_cents: 400
            }
        ]
    );

    let json = cluster
        .find::<order::Entity>()
        .key(7)
        .filter(order::Column::Id.eq(2))
        .into_json()
        .one()
        .await
        .unwrap()
        .expect("row 2 as JSON");
    assert_eq!(json["customer_id"], 7);
    assert_eq!(json["total_cents"], 200);

    // A key with no rows: empty, not another key's rows.
    let none: Vec<i64> = cluster
        .find::<order::Entity>()
        .key(9)
        .select_only()
        .column(order::Column::Id)
        .into_tuple()
        .all()
        .await
        .unwrap();
    assert!(none.is_empty());

    // Inside a transaction, scoped to its key.
    let tx = cluster.begin::<Customer>(8).await.unwrap();
    let ids: Vec<i64> = tx
        .find::<order::Entity>()
        .select_only()
        .column(order::Column::Id)
        .order_by_asc(order::Column::Id)
        .into_tuple()
        .all()
        .await
        .unwrap();
    assert_eq!(ids, vec![3, 4]);
    let total: Option<OrderTotal> = tx
        .find::<order::Entity>()
        .select_only()
        .column(order::Column::Id)
        .column(order::Column::TotalCents)
        .filter(order::Column::Id.eq(1))
        .into_model()
        .one()
        .await
        .unwrap();
    assert_eq!(total, None, "row 1 belongs to key 7");
    tx.rollback().await.unwrap();
}

/// A group keyed by `u64`.
#[derive(shardkit::EntityGroup)]
#[shardkit(key = u64)]
pub struct Gauge;

mod gauge_reading {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "gauge_readings")]
    #[shardkit(group = crate::reads::Gauge)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub gauge_id: u64,
        pub value: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

pub(crate) async fn u64_keys_above_i64_max(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Gauge]\n").await;
    for shard in ["s0", "s1"] {
        let db = cluster.connection(shard).unwrap();
        let schema = Schema::new(db.get_database_backend());
        db.execute(&schema.create_table_from_entity(gauge_reading::Entity))
            .await
            .unwrap();
    }
    let big = u64::MAX - 5;
    let row = gauge_reading::ActiveModel {
        id: Set(1),
        gauge_id: Set(big),
        value: Set(42),
    };

    if dbs.backend == Backend::MySql {
        // BIGINT UNSIGNED stores it: the whole range works.
        let tx = cluster.begin::<Gauge>(big).await.unwrap();
        tx.insert(row).await.unwrap();
        tx.commit().await.unwrap();
        let rows = cluster
            .find::<gauge_reading::Entity>()
            .key(big)
            .all()
            .await
            .unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].gauge_id, big);
        let shard = cluster.shard_of::<Gauge>(&big).await.unwrap().to_owned();
        let on_shard = cluster
            .connection(&shard)
            .unwrap()
            .query_one_raw(sea_orm::Statement::from_string(
                DbBackend::MySql,
                "SELECT COUNT(*) AS n FROM gauge_readings",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get::<i64>("", "n")
            .unwrap();
        assert_eq!(on_shard, 1, "the row is on the shard its key routes to");
        return;
    }

    // PostgreSQL and SQLite: refused before any statement, naming the key
    // and the shard (it used to panic inside the driver).
    let refused = |err: ShardError| match err {
        ShardError::Unroutable { group, key, reason } => {
            assert_eq!(group, "Gauge");
            assert_eq!(key, big.to_string());
            assert!(reason.contains("BIGINT UNSIGNED"), "{reason}");
        }
        other => panic!("expected Unroutable, got {other:?}"),
    };
    refused(cluster.begin::<Gauge>(big).await.unwrap_err());
    refused(
        cluster
            .find::<gauge_reading::Entity>()
            .key(big)
            .all()
            .await
            .unwrap_err(),
    );
    refused(
        cluster
            .find::<gauge_reading::Entity>()
            .keys([1, big])
            .all()
            .await
            .unwrap_err(),
    );
    // Keys that fit still route.
    assert!(cluster.route::<Gauge>(&(i64::MAX as u64)).await.is_ok());
    for shard in ["s0", "s1"] {
        let db = cluster.connection(shard).unwrap();
        let n = db
            .query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT COUNT(*) AS n FROM gauge_readings",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get::<i64>("", "n")
            .unwrap();
        assert_eq!(n, 0, "nothing written on {shard}");
    }
}

/// `find().key(k).paginate(n)`: pages of the key's rows only (another key's
/// rows on the same shard never appear), in the read's order.
pub(crate) async fn keyed_reads_paginate_within_their_key(dbs: &mut TestDbs) {
    // One shard: both keys' rows share it, so the key filter is what keeps
    // key 8's rows out of key 7's pages.
    let cluster = dbs.cluster(1, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    for (customer, ids) in [(7_i64, 1..=7_i64), (8, 100..=104)] {
        let tx = cluster.begin::<Customer>(customer).await.unwrap();
        tx.insert_many(ids.map(|id| order::ActiveModel {
            id: Set(id),
            customer_id: Set(customer),
            total_cents: Set(id),
        }))
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let pages = cluster
        .find::<order::Entity>()
        .key(7)
        .order_by_desc(order::Column::Id)
        .paginate(3);
    assert_eq!(pages.num_items().await.unwrap(), 7);
    assert_eq!(pages.num_pages().await.unwrap(), 3);
    let mut seen = Vec::new();
    for page in 0..4 {
        let rows = pages.fetch_page(page).await.unwrap();
        assert!(rows.len() <= 3, "page {page}: {rows:?}");
        seen.extend(rows.into_iter().map(|r| (r.customer_id, r.id)));
    }
    assert_eq!(seen, (1..=7).rev().map(|id| (7, id)).collect::<Vec<_>>());
}
