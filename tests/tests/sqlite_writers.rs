//! SQLite shards queue writers instead of failing them: write transactions
//! take the write lock up front (`BEGIN IMMEDIATE`) and wait with the busy
//! timeout, and shards run in WAL mode. Several instances on one set of
//! files (two `Cluster`s in this process, and this test binary run again as
//! a second process) queue their write transactions on the write slot the
//! files share, so none fails with `database is locked`, and a wait that
//! runs out takes the busy timeout (5 s) and says to retry after a short
//! wait.

use sea_orm::ConnectionTrait;
use shardkit::prelude::*;
use shardkit::{JobControl, Retry, ShardError};
use shardkit_tests::models::*;
use shardkit_tests::{TestDbs, backend_tests, count_rows};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

backend_tests!(4 =>
    [Sqlite] concurrent_read_then_write_transactions_all_commit,
    [Sqlite] two_instances_and_a_process_write_while_an_index_backfills,
    [Sqlite] a_begin_waits_the_busy_timeout_then_says_retry_after,
    [Sqlite] child_process_writer,
);

/// Set for this binary run as a second process by
/// `two_instances_and_a_process_write_while_an_index_backfills`: the
/// cluster's TOML.
const CHILD_CONFIG: &str = "SHARDKIT_TEST_SQLITE_CHILD_CONFIG";
/// The child's first contact id.
const CHILD_BASE: &str = "SHARDKIT_TEST_SQLITE_CHILD_BASE";

/// Transactions per writer.
const WRITES: i64 = 30;

/// The cluster TOML of `dbs`' four SQLite files, pools of 2.
fn small_pools(dbs: &TestDbs) -> String {
    format!(
        "{}\n[groups.Customer]\n",
        dbs.shards_toml(4)
            .replace("max_connections = 4", "max_connections = 2")
    )
}

/// Writer `w`'s transactions: each inserts a contact (a unique and a
/// non-unique global index, whose rows live on other files), every third
/// also updates the one before (its index entry moves). Returns the
/// acknowledged rows (id → email) and the errors.
async fn writer(cluster: Cluster, base: i64) -> (BTreeMap<i64, String>, Vec<String>) {
    let mut acked = BTreeMap::new();
    let mut failed = Vec::new();
    for i in 0..WRITES {
        let id = base + i;
        let email = format!("w{id}@x");
        let result = async {
            let tx = cluster.begin::<Customer>(id).await?;
            tx.insert(contact::row(id, id, &email, &format!("p{}", id % 7)))
                .await?;
            tx.commit().await
        }
        .await;
        match result {
            Ok(()) => {
                acked.insert(id, email);
            }
            Err(err) => failed.push(format!("insert {id}: {err} (retry {:?})", err.retry())),
        }
        if i % 3 == 2 && acked.contains_key(&(id - 1)) {
            let prev = id - 1;
            let moved = format!("moved{prev}@x");
            let result = async {
                let tx = cluster.begin::<Customer>(prev).await?;
                tx.update(contact::row(prev, prev, &moved, "p-moved"))
                    .await?;
                tx.commit().await
            }
            .await;
            match result {
                Ok(()) => {
                    acked.insert(prev, moved);
                }
                Err(err) => failed.push(format!("update {prev}: {err} (retry {:?})", err.retry())),
            }
        }
    }
    (acked, failed)
}

/// Every acknowledged row is there with its last acknowledged email, and
/// its unique index finds it.
async fn check_acked(cluster: &Cluster, acked: &BTreeMap<i64, String>) {
    for (id, email) in acked {
        let tx = cluster.begin::<Customer>(*id).await.unwrap();
        let row = tx.find::<contact::Entity>().one().await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(
            row.map(|r| r.email).as_deref(),
            Some(email.as_str()),
            "contact {id}"
        );
        let found = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, email.as_str())
            .all()
            .await
            .unwrap();
        assert_eq!(
            found.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![*id],
            "{email} by its index"
        );
    }
}

/// Two `Cluster`s on the same four files in this process, four writers
/// each on pools of 2, and this binary again as a second process with four
/// more, while the second instance backfills a global index over rows
/// written before it existed. Before the write slot was shared, writers of
/// two instances each held one file and waited for the other's (index
/// rows): about 1 in 14 writes failed with `database is locked` after the
/// busy timeout.
async fn two_instances_and_a_process_write_while_an_index_backfills(dbs: &mut TestDbs) {
    let toml = small_pools(dbs);
    let config = ClusterConfig::from_toml(&toml).unwrap();
    let a = Cluster::connect(config.clone()).await.unwrap();
    a.migrate::<Migrator>().await.unwrap();
    // Rows the phone index must backfill: written before it existed.
    for id in 1..=300_i64 {
        let shard = a.shard_of::<Customer>(&id).await.unwrap().to_owned();
        contact::Entity::insert(contact::row(id, id, &format!("old{id}@x"), "p-old"))
            .exec(a.connection(&shard).unwrap())
            .await
            .unwrap();
    }
    a.gsi().create::<contact::Entity>().await.unwrap();
    let b = Cluster::connect(config).await.unwrap();

    let child_base = 900_000_i64;
    let exe = std::env::current_exe().unwrap();
    let child_toml = toml.clone();
    let child = tokio::task::spawn_blocking(move || {
        std::process::Command::new(exe)
            .args([
                "child_process_writer::sqlite",
                "--exact",
                "--test-threads",
                "1",
            ])
            .env(CHILD_CONFIG, child_toml)
            .env(CHILD_BASE, child_base.to_string())
            .output()
            .unwrap()
    });
    let started = Instant::now();
    let writers: Vec<_> = (0..8_i64)
        .map(|w| {
            let cluster = if w % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(writer(cluster, 10_000 * (w + 1)))
        })
        .collect();
    let backfill = b
        .gsi()
        .backfill_with::<contact::Entity>(contact::Column::Phone, 20, JobControl::new())
        .await
        .unwrap();
    assert!(backfill.finished, "{backfill:?}");
    assert!(backfill.rows >= 300, "{backfill:?}");

    let mut acked = BTreeMap::new();
    let mut failed = Vec::new();
    for task in writers {
        let (rows, errors) = task.await.unwrap();
        acked.extend(rows);
        failed.extend(errors);
    }
    let output = child.await.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the child process failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut child_rows = 0;
    for line in stdout.lines() {
        if let Some(row) = line.strip_prefix("ACKED ") {
            let (id, email) = row.split_once(' ').unwrap();
            acked.insert(id.parse().unwrap(), email.to_owned());
            child_rows += 1;
        } else if let Some(err) = line.strip_prefix("FAILED ") {
            failed.push(format!("child: {err}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{} writes failed: {failed:#?}",
        failed.len()
    );
    assert_eq!(child_rows, 4 * WRITES, "the child's rows: {stdout}");
    assert_eq!(acked.len() as i64, 12 * WRITES);
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "took {:?}",
        started.elapsed()
    );
    check_acked(&a, &acked).await;
    assert_eq!(count_rows(&b, "contacts").await, 300 + 12 * WRITES as u64);
    let family = b
        .find::<contact::Entity>()
        .by_index(contact::Column::Phone, "p-old")
        .all()
        .await
        .unwrap();
    assert_eq!(family.len(), 300, "the backfilled index finds the old rows");
}

/// The second process of the scenario above (nothing to do when this
/// binary runs as itself): four writers on the files the parent names,
/// each acknowledged row (its last email) and each error printed for the
/// parent to check.
async fn child_process_writer(_dbs: &mut TestDbs) {
    let Ok(toml) = std::env::var(CHILD_CONFIG) else {
        return;
    };
    let base: i64 = std::env::var(CHILD_BASE).unwrap().parse().unwrap();
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    let writers: Vec<_> = (0..4_i64)
        .map(|w| tokio::spawn(writer(cluster.clone(), base + 1_000 * w)))
        .collect();
    let mut lines = Vec::new();
    for task in writers {
        let (acked, failed) = task.await.unwrap();
        lines.extend(
            acked
                .iter()
                .map(|(id, email)| format!("ACKED {id} {email}")),
        );
        lines.extend(failed.iter().map(|e| format!("FAILED {e}")));
    }
    // On lines of their own, after the harness's "test ... " prefix.
    println!("\n{}", lines.join("\n"));
}

async fn concurrent_read_then_write_transactions_all_commit(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(1, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let db = cluster.connection("s0").unwrap();
    let mode = db
        .query_one_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            "PRAGMA journal_mode",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index::<String>(0)
        .unwrap();
    assert_eq!(mode, "wal");

    // 80 transactions on 8 keys of one shard: each reads its key's rows,
    // then writes one (the read-then-write that a deferred SQLite
    // transaction cannot upgrade while another holds the write lock).
    let tasks: Vec<_> = (0..80_i64)
        .map(|i| {
            let cluster = cluster.clone();
            tokio::spawn(async move {
                let key = i % 8;
                let tx = cluster.begin::<Customer>(key).await?;
                let before = tx.find::<order::Entity>().count().await?;
                tx.insert(order::ActiveModel {
                    id: Set(i),
                    customer_id: Set(key),
                    total_cents: Set(i64::try_from(before).unwrap_or(0)),
                })
                .await?;
                tx.commit().await
            })
        })
        .collect();
    let mut failed = Vec::new();
    for task in tasks {
        if let Err(err) = task.await.unwrap() {
            failed.push(err.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 80 failed: {failed:?}",
        failed.len()
    );
    assert_eq!(count_rows(&cluster, "orders").await, 80);
}

/// The error of a begin that waited for the write slot: SQLite's `database
/// is locked`, after the busy timeout, to retry after a short wait.
fn assert_busy_begin(result: Result<ShardTx<Customer>, ShardError>, waited: Duration) {
    let Err(err) = result else {
        panic!("the begin waits for the writer, then fails");
    };
    assert!(
        matches!(&err, ShardError::Db { operation, .. } if operation == "begin"),
        "{err:?}"
    );
    assert!(err.to_string().contains("database is locked"), "{err}");
    assert_eq!(
        err.retry(),
        Retry::After(Duration::from_millis(50)),
        "{err}"
    );
    assert!(
        (Duration::from_millis(4_500)..Duration::from_secs(8)).contains(&waited),
        "waited {waited:?}, not the busy timeout (5 s)"
    );
}

/// While a write transaction is open, another begin on the same files waits
/// the busy timeout (5 s), not the pool's acquire timeout (30 s), and fails
/// with `database is locked`, retry after 50 ms: a second begin in the same
/// task, a begin of another instance on the same files, and, on a
/// one-shard cluster whose pool of one is held, the wait for its
/// connection. Once the transaction ends, the other instance begins at once.
async fn a_begin_waits_the_busy_timeout_then_says_retry_after(dbs: &mut TestDbs) {
    let config = ClusterConfig::from_toml(&small_pools(dbs)).unwrap();
    let a = Cluster::connect(config.clone()).await.unwrap();
    a.migrate::<Migrator>().await.unwrap();
    let b = Cluster::connect(config).await.unwrap();
    let single_url = dbs.extra("single").await;
    let single = Cluster::connect(
        ClusterConfig::from_toml(&format!(
            "[pool]\nmax_connections = 1\n\n[[shards]]\nname = \"s0\"\nurl = \"{single_url}\"\n\n\
             [groups.Customer]\n"
        ))
        .unwrap(),
    )
    .await
    .unwrap();
    single.migrate::<Migrator>().await.unwrap();

    let held = a.begin::<Customer>(1).await.unwrap();
    let held_single = single.begin::<Customer>(1).await.unwrap();
    let timed = |cluster: Cluster, key: i64| async move {
        let started = Instant::now();
        let result = cluster.begin::<Customer>(key).await;
        (result, started.elapsed())
    };
    let ((same_task, t1), (other_instance, t2), (pool, t3)) = tokio::join!(
        timed(a.clone(), 2),
        timed(b.clone(), 3),
        timed(single.clone(), 2),
    );
    assert_busy_begin(same_task, t1);
    assert_busy_begin(other_instance, t2);
    let Err(err) = pool else {
        panic!("the pool's one connection is held");
    };
    assert!(
        matches!(
            &err,
            ShardError::Db {
                operation,
                source: sea_orm::DbErr::ConnectionAcquire(sea_orm::ConnAcquireErr::Timeout),
                ..
            } if operation == "begin"
        ),
        "{err:?}"
    );
    assert!(
        (Duration::from_millis(4_500)..Duration::from_secs(8)).contains(&t3),
        "the pool waited {t3:?}, not the busy timeout (5 s)"
    );

    held.rollback().await.unwrap();
    held_single.rollback().await.unwrap();
    let started = Instant::now();
    let tx = b.begin::<Customer>(3).await.unwrap();
    tx.insert(order::ActiveModel {
        id: Set(3),
        customer_id: Set(3),
        total_cents: Set(1),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(1));
}
