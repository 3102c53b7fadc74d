//! `Cluster::transaction`: commit on `Ok`, roll back on `Err`, run again when
//! the database aborted the transaction, and `ShardError::retry` read from
//! the driver's own error codes.

use sea_orm::sea_query::ExprTrait;
use sea_orm::{ConnectionTrait, IntoActiveModel, QuerySelect};
use shardkit::Retry;
use shardkit::prelude::*;
use shardkit_tests::models::*;
use shardkit_tests::{Backend, TestDbs, backend_tests, count_rows};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

backend_tests!(2 =>
    closure_commits_on_ok_and_rolls_back_on_err,
    aborted_transactions_run_again_within_the_bound,
    a_write_the_database_aborted_leaves_the_transaction_rollback_only,
    driver_errors_are_classified_by_code,
    errors_say_what_failed_where_and_the_drivers_cause_once,
    insert_many_checks_every_row_first,
    a_closure_with_its_own_error_type_commits_or_rolls_back,
    [Postgres, MySql] real_deadlocks_on_small_pools_commit_whole_or_not_at_all,
    [Postgres, MySql] a_begin_cut_off_leaves_no_transaction_behind,
);

fn order_row(id: i64, customer: i64) -> order::ActiveModel {
    order::ActiveModel {
        id: Set(id),
        customer_id: Set(customer),
        total_cents: Set(100),
    }
}

async fn closure_commits_on_ok_and_rolls_back_on_err(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();

    let total = cluster
        .transaction::<Customer, _, _>(7, |tx| async move {
            tx.insert(order_row(1, 7)).await?;
            tx.insert(order_row(2, 7)).await?;
            tx.find::<order::Entity>().count().await
        })
        .await
        .unwrap();
    assert_eq!(total, 2);
    assert_eq!(count_rows(&cluster, "orders").await, 2, "committed");

    let err = cluster
        .transaction::<Customer, (), _>(7, |tx| async move {
            tx.insert(order_row(3, 7)).await?;
            // A cross-shard write: refused, and the work fails with it.
            tx.insert(order_row(4, 8)).await?;
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::CrossShardWrite { .. }), "{err:?}");
    assert_eq!(err.retry(), Retry::Never);
    assert_eq!(count_rows(&cluster, "orders").await, 2, "row 3 rolled back");

    // A clone kept past the closure: nothing commits.
    let kept = Arc::new(std::sync::Mutex::new(None));
    let slot = Arc::clone(&kept);
    let err = cluster
        .transaction::<Customer, (), _>(7, move |tx| {
            let slot = Arc::clone(&slot);
            async move {
                tx.insert(order_row(5, 7)).await?;
                *slot.lock().unwrap() = Some(tx);
                Ok(())
            }
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::RollbackOnly { .. }), "{err:?}");
    drop(kept.lock().unwrap().take());
    assert_eq!(
        count_rows(&cluster, "orders").await,
        2,
        "row 5 not committed"
    );
}

/// Begins cut off by a timeout at different points (before `BEGIN` is
/// sent, while its answer is on the way, after it), each followed by a write
/// outside any transaction on the shard's one pooled connection: every such
/// write is committed, as another instance sees. (A begin cut off after
/// `BEGIN` was sent and before its answer was read left the connection
/// inside a transaction, which the pool handed out again: the writes after
/// it ran in that transaction and were never committed.)
async fn a_begin_cut_off_leaves_no_transaction_behind(dbs: &mut TestDbs) {
    use sea_orm::{ActiveModelTrait, PaginatorTrait};
    let toml = format!(
        "{}\n[groups.Customer]\n",
        dbs.shards_toml(1)
            .replace("max_connections = 4", "max_connections = 1")
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let rounds = 150;
    for round in 0..rounds {
        let cut = std::time::Duration::from_micros(10 * round as u64);
        if let Ok(begun) = tokio::time::timeout(cut, cluster.begin::<Customer>(1)).await {
            begun.unwrap().rollback().await.unwrap();
        }
        order_row(round, 1)
            .insert(cluster.connection("s0").unwrap())
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
    let other = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    let seen = order::Entity::find()
        .count(other.connection("s0").unwrap())
        .await
        .unwrap();
    assert_eq!(
        seen, rounds as u64,
        "writes after a cut-off begin were lost"
    );
    // 8 tasks on a pool of 2, each cutting begins off and writing (a
    // transaction's write when its begin finished in time, else one on the
    // pool): every write lands, and once the cluster is gone no connection
    // is left on the server (the finished begins' tasks included).
    drop((cluster, other));
    let before = dbs.server_connections().await;
    let busy = Cluster::connect(
        ClusterConfig::from_toml(&toml.replace("max_connections = 1", "max_connections = 2"))
            .unwrap(),
    )
    .await
    .unwrap();
    let tasks = (0..8i64).map(|task| {
        let busy = busy.clone();
        tokio::spawn(async move {
            for round in 0..25i64 {
                let id = 1000 + task * 100 + round;
                let cut = std::time::Duration::from_micros(40 * round as u64);
                match tokio::time::timeout(cut, busy.begin::<Customer>(task)).await {
                    Ok(begun) => {
                        let tx = begun.unwrap();
                        tx.insert(order_row(id, task)).await.unwrap();
                        tx.commit().await.unwrap();
                    }
                    Err(_) => {
                        order_row(id, task)
                            .insert(busy.connection("s0").unwrap())
                            .await
                            .unwrap_or_else(|e| panic!("task {task} round {round}: {e}"));
                    }
                }
            }
        })
    });
    for task in futures::future::join_all(tasks).await {
        task.unwrap();
    }
    drop(busy);
    let seen = order::Entity::find()
        .count(
            Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
                .await
                .unwrap()
                .connection("s0")
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(seen, rounds as u64 + 8 * 25, "writes lost under 8 tasks");
    dbs.assert_connections_settle(before).await;
}

/// Real deadlocks on small pools: transactions of one key update its two
/// orders in opposite orders, swallowing the second update's error (as a
/// careless program might), then replace a third order (read, delete,
/// insert). The database's deadlock victim is refused everything after
/// (on MySQL/MariaDB it would run outside the transaction the server
/// rolled back), and `Cluster::transaction` runs it again since the
/// database ended it, so what commits, commits whole: both orders and the
/// third moved by the number of committed transactions. First a pair that
/// meets after its first updates (a deadlock for sure: three attempts, two
/// commits), then 8 tasks on pools of 2.
async fn real_deadlocks_on_small_pools_commit_whole_or_not_at_all(dbs: &mut TestDbs) {
    let before = dbs.server_connections().await;
    let toml = format!(
        "{}\n[groups.Customer]\n",
        dbs.shards_toml(1)
            .replace("max_connections = 4", "max_connections = 2")
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let key = 3;
    cluster
        .transaction::<Customer, _, _>(key, |tx| async move {
            for (id, total) in [(1, 100), (2, 100), (3, 0)] {
                tx.insert(order::ActiveModel {
                    id: Set(id),
                    customer_id: Set(key),
                    total_cents: Set(total),
                })
                .await?;
            }
            Ok(())
        })
        .await
        .unwrap();

    let meet = Arc::new(tokio::sync::Barrier::new(2));
    let pair: Vec<_> = [(1, 2), (2, 1)]
        .into_iter()
        .map(|order_of| {
            let (cluster, meet) = (cluster.clone(), Arc::clone(&meet));
            tokio::spawn(async move { replace_third(&cluster, key, order_of, Some(meet)).await })
        })
        .collect();
    let mut outcomes = Vec::new();
    let mut attempts = 0;
    for task in pair {
        let (outcome, ran) = task.await.unwrap();
        outcomes.push(outcome);
        attempts += ran;
    }
    assert!(
        outcomes.iter().all(|r| r.is_ok()),
        "the deadlock's victim ran again and committed: {outcomes:?}"
    );
    assert_eq!(attempts, 3, "one of the pair was the deadlock's victim");
    // Three aborts in a row end with the last one's refusal.
    let refused = |r: &shardkit::Result<()>| matches!(r, Err(ShardError::RollbackOnly { .. }));

    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let cluster = cluster.clone();
            tokio::spawn(async move {
                let order_of = if t % 2 == 0 { (1, 2) } else { (2, 1) };
                let mut outcomes = Vec::new();
                for _ in 0..3 {
                    outcomes.push(replace_third(&cluster, key, order_of, None).await.0);
                }
                outcomes
            })
        })
        .collect();
    for task in tasks {
        outcomes.extend(task.await.unwrap());
    }
    for outcome in &outcomes {
        assert!(outcome.is_ok() || refused(outcome), "{outcome:?}");
    }
    let committed = outcomes.iter().filter(|r| r.is_ok()).count() as i64;
    let mut rows: Vec<order::Model> = cluster
        .find::<order::Entity>()
        .key(key)
        .all()
        .await
        .unwrap();
    rows.sort_by_key(|r| r.id);
    let totals: Vec<(i64, i64)> = rows.iter().map(|r| (r.id, r.total_cents)).collect();
    assert_eq!(
        totals,
        [(1, 100 + committed), (2, 100 + committed), (3, committed)],
        "{committed} of {} transactions committed",
        outcomes.len()
    );
    drop(cluster);
    dbs.assert_connections_settle(before).await;
}

/// One transaction of [`real_deadlocks_on_small_pools_commit_whole_or_not_at_all`]:
/// a cent on orders `first` and `second` (the second's error swallowed),
/// then order 3 replaced by one with a cent more; with the number of
/// attempts it took. With `meet`, its first attempt waits there after the
/// first update.
async fn replace_third(
    cluster: &Cluster,
    key: i64,
    (first, second): (i64, i64),
    meet: Option<Arc<tokio::sync::Barrier>>,
) -> (shardkit::Result<()>, u32) {
    let attempts = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&attempts);
    let outcome = cluster
        .transaction::<Customer, _, _>(key, move |tx| {
            let meet = meet
                .clone()
                .filter(|_| counted.fetch_add(1, Ordering::SeqCst) == 0);
            async move {
                let conn = tx.unchecked_connection();
                if conn.get_database_backend() == sea_orm::DbBackend::Postgres {
                    // Found within 100 ms instead of the server's 1 s.
                    conn.execute_unprepared("SET LOCAL deadlock_timeout = '100ms'")
                        .await
                        .unwrap();
                }
                add_a_cent(&tx, first).await?;
                if let Some(meet) = meet {
                    tokio::time::timeout(std::time::Duration::from_secs(10), meet.wait())
                        .await
                        .expect("the pair meets");
                }
                let _ = add_a_cent(&tx, second).await;
                let third = tx
                    .find::<order::Entity>()
                    .filter(order::Column::Id.eq(3))
                    .one()
                    .await?
                    .expect("order 3");
                tx.delete(third.clone().into_active_model()).await?;
                tx.insert(order::ActiveModel {
                    total_cents: Set(third.total_cents + 1),
                    ..third.into_active_model()
                })
                .await?;
                Ok(())
            }
        })
        .await;
    (outcome, attempts.load(Ordering::SeqCst))
}

async fn add_a_cent(tx: &ShardTx<Customer>, id: i64) -> shardkit::Result<u64> {
    tx.update_many::<order::Entity>()
        .col_expr(
            order::Column::TotalCents,
            sea_orm::sea_query::Expr::col(order::Column::TotalCents).add(1),
        )
        .filter(order::Column::Id.eq(id))
        .exec()
        .await
}

/// Makes the database abort the transaction the way a deadlock does
/// ([`deadlock_sql`]; a plain failure on SQLite).
async fn abort_like_a_deadlock(tx: &ShardTx<Customer>) -> shardkit::Result<()> {
    let conn = tx.unchecked_connection();
    conn.execute_unprepared(deadlock_sql(conn.get_database_backend()))
        .await
        .map_err(|source| ShardError::Db {
            origin: Box::new(shardkit::Origin::Group("Customer")),
            shard: tx.shard().to_owned(),
            operation: "deadlock".to_owned(),
            source,
        })?;
    Ok(())
}

/// A write whose statement (here its `before_save` / `before_delete` hook's),
/// or a read, the database aborted leaves the transaction rollback-only: on
/// MySQL/MariaDB what it sent next would run outside the transaction, which
/// the server has rolled back already.
async fn a_write_the_database_aborted_leaves_the_transaction_rollback_only(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    for op in ["insert", "delete"] {
        let tx = cluster.begin::<Customer>(11).await.unwrap();
        tx.insert(order_row(1, 11)).await.unwrap();
        let aborting = mover::ActiveModel {
            id: Set(1),
            customer_id: Set(11),
            note: Set("abort".into()),
        };
        let err = match op {
            "insert" => tx.insert(aborting).await.map(drop),
            _ => tx.delete(aborting).await.map(drop),
        }
        .unwrap_err();
        if dbs.backend == Backend::Sqlite {
            assert_eq!(err.retry(), Retry::Never, "{op}: {err}");
            assert!(!tx.is_rollback_only(), "{op}: a plain failure");
        } else {
            assert_eq!(err.retry(), Retry::Transaction, "{op}: {err}");
            assert!(tx.is_rollback_only(), "{op}");
            let later = tx.insert(order_row(2, 11)).await.unwrap_err();
            assert!(
                matches!(later, ShardError::RollbackOnly { .. }),
                "{op}: {later:?}"
            );
            let commit = tx.commit().await.unwrap_err();
            assert!(
                matches!(commit, ShardError::RollbackOnly { .. }),
                "{op}: {commit:?}"
            );
            continue;
        }
        drop(tx);
    }
    if dbs.backend != Backend::Sqlite {
        // A read the database aborts does the same.
        for shard in ["s0", "s1"] {
            create_aborting_function(cluster.connection(shard).unwrap()).await;
        }
        let tx = cluster.begin::<Customer>(11).await.unwrap();
        tx.insert(order_row(1, 11)).await.unwrap();
        let err = tx
            .find::<order::Entity>()
            .filter(sea_orm::sea_query::Expr::cust("aborts() = 1"))
            .all()
            .await
            .unwrap_err();
        assert_eq!(err.retry(), Retry::Transaction, "read: {err}");
        assert!(tx.is_rollback_only(), "read");
        let later = tx.insert(order_row(2, 11)).await.unwrap_err();
        assert!(
            matches!(later, ShardError::RollbackOnly { .. }),
            "read: {later:?}"
        );
        // Reads too: they would run outside the ended transaction.
        let read = tx.find::<order::Entity>().all().await.unwrap_err();
        assert!(
            matches!(read, ShardError::RollbackOnly { .. }),
            "read: {read:?}"
        );
        drop(tx);
    }
    assert_eq!(count_rows(&cluster, "orders").await, 0, "nothing committed");

    if dbs.backend == Backend::MySql {
        // MySQL/MariaDB's lock wait timeout (1205, which a refused `NOWAIT`
        // lock says too) is retried as a transaction but ends only the
        // statement: the transaction goes on.
        cluster
            .transaction::<Customer, _, _>(12, |tx| async move {
                tx.insert(order_row(3, 12)).await.map(drop)
            })
            .await
            .unwrap();
        let holder = cluster.begin::<Customer>(12).await.unwrap();
        let held = holder
            .find::<order::Entity>()
            .lock_exclusive()
            .all()
            .await
            .unwrap();
        assert_eq!(held.len(), 1);
        let waiter = cluster.begin::<Customer>(12).await.unwrap();
        let err = waiter
            .find::<order::Entity>()
            .lock_with_behavior(
                sea_orm::sea_query::LockType::Update,
                sea_orm::sea_query::LockBehavior::Nowait,
            )
            .all()
            .await
            .unwrap_err();
        assert_eq!(err.retry(), Retry::Transaction, "{err}");
        assert!(!waiter.is_rollback_only(), "{err}");
        assert_eq!(waiter.find::<order::Entity>().count().await.unwrap(), 1);
        // (The holder's lock covers the key's range: it goes first.)
        drop(holder);
        waiter.insert(order_row(4, 12)).await.unwrap();
        waiter.commit().await.unwrap();
        assert_eq!(count_rows(&cluster, "orders").await, 2);
    }
}

async fn aborted_transactions_run_again_within_the_bound(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let retried = dbs.backend != Backend::Sqlite;

    // Aborted once, then succeeds: the first attempt's row is gone, the
    // second's committed.
    let attempts = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&attempts);
    let result = cluster
        .transaction::<Customer, _, _>(9, move |tx| {
            let seen = Arc::clone(&seen);
            async move {
                let attempt = seen.fetch_add(1, Ordering::SeqCst) + 1;
                tx.insert(order_row(i64::from(attempt), 9)).await?;
                if attempt == 1 {
                    abort_like_a_deadlock(&tx).await?;
                }
                Ok(attempt)
            }
        })
        .await;
    if retried {
        assert_eq!(result.unwrap(), 2);
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        assert_eq!(count_rows(&cluster, "orders").await, 1);
    } else {
        let err = result.unwrap_err();
        assert_eq!(err.retry(), Retry::Never, "{err}");
        assert_eq!(attempts.load(Ordering::SeqCst), 1, "not retried");
        assert_eq!(count_rows(&cluster, "orders").await, 0);
    }

    // Aborted once by a read whose error the work handles itself, then
    // `Ok`: the first attempt commits nothing and the work runs again.
    if retried {
        for shard in ["s0", "s1"] {
            create_aborting_function(cluster.connection(shard).unwrap()).await;
        }
        let attempts = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&attempts);
        let result = cluster
            .transaction::<Customer, _, _>(13, move |tx| {
                let attempt = seen.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    tx.insert(order_row(200 + i64::from(attempt), 13)).await?;
                    if attempt == 1 {
                        let swallowed = tx
                            .find::<order::Entity>()
                            .filter(sea_orm::sea_query::Expr::cust("aborts() = 1"))
                            .all()
                            .await;
                        assert!(swallowed.is_err(), "{swallowed:?}");
                    }
                    Ok(attempt)
                }
            })
            .await;
        assert_eq!(result.unwrap(), 2);
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        let rows = cluster.find::<order::Entity>().key(13).all().await.unwrap();
        assert_eq!(
            rows.iter().map(|r| r.id).collect::<Vec<_>>(),
            [202],
            "the second attempt's row alone"
        );
    }

    // Aborted while the work kept a clone of its transaction: not run again
    // (the clone may hold the transaction and its locks open); the error
    // says to run it again.
    if retried {
        let attempts = Arc::new(AtomicU32::new(0));
        let (seen, kept) = (Arc::clone(&attempts), Arc::new(Mutex::new(Vec::new())));
        let slot = Arc::clone(&kept);
        let err = cluster
            .transaction::<Customer, (), _>(14, move |tx| {
                seen.fetch_add(1, Ordering::SeqCst);
                slot.lock().unwrap().push(Arc::clone(&tx));
                async move { abort_like_a_deadlock(&tx).await }
            })
            .await
            .unwrap_err();
        assert_eq!(attempts.load(Ordering::SeqCst), 1, "{err}");
        assert_eq!(err.retry(), Retry::Transaction, "{err}");
        kept.lock().unwrap().clear();
    }

    // Always aborted: three attempts, then the error, nothing written.
    let attempts = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&attempts);
    let err = cluster
        .transaction::<Customer, (), _>(10, move |tx| {
            let seen = Arc::clone(&seen);
            async move {
                let attempt = seen.fetch_add(1, Ordering::SeqCst) + 1;
                tx.insert(order_row(100 + i64::from(attempt), 10)).await?;
                abort_like_a_deadlock(&tx).await
            }
        })
        .await
        .unwrap_err();
    assert_eq!(attempts.load(Ordering::SeqCst), if retried { 3 } else { 1 });
    if retried {
        assert_eq!(err.retry(), Retry::Transaction, "{err}");
    }
    assert_eq!(
        count_rows(&cluster, "orders").await,
        2 * u64::from(retried),
        "no row of key 10"
    );
}

async fn driver_errors_are_classified_by_code(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let tx = cluster.begin::<Customer>(5).await.unwrap();
    tx.insert(order_row(1, 5)).await.unwrap();
    // The same primary key again: a unique violation, never retried.
    let err = tx.insert(order_row(1, 5)).await.unwrap_err();
    assert!(matches!(err, ShardError::Db { .. }), "{err:?}");
    assert_eq!(err.retry(), Retry::Never, "{err}");
    drop(tx);

    if dbs.backend != Backend::Sqlite {
        let tx = cluster.begin::<Customer>(5).await.unwrap();
        let err = abort_like_a_deadlock(&tx).await.unwrap_err();
        assert_eq!(err.retry(), Retry::Transaction, "{err}");
    }

    // A closed port: the connection error is transient.
    let down = format!(
        "[[shards]]\nname = \"s0\"\nurl = \"{}\"\n[pool]\nconnect_lazy = true\n\
         acquire_timeout_secs = 1\n[groups.Customer]\n",
        match dbs.backend {
            Backend::MySql => "mysql://root@127.0.0.1:9/down",
            _ => "postgres://postgres@127.0.0.1:9/down",
        }
    );
    let lazy = Cluster::connect(ClusterConfig::from_toml(&down).unwrap())
        .await
        .unwrap();
    // The shard is marked down: retrying at once would fail at once, so
    // the error says to wait for the breaker's next probe.
    let err = lazy.begin::<Customer>(5).await.unwrap_err();
    assert!(matches!(err, ShardError::Unavailable { .. }), "{err:?}");
    assert!(matches!(err.retry(), Retry::After(_)), "{err}");
}

/// A database error's message says what failed, on which shard, and the
/// driver's own message with its code, once; `report()` adds nothing to it.
/// Checked word for word on a unique violation, a deadlock (SQLite: a busy
/// database) and a refused connection, each raised by the real database.
async fn errors_say_what_failed_where_and_the_drivers_cause_once(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let tx = cluster.begin::<Customer>(5).await.unwrap();
    let shard = tx.shard().to_owned();
    tx.insert(order_row(1, 5)).await.unwrap();
    tx.insert(order_row(2, 5)).await.unwrap();
    tx.commit().await.unwrap();
    let once = |err: &ShardError, cause: &str| {
        assert!(matches!(err, ShardError::Db { .. }), "{err:?}");
        assert_eq!(err.to_string(), cause);
        assert_eq!(err.report().to_string(), err.to_string());
    };

    // A unique violation.
    let tx = cluster.begin::<Customer>(5).await.unwrap();
    let err = tx.insert(order_row(1, 5)).await.unwrap_err();
    drop(tx);
    let driver = match dbs.backend {
        Backend::Sqlite => "(code: 1555) UNIQUE constraint failed: orders.id",
        Backend::Postgres => {
            "duplicate key value violates unique constraint \"orders_pkey\" (SQLSTATE 23505)"
        }
        Backend::MySql => "1062 (23000): Duplicate entry '1' for key 'PRIMARY'",
    };
    once(
        &err,
        &format!("insert orders on `{shard}` (group `Customer`) failed: {driver}"),
    );

    // A deadlock: A holds order 1 and waits for order 2, which B holds;
    // then B asks for order 1. B is the victim: on PostgreSQL it checks for
    // deadlocks first (its `deadlock_timeout` is the shorter), on
    // MySQL/MariaDB it has changed fewer rows. SQLite has one writer at a
    // time, so a second writer finds the database busy instead.
    if dbs.backend == Backend::Sqlite {
        let a = cluster.begin::<Customer>(5).await.unwrap();
        a.insert(order_row(3, 5)).await.unwrap();
        let other = sea_orm::TransactionTrait::begin(cluster.connection(&shard).unwrap())
            .await
            .unwrap();
        other
            .execute_unprepared("PRAGMA busy_timeout = 0")
            .await
            .unwrap();
        let source = other
            .execute_unprepared("UPDATE orders SET total_cents = 7 WHERE id = 1")
            .await
            .unwrap_err();
        other
            .execute_unprepared("PRAGMA busy_timeout = 5000")
            .await
            .unwrap();
        drop(other);
        drop(a);
        let err = ShardError::Db {
            origin: Box::new(shardkit::Origin::Group("Customer")),
            shard: shard.clone(),
            operation: "update orders".to_owned(),
            source,
        };
        // Retrying at once would meet the same writer.
        assert_eq!(
            err.retry(),
            Retry::After(std::time::Duration::from_millis(50)),
            "{err}"
        );
        once(
            &err,
            &format!(
                "update orders on `{shard}` (group `Customer`) failed: (code: 5) database is locked"
            ),
        );
    } else {
        let a = cluster.begin::<Customer>(5).await.unwrap();
        let b = cluster.begin::<Customer>(5).await.unwrap();
        let pg = dbs.backend == Backend::Postgres;
        let (whoami, waiting) = if pg {
            (
                "SELECT pg_backend_pid()::bigint AS id",
                "SELECT COUNT(*)::bigint AS n FROM pg_stat_activity WHERE pid = $1 \
                 AND wait_event_type = 'Lock'",
            )
        } else {
            (
                "SELECT CAST(CONNECTION_ID() AS SIGNED) AS id",
                "SELECT COUNT(*) AS n FROM information_schema.innodb_trx \
                 WHERE trx_mysql_thread_id = ? AND trx_state = 'LOCK WAIT'",
            )
        };
        if pg {
            for (tx, after) in [(&a, "10s"), (&b, "10ms")] {
                tx.unchecked_connection()
                    .execute_unprepared(&format!("SET LOCAL deadlock_timeout = '{after}'"))
                    .await
                    .unwrap();
            }
        }
        let backend = a.unchecked_connection().get_database_backend();
        let a_id: i64 = a
            .unchecked_connection()
            .query_one_raw(sea_orm::Statement::from_string(backend, whoami))
            .await
            .unwrap()
            .unwrap()
            .try_get("", "id")
            .unwrap();
        let set_total = |id: i64, cents: i64| order::ActiveModel {
            id: Set(id),
            customer_id: Set(5),
            total_cents: Set(cents),
        };
        a.update(set_total(1, 10)).await.unwrap();
        for id in 10..14 {
            a.insert(order_row(id, 5)).await.unwrap();
        }
        b.update(set_total(2, 20)).await.unwrap();
        let watcher = cluster.connection(&shard).unwrap();
        let (a_result, b_result) = tokio::join!(a.update(set_total(2, 11)), async {
            // B asks only once A waits for it.
            loop {
                let row = watcher
                    .query_one_raw(sea_orm::Statement::from_sql_and_values(
                        backend,
                        waiting,
                        [a_id.into()],
                    ))
                    .await
                    .unwrap()
                    .unwrap();
                if row.try_get::<i64>("", "n").unwrap() > 0 {
                    break;
                }
                // InnoDB refreshes `information_schema.innodb_trx` only
                // once it has not been read for 100 ms: a watcher reading
                // it back to back would never see A wait.
                tokio::time::sleep(std::time::Duration::from_millis(150)).await;
            }
            let result = b.update(set_total(1, 21)).await;
            drop(b);
            result
        });
        a_result.unwrap();
        drop(a);
        let err = b_result.unwrap_err();
        assert_eq!(err.retry(), Retry::Transaction, "{err}");
        let driver = if pg {
            "deadlock detected (SQLSTATE 40P01)"
        } else {
            "1213 (40001): Deadlock found when trying to get lock; try restarting transaction"
        };
        once(
            &err,
            &format!("update orders on `{shard}` (group `Customer`) failed: {driver}"),
        );
    }

    // A connection refused (SQLite: a file that cannot be opened): the URL
    // with its password hidden, and the driver's cause.
    let (url, redacted, cause) = match dbs.backend {
        Backend::Sqlite => (
            "sqlite:///nonexistent/shardkit/s0.db?mode=rwc",
            "sqlite:///nonexistent/shardkit/s0.db?mode=rwc",
            "(code: 14) unable to open database file",
        ),
        Backend::Postgres => (
            "postgres://postgres:hunter2@127.0.0.1:9/down",
            "postgres://postgres:***@127.0.0.1:9/down",
            "error communicating with database: Connection refused (os error 111)",
        ),
        Backend::MySql => (
            "mysql://root:hunter2@127.0.0.1:9/down",
            "mysql://root:***@127.0.0.1:9/down",
            "error communicating with database: Connection refused (os error 111)",
        ),
    };
    let toml = format!("[[shards]]\nname = \"s0\"\nurl = \"{url}\"\n[groups.Customer]\n");
    let err = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::Connect { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!("cannot connect to shard `s0` at {redacted}: {cause}")
    );
    assert_eq!(err.report().to_string(), err.to_string());
}

/// `insert_many` refuses a batch with one row of another key before any
/// row is written, and otherwise writes every row on the key's shard
/// through the pipeline (index rows included).
async fn insert_many_checks_every_row_first(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    cluster
        .gsi()
        .backfill::<contact::Entity>(contact::Column::Email)
        .await
        .unwrap();
    let contact_row = |id: i64, customer: i64| contact::ActiveModel {
        id: Set(id),
        customer_id: Set(customer),
        email: Set(format!("c{id}@example.com")),
        phone: Set(format!("555-{id}")),
    };

    // One row of customer 8 in a batch for customer 7: nothing is written.
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    let err = tx
        .insert_many([contact_row(1, 7), contact_row(2, 8), contact_row(3, 7)])
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::CrossShardWrite { .. }), "{err:?}");
    assert!(tx.is_rollback_only());
    assert!(matches!(
        tx.commit().await.unwrap_err(),
        ShardError::RollbackOnly { .. }
    ));
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        assert!(contact::Entity::find().all(db).await.unwrap().is_empty());
    }

    // A batch of the key's rows: all on its shard, each found by its index.
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    let rows = tx
        .insert_many((1..=5).map(|id| contact_row(id, 7)))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        rows.iter().map(|r| r.id).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5]
    );
    let home = cluster.shard_of::<Customer>(&7).await.unwrap().to_owned();
    for shard in cluster.topology().shard_names() {
        let db = cluster.connection(shard).unwrap();
        let stored = contact::Entity::find().all(db).await.unwrap().len();
        assert_eq!(stored, if shard == home { 5 } else { 0 }, "{shard}");
    }
    for id in 1..=5 {
        let found = cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, format!("c{id}@example.com"))
            .all()
            .await
            .unwrap();
        assert_eq!(found.len(), 1, "c{id}");
    }
}

/// An application's error, which wraps shardkit's.
#[derive(Debug)]
enum AppError {
    Shard(ShardError),
    Refused(&'static str),
}

impl From<ShardError> for AppError {
    fn from(e: ShardError) -> Self {
        AppError::Shard(e)
    }
}

/// `try_transaction`: the work's own error type, `?` on shardkit's calls
/// through `From`; committed on `Ok`, rolled back on the work's error
/// (returned as `Transaction`), and a refused write inside is the work's
/// error too, with nothing committed.
async fn a_closure_with_its_own_error_type_commits_or_rolls_back(dbs: &mut TestDbs) {
    let cluster = dbs.cluster(2, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    let row = cluster
        .try_transaction::<Customer, _, AppError, _>(7, |tx| async move {
            Ok(tx.insert(order_row(1, 7)).await?)
        })
        .await
        .unwrap();
    assert_eq!(row.id, 1);
    let refused = cluster
        .try_transaction::<Customer, (), AppError, _>(7, |tx| async move {
            tx.insert(order_row(2, 7)).await?;
            Err(AppError::Refused("out of stock"))
        })
        .await;
    assert!(
        matches!(
            refused,
            Err(shardkit::TransactionError::Transaction(AppError::Refused(
                "out of stock"
            )))
        ),
        "{refused:?}"
    );
    let cross = cluster
        .try_transaction::<Customer, (), AppError, _>(7, |tx| async move {
            tx.insert(order_row(3, 7)).await?;
            tx.insert(order_row(4, 8)).await?;
            Ok(())
        })
        .await;
    assert!(
        matches!(
            cross,
            Err(shardkit::TransactionError::Transaction(AppError::Shard(
                ShardError::CrossShardWrite { .. }
            )))
        ),
        "{cross:?}"
    );
    let ids: Vec<i64> = cluster
        .find::<order::Entity>()
        .key(7)
        .all()
        .await
        .unwrap()
        .iter()
        .map(|o| o.id)
        .collect();
    assert_eq!(ids, [1], "only the committed work's row");
}
