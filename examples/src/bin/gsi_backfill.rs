//! A global secondary index added to a table that already has rows: create it
//! (`write_only`: lookups scatter), backfill it with a progress bar (stopped
//! half way through its cancellation token, then resumed), then look
//! rows up by email from the one shard that holds them. Then a rolled-back
//! insert leaves a dangling index row that lookups ignore and reconcile
//! removes.
//!
//! `cargo run -p shardkit-examples --bin gsi_backfill`

use sea_orm::{ConnectionTrait, EntityTrait};
use shardkit::gsi::{BackfillProgress, IndexState};
use shardkit::prelude::*;
use shardkit::{CancellationToken, JobControl};
use shardkit_examples::Customer;
use std::io::Write;

mod member {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "members")]
    #[shardkit(group = shardkit_examples::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        #[shardkit(global_index(unique))]
        pub email: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

const SHARDS: usize = 4;
const ROWS: i64 = 2_000;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (_, mut toml) = shardkit_examples::sqlite_shards("gsi_backfill", SHARDS)?;
    // The shortest grace shardkit accepts, so the demo can wait it out; keep
    // the default (30 s) in production: it protects inserts in flight.
    toml.push_str("[groups.Customer]\n[gsi]\ngrace_ms = 1000\n");
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml)?).await?;
    cluster.migrate::<shardkit_migration::Migrator>().await?;
    for name in cluster.topology().shard_names() {
        let db = cluster.connection(name).expect("shard");
        let schema = sea_orm::Schema::new(db.get_database_backend());
        db.execute(&schema.create_table_from_entity(member::Entity))
            .await?;
    }

    println!("== {ROWS} members written before the index existed");
    for id in 1..=ROWS {
        let shard = cluster.shard_of::<Customer>(&id).await?.to_owned();
        member::Entity::insert(member::ActiveModel {
            id: Set(id),
            email: Set(format!("m{id}@example.com")),
        })
        .exec(cluster.connection(&shard).expect("shard"))
        .await?;
    }

    let gsi = cluster.gsi();
    gsi.create::<member::Entity>().await?;
    println!(
        "index state: {:?} (lookups scatter to all {SHARDS} shards)",
        gsi.state::<member::Entity>(member::Column::Email).await?
    );

    println!("\n== backfill, stopped half way (as Ctrl-C would) and resumed");
    // `rows` counts this call's rows: a resumed run adds the earlier ones.
    let bar = |earlier: u64, p: &BackfillProgress| {
        let total = ROWS as u64;
        let rows = earlier + p.rows;
        let filled = (rows * 40 / total.max(1)).min(40) as usize;
        print!(
            "\r[{}{}] {rows:>5}/{total} rows, shard {}/{}",
            "#".repeat(filled),
            " ".repeat(40 - filled),
            p.shards_done,
            p.shards
        );
        let _ = std::io::stdout().flush();
    };
    // Every long job takes a JobControl: a progress callback and a
    // cancellation token. Cancelling stops it at the next chunk boundary
    // with its position saved.
    let stop = CancellationToken::new();
    let cancel = stop.clone();
    let half = gsi
        .backfill_with::<member::Entity>(
            member::Column::Email,
            250,
            JobControl::new()
                .on_progress(move |p| {
                    bar(0, p);
                    if p.rows >= ROWS as u64 / 2 {
                        cancel.cancel();
                    }
                })
                .cancel_on(stop),
        )
        .await?;
    assert!(!half.finished);
    println!(
        "\nstopped after {} rows; state: {:?}",
        half.rows,
        gsi.state::<member::Entity>(member::Column::Email).await?
    );
    // The next call resumes where the first stopped.
    let done = gsi
        .backfill_with::<member::Entity>(
            member::Column::Email,
            250,
            JobControl::new().on_progress(move |p| bar(half.rows, p)),
        )
        .await?;
    assert!(done.finished);
    println!(
        "\nindexed {} of {} rows in two runs; state: {:?}",
        half.written + done.written,
        half.rows + done.rows,
        gsi.state::<member::Entity>(member::Column::Email).await?
    );
    assert_eq!(
        gsi.state::<member::Entity>(member::Column::Email).await?,
        IndexState::Active
    );

    println!("\n== lookup by email");
    let found = cluster
        .find::<member::Entity>()
        .by_index(member::Column::Email, "m1234@example.com")
        .one()
        .await?;
    println!(
        "m1234@example.com -> {:?} (read from shard {} only)",
        found.as_ref().map(|m| m.id),
        cluster.shard_of::<Customer>(&1234).await?
    );
    if found.map(|m| m.id) != Some(1234) {
        return Err("the index lookup missed".into());
    }

    println!("\n== a unique value already taken is refused");
    let tx = cluster.begin::<Customer>(9_001).await?;
    match tx
        .insert(member::ActiveModel {
            id: Set(9_001),
            email: Set("m7@example.com".into()),
        })
        .await
    {
        Err(err) => println!("refused: {err}"),
        Ok(_) => return Err("a duplicate email was accepted".into()),
    }
    drop(tx);

    println!("\n== reconcile (after the 1 s grace period)");
    tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    let report = gsi.reconcile::<member::Entity>().await?;
    println!(
        "scanned {} index rows, removed {}, added {}",
        report.scanned, report.removed, report.added
    );
    Ok(())
}
