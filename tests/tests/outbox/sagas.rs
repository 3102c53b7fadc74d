//! Sagas: a refused step compensated once, a step that panics.

use super::*;

pub(crate) fn order_saga() -> Saga<Holder, Order> {
    buyer_pays("order").step::<Holder, _, _, _, _, _, _, _>(
        |o: &Order| o.seller,
        |tx, o: Order| async move {
            // A seller holds at most 150.
            let w = tx
                .find::<wallet::Entity>()
                .lock_exclusive()
                .one()
                .await?
                .ok_or("no wallet")?;
            if w.balance + o.amount > 150 {
                return Err(Refused("the seller's limit").into());
            }
            add(&tx, o.amount).await
        },
        |tx, o: Order| async move { add(&tx, -o.amount).await },
    )
}

/// The second step is refused (the seller cannot pay): the first is
/// undone once, also when the process dies after the compensation
/// committed and before the saga saved it.
pub(crate) async fn a_saga_whose_step_is_refused_is_compensated_once(dbs: &mut TestDbs) {
    let _fp = FAILPOINTS.lock().await;
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 100).await;
    }
    let sagas = cluster.sagas(order_saga());
    // Both steps commit.
    let ok = Order {
        buyer: 1,
        seller: 2,
        amount: 30,
    };
    let (_, state) = sagas.start(1, &ok).await.unwrap();
    assert_eq!(state, SagaState::Done);
    assert_eq!(
        (balance(&cluster, 1).await, balance(&cluster, 2).await),
        (70, 130)
    );

    // The seller's step is refused (130 + 50 > 150); the process "dies"
    // after the buyer's debit was undone and before the saga saved it
    // (the save of step 0, after step 1 done, step 2 refused, step 2's undo
    // fenced it, step 1 undone).
    fail::cfg(
        "shardkit::saga::before_save",
        &format!("return({}@0)", dbs.scope()),
    )
    .unwrap();
    let stopped = sagas
        .start(
            1,
            &Order {
                buyer: 1,
                seller: 2,
                amount: 50,
            },
        )
        .await;
    fail::remove("shardkit::saga::before_save");
    // Saved before it was driven: `start` reports where it stopped, not an
    // error a caller could take for "not started".
    let Ok((_, SagaState::Compensating)) = stopped else {
        panic!(
            "the failpoint stops the saga while compensating: {stopped:?} {:?}",
            cluster.saga_status(true).await
        );
    };
    assert_eq!(
        balance(&cluster, 1).await,
        70,
        "the debit is undone already"
    );
    let open = cluster.saga_status(false).await.unwrap();
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!((open[0].state, open[0].step), (SagaState::Compensating, 1));
    // Resumed by an instance to which s4, which holds no part of the saga,
    // refuses (its proxy killed after connecting; for SQLite, a database
    // without the tables): the other shards' sagas are driven, s4 is
    // counted, and the buyer's debit is not undone a second time.
    let proxy = match dbs.backend {
        Backend::Sqlite => None,
        _ => Some(Proxy::start(dbs.backend.server_address().unwrap()).await),
    };
    let other_toml = match &proxy {
        Some(proxy) => toml(dbs, &[(4, proxy.port)]),
        None => {
            let shards = dbs
                .shards_toml_with(5, "", &[4])
                .replace("max_connections = 4", "max_connections = 2");
            format!("{shards}\n{}\n", groups())
        }
    };
    let other = connect(&other_toml).await;
    if let Some(proxy) = &proxy {
        proxy.killed().await;
    }
    let report = other.sagas(order_saga()).resume().await.unwrap();
    assert_eq!(
        (report.compensated, report.unreachable),
        (1, 1),
        "{report:?}"
    );
    drop(other);
    // The same with s4 hanging (its proxy keeps every connection open and
    // forwards nothing): resume reports it once its breaker's probe finds
    // it down, drives nothing twice, and leaves no connection behind.
    // (SQLite has no server to hang.)
    if dbs.backend != Backend::Sqlite {
        let before = dbs.server_connections().await;
        let frozen = Proxy::start(dbs.backend.server_address().unwrap()).await;
        let hung = connect(&toml(dbs, &[(4, frozen.port)])).await;
        frozen.freeze();
        let report = hung.sagas(order_saga()).resume().await.unwrap();
        assert_eq!(
            report,
            shardkit::SagaReport {
                unreachable: 1,
                ..Default::default()
            }
        );
        drop(hung);
        frozen.kill();
        dbs.assert_connections_settle(before).await;
    }
    assert_eq!(
        (balance(&cluster, 1).await, balance(&cluster, 2).await),
        (70, 130)
    );
    let all = cluster.saga_status(true).await.unwrap();
    assert_eq!(
        all.iter()
            .filter(|s| s.state == SagaState::Compensated)
            .count(),
        1
    );
    assert!(
        all.iter()
            .any(|s| s.error.as_deref() == Some("the seller's limit")),
        "{all:?}"
    );
    // Resuming again changes nothing.
    assert_eq!(
        sagas.resume().await.unwrap(),
        shardkit::SagaReport::default()
    );
    assert_eq!(balance(&cluster, 1).await, 70);
    // A step whose key no shard holds here waits, its error naming the
    // key; it is not refused, since an instance that places the key could
    // run it, and nothing here could fence that run. The step before it
    // stays done.
    let gift = buyer_pays("gift").step::<shardkit_tests::models::Account, _, _, _, _, _, _, _>(
        |_: &Order| NO_SHARD,
        |_tx, _o: Order| async { Err::<(), shardkit::BoxError>("a step with no shard ran".into()) },
        |_tx, _o: Order| async {
            Err::<(), shardkit::BoxError>("the undo of a step that never began ran".into())
        },
    );
    let gift = cluster.sagas(gift);
    let (id, state) = gift
        .start(
            1,
            &Order {
                buyer: 1,
                seller: 2,
                amount: 9,
            },
        )
        .await
        .unwrap();
    assert_eq!(state, SagaState::Running);
    assert_eq!(balance(&cluster, 1).await, 61, "the first step is done");
    let status = gift
        .status(1, &id)
        .await
        .unwrap()
        .expect("the saga is saved");
    assert_eq!((status.state, status.step), (SagaState::Running, 1));
    assert!(
        status.error.as_deref().is_some_and(
            |e| e.starts_with(&format!("cannot route group `Account` key {NO_SHARD}: "))
        ),
        "{status:?}"
    );

    // An operator gives up a saga whose step keeps being put off (its
    // work reads a key no shard holds, an error to try again): the step's
    // undo fences it, and the first step is undone.
    let reads = cluster.clone();
    let stuck = buyer_pays("stuck").step::<Holder, _, _, _, _, _, _, _>(
        |o: &Order| o.seller,
        move |_tx, _o: Order| {
            let reads = reads.clone();
            async move {
                reads
                    .find::<shardkit_tests::models::ledger::Entity>()
                    .key(NO_SHARD)
                    .one()
                    .await?;
                Err::<(), shardkit::BoxError>("a read of a key no shard holds".into())
            }
        },
        |_tx, _o: Order| async {
            Err::<(), shardkit::BoxError>("the undo of a step that never committed ran".into())
        },
    );
    let stuck = cluster.sagas(stuck);
    let order = Order {
        buyer: 1,
        seller: 2,
        amount: 5,
    };
    let (id, state) = stuck.start(1, &order).await.unwrap();
    assert_eq!(state, SagaState::Running);
    assert_eq!(balance(&cluster, 1).await, 56, "the first step is done");
    let state = stuck.abort(1, &id, "the seller left").await.unwrap();
    assert_eq!(state, SagaState::Compensating);
    let status = stuck.status(1, &id).await.unwrap().unwrap();
    assert_eq!(
        (status.state, status.step, status.error.as_deref()),
        (SagaState::Compensating, 2, Some("aborted: the seller left"))
    );
    // Aborting it again changes nothing; driving it compensates at once
    // (the abort cleared the step's backoff).
    assert_eq!(
        stuck.abort(1, &id, "again").await.unwrap(),
        SagaState::Compensating
    );
    let again = stuck.status(1, &id).await.unwrap().unwrap();
    assert_eq!(again.error.as_deref(), Some("aborted: the seller left"));
    assert_eq!(stuck.drive(1, &id).await.unwrap(), SagaState::Compensated);
    assert_eq!(
        (balance(&cluster, 1).await, balance(&cluster, 2).await),
        (61, 130),
        "the debit is undone, the seller untouched"
    );
    match stuck.abort(1, &id, "late").await {
        Err(shardkit::ShardError::CrossKey { what, reason }) => {
            assert_eq!(what, format!("saga `stuck` {id}"));
            assert_eq!(reason, "it is compensated: nothing is left to abort");
        }
        other => panic!("aborting a compensated saga: {other:?}"),
    }
    match stuck.abort(1, "no-such-saga", "late").await {
        Err(shardkit::ShardError::CrossKey { reason, .. }) => {
            assert_eq!(reason, "no such saga on its origin's shard");
        }
        other => panic!("aborting a saga that does not exist: {other:?}"),
    }
    // A state this release does not know (a rollback past a release that
    // added one, a row edited by hand): driving or aborting it fails and
    // says so (it was driven as `running`, every save refused, forever).
    let (id, _) = stuck.start(1, &order).await.unwrap();
    edit_row(&cluster, "shardkit_sagas", &id, "state = 'paused'").await;
    // The listing leaves it out (with a warning) instead of failing whole.
    let listed = cluster.saga_status(true).await.unwrap();
    assert!(!listed.iter().any(|s| s.id == id), "{listed:?}");
    assert!(!listed.is_empty());
    // Data that does not decode as the definition's: driving it fails and
    // records why on the saga, with its backoff (it stayed due at once, so
    // a thousand such sagas filled every `resume` pass).
    let (undecodable, _) = stuck.start(1, &order).await.unwrap();
    edit_row(
        &cluster,
        "shardkit_sagas",
        &undecodable,
        "data = 'not json', next_at = 0",
    )
    .await;
    let before = stuck.status(1, &undecodable).await.unwrap().unwrap();
    let err = stuck.drive(1, &undecodable).await.unwrap_err();
    assert!(
        err.to_string().contains("its stored data does not decode"),
        "{err}"
    );
    let status = stuck.status(1, &undecodable).await.unwrap().unwrap();
    assert_eq!(status.attempts, before.attempts + 1, "{status:?}");
    assert!(
        status
            .error
            .as_deref()
            .is_some_and(|e| e.contains("its stored data does not decode")),
        "{status:?}"
    );
    // Not due again at once: `drive` returns where it is without running.
    assert_eq!(
        stuck.drive(1, &undecodable).await.unwrap(),
        SagaState::Running
    );
    let within = Duration::from_secs(30);
    for ended in [
        tokio::time::timeout(within, stuck.drive(1, &id)).await,
        tokio::time::timeout(within, stuck.abort(1, &id, "late")).await,
    ] {
        let err = ended
            .expect("a saga of an unknown state driven forever")
            .unwrap_err();
        assert!(
            err.to_string().contains(&format!(
                "saga {id}: its state `paused` is not one this release knows"
            )),
            "{}",
            err.report()
        );
    }
}

/// A saga step that panics is refused like one that returns an error: the
/// steps before it are undone, the saga says why, and the next saga runs
/// (the panic used to end `start`, and every `resume` after, at it).
pub(crate) async fn a_saga_step_that_panics_is_refused_and_compensated(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 100).await;
    }
    let saga = buyer_pays("panicky").step::<Holder, _, _, _, _, _, _, _>(
        |o: &Order| o.seller,
        |tx, o: Order| async move {
            assert_ne!(o.amount, 13, "unlucky amount");
            add(&tx, o.amount).await
        },
        |tx, o: Order| async move { add(&tx, -o.amount).await },
    );
    let sagas = cluster.sagas(saga);
    let order = |amount| Order {
        buyer: 1,
        seller: 2,
        amount,
    };
    let (id, state) = sagas.start(1, &order(13)).await.unwrap();
    assert_eq!(state, SagaState::Compensated);
    assert_eq!(
        (balance(&cluster, 1).await, balance(&cluster, 2).await),
        (100, 100)
    );
    let status = cluster.saga_status(true).await.unwrap();
    let status = status.iter().find(|s| s.id == id).unwrap();
    let why = status.error.as_deref().unwrap_or_default();
    assert!(
        why.contains("the step panicked") && why.contains("unlucky amount"),
        "{why}"
    );
    let (_, state) = sagas.start(1, &order(5)).await.unwrap();
    assert_eq!(state, SagaState::Done);
    assert_eq!(
        (balance(&cluster, 1).await, balance(&cluster, 2).await),
        (95, 105)
    );
}
