//! shardkit in one screen: four SQLite shard files, migrations on every shard,
//! customers and orders written through single-key transactions, where each
//! row landed, a refused cross-shard write, a keyed read, a transaction
//! closure, and a customer read with its related orders.
//!
//! Run it with `cargo run -p shardkit-examples --bin quickstart`. Set
//! `SHARDKIT_DATA_DIR` to put the shard files somewhere other than
//! `data/quickstart`.

use sea_orm::{EntityTrait, PaginatorTrait};
use shardkit::prelude::*;
use shardkit_examples::{Customer, Migrator, customer, order};

const SHARDS: usize = 4;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (dir, mut toml) = shardkit_examples::sqlite_shards("quickstart", SHARDS)?;
    toml.push_str(shardkit_examples::QUICKSTART_GROUPS);

    println!("== cluster: {SHARDS} SQLite shards in {}", dir.display());
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml)?).await?;

    println!("\n== migrations (every shard)");
    let report = cluster.migrate::<Migrator>().await?;
    print!("{report}");

    println!("\n== writes: one transaction per customer, on that customer's shard");
    let mut order_id = 1000;
    for id in 1..=12_i64 {
        let tx = cluster.begin::<Customer>(id).await?;
        tx.insert(customer::ActiveModel {
            id: Set(id),
            name: Set(format!("customer {id}")),
            email: Set(format!("c{id}@example.com")),
        })
        .await?;
        for n in 0..3 {
            order_id += 1;
            tx.insert(order::ActiveModel {
                id: Set(order_id),
                customer_id: Set(id),
                total_cents: Set(1_000 * (n + 1) + id),
            })
            .await?;
        }
        let target = tx.target();
        println!(
            "customer {id}: bucket {:>4} -> shard {} (1 customer, 3 orders)",
            target.bucket.unwrap_or_default(),
            tx.shard()
        );
        tx.commit().await?;
    }

    println!("\n== where the rows are (read straight from each shard's database)");
    for name in cluster.topology().shard_names() {
        let db = cluster.connection(name).expect("configured shard");
        let customers = customer::Entity::find().count(db).await?;
        let orders = order::Entity::find().count(db).await?;
        println!("{name}: {customers} customers, {orders} orders");
    }

    println!("\n== a cross-shard write is refused before any SQL runs");
    let tx = cluster.begin::<Customer>(1).await?;
    let refused = tx
        .insert(order::ActiveModel {
            id: Set(9_999),
            customer_id: Set(2),
            total_cents: Set(5),
        })
        .await;
    match refused {
        Err(err) => println!("refused: {err}"),
        Ok(_) => return Err("a cross-shard write was accepted".into()),
    }
    match tx.commit().await {
        Err(err) => println!("commit:  {err}"),
        Ok(()) => return Err("a rollback-only transaction committed".into()),
    }

    println!("\n== a keyed read: customer 3's orders over $20, newest first");
    let orders = cluster
        .find::<order::Entity>()
        .key(3)
        .filter(order::Column::TotalCents.gt(2_000))
        .order_by_desc(order::Column::Id)
        .all()
        .await?;
    for o in &orders {
        println!(
            "order {} customer {} total {} cents",
            o.id, o.customer_id, o.total_cents
        );
    }
    println!(
        "(read from shard {} only)",
        cluster.shard_of::<Customer>(&3).await?
    );

    println!("\n== a transaction closure: commits when it returns Ok, rolls back on Err");
    let placed = cluster
        .transaction::<Customer, _, _>(3, |tx| async move {
            let row = tx
                .insert(order::ActiveModel {
                    id: Set(2_000),
                    customer_id: Set(3),
                    total_cents: Set(4_203),
                })
                .await?;
            Ok(row)
        })
        .await?;
    println!(
        "order {} customer {} total {} cents committed",
        placed.id, placed.customer_id, placed.total_cents
    );

    println!("\n== a related read: customer 3 with its orders, one join on its shard");
    let with_orders = cluster
        .find::<customer::Entity>()
        .key(3)
        .find_with_related(order::Entity)
        .await?;
    for (c, orders) in &with_orders {
        let ids: Vec<i64> = orders.iter().map(|o| o.id).collect();
        println!("{} <{}>: orders {ids:?}", c.name, c.email);
        if orders.len() != 4 || !orders.contains(&placed) {
            return Err("customer 3 should have its 3 orders and the new one".into());
        }
    }
    if with_orders.len() != 1 {
        return Err("customer 3 is one customer".into());
    }
    Ok(())
}
