//! Work that spans keys: the `outbox` test binary, its models, messages and
//! shared steps here, its scenarios in these files:
//!
//! - `transfers.rs`: transfers between accounts through the outbox under
//!   faults (relays dying mid-delivery, two relays, a relay process killed,
//!   a shard refusing and one hanging, a bucket move).
//! - `relay.rs`: parked messages, order, backlogs, racing relays, and
//!   handlers that fail, panic, or swallow a failed statement or a refusal.
//! - `sagas.rs`: a saga whose step is refused, a step that panics.
//! - `requests.rs`: concurrent retries of one request (`transaction_once`).
//! - `aborts.rs`: transactions the database aborted (a deadlock, real or
//!   raised) that handlers, saga steps and requests ran again.

use sea_orm::{ActiveValue::Set, ConnectionTrait, QueryFilter, QuerySelect};
use shardkit::{Cluster, ClusterConfig, Message, Saga, SagaState, ShardError};
use shardkit_tests::{Backend, Proxy, TestDbs, backend_tests};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod aborts;
mod relay;
mod requests;
mod sagas;
mod transfers;

use aborts::*;
use relay::*;
use requests::*;
use sagas::*;
use transfers::*;

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

/// Sets `set` (SQL) on the row `id` of shardkit's `table`, on whichever
/// shard holds it (an edit by hand, a release that wrote what this one does
/// not read, a clock of its own).
async fn edit_row(cluster: &Cluster, table: &str, id: &str, set: &str) {
    for shard in ["s0", "s1", "s2", "s3", "s4"] {
        cluster
            .connection(shard)
            .unwrap()
            .execute_unprepared(&format!("UPDATE {table} SET {set} WHERE id = '{id}'"))
            .await
            .unwrap();
    }
}
