//! Two id patterns that need no ticket server, on 4 SQLite shards:
//!
//! 1. **Multiple-column keys** `(shard key, local id)`: the row's identity is
//!    the pair; the local id only has to be unique under its shard key, so it
//!    is counted inside the key's own transaction. Reads address a row by the
//!    pair and are routed by its first column.
//! 2. **Per-shard auto-increment with offset and increment**: shard `i` of `n`
//!    hands out ids `≡ i + 1 (mod n)` (step `n`), so ids never collide across
//!    shards. On MySQL/MariaDB this is `auto_increment_increment` /
//!    `auto_increment_offset`; on PostgreSQL an identity `START WITH i + 1
//!    INCREMENT BY n`; SQLite has no step, so here it is `MAX(id) + n` taken
//!    inside the shard transaction (SQLite serialises writers per database).
//!    Ids of rows that later move shards keep their residue, so prefer tickets
//!    (`cluster.ids()`) when rows move.
//!
//! `cargo run -p shardkit-examples --bin id_patterns`

use sea_orm::{ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, Statement};
use shardkit::prelude::*;
use shardkit_examples::Customer;

/// Pattern 1: a composite key `(customer_id, seq)`.
mod note {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "notes")]
    #[shardkit(group = shardkit_examples::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub customer_id: i64,
        #[sea_orm(primary_key, auto_increment = false)]
        pub seq: i64,
        pub body: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Pattern 2: ids stepped per shard.
mod payment {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "payments")]
    #[shardkit(group = shardkit_examples::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub cents: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

const SHARDS: usize = 4;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (_, mut toml) = shardkit_examples::sqlite_shards("id_patterns", SHARDS)?;
    toml.push_str("[groups.Customer]\n");
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml)?).await?;
    for name in cluster.topology().shard_names() {
        let db = cluster.connection(name).expect("configured shard");
        let schema = sea_orm::Schema::new(db.get_database_backend());
        db.execute(&schema.create_table_from_entity(note::Entity))
            .await?;
        db.execute(&schema.create_table_from_entity(payment::Entity))
            .await?;
    }

    println!("== 1. (shard key, local id): the local id counts per customer");
    for customer in [1_i64, 2, 1, 3, 1, 2] {
        let tx = cluster.begin::<Customer>(customer).await?;
        // Counted inside the key's own transaction: no other key can interfere.
        let last = tx
            .find::<note::Entity>()
            .order_by_desc(note::Column::Seq)
            .one()
            .await?
            .map_or(0, |n| n.seq);
        let row = tx
            .insert(note::ActiveModel {
                customer_id: Set(customer),
                seq: Set(last + 1),
                body: Set(format!("note {} of customer {customer}", last + 1)),
            })
            .await?;
        tx.commit().await?;
        println!(
            "customer {customer}: note ({}, {}) on {}",
            row.customer_id,
            row.seq,
            cluster.shard_of::<Customer>(&customer).await?
        );
    }
    let one = cluster
        .find::<note::Entity>()
        .key(1)
        .filter(note::Column::Seq.eq(2))
        .one()
        .await?;
    println!("read (1, 2): {:?}", one.map(|n| n.body));

    println!(
        "\n== 2. per-shard auto-increment: shard i of {SHARDS} hands out ids ≡ i+1 (mod {SHARDS})"
    );
    for customer in 1..=8_i64 {
        let tx = cluster.begin::<Customer>(customer).await?;
        let i = tx.target().shard.index() as i64;
        let n = SHARDS as i64;
        // A shard-wide MAX is outside any one key: the unchecked connection.
        let row = tx
            .unchecked_connection()
            .query_one_raw(Statement::from_string(
                sea_orm::DbBackend::Sqlite,
                format!(
                    "SELECT COALESCE(MAX(id), {start}) + {n} AS id FROM payments",
                    start = i + 1 - n
                ),
            ))
            .await?
            .ok_or("no row")?;
        let id: i64 = row.try_get("", "id")?;
        tx.insert(payment::ActiveModel {
            id: Set(id),
            customer_id: Set(customer),
            cents: Set(100 * customer),
        })
        .await?;
        tx.commit().await?;
        println!(
            "customer {customer} on {}: payment id {id} (≡ {} mod {n})",
            tx_shard(&cluster, customer).await?,
            id % n
        );
    }
    let mut all = Vec::new();
    for name in cluster.topology().shard_names() {
        all.extend(
            payment::Entity::find()
                .all(cluster.connection(name).expect("shard"))
                .await?,
        );
    }
    let mut ids: Vec<i64> = all.iter().map(|p| p.id).collect();
    ids.sort_unstable();
    ids.dedup();
    println!(
        "{} payments, {} distinct ids across {SHARDS} shards",
        all.len(),
        ids.len()
    );
    if ids.len() != all.len() {
        return Err("per-shard ids collided".into());
    }
    Ok(())
}

async fn tx_shard(cluster: &Cluster, customer: i64) -> shardkit::Result<String> {
    Ok(cluster.shard_of::<Customer>(&customer).await?.to_owned())
}
