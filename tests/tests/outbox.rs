//! Work that spans keys: transfers between accounts through the outbox
//! under faults (relays dying mid-delivery, two relays, a relay process
//! killed, a shard refusing and one hanging, a bucket move), a saga whose
//! step is refused, concurrent retries of one request, parked messages.

use sea_orm::{ActiveValue::Set, ConnectionTrait, QueryFilter, QuerySelect};
use shardkit::{Cluster, ClusterConfig, Message, Saga, SagaState, ShardError};
use shardkit_tests::{Backend, Proxy, TestDbs, backend_tests};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

backend_tests!(5 =>
    transfers_keep_the_money_under_faults_and_a_move,
    a_saga_whose_step_is_refused_is_compensated_once,
    concurrent_retries_of_a_request_run_it_once,
    parked_messages_are_listed_retried_and_discarded_and_order_holds,
    a_sender_with_a_backlog_hides_no_other_sender,
    a_message_a_handler_sends_goes_in_the_same_deliver,
    a_pair_waits_for_its_message_another_relay_applies,
    [Postgres] a_handler_that_swallows_a_failed_statement_commits_nothing,
    a_message_applied_before_that_its_handler_refuses_is_not_parked,
    a_saga_step_that_panics_is_refused_and_compensated,
    a_handler_that_swallows_a_refusal_is_parked,
    a_message_whose_sending_key_cannot_be_read_is_applied_once,
    [Postgres, MySql] a_handler_that_swallows_an_abort_runs_again,
    [Postgres, MySql] a_saga_step_that_swallows_an_abort_is_tried_again,
    [Postgres, MySql] a_handler_that_loses_a_real_deadlock_runs_again,
    [Postgres, MySql] a_request_that_loses_a_real_deadlock_runs_again,
    child_relay,
);

/// Failpoints are process-wide: one scenario at a time sets them.
static FAILPOINTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(shardkit::EntityGroup)]
#[shardkit(key = i64)]
pub struct Holder;

pub mod wallet {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "wallets")]
    #[shardkit(group = super::Holder)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        pub balance: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// One row per credit applied (its own id: a credit applied twice would
/// show as two rows of one transfer).
pub mod credit {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "credits")]
    #[shardkit(group = super::Holder)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        #[shardkit(shard_key)]
        pub wallet_id: i64,
        pub transfer: String,
        pub amount: i64,
        pub seq: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

pub struct Migrator;

#[sea_orm_migration::async_trait::async_trait]
impl sea_orm_migration::MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn sea_orm_migration::MigrationTrait>> {
        use shardkit_tests::models::CreateTable;
        let mut all = shardkit_migration::migrations();
        all.push(Box::new(CreateTable(
            "m20261126_000201_wallets",
            wallet::Entity,
        )));
        all.push(Box::new(CreateTable(
            "m20261126_000202_credits",
            credit::Entity,
        )));
        all
    }
}

#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
struct Credit {
    transfer: String,
    amount: i64,
    /// The sender's count of transfers to this receiver (order check).
    seq: i64,
}

impl Message for Credit {
    const NAME: &'static str = "credit";
    type From = Holder;
    type To = Holder;
}

/// A message only some relays apply.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
struct Memo {
    amount: i64,
}

impl Message for Memo {
    const NAME: &'static str = "memo";
    type From = Holder;
    type To = Holder;
}

/// A message to a group whose ranges leave keys without a shard.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
struct Gift {
    amount: i64,
}

impl Message for Gift {
    const NAME: &'static str = "gift";
    type From = Holder;
    type To = shardkit_tests::models::Account;
}

/// A key of `Account` outside its one range: no shard holds it.
const NO_SHARD: i32 = 5000;

const ACCOUNTS: i64 = 1000;
const START: i64 = 1000;
const BUCKETS: u32 = 64;

fn groups() -> String {
    format!(
        "[groups.Holder]\nbuckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true\n\n[groups.Account]\nplacement = \"range\"\nranges = [{{ shard = \"s0\", to = 1000 }}]\n\n[rebalance]\nrefresh_ms = 50\ncleanup_grace_ms = 0\nchunk = 200\n"
    )
}

fn toml(dbs: &TestDbs, through: &[(usize, u16)]) -> String {
    let shards = dbs
        .shards_toml_through(
            5,
            "connect_timeout_secs = 1\nacquire_timeout_secs = 2\n",
            through,
        )
        .replace("max_connections = 4", "max_connections = 2");
    format!("{shards}\n{}\n[read]\ntimeout_ms = 3000\n", groups())
}

async fn connect(toml: &str) -> Cluster {
    let cluster = Cluster::connect(ClusterConfig::from_toml(toml).unwrap())
        .await
        .unwrap();
    cluster.refresh_bucket_maps().await.unwrap();
    cluster
}

/// Opens wallet `id` with `balance`, in a transaction of its key.
async fn open_wallet(cluster: &Cluster, id: i64, balance: i64) {
    cluster
        .transaction::<Holder, _, _>(id, |tx| async move {
            tx.insert(wallet::ActiveModel {
                id: Set(id),
                balance: Set(balance),
            })
            .await
        })
        .await
        .unwrap();
}

/// The credit handler: adds the amount and records the credit.
fn relay(cluster: &Cluster) -> shardkit::Outbox {
    cluster
        .outbox()
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .step_timeout(Duration::from_secs(3))
        .handle::<Credit, _, _, _>(|tx, c: Credit| async move { apply_credit(&tx, c).await })
}

/// Adds the credit to the receiving wallet (read under its row lock: a
/// debit and a credit of one wallet at once must not both write the
/// balance they read) and records it.
async fn apply_credit(tx: &shardkit::ShardTx<Holder>, c: Credit) -> Result<(), shardkit::BoxError> {
    let id = *tx.key();
    let w = tx
        .find::<wallet::Entity>()
        .lock_exclusive()
        .one()
        .await?
        .ok_or("no such wallet")?;
    tx.update(wallet::ActiveModel {
        id: Set(id),
        balance: Set(w.balance + c.amount),
    })
    .await?;
    tx.insert(credit::ActiveModel {
        id: Set(shardkit::uuid_v7().to_string()),
        wallet_id: Set(id),
        transfer: Set(c.transfer),
        amount: Set(c.amount),
        seq: Set(c.seq),
    })
    .await?;
    Ok(())
}

async fn seed(cluster: &Cluster) {
    cluster.migrate::<Migrator>().await.unwrap();
    let mut tasks = Vec::new();
    for part in 0..4 {
        let c = cluster.clone();
        tasks.push(tokio::spawn(async move {
            for id in (1..=ACCOUNTS).filter(|i| i % 4 == part) {
                open_wallet(&c, id, START).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Debits `from` and sends the credit to `to`, in one transaction of
/// `from`; the transfer id when it committed.
async fn transfer_as(
    cluster: &Cluster,
    id: String,
    from: i64,
    to: i64,
    amount: i64,
) -> Result<String, ShardError> {
    let t = id.clone();
    cluster
        .transaction::<Holder, _, _>(from, |tx| {
            let t = t.clone();
            async move {
                let w = tx
                    .find::<wallet::Entity>()
                    .lock_exclusive()
                    .one()
                    .await?
                    .expect("wallet");
                tx.update(wallet::ActiveModel {
                    id: Set(from),
                    balance: Set(w.balance - amount),
                })
                .await?;
                tx.send(
                    to,
                    &Credit {
                        transfer: t,
                        amount,
                        seq: 0,
                    },
                )
                .await?;
                Ok(())
            }
        })
        .await?;
    Ok(id)
}

/// Sums of every shard's rows of the owners' buckets: balances, credits
/// per transfer, outbox debits pending, parked messages.
struct Books {
    balances: i64,
    credits: BTreeMap<String, usize>,
    pending: i64,
    parked: usize,
}

async fn books(cluster: &Cluster) -> Books {
    let wallets = cluster
        .find::<wallet::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    let credits = cluster
        .find::<credit::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    let mut by_transfer = BTreeMap::new();
    for c in &credits {
        *by_transfer.entry(c.transfer.clone()).or_insert(0) += 1;
    }
    let mut pending = 0;
    let mut parked = 0;
    let mut seen = BTreeSet::new();
    for name in cluster
        .topology()
        .shard_names()
        .map(str::to_owned)
        .collect::<Vec<_>>()
    {
        let db = cluster.connection(&name).unwrap();
        let rows = db
            .query_all_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT id, key_text, payload, state FROM shardkit_outbox",
            ))
            .await
            .unwrap();
        for r in rows {
            let id: String = r.try_get("", "id").unwrap();
            let key: String = r.try_get("", "key_text").unwrap();
            let owner = cluster
                .shard_of_now::<Holder>(&key.parse().unwrap())
                .unwrap()
                .unwrap();
            if owner != name || !seen.insert(id) {
                continue;
            }
            let payload: String = r.try_get("", "payload").unwrap();
            let c: Credit = serde_json::from_str(&payload).unwrap();
            // Applied by a relay that stopped before deleting it.
            if !by_transfer.contains_key(&c.transfer) {
                pending += c.amount;
            }
            parked += usize::from(r.try_get::<String>("", "state").unwrap() == "parked");
        }
    }
    Books {
        balances: wallets.iter().map(|w| w.balance).sum(),
        credits: by_transfer,
        pending,
        parked,
    }
}

/// Transfer id → (from, to, amount), every transfer attempted.
type Tried = BTreeMap<String, (i64, i64, i64)>;

/// Prints the wallets whose balance is not what the credits and the
/// outbox say it should be.
async fn explain(cluster: &Cluster, tried: &Tried) {
    let credits = cluster
        .find::<credit::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    let credited: BTreeSet<String> = credits.iter().map(|c| c.transfer.clone()).collect();
    let mut outbox = BTreeSet::new();
    for name in cluster
        .topology()
        .shard_names()
        .map(str::to_owned)
        .collect::<Vec<_>>()
    {
        let db = cluster.connection(&name).unwrap();
        for r in db
            .query_all_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT payload FROM shardkit_outbox",
            ))
            .await
            .unwrap()
        {
            let c: Credit =
                serde_json::from_str(&r.try_get::<String>("", "payload").unwrap()).unwrap();
            outbox.insert(c.transfer);
        }
    }
    let mut expect: BTreeMap<i64, i64> = (1..=ACCOUNTS).map(|i| (i, START)).collect();
    for (id, (from, to, amount)) in tried {
        if credited.contains(id) || outbox.contains(id) {
            *expect.get_mut(from).unwrap() -= amount;
        }
        if credited.contains(id) {
            *expect.get_mut(to).unwrap() += amount;
        }
    }
    for w in cluster
        .find::<wallet::Entity>()
        .scatter()
        .all()
        .await
        .unwrap()
    {
        if expect[&w.id] != w.balance {
            let bucket = shardkit::ShardKey::partition_hash(&w.id) % u64::from(BUCKETS);
            eprintln!(
                "wallet {} (bucket {bucket}, on {:?}): {} expected {}; transfers {:?}",
                w.id,
                cluster.shard_of_now::<Holder>(&w.id),
                w.balance,
                expect[&w.id],
                tried
                    .iter()
                    .filter(|(_, (f, t, _))| *f == w.id || *t == w.id)
                    .map(|(id, x)| (id, x, credited.contains(id), outbox.contains(id)))
                    .collect::<Vec<_>>()
            );
        }
    }
}

/// Delivers until no message is pending (at most `within`).
async fn drain(outbox: &shardkit::Outbox, cluster: &Cluster, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        outbox.deliver().await.unwrap();
        let status = outbox.status().await.unwrap();
        let left: u64 = status.shards.iter().map(|s| s.pending).sum();
        if left == 0 || tokio::time::Instant::now() > deadline {
            assert_eq!(left, 0, "messages still pending: {status:?}");
            let _ = cluster;
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const CHILD: &str = "SHARDKIT_OUTBOX_CHILD_CONFIG";

/// 16 tasks transfer between accounts on different keys while two
/// instances relay (one with relays dying after applying, before
/// deleting), another process relays and is killed with SIGKILL, a
/// quarter of the buckets move, and (on servers) one shard refuses
/// connections for a while and another hangs. Afterwards: balances plus
/// undelivered debits equal the start, then every acknowledged transfer
/// is credited exactly once, nothing is parked, nothing leaked.
async fn transfers_keep_the_money_under_faults_and_a_move(dbs: &mut TestDbs) {
    let _fp = FAILPOINTS.lock().await;
    let plain = toml(dbs, &[]);
    let b = connect(&plain).await;
    seed(&b).await;
    let servers = dbs.backend != Backend::Sqlite;
    let target = dbs.backend.server_address().unwrap_or_default();
    let (refusing, hanging) = if servers {
        (
            Some(Proxy::start(target.clone()).await),
            Some(Proxy::start(target.clone()).await),
        )
    } else {
        (None, None)
    };
    let through: Vec<(usize, u16)> = [(1, &refusing), (2, &hanging)]
        .into_iter()
        .filter_map(|(i, p)| p.as_ref().map(|p| (i, p.port)))
        .collect();
    let faulty = toml(dbs, &through);
    let a = connect(&faulty).await;
    let before = dbs.server_connections().await;

    // Relays: one per instance, the faulty instance's dying after applying
    // one message in five.
    fail::cfg(
        "shardkit::outbox::after_apply",
        &format!("20%return({})", dbs.scope()),
    )
    .unwrap();
    let relay_a = relay(&a).poll_every(Duration::from_millis(10)).run();
    let relay_b = relay(&b).poll_every(Duration::from_millis(10)).run();

    // Another process relays and is killed with SIGKILL while it does.
    let exe = std::env::current_exe().unwrap();
    let name = match dbs.backend {
        Backend::Sqlite => "child_relay::sqlite",
        Backend::Postgres => "child_relay::postgres",
        Backend::MySql => "child_relay::mysql",
    };
    let mut child = std::process::Command::new(exe)
        .args([name, "--exact", "--test-threads", "1"])
        .env(CHILD, &plain)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();

    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let tried: Arc<Mutex<Tried>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..16i64 {
        let (c, acked, stop) = (
            if t % 2 == 0 { a.clone() } else { b.clone() },
            acked.clone(),
            stop.clone(),
        );
        let tried = tried.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = t * 7919;
            while !stop.load(Ordering::SeqCst) {
                n = (n * 1_103_515_245 + 12_345) % 2_147_483_648;
                let from = n % ACCOUNTS + 1;
                let to = (n / ACCOUNTS) % ACCOUNTS + 1;
                if from == to {
                    continue;
                }
                // A transfer the shard refused, or whose commit is unknown
                // (a lost connection during it), is not acknowledged.
                let id = shardkit::uuid_v7().to_string();
                tried
                    .lock()
                    .unwrap()
                    .insert(id.clone(), (from, to, 1 + n % 10));
                if let Ok(id) = transfer_as(&c, id, from, to, 1 + n % 10).await {
                    acked.lock().unwrap().push(id);
                }
            }
        }));
    }

    // A quarter of the buckets move to s4 meanwhile.
    let mover = b
        .rebalance::<Holder>()
        .unwrap()
        .entity::<wallet::Entity>()
        .entity::<credit::Entity>();
    let quarter: Vec<u32> = (0..BUCKETS).filter(|b| b % 4 == 1).collect();
    let plan = mover.plan_buckets(quarter, "s4").await.unwrap();
    let started = mover.start(&plan).await.unwrap();
    let moving = tokio::spawn({
        let mover = mover.clone();
        async move { mover.run(started.id).await }
    });

    tokio::time::sleep(Duration::from_millis(600)).await;
    let _ = child.kill();
    let _ = child.wait();
    if let (Some(refusing), Some(hanging)) = (&refusing, &hanging) {
        refusing.kill();
        hanging.freeze();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        hanging.kill();
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Both come back on their ports.
        let r = Proxy::start_on(refusing.port, target.clone()).await;
        let h = Proxy::start_on(hanging.port, target.clone()).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        stop.store(true, Ordering::SeqCst);
        for t in tasks.drain(..) {
            t.await.unwrap();
        }
        std::mem::forget((r, h));
    } else {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.store(true, Ordering::SeqCst);
        for t in tasks.drain(..) {
            t.await.unwrap();
        }
    }
    let moved = moving
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("the move: {}", e.report()));
    assert_eq!(moved.phase, shardkit::rebalance::MovePhase::Done);
    a.refresh_bucket_maps().await.unwrap();
    b.refresh_bucket_maps().await.unwrap();

    // With the relays stopped mid-flight: the balances and the debits not
    // applied yet add up to the start.
    relay_a.stop();
    relay_b.stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    fail::remove("shardkit::outbox::after_apply");
    let mid = books(&b).await;
    if mid.balances + mid.pending != ACCOUNTS * START {
        let tried = tried.lock().unwrap().clone();
        explain(&b, &tried).await;
    }
    assert_eq!(
        mid.balances + mid.pending,
        ACCOUNTS * START,
        "money created or lost in flight"
    );
    let outbox = relay(&b);
    drain(&outbox, &b, Duration::from_secs(30)).await;

    let end = books(&b).await;
    assert_eq!(end.balances, ACCOUNTS * START, "the money invariant");
    assert_eq!((end.pending, end.parked), (0, 0));
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() > 100, "only {} transfers made", acked.len());
    for id in &acked {
        assert_eq!(end.credits.get(id), Some(&1), "transfer {id} credited once");
    }
    // Credits of transfers whose commit was unknown to the sender are
    // real transfers too; none is credited twice.
    assert!(
        end.credits.values().all(|&n| n == 1),
        "a transfer credited twice"
    );
    let statuses = outbox.status().await.unwrap();
    assert!(
        statuses
            .shards
            .iter()
            .all(|s| s.parked_count == 0 && s.error.is_none()),
        "{statuses:?}"
    );

    // Every row on its owner.
    for c in b.find::<credit::Entity>().scatter().all().await.unwrap() {
        let owner = b
            .shard_of_now::<Holder>(&c.wallet_id)
            .unwrap()
            .unwrap()
            .to_owned();
        let there = b
            .find::<credit::Entity>()
            .key(c.wallet_id)
            .all()
            .await
            .unwrap();
        assert!(
            there.iter().any(|x| x.id == c.id),
            "credit {} not on {owner}",
            c.id
        );
    }

    drop((relay_a, relay_b, outbox, mover));
    drop(a);
    drop(refusing);
    drop(hanging);
    dbs.assert_connections_settle(before + 12).await;
    drop(b);
}

/// The other process of the scenario above: relays until it is killed.
async fn child_relay(_dbs: &mut TestDbs) {
    let Ok(toml) = std::env::var(CHILD) else {
        return;
    };
    let cluster = connect(&toml).await;
    let _relay = relay(&cluster).poll_every(Duration::from_millis(5)).run();
    tokio::time::sleep(Duration::from_secs(60)).await;
}

#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
struct Order {
    buyer: i64,
    seller: i64,
    amount: i64,
}

#[derive(Debug)]
struct Refused(&'static str);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Refused {}

async fn add(tx: &shardkit::ShardTx<Holder>, amount: i64) -> Result<(), shardkit::BoxError> {
    let id = *tx.key();
    let w = tx
        .find::<wallet::Entity>()
        .lock_exclusive()
        .one()
        .await?
        .ok_or("no wallet")?;
    if w.balance + amount < 0 {
        return Err(Refused("insufficient funds").into());
    }
    tx.update(wallet::ActiveModel {
        id: Set(id),
        balance: Set(w.balance + amount),
    })
    .await?;
    Ok(())
}

/// A saga `name` whose first step debits the buyer, its undo crediting
/// the amount back.
fn buyer_pays(name: &'static str) -> Saga<Holder, Order> {
    Saga::new(name).step::<Holder, _, _, _, _, _, _, _>(
        |o: &Order| o.buyer,
        |tx, o: Order| async move { add(&tx, -o.amount).await },
        |tx, o: Order| async move { add(&tx, o.amount).await },
    )
}

fn order_saga() -> Saga<Holder, Order> {
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

async fn balance(cluster: &Cluster, id: i64) -> i64 {
    cluster
        .find::<wallet::Entity>()
        .key(id)
        .one()
        .await
        .unwrap()
        .unwrap()
        .balance
}

/// The second step is refused (the seller cannot pay): the first is
/// undone once, also when the process dies after the compensation
/// committed and before the saga saved it.
async fn a_saga_whose_step_is_refused_is_compensated_once(dbs: &mut TestDbs) {
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
}

/// 8 concurrent retries of one request id run the work once and all get
/// its outcome; another id runs again; a failed run stores nothing.
async fn concurrent_retries_of_a_request_run_it_once(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    open_wallet(&cluster, 7, 0).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let pay = |cluster: Cluster, runs: Arc<AtomicUsize>, request: &'static str| async move {
        cluster
            .transaction_once::<Holder, (i64, String), _>(7, request, |tx| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let w = tx
                        .find::<wallet::Entity>()
                        .lock_exclusive()
                        .one()
                        .await?
                        .unwrap();
                    tx.update(wallet::ActiveModel {
                        id: Set(7),
                        balance: Set(w.balance + 5),
                    })
                    .await?;
                    Ok((w.balance + 5, shardkit::uuid_v7().to_string()))
                }
            })
            .await
    };
    // 8 retries of req-1 at once through `cluster`: their outcomes.
    let eight = |cluster: &Cluster| {
        let tasks: Vec<_> = (0..8)
            .map(|_| tokio::spawn(pay(cluster.clone(), runs.clone(), "req-1")))
            .collect();
        async move {
            let mut outcomes = Vec::new();
            for t in tasks {
                outcomes.push(
                    t.await
                        .unwrap()
                        .unwrap_or_else(|e| panic!("{}", e.report())),
                );
            }
            outcomes
        }
    };
    let outcomes = eight(&cluster).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");
    assert!(outcomes.iter().all(|o| *o == outcomes[0]), "{outcomes:?}");
    assert_eq!(balance(&cluster, 7).await, 5);
    let again = pay(cluster.clone(), runs.clone(), "req-2").await.unwrap();
    assert_eq!((again.0, runs.load(Ordering::SeqCst)), (10, 2));
    // A failing run stores nothing: its retry runs.
    let failed = cluster
        .transaction_once::<Holder, i64, _>(7, "req-3", |_tx| async {
            Err(ShardError::Internal {
                what: "boom".into(),
            })
        })
        .await;
    assert!(matches!(failed, Err(ShardError::Internal { .. })));
    let third = pay(cluster.clone(), runs.clone(), "req-3").await.unwrap();
    assert_eq!(third.0, 15);
    // Bad ids are refused before anything runs.
    let long = "x".repeat(201);
    let err = cluster
        .transaction_once::<Holder, i64, _>(7, &long, |_tx| async { Ok(1) })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::CrossKey { .. }), "{err}");
    assert!(err.to_string().contains("1 to 200 characters"), "{err}");
    let err = cluster
        .transaction_once::<Holder, i64, _>(7, "req-1 ", |_tx| async { Ok(1) })
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("does not end with a space"),
        "{err}"
    );
    // An outcome too big to store is refused, and the work rolled back.
    let big = cluster
        .transaction_once::<Holder, String, _>(7, "req-big", |tx| async move {
            tx.update(wallet::ActiveModel {
                id: Set(7),
                balance: Set(-1),
            })
            .await?;
            Ok("x".repeat(70_000))
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&big, ShardError::CrossKey { reason, .. } if reason.starts_with("its outcome is 70002 bytes of JSON")),
        "{big}"
    );
    assert_eq!(balance(&cluster, 7).await, 15, "nothing was committed");
    // Work that swallows a failed statement: PostgreSQL ended the
    // transaction, and the refusal carries the database's own words.
    if dbs.backend == Backend::Postgres {
        let ended = cluster
            .transaction_once::<Holder, i64, _>(7, "req-swallowed", |tx| async move {
                let _ = tx
                    .unchecked_connection()
                    .execute_unprepared("SELECT * FROM no_such_table")
                    .await;
                Ok(1)
            })
            .await
            .unwrap_err();
        let text = ended.to_string();
        assert!(
            text.contains("the work returned Ok on a transaction the database had ended")
                && text.contains("current transaction is aborted"),
            "{text}"
        );
    }
    // Work that handles a deadlock's error itself and returns Ok: the
    // database ended that run, so nothing of it is stored and it runs
    // again; a retry of the request then gets the second run's outcome.
    if dbs.backend != Backend::Sqlite {
        let shard = cluster.shard_of::<Holder>(&7).await.unwrap().to_owned();
        shardkit_tests::models::create_aborting_function(cluster.connection(&shard).unwrap()).await;
        // Then the same, the work returning the refusal of its next write.
        for (request, then_write) in [("req-aborted", false), ("req-aborted-write", true)] {
            let ran = Arc::new(AtomicUsize::new(0));
            let counted = Arc::clone(&ran);
            let outcome = cluster
                .transaction_once::<Holder, usize, _>(7, request, move |tx| {
                    let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
                    async move {
                        if run == 1 {
                            swallow_an_abort(&tx).await;
                        }
                        if then_write {
                            tx.update(wallet::ActiveModel {
                                id: Set(7),
                                balance: Set(15),
                            })
                            .await?;
                        }
                        Ok(run)
                    }
                })
                .await
                .unwrap();
            assert_eq!((outcome, ran.load(Ordering::SeqCst)), (2, 2), "{request}");
            let again = cluster
                .transaction_once::<Holder, usize, _>(7, request, |_| async { Ok(99) })
                .await
                .unwrap();
            assert_eq!(again, 2, "{request}: the second run's stored outcome");
        }
    }
    // To an instance a day and an hour ahead, req-1's outcome expired: 8
    // retries of it at once run the work once more (MySQL/MariaDB: a
    // retry's delete of the expired row must not take another's new
    // claim), and all get that run's outcome.
    let ahead = Arc::new(shardkit::clock::ManualClock::new(
        shardkit::Clock::now_millis(&shardkit::clock::SystemClock) + 25 * 3_600_000,
    ));
    let later = Cluster::builder(ClusterConfig::from_toml(&toml(dbs, &[])).unwrap())
        .clock(ahead)
        .connect()
        .await
        .unwrap();
    later.refresh_bucket_maps().await.unwrap();
    let outcomes = eight(&later).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        4,
        "the expired request ran once more"
    );
    assert!(outcomes.iter().all(|o| *o == outcomes[0]), "{outcomes:?}");
    assert_eq!(outcomes[0].0, 20);

    // The running relay of an instance two days ahead prunes them all
    // (after its deletes of expired inbox ids and finished sagas, which
    // run first: a failing one would leave the outcomes).
    let stored = shardkit_tests::count_rows(&cluster, "shardkit_requests").await;
    assert!(stored >= 3, "{stored}");
    let ahead = Arc::new(shardkit::clock::ManualClock::new(
        shardkit::Clock::now_millis(&shardkit::clock::SystemClock) + 50 * 3_600_000,
    ));
    let pruner = Cluster::builder(ClusterConfig::from_toml(&toml(dbs, &[])).unwrap())
        .clock(ahead.clone())
        .connect()
        .await
        .unwrap();
    let running = relay(&pruner).poll_every(Duration::from_millis(5)).run();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while shardkit_tests::count_rows(&cluster, "shardkit_requests").await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "expired outcomes not pruned"
        );
        // A shard's prune runs once a minute of its clock: a slow first
        // one is tried again.
        ahead.advance(Duration::from_secs(61));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.stop();
}

/// Sends a credit of `amount` from `from` to `to` in a transaction of its
/// own; its message id.
async fn send_credit(cluster: &Cluster, from: i64, to: i64, seq: i64, amount: i64) -> String {
    cluster
        .transaction::<Holder, _, _>(from, |tx| async move {
            let credit = Credit {
                transfer: format!("t{seq}"),
                amount,
                seq,
            };
            tx.send(to, &credit).await
        })
        .await
        .unwrap()
}

/// The parked messages every shard's outbox lists.
async fn all_parked(outbox: &shardkit::Outbox) -> Vec<shardkit::ParkedMessage> {
    let status = outbox.status().await.unwrap();
    status
        .shards
        .iter()
        .flat_map(|s| s.parked.clone())
        .collect()
}

/// Panics whose message is `expected` are not printed (the scenario
/// makes them on purpose); every other panic is, as before.
fn quiet_panics(expected: &'static str) {
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| {
        let print = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&expected) {
                print(info);
            }
        }));
    });
}

/// A handler that fails for one amount parks its message after the
/// attempts; the status lists it; retry and discard work on it; the other
/// messages of the pair are applied in the order they were sent.
async fn parked_messages_are_listed_retried_and_discarded_and_order_holds(dbs: &mut TestDbs) {
    let metrics = shardkit_tests::recorded::totals();
    // A group whose buckets never move: the sender's outbox rows change
    // with one statement each, not in a fenced transaction (the transfers
    // scenario covers the movable path).
    let cluster = connect(&toml(dbs, &[]).replace("movable = true", "movable = false")).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 0).await;
    }
    let fail_13 = Arc::new(AtomicBool::new(true));
    let seen_3 = Arc::new(AtomicBool::new(false));
    let outbox = {
        let fail_13 = fail_13.clone();
        let seen_3 = seen_3.clone();
        relay(&cluster)
            .max_attempts(2)
            .backoff(Duration::ZERO, Duration::ZERO)
            .handle::<Credit, _, _, _>(move |tx, c: Credit| {
                let fail_13 = fail_13.load(Ordering::SeqCst);
                // The 3rd message fails its first attempt: the ones after
                // it wait for it.
                let first_of_3 = c.seq == 3 && !seen_3.swap(true, Ordering::SeqCst);
                async move {
                    if first_of_3 {
                        return Err(shardkit::BoxError::from("not yet"));
                    }
                    if c.amount == 13 && fail_13 {
                        return Err(shardkit::BoxError::from("thirteen is unlucky"));
                    }
                    if c.amount == 66 {
                        quiet_panics("sixty-six");
                        panic!("sixty-six");
                    }
                    apply_credit(&tx, c).await
                }
            })
            .handle::<Gift, _, _, _>(|_tx, _g: Gift| async { Ok::<(), shardkit::BoxError>(()) })
    };
    // 20 messages from 1 to 2, each in its own transaction; the 5th is 13.
    let mut parked_id = String::new();
    for seq in 1..=20 {
        let amount = if seq == 5 { 13 } else { 1 };
        let id = send_credit(&cluster, 1, 2, seq, amount).await;
        if seq == 5 {
            parked_id = id;
        }
    }
    let report = outbox.deliver().await.unwrap();
    assert_eq!(
        (report.applied, report.parked, report.failed),
        (19, 1, 3),
        "{report:?}"
    );
    let seqs: Vec<i64> = {
        let mut credits = cluster.find::<credit::Entity>().key(2).all().await.unwrap();
        credits.sort_by(|a, b| a.id.cmp(&b.id));
        credits.iter().map(|c| c.seq).collect()
    };
    assert_eq!(
        seqs,
        (1..=20).filter(|&s| s != 5).collect::<Vec<_>>(),
        "applied in order"
    );
    let parked = all_parked(&outbox).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].id, parked_id);
    assert_eq!(parked[0].attempts, 2);
    assert_eq!(parked[0].last_error.as_deref(), Some("thirteen is unlucky"));
    // Retry: applied once the handler accepts it.
    fail_13.store(false, Ordering::SeqCst);
    // A pending message is neither retried nor discarded.
    let unknown = outbox.discard("no-such-id").await.unwrap_err();
    assert!(
        unknown.to_string().contains("no shard's outbox holds it"),
        "{unknown}"
    );
    // On servers: with a shard that does not hold it refusing connections,
    // the message is still retried (an outage is when operators clear
    // parked messages); an id no readable shard holds fails with the down
    // shard's error (it may hold it).
    let holder = cluster.shard_of::<Holder>(&1).await.unwrap().to_owned();
    match dbs.backend.server_address() {
        Some(server) => {
            let down = (0..5).find(|i| format!("s{i}") != holder).unwrap();
            let proxy = Proxy::start(server).await;
            let partial = connect(&toml(dbs, &[(down, proxy.port)])).await;
            proxy.killed().await;
            let partial = partial.outbox().message::<Credit>();
            let unknown = partial.discard("no-such-id").await.unwrap_err();
            assert!(
                matches!(&unknown, ShardError::Unavailable { shard, .. } if *shard == format!("s{down}")),
                "{}",
                unknown.report()
            );
            partial
                .retry(&parked_id)
                .await
                .unwrap_or_else(|e| panic!("retry with s{down} down: {}", e.report()));
        }
        None => outbox.retry(&parked_id).await.unwrap(),
    }
    let err = outbox.retry(&parked_id).await.unwrap_err();
    assert!(err.to_string().contains("not parked"), "{err}");
    assert_eq!(outbox.deliver().await.unwrap().applied, 1);
    assert_eq!(balance(&cluster, 2).await, 19 + 13);
    // Discard: parked, then gone without being applied.
    fail_13.store(true, Ordering::SeqCst);
    let id = send_credit(&cluster, 1, 2, 21, 13).await;
    assert_eq!(outbox.deliver().await.unwrap().parked, 1);
    outbox.discard(&id).await.unwrap();
    assert_eq!(
        outbox.deliver().await.unwrap(),
        shardkit::RelayReport::default()
    );
    assert_eq!(balance(&cluster, 2).await, 32);
    // A handler that panics fails the attempt as an error would: parked
    // after its attempts with the panic's message, nothing applied, and
    // the message sent after it is applied (the relay goes on).
    let id = send_credit(&cluster, 1, 2, 24, 66).await;
    send_credit(&cluster, 1, 2, 25, 1).await;
    let report = outbox.deliver().await.unwrap();
    assert_eq!((report.applied, report.parked), (1, 1), "{report:?}");
    let parked = all_parked(&outbox).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].id, id);
    assert_eq!(
        parked[0].last_error.as_deref(),
        Some("the handler panicked: sixty-six")
    );
    outbox.discard(&id).await.unwrap();
    assert_eq!(balance(&cluster, 2).await, 33);
    // A message to a key no shard holds (outside every range) counts its
    // attempts like a failed handler and is parked after them, naming the
    // key, instead of being put off for ever.
    let id = cluster
        .transaction::<Holder, _, _>(1, |tx| async move {
            tx.send(NO_SHARD, &Gift { amount: 5 }).await
        })
        .await
        .unwrap();
    let report = outbox.deliver().await.unwrap();
    assert_eq!(
        (report.failed, report.parked, report.deferred),
        (2, 1, 0),
        "{report:?}"
    );
    let parked = all_parked(&outbox).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(
        (parked[0].id.as_str(), parked[0].attempts),
        (id.as_str(), 2)
    );
    assert!(
        parked[0].last_error.as_deref().is_some_and(
            |e| e.starts_with(&format!("cannot route group `Account` key {NO_SHARD}: "))
        ),
        "{:?}",
        parked[0].last_error
    );
    outbox.discard(&id).await.unwrap();
    let status = outbox.status().await.unwrap();
    assert!(
        status
            .shards
            .iter()
            .all(|s| s.pending == 0 && s.parked_count == 0),
        "{status:?}"
    );
    // The metrics count the failed attempts, the parking and the lag.
    assert!(metrics.counter("shardkit_outbox_retries_total{kind=credit}") >= 2);
    assert!(metrics.counter("shardkit_outbox_parked_total{kind=credit}") >= 1);
    assert!(
        metrics
            .samples("shardkit_outbox_delivery_lag_seconds{kind=credit}")
            .len()
            >= 20,
        "{:?}",
        metrics.all_keys()
    );
    // The command line lists a parked message and retries it.
    fail_13.store(true, Ordering::SeqCst);
    let id = send_credit(&cluster, 1, 2, 23, 13).await;
    assert_eq!(outbox.deliver().await.unwrap().parked, 1);
    let shardctl = |args: &'static [&'static str]| {
        let config = ClusterConfig::from_toml(&toml(dbs, &[])).unwrap();
        async move {
            let mut out: Vec<u8> = Vec::new();
            let registry = shardkit::cli::Registry::new().outbox(|o| o.message::<Credit>());
            let argv = ["shardctl", "--json"].iter().chain(args).copied();
            let code = shardkit::cli::run_with(argv, config, registry, &mut out).await;
            (
                code,
                serde_json::from_slice::<serde_json::Value>(&out).unwrap(),
            )
        }
    };
    let (code, status) = shardctl(&["outbox", "status"]).await;
    assert_eq!(code, 1, "a parked message is a problem: {status}");
    let listed: Vec<&str> = status["shards"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["parked"].as_array().unwrap())
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, [id.as_str()]);
    let argv: &'static [&'static str] = Box::leak(Box::new([
        "outbox",
        "discard",
        Box::leak(id.into_boxed_str()),
    ]));
    let (code, out) = shardctl(argv).await;
    assert_eq!(code, 0, "{out}");
    let (code, status) = shardctl(&["outbox", "status"]).await;
    assert_eq!(code, 0, "{status}");
    let (code, sagas) = shardctl(&["saga", "status"]).await;
    assert_eq!((code, sagas), (0, serde_json::json!([])));
    // A message that rolls back with its transaction is never sent.
    let _ = cluster
        .transaction::<Holder, (), _>(1, |tx| async move {
            tx.send(
                2,
                &Credit {
                    transfer: "t22".into(),
                    amount: 1,
                    seq: 22,
                },
            )
            .await?;
            Err(ShardError::Internal {
                what: "rolled back".into(),
            })
        })
        .await;
    assert_eq!(
        outbox.deliver().await.unwrap(),
        shardkit::RelayReport::default()
    );
    // A handler slower than the step timeout: cut off, its transaction
    // rolled back, and put off by the backoff without counting an attempt
    // (not run again back to back, holding the receiving key's rows).
    let slow = relay(&cluster)
        .step_timeout(Duration::from_millis(300))
        .backoff(Duration::from_secs(60), Duration::from_secs(60))
        .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
            if c.amount == 77 {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            apply_credit(&tx, c).await
        });
    let id = send_credit(&cluster, 1, 2, 26, 77).await;
    let report = slow.deliver().await.unwrap();
    assert_eq!((report.applied, report.deferred), (0, 1), "{report:?}");
    let shard = cluster.shard_of::<Holder>(&1).await.unwrap();
    let db = cluster.connection(shard).unwrap();
    let row = db
        .query_one_raw(sea_orm::Statement::from_sql_and_values(
            db.get_database_backend(),
            match db.get_database_backend() {
                sea_orm::DbBackend::Postgres => {
                    "SELECT attempts, next_at, last_error FROM shardkit_outbox WHERE id = $1"
                }
                _ => "SELECT attempts, next_at, last_error FROM shardkit_outbox WHERE id = ?",
            },
            [id.clone().into()],
        ))
        .await
        .unwrap()
        .expect("the message is pending");
    let attempts: i32 = row.try_get("", "attempts").unwrap();
    let next_at: i64 = row.try_get("", "next_at").unwrap();
    let error: Option<String> = row.try_get("", "last_error").unwrap();
    assert_eq!(attempts, 0);
    assert!(
        next_at as u64 > shardkit::Clock::now_millis(cluster.clock().as_ref()) + 50_000,
        "not put off: next_at {next_at}"
    );
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.starts_with("not applied within the step timeout (300ms)")),
        "{error:?}"
    );
    assert_eq!(
        slow.deliver().await.unwrap(),
        shardkit::RelayReport::default()
    );
    assert_eq!(balance(&cluster, 2).await, 33);
}

/// One sending key with more messages waiting than a pass reads (its
/// first one failed and backs off for a minute, the rest of its pair wait
/// behind it) holds up neither the keys after it on its shard nor its own
/// messages to another receiver, sent after them (applied in order), also
/// for the running relay while 8 tasks send.
async fn a_sender_with_a_backlog_hides_no_other_sender(dbs: &mut TestDbs) {
    let before = dbs.server_connections().await;
    let cluster = connect(&toml(dbs, &[]).replace("movable = true", "movable = false")).await;
    cluster.migrate::<Migrator>().await.unwrap();
    open_wallet(&cluster, 2, 0).await;
    open_wallet(&cluster, 3, 0).await;
    // A sender after key 1 in the outbox's order, on key 1's shard.
    let shard = cluster.shard_of::<Holder>(&1).await.unwrap().to_owned();
    let mut later = 10;
    while cluster.shard_of::<Holder>(&later).await.unwrap() != shard {
        later += 1;
    }
    // 2,001 messages of key 1 (a pass reads 2,000 per shard), the first
    // of them refused.
    cluster
        .transaction::<Holder, _, _>(1, |tx| async move {
            for seq in 1..=2001 {
                let amount = if seq == 1 { 13 } else { 1 };
                let credit = Credit {
                    transfer: format!("t{seq}"),
                    amount,
                    seq,
                };
                tx.send(2, &credit).await?;
            }
            Ok(())
        })
        .await
        .unwrap();
    send_credit(&cluster, later, 2, 1, 100).await;
    send_credit(&cluster, 1, 3, 1, 50).await;
    send_credit(&cluster, 1, 3, 2, 60).await;
    let outbox = relay(&cluster)
        .backoff(Duration::from_secs(60), Duration::from_secs(60))
        .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
            if c.amount == 13 {
                return Err(shardkit::BoxError::from("thirteen is unlucky"));
            }
            apply_credit(&tx, c).await
        });
    let report = outbox.deliver().await.unwrap();
    assert_eq!((report.applied, report.failed), (3, 1), "{report:?}");
    assert_eq!(balance(&cluster, 2).await, 100, "the later sender's credit");
    assert_eq!(balance(&cluster, 3).await, 110, "key 1's credits to key 3");
    let mut to_three: Vec<credit::Model> =
        cluster.find::<credit::Entity>().key(3).all().await.unwrap();
    // Ids are uuid v7: the order they were applied in.
    to_three.sort_by(|a, b| a.id.cmp(&b.id));
    let order: Vec<i64> = to_three.iter().map(|c| c.seq).collect();
    assert_eq!(order, [1, 2], "key 1's credits to key 3, in order");
    let pending: u64 = outbox
        .status()
        .await
        .unwrap()
        .shards
        .iter()
        .map(|s| s.pending)
        .sum();
    assert_eq!(pending, 2001, "key 1's messages wait, in order");

    // The running relay, while 8 tasks on pools of 2 send: 4 from key 1 to
    // key 3, after its backlog, and 4 from the later key to key 2.
    let running = outbox.clone().poll_every(Duration::from_millis(5)).run();
    let senders: Vec<_> = (0..8)
        .map(|t| {
            let cluster = cluster.clone();
            tokio::spawn(async move {
                let (from, to) = if t < 4 { (1, 3) } else { (later, 2) };
                for n in 0..5 {
                    send_credit(&cluster, from, to, 10 + t * 5 + n, 1).await;
                }
            })
        })
        .collect();
    for sender in senders {
        sender.await.unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while (balance(&cluster, 3).await, balance(&cluster, 2).await) != (130, 120) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the running relay applied {} and {} of 20 credits each",
            balance(&cluster, 3).await - 110,
            balance(&cluster, 2).await - 100
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.stop();
    while !running.is_finished() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Each task's credits, applied in the order it sent them.
    for (to, tasks) in [(3, 0..4), (2, 4..8)] {
        let mut applied: Vec<credit::Model> = cluster
            .find::<credit::Entity>()
            .key(to)
            .all()
            .await
            .unwrap();
        applied.sort_by(|a, b| a.id.cmp(&b.id));
        for t in tasks {
            let sent = 10 + t * 5..15 + t * 5;
            let seqs: Vec<i64> = applied
                .iter()
                .map(|c| c.seq)
                .filter(|seq| sent.contains(seq))
                .collect();
            assert_eq!(seqs, sent.collect::<Vec<_>>(), "task {t}'s credits to {to}");
        }
    }
    drop((outbox, cluster));
    dbs.assert_connections_settle(before).await;
}

/// Relays with different handlers: one that has no handler for a pair's
/// first message does not apply the pair's later ones before another
/// relay applies it.
async fn a_pair_waits_for_its_message_another_relay_applies(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[]).replace("movable = true", "movable = false")).await;
    cluster.migrate::<Migrator>().await.unwrap();
    open_wallet(&cluster, 2, 0).await;
    cluster
        .transaction::<Holder, _, _>(1, |tx| async move {
            tx.send(2, &Memo { amount: 7 }).await?;
            let credit = Credit {
                transfer: "after the memo".to_owned(),
                amount: 100,
                seq: 1,
            };
            tx.send(2, &credit).await
        })
        .await
        .unwrap();
    let credits = cluster
        .outbox()
        .handle::<Credit, _, _, _>(|tx, c: Credit| async move { apply_credit(&tx, c).await });
    let memos = cluster
        .outbox()
        .handle::<Memo, _, _, _>(|tx, m: Memo| async move { add(&tx, m.amount).await });
    let report = credits.deliver().await.unwrap();
    assert_eq!(report.applied, 0, "{report:?}");
    assert_eq!(
        balance(&cluster, 2).await,
        0,
        "the credit waits for the memo"
    );
    assert_eq!(memos.deliver().await.unwrap().applied, 1);
    assert_eq!(balance(&cluster, 2).await, 7);
    assert_eq!(credits.deliver().await.unwrap().applied, 1);
    assert_eq!(balance(&cluster, 2).await, 107);
}

/// A handler that sends a message on, from the key it received on into
/// that key's shard's outbox: one `deliver` applies both, though that
/// shard had nothing to deliver when it was first read.
async fn a_message_a_handler_sends_goes_in_the_same_deliver(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[]).replace("movable = true", "movable = false")).await;
    cluster.migrate::<Migrator>().await.unwrap();
    let first = cluster.shard_of::<Holder>(&1).await.unwrap().to_owned();
    let mut mid = 2;
    while cluster.shard_of::<Holder>(&mid).await.unwrap() == first {
        mid += 1;
    }
    for id in [1, mid] {
        open_wallet(&cluster, id, 0).await;
    }
    let outbox = relay(&cluster).handle::<Credit, _, _, _>(|tx, c: Credit| async move {
        if c.amount == 7 {
            let on = Credit {
                transfer: "forwarded".to_owned(),
                amount: 1,
                seq: 1,
            };
            tx.send(1, &on).await?;
        }
        apply_credit(&tx, c).await
    });
    send_credit(&cluster, 1, mid, 1, 7).await;
    let report = outbox.deliver().await.unwrap();
    assert_eq!(report.applied, 2, "{report:?}");
    assert_eq!(
        (balance(&cluster, mid).await, balance(&cluster, 1).await),
        (7, 1)
    );
}

/// A handler that swallows a failed statement and returns `Ok` on
/// PostgreSQL, whose transaction is then aborted (its COMMIT would roll
/// back without an error): the message is not taken for applied, nothing
/// is credited, and the parked message says why.
async fn a_handler_that_swallows_a_failed_statement_commits_nothing(dbs: &mut TestDbs) {
    let why = parked_at_once(dbs, |cluster| {
        cluster
            .outbox()
            .max_attempts(1)
            .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
                apply_credit(&tx, c).await?;
                let _ignored = tx
                    .unchecked_connection()
                    .execute_unprepared("SELECT * FROM no_such_table")
                    .await;
                Ok::<_, shardkit::BoxError>(())
            })
    })
    .await;
    assert!(
        why.contains("returned Ok on a transaction the database had ended")
            && why.contains("25P02"),
        "{why}"
    );
}

/// Sends one credit from wallet 1 to wallet 2 and delivers it through
/// `relay`'s outbox, whose handler fails: nothing is credited, the message
/// is parked at once; its last error.
async fn parked_at_once(dbs: &TestDbs, relay: fn(&Cluster) -> shardkit::Outbox) -> String {
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 0).await;
    }
    let outbox = relay(&cluster);
    let id = send_credit(&cluster, 1, 2, 1, 5).await;
    let report = outbox.deliver().await.unwrap();
    assert_eq!((report.applied, report.parked), (0, 1), "{report:?}");
    assert_eq!(balance(&cluster, 2).await, 0, "nothing credited");
    let parked = all_parked(&outbox).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].id, id);
    parked[0].last_error.clone().unwrap_or_default()
}

/// A message applied before whose sender's row was not deleted then (the
/// relay stopped between the two) is delivered again; its handler refuses
/// it, having done the work ("already credited", as a unique transfer id
/// would). It is a duplicate, deleted, not a failure counted and parked
/// (on PostgreSQL, where the inbox row is checked after the handler, it
/// was parked with the handler's error).
async fn a_message_applied_before_that_its_handler_refuses_is_not_parked(dbs: &mut TestDbs) {
    use sea_orm::{ColumnTrait, QueryFilter};
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 0).await;
    }
    let outbox =
        cluster
            .outbox()
            .max_attempts(1)
            .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
                let done = tx
                    .find::<credit::Entity>()
                    .filter(credit::Column::Transfer.eq(c.transfer.clone()))
                    .one()
                    .await?;
                if done.is_some() {
                    return Err(format!("transfer {} already credited", c.transfer).into());
                }
                apply_credit(&tx, c).await
            });
    let id = send_credit(&cluster, 1, 2, 1, 5).await;
    {
        let _turn = FAILPOINTS.lock().await;
        fail::cfg(
            "shardkit::outbox::after_apply",
            &format!("return({})", dbs.scope()),
        )
        .unwrap();
        let stopped = outbox.deliver().await;
        fail::remove("shardkit::outbox::after_apply");
        stopped.unwrap();
    }
    assert_eq!(balance(&cluster, 2).await, 5, "applied once");
    let again = outbox.deliver().await.unwrap();
    assert_eq!(
        (again.applied, again.duplicates, again.parked),
        (0, 1, 0),
        "{again:?}"
    );
    assert_eq!(balance(&cluster, 2).await, 5, "applied once");
    assert!(all_parked(&outbox).await.is_empty());
    let status = outbox.status().await.unwrap();
    let pending: u64 = status.shards.iter().map(|s| s.pending).sum();
    assert_eq!(pending, 0, "message {id} still pending: {status:?}");
}

/// A message whose sending key this release cannot read (the group's key
/// type changed between releases; here the row's key text is set by hand)
/// is applied once and its row deleted on the shard it was read from: the
/// row used to be deleted in a transaction of its key, which could not
/// begin, so the message was found a duplicate again at every pass, with a
/// debug line only. (Such a key has no bucket a move could take.)
async fn a_message_whose_sending_key_cannot_be_read_is_applied_once(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, &[])).await;
    cluster.migrate::<Migrator>().await.unwrap();
    for id in [1, 2] {
        open_wallet(&cluster, id, 0).await;
    }
    let id = send_credit(&cluster, 1, 2, 1, 5).await;
    let shard = cluster.shard_of::<Holder>(&1).await.unwrap().to_owned();
    cluster
        .connection(&shard)
        .unwrap()
        .execute_unprepared(&format!(
            "UPDATE shardkit_outbox SET key_text = 'not-a-key' WHERE id = '{id}'"
        ))
        .await
        .unwrap();
    let outbox = relay(&cluster);
    let report = outbox.deliver().await.unwrap();
    assert_eq!(
        (report.applied, report.duplicates, report.parked),
        (1, 0, 0),
        "{report:?}"
    );
    assert_eq!(balance(&cluster, 2).await, 5);
    let again = outbox.deliver().await.unwrap();
    assert_eq!((again.applied, again.duplicates), (0, 0), "{again:?}");
    assert_eq!(balance(&cluster, 2).await, 5, "applied once");
    assert!(all_parked(&outbox).await.is_empty());
    let status = outbox.status().await.unwrap();
    let pending: u64 = status.shards.iter().map(|s| s.pending).sum();
    assert_eq!(pending, 0, "{status:?}");
}

/// A saga step that panics is refused like one that returns an error: the
/// steps before it are undone, the saga says why, and the next saga runs
/// (the panic used to end `start`, and every `resume` after, at it).
async fn a_saga_step_that_panics_is_refused_and_compensated(dbs: &mut TestDbs) {
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

/// A handler that swallows a refusal of shardkit's (a write of another
/// key's row, which leaves its transaction rollback-only) and returns `Ok`:
/// nothing is committed, and the delivery is a failure counted and parked
/// with the reason, not put off at every pass for good. (Its relay's
/// durations are `Duration::MAX`, "no bound": taken as a year, they
/// panicked computing a deadline.)
async fn a_handler_that_swallows_a_refusal_is_parked(dbs: &mut TestDbs) {
    let why = parked_at_once(dbs, |cluster| {
        cluster
            .outbox()
            .max_attempts(1)
            .step_timeout(Duration::MAX)
            .backoff(Duration::MAX, Duration::MAX)
            .handle::<Credit, _, _, _>(|tx, c: Credit| async move {
                apply_credit(&tx, c).await?;
                let _ignored = tx
                    .insert(wallet::ActiveModel {
                        id: Set(*tx.key() + 1000),
                        balance: Set(1),
                    })
                    .await;
                Ok::<_, shardkit::BoxError>(())
            })
    })
    .await;
    assert!(why.contains("rollback-only"), "{why}");
}

/// Reads wallet `id` through `aborts()`, which makes the database abort the
/// transaction the way a deadlock does, and swallows the error, as a
/// handler or a step that handles a deadlock itself might.
async fn swallow_an_abort(tx: &shardkit::ShardTx<Holder>) {
    let aborted = tx
        .find::<wallet::Entity>()
        .filter(sea_orm::sea_query::Expr::cust("aborts() = 1"))
        .all()
        .await;
    assert!(aborted.is_err(), "{aborted:?}");
}

/// Wallets 1 and 2 with `balance`, and `aborts()` on wallet 2's shard
/// (see [`swallow_an_abort`]).
async fn wallets_and_aborts(cluster: &Cluster, balance: i64) {
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
async fn a_handler_that_swallows_an_abort_runs_again(dbs: &mut TestDbs) {
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
async fn a_saga_step_that_swallows_an_abort_is_tried_again(dbs: &mut TestDbs) {
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
async fn bump(tx: &shardkit::ShardTx<Holder>, id: &str, by: i64) -> shardkit::Result<u64> {
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
async fn deadlock_timeout(tx: &shardkit::ShardTx<Holder>, ms: u32) {
    let conn = tx.unchecked_connection();
    if conn.get_database_backend() == sea_orm::DbBackend::Postgres {
        conn.execute_unprepared(&format!("SET LOCAL deadlock_timeout = {ms}"))
            .await
            .expect("SET LOCAL deadlock_timeout");
    }
}

/// Wallets 1 and 2, and two counters of wallet 2 (credit rows `a` and
/// `b`, amount 0) for [`lose_a_deadlock`] and [`heavier_writer`].
async fn two_counters(cluster: &Cluster) {
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
async fn counters(cluster: &Cluster) -> BTreeMap<String, i64> {
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
async fn lose_a_deadlock(
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
fn heavier_writer(
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
async fn a_handler_that_loses_a_real_deadlock_runs_again(dbs: &mut TestDbs) {
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
async fn a_request_that_loses_a_real_deadlock_runs_again(dbs: &mut TestDbs) {
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
