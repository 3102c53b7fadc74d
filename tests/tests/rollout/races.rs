//! Rollouts and background tasks under the conditions that break them:
//! clusters dropped while their periodic tasks run, phases that move while
//! a backfill runs, and instances that act on an older phase.

use sea_orm::ActiveValue::{Set, Unchanged};
use sea_orm::{ConnectionTrait, Statement};
use shardkit::{
    Cluster, JobControl, ManualClock, Phase, Rollout, RolloutHandle, ShardError, VerifyOptions,
};
use shardkit_tests::models::*;
use shardkit_tests::{Sent, TestDbs, recording_cluster_with};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

type People = RolloutHandle<person_v1::Entity, person_v2::Entity>;

const TTL: Duration = Duration::from_millis(150);
const REFRESH: Duration = Duration::from_millis(10);

fn people_rollout(refresh: Duration) -> Rollout<person_v1::Entity, person_v2::Entity> {
    Rollout::new("people_v2", person_to_v2)
        .to_old(person_to_v1)
        .cache_ttl(TTL)
        .refresh_interval(refresh)
}

/// One application instance reading `clock`, with its statement log.
async fn instance(dbs: &TestDbs, clock: &Arc<ManualClock>) -> (Cluster, Sent, People) {
    instance_refreshing(dbs, clock, REFRESH).await
}

/// An instance that re-reads the phase by itself every `refresh`.
async fn instance_refreshing(
    dbs: &TestDbs,
    clock: &Arc<ManualClock>,
    refresh: Duration,
) -> (Cluster, Sent, People) {
    let clock = Arc::clone(clock);
    let (cluster, sent) =
        recording_cluster_with(dbs, 4, "[groups.Customer]\n", move |b| b.clock(clock)).await;
    cluster.migrate::<Migrator>().await.unwrap();
    let people = cluster
        .register_rollout(people_rollout(refresh))
        .await
        .unwrap();
    (cluster, sent, people)
}

/// Advances, moving `clock` by exactly the wait a refusal names.
async fn advance(people: &People, clock: &ManualClock) -> Phase {
    loop {
        match people.advance().await {
            Ok(phase) => return phase,
            Err(ShardError::RolloutTooSoon { wait_ms, .. }) => {
                clock.advance(Duration::from_millis(wait_ms))
            }
            Err(e) => panic!("advance: {e}"),
        }
    }
}

async fn set_city(cluster: &Cluster, id: i64, customer: i64, city: &str) {
    let tx = cluster.begin::<Customer>(customer).await.unwrap();
    tx.update(person_v1::ActiveModel {
        id: Unchanged(id),
        customer_id: Unchanged(customer),
        city: Set(city.into()),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// `(id, city)` of every row of `table`, over all shards, by id.
async fn cities(cluster: &Cluster, table: &str) -> Vec<(i64, String)> {
    let mut rows = Vec::new();
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        for row in db
            .query_all_raw(Statement::from_string(
                db.get_database_backend(),
                format!("SELECT id, city FROM {table}"),
            ))
            .await
            .unwrap()
        {
            rows.push((
                row.try_get::<i64>("", "id").unwrap(),
                row.try_get::<String>("", "city").unwrap(),
            ));
        }
    }
    rows.sort();
    rows
}

/// The stored backfill progress of the rollout (its state row is on one
/// shard of the group).
async fn stored_backfill(cluster: &Cluster) -> Option<String> {
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        let row = db
            .query_one_raw(Statement::from_string(
                db.get_database_backend(),
                "SELECT backfill FROM shardkit_rollouts WHERE name = 'people_v2'",
            ))
            .await
            .unwrap();
        if let Some(row) = row {
            return row.try_get::<Option<String>>("", "backfill").unwrap();
        }
    }
    panic!("no state row for the rollout")
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
pub(crate) async fn dropping_the_cluster_stops_its_tasks_and_closes_its_pools(dbs: &mut TestDbs) {
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

/// Instance B retreats to cache_both while A's backfill runs (between two
/// chunks: A's progress callback waits for it) and then updates rows that
/// only the old table gets. A's backfill stops at its next chunk with a
/// refusal naming the phase, records neither progress nor `done`, and after
/// the fleet is back in dual_write a new backfill copies every row from the
/// start, so read_new serves the updates.
pub(crate) async fn retreat_during_backfill_stops_it_and_voids_its_progress(dbs: &mut TestDbs) {
    const ROWS: i64 = 12;
    let clock = Arc::new(ManualClock::starting_now());
    let (a_app, _, a) = instance(dbs, &clock).await;
    let (b_app, _, b) = instance(dbs, &clock).await;
    for id in 1..=ROWS {
        put(&a_app, id, id, "Oslo").await;
    }
    assert_eq!(advance(&a, &clock).await, Phase::CacheBoth);
    assert_eq!(advance(&a, &clock).await, Phase::DualWrite);
    clock.advance(a.gap());

    // After A's first chunk, its progress callback has B retreat and update
    // every row before the backfill goes on (the callback is synchronous:
    // it leaves the worker thread to the runtime while it waits).
    let runtime = tokio::runtime::Handle::current();
    let calls = Arc::new(AtomicU64::new(0));
    let (counted, b, b_app) = (Arc::clone(&calls), b.clone(), b_app.clone());
    let result = a
        .backfill_with(
            1,
            JobControl::new().on_progress(move |_| {
                if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                    tokio::task::block_in_place(|| {
                        runtime.block_on(async {
                            // B retreats from the phase it acts on: dual_write.
                            assert_eq!(b.refresh().await.unwrap(), Phase::DualWrite);
                            assert_eq!(b.retreat().await.unwrap(), Phase::CacheBoth);
                            for id in 1..=ROWS {
                                set_city(&b_app, id, id, "Fresh").await;
                            }
                        })
                    });
                }
            }),
        )
        .await;
    match result {
        Err(ShardError::Rollout { reason, .. }) => {
            assert!(
                reason.contains("from dual_write to cache_both") && reason.contains("void"),
                "{reason}"
            )
        }
        other => panic!("the backfill went on after the retreat: {other:?}"),
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "no chunk after the retreat"
    );
    assert_eq!(stored_backfill(&a_app).await, None, "progress is void");
    assert_eq!(a.refresh().await.unwrap(), Phase::CacheBoth);
    assert!(cities(&a_app, "people_v2").await.len() <= 2);

    // Back to dual_write: read_new needs a new, complete backfill, which
    // copies the rows as they are now.
    assert_eq!(advance(&a, &clock).await, Phase::DualWrite);
    match a.advance().await {
        Err(ShardError::Rollout { reason, .. }) => assert!(reason.contains("backfill"), "{reason}"),
        other => panic!("read_new without a backfill: {other:?}"),
    }
    clock.advance(a.gap());
    let done = a.backfill().await.unwrap();
    assert!(done.finished);
    assert_eq!(done.rows, ROWS as u64, "copied from the start");
    assert_eq!(advance(&a, &clock).await, Phase::ReadNew);
    let fresh: Vec<(i64, String)> = (1..=ROWS).map(|id| (id, "Fresh".to_owned())).collect();
    assert_eq!(cities(&a_app, "people_v2").await, fresh);
    for id in 1..=ROWS {
        assert_eq!(a.get_new(id, id).await.unwrap().unwrap().city, "Fresh");
    }
}

/// Instance A moves to dual_write while instance B (which re-reads the
/// phase only every hour) still acts on cache_both. A's backfill is refused
/// with the wait until every instance must be dual-writing; B's updates in
/// the meantime reach only the old table. Once the gap has passed (and B has
/// re-read the phase, as it must have by then), A's backfill copies them and
/// read_new serves every row as B last wrote it.
pub(crate) async fn backfill_waits_until_every_instance_dual_writes(dbs: &mut TestDbs) {
    const ROWS: i64 = 10;
    let clock = Arc::new(ManualClock::starting_now());
    let (a_app, _, a) = instance(dbs, &clock).await;
    let (b_app, _, b) = instance_refreshing(dbs, &clock, Duration::from_secs(3600)).await;
    for id in 1..=ROWS {
        put(&a_app, id, id, "Oslo").await;
    }
    assert_eq!(advance(&a, &clock).await, Phase::CacheBoth);
    assert_eq!(b.refresh().await.unwrap(), Phase::CacheBoth);
    assert_eq!(advance(&a, &clock).await, Phase::DualWrite);
    assert_eq!(b.phase(), Phase::CacheBoth, "B has not re-read the phase");
    let gap_ms = b.gap().as_millis() as u64;
    assert!(gap_ms > a.gap().as_millis() as u64, "the stored gap is B's");

    match a.backfill().await {
        Err(ShardError::RolloutTooSoon {
            from,
            to,
            elapsed_ms,
            gap_ms: refused_gap,
            wait_ms,
            ..
        }) => {
            assert_eq!((from, to), (Phase::DualWrite, Phase::DualWrite));
            assert_eq!((elapsed_ms, refused_gap, wait_ms), (0, gap_ms, gap_ms));
        }
        other => panic!("backfill before the fleet dual-writes: {other:?}"),
    }
    assert_eq!(cities(&a_app, "people_v2").await, vec![], "nothing copied");
    // B, still on cache_both, updates every row: the old table only.
    for id in 1..=ROWS {
        set_city(&b_app, id, id, "Fresh").await;
    }
    assert_eq!(cities(&b_app, "people_v2").await, vec![]);
    // One millisecond short of the gap, still refused.
    clock.advance(Duration::from_millis(gap_ms - 1));
    assert!(matches!(
        a.backfill().await,
        Err(ShardError::RolloutTooSoon { wait_ms: 1, .. })
    ));
    clock.advance(Duration::from_millis(1));
    // By now B's refresh has run; its writes dual-write.
    assert_eq!(b.refresh().await.unwrap(), Phase::DualWrite);
    set_city(&b_app, 1, 1, "Latest").await;
    let done = a.backfill().await.unwrap();
    assert!(done.finished);
    assert_eq!(advance(&a, &clock).await, Phase::ReadNew);
    let mut want: Vec<(i64, String)> = (1..=ROWS).map(|id| (id, "Fresh".to_owned())).collect();
    want[0].1 = "Latest".to_owned();
    assert_eq!(cities(&a_app, "people_v2").await, want);
    for (id, city) in &want {
        assert_eq!(&a.get_new(*id, *id).await.unwrap().unwrap().city, city);
    }
}

/// In new_only an old-entity write goes to the new table only, through the
/// conversion; a conversion that moves the row to another shard key is
/// refused there too (insert and update alike): `CrossShardWrite`, the
/// transaction rollback-only, nothing written.
pub(crate) async fn new_only_write_that_moves_the_key_is_refused(dbs: &mut TestDbs) {
    fn moving(old: &person_v1::Model) -> person_v2::Model {
        let mut new = person_to_v2(old);
        if old.customer_id >= 100 {
            new.customer_id += 1;
        }
        new
    }
    let clock = Arc::new(ManualClock::starting_now());
    let shared = Arc::clone(&clock);
    let (cluster, _) =
        recording_cluster_with(dbs, 4, "[groups.Customer]\n", move |b| b.clock(shared)).await;
    cluster.migrate::<Migrator>().await.unwrap();
    let rollout: People = cluster
        .register_rollout(
            Rollout::new("moving", moving)
                .to_old(person_to_v1)
                .cache_ttl(TTL)
                .refresh_interval(REFRESH),
        )
        .await
        .unwrap();
    assert_eq!(advance(&rollout, &clock).await, Phase::CacheBoth);
    assert_eq!(advance(&rollout, &clock).await, Phase::DualWrite);
    clock.advance(rollout.gap());
    assert!(rollout.backfill().await.unwrap().finished);

    // In dual_write, a batch update of the old entity goes row by row
    // through the pipeline: each row is dual-written, in the same
    // transaction.
    put(&cluster, 7, 7, "Oslo").await;
    put(&cluster, 8, 7, "Oslo").await;
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    let changed = tx
        .update_many::<person_v1::Entity>()
        .set(person_v1::ActiveModel {
            city: Set("Bergen".into()),
            ..Default::default()
        })
        .exec()
        .await
        .unwrap();
    assert_eq!(changed, 2);
    tx.commit().await.unwrap();
    assert_eq!(
        cities(&cluster, "people_v2").await,
        vec![(7, "Bergen".to_owned()), (8, "Bergen".to_owned())]
    );
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    assert_eq!(
        tx.delete_many::<person_v1::Entity>().exec().await.unwrap(),
        2
    );
    tx.commit().await.unwrap();
    assert_eq!(shardkit_tests::count_rows(&cluster, "people_v2").await, 0);

    assert_eq!(advance(&rollout, &clock).await, Phase::ReadNew);
    assert_eq!(advance(&rollout, &clock).await, Phase::NewOnly);

    // From new_only on the old table is not written: a batch cannot pick
    // its rows there, and is refused before any I/O.
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    let err = tx
        .update_many::<person_v1::Entity>()
        .set(person_v1::ActiveModel {
            city: Set("Rome".into()),
            ..Default::default()
        })
        .exec()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ShardError::Unsupported { operation: "update_many", reason, .. } if reason.contains("NewOnly")),
        "{err:?}"
    );
    let err = tx
        .delete_many::<person_v1::Entity>()
        .exec()
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            ShardError::Unsupported {
                operation: "delete_many",
                ..
            }
        ),
        "{err:?}"
    );
    drop(tx);
    let cross = |err: &ShardError| {
        matches!(err, ShardError::CrossShardWrite { entity, expected, found, .. }
            if *entity == "people_v2" && expected == "100" && found == "101")
    };

    let tx = cluster.begin::<Customer>(100).await.unwrap();
    let err = tx.insert(person(1, 100, "Oslo")).await.unwrap_err();
    assert!(cross(&err), "{err:?}");
    assert!(tx.is_rollback_only());
    assert!(matches!(
        tx.commit().await.unwrap_err(),
        ShardError::RollbackOnly { .. }
    ));
    assert_eq!(shardkit_tests::count_rows(&cluster, "people").await, 0);
    assert_eq!(shardkit_tests::count_rows(&cluster, "people_v2").await, 0);

    // A new row of key 100 written behind shardkit's back, then updated
    // through the old entity: the converted row would move; refused.
    let shard = cluster.shard_of::<Customer>(&100).await.unwrap().to_owned();
    let db = cluster.connection(&shard).unwrap();
    db.execute_unprepared(
        "INSERT INTO people_v2 (id, customer_id, first_name, last_name, display_name, city) \
         VALUES (2, 100, 'Bo', 'Dahl', 'Bo Dahl', 'Rome')",
    )
    .await
    .unwrap();
    let tx = cluster.begin::<Customer>(100).await.unwrap();
    let err = tx
        .update(person_v1::ActiveModel {
            id: Unchanged(2),
            customer_id: Unchanged(100),
            city: Set("Pisa".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(cross(&err), "{err:?}");
    assert!(tx.is_rollback_only());
    drop(tx);
    assert_eq!(
        cities(&cluster, "people_v2").await,
        vec![(2, "Rome".to_owned())]
    );
}

/// Two retreats at once from dual_write: one goes back to cache_both, the
/// other is refused with the refusal a losing advance gets, and the phase
/// stays on cache_both (never `off`). Twenty pairs per backend, three ways:
/// two calls on one instance, one call on each of two instances, and B
/// retreating right after A although B still acts on dual_write (an
/// operator who saw dual_write and asked for one step back).
pub(crate) async fn two_retreats_at_once_go_back_one_phase(dbs: &mut TestDbs) {
    const PAIRS: usize = 20;
    let clock = Arc::new(ManualClock::starting_now());
    // Neither instance re-reads the phase on its own: the test says when.
    let (_a_app, _, a) = instance_refreshing(dbs, &clock, Duration::from_secs(3600)).await;
    let (_b_app, _, b) = instance_refreshing(dbs, &clock, Duration::from_secs(3600)).await;
    assert_eq!(advance(&a, &clock).await, Phase::CacheBoth);
    let lost_race = "another instance changed the phase first; refresh and decide again";
    let moved_meanwhile = "another instance moved the phase from dual_write to cache_both \
                           meanwhile; refresh and decide again";
    for pair in 0..PAIRS {
        assert_eq!(advance(&a, &clock).await, Phase::DualWrite);
        assert_eq!(b.refresh().await.unwrap(), Phase::DualWrite);
        let (first, second) = match pair % 3 {
            0 => tokio::join!(a.retreat(), a.retreat()),
            1 => tokio::join!(a.retreat(), b.retreat()),
            _ => {
                let first = a.retreat().await;
                assert_eq!(b.phase(), Phase::DualWrite, "B has not re-read the phase");
                (first, b.retreat().await)
            }
        };
        let (won, lost) = match (first, second) {
            (Ok(won), Err(lost)) | (Err(lost), Ok(won)) => (won, lost),
            other => panic!("pair {pair}: not exactly one retreat applied: {other:?}"),
        };
        assert_eq!(won, Phase::CacheBoth, "pair {pair}");
        match &lost {
            ShardError::Rollout {
                rollout, reason, ..
            } => {
                assert_eq!(rollout, "people_v2", "pair {pair}");
                if pair % 3 == 2 {
                    assert_eq!(reason, moved_meanwhile, "pair {pair}");
                } else {
                    assert!(
                        reason == lost_race || reason == moved_meanwhile,
                        "pair {pair}: {reason}"
                    );
                }
            }
            other => panic!("pair {pair}: the refused retreat: {other:?}"),
        }
        assert_eq!(lost.kind(), shardkit::ErrorKind::Refused, "pair {pair}");
        assert_eq!(a.refresh().await.unwrap(), Phase::CacheBoth, "pair {pair}");
        assert_eq!(b.refresh().await.unwrap(), Phase::CacheBoth, "pair {pair}");
    }
    // The refused side retreats once it has seen the phase it goes back from.
    assert_eq!(b.retreat().await.unwrap(), Phase::Off);
}
