//! Transactions the database aborted (a deadlock): handlers, saga steps
//! and requests that swallow the error, or lose a real deadlock, run again.

use super::*;

/// Reads wallet `id` through `aborts()`, which makes the database abort the
/// transaction the way a deadlock does, and swallows the error, as a
/// handler or a step that handles a deadlock itself might.
pub(crate) async fn swallow_an_abort(tx: &shardkit::ShardTx<Holder>) {
    let aborted = tx
        .find::<wallet::Entity>()
        .filter(sea_orm::sea_query::Expr::cust("aborts() = 1"))
        .all()
        .await;
    assert!(aborted.is_err(), "{aborted:?}");
}

/// Wallets 1 and 2 with `balance`, and `aborts()` on wallet 2's shard
/// (see [`swallow_an_abort`]).
pub(crate) async fn wallets_and_aborts(cluster: &Cluster, balance: i64) {
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(cluster, id, balance).await;
    }
    let shard = cluster.shard_of::<Holder>(&2).await.unwrap().to_owned();
    shardkit_tests::models::create_aborting_function(cluster.connection(&shard).unwrap()).await;
}

/// A handler that handles its transaction's abort by the database (a
/// deadlock) itself and returns `Ok`: nothing of that run commits, and the
/// message is delivered again at once, not counted as a failed attempt
/// (with one attempt allowed, counting it would park the message).
pub(crate) async fn a_handler_that_swallows_an_abort_runs_again(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[])).await;
    wallets_and_aborts(&cluster, 0).await;
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&ran);
    let outbox =
        cluster
            .outbox()
            .max_attempts(1)
            .handle::<Credit, _, _, _>(move |tx, c: Credit| {
                let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    apply_credit(&tx, c).await?;
                    match run {
                        1 => swallow_an_abort(&tx).await,
                        3 => {
                            let conn = tx.unchecked_connection();
                            let backend = conn.get_database_backend();
                            conn.execute_unprepared(shardkit_tests::models::deadlock_sql(backend))
                                .await?;
                        }
                        _ => {}
                    }
                    Ok::<_, shardkit::BoxError>(())
                }
            });
    send_credit(&cluster, 1, 2, 1, 5).await;
    let report = outbox.deliver().await.unwrap();
    assert_eq!(
        (report.applied, report.parked, ran.load(Ordering::SeqCst)),
        (1, 0, 2),
        "{report:?}"
    );
    assert_eq!(balance(&cluster, 2).await, 5, "credited once");
    assert_eq!(shardkit_tests::count_rows(&cluster, "credits").await, 1);
    // A handler that returns the abort of a statement it sent itself
    // (SeaORM's `DbErr`): put off, not counted.
    send_credit(&cluster, 1, 2, 2, 7).await;
    let report = outbox.deliver().await.unwrap();
    assert_eq!(
        (report.applied, report.parked, report.deferred),
        (0, 0, 1),
        "{report:?}"
    );
    assert_eq!(balance(&cluster, 2).await, 5, "nothing credited");
    assert!(all_parked(&outbox).await.is_empty());
}

/// A saga step that handles its transaction's abort by the database itself
/// and returns `Ok`: the saga is not compensated for a transient conflict;
/// the step is put off, and the next drive after its wait runs it again.
pub(crate) async fn a_saga_step_that_swallows_an_abort_is_tried_again(dbs: &mut TestDbs) {
    let clock = Arc::new(shardkit::clock::ManualClock::new(
        shardkit::Clock::now_millis(&shardkit::clock::SystemClock),
    ));
    let cluster = Cluster::builder(ClusterConfig::from_toml(&toml(dbs, &[])).unwrap())
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
    cluster.refresh_bucket_maps().await.unwrap();
    wallets_and_aborts(&cluster, 100).await;
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&ran);
    let saga = buyer_pays("aborted").step::<Holder, _, _, _, _, _, _, _>(
        |o: &Order| o.seller,
        move |tx, o: Order| {
            let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                match run {
                    1 => {
                        add(&tx, o.amount).await?;
                        swallow_an_abort(&tx).await;
                    }
                    // The refusal of its next write returned.
                    3 => {
                        swallow_an_abort(&tx).await;
                        add(&tx, o.amount).await?;
                    }
                    _ => add(&tx, o.amount).await?,
                }
                Ok::<_, shardkit::BoxError>(())
            }
        },
        |tx, o: Order| async move { add(&tx, -o.amount).await },
    );
    let sagas = cluster.sagas(saga);
    let order = Order {
        buyer: 1,
        seller: 2,
        amount: 5,
    };
    let (id, state) = sagas.start(1, &order).await.unwrap();
    assert_eq!(state, SagaState::Running, "put off, not compensated");
    assert_eq!(
        (balance(&cluster, 1).await, balance(&cluster, 2).await),
        (95, 100)
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(sagas.drive(1, &id).await.unwrap(), SagaState::Done);
    assert_eq!(
        (balance(&cluster, 1).await, balance(&cluster, 2).await),
        (95, 105)
    );
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    // The same, the step returning the refusal of its write after the abort.
    let (id, state) = sagas.start(1, &order).await.unwrap();
    assert_eq!(state, SagaState::Running, "put off, not compensated");
    clock.advance(Duration::from_secs(1));
    assert_eq!(sagas.drive(1, &id).await.unwrap(), SagaState::Done);
    assert_eq!(
        (balance(&cluster, 1).await, balance(&cluster, 2).await),
        (90, 110)
    );
    assert_eq!(ran.load(Ordering::SeqCst), 4);
}

/// Adds `by` to the amount of credit row `id` of the transaction's key.
pub(crate) async fn bump(
    tx: &shardkit::ShardTx<Holder>,
    id: &str,
    by: i64,
) -> shardkit::Result<u64> {
    use sea_orm::ColumnTrait;
    tx.update_many::<credit::Entity>()
        .col_expr(
            credit::Column::Amount,
            sea_orm::sea_query::ExprTrait::add(
                sea_orm::sea_query::Expr::col(credit::Column::Amount),
                by,
            ),
        )
        .filter(credit::Column::Id.eq(id))
        .exec()
        .await
}

/// Gives a PostgreSQL transaction its own `deadlock_timeout`: of two
/// transactions in a deadlock, the one with the shorter is the victim.
pub(crate) async fn deadlock_timeout(tx: &shardkit::ShardTx<Holder>, ms: u32) {
    let conn = tx.unchecked_connection();
    if conn.get_database_backend() == sea_orm::DbBackend::Postgres {
        conn.execute_unprepared(&format!("SET LOCAL deadlock_timeout = {ms}"))
            .await
            .expect("SET LOCAL deadlock_timeout");
    }
}

/// Wallets 1 and 2, and two counters of wallet 2 (credit rows `a` and
/// `b`, amount 0) for [`lose_a_deadlock`] and [`heavier_writer`].
pub(crate) async fn two_counters(cluster: &Cluster) {
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(cluster, id, 0).await;
    }
    cluster
        .transaction::<Holder, _, _>(2, |tx| async move {
            for id in ["a", "b"] {
                tx.insert(credit::ActiveModel {
                    id: Set(id.to_owned()),
                    wallet_id: Set(2),
                    transfer: Set("counter".to_owned()),
                    amount: Set(0),
                    seq: Set(0),
                })
                .await?;
            }
            Ok(())
        })
        .await
        .unwrap();
}

/// The counters' amounts.
pub(crate) async fn counters(cluster: &Cluster) -> BTreeMap<String, i64> {
    cluster
        .find::<credit::Entity>()
        .key(2)
        .filter(<credit::Column as sea_orm::ColumnTrait>::eq(
            &credit::Column::Transfer,
            "counter",
        ))
        .all()
        .await
        .unwrap()
        .into_iter()
        .map(|c| (c.id, c.amount))
        .collect()
}

/// Adds `by` to counter `a`, then (its first run meeting
/// [`heavier_writer`] first) to counter `b`, swallowing that update's
/// error as careless code might: it is the deadlock's victim
/// (PostgreSQL: its `deadlock_timeout` is the shorter; MariaDB, which
/// rolls the victim back at once: it has written fewer rows, and InnoDB
/// rolls back the lighter transaction).
pub(crate) async fn lose_a_deadlock(
    tx: &shardkit::ShardTx<Holder>,
    run: usize,
    meet: &tokio::sync::Barrier,
    by: i64,
) -> shardkit::Result<()> {
    deadlock_timeout(tx, 100).await;
    bump(tx, "a", by).await?;
    if run == 1 {
        meet.wait().await;
    }
    let _swallowed = bump(tx, "b", by).await;
    Ok(())
}

/// A transaction of wallet 2 that writes 8 rows, adds 10 to counter `b`,
/// (its first run meeting [`lose_a_deadlock`]) then to counter `a`; with
/// its runs.
pub(crate) fn heavier_writer(
    cluster: &Cluster,
    meet: Arc<tokio::sync::Barrier>,
) -> (
    tokio::task::JoinHandle<shardkit::Result<()>>,
    Arc<AtomicUsize>,
) {
    let runs = Arc::new(AtomicUsize::new(0));
    let (cluster, ran) = (cluster.clone(), Arc::clone(&runs));
    let task = tokio::spawn(async move {
        cluster
            .transaction::<Holder, _, _>(2, move |tx| {
                let run = ran.fetch_add(1, Ordering::SeqCst) + 1;
                let meet = Arc::clone(&meet);
                async move {
                    deadlock_timeout(&tx, 10_000).await;
                    for i in 0..8 {
                        tx.insert(credit::ActiveModel {
                            id: Set(format!("w{run}-{i}")),
                            wallet_id: Set(2),
                            transfer: Set("weight".to_owned()),
                            amount: Set(0),
                            seq: Set(0),
                        })
                        .await?;
                    }
                    bump(&tx, "b", 10).await?;
                    if run == 1 {
                        meet.wait().await;
                    }
                    bump(&tx, "a", 10).await?;
                    Ok(())
                }
            })
            .await
    });
    (task, runs)
}

/// A real deadlock between a handler and another transaction of the
/// receiving key, each updating two rows in the opposite order; the
/// handler is the victim and swallows the error ([`lose_a_deadlock`]). The
/// relay runs the delivery again, not counted (one attempt allowed), and
/// each row moves once per committed transaction: nothing of the victim's
/// attempt, its inbox row included, is taken for applied.
pub(crate) async fn a_handler_that_loses_a_real_deadlock_runs_again(dbs: &mut TestDbs) {
    let before = dbs.server_connections().await;
    let cluster = connect(&toml(dbs, &[])).await;
    two_counters(&cluster).await;
    let meet = Arc::new(tokio::sync::Barrier::new(2));
    let handled = Arc::new(AtomicUsize::new(0));
    let (counted, met) = (Arc::clone(&handled), Arc::clone(&meet));
    let outbox =
        cluster
            .outbox()
            .max_attempts(1)
            .handle::<Credit, _, _, _>(move |tx, c: Credit| {
                let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
                let meet = Arc::clone(&met);
                async move {
                    Ok::<_, shardkit::BoxError>(lose_a_deadlock(&tx, run, &meet, c.amount).await?)
                }
            });
    send_credit(&cluster, 1, 2, 1, 1).await;
    let (writer, other) = heavier_writer(&cluster, meet);
    let report = outbox.deliver().await.unwrap();
    writer.await.unwrap().unwrap();
    assert_eq!(
        (
            report.applied,
            report.parked,
            handled.load(Ordering::SeqCst),
            other.load(Ordering::SeqCst)
        ),
        (1, 0, 2, 1),
        "{report:?}: the handler was the victim and ran again"
    );
    assert_eq!(
        counters(&cluster).await,
        BTreeMap::from([("a".to_owned(), 11), ("b".to_owned(), 11)])
    );
    assert!(all_parked(&outbox).await.is_empty());
    drop((outbox, cluster));
    dbs.assert_connections_settle(before).await;
}

/// The same deadlock, lost by the work of `transaction_once`: on MariaDB
/// the victim's claim of the request id is rolled back with it, so its
/// outcome must not be stored (the store would run outside the transaction
/// and find no claim, or another run's). The work runs again, its second
/// outcome is stored once, and a retry of the request gets it.
pub(crate) async fn a_request_that_loses_a_real_deadlock_runs_again(dbs: &mut TestDbs) {
    let before = dbs.server_connections().await;
    let cluster = connect(&toml(dbs, &[])).await;
    two_counters(&cluster).await;
    let meet = Arc::new(tokio::sync::Barrier::new(2));
    let (writer, other) = heavier_writer(&cluster, Arc::clone(&meet));
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&ran);
    let outcome = cluster
        .transaction_once::<Holder, usize, _>(2, "req-deadlock", move |tx| {
            let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
            let meet = Arc::clone(&meet);
            async move {
                lose_a_deadlock(&tx, run, &meet, 1).await?;
                Ok(run)
            }
        })
        .await
        .unwrap();
    writer.await.unwrap().unwrap();
    assert_eq!(
        (
            outcome,
            ran.load(Ordering::SeqCst),
            other.load(Ordering::SeqCst)
        ),
        (2, 2, 1),
        "the work was the victim and ran again"
    );
    assert_eq!(
        counters(&cluster).await,
        BTreeMap::from([("a".to_owned(), 11), ("b".to_owned(), 11)])
    );
    let again = cluster
        .transaction_once::<Holder, usize, _>(2, "req-deadlock", |_| async { Ok(99) })
        .await
        .unwrap();
    assert_eq!(again, 2, "the second run's stored outcome");
    drop(cluster);
    dbs.assert_connections_settle(before).await;
}
