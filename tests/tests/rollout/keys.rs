//! A rollout conversion that changes the shard key is refused like any
//! cross-shard write: in dual writes (the transaction becomes rollback-only
//! and neither table is written) and in backfill (nothing copied).

use sea_orm::ConnectionTrait;
use shardkit::prelude::*;
use shardkit::{ManualClock, Phase, Rollout, RolloutHandle};
use shardkit_tests::models::*;
use shardkit_tests::{TestDbs, count_rows};
use std::sync::Arc;
use std::time::Duration;

type Moving = RolloutHandle<person_v1::Entity, person_v2::Entity>;

/// A buggy conversion: rows of customers 100 and up move to the next key.
fn moving(old: &person_v1::Model) -> person_v2::Model {
    let mut new = person_to_v2(old);
    if old.customer_id >= 100 {
        new.customer_id += 1;
    }
    new
}

/// Advances, moving `clock` past the gap when it is too soon.
async fn advance(rollout: &Moving, clock: &ManualClock) -> Phase {
    loop {
        match rollout.advance().await {
            Ok(phase) => return phase,
            Err(ShardError::RolloutTooSoon { wait_ms, .. }) => {
                clock.advance(Duration::from_millis(wait_ms));
            }
            Err(e) => panic!("advance: {e}"),
        }
    }
}

fn person(id: i64, customer: i64) -> person_v1::ActiveModel {
    person_v1::ActiveModel {
        id: Set(id),
        customer_id: Set(customer),
        first_name: Set("Ada".into()),
        last_name: Set(format!("L{id}")),
        city: Set("Oslo".into()),
    }
}

pub(crate) async fn conversion_that_moves_the_key_is_refused(dbs: &mut TestDbs) {
    let clock = Arc::new(ManualClock::starting_now());
    let cluster = Cluster::builder(dbs.config(4, "[groups.Customer]\n"))
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let rollout = cluster
        .register_rollout(
            Rollout::new("moving", moving)
                .to_old(person_to_v1)
                .cache_ttl(Duration::from_millis(30))
                .refresh_interval(Duration::from_millis(10)),
        )
        .await
        .unwrap();
    assert_eq!(advance(&rollout, &clock).await, Phase::CacheBoth);
    assert_eq!(advance(&rollout, &clock).await, Phase::DualWrite);

    // Dual write: refused before the new row is written; the transaction
    // is rollback-only, so the old row does not commit either.
    let tx = cluster.begin::<Customer>(100).await.unwrap();
    let err = tx.insert(person(1, 100)).await.unwrap_err();
    match &err {
        ShardError::CrossShardWrite {
            entity,
            column,
            expected,
            found,
        } => assert_eq!(
            (*entity, *column, expected.as_str(), found.as_str()),
            ("people_v2", "customer_id", "100", "101")
        ),
        other => panic!("expected CrossShardWrite, got {other:?}"),
    }
    assert!(tx.is_rollback_only());
    assert!(matches!(
        tx.commit().await.unwrap_err(),
        ShardError::RollbackOnly { .. }
    ));
    assert_eq!(count_rows(&cluster, "people").await, 0);
    assert_eq!(count_rows(&cluster, "people_v2").await, 0);

    // A key the conversion keeps still dual-writes.
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    tx.insert(person(2, 7)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count_rows(&cluster, "people_v2").await, 1);

    // Backfill of an old row written behind shardkit's back: refused,
    // naming the row, and nothing of it copied.
    let shard = cluster.shard_of::<Customer>(&200).await.unwrap().to_owned();
    let db = cluster.connection(&shard).unwrap();
    db.execute_unprepared(
        "INSERT INTO people (id, customer_id, first_name, last_name, city) \
         VALUES (3, 200, 'Bo', 'L3', 'Rome')",
    )
    .await
    .unwrap();
    // (A backfill starts once every instance must be dual-writing.)
    clock.advance(rollout.gap());
    let err = rollout.backfill().await.unwrap_err();
    match &err {
        ShardError::Rollout { reason, .. } => assert!(
            reason.contains("`people` row id = 3")
                && reason.contains("customer_id = 201")
                && reason.contains("pinned to customer_id = 200"),
            "{reason}"
        ),
        other => panic!("expected the backfill to name the row: {other:?}"),
    }
    assert_eq!(
        count_rows(&cluster, "people_v2").await,
        1,
        "the moved row was not copied anywhere"
    );
}
