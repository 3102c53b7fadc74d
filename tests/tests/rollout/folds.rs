//! Rollouts that fold several tables into one, on SQLite, PostgreSQL and
//! MySQL/MariaDB: `users` + `user_profiles` (one to one) into `users_v2`,
//! `orders` + `order_lines` (one to many) into `orders_v2`, written by two
//! application instances through every phase.

use sea_orm::{ActiveValue::NotSet, ActiveValue::Unchanged, ColumnTrait, QueryFilter, Set};
use shardkit::{
    Cluster, ClusterConfig, JobControl, ManualClock, Phase, Rollout, RolloutHandle, ShardError,
    VerifyOptions,
};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, Sent, TestDbs, count_rows, recording_cluster_with};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The failpoint scenario's turn (its failpoint is the process's).
static FAILPOINT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

type Users = RolloutHandle<user::Entity, user_v2::Entity>;
type Orders = RolloutHandle<order::Entity, order_v2::Entity>;

const TTL: Duration = Duration::from_millis(150);
const REFRESH: Duration = Duration::from_millis(40);

fn users_rollout() -> Rollout<user::Entity, user_v2::Entity> {
    Rollout::fold("users_v2", user_fold)
        .part::<user_profile::Entity>(user_profile::Column::UserId)
        .to_old(user_unfold)
        .to_old_parts(user_parts)
        .cache_ttl(TTL)
        .refresh_interval(REFRESH)
}

fn orders_rollout() -> Rollout<order::Entity, order_v2::Entity> {
    Rollout::fold("orders_v2", order_fold)
        .part::<order_line::Entity>(order_line::Column::OrderId)
        .to_old(order_unfold)
        .to_old_parts(order_parts)
        .cache_ttl(TTL)
        .refresh_interval(REFRESH)
}

/// One application instance with both rollouts registered.
struct App {
    cluster: Cluster,
    sent: Sent,
    users: Users,
    orders: Orders,
}

async fn app(dbs: &TestDbs, clock: &Arc<ManualClock>, config: Option<ClusterConfig>) -> App {
    let clock = Arc::clone(clock);
    let (cluster, sent) = match config {
        None => recording_cluster_with(dbs, 4, "[groups.Customer]", move |b| b.clock(clock)).await,
        Some(config) => {
            let sent = Sent::default();
            let cluster = Cluster::builder(config)
                .clock(clock)
                .connect()
                .await
                .unwrap();
            (cluster, sent)
        }
    };
    cluster.migrate::<Migrator>().await.unwrap();
    cluster
        .setup::<(user::Entity, user_v2::Entity)>()
        .await
        .unwrap();
    let users = cluster.register_rollout(users_rollout()).await.unwrap();
    let orders = cluster.register_rollout(orders_rollout()).await.unwrap();
    App {
        cluster,
        sent,
        users,
        orders,
    }
}

/// What the old tables hold, as the test wrote them: the folded rows the
/// new tables must end with.
#[derive(Default)]
struct Expected {
    users: BTreeMap<i64, user::Model>,
    profiles: BTreeMap<i64, user_profile::Model>,
    orders: BTreeMap<i64, order::Model>,
    lines: BTreeMap<i64, order_line::Model>,
}

impl Expected {
    fn user_v2(&self, id: i64) -> user_v2::Model {
        let profiles: Vec<user_profile::Model> = self
            .profiles
            .values()
            .filter(|p| p.user_id == id)
            .cloned()
            .collect();
        user_fold(
            &self.users[&id],
            &shardkit::Parts::new().with::<user_profile::Entity>(profiles),
        )
    }

    fn order_v2(&self, id: i64) -> order_v2::Model {
        let lines: Vec<order_line::Model> = self
            .lines
            .values()
            .filter(|l| l.order_id == id)
            .cloned()
            .collect();
        order_fold(
            &self.orders[&id],
            &shardkit::Parts::new().with::<order_line::Entity>(lines),
        )
    }
}

/// Writes of every part, through the old path, as code that knows nothing
/// of the rollouts would make them. `with_link`: updates and deletes carry
/// the link column (as an active model made from a read row does); from
/// `new_only` on they must.
async fn write_everything(app: &App, n: i64, want: &mut Expected, with_link: bool) {
    write_for(app, n, n % 7, want, with_link).await
}

/// [`write_everything`] under key `customer`.
async fn write_for(app: &App, n: i64, customer: i64, want: &mut Expected, with_link: bool) {
    let cluster = &app.cluster;
    let user = user::Model {
        id: n,
        customer_id: customer,
        email: format!("u{n}@example.com"),
    };
    let profile = user_profile::Model {
        id: 1000 + n,
        customer_id: customer,
        user_id: n,
        phone: format!("555-{n}"),
        city: "Oslo".into(),
    };
    let order = order::Model {
        id: n,
        customer_id: customer,
        total_cents: 100 * n,
    };
    let lines: Vec<order_line::Model> = (0..3)
        .map(|j| order_line::Model {
            id: 10_000 + n * 10 + j,
            customer_id: customer,
            order_id: n,
            sku: format!("sku-{j}"),
            cents: 10 + j,
        })
        .collect();
    // A user with its profile, and an order with its lines, each in one
    // transaction.
    cluster
        .transaction::<Customer, _, _>(customer, |tx| {
            let (user, profile) = (user.clone(), profile.clone());
            async move {
                tx.insert(user::ActiveModel::from(user)).await?;
                tx.insert(user_profile::ActiveModel::from(profile)).await
            }
        })
        .await
        .unwrap();
    cluster
        .transaction::<Customer, _, _>(customer, |tx| {
            let (order, lines) = (order.clone(), lines.clone());
            async move {
                tx.insert(order::ActiveModel::from(order)).await?;
                for line in lines {
                    tx.insert(order_line::ActiveModel::from(line)).await?;
                }
                Ok(())
            }
        })
        .await
        .unwrap();
    // A profile-only edit and a line-only edit, each alone in its
    // transaction, and a line deleted.
    let link = |v: i64| if with_link { Unchanged(v) } else { NotSet };
    let tx = cluster.begin::<Customer>(customer).await.unwrap();
    tx.update(user_profile::ActiveModel {
        id: Unchanged(profile.id),
        customer_id: Unchanged(customer),
        user_id: link(n),
        phone: Set(format!("556-{n}")),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let tx = cluster.begin::<Customer>(customer).await.unwrap();
    tx.update(order_line::ActiveModel {
        id: Unchanged(lines[0].id),
        customer_id: Unchanged(customer),
        order_id: link(n),
        cents: Set(99),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let tx = cluster.begin::<Customer>(customer).await.unwrap();
    let deleted = tx
        .delete(order_line::ActiveModel {
            id: Unchanged(lines[2].id),
            customer_id: Unchanged(customer),
            order_id: link(n),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    tx.commit().await.unwrap();

    want.users.insert(n, user);
    want.profiles.insert(
        profile.id,
        user_profile::Model {
            phone: format!("556-{n}"),
            ..profile
        },
    );
    want.orders.insert(n, order);
    want.lines.insert(
        lines[0].id,
        order_line::Model {
            cents: 99,
            ..lines[0].clone()
        },
    );
    want.lines.insert(lines[1].id, lines[1].clone());
}

/// The new tables' rows of the users and orders `ids`, read with their
/// keys (so from the shard each key routes to).
async fn assert_folded(app: &App, want: &Expected, ids: impl IntoIterator<Item = i64>) {
    for id in ids {
        let customer = want.users[&id].customer_id;
        let user = app
            .cluster
            .find::<user_v2::Entity>()
            .key(customer)
            .filter(user_v2::Column::Id.eq(id))
            .one()
            .await
            .unwrap();
        assert_eq!(user, Some(want.user_v2(id)), "users_v2 {id}");
        let order = app
            .cluster
            .find::<order_v2::Entity>()
            .key(customer)
            .filter(order_v2::Column::Id.eq(id))
            .one()
            .await
            .unwrap();
        assert_eq!(order, Some(want.order_v2(id)), "orders_v2 {id}");
    }
}

fn statements(sent: &Sent) -> usize {
    sent.lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| !s.sql.contains("shardkit_rollout"))
        .count()
}

async fn sees(app: &App, phase: Phase) {
    let start = Instant::now();
    while app.users.phase() != phase || app.orders.phase() != phase {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "instance still on {} / {}, expected {phase}",
            app.users.phase(),
            app.orders.phase()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Both rollouts one phase on, waiting out the gap on the test clock; the
/// other instance follows through its refresh.
async fn advance(by: &App, other: &App, clock: &ManualClock) -> Phase {
    clock.advance(by.users.gap().max(by.orders.gap()));
    let phase = by.users.advance_when_ready().await.unwrap();
    assert_eq!(by.orders.advance_when_ready().await.unwrap(), phase);
    sees(other, phase).await;
    phase
}

pub(crate) async fn fold_walk_with_two_instances(dbs: &mut TestDbs) {
    let clock = Arc::new(ManualClock::starting_now());
    let a = app(dbs, &clock, None).await;
    let b = app(dbs, &clock, None).await;
    let mut want = Expected::default();
    let mut n = 0;
    let mut written = Vec::new();
    for phase in [
        Phase::Off,
        Phase::CacheBoth,
        Phase::DualWrite,
        Phase::ReadNew,
        Phase::NewOnly,
    ] {
        if phase != Phase::Off {
            let (by, other) = if n % 4 == 0 { (&a, &b) } else { (&b, &a) };
            assert_eq!(advance(by, other, &clock).await, phase);
        }
        // Writes of every part from both instances.
        for app in [&a, &b] {
            n += 1;
            write_everything(app, n, &mut want, phase >= Phase::NewOnly).await;
            written.push(n);
        }
        match phase {
            Phase::Off | Phase::CacheBoth => {
                assert_eq!(count_rows(&a.cluster, "users_v2").await, 0);
                assert_eq!(count_rows(&a.cluster, "orders_v2").await, 0);
            }
            _ => assert_folded(&a, &want, [n - 1, n]).await,
        }
        if phase == Phase::CacheBoth || phase == Phase::DualWrite {
            // PayPal's case: inserted through the old path, read through
            // the new path on the same instance, from its cache.
            let before = statements(&b.sent);
            assert_eq!(
                b.users.get_new(n % 7, n).await.unwrap(),
                Some(want.user_v2(n))
            );
            assert_eq!(
                b.orders.get_new(n % 7, n).await.unwrap(),
                Some(want.order_v2(n))
            );
            assert_eq!(statements(&b.sent), before, "cached reads sent SQL");
            // The other instance folds from the old tables.
            a.users.clear_caches();
            assert_eq!(
                a.orders.get_new(n % 7, n).await.unwrap(),
                Some(want.order_v2(n))
            );
        }
        if phase == Phase::DualWrite {
            // Rows from before dual writes are folded by the backfill.
            clock.advance(a.users.gap());
            assert!(a.users.backfill().await.unwrap().finished);
            assert!(
                b.orders
                    .backfill_with(3, JobControl::new())
                    .await
                    .unwrap()
                    .finished
            );
            assert_folded(&a, &want, written.iter().copied()).await;
        }
        if phase >= Phase::DualWrite && phase < Phase::NewOnly {
            for report in [
                a.users
                    .verify(VerifyOptions::default().chunk(3))
                    .await
                    .unwrap(),
                b.orders
                    .verify(VerifyOptions::default().chunk(2))
                    .await
                    .unwrap(),
            ] {
                assert!(report.is_consistent(), "{report:?}");
                assert_eq!(report.rows, n as u64);
            }
        }
    }
    // new_only: the old tables were not written, and every folded row is
    // what the old tables would hold.
    assert_folded(&a, &want, written.iter().copied()).await;
    assert_eq!(count_rows(&a.cluster, "users").await, n as u64 - 2);
    assert_eq!(
        count_rows(&a.cluster, "order_lines").await,
        2 * (n as u64 - 2)
    );
    let customer = n % 7;

    // Reads of the root follow the phase: the latest row, from users_v2.
    let tx = a.cluster.begin::<Customer>(customer).await.unwrap();
    tx.update(user::ActiveModel {
        id: Unchanged(n),
        customer_id: Unchanged(customer),
        email: Set(format!("new{n}@example.com")),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    want.users.get_mut(&n).unwrap().email = format!("new{n}@example.com");
    let read = b
        .cluster
        .find::<user::Entity>()
        .key(customer)
        .filter(user::Column::Id.eq(n))
        .one()
        .await
        .unwrap();
    assert_eq!(read, Some(want.users[&n].clone()));
    assert_folded(&b, &want, [n]).await;
    // The old and the new index find a user written in new_only, and the
    // new row's own phone index follows a profile-only edit.
    for (found, what) in [
        (
            b.cluster
                .find::<user::Entity>()
                .by_index(user::Column::Email, format!("new{n}@example.com"))
                .all()
                .await
                .unwrap()
                .iter()
                .map(|u| u.id)
                .collect::<Vec<_>>(),
            "users.email",
        ),
        (
            b.cluster
                .find::<user_v2::Entity>()
                .by_index(user_v2::Column::Email, format!("new{n}@example.com"))
                .all()
                .await
                .unwrap()
                .iter()
                .map(|u| u.id)
                .collect(),
            "users_v2.email",
        ),
        (
            b.cluster
                .find::<user_v2::Entity>()
                .by_index(user_v2::Column::Phone, format!("556-{n}"))
                .all()
                .await
                .unwrap()
                .iter()
                .map(|u| u.id)
                .collect(),
            "users_v2.phone",
        ),
    ] {
        assert_eq!(found, vec![n], "{what}");
    }
    // A part's table is no longer written: reading it is refused, naming
    // what to read instead; get_parts reads the folded row.
    let err = b
        .cluster
        .find::<user_profile::Entity>()
        .key(customer)
        .all()
        .await
        .unwrap_err();
    match &err {
        ShardError::Rollout { reason, .. } => assert!(reason.contains("get_parts"), "{reason}"),
        other => panic!("read of a folded part in new_only: {other:?}"),
    }
    let parts = b.users.get_parts(customer, n).await.unwrap().unwrap();
    assert_eq!(
        parts.one::<user_profile::Entity>(),
        Some(&want.profiles[&(1000 + n)])
    );
    // A part write that does not say which root it belongs to cannot be
    // applied to a folded row: refused, naming the column, nothing written.
    let tx = b.cluster.begin::<Customer>(customer).await.unwrap();
    let err = tx
        .update(order_line::ActiveModel {
            id: Unchanged(10_000 + n * 10),
            customer_id: Unchanged(customer),
            cents: Set(1),
            ..Default::default()
        })
        .await
        .unwrap_err();
    match &err {
        ShardError::Rollout { reason, .. } => assert!(reason.contains("order_id"), "{reason}"),
        other => panic!("part write without its link in new_only: {other:?}"),
    }
    drop(tx);
    assert_folded(&b, &want, [n]).await;

    // done: writes of every part are refused.
    assert_eq!(advance(&a, &b, &clock).await, Phase::Done);
    let tx = b.cluster.begin::<Customer>(customer).await.unwrap();
    let err = tx
        .insert(order_line::ActiveModel::from(order_line::Model {
            id: 99_999,
            customer_id: customer,
            order_id: n,
            sku: "late".into(),
            cents: 1,
        }))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ShardError::Rollout {
                phase: Phase::Done,
                ..
            }
        ),
        "{err:?}"
    );
    drop(tx);
    assert_folded(&a, &want, written.iter().copied()).await;
}

/// A failed dual write of a part's fold rolls back the whole transaction:
/// the other part written before it in the same transaction too.
pub(crate) async fn a_failed_part_dual_write_rolls_back_the_transaction(dbs: &mut TestDbs) {
    let clock = Arc::new(ManualClock::starting_now());
    let a = app(dbs, &clock, None).await;
    let b = app(dbs, &clock, None).await;
    let mut want = Expected::default();
    for _ in 0..2 {
        advance(&a, &b, &clock).await;
    }
    // Its own key: the failpoint is the process's, and other scenarios (and
    // this one on the other backends) run beside this one.
    let customer = 900_001
        + match dbs.backend {
            Backend::Sqlite => 0,
            Backend::Postgres => 1,
            Backend::MySql => 2,
        };
    write_for(&a, 1, customer, &mut want, false).await;
    // One failpoint for the process: the backends take turns with it.
    let turn = FAILPOINT.lock().await;
    fail::cfg(
        "shardkit::rollout::write_new",
        &format!("return(orders_v2@{customer})"),
    )
    .unwrap();
    let result = a
        .cluster
        .transaction::<Customer, _, _>(customer, |tx| async move {
            tx.update(user_profile::ActiveModel {
                id: Unchanged(1001),
                customer_id: Unchanged(customer),
                phone: Set("777".into()),
                ..Default::default()
            })
            .await?;
            tx.insert(order_line::ActiveModel::from(order_line::Model {
                id: 55,
                customer_id: customer,
                order_id: 1,
                sku: "x".into(),
                cents: 5,
            }))
            .await
        })
        .await;
    fail::remove("shardkit::rollout::write_new");
    drop(turn);
    let err = result.unwrap_err();
    assert!(err.to_string().contains("orders_v2"), "{err}");
    // Neither part changed, in the old tables or the new.
    assert_folded(&a, &want, [1]).await;
    assert_eq!(count_rows(&a.cluster, "order_lines").await, 2);
    let profile = a
        .cluster
        .find::<user_profile::Entity>()
        .key(customer)
        .one()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(profile.phone, "556-1");
    let report = b.orders.verify(VerifyOptions::default()).await.unwrap();
    assert!(report.is_consistent(), "{report:?}");
    let report = b.users.verify(VerifyOptions::default()).await.unwrap();
    assert!(report.is_consistent(), "{report:?}");
}

/// 8 writers on a pool of 2 per shard add, change and remove lines of one
/// order while two others update the order itself, all starting together,
/// round after round: every transaction completes, and after each round the
/// folded row is the fold of the rows as committed (no fold computed from
/// what a transaction saw before another committed; a later write would
/// hide such a loss, so each round is checked before the next).
pub(crate) async fn concurrent_part_writes_on_a_small_pool_fold_every_line(dbs: &mut TestDbs) {
    let clock = Arc::new(ManualClock::starting_now());
    let toml = format!(
        "{}\n[groups.Customer]\n",
        dbs.shards_toml(4)
            .replace("max_connections = 4", "max_connections = 2")
    );
    let a = app(dbs, &clock, Some(ClusterConfig::from_toml(&toml).unwrap())).await;
    let b = app(dbs, &clock, None).await;
    for _ in 0..2 {
        advance(&a, &b, &clock).await;
    }
    assert_eq!(a.orders.phase(), Phase::DualWrite);
    let tx = a.cluster.begin::<Customer>(3).await.unwrap();
    tx.insert(order::ActiveModel::from(order::Model {
        id: 1,
        customer_id: 3,
        total_cents: 0,
    }))
    .await
    .unwrap();
    tx.commit().await.unwrap();
    for round in 0..6_i64 {
        let start = Arc::new(tokio::sync::Barrier::new(10));
        let writers = (0..8_i64).map(|w| {
            let (cluster, start) = (a.cluster.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                cluster
                    .transaction::<Customer, _, _>(3, |tx| async move {
                        tx.insert(order_line::ActiveModel::from(order_line::Model {
                            id: round * 100 + w,
                            customer_id: 3,
                            order_id: 1,
                            sku: format!("w{w}"),
                            cents: 1,
                        }))
                        .await?;
                        if round >= 1 {
                            tx.update(order_line::ActiveModel {
                                id: Unchanged((round - 1) * 100 + w),
                                customer_id: Unchanged(3),
                                cents: Set(10 + round),
                                ..Default::default()
                            })
                            .await?;
                        }
                        if round >= 2 && w % 2 == 0 {
                            tx.delete(order_line::ActiveModel {
                                id: Unchanged((round - 2) * 100 + w),
                                customer_id: Unchanged(3),
                                ..Default::default()
                            })
                            .await?;
                        }
                        Ok(())
                    })
                    .await
                    .unwrap();
            })
        });
        let roots = (0..2_i64).map(|r| {
            let (cluster, start) = (b.cluster.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                cluster
                    .transaction::<Customer, _, _>(3, |tx| async move {
                        tx.update(order::ActiveModel {
                            id: Unchanged(1),
                            customer_id: Unchanged(3),
                            total_cents: Set(round * 10 + r),
                        })
                        .await
                    })
                    .await
                    .unwrap();
            })
        });
        let all: Vec<_> = writers.chain(roots).collect();
        for task in futures::future::join_all(all).await {
            task.unwrap();
        }
        let order = a
            .cluster
            .find::<order::Entity>()
            .key(3)
            .one()
            .await
            .unwrap()
            .unwrap();
        let mut lines = a
            .cluster
            .find::<order_line::Entity>()
            .key(3)
            .all()
            .await
            .unwrap();
        lines.sort_by_key(|l| l.id);
        let folded = a
            .cluster
            .find::<order_v2::Entity>()
            .key(3)
            .one()
            .await
            .unwrap();
        assert_eq!(
            folded,
            Some(order_fold(
                &order,
                &shardkit::Parts::new().with::<order_line::Entity>(lines)
            )),
            "round {round}"
        );
    }
    let report = a.orders.verify(VerifyOptions::default()).await.unwrap();
    assert!(report.is_consistent(), "{report:?}");
}

/// A part declared twice, or a part that already belongs to another
/// rollout, is refused at registration, before anything is recorded.
pub(crate) async fn fold_declarations_are_checked(dbs: &mut TestDbs) {
    let clock = Arc::new(ManualClock::starting_now());
    let a = app(dbs, &clock, None).await;
    let twice = Rollout::<user::Entity, user_v2::Entity>::fold("twice", user_fold)
        .part::<user_profile::Entity>(user_profile::Column::UserId)
        .part::<user_profile::Entity>(user_profile::Column::UserId);
    let err = a.cluster.register_rollout(twice).await.unwrap_err();
    assert!(err.to_string().contains("user_profiles"), "{err}");
    // order_lines already folds into orders_v2 on this cluster.
    let taken =
        Rollout::<customer::Entity, user_v2::Entity>::fold("taken", |c, _| user_v2::Model {
            id: c.id,
            customer_id: c.id,
            email: c.name.clone(),
            profile_id: None,
            phone: None,
            city: None,
        })
        .part::<order_line::Entity>(order_line::Column::OrderId);
    let err = a.cluster.register_rollout(taken).await.unwrap_err();
    assert!(err.to_string().contains("order_lines"), "{err}");
    let err = a
        .cluster
        .rollout::<customer::Entity, user_v2::Entity>()
        .unwrap_err();
    assert!(
        matches!(&err, ShardError::Config { message, .. }
            if message.contains("no rollout of `customers` is registered")),
        "{err}"
    );
}

/// A line changed behind shardkit's back (raw SQL on the old table) makes
/// its order's folded row differ: verify names that order, in a chunk of
/// its own, and repair re-folds it from the old tables.
pub(crate) async fn verify_and_repair_the_folded_form(dbs: &mut TestDbs) {
    let clock = Arc::new(ManualClock::starting_now());
    let a = app(dbs, &clock, None).await;
    let b = app(dbs, &clock, None).await;
    let mut want = Expected::default();
    for n in 1..=6 {
        write_everything(&a, n, &mut want, false).await;
    }
    for _ in 0..2 {
        advance(&a, &b, &clock).await;
    }
    clock.advance(a.orders.gap());
    assert!(a.orders.backfill().await.unwrap().finished);
    assert!(a.users.backfill().await.unwrap().finished);
    assert_folded(&a, &want, 1..=6).await;
    // Order 4's first line, edited without shardkit.
    let customer = want.orders[&4].customer_id;
    let shard = a.cluster.shard_of::<Customer>(&customer).await.unwrap();
    let db = a.cluster.connection(shard).unwrap();
    sea_orm::ConnectionTrait::execute_unprepared(
        db,
        "UPDATE order_lines SET cents = 7 WHERE id = 10040",
    )
    .await
    .unwrap();
    want.lines.get_mut(&10_040).unwrap().cents = 7;
    let report = b
        .orders
        .verify(VerifyOptions::default().chunk(2))
        .await
        .unwrap();
    assert_eq!(
        report
            .different
            .iter()
            .map(|d| d.pk.as_str())
            .collect::<Vec<_>>(),
        ["4"],
        "{report:?}"
    );
    assert!(
        report.missing.is_empty() && report.extra.is_empty(),
        "{report:?}"
    );
    let report = b
        .orders
        .verify(VerifyOptions::default().repair())
        .await
        .unwrap();
    assert_eq!(report.repaired, 1, "{report:?}");
    assert_folded(&a, &want, 1..=6).await;
    assert!(
        b.orders
            .verify(VerifyOptions::default())
            .await
            .unwrap()
            .is_consistent()
    );
    // Users were untouched.
    assert!(
        b.users
            .verify(VerifyOptions::default())
            .await
            .unwrap()
            .is_consistent()
    );
}

/// The folded row of order `id` is the fold of the rows as committed.
async fn assert_order_matches_tables(cluster: &Cluster, customer: i64, id: i64, when: &str) {
    let order = cluster
        .find::<order::Entity>()
        .key(customer)
        .filter(order::Column::Id.eq(id))
        .one()
        .await
        .unwrap()
        .unwrap();
    let mut lines = cluster
        .find::<order_line::Entity>()
        .key(customer)
        .filter(order_line::Column::OrderId.eq(id))
        .all()
        .await
        .unwrap();
    lines.sort_by_key(|l| l.id);
    let folded = cluster
        .find::<order_v2::Entity>()
        .key(customer)
        .filter(order_v2::Column::Id.eq(id))
        .one()
        .await
        .unwrap();
    assert_eq!(
        folded,
        Some(order_fold(
            &order,
            &shardkit::Parts::new().with::<order_line::Entity>(lines)
        )),
        "order {id}, {when}"
    );
}

/// Transactions that write two lines of one order, one line, the order and
/// then a line, and that move lines between two orders in opposite
/// directions, all at once and round after round, on plain transactions (no
/// retry): none deadlocks or fails, and after each round both folded orders
/// match their tables. A part's write locks its roots (sorted) before its
/// own row, as the root's writes do.
pub(crate) async fn part_writes_and_root_writes_never_deadlock(dbs: &mut TestDbs) {
    let clock = Arc::new(ManualClock::starting_now());
    let a = app(dbs, &clock, None).await;
    let b = app(dbs, &clock, None).await;
    for _ in 0..2 {
        advance(&a, &b, &clock).await;
    }
    let customer = 5;
    let tx = a.cluster.begin::<Customer>(customer).await.unwrap();
    for order in [1, 2] {
        tx.insert(order::ActiveModel::from(order::Model {
            id: order,
            customer_id: customer,
            total_cents: 0,
        }))
        .await
        .unwrap();
    }
    // Lines 11, 12 stay in order 1; 21 in order 2; 13 and 23 move.
    for (id, order) in [(11, 1), (12, 1), (13, 1), (21, 2), (23, 2)] {
        tx.insert(order_line::ActiveModel::from(order_line::Model {
            id,
            customer_id: customer,
            order_id: order,
            sku: format!("l{id}"),
            cents: 1,
        }))
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let cents = |id: i64, cents: i64| order_line::ActiveModel {
        id: Unchanged(id),
        customer_id: Unchanged(customer),
        cents: Set(cents),
        ..Default::default()
    };
    let moved = |id: i64, to: i64| order_line::ActiveModel {
        id: Unchanged(id),
        customer_id: Unchanged(customer),
        order_id: Set(to),
        ..Default::default()
    };
    for round in 0..8_i64 {
        let start = Arc::new(tokio::sync::Barrier::new(5));
        let (from_13, from_23) = if round % 2 == 0 { (2, 1) } else { (1, 2) };
        let jobs: Vec<Vec<order_line::ActiveModel>> = vec![
            vec![cents(11, round), cents(12, round)],
            vec![cents(12, round + 100)],
            vec![moved(13, from_13)],
            vec![moved(23, from_23)],
        ];
        let mut tasks: Vec<tokio::task::JoinHandle<()>> = jobs
            .into_iter()
            .enumerate()
            .map(|(i, writes)| {
                let cluster = if i % 2 == 0 {
                    a.cluster.clone()
                } else {
                    b.cluster.clone()
                };
                let start = start.clone();
                tokio::spawn(async move {
                    start.wait().await;
                    let tx = cluster.begin::<Customer>(customer).await.unwrap();
                    for write in writes {
                        tx.update(write).await.unwrap();
                    }
                    tx.commit().await.unwrap();
                })
            })
            .collect();
        // The order itself, then one of its lines.
        let (cluster, start) = (a.cluster.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let tx = cluster.begin::<Customer>(customer).await.unwrap();
            tx.update(order::ActiveModel {
                id: Unchanged(1),
                customer_id: Unchanged(customer),
                total_cents: Set(round),
            })
            .await
            .unwrap();
            tx.update(order_line::ActiveModel {
                id: Unchanged(11),
                customer_id: Unchanged(customer),
                sku: Set(format!("r{round}")),
                ..Default::default()
            })
            .await
            .unwrap();
            tx.commit().await.unwrap();
        }));
        for task in futures::future::join_all(tasks).await {
            task.unwrap();
        }
        for order in [1, 2] {
            assert_order_matches_tables(&a.cluster, customer, order, &format!("round {round}"))
                .await;
        }
    }
    let report = a.orders.verify(VerifyOptions::default()).await.unwrap();
    assert!(report.is_consistent(), "{report:?}");
}

/// From new_only a line added to an order holding line 9 is folded after
/// it (10 after 9, as the table orders them), exactly as the backfill of
/// the same rows folds them; and the folded row is what a re-derivation
/// from the split gives.
pub(crate) async fn new_only_part_inserts_keep_primary_key_order(dbs: &mut TestDbs) {
    let clock = Arc::new(ManualClock::starting_now());
    let a = app(dbs, &clock, None).await;
    let b = app(dbs, &clock, None).await;
    let customer = 6;
    let tx = a.cluster.begin::<Customer>(customer).await.unwrap();
    tx.insert(order::ActiveModel::from(order::Model {
        id: 1,
        customer_id: customer,
        total_cents: 5,
    }))
    .await
    .unwrap();
    for id in [9, 100] {
        tx.insert(order_line::ActiveModel::from(order_line::Model {
            id,
            customer_id: customer,
            order_id: 1,
            sku: format!("l{id}"),
            cents: id,
        }))
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    for _ in 0..2 {
        advance(&a, &b, &clock).await;
    }
    clock.advance(a.orders.gap());
    assert!(a.orders.backfill().await.unwrap().finished);
    assert!(a.users.backfill().await.unwrap().finished);
    for _ in 0..2 {
        advance(&a, &b, &clock).await;
    }
    assert_eq!(a.orders.phase(), Phase::NewOnly);
    let tx = a.cluster.begin::<Customer>(customer).await.unwrap();
    tx.insert(order_line::ActiveModel::from(order_line::Model {
        id: 10,
        customer_id: customer,
        order_id: 1,
        sku: "l10".into(),
        cents: 10,
    }))
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let folded = a
        .cluster
        .find::<order_v2::Entity>()
        .key(customer)
        .one()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(folded.lines, "9:l9:9;10:l10:10;100:l100:100");
    assert_eq!(folded.lines_cents, 119);
    let parts = b.orders.get_parts(customer, 1).await.unwrap().unwrap();
    assert_eq!(
        parts
            .many::<order_line::Entity>()
            .iter()
            .map(|l| l.id)
            .collect::<Vec<_>>(),
        [9, 10, 100]
    );
}
