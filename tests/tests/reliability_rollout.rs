//! Rollouts and background tasks under the conditions that break them:
//! clusters dropped while their periodic tasks run, phases that move while
//! a backfill runs, and instances that act on an older phase.

use sea_orm::ActiveValue::Set;
use shardkit::{Cluster, ManualClock, Rollout, RolloutHandle, VerifyOptions};
use shardkit_tests::models::*;
use shardkit_tests::{Sent, TestDbs, backend_tests, recording_cluster_with};
use std::sync::Arc;
use std::time::Duration;

backend_tests!(4 =>
    dropping_the_cluster_stops_its_tasks_and_closes_its_pools,
);

type People = RolloutHandle<person_v1::Entity, person_v2::Entity>;

const TTL: Duration = Duration::from_millis(150);
const REFRESH: Duration = Duration::from_millis(10);

fn people_rollout() -> Rollout<person_v1::Entity, person_v2::Entity> {
    Rollout::new("people_v2", person_to_v2)
        .to_old(person_to_v1)
        .cache_ttl(TTL)
        .refresh_every(REFRESH)
}

/// One application instance reading `clock`, with its statement log.
async fn instance(dbs: &TestDbs, clock: &Arc<ManualClock>) -> (Cluster, Sent, People) {
    let clock = Arc::clone(clock);
    let (cluster, sent) =
        recording_cluster_with(dbs, 4, "[groups.Customer]\n", move |b| b.clock(clock)).await;
    cluster.migrate::<Migrator>().await.unwrap();
    let people = cluster.register_rollout(people_rollout()).await.unwrap();
    (cluster, sent, people)
}

fn person(id: i64, customer: i64, city: &str) -> person_v1::ActiveModel {
    person_v1::ActiveModel {
        id: Set(id),
        customer_id: Set(customer),
        first_name: Set("Ann".into()),
        last_name: Set(format!("Lee{id}")),
        city: Set(city.into()),
    }
}

async fn put(cluster: &Cluster, id: i64, customer: i64, city: &str) {
    let tx = cluster.begin::<Customer>(customer).await.unwrap();
    tx.insert(person(id, customer, city)).await.unwrap();
    tx.commit().await.unwrap();
}

/// How many recorded statements mention `text`.
fn mentions(sent: &Sent, text: &str) -> usize {
    sent.lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| s.sql.contains(text))
        .count()
}

/// Waits (polling, bounded) until `done` holds.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A cluster that ran a reconciler, a verifier and a rollout's phase
/// refresh: dropping its last handle ends all three tasks and closes every
/// connection it opened (the server's own count is back to where it was).
async fn dropping_the_cluster_stops_its_tasks_and_closes_its_pools(dbs: &mut TestDbs) {
    let baseline = dbs.server_connections().await;
    let clock = Arc::new(ManualClock::starting_now());
    let (cluster, sent, people) = instance(dbs, &clock).await;
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    for id in 1..=8 {
        put(&cluster, id, id, "Oslo").await;
    }
    let reconciler = cluster
        .gsi()
        .reconcile_every::<contact::Entity>(Duration::from_millis(10));
    let verifier = people.verify_every(Duration::from_millis(10), VerifyOptions::default());
    // Every task has run: the reconciler reads the index tables, the
    // verifier the new table, the refresh the state table (again and again).
    let refreshes = mentions(&sent, "shardkit_rollouts");
    eventually("a reconcile pass", || {
        mentions(&sent, "gsi_contacts_email") > 0
    })
    .await;
    eventually("a verify pass", || mentions(&sent, "people_v2") > 0).await;
    eventually("phase refreshes", || {
        mentions(&sent, "shardkit_rollouts") > refreshes + 2
    })
    .await;
    if dbs.backend != shardkit_tests::Backend::Sqlite {
        assert!(dbs.server_connections().await > baseline);
    }

    drop(people);
    drop(cluster);
    for (name, task) in [("reconcile_every", reconciler), ("verify_every", verifier)] {
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap_or_else(|_| panic!("{name} still runs after the cluster was dropped"))
            .unwrap();
    }
    // The rollout's refresh task holds nothing either: the pools close.
    assert_eq!(
        dbs.settle_connections(baseline, Duration::from_secs(10))
            .await,
        baseline,
        "connections left open after the cluster was dropped"
    );
}
