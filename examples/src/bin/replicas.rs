//! Read-your-writes on read replicas: two shards on a PostgreSQL primary
//! whose streaming replica applies changes 200 ms late. A writer changes an
//! order and reads it right back three ways:
//!
//! - from any replica (`Consistency::Replica`): often the old row;
//! - with its session (`Consistency::AtLeast`): never older than its write,
//!   from the replica once it has replayed the commit, else the shard;
//! - in another instance, from the session's text (a cookie, a header).
//!
//! Needs the replica servers: `scripts/replicas.sh start` (which `.ci/run`
//! runs), or `SHARDKIT_PG_PRIMARY_URL` / `SHARDKIT_PG_REPLICA_URL`.
//!
//! `cargo run -p shardkit-examples --bin replicas`

use sea_orm::{ActiveValue::Set, ConnectionTrait};
use shardkit::prelude::*;
use shardkit_examples::{Customer, Migrator, customer, order};
use std::time::Duration;

const ROUNDS: i64 = 20;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let primary = std::env::var("SHARDKIT_PG_PRIMARY_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5442".to_owned());
    let replica = std::env::var("SHARDKIT_PG_REPLICA_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5443".to_owned());
    let admin = sea_orm::Database::connect(&primary).await.map_err(|e| {
        format!("no PostgreSQL primary at {primary} ({e}): run `scripts/replicas.sh start`")
    })?;
    let mut toml = String::from("[read]\nreplica_wait_ms = 1000\n\n");
    for i in 0..2 {
        let db = format!("shardkit_replicas_example_{i}");
        admin
            .execute_unprepared(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await?;
        admin
            .execute_unprepared(&format!("CREATE DATABASE {db}"))
            .await?;
        toml.push_str(&format!(
            "[[shards]]\nname = \"s{i}\"\nurl = \"{primary}/{db}\"\n\
             replicas = [{{ name = \"s{i}r1\", url = \"{replica}/{db}\" }}]\n\n"
        ));
    }
    toml.push_str("[groups.Customer]\nplacement = \"hash\"\n");
    // The replica must have the new databases before a pool opens on them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let config = ClusterConfig::from_toml(&toml)?;
    let cluster = Cluster::connect(config.clone()).await?;
    cluster.migrate::<Migrator>().await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    set_apply_delay(&replica, "200ms").await?;

    let tx = cluster.begin::<Customer>(7).await?;
    tx.insert(customer::ActiveModel {
        id: Set(7),
        name: Set("Ada".into()),
        email: Set("ada@example.com".into()),
    })
    .await?;
    tx.insert(order::ActiveModel {
        id: Set(1),
        customer_id: Set(7),
        total_cents: Set(0),
    })
    .await?;
    tx.commit().await?;

    let (mut stale_any, mut stale_session) = (0, 0);
    let session = Session::new();
    for cents in 1..=ROUNDS {
        let tx = cluster.begin::<Customer>(7).await?;
        tx.update(order::ActiveModel {
            id: Set(1),
            customer_id: Set(7),
            total_cents: Set(cents),
        })
        .await?;
        tx.commit_in(&session).await?; // records where the commit landed
        let any = read(&cluster, Consistency::Replica { max_lag: None }).await?;
        let mine = read(&cluster, Consistency::at_least(&session)).await?;
        stale_any += i64::from(any < cents);
        stale_session += i64::from(mine < cents);
    }
    println!("after each of {ROUNDS} writes, read back at once:");
    println!("  from any replica:   {stale_any} stale reads");
    println!("  with the session:   {stale_session} stale reads");

    // Another instance, handed the session as text.
    let token = session.to_string();
    let other = Cluster::connect(config).await?;
    let carried: Session = token.parse()?;
    let seen = read(&other, Consistency::at_least(&carried)).await?;
    println!("  another instance with the token `{token}`: sees {seen} cents");

    for r in cluster.replicas().await {
        println!(
            "replica {} of {}: in rotation {}, lag {:?}",
            r.name, r.shard, r.in_rotation, r.lag
        );
    }
    set_apply_delay(&replica, "0").await?;
    assert_eq!(stale_session, 0, "a read with the session saw an older row");
    assert_eq!(seen, ROUNDS, "the carried session saw an older row");
    Ok(())
}

/// The order's total as `consistency` reads it.
async fn read(cluster: &Cluster, consistency: Consistency) -> shardkit::Result<i64> {
    let row = cluster
        .find::<order::Entity>()
        .key(7)
        .consistency(consistency)
        .one()
        .await?;
    Ok(row.map_or(-1, |o| o.total_cents))
}

/// Makes the replica apply changes `delay` late.
async fn set_apply_delay(replica: &str, delay: &str) -> Result<(), sea_orm::DbErr> {
    let db = sea_orm::Database::connect(replica).await?;
    db.execute_unprepared(&format!(
        "ALTER SYSTEM SET recovery_min_apply_delay = '{delay}'"
    ))
    .await?;
    db.execute_unprepared("SELECT pg_reload_conf()").await?;
    db.close().await
}
