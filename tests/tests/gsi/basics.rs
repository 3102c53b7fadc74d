//! Global secondary indexes on SQLite, PostgreSQL and MySQL/MariaDB: index
//! rows written first, lookups that ask only the shards the index names and
//! verify every row, unique violations and takeover of dangling rows, updates
//! that move the entry, backfill and reconciliation.

use crate::index_rows;
use sea_orm::{
    ActiveValue::Unchanged, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, Set, Statement,
};
use shardkit::gsi::IndexState;
use shardkit::{CancellationToken, Cluster, ClusterBuilder, JobControl, ManualClock, ShardError};
use shardkit_tests::models::*;
use shardkit_tests::{
    Backend, IndexWrite, Sent, TestDbs, cancelled_by_another_task, index_writes, recording_cluster,
    recording_cluster_with,
};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

async fn gsi_cluster(dbs: &TestDbs, extra: &str) -> (Cluster, Sent) {
    gsi_cluster_with(dbs, extra, |b| b).await
}

async fn gsi_cluster_with(
    dbs: &TestDbs,
    extra: &str,
    options: impl FnOnce(ClusterBuilder) -> ClusterBuilder,
) -> (Cluster, Sent) {
    let groups = format!("[groups.Customer]\n{extra}");
    let (cluster, sent) = recording_cluster_with(dbs, 4, &groups, options).await;
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    (cluster, sent)
}

/// Shards that read the `contacts` table among the recorded statements.
fn contact_readers(sent: &Sent) -> Vec<String> {
    sent.lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| s.sql.contains("\"contacts\"") || s.sql.contains("`contacts`"))
        .map(|(shard, _)| shard.clone())
        .collect()
}

async fn add_contact(
    cluster: &Cluster,
    id: i64,
    customer: i64,
    email: &str,
    phone: &str,
) -> shardkit::Result<contact::Model> {
    let tx = cluster.begin::<Customer>(customer).await?;
    let row = tx
        .insert(contact::ActiveModel {
            id: Set(id),
            customer_id: Set(customer),
            email: Set(email.to_owned()),
            phone: Set(phone.to_owned()),
        })
        .await?;
    tx.commit().await?;
    Ok(row)
}

pub(crate) async fn lookups_follow_the_index(dbs: &mut TestDbs) {
    let (cluster, sent) = gsi_cluster(dbs, "").await;
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
    assert_eq!(
        cluster
            .gsi()
            .state::<contact::Entity>(contact::Column::Email)
            .await
            .unwrap(),
        IndexState::Active
    );

    for i in 1..=40_i64 {
        // Families share a phone number across customers (and shards).
        add_contact(
            &cluster,
            i,
            i,
            &format!("c{i}@example.com"),
            &format!("555-{}", i % 4),
        )
        .await
        .unwrap();
    }
    assert_eq!(index_rows(&cluster, "gsi_contacts_email").await.len(), 40);

    // A unique value: one index lookup, then only the owner's shard.
    for i in [1_i64, 17, 40] {
        sent.lock().unwrap().clear();
        let rows = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, format!("c{i}@example.com"))
            .all()
            .await
            .unwrap();
        assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), vec![i]);
        let owner = cluster.shard_of::<Customer>(&i).await.unwrap().to_owned();
        let reads = contact_readers(&sent);
        assert_eq!(reads, vec![owner], "only the owner's shard is read");
    }
    assert!(
        cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, "nobody@example.com")
            .all()
            .await
            .unwrap()
            .is_empty()
    );

    // A shared value: the same rows as a scatter filtered by the column.
    for phone in ["555-0", "555-1", "555-3"] {
        let mut by_index = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Phone, phone)
            .all()
            .await
            .unwrap();
        let mut scatter = cluster
            .find::<contact::Entity>()
            .scatter()
            .filter(contact::Column::Phone.eq(phone))
            .all()
            .await
            .unwrap();
        by_index.sort_by_key(|r| r.id);
        scatter.sort_by_key(|r| r.id);
        assert_eq!(by_index, scatter, "phone {phone}");
        assert_eq!(by_index.len(), 10);
    }

    // Update of an indexed column: the entry moves.
    let tx = cluster.begin::<Customer>(5).await.unwrap();
    tx.update(contact::ActiveModel {
        id: Unchanged(5),
        customer_id: Unchanged(5),
        email: Set("new5@example.com".into()),
        phone: Unchanged("555-1".into()),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(
        cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, "c5@example.com")
            .all()
            .await
            .unwrap()
            .is_empty()
    );
    let moved = cluster
        .find::<contact::Entity>()
        .by_index(contact::Column::Email, "new5@example.com")
        .one()
        .await
        .unwrap();
    assert_eq!(moved.map(|r| r.id), Some(5));
    let emails = index_rows(&cluster, "gsi_contacts_email").await;
    assert!(emails.contains(&("new5@example.com".into(), "5".into())));
    assert!(
        !emails.iter().any(|(v, _)| v == "c5@example.com"),
        "the old entry is removed after commit"
    );

    // Delete: the primary row first, then its index rows.
    let tx = cluster.begin::<Customer>(6).await.unwrap();
    let n = tx
        .delete(contact::ActiveModel {
            id: Unchanged(6),
            customer_id: Unchanged(6),
            email: Unchanged("c6@example.com".into()),
            phone: Unchanged("555-2".into()),
        })
        .await
        .unwrap();
    assert_eq!(n, 1);
    tx.commit().await.unwrap();
    assert!(
        !index_rows(&cluster, "gsi_contacts_email")
            .await
            .iter()
            .any(|(v, _)| v == "c6@example.com")
    );
    assert!(
        !index_rows(&cluster, "gsi_contacts_phone")
            .await
            .contains(&("555-2".into(), "6".into()))
    );
}

pub(crate) async fn unique_violation_and_takeover(dbs: &mut TestDbs) {
    let clock = std::sync::Arc::new(ManualClock::starting_now());
    let grace = std::time::Duration::from_millis(1000);
    let shared = std::sync::Arc::clone(&clock);
    let (cluster, _) =
        gsi_cluster_with(dbs, "[gsi]\ngrace_ms = 1000\n", move |b| b.clock(shared)).await;
    cluster
        .gsi()
        .backfill::<contact::Entity>(contact::Column::Email)
        .await
        .unwrap();

    add_contact(&cluster, 1, 1, "taken@example.com", "1")
        .await
        .unwrap();
    // A live owner: refused, and nothing is written for customer 2.
    match add_contact(&cluster, 2, 2, "taken@example.com", "2").await {
        Err(ShardError::UniqueViolation { index, value }) => {
            assert_eq!(
                (index.as_str(), value.as_str()),
                ("gsi_contacts_email", "taken@example.com")
            );
        }
        other => panic!("expected UniqueViolation, got {other:?}"),
    }
    assert!(
        cluster
            .find::<contact::Entity>()
            .key(2)
            .all()
            .await
            .unwrap()
            .is_empty()
    );
    // A retry of the owner's own write is idempotent.
    let tx = cluster.begin::<Customer>(1).await.unwrap();
    tx.update(contact::ActiveModel {
        id: Unchanged(1),
        customer_id: Unchanged(1),
        email: Set("taken@example.com".into()),
        phone: Set("1b".into()),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // A dangling row: its primary transaction never committed.
    let tx = cluster.begin::<Customer>(3).await.unwrap();
    tx.insert(contact::ActiveModel {
        id: Set(3),
        customer_id: Set(3),
        email: Set("free@example.com".into()),
        phone: Set("3".into()),
    })
    .await
    .unwrap();
    drop(tx); // rolled back: the index row dangles
    assert!(
        cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, "free@example.com")
            .all()
            .await
            .unwrap()
            .is_empty(),
        "dangling rows are ignored"
    );
    // Within the grace period it may be an insert in flight: refused.
    assert!(matches!(
        add_contact(&cluster, 4, 4, "free@example.com", "4").await,
        Err(ShardError::UniqueViolation { .. })
    ));
    // Still within it one millisecond before it ends (the index row's write
    // time is the cluster clock's, like the time it is compared with).
    clock.advance(grace - std::time::Duration::from_millis(1));
    assert!(matches!(
        add_contact(&cluster, 4, 4, "free@example.com", "4").await,
        Err(ShardError::UniqueViolation { .. })
    ));
    clock.advance(std::time::Duration::from_millis(1));
    // After it, the new row takes the dangling entry over.
    add_contact(&cluster, 4, 4, "free@example.com", "4")
        .await
        .unwrap();
    let found = cluster
        .find::<contact::Entity>()
        .by_index(contact::Column::Email, "free@example.com")
        .all()
        .await
        .unwrap();
    assert_eq!(
        found.iter().map(|r| r.customer_id).collect::<Vec<_>>(),
        vec![4]
    );
}

/// A backfill whose token is cancelled before it starts does nothing; one
/// cancelled by another task while it runs stops at the next chunk boundary
/// with what it indexed saved (`finished: false`, still `write_only`), and
/// the next call resumes there and activates the index.
pub(crate) async fn cancelled_backfill_stops_at_a_chunk_and_resumes(dbs: &mut TestDbs) {
    let (cluster, _) = gsi_cluster(dbs, "").await;
    for i in 1..=20_i64 {
        let shard = cluster.shard_of::<Customer>(&i).await.unwrap().to_owned();
        contact::Entity::insert(contact::ActiveModel {
            id: Set(i),
            customer_id: Set(i),
            email: Set(format!("old{i}@x")),
            phone: Set("0".into()),
        })
        .exec(cluster.connection(&shard).unwrap())
        .await
        .unwrap();
    }
    let gsi = cluster.gsi();
    let state = || gsi.state::<contact::Entity>(contact::Column::Email);
    let backfill =
        |control| gsi.backfill_with::<contact::Entity>(contact::Column::Email, 2, control);

    // Cancelled before it starts: no chunk, no report.
    let stop = CancellationToken::new();
    stop.cancel();
    let reports = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&reports);
    let none = backfill(
        JobControl::new()
            .on_progress(move |_| {
                counted.fetch_add(1, Ordering::SeqCst);
            })
            .cancel_on(stop),
    )
    .await
    .unwrap();
    assert!(
        !none.finished && none.rows == 0 && none.written == 0,
        "{none:?}"
    );
    assert_eq!(reports.load(Ordering::SeqCst), 0);
    assert_eq!(state().await.unwrap(), IndexState::WriteOnly);
    assert!(index_rows(&cluster, "gsi_contacts_email").await.is_empty());

    // Cancelled by another task at its second report: no chunk after it.
    let (control, reports) = cancelled_by_another_task(2);
    let stopped = backfill(control).await.unwrap();
    assert_eq!(reports.load(Ordering::SeqCst), 2, "{stopped:?}");
    assert!(!stopped.finished && stopped.rows > 0, "{stopped:?}");
    assert_eq!(state().await.unwrap(), IndexState::WriteOnly);
    let indexed = index_rows(&cluster, "gsi_contacts_email").await;
    assert_eq!(indexed.len() as u64, stopped.written, "{stopped:?}");

    // The next call resumes: each row is read once over the runs.
    let done = backfill(JobControl::new()).await.unwrap();
    assert!(done.finished && done.shards_done == 4, "{done:?}");
    assert_eq!(
        stopped.rows + done.rows,
        20,
        "resumed: {done:?} after {stopped:?}"
    );
    assert_eq!(state().await.unwrap(), IndexState::Active);
    assert_eq!(index_rows(&cluster, "gsi_contacts_email").await.len(), 20);
}

pub(crate) async fn write_only_scatters_until_backfilled(dbs: &mut TestDbs) {
    let (cluster, sent) = gsi_cluster(dbs, "").await;
    // Rows written before the index existed: no index rows for them.
    for i in 1..=12_i64 {
        let shard = cluster.shard_of::<Customer>(&i).await.unwrap().to_owned();
        contact::Entity::insert(contact::ActiveModel {
            id: Set(i),
            customer_id: Set(i),
            email: Set(format!("old{i}@x")),
            phone: Set("0".into()),
        })
        .exec(cluster.connection(&shard).unwrap())
        .await
        .unwrap();
    }
    assert_eq!(
        cluster
            .gsi()
            .state::<contact::Entity>(contact::Column::Email)
            .await
            .unwrap(),
        IndexState::WriteOnly
    );
    sent.lock().unwrap().clear();
    let rows = cluster
        .find::<contact::Entity>()
        .by_index(contact::Column::Email, "old7@x")
        .all()
        .await
        .unwrap();
    assert_eq!(
        rows.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![7],
        "write_only: a scatter finds it"
    );
    let shards: BTreeSet<String> = contact_readers(&sent).into_iter().collect();
    assert_eq!(shards.len(), 4, "while write_only, every shard is asked");

    // A run cancelled at its third report (chunks of two rows) leaves the
    // index write_only...
    let calls = AtomicU64::new(0);
    let stop = CancellationToken::new();
    let cancel = stop.clone();
    let stopped = cluster
        .gsi()
        .backfill_with::<contact::Entity>(
            contact::Column::Email,
            2,
            JobControl::new()
                .on_progress(move |_| {
                    if calls.fetch_add(1, Ordering::SeqCst) + 1 == 3 {
                        cancel.cancel();
                    }
                })
                .cancel_on(stop),
        )
        .await
        .unwrap();
    assert!(!stopped.finished);
    assert_eq!(
        cluster
            .gsi()
            .state::<contact::Entity>(contact::Column::Email)
            .await
            .unwrap(),
        IndexState::WriteOnly
    );
    let first_rows = stopped.rows;
    assert!((2..=6).contains(&first_rows), "{stopped:?}");
    // ...and the next run resumes where it stopped instead of starting over.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let pushed = Arc::clone(&seen);
    let progress = cluster
        .gsi()
        .backfill_with::<contact::Entity>(
            contact::Column::Email,
            2,
            JobControl::new().on_progress(move |p| pushed.lock().unwrap().push(*p)),
        )
        .await
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(progress.finished);
    assert_eq!(
        progress.rows + first_rows,
        12,
        "resumed: {progress:?} after {stopped:?}"
    );
    assert_eq!(progress.shards_done, 4);
    assert!(seen.len() > 4, "progress is reported per chunk");
    assert_eq!(
        cluster
            .gsi()
            .state::<contact::Entity>(contact::Column::Email)
            .await
            .unwrap(),
        IndexState::Active
    );
    sent.lock().unwrap().clear();
    let rows = cluster
        .find::<contact::Entity>()
        .by_index(contact::Column::Email, "old7@x")
        .all()
        .await
        .unwrap();
    assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), vec![7]);
    let shards: BTreeSet<String> = contact_readers(&sent).into_iter().collect();
    assert_eq!(shards.len(), 1, "active: only the owner's shard");
    // A second backfill is harmless (idempotent writes).
    cluster
        .gsi()
        .backfill::<contact::Entity>(contact::Column::Email)
        .await
        .unwrap();
    assert_eq!(index_rows(&cluster, "gsi_contacts_email").await.len(), 12);
}

pub(crate) async fn reconcile_removes_dangling_and_adds_missing(dbs: &mut TestDbs) {
    let clock = std::sync::Arc::new(ManualClock::starting_now());
    let shared = std::sync::Arc::clone(&clock);
    let (cluster, _) = gsi_cluster_with(dbs, "", move |b| b.clock(shared)).await;
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
    for i in 1..=10_i64 {
        add_contact(&cluster, i, i, &format!("r{i}@x"), &format!("p{i}"))
            .await
            .unwrap();
    }
    // Three rolled-back inserts leave dangling rows in both indexes.
    for i in 11..=13_i64 {
        let tx = cluster.begin::<Customer>(i).await.unwrap();
        tx.insert(contact::ActiveModel {
            id: Set(i),
            customer_id: Set(i),
            email: Set(format!("r{i}@x")),
            phone: Set(format!("p{i}")),
        })
        .await
        .unwrap();
        tx.rollback().await.unwrap();
    }
    // One row written behind shardkit's back has no index rows.
    let shard = cluster.shard_of::<Customer>(&20).await.unwrap().to_owned();
    contact::Entity::insert(contact::ActiveModel {
        id: Set(20),
        customer_id: Set(20),
        email: Set("r20@x".into()),
        phone: Set("p20".into()),
    })
    .exec(cluster.connection(&shard).unwrap())
    .await
    .unwrap();
    // Index rows on the owner's own shard rolled back with it; the others dangle.
    let emails = index_rows(&cluster, "gsi_contacts_email").await;
    let phones = index_rows(&cluster, "gsi_contacts_phone").await;
    let dangling = emails
        .iter()
        .chain(phones.iter())
        .filter(|(_, key)| ["11", "12", "13"].contains(&key.as_str()))
        .count() as u64;
    assert!(dangling > 0, "with 4 shards some index rows live elsewhere");
    let scanned = (emails.len() + phones.len()) as u64;

    // Past the (default) grace period: no insert is in flight any more.
    clock.advance(std::time::Duration::from_secs(31));
    let report = cluster.gsi().reconcile::<contact::Entity>().await.unwrap();
    assert_eq!(report.removed, dangling, "{report:?}");
    assert_eq!(report.added, 2, "{report:?}");
    assert_eq!(report.scanned, scanned, "{report:?}");
    let emails = index_rows(&cluster, "gsi_contacts_email").await;
    assert_eq!(emails.len(), 11);
    assert!(emails.contains(&("r20@x".into(), "20".into())));
    let again = cluster.gsi().reconcile::<contact::Entity>().await.unwrap();
    assert_eq!(
        (again.removed, again.added),
        (0, 0),
        "a second pass finds nothing"
    );
    let found = cluster
        .find::<contact::Entity>()
        .by_index(contact::Column::Email, "r20@x")
        .one()
        .await
        .unwrap();
    assert_eq!(found.map(|r| r.id), Some(20));
}

pub(crate) async fn pinned_index_lives_on_one_shard(dbs: &mut TestDbs) {
    let clock = std::sync::Arc::new(ManualClock::starting_now());
    let shared = std::sync::Arc::clone(&clock);
    let (cluster, _) = gsi_cluster_with(
        dbs,
        "[gsi]\npin = { gsi_contacts_email = \"s2\" }\n",
        move |b| b.clock(shared),
    )
    .await;
    cluster
        .gsi()
        .backfill::<contact::Entity>(contact::Column::Email)
        .await
        .unwrap();
    for i in 1..=12_i64 {
        add_contact(&cluster, i, i, &format!("pin{i}@x"), "0")
            .await
            .unwrap();
    }
    for shard in ["s0", "s1", "s2", "s3"] {
        let db = cluster.connection(shard).unwrap();
        let row = db
            .query_one_raw(Statement::from_string(
                db.get_database_backend(),
                "SELECT COUNT(*) AS n FROM gsi_contacts_email",
            ))
            .await
            .unwrap()
            .unwrap();
        let n: i64 = row.try_get("", "n").unwrap();
        assert_eq!(n, if shard == "s2" { 12 } else { 0 }, "{shard}");
    }
    let found = cluster
        .find::<contact::Entity>()
        .by_index(contact::Column::Email, "pin9@x")
        .one()
        .await
        .unwrap();
    assert_eq!(found.map(|r| r.id), Some(9));

    // A continuous reconciler removes what a rolled-back insert left behind.
    // A customer off the index's shard, so its index row cannot roll back with it.
    let mut k = 99_i64;
    while cluster.shard_of::<Customer>(&k).await.unwrap() == "s2" {
        k += 1;
    }
    let tx = cluster.begin::<Customer>(k).await.unwrap();
    tx.insert(contact::ActiveModel {
        id: Set(k),
        customer_id: Set(k),
        email: Set("gone@x".into()),
        phone: Set("0".into()),
    })
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    assert!(
        index_rows(&cluster, "gsi_contacts_email")
            .await
            .iter()
            .any(|(v, _)| v == "gone@x"),
        "dangling first"
    );
    // Past the grace period, the row is dangling, not an insert in flight.
    clock.advance(std::time::Duration::from_secs(31));
    let reconciler = cluster
        .gsi()
        .reconcile_every::<contact::Entity>(std::time::Duration::from_millis(50));
    let mut cleaned = false;
    for _ in 0..100 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        if !index_rows(&cluster, "gsi_contacts_email")
            .await
            .iter()
            .any(|(v, _)| v == "gone@x")
        {
            cleaned = true;
            break;
        }
    }
    reconciler.abort();
    assert!(cleaned, "the reconciler removed the dangling row");
}

/// On PostgreSQL, an index row on another shard of the owner's server commits
/// with `synchronous_commit = off` (the owner's flushed commit flushes it);
/// on the owner's own shard it goes in the owner's transaction; removals after
/// the commit are relaxed too. SQLite and MySQL/MariaDB always flush, and
/// `[gsi] relaxed_commit = false` turns it off. Values travel inlined on the
/// relaxed path and must arrive exactly.
pub(crate) async fn index_rows_beside_their_owner_commit_relaxed(dbs: &mut TestDbs) {
    let (cluster, sent) = gsi_cluster(dbs, "").await;
    let pg =
        cluster.connection("s0").unwrap().get_database_backend() == sea_orm::DbBackend::Postgres;
    let email = |i: i64| format!("o'hara\\'; --{i}@example.com");
    let (mut relaxed, mut in_owner_txn) = (0, 0);
    for i in 0..24_i64 {
        sent.lock().unwrap().clear();
        add_contact(&cluster, i, i, &email(i), "+1 555 0100 'x'")
            .await
            .unwrap();
        let owner = cluster.shard_of::<Customer>(&i).await.unwrap();
        for table in ["gsi_contacts_email", "gsi_contacts_phone"] {
            let writes = index_writes(&sent, table);
            assert_eq!(writes.len(), 1, "{table}: {writes:?}");
            let IndexWrite {
                shard,
                op,
                relaxed: r,
            } = &writes[0];
            assert_eq!(op, "INSERT");
            if shard == owner {
                assert!(!r, "in the owner's transaction: {writes:?}");
                in_owner_txn += 1;
            } else {
                assert_eq!(*r, pg, "{table} on {shard}, owner on {owner}");
                relaxed += usize::from(*r);
            }
        }
    }
    assert!(in_owner_txn > 0);
    assert_eq!(relaxed > 0, pg);
    assert_eq!(
        index_rows(&cluster, "gsi_contacts_email").await,
        (0..24).map(|i| (email(i), i.to_string())).collect()
    );
    cluster
        .gsi()
        .backfill::<contact::Entity>(contact::Column::Email)
        .await
        .unwrap();
    for i in [0, 7, 23] {
        let found = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, email(i))
            .all()
            .await
            .unwrap();
        assert_eq!(found.iter().map(|r| r.id).collect::<Vec<_>>(), vec![i]);
    }

    // An update moves the entry: the new row first, the old one removed after
    // the commit (relaxed on PostgreSQL wherever it lives).
    sent.lock().unwrap().clear();
    let tx = cluster.begin::<Customer>(5).await.unwrap();
    tx.update(contact::ActiveModel {
        id: Unchanged(5),
        customer_id: Unchanged(5),
        email: Set("moved@example.com".into()),
        phone: Unchanged("+1 555 0100 'x'".into()),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let writes = index_writes(&sent, "gsi_contacts_email");
    assert_eq!(
        writes.iter().map(|w| w.op.as_str()).collect::<Vec<_>>(),
        ["INSERT", "DELETE"]
    );
    assert_eq!(writes[1].relaxed, pg);
    assert!(
        !index_rows(&cluster, "gsi_contacts_email")
            .await
            .contains(&(email(5), "5".to_owned()))
    );

    // Turned off: every index write flushes.
    let (strict, strict_sent) =
        recording_cluster(dbs, 4, "[groups.Customer]\n[gsi]\nrelaxed_commit = false\n").await;
    for i in 100..108_i64 {
        add_contact(&strict, i, i, &email(i), "p").await.unwrap();
    }
    let tx = strict.begin::<Customer>(100).await.unwrap();
    tx.delete(contact::ActiveModel {
        id: Unchanged(100),
        customer_id: Unchanged(100),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let writes = index_writes(&strict_sent, "gsi_contacts_");
    assert!(writes.iter().any(|w| w.op == "DELETE"), "{writes:?}");
    assert!(writes.iter().all(|w| !w.relaxed), "{writes:?}");
}

/// The shard holding `table`'s index row for `value`.
async fn index_home(cluster: &Cluster, table: &str, value: &str) -> String {
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        let n = db
            .query_all_raw(Statement::from_sql_and_values(
                db.get_database_backend(),
                match db.get_database_backend() {
                    sea_orm::DbBackend::Postgres => {
                        format!("SELECT 1 FROM {table} WHERE value = $1")
                    }
                    _ => format!("SELECT 1 FROM {table} WHERE value = ?"),
                },
                [value.into()],
            ))
            .await
            .unwrap();
        if !n.is_empty() {
            return shard.to_owned();
        }
    }
    panic!("no index row for {value} in {table}");
}

/// An owner shard that cannot be reached: an index read fails with
/// `ShardsFailed` naming it, or with `.partial()` lists it and returns the
/// rows of the shards that answered — whether the index lists one shard key
/// (the single-shard path) or several.
pub(crate) async fn by_index_reports_a_failed_owner_shard(dbs: &mut TestDbs) {
    let (healthy, _) = gsi_cluster(dbs, "").await;
    let shard_of = |k: i64| {
        let healthy = healthy.clone();
        async move { healthy.shard_of::<Customer>(&k).await.unwrap().to_owned() }
    };
    let mut dead_keys = Vec::new();
    let mut live_key = None;
    for k in 0..200_i64 {
        if shard_of(k).await == "s3" {
            dead_keys.push(k);
        } else if live_key.is_none() {
            live_key = Some(k);
        }
    }
    let live_key = live_key.unwrap();
    // Values whose index rows live on a shard that stays up.
    let mut email = None;
    for (i, &k) in dead_keys.iter().enumerate() {
        let e = format!("dead{i}@example.com");
        add_contact(&healthy, i as i64 + 1, k, &e, &format!("ph{i}"))
            .await
            .unwrap();
        if index_home(&healthy, "gsi_contacts_email", &e).await != "s3" {
            email = Some(e);
            break;
        }
    }
    let email = email.expect("an email indexed off s3");
    let mut phone = None;
    add_contact(&healthy, 2000, live_key, "live@example.com", "shared0")
        .await
        .unwrap();
    for i in 0..50 {
        let p = format!("shared{i}");
        if i > 0 {
            let tx = healthy.begin::<Customer>(live_key).await.unwrap();
            tx.update(contact::ActiveModel {
                id: Unchanged(2000),
                customer_id: Unchanged(live_key),
                phone: Set(p.clone()),
                ..Default::default()
            })
            .await
            .unwrap();
            tx.commit().await.unwrap();
        }
        if index_home(&healthy, "gsi_contacts_phone", &p).await != "s3" {
            phone = Some(p);
            break;
        }
    }
    let phone = phone.expect("a phone indexed off s3");
    add_contact(
        &healthy,
        2001,
        dead_keys[0],
        "dead-shared@example.com",
        &phone,
    )
    .await
    .unwrap();
    for column in [contact::Column::Email, contact::Column::Phone] {
        healthy
            .gsi()
            .backfill::<contact::Entity>(column)
            .await
            .unwrap();
    }

    let toml = format!(
        "{}\n[groups.Customer]\n",
        dbs.shards_toml_with(4, "connect_lazy = true\nacquire_timeout_secs = 3\n", &[3])
    );
    let cluster = Cluster::connect(shardkit::ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    let read = || cluster.find::<contact::Entity>();
    match read()
        .by_index(contact::Column::Email, email.as_str())
        .all()
        .await
    {
        Err(ShardError::ShardsFailed {
            asked: 1, failures, ..
        }) => {
            assert_eq!(failures[0].shard, "s3");
        }
        other => panic!("expected ShardsFailed, got {other:?}"),
    }
    let partial = read()
        .by_index(contact::Column::Email, email.as_str())
        .partial()
        .one()
        .await
        .unwrap();
    assert_eq!(partial.rows, None);
    assert_eq!(partial.failed_shards(), ["s3"]);
    let shared = read()
        .by_index(contact::Column::Phone, phone.as_str())
        .partial()
        .all()
        .await
        .unwrap();
    assert_eq!(shared.rows.iter().map(|r| r.id).collect::<Vec<_>>(), [2000]);
    assert_eq!(shared.failed.len(), 1);
    // A healthy owner is read as before.
    let live = read()
        .by_index(contact::Column::Email, "live@example.com")
        .one()
        .await
        .unwrap();
    assert_eq!(live.map(|r| r.id), Some(2000));
}

/// A statement that fails on an index table says so: `origin` names the
/// subsystem and the table, the message ends with the driver's own message
/// (once, and `report()` does not repeat it), SeaORM's error is the typed
/// `source()`; the row is not written.
pub(crate) async fn a_failed_index_write_names_its_table(dbs: &mut TestDbs) {
    let (cluster, _) = gsi_cluster(dbs, "").await;
    for shard in cluster.topology().shard_names() {
        cluster
            .connection(shard)
            .unwrap()
            .execute_unprepared("DROP TABLE gsi_contacts_email")
            .await
            .unwrap();
    }
    let err = add_contact(&cluster, 1, 7, "a@example.com", "555")
        .await
        .unwrap_err();
    let ShardError::Db {
        origin,
        shard,
        operation,
        ..
    } = &err
    else {
        panic!("expected a database error, got {err:?}");
    };
    assert_eq!(
        **origin,
        shardkit::Origin::Table {
            subsystem: shardkit::Subsystem::Gsi,
            table: "gsi_contacts_email".to_owned(),
        },
        "{err:?}"
    );
    let message = err.to_string();
    let what = format!("{operation} on `{shard}` (gsi table `gsi_contacts_email`) failed: ");
    let cause = message
        .strip_prefix(&what)
        .unwrap_or_else(|| panic!("{message}"));
    match dbs.backend {
        Backend::Sqlite => assert_eq!(cause, "(code: 1) no such table: gsi_contacts_email"),
        Backend::Postgres => assert_eq!(
            cause,
            "relation \"gsi_contacts_email\" does not exist (SQLSTATE 42P01)"
        ),
        // The database's name is the test's own.
        Backend::MySql => {
            let spec = cluster
                .topology()
                .shards()
                .iter()
                .find(|s| s.name == *shard);
            let url = spec.unwrap().url.redacted();
            let database = url.rsplit('/').next().unwrap();
            assert_eq!(
                cause,
                format!("1146 (42S02): Table '{database}.gsi_contacts_email' doesn't exist")
            );
        }
    }
    assert_eq!(err.report().to_string(), message);
    let typed = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<sea_orm::DbErr>());
    assert!(typed.is_some(), "{err:?}");
    let rows = cluster
        .find::<contact::Entity>()
        .key(7)
        .all()
        .await
        .unwrap();
    assert!(
        rows.is_empty(),
        "index-first: no row without its index row: {rows:?}"
    );
}
