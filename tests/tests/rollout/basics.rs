//! Denormalisation rollouts on SQLite, PostgreSQL and MySQL/MariaDB: two
//! application instances sharing the phase, dual writes that commit or fail
//! together, caches of both models, backfill, and the verifier.

use sea_orm::{
    ActiveValue::Unchanged, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QuerySelect,
    Set, Statement,
};
use shardkit::clock::Clock;
use shardkit::{
    CancellationToken, Cluster, JobControl, ManualClock, Phase, Rollout, RolloutHandle, ShardError,
    VerifyOptions,
};
use shardkit_tests::models::*;
use shardkit_tests::{
    Sent, TestDbs, cancelled_by_another_task, count_rows, recording_cluster_with,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

type People = RolloutHandle<person_v1::Entity, person_v2::Entity>;

const TTL: Duration = Duration::from_millis(150);
const REFRESH: Duration = Duration::from_millis(40);

fn people_rollout(ttl: Duration) -> Rollout<person_v1::Entity, person_v2::Entity> {
    Rollout::new("people_v2", person_to_v2)
        .to_old(person_to_v1)
        .cache_ttl(ttl)
        .refresh_interval(REFRESH)
}

/// The time every instance of a test reads: phase gaps and cache lifetimes
/// pass when the test advances it, not while it sleeps.
fn test_clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::starting_now())
}

/// A cluster over the test's shards reading `clock`.
async fn connect(dbs: &TestDbs, clock: &Arc<ManualClock>) -> (Cluster, Sent) {
    let clock = Arc::clone(clock);
    recording_cluster_with(dbs, 4, "[groups.Customer]", move |b| b.clock(clock)).await
}

/// One application instance: its own pools, caches and statement log.
async fn instance(dbs: &TestDbs, clock: &Arc<ManualClock>) -> (Cluster, Sent, People) {
    let (cluster, sent) = connect(dbs, clock).await;
    cluster.migrate::<Migrator>().await.unwrap();
    let people = cluster.register_rollout(people_rollout(TTL)).await.unwrap();
    (cluster, sent, people)
}

fn person(id: i64, customer: i64, first: &str, last: &str, city: &str) -> person_v1::Model {
    person_v1::Model {
        id,
        customer_id: customer,
        first_name: first.to_owned(),
        last_name: last.to_owned(),
        city: city.to_owned(),
    }
}

/// Inserts through the old path, as code that knows nothing of the rollout.
async fn put(cluster: &Cluster, p: &person_v1::Model) -> shardkit::Result<person_v1::Model> {
    let tx = cluster.begin::<Customer>(p.customer_id).await?;
    let row = tx
        .insert(person_v1::ActiveModel {
            id: Set(p.id),
            customer_id: Set(p.customer_id),
            first_name: Set(p.first_name.clone()),
            last_name: Set(p.last_name.clone()),
            city: Set(p.city.clone()),
        })
        .await?;
    tx.commit().await?;
    Ok(row)
}

async fn set_city(
    cluster: &Cluster,
    id: i64,
    customer: i64,
    city: &str,
) -> shardkit::Result<person_v1::Model> {
    let tx = cluster.begin::<Customer>(customer).await?;
    let row = tx
        .update(person_v1::ActiveModel {
            id: Unchanged(id),
            customer_id: Unchanged(customer),
            city: Set(city.to_owned()),
            ..Default::default()
        })
        .await?;
    tx.commit().await?;
    Ok(row)
}

async fn remove(cluster: &Cluster, id: i64, customer: i64) -> shardkit::Result<u64> {
    let tx = cluster.begin::<Customer>(customer).await?;
    let n = tx
        .delete(person_v1::ActiveModel {
            id: Unchanged(id),
            customer_id: Unchanged(customer),
            ..Default::default()
        })
        .await?;
    tx.commit().await?;
    Ok(n)
}

/// Advances as soon as the gap allows: a refusal names the wait, and the
/// clock is moved by exactly that much.
async fn advance<New: shardkit::ShardedEntity<Group = Customer>>(
    people: &RolloutHandle<person_v1::Entity, New>,
    clock: &ManualClock,
) -> Phase {
    loop {
        match people.advance().await {
            Ok(phase) => return phase,
            Err(ShardError::RolloutTooSoon { wait_ms, .. }) => {
                assert!(wait_ms > 0);
                clock.advance(Duration::from_millis(wait_ms));
            }
            Err(e) => panic!("advance: {e}"),
        }
    }
}

/// Waits (without asking) until the instance acts on `phase`: phase
/// changes reach it through its own refresh, every `REFRESH` of real time.
async fn sees(people: &People, phase: Phase) {
    let start = Instant::now();
    while people.phase() != phase {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "instance still on {} after {:?}, expected {phase}",
            people.phase(),
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Statements sent other than shardkit's background reads of its rollout
/// tables: the phase refresh's of `shardkit_rollouts` (every `REFRESH`) and
/// the unregistered-writer watch's of `shardkit_rollout_instances` (every
/// 30 s of wall time after a write), whatever the test does.
fn statements(sent: &Sent) -> Vec<String> {
    sent.lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| !background(&s.sql))
        .map(|(_, s)| s.sql.clone())
        .collect()
}

fn background(sql: &str) -> bool {
    sql.contains("shardkit_rollouts") || sql.contains("shardkit_rollout_instances")
}

/// The row of `table` with `id` on the shard its key routes to (raw SQL).
async fn raw_city(cluster: &Cluster, table: &str, customer: i64, id: i64) -> Option<String> {
    let shard = cluster.shard_of::<Customer>(&customer).await.unwrap();
    let db = cluster.connection(shard).unwrap();
    db.query_one_raw(Statement::from_string(
        db.get_database_backend(),
        format!("SELECT city FROM {table} WHERE id = {id}"),
    ))
    .await
    .unwrap()
    .map(|r| r.try_get::<String>("", "city").unwrap())
}

pub(crate) async fn full_rollout_walk(dbs: &mut TestDbs) {
    let clock = test_clock();
    // Two instances: "old code" writes and reads the old model; "new code"
    // reads the new one. Both have the rollout registered.
    let (old_app, old_sent, old_view) = instance(dbs, &clock).await;
    let (new_app, new_sent, new_view) = instance(dbs, &clock).await;
    assert_eq!(old_view.phase(), Phase::Off);

    // Off: only the old table is written; the new path converts old rows.
    for id in 1..=10 {
        put(
            &old_app,
            &person(id, id % 5, "Ann", &format!("Lee{id}"), "Oslo"),
        )
        .await
        .unwrap();
    }
    assert_eq!(count_rows(&old_app, "people_v2").await, 0);
    let want = person_to_v2(&person(3, 3, "Ann", "Lee3", "Oslo"));
    assert_eq!(new_view.get_new(3, 3).await.unwrap(), Some(want.clone()));

    // CacheBoth: every write fills both caches; tables unchanged.
    assert_eq!(advance(&old_view, &clock).await, Phase::CacheBoth);
    sees(&new_view, Phase::CacheBoth).await;
    let ann = put(&old_app, &person(11, 1, "Ann", "Berg", "Rome"))
        .await
        .unwrap();
    // PayPal's failure: inserted through the old path, read through the new
    // path on the same instance. Both cache objects exist, so the new read
    // is the converted row, without a statement.
    let before = statements(&old_sent);
    assert_eq!(
        old_view.get_new(1, 11).await.unwrap(),
        Some(person_to_v2(&ann))
    );
    assert_eq!(old_view.get_old(1, 11).await.unwrap(), Some(ann.clone()));
    let sent = statements(&old_sent);
    assert_eq!(
        sent.len(),
        before.len(),
        "cached reads sent SQL: {:?}",
        &sent[before.len()..]
    );
    // The other instance has no cache entry: it reads the old table.
    let before = statements(&new_sent);
    assert_eq!(
        new_view.get_new(1, 11).await.unwrap(),
        Some(person_to_v2(&ann))
    );
    let sent = statements(&new_sent);
    assert_eq!(sent.len(), before.len() + 1, "{:?}", &sent[before.len()..]);
    assert_eq!(count_rows(&old_app, "people_v2").await, 0);
    // Deletes invalidate both caches.
    assert_eq!(remove(&old_app, 11, 1).await.unwrap(), 1);
    assert_eq!(old_view.get_new(1, 11).await.unwrap(), None);
    assert_eq!(old_view.get_old(1, 11).await.unwrap(), None);

    // DualWrite: writes of the old entity write the new table too, from
    // either instance.
    assert_eq!(advance(&new_view, &clock).await, Phase::DualWrite);
    sees(&old_view, Phase::DualWrite).await;
    put(&old_app, &person(12, 2, "Bo", "Dahl", "Pisa"))
        .await
        .unwrap();
    put(&new_app, &person(13, 3, "Cy", "Moe", "Lima"))
        .await
        .unwrap();
    set_city(&new_app, 1, 1, "Bergen").await.unwrap(); // predates dual writes
    assert_eq!(remove(&old_app, 2, 2).await.unwrap(), 1);
    assert_eq!(
        raw_city(&old_app, "people_v2", 2, 12).await.as_deref(),
        Some("Pisa")
    );
    assert_eq!(
        raw_city(&old_app, "people_v2", 3, 13).await.as_deref(),
        Some("Lima")
    );
    assert_eq!(
        raw_city(&old_app, "people_v2", 1, 1).await.as_deref(),
        Some("Bergen")
    );
    // Rows from before dual writes are missing from the new table until the
    // backfill; the verifier says which, and reads cannot move yet.
    let report = old_view
        .verify(VerifyOptions::default().chunk(3))
        .await
        .unwrap();
    let missing: std::collections::BTreeSet<String> =
        report.missing.iter().map(|d| d.pk.clone()).collect();
    let expected: std::collections::BTreeSet<String> =
        [3, 4, 5, 6, 7, 8, 9, 10].map(|i: i64| i.to_string()).into();
    assert_eq!(missing, expected);
    assert!(report.extra.is_empty() && report.different.is_empty());
    clock.advance(TTL + REFRESH);
    match old_view.advance().await {
        Err(ShardError::Rollout {
            phase: Phase::DualWrite,
            reason,
            ..
        }) => {
            assert!(reason.contains("backfill"), "{reason}")
        }
        other => panic!("advance before backfill: {other:?}"),
    }
    // Cancelled after its first chunk, a backfill resumes where it stopped.
    let stop = CancellationToken::new();
    let cancel = stop.clone();
    let first = old_view
        .backfill_with(
            2,
            JobControl::new()
                .on_progress(move |_| cancel.cancel())
                .cancel_on(stop),
        )
        .await
        .unwrap();
    assert!(!first.finished && first.rows <= 2, "{first:?}");
    let chunks = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&chunks);
    let done = old_view
        .backfill_with(
            2,
            JobControl::new().on_progress(move |_| {
                counted.fetch_add(1, Ordering::Relaxed);
            }),
        )
        .await
        .unwrap();
    let chunks = chunks.load(Ordering::Relaxed);
    assert!(
        done.finished && chunks >= 4,
        "{done:?} after {chunks} callbacks"
    );
    // Resumed, not restarted: the two runs copied each old row once.
    assert_eq!(first.rows + done.rows, count_rows(&old_app, "people").await);
    assert_eq!(
        count_rows(&old_app, "people_v2").await,
        count_rows(&old_app, "people").await
    );
    let report = new_view
        .verify(VerifyOptions::default().chunk(3))
        .await
        .unwrap();
    assert!(report.is_consistent(), "{report:?}");
    assert_eq!(report.rows, 11);

    // ReadNew: reads come from the new table; old reads are converted back.
    assert_eq!(advance(&old_view, &clock).await, Phase::ReadNew);
    sees(&new_view, Phase::ReadNew).await;
    set_city(&old_app, 12, 2, "Genoa").await.unwrap();
    new_view.clear_caches();
    let before = new_sent.lock().unwrap().len();
    let got = new_view.get_old(2, 12).await.unwrap().unwrap();
    assert_eq!(got.city, "Genoa");
    let read: Vec<_> = new_sent.lock().unwrap()[before..]
        .iter()
        .filter(|(_, s)| !background(&s.sql))
        .cloned()
        .collect();
    assert!(
        read.len() == 1 && read[0].1.sql.contains("people_v2"),
        "expected one read of people_v2: {read:?}"
    );
    let report = old_view.verify(VerifyOptions::default()).await.unwrap();
    assert!(report.is_consistent(), "{report:?}");

    // NewOnly: old-path writes land in the new table only.
    assert_eq!(advance(&new_view, &clock).await, Phase::NewOnly);
    sees(&old_view, Phase::NewOnly).await;
    let old_rows = count_rows(&old_app, "people").await;
    let dee = put(&old_app, &person(14, 4, "Dee", "Holm", "Kyiv"))
        .await
        .unwrap();
    set_city(&old_app, 3, 3, "Turin").await.unwrap();
    assert_eq!(count_rows(&old_app, "people").await, old_rows);
    assert_eq!(
        raw_city(&old_app, "people", 3, 3).await.as_deref(),
        Some("Oslo")
    );
    assert_eq!(
        raw_city(&old_app, "people_v2", 3, 3).await.as_deref(),
        Some("Turin")
    );
    assert_eq!(new_view.get_old(4, 14).await.unwrap(), Some(dee.clone()));
    assert_eq!(new_view.get_new(3, 3).await.unwrap().unwrap().city, "Turin");
    // The old table missed exactly those writes; checked from the new side,
    // the verifier finds them and repairs the old table (what a rollback
    // from new_only needs), after which both agree.
    let report = old_view
        .verify(VerifyOptions::default().from_new().repair())
        .await
        .unwrap();
    assert_eq!(report.missing.len(), 1, "{report:?}");
    assert_eq!(report.missing[0].pk, "14");
    assert_eq!(report.different.len(), 1, "{report:?}");
    assert_eq!(report.different[0].pk, "3");
    assert_eq!(report.repaired, 2);
    assert!(
        old_view
            .verify(VerifyOptions::default())
            .await
            .unwrap()
            .is_consistent()
    );

    // Done: the old table is retired; writes of the old entity are refused
    // before anything is written.
    assert_eq!(advance(&old_view, &clock).await, Phase::Done);
    sees(&new_view, Phase::Done).await;
    match put(&new_app, &person(15, 0, "Eve", "Lund", "Riga")).await {
        Err(ShardError::Rollout {
            phase: Phase::Done, ..
        }) => {}
        other => panic!("write after done: {other:?}"),
    }
    assert_eq!(raw_city(&old_app, "people_v2", 0, 15).await, None);
    assert_eq!(
        old_view.advance().await.unwrap_err().kind(),
        shardkit::ErrorKind::Refused
    );
    // And back one phase at a time, at once.
    assert_eq!(old_view.retreat().await.unwrap(), Phase::NewOnly);
    assert_eq!(old_view.retreat().await.unwrap(), Phase::ReadNew);
    assert!(
        old_view
            .verify(VerifyOptions::default())
            .await
            .unwrap()
            .is_consistent()
    );
}

pub(crate) async fn failed_new_write_rolls_back_old(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (app, _, people) = instance(dbs, &clock).await;
    advance(&people, &clock).await;
    assert_eq!(advance(&people, &clock).await, Phase::DualWrite);
    put(&app, &person(1, 7, "Ann", "Lee", "Oslo"))
        .await
        .unwrap();
    // Same display name: the new table's unique index refuses it, and the
    // old row, written first in the same transaction, goes with it.
    let tx = app.begin::<Customer>(7).await.unwrap();
    let err = tx
        .insert(person_v1::ActiveModel {
            id: Set(2),
            customer_id: Set(7),
            first_name: Set("Ann".into()),
            last_name: Set("Lee".into()),
            city: Set("Rome".into()),
        })
        .await
        .unwrap_err();
    match &err {
        ShardError::Db { operation, .. } => assert_eq!(operation, "dual write people_v2"),
        other => panic!("expected a database error from the new table: {other:?}"),
    }
    assert!(tx.is_rollback_only());
    assert!(matches!(
        tx.commit().await,
        Err(ShardError::RollbackOnly { .. })
    ));
    assert_eq!(count_rows(&app, "people").await, 1);
    assert_eq!(count_rows(&app, "people_v2").await, 1);
    assert_eq!(raw_city(&app, "people", 7, 2).await, None);

    // An update that would collide on the new table changes neither.
    put(&app, &person(3, 7, "Bo", "Dahl", "Pisa"))
        .await
        .unwrap();
    let tx = app.begin::<Customer>(7).await.unwrap();
    assert!(
        tx.update(person_v1::ActiveModel {
            id: Unchanged(3),
            customer_id: Unchanged(7),
            first_name: Set("Ann".into()),
            last_name: Set("Lee".into()),
            ..Default::default()
        })
        .await
        .is_err()
    );
    drop(tx);
    let db_row = person_v1::Entity::find()
        .filter(sea_orm::ColumnTrait::eq(&person_v1::Column::Id, 3))
        .one(
            app.connection(app.shard_of::<Customer>(&7).await.unwrap())
                .unwrap(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(db_row.first_name, "Bo");
    assert_eq!(
        people.get_new(7, 3).await.unwrap().unwrap().display_name,
        "Bo Dahl"
    );
}

pub(crate) async fn phase_gap_is_enforced(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (app, _, people) = instance(dbs, &clock).await;
    // The first step has no previous change to wait for.
    assert_eq!(people.advance().await.unwrap(), Phase::CacheBoth);
    let gap = TTL + REFRESH;
    let too_soon = |result: shardkit::Result<Phase>| match result {
        Err(ShardError::RolloutTooSoon {
            from,
            to,
            gap_ms,
            wait_ms,
            elapsed_ms,
            ..
        }) => {
            assert_eq!((from, to), (Phase::CacheBoth, Phase::DualWrite));
            (gap_ms, elapsed_ms, wait_ms)
        }
        other => panic!("advance inside the gap: {other:?}"),
    };
    let gap_ms = gap.as_millis() as u64;
    assert_eq!(too_soon(people.advance().await), (gap_ms, 0, gap_ms));
    // One millisecond short of the gap is still too soon.
    clock.advance(gap - Duration::from_millis(1));
    assert_eq!(too_soon(people.advance().await), (gap_ms, gap_ms - 1, 1));
    assert_eq!(people.refresh().await.unwrap(), Phase::CacheBoth);
    // An instance with a longer cache TTL lengthens the gap for everyone.
    let (other, _) = connect(dbs, &clock).await;
    let slow = other
        .register_rollout(people_rollout(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(slow.phase(), Phase::CacheBoth);
    clock.advance(Duration::from_millis(1));
    let long_ms = (Duration::from_secs(30) + REFRESH).as_millis() as u64;
    assert_eq!(
        too_soon(people.advance().await),
        (long_ms, gap_ms, long_ms - gap_ms)
    );
    clock.advance(Duration::from_millis(long_ms - gap_ms));
    assert_eq!(people.advance().await.unwrap(), Phase::DualWrite);
    assert_eq!(people.retreat().await.unwrap(), Phase::CacheBoth);
    // Rolling back is allowed at once, and restarts the gap.
    assert_eq!(people.retreat().await.unwrap(), Phase::Off);
    assert!(matches!(
        people.advance().await,
        Err(ShardError::RolloutTooSoon { .. })
    ));
    // One rollout per old entity on a cluster.
    assert!(matches!(
        app.register_rollout(people_rollout(TTL)).await,
        Err(ShardError::Config { .. })
    ));
}

/// Runs `sql` on the shard of `customer`.
async fn exec_on(cluster: &Cluster, customer: i64, sql: &str) {
    let shard = cluster.shard_of::<Customer>(&customer).await.unwrap();
    let db = cluster.connection(shard).unwrap();
    let res = db.execute_unprepared(sql).await.unwrap();
    assert_eq!(res.rows_affected(), 1, "{sql}");
}

pub(crate) async fn verify_finds_injected_differences(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (app, _, people) = instance(dbs, &clock).await;
    advance(&people, &clock).await;
    advance(&people, &clock).await;
    // 60 rows of one customer (one shard), 20 of others.
    for id in 1..=80 {
        let customer = if id <= 60 { 5 } else { id % 4 };
        put(
            &app,
            &person(id, customer, "P", &format!("N{id}"), &format!("C{id}")),
        )
        .await
        .unwrap();
    }
    assert!(
        people
            .verify(VerifyOptions::default())
            .await
            .unwrap()
            .is_consistent()
    );
    exec_on(&app, 5, "DELETE FROM people_v2 WHERE id = 10").await;
    exec_on(
        &app,
        5,
        "INSERT INTO people_v2 (id, customer_id, first_name, last_name, display_name, city) \
         VALUES (99, 5, 'X', 'Y', 'X Y', 'Nowhere')",
    )
    .await;
    exec_on(
        &app,
        5,
        "UPDATE people_v2 SET city = 'Changed' WHERE id = 20",
    )
    .await;
    // A swapped pair: the set of values is unchanged, which XOR-of-CRC
    // checksums do not notice.
    exec_on(&app, 5, "UPDATE people_v2 SET city = 'C31' WHERE id = 30").await;
    exec_on(&app, 5, "UPDATE people_v2 SET city = 'C30' WHERE id = 31").await;

    let opts = VerifyOptions::default().chunk(7);
    let report = people.verify(opts.clone()).await.unwrap();
    let pks = |d: &[shardkit::RowDiff]| d.iter().map(|d| d.pk.clone()).collect::<Vec<_>>();
    assert_eq!(pks(&report.missing), ["10"]);
    assert_eq!(pks(&report.extra), ["99"]);
    let mut different = pks(&report.different);
    different.sort();
    assert_eq!(different, ["20", "30", "31"]);
    assert_eq!(report.rows, 80);
    assert!(report.finished && report.chunks_differing >= 2 && report.chunks_differing <= 4);
    let shard = app.shard_of::<Customer>(&5).await.unwrap();
    assert!(report.missing.iter().all(|d| d.shard == shard));

    // Progress after every chunk; cancelling stops at the next chunk
    // boundary, resumable.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let stop = CancellationToken::new();
    let (pushed, cancel) = (Arc::clone(&seen), stop.clone());
    let partial = people
        .verify_with(
            opts.clone(),
            JobControl::new()
                .on_progress(move |so_far: &shardkit::VerifyReport| {
                    pushed.lock().unwrap().push((so_far.chunks, so_far.rows));
                    if so_far.chunks == 3 {
                        cancel.cancel();
                    }
                })
                .cancel_on(stop),
        )
        .await
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.iter().map(|(c, _)| *c).collect::<Vec<_>>(), [1, 2, 3]);
    assert!(seen.windows(2).all(|w| w[0].1 <= w[1].1), "{seen:?}");
    assert!(!partial.finished && partial.cursor.is_some());
    let calls = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&calls);
    let whole = people
        .verify_with(
            opts.clone(),
            JobControl::new().on_progress(move |_| {
                counted.fetch_add(1, Ordering::Relaxed);
            }),
        )
        .await
        .unwrap();
    assert!(whole.finished);
    assert_eq!(
        calls.load(Ordering::Relaxed),
        whole.chunks,
        "one call per chunk"
    );

    // Resumable: two chunks now, the rest later, the same findings.
    let first = people.verify(opts.clone().max_chunks(2)).await.unwrap();
    assert!(!first.finished && first.cursor.is_some());
    let rest = people.verify(opts.clone().resume()).await.unwrap();
    assert!(rest.finished);
    assert_eq!(first.differences() + rest.differences(), 5);
    assert_eq!(first.rows + rest.rows, 80);

    // Repair from the source of truth, then nothing differs.
    let fixed = people.verify(opts.clone().repair()).await.unwrap();
    assert_eq!(fixed.repaired, 5);
    assert!(people.verify(opts).await.unwrap().is_consistent());
    assert_eq!(
        raw_city(&app, "people_v2", 5, 30).await.as_deref(),
        Some("C30")
    );
    assert_eq!(raw_city(&app, "people_v2", 5, 99).await, None);
}

pub(crate) async fn verify_shards_compares_copies(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (app, _, _) = instance(dbs, &clock).await;
    for id in 1..=120 {
        put(&app, &person(id, id % 9, "P", &format!("N{id}"), "C"))
            .await
            .unwrap();
    }
    let names: Vec<String> = app.topology().shard_names().map(str::to_owned).collect();
    let (from, to) = (&names[0], &names[1]);
    // Copy shard `from`'s rows over `to`'s, as a move would, then damage it.
    let rows = person_v1::Entity::find()
        .all(app.connection(from).unwrap())
        .await
        .unwrap();
    assert!(rows.len() > 5, "shard {from} holds {} rows", rows.len());
    let target = app.connection(to).unwrap();
    person_v1::Entity::delete_many().exec(target).await.unwrap();
    for row in &rows {
        person_v1::Entity::insert(sea_orm::IntoActiveModel::into_active_model(row.clone()))
            .exec_without_returning(target)
            .await
            .unwrap();
    }
    let opts = VerifyOptions::default().chunk(4);
    let clean = app
        .verify_shards::<person_v1::Entity>(from, to, None, opts.clone())
        .await
        .unwrap();
    assert!(clean.is_consistent(), "{clean:?}");
    let in_db = target.get_database_backend() != sea_orm::DbBackend::Sqlite;
    assert_eq!(clean.chunks_in_database > 0, in_db);
    let (a, b) = (rows[1].id, rows[3].id);
    let raw = |sql: String| Statement::from_string(target.get_database_backend(), sql);
    target
        .execute_raw(raw(format!("UPDATE people SET city = 'X' WHERE id = {a}")))
        .await
        .unwrap();
    target
        .execute_raw(raw(format!("DELETE FROM people WHERE id = {b}")))
        .await
        .unwrap();
    let report = app
        .verify_shards::<person_v1::Entity>(from, to, None, opts.clone())
        .await
        .unwrap();
    assert_eq!(
        report
            .different
            .iter()
            .map(|d| d.pk.clone())
            .collect::<Vec<_>>(),
        [a.to_string()]
    );
    assert_eq!(
        report
            .missing
            .iter()
            .map(|d| d.pk.clone())
            .collect::<Vec<_>>(),
        [b.to_string()]
    );
    assert!(report.extra.is_empty());
    // One bucket only: rows of other buckets on either side do not count.
    let bucket_of = |key: i64| {
        let app = app.clone();
        async move { app.route::<Customer>(&key).await.unwrap().bucket }
    };
    let bucket = bucket_of(rows[1].customer_id).await;
    let same_bucket = bucket_of(rows[3].customer_id).await == bucket;
    let in_bucket = app
        .verify_shards::<person_v1::Entity>(from, to, bucket, opts.clone().repair())
        .await
        .unwrap();
    assert_eq!(in_bucket.different.len(), 1);
    assert_eq!(in_bucket.missing.len(), usize::from(same_bucket));
    assert_eq!(in_bucket.repaired, 1 + u64::from(same_bucket));
    assert_eq!(in_bucket.chunks_in_database, 0);
    let fixed = app
        .verify_shards::<person_v1::Entity>(from, to, None, opts.clone().repair())
        .await
        .unwrap();
    assert_eq!(fixed.repaired, 2 - in_bucket.repaired);
    assert!(
        app.verify_shards::<person_v1::Entity>(from, to, None, opts)
            .await
            .unwrap()
            .is_consistent()
    );
}

/// `advance_when_ready` waits out the gap on the cluster's clock (no retry
/// loop in the caller), says how long it waits, and returns other refusals
/// as they are.
pub(crate) async fn advance_when_ready_waits_out_the_gap(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (_app, _, people) = instance(dbs, &clock).await;
    assert_eq!(people.advance_when_ready().await.unwrap(), Phase::CacheBoth);

    let (told, waiting) = tokio::sync::oneshot::channel();
    let mut told = Some(told);
    let mover = people.clone();
    let task = tokio::spawn(async move {
        mover
            .advance_when_ready_with(move |to, left| {
                if let Some(told) = told.take() {
                    let _ = told.send((to, left));
                }
            })
            .await
    });
    // It waits for the whole gap, for dual_write, and does not move on its own.
    let (to, left) = waiting.await.unwrap();
    assert_eq!((to, left), (Phase::DualWrite, TTL + REFRESH));
    tokio::task::yield_now().await;
    assert!(!task.is_finished());
    assert_eq!(people.refresh().await.unwrap(), Phase::CacheBoth);
    // Once the clock passes the gap, it advances.
    clock.advance(TTL + REFRESH);
    let moved = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("advance_when_ready returns once the gap has passed")
        .unwrap()
        .unwrap();
    assert_eq!(moved, Phase::DualWrite);
    assert_eq!(people.refresh().await.unwrap(), Phase::DualWrite);

    // A refusal that waiting cannot cure comes back at once: read_new needs
    // a finished backfill.
    clock.advance(TTL + REFRESH);
    let err = people.advance_when_ready().await.unwrap_err();
    assert!(matches!(err, ShardError::Rollout { .. }), "{err:?}");

    // It advances one step from the phase it started in, never from one
    // another instance moved to while it waited.
    assert_eq!(people.retreat().await.unwrap(), Phase::CacheBoth);
    let (told, waiting) = tokio::sync::oneshot::channel();
    let mut told = Some(told);
    let mover = people.clone();
    let task = tokio::spawn(async move {
        mover
            .advance_when_ready_with(move |_, _| {
                if let Some(told) = told.take() {
                    let _ = told.send(());
                }
            })
            .await
    });
    waiting.await.unwrap();
    assert_eq!(people.retreat().await.unwrap(), Phase::Off);
    clock.advance(TTL + REFRESH);
    let err = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("advance_when_ready returns once the gap has passed")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, ShardError::Rollout { reason, .. } if reason.contains("meanwhile")),
        "{err:?}"
    );
    assert_eq!(people.refresh().await.unwrap(), Phase::Off);
}

/// The `people` rollout's new table in PostgreSQL's schema `app`, beside
/// the migration's `public.people_v2` of the same name.
mod app_person {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(schema_name = "app", table_name = "people_v2")]
    #[shardkit(group = shardkit_tests::models::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub first_name: String,
        pub last_name: String,
        pub display_name: String,
        pub city: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// From `read_new` on, the old entity's reads are answered by the new
/// table in its entity's schema (`app.people_v2`): keyed, inside a
/// transaction, and in the plan; never by the table of that name the
/// search path finds (`public.people_v2`, which holds a decoy row). The
/// verifiers compare it there too (a rollout's, and two shards' copies by
/// digests in the database), and no statement names it without its schema.
pub(crate) async fn old_reads_follow_the_phase_into_a_named_schema(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (app, sent) = connect(dbs, &clock).await;
    app.migrate::<Migrator>().await.unwrap();
    for shard in app.topology().shard_names() {
        app.connection(shard)
            .unwrap()
            .execute_unprepared(
                "CREATE SCHEMA app; CREATE TABLE app.people_v2 (LIKE public.people_v2 INCLUDING ALL)",
            )
            .await
            .unwrap();
    }
    // From here on, the rollout's statements (the migration's are not).
    sent.lock().unwrap().clear();
    let to_app = |old: &person_v1::Model| -> app_person::Model {
        let new = person_to_v2(old);
        app_person::Model {
            id: new.id,
            customer_id: new.customer_id,
            first_name: new.first_name,
            last_name: new.last_name,
            display_name: new.display_name,
            city: new.city,
        }
    };
    let from_app = |new: &app_person::Model| -> person_v1::Model {
        person_v1::Model {
            id: new.id,
            customer_id: new.customer_id,
            first_name: new.first_name.clone(),
            last_name: new.last_name.clone(),
            city: new.city.clone(),
        }
    };
    let people: RolloutHandle<person_v1::Entity, app_person::Entity> = app
        .register_rollout(
            Rollout::new("people_app", to_app)
                .to_old(from_app)
                .cache_ttl(TTL)
                .refresh_interval(REFRESH),
        )
        .await
        .unwrap();
    put(&app, &person(1, 5, "Ann", "Lee", "Oslo"))
        .await
        .unwrap();
    for phase in [Phase::CacheBoth, Phase::DualWrite] {
        assert_eq!(advance(&people, &clock).await, phase);
    }
    clock.advance(people.gap());
    assert!(people.backfill().await.unwrap().finished);
    assert_eq!(advance(&people, &clock).await, Phase::ReadNew);
    exec_on(
        &app,
        5,
        "INSERT INTO public.people_v2 (id, customer_id, first_name, last_name, display_name, city) \
         VALUES (9, 5, 'Decoy', 'Row', 'Decoy Row', 'Nowhere')",
    )
    .await;
    set_city(&app, 1, 5, "Rome").await.unwrap();
    let rows = app.find::<person_v1::Entity>().key(5).all().await.unwrap();
    assert_eq!(rows, vec![person(1, 5, "Ann", "Lee", "Rome")]);
    let tx = app.begin::<Customer>(5).await.unwrap();
    let inside = tx.find::<person_v1::Entity>().all().await.unwrap();
    assert_eq!(inside, rows);
    tx.rollback().await.unwrap();
    let plan = app
        .find::<person_v1::Entity>()
        .key(5)
        .explain()
        .await
        .unwrap()
        .to_string();
    assert!(plan.contains(r#""app"."people_v2""#), "{plan}");
    let report = people.verify(VerifyOptions::default()).await.unwrap();
    assert!(report.is_consistent(), "{report:?}");
    // Two shards' copies compared by digests the databases compute.
    let names: Vec<&str> = app.topology().shard_names().collect();
    let copies = app
        .verify_shards::<app_person::Entity>(names[0], names[1], None, VerifyOptions::default())
        .await
        .unwrap();
    assert!(copies.chunks_in_database > 0, "{copies:?}");
    let unqualified: Vec<String> = statements(&sent)
        .into_iter()
        .filter(|sql| {
            sql.contains("people_v2")
                && !sql.contains(r#""app"."people_v2""#)
                && !sql.contains("public.people_v2")
        })
        .collect();
    assert!(unqualified.is_empty(), "{unqualified:#?}");
}

/// Code that reads the old entity keeps reading the latest rows: from
/// `new_only` on, when the old table is no longer written, its reads (keyed,
/// scatter, counts, projections, inside a transaction) are served from the
/// new table.
pub(crate) async fn old_reads_follow_the_phase(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (app, _, people) = instance(dbs, &clock).await;
    put(&app, &person(1, 5, "Ann", "Lee", "Oslo"))
        .await
        .unwrap();
    for phase in [Phase::CacheBoth, Phase::DualWrite] {
        assert_eq!(advance(&people, &clock).await, phase);
    }
    clock.advance(people.gap());
    assert!(people.backfill().await.unwrap().finished);
    assert_eq!(advance(&people, &clock).await, Phase::ReadNew);
    // From read_new on the old entity's reads are answered by the new table
    // (still written by every write, and backfilled), so no instance reads
    // the old one once another stops writing it.
    let plan = app
        .find::<person_v1::Entity>()
        .key(5)
        .explain()
        .await
        .unwrap()
        .to_string();
    assert!(plan.contains("people_v2"), "{plan}");
    assert_eq!(advance(&people, &clock).await, Phase::NewOnly);

    // Old-path writes in new_only reach the new table only.
    set_city(&app, 1, 5, "Rome").await.unwrap();
    put(&app, &person(2, 5, "Bo", "Dahl", "Pisa"))
        .await
        .unwrap();
    assert_eq!(
        raw_city(&app, "people", 5, 1).await.as_deref(),
        Some("Oslo")
    );
    assert_eq!(raw_city(&app, "people", 5, 2).await, None);

    // The old entity's reads see them.
    let rows = app
        .find::<person_v1::Entity>()
        .key(5)
        .order_by_asc(person_v1::Column::Id)
        .all()
        .await
        .unwrap();
    assert_eq!(
        rows,
        vec![
            person(1, 5, "Ann", "Lee", "Rome"),
            person(2, 5, "Bo", "Dahl", "Pisa")
        ]
    );
    let cities: Vec<String> = app
        .find::<person_v1::Entity>()
        .key(5)
        .filter(person_v1::Column::City.eq("Rome"))
        .select_only()
        .column(person_v1::Column::City)
        .into_tuple()
        .all()
        .await
        .unwrap();
    assert_eq!(cities, ["Rome"]);
    assert_eq!(
        app.find::<person_v1::Entity>()
            .scatter()
            .count()
            .await
            .unwrap(),
        2
    );
    let tx = app.begin::<Customer>(5).await.unwrap();
    let inside = tx.find::<person_v1::Entity>().all().await.unwrap();
    assert_eq!(inside.len(), 2);
    assert!(inside.iter().any(|p| p.city == "Rome"));
    tx.rollback().await.unwrap();
    // The plan says which table answers.
    let plan = app
        .find::<person_v1::Entity>()
        .key(5)
        .explain()
        .await
        .unwrap()
        .to_string();
    assert!(plan.contains("people_v2"), "{plan}");
}

fn login_to_v2(old: &login_v1::Model) -> login_v2::Model {
    login_v2::Model {
        id: old.id,
        customer_id: old.customer_id,
        email: old.email.clone(),
        domain: old.email.rsplit('@').next().unwrap_or_default().to_owned(),
    }
}

fn login_to_v1(new: &login_v2::Model) -> login_v1::Model {
    login_v1::Model {
        id: new.id,
        customer_id: new.customer_id,
        email: new.email.clone(),
    }
}

fn login(id: i64, customer: i64, email: &str) -> login_v1::ActiveModel {
    login_v1::ActiveModel {
        id: Set(id),
        customer_id: Set(customer),
        email: Set(email.to_owned()),
    }
}

/// In new_only a login inserted through the old entity is found by index
/// reads of both entities: the old entity's read goes to the new table and
/// its index, which the new-only write keeps.
pub(crate) async fn old_index_reads_follow_the_phase(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (app, _) = connect(dbs, &clock).await;
    app.migrate::<Migrator>().await.unwrap();
    app.setup::<(login_v1::Entity, login_v2::Entity)>()
        .await
        .unwrap();
    let tx = app.begin::<Customer>(3).await.unwrap();
    tx.insert(login(1, 3, "ann@a.example")).await.unwrap();
    tx.commit().await.unwrap();
    let logins: RolloutHandle<login_v1::Entity, login_v2::Entity> = app
        .register_rollout(
            Rollout::new("logins_v2", login_to_v2)
                .to_old(login_to_v1)
                .cache_ttl(TTL)
                .refresh_interval(REFRESH),
        )
        .await
        .unwrap();
    for phase in [Phase::CacheBoth, Phase::DualWrite] {
        logins.advance_when_ready().await.ok();
        assert_eq!(logins.phase(), phase);
        clock.advance(logins.gap());
    }
    assert!(logins.backfill().await.unwrap().finished);
    for column in [login_v1::Column::Email] {
        app.gsi()
            .backfill::<login_v1::Entity>(column)
            .await
            .unwrap();
    }
    app.gsi()
        .backfill::<login_v2::Entity>(login_v2::Column::Email)
        .await
        .unwrap();
    for phase in [Phase::ReadNew, Phase::NewOnly] {
        clock.advance(logins.gap());
        assert_eq!(logins.advance_when_ready().await.unwrap(), phase);
    }

    let tx = app.begin::<Customer>(4).await.unwrap();
    tx.insert(login(2, 4, "bo@b.example")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        count_rows(&app, "logins").await,
        1,
        "new_only writes only the new table"
    );

    for (email, id) in [("ann@a.example", 1), ("bo@b.example", 2)] {
        let old = app
            .find::<login_v1::Entity>()
            .by_index(login_v1::Column::Email, email)
            .all()
            .await
            .unwrap();
        assert_eq!(
            old.iter().map(|l| l.id).collect::<Vec<_>>(),
            [id],
            "old entity, {email}"
        );
        let new = app
            .find::<login_v2::Entity>()
            .by_index(login_v2::Column::Email, email)
            .all()
            .await
            .unwrap();
        assert_eq!(
            new.iter().map(|l| l.id).collect::<Vec<_>>(),
            [id],
            "new entity, {email}"
        );
    }
    let plan = app
        .find::<login_v1::Entity>()
        .by_index(login_v1::Column::Email, "bo@b.example")
        .explain()
        .await
        .unwrap()
        .to_string();
    assert!(plan.contains("gsi_logins_v2_email"), "{plan}");
    // The unique value is held in new_only too.
    let tx = app.begin::<Customer>(5).await.unwrap();
    let err = tx.insert(login(3, 5, "bo@b.example")).await.unwrap_err();
    assert!(matches!(err, ShardError::UniqueViolation { .. }), "{err:?}");
}

/// `status()` shows the shared state and every instance that registered the
/// rollout, with its cache TTL and refresh interval, and when it last
/// re-read the phase.
pub(crate) async fn status_lists_the_instances(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (app, _) = connect(dbs, &clock).await;
    app.migrate::<Migrator>().await.unwrap();
    let a = app
        .register_rollout(people_rollout(TTL).instance("app-a"))
        .await
        .unwrap();
    let (other, _) = connect(dbs, &clock).await;
    let b = other
        .register_rollout(people_rollout(Duration::from_secs(30)).instance("app-b"))
        .await
        .unwrap();
    let registered = clock.now_millis() as i64;
    assert_eq!(a.advance().await.unwrap(), Phase::CacheBoth);

    let status = a.status().await.unwrap();
    assert_eq!(status.name, "people_v2");
    assert_eq!(status.phase, Phase::CacheBoth);
    assert_eq!(
        status.gap,
        Duration::from_secs(30) + REFRESH,
        "the longest instance's"
    );
    assert!(!status.backfilled);
    let mut seen: Vec<(String, Duration, Duration, bool)> = status
        .instances
        .iter()
        .map(|i| {
            (
                i.name.clone(),
                i.cache_ttl,
                i.refresh_interval,
                i.this_instance,
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![
            ("app-a".to_owned(), TTL, REFRESH, true),
            ("app-b".to_owned(), Duration::from_secs(30), REFRESH, false),
        ]
    );
    assert!(status.instances.iter().all(|i| i.seen_ms == registered));
    let theirs = b.status().await.unwrap();
    assert!(
        theirs
            .instances
            .iter()
            .any(|i| i.name == "app-b" && i.this_instance)
    );

    // Each refresh renews the instance's `seen_ms`; a stopped instance's stays.
    clock.advance(Duration::from_secs(5));
    drop(b);
    drop(other);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = a.status().await.unwrap();
        let seen = |name: &str| {
            status
                .instances
                .iter()
                .find(|i| i.name == name)
                .map(|i| i.seen_ms)
                .unwrap()
        };
        if seen("app-a") > registered {
            assert_eq!(
                seen("app-b"),
                registered,
                "a dropped instance stops renewing"
            );
            break;
        }
        assert!(Instant::now() < deadline, "app-a never renewed its row");
        tokio::time::sleep(REFRESH).await;
    }
}

/// An instance that writes a rollout's old entity without having registered
/// the rollout (its writes are neither dual-written nor cached) finds out
/// from the shared state: it lists the rollout and warns once.
pub(crate) async fn an_instance_without_the_rollout_is_visible(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (registered, _, _people) = instance(dbs, &clock).await;
    let (unaware, _) = connect(dbs, &clock).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut id = 0;
    while unaware.rollouts_not_registered().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the unregistered writer never noticed"
        );
        id += 1;
        put(&unaware, &person(id, 3, "Ann", "Lee", "Oslo"))
            .await
            .unwrap();
        let tx = unaware.begin::<Customer>(3).await.unwrap();
        tx.insert(order::ActiveModel {
            id: Set(id),
            customer_id: Set(3),
            total_cents: Set(1),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        unaware.rollouts_not_registered(),
        vec![("people".to_owned(), "people_v2".to_owned())],
        "orders are in no rollout"
    );
    put(&registered, &person(1_000, 3, "Bo", "Dahl", "Rome"))
        .await
        .unwrap();
    assert!(registered.rollouts_not_registered().is_empty());

    // A batch written as one statement is seen too.
    let (batching, _) = connect(dbs, &clock).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while batching.rollouts_not_registered().is_empty() {
        assert!(Instant::now() < deadline, "the batch writer never noticed");
        let tx = batching.begin::<Customer>(3).await.unwrap();
        tx.update_many::<person_v1::Entity>()
            .set(person_v1::ActiveModel {
                city: Set("Bergen".into()),
                ..Default::default()
            })
            .exec()
            .await
            .unwrap();
        tx.commit().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `backfill_when_ready` waits out the gap after `dual_write` on the
/// cluster's clock (where `backfill` is refused as too soon), and resumes
/// from its saved position after chunks that fail with an error that says to
/// retry (a shard that stopped answering, twice); every person is copied.
pub(crate) async fn backfill_when_ready_waits_out_the_gap_and_resumes_after_a_timeout(
    dbs: &mut TestDbs,
) {
    let clock = test_clock();
    let (app, _, people) = instance(dbs, &clock).await;
    for i in 1..=30 {
        put(&app, &person(i, i % 7, &format!("f{i}"), "l", "c"))
            .await
            .unwrap();
    }
    clock.advance(TTL + REFRESH);
    assert_eq!(people.advance().await.unwrap(), Phase::CacheBoth);
    clock.advance(TTL + REFRESH);
    assert_eq!(people.advance().await.unwrap(), Phase::DualWrite);
    let err = people.backfill().await.unwrap_err();
    assert!(matches!(err, ShardError::RolloutTooSoon { .. }), "{err:?}");
    let at = "shardkit::rollout::backfill_chunk";
    // The backends' runs take turns: arming replaces another run's
    // argument, removing it removes it for both.
    static FAILPOINT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = FAILPOINT.lock().await;
    fail::cfg(at, &format!("2*return({})", dbs.scope_of(1))).unwrap();
    let task = {
        let people = people.clone();
        tokio::spawn(async move { people.backfill_when_ready().await })
    };
    tokio::task::yield_now().await;
    assert!(!task.is_finished(), "it waits for the gap");
    clock.advance(TTL + REFRESH);
    let done = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("backfill_when_ready returns once the gap has passed")
        .unwrap();
    fail::remove(at);
    let done = done.unwrap_or_else(|e| panic!("{}", e.report()));
    assert!(done.finished, "{done:?}");
    assert_eq!(count_rows(&app, "people_v2").await, 30);
}

/// A rollout backfill whose token is cancelled before it starts copies
/// nothing; one cancelled by another task while it runs stops at the next
/// chunk boundary (`finished: false`, its position saved), and the next call
/// resumes there and finishes, so the rollout can advance.
pub(crate) async fn cancelled_backfill_stops_at_a_chunk_and_resumes(dbs: &mut TestDbs) {
    let clock = test_clock();
    let (app, _, people) = instance(dbs, &clock).await;
    for i in 1..=30 {
        put(&app, &person(i, i % 7, &format!("f{i}"), "l", "c"))
            .await
            .unwrap();
    }
    clock.advance(TTL + REFRESH);
    assert_eq!(people.advance().await.unwrap(), Phase::CacheBoth);
    clock.advance(TTL + REFRESH);
    assert_eq!(people.advance().await.unwrap(), Phase::DualWrite);
    clock.advance(people.gap());

    // Cancelled before it starts: no chunk, no report.
    let stop = CancellationToken::new();
    stop.cancel();
    let reports = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&reports);
    let none = people
        .backfill_with(
            4,
            JobControl::new()
                .on_progress(move |_| {
                    counted.fetch_add(1, Ordering::SeqCst);
                })
                .cancel_on(stop),
        )
        .await
        .unwrap();
    assert!(!none.finished && none.rows == 0, "{none:?}");
    assert_eq!(reports.load(Ordering::SeqCst), 0);
    assert_eq!(count_rows(&app, "people_v2").await, 0);
    assert!(!people.status().await.unwrap().backfilled);

    // Cancelled by another task at its second report: no chunk after it.
    let (control, reports) = cancelled_by_another_task(2);
    let stopped = people.backfill_with(4, control).await.unwrap();
    assert_eq!(reports.load(Ordering::SeqCst), 2, "{stopped:?}");
    assert!(!stopped.finished && stopped.rows > 0, "{stopped:?}");
    assert_eq!(count_rows(&app, "people_v2").await, stopped.rows);
    let refused = people.advance().await.unwrap_err();
    assert!(
        matches!(refused, ShardError::Rollout { ref reason, .. } if reason.contains("backfill")),
        "{refused:?}"
    );

    // The next call resumes: each row is copied once over the runs.
    let done = people.backfill_with(4, JobControl::new()).await.unwrap();
    assert!(done.finished, "{done:?}");
    assert_eq!(
        stopped.rows + done.rows,
        30,
        "resumed: {done:?} after {stopped:?}"
    );
    assert_eq!(count_rows(&app, "people_v2").await, 30);
    clock.advance(TTL + REFRESH);
    assert_eq!(people.advance().await.unwrap(), Phase::ReadNew);
}
