//! Global secondary indexes under races, faults and hostile input, on SQLite,
//! PostgreSQL and MySQL/MariaDB: concurrent updates of one row keep its
//! unique index row, reconcile reports conflicts and goes on, index values
//! compare byte for byte, backfill scans by primary key, and a failed unique
//! claim is a duplicate only when the database says so.

use crate::index_rows;
use sea_orm::ActiveValue::{NotSet, Unchanged};
use sea_orm::{ConnectionTrait, EntityTrait, Set, Statement};
use shardkit::error::Retry;
use shardkit::gsi::{BackfillProgress, IndexState};
use shardkit::{Cluster, JobControl, ShardError};
use shardkit_tests::models::*;
use shardkit_tests::{TestDbs, contacts_by_index};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

async fn gsi_cluster(dbs: &TestDbs, extra: &str) -> Cluster {
    let cluster = dbs.cluster(4, &format!("[groups.Customer]\n{extra}")).await;
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    cluster
}

async fn activate(cluster: &Cluster) {
    for column in [contact::Column::Email, contact::Column::Phone] {
        let done = cluster
            .gsi()
            .backfill::<contact::Entity>(column)
            .await
            .unwrap();
        assert!(done.finished);
    }
}

async fn add(
    cluster: &Cluster,
    id: i64,
    customer: i64,
    email: &str,
    phone: &str,
) -> shardkit::Result<contact::Model> {
    let tx = cluster.begin::<Customer>(customer).await?;
    let row = tx.insert(contact::row(id, customer, email, phone)).await?;
    tx.commit().await?;
    Ok(row)
}

async fn set_email(cluster: &Cluster, id: i64, customer: i64, email: &str) -> shardkit::Result<()> {
    let tx = cluster.begin::<Customer>(customer).await?;
    tx.update(contact::ActiveModel {
        id: Unchanged(id),
        customer_id: Unchanged(customer),
        email: Set(email.to_owned()),
        phone: NotSet,
    })
    .await?;
    tx.commit().await
}

async fn by_email(cluster: &Cluster, email: &str) -> Vec<i64> {
    contacts_by_index(cluster, contact::Column::Email, email).await
}

/// All contacts, read shard by shard behind shardkit's back.
async fn all_contacts(cluster: &Cluster) -> Vec<contact::Model> {
    let mut rows = Vec::new();
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        rows.extend(contact::Entity::find().all(db).await.unwrap());
    }
    rows.sort_by_key(|r| r.id);
    rows
}

/// T1 changes a row's email e0 → e1 and holds its row lock; T2 sets it back
/// to e0 meanwhile; T1 commits (and removes e0's index row after), then T2.
/// The row holds e0, so e0's index row must be there, and a second owner
/// must not get e0.
pub(crate) async fn update_race_keeps_the_unique_index_row(dbs: &mut TestDbs) {
    let cluster = gsi_cluster(dbs, "").await;
    activate(&cluster).await;
    for round in 0..20_i64 {
        let (id, customer) = (1000 + round, round + 1);
        let (e0, e1) = (format!("race{round}@x"), format!("race{round}-new@x"));
        add(&cluster, id, customer, &e0, "p").await.unwrap();

        let t1 = cluster.begin::<Customer>(customer).await.unwrap();
        t1.update(contact::ActiveModel {
            id: Unchanged(id),
            customer_id: Unchanged(customer),
            email: Set(e1.clone()),
            phone: NotSet,
        })
        .await
        .unwrap();
        let t2 = tokio::spawn({
            let (cluster, e0) = (cluster.clone(), e0.clone());
            async move { set_email(&cluster, id, customer, &e0).await }
        });
        // Lets T2 reach T1's row lock (or SQLite's write lock) first; the
        // outcome must not depend on whether it did.
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        t1.commit().await.unwrap();
        t2.await.unwrap().unwrap();

        let row = cluster
            .find::<contact::Entity>()
            .key(customer)
            .all()
            .await
            .unwrap();
        assert_eq!(row.len(), 1);
        assert_eq!(row[0].email, e0, "round {round}");
        assert_eq!(by_email(&cluster, &e0).await, vec![id], "round {round}");
        assert!(by_email(&cluster, &e1).await.is_empty(), "round {round}");
        let other = add(&cluster, 5000 + round, customer + 500, &e0, "p").await;
        assert!(
            matches!(other, Err(ShardError::UniqueViolation { .. })),
            "round {round}: a second owner claimed {e0}: {other:?}"
        );
    }
    let emails = index_rows(&cluster, "gsi_contacts_email").await;
    let expected: BTreeSet<(String, String)> = (0..20_i64)
        .map(|r| (format!("race{r}@x"), (r + 1).to_string()))
        .collect();
    assert_eq!(emails, expected);
}

/// Two live rows hold one unique value (written behind shardkit's back):
/// reconcile reports the one left without an index row and still adds the
/// index rows other owners miss.
pub(crate) async fn reconcile_reports_unique_conflicts_and_goes_on(dbs: &mut TestDbs) {
    let cluster = gsi_cluster(dbs, "").await;
    activate(&cluster).await;
    add(&cluster, 1, 1, "dup@x", "p1").await.unwrap();
    // Behind shardkit's back: a second holder of dup@x, and owners with no
    // index rows at all, on every shard.
    for (id, customer, email) in [
        (2_i64, 2_i64, "dup@x".to_owned()),
        (3, 3, "m3@x".to_owned()),
        (4, 4, "m4@x".to_owned()),
        (5, 5, "m5@x".to_owned()),
        (6, 6, "m6@x".to_owned()),
    ] {
        let shard = cluster
            .shard_of::<Customer>(&customer)
            .await
            .unwrap()
            .to_owned();
        contact::Entity::insert(contact::row(id, customer, &email, &format!("p{id}")))
            .exec(cluster.connection(&shard).unwrap())
            .await
            .unwrap();
    }
    let report = cluster.gsi().reconcile::<contact::Entity>().await.unwrap();
    assert_eq!(report.conflicts.len(), 1, "{report:?}");
    let conflict = &report.conflicts[0];
    assert_eq!(
        (
            conflict.index.as_str(),
            conflict.value.as_str(),
            conflict.key.as_str(),
            conflict.owner.as_str()
        ),
        ("gsi_contacts_email", "dup@x", "2", "2")
    );
    // m3..m6 in the email index, p2..p6 in the phone index.
    assert_eq!(report.added, 4 + 5, "{report:?}");
    for id in 3..=6_i64 {
        assert_eq!(by_email(&cluster, &format!("m{id}@x")).await, vec![id]);
    }
    assert_eq!(by_email(&cluster, "dup@x").await, vec![1]);
}

/// `a@x`, `A@X` and `a@x ` are three values on every backend: three owners,
/// three index rows, each found by its own value only; an update that only
/// changes case or trailing space moves the row's index entry.
pub(crate) async fn index_values_compare_byte_for_byte(dbs: &mut TestDbs) {
    let cluster = gsi_cluster(dbs, "").await;
    activate(&cluster).await;
    let values = ["a@x", "A@X", "a@x "];
    for (i, value) in values.iter().enumerate() {
        let id = i as i64 + 1;
        add(&cluster, id, id, value, value).await.unwrap();
    }
    for (i, value) in values.iter().enumerate() {
        assert_eq!(
            by_email(&cluster, value).await,
            vec![i as i64 + 1],
            "{value:?}"
        );
        let phones: Vec<i64> = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Phone, *value)
            .all()
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(phones, vec![i as i64 + 1], "phone {value:?}");
    }
    let emails = index_rows(&cluster, "gsi_contacts_email").await;
    assert_eq!(emails.len(), 3, "{emails:?}");
    assert_eq!(index_rows(&cluster, "gsi_contacts_phone").await.len(), 3);

    // Case-only and trailing-space-only updates.
    for (id, from, to) in [(10_i64, "b@y", "B@Y"), (11, "c@z", "c@z  ")] {
        add(&cluster, id, id, from, "p").await.unwrap();
        set_email(&cluster, id, id, to).await.unwrap();
        assert_eq!(by_email(&cluster, to).await, vec![id], "{to:?}");
        assert!(by_email(&cluster, from).await.is_empty(), "{from:?}");
        // The old value is free again, for another owner.
        add(&cluster, id + 100, id + 100, from, "p").await.unwrap();
        assert_eq!(by_email(&cluster, from).await, vec![id + 100]);
        assert_eq!(by_email(&cluster, to).await, vec![id]);
    }
}

/// An index table created by an older release on MySQL/MariaDB (text columns
/// in the server's default collation) is converted by `gsi().create`, rows
/// kept; reconcile then adds the rows such a table had merged.
pub(crate) async fn index_tables_of_an_older_release_are_converted(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(4, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        for (table, unique) in [("gsi_contacts_email", true), ("gsi_contacts_phone", false)] {
            db.execute(&shardkit_migration::gsi_table(table, unique))
                .await
                .unwrap();
        }
    }
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    activate(&cluster).await;
    let db = cluster.connection("s0").unwrap();
    let rows = db
        .query_all_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT COLLATION_NAME AS c FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'gsi_contacts_%' \
             AND COLUMN_NAME IN ('value', 'shard_key', 'owner_pk')"
                .to_owned(),
        ))
        .await
        .unwrap();
    assert_eq!(rows.len(), 6);
    for row in rows {
        let collation: String = row.try_get("", "c").unwrap();
        assert!(
            ["utf8mb4_nopad_bin", "utf8mb4_0900_bin"].contains(&collation.as_str()),
            "{collation}"
        );
    }
    add(&cluster, 1, 1, "a@x", "p").await.unwrap();
    add(&cluster, 2, 2, "A@X", "P").await.unwrap();
    assert_eq!(by_email(&cluster, "A@X").await, vec![2]);
}

/// Rows deleted behind the backfill's position and rows inserted during it:
/// when the index turns active every surviving owner is in it. Driven from
/// the progress callback after every chunk.
pub(crate) async fn backfill_indexes_every_owner_despite_concurrent_deletes(dbs: &mut TestDbs) {
    let cluster = gsi_cluster(dbs, "").await;
    for id in 1..=120_i64 {
        add(&cluster, id, id % 16, &format!("b{id}@x"), "p")
            .await
            .unwrap();
    }
    // As if the rows predated the index: no index rows, index write_only.
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        for table in ["gsi_contacts_email", "gsi_contacts_phone"] {
            db.execute_unprepared(&format!("DELETE FROM {table}"))
                .await
                .unwrap();
        }
    }
    assert_eq!(
        cluster
            .gsi()
            .state::<contact::Entity>(contact::Column::Email)
            .await
            .unwrap(),
        IndexState::WriteOnly
    );
    let handle = tokio::runtime::Handle::current();
    let next = AtomicI64::new(1000);
    let calls = Arc::new(AtomicU64::new(0));
    let (counted, writer) = (Arc::clone(&calls), cluster.clone());
    let on_progress = move |p: &BackfillProgress| {
        let cluster = &writer;
        counted.fetch_add(1, Ordering::SeqCst);
        if p.finished || p.rows == 0 {
            return;
        }
        let next_id = next.fetch_add(1, Ordering::SeqCst);
        // Behind the scan: delete the lowest id left on the shard being
        // scanned (just indexed), and insert a new row.
        let scanned = cluster.topology().shard_names().nth(p.shards_done);
        tokio::task::block_in_place(|| {
            handle.block_on(async {
                if let Some(shard) = scanned {
                    let db = cluster.connection(shard).unwrap();
                    let mut rows = contact::Entity::find().all(db).await.unwrap();
                    rows.sort_by_key(|r| r.id);
                    if let Some(row) = rows.into_iter().find(|r| r.id < 1000) {
                        let tx = cluster.begin::<Customer>(row.customer_id).await.unwrap();
                        tx.delete(contact::ActiveModel {
                            id: Unchanged(row.id),
                            customer_id: Unchanged(row.customer_id),
                            email: NotSet,
                            phone: NotSet,
                        })
                        .await
                        .unwrap();
                        tx.commit().await.unwrap();
                    }
                }
                add(
                    cluster,
                    next_id,
                    next_id % 16,
                    &format!("b{next_id}@x"),
                    "p",
                )
                .await
                .unwrap();
            });
        });
    };
    let progress = cluster
        .gsi()
        .backfill_with::<contact::Entity>(
            contact::Column::Email,
            4,
            JobControl::new().on_progress(on_progress),
        )
        .await
        .unwrap();
    assert!(progress.finished);
    let calls = calls.load(Ordering::SeqCst);
    assert!(calls > 10, "{calls} progress calls");
    let survivors = all_contacts(&cluster).await;
    assert!(survivors.len() > 60, "{}", survivors.len());
    let indexed = index_rows(&cluster, "gsi_contacts_email").await;
    let expected: BTreeSet<(String, String)> = survivors
        .iter()
        .map(|r| (r.email.clone(), r.customer_id.to_string()))
        .collect();
    let missing: Vec<_> = expected.difference(&indexed).collect();
    assert!(
        missing.is_empty(),
        "owners missing from the index: {missing:?}"
    );
    for row in survivors.iter().step_by(7) {
        assert_eq!(by_email(&cluster, &row.email).await, vec![row.id]);
    }
}

/// 16 writers race for the same unique values, first with the index rows
/// on the writers' own shard (the claim runs in the writer's transaction),
/// then on another shard (a claim transaction of its own). A writer's failure
/// is a duplicate only if another writer owns the value; anything else must
/// say it can be retried, and retrying the whole transaction succeeds or
/// meets the owner. Exactly one owner per value, and every connection is
/// still usable afterwards.
pub(crate) async fn unique_race_reports_only_real_duplicates(dbs: &mut TestDbs) {
    let cluster = gsi_cluster(
        dbs,
        "[gsi]\npin = { gsi_contacts_email = \"s1\", gsi_contacts_phone = \"s1\" }\n",
    )
    .await;
    activate(&cluster).await;
    // One write from each shard first: the first index write to another
    // PostgreSQL database asks the owner's shard which server it is on, on
    // a second connection of its pool, which 16 writers holding all of that
    // pool's connections would wait for until the pool timed out (the pool
    // exhaustion of issue 16 item 1, not what this scenario is about).
    for (k, shard) in ["s0", "s1", "s2", "s3"].into_iter().enumerate() {
        let customer = customers_on(&cluster, shard, 1).await[0];
        add(
            &cluster,
            8000 + k as i64,
            customer,
            &format!("warm{k}@x"),
            "p",
        )
        .await
        .unwrap();
    }
    let local = customers_on(&cluster, "s1", 16).await;
    let remote = customers_on(&cluster, "s0", 16).await;
    for (phase, writers) in [("local", local), ("remote", remote)] {
        race(&cluster, phase, &writers).await;
    }
    // Every pooled connection still works (none is left inside a dead
    // transaction or with a rollback it cannot run).
    let writes: Vec<_> = (0..16_i64)
        .map(|i| {
            let cluster = cluster.clone();
            tokio::spawn(
                async move { add(&cluster, 9000 + i, i, &format!("after{i}@x"), "p").await },
            )
        })
        .collect();
    for write in writes {
        write.await.unwrap().unwrap();
    }
}

async fn race(cluster: &Cluster, phase: &'static str, writers: &[i64]) {
    const VALUES: i64 = 6;
    let mut tasks = Vec::new();
    for (w, customer) in writers.iter().copied().enumerate() {
        let cluster = cluster.clone();
        tasks.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for v in 0..VALUES {
                let id = customer * 100 + v;
                let email = format!("{phase}{v}@x");
                let mut retried = 0;
                let outcome = loop {
                    // Writers start on different values, so their
                    // transactions cross.
                    let _ = w;
                    match add(&cluster, id, customer, &email, "p").await {
                        Err(e) if e.retry() != Retry::Never && retried < 20 => {
                            assert!(
                                !e.report().to_string().contains("SAVEPOINT"),
                                "{}",
                                e.report()
                            );
                            retried += 1;
                        }
                        other => break other,
                    }
                };
                outcomes.push((v, id, outcome.map(|_| ()), retried));
            }
            outcomes
        }));
    }
    let mut winners = vec![Vec::new(); VALUES as usize];
    let mut retries = 0;
    for task in tasks {
        for (v, id, outcome, retried) in task.await.unwrap() {
            retries += retried;
            match outcome {
                Ok(()) => winners[v as usize].push(id),
                Err(ShardError::UniqueViolation { value, .. }) => {
                    assert_eq!(value, format!("{phase}{v}@x"))
                }
                Err(e) => panic!(
                    "{phase} value {v}: not a duplicate, yet failed: {e} ({:?})",
                    e.retry()
                ),
            }
        }
    }
    println!("{phase}: {retries} transactions run again after a retryable error");
    for (v, ids) in winners.iter().enumerate() {
        assert_eq!(ids.len(), 1, "{phase} value {v}: owners {ids:?}");
        assert_eq!(by_email(cluster, &format!("{phase}{v}@x")).await, *ids);
    }
}

/// A claim whose statement fails as a cut connection would (failpoint
/// `shardkit::gsi::claim`, armed for one never-used value: the other
/// scenarios' claims go on) is a database error that may be retried, not a
/// duplicate; nothing is written, and the same write then succeeds.
pub(crate) async fn failed_claim_is_not_a_duplicate(dbs: &mut TestDbs) {
    // The backends' runs take turns: setting the failpoint replaces another
    // run's value, removing it removes it for all.
    static FAILPOINT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = FAILPOINT.lock().await;
    // The index lives on the owner's own shard, so the claim runs inside the
    // owner's transaction.
    let cluster = gsi_cluster(dbs, "[gsi]\npin = { gsi_contacts_email = \"s1\" }\n").await;
    activate(&cluster).await;
    let customer = customers_on(&cluster, "s1", 1).await[0];
    let value = format!("cut-{:?}@x", dbs.backend);
    fail::cfg("shardkit::gsi::claim", &format!("return({value})")).unwrap();
    let err = add(&cluster, 1, customer, &value, "p").await.unwrap_err();
    fail::remove("shardkit::gsi::claim");
    assert!(
        matches!(err, ShardError::Db { .. }),
        "a failed claim reported as {err:?}"
    );
    assert_eq!(err.retry(), Retry::Now, "{err}");
    assert!(all_contacts(&cluster).await.is_empty());
    add(&cluster, 1, customer, &value, "p").await.unwrap();
    assert_eq!(by_email(&cluster, &value).await, vec![1]);
}

/// The first `n` customers whose rows live on `shard`.
async fn customers_on(cluster: &Cluster, shard: &str, n: usize) -> Vec<i64> {
    let mut found = Vec::new();
    let mut customer = 0_i64;
    while found.len() < n {
        if cluster.shard_of::<Customer>(&customer).await.unwrap() == shard {
            found.push(customer);
        }
        customer += 1;
    }
    found
}

/// A 1 MB value is refused before any I/O on every backend, as too long,
/// with a message that quotes only its start; nothing is written.
pub(crate) async fn long_value_is_refused_with_a_bounded_message(dbs: &mut TestDbs) {
    let cluster = gsi_cluster(dbs, "").await;
    activate(&cluster).await;
    let long = format!("{}@x", "v".repeat(1 << 20));
    for customer in 0..4_i64 {
        let Err(err) = add(&cluster, customer, customer, &long, "p").await else {
            panic!("a 1 MB index value was written");
        };
        match &err {
            ShardError::IndexValueTooLong {
                index, chars, max, ..
            } => {
                assert_eq!(index, "gsi_contacts_email");
                assert_eq!(*chars, long.len());
                assert_eq!(*max, shardkit::gsi::MAX_VALUE_CHARS);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(err.retry(), Retry::Never);
        let message = err.to_string();
        assert!(message.len() < 300, "{} bytes: {message}", message.len());
        assert!(message.contains("characters long"), "{message}");
    }
    // The longest value that fits is indexed like any other.
    let fits = "w".repeat(shardkit::gsi::MAX_VALUE_CHARS);
    add(&cluster, 7, 7, &fits, "p").await.unwrap();
    assert_eq!(by_email(&cluster, &fits).await, vec![7]);
    // A lookup of a value too long to be indexed finds nothing.
    assert!(by_email(&cluster, &long).await.is_empty());
    // A duplicate's message quotes a bounded prefix too.
    let err = add(&cluster, 8, 8, &fits, "p").await.unwrap_err();
    assert!(matches!(err, ShardError::UniqueViolation { .. }), "{err:?}");
    assert!(err.to_string().len() < 200, "{err}");
    let rows = all_contacts(&cluster).await;
    assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), vec![7]);
}
