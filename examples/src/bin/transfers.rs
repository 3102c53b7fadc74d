//! Money moved between accounts on different shards, without a
//! transaction that spans them: each transfer debits the sender in a
//! transaction of the sender's key and sends a `Credit` message in that
//! same transaction (the outbox); the relay applies the credit once in a
//! transaction of the receiver's key. Then a saga whose second step is
//! refused undoes its first, an idempotent request retried runs once, and
//! the money invariant is checked: the balances add up to what they began
//! with.
//!
//! Run it with `cargo run -p shardkit-examples --bin transfers`.

use sea_orm::QuerySelect;
use sea_orm_migration::prelude::*;
use shardkit::prelude::*;
use shardkit::{Saga, SagaState};
use std::sync::Arc;

#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Account;

pub mod account {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "accounts")]
    #[shardkit(group = super::Account)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        pub balance: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

struct CreateAccounts;

impl MigrationName for CreateAccounts {
    fn name(&self) -> &str {
        "m20261126_000300_create_accounts"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for CreateAccounts {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let schema = sea_orm::Schema::new(manager.get_database_backend());
        manager
            .create_table(
                schema
                    .create_table_from_entity(account::Entity)
                    .if_not_exists()
                    .to_owned(),
            )
            .await
    }
}

struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut all = shardkit_migration::migrations();
        all.push(Box::new(CreateAccounts));
        all
    }
}

/// Sent by the sender's transaction, applied by the receiver's.
#[derive(serde::Serialize, serde::Deserialize)]
struct Credit {
    amount: i64,
}

impl shardkit::Message for Credit {
    const NAME: &'static str = "credit";
    type From = Account;
    type To = Account;
}

/// Adds `amount` to the transaction's account, read under its row lock;
/// refused when the balance would go below zero.
async fn add(tx: &ShardTx<Account>, amount: i64) -> Result<(), shardkit::BoxError> {
    let a = tx
        .find::<account::Entity>()
        .lock_exclusive()
        .one()
        .await?
        .ok_or("no such account")?;
    if a.balance + amount < 0 {
        return Err(format!("account {} has {}, not {}", a.id, a.balance, -amount).into());
    }
    tx.update(account::ActiveModel {
        id: Set(a.id),
        balance: Set(a.balance + amount),
    })
    .await?;
    Ok(())
}

async fn total(cluster: &Cluster) -> Result<i64, ShardError> {
    let accounts = cluster.find::<account::Entity>().scatter().all().await?;
    Ok(accounts.iter().map(|a| a.balance).sum())
}

#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Payment {
    from: i64,
    to: i64,
    amount: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (dir, mut toml) = shardkit_examples::sqlite_shards("transfers", 4)?;
    toml.push_str("[groups.Account]\nbuckets = 64\n");
    println!("== 4 SQLite shards in {}", dir.display());
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml)?).await?;
    cluster.migrate::<Migrator>().await?;

    let accounts = 40_i64;
    for id in 1..=accounts {
        cluster
            .transaction::<Account, _, _>(id, |tx| async move {
                tx.insert(account::ActiveModel {
                    id: Set(id),
                    balance: Set(100),
                })
                .await
            })
            .await?;
    }
    let start = total(&cluster).await?;
    println!("{accounts} accounts, {start} in all");

    // The relay applies credits in the background; it stops with the
    // cluster.
    let relay = cluster
        .outbox()
        .handle::<Credit, _, _, _>(
            |tx, credit: Credit| async move { add(&tx, credit.amount).await },
        )
        .run();

    println!("\n== 200 transfers, each between accounts on different shards");
    let mut sent = 0;
    let mut n = 7_i64;
    while sent < 200 {
        n = (n * 1_103_515_245 + 12_345) % 2_147_483_648;
        let (from, to, amount) = (n % accounts + 1, (n / 97) % accounts + 1, 1 + n % 20);
        if cluster.shard_of::<Account>(&from).await? == cluster.shard_of::<Account>(&to).await? {
            continue;
        }
        // The debit and the message commit together, or neither does.
        let done = cluster
            .transaction::<Account, _, _>(from, |tx| async move {
                add(&tx, -amount).await.map_err(|e| ShardError::Internal {
                    what: e.to_string(),
                })?;
                tx.send(to, &Credit { amount }).await
            })
            .await;
        if done.is_ok() {
            sent += 1;
        }
    }

    // Wait for the relay to apply everything sent.
    let outbox = cluster.outbox();
    loop {
        let status = outbox.status().await?;
        let pending: u64 = status.shards.iter().map(|s| s.pending).sum();
        if pending == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    relay.stop();
    let after = total(&cluster).await?;
    println!("after {sent} transfers: {after} in all (began with {start})");
    assert_eq!(after, start, "the money invariant");

    println!("\n== a saga: pay 5 from account 1, then a step on account 2 that is refused");
    let pay = Saga::<Account, Payment>::new("pay-with-fee")
        .step::<Account, _, _, _, _, _, _, _>(
            |p: &Payment| p.from,
            |tx, p: Payment| async move { add(&tx, -p.amount).await },
            |tx, p: Payment| async move { add(&tx, p.amount).await },
        )
        .step::<Account, _, _, _, _, _, _, _>(
            |p: &Payment| p.to,
            |tx, _p: Payment| async move { add(&tx, -1_000_000).await },
            |tx, _p: Payment| async move { add(&tx, 1_000_000).await },
        );
    let before = cluster.find::<account::Entity>().key(1).one().await?;
    let (id, state) = cluster
        .sagas(pay)
        .start(
            1,
            &Payment {
                from: 1,
                to: 2,
                amount: 5,
            },
        )
        .await?;
    let after_saga = cluster.find::<account::Entity>().key(1).one().await?;
    println!(
        "saga {id}: {state:?}; account 1 holds {:?}, as before",
        after_saga.as_ref().map(|a| a.balance)
    );
    assert_eq!(state, SagaState::Compensated);
    assert_eq!(before, after_saga);

    println!("\n== an idempotent request, retried three times");
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..3 {
        let runs = runs.clone();
        let balance = cluster
            .transaction_once::<Account, i64, _>(3, "deposit-42", |tx| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    add(&tx, 10).await.map_err(|e| ShardError::Internal {
                        what: e.to_string(),
                    })?;
                    let a = tx.find::<account::Entity>().one().await?;
                    Ok(a.map_or(0, |a| a.balance))
                }
            })
            .await?;
        println!("deposit-42 -> balance {balance}");
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(total(&cluster).await?, start + 10);
    println!(
        "\nthe books balance: {} = {start} + the one deposit of 10",
        start + 10
    );
    Ok(())
}
