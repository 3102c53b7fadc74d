//! The models and migrations the example programs share: a `Customer` entity
//! group with customers and their orders, sharded by customer id.

use sea_orm_migration::prelude::*;
use shardkit::EntityGroup;
use std::path::PathBuf;

/// The `[[shards]]` entries of `shards` fresh SQLite files in `$SHARDKIT_DATA_DIR`
/// (default `data/<name>`), with the directory they are in. Old files are
/// removed so every run of an example shows the same thing.
pub fn sqlite_shards(name: &str, shards: usize) -> std::io::Result<(PathBuf, String)> {
    shards_in(name, shards, true)
}

/// [`sqlite_shards`] without removing anything: the files an earlier run
/// left (what `shardctl` looks at).
pub fn existing_sqlite_shards(name: &str, shards: usize) -> std::io::Result<(PathBuf, String)> {
    shards_in(name, shards, false)
}

/// The quickstart's group: customers hashed into 1,024 buckets.
pub const QUICKSTART_GROUPS: &str = "[groups.Customer]\nplacement = \"hash\"\nbuckets = 1024\n";

fn shards_in(name: &str, shards: usize, fresh: bool) -> std::io::Result<(PathBuf, String)> {
    let dir = PathBuf::from(
        std::env::var("SHARDKIT_DATA_DIR").unwrap_or_else(|_| format!("data/{name}")),
    );
    std::fs::create_dir_all(&dir)?;
    let mut toml = String::new();
    for i in 0..shards {
        let file = dir.join(format!("shard_{i}.db"));
        if fresh {
            let _ = std::fs::remove_file(&file);
        }
        toml.push_str(&format!(
            "[[shards]]\nname = \"s{i}\"\nurl = \"sqlite://{}?mode=rwc\"\n\n",
            file.display()
        ));
    }
    Ok((dir, toml))
}

/// Everything a customer owns is sharded by the customer's id.
#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Customer;

/// A customer (dense `#[sea_orm::model]` format).
pub mod customer {
    use sea_orm::entity::prelude::*;

    /// One customer; its own id is its shard key.
    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "customers")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        /// Customer id, the shard key.
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        /// Display name.
        pub name: String,
        /// Contact address.
        pub email: String,
        /// The customer's orders (`find_with_related(order::Entity)`).
        #[sea_orm(has_many)]
        pub orders: HasMany<super::order::Entity>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// An order, on its customer's shard.
pub mod order {
    use sea_orm::entity::prelude::*;

    /// One order.
    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "orders")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        /// Order id.
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        /// The owning customer: the shard key.
        #[shardkit(shard_key)]
        pub customer_id: i64,
        /// Amount in cents.
        pub total_cents: i64,
        /// The customer who placed it (on the same shard: same shard key).
        #[sea_orm(belongs_to, from = "customer_id", to = "id")]
        pub customer: BelongsTo<super::customer::Entity>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// Creates the example tables from the entities.
pub struct CreateCustomersAndOrders;

impl MigrationName for CreateCustomersAndOrders {
    fn name(&self) -> &str {
        "m20261122_000100_create_customers_and_orders"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for CreateCustomersAndOrders {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let schema = sea_orm::Schema::new(manager.get_database_backend());
        manager
            .create_table(
                schema
                    .create_table_from_entity(customer::Entity)
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                schema
                    .create_table_from_entity(order::Entity)
                    .if_not_exists()
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(order::Entity).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(customer::Entity).to_owned())
            .await
    }
}

/// The example application's migrator: shardkit's tables, then its own.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut all = shardkit_migration::migrations();
        all.push(Box::new(CreateCustomersAndOrders));
        all
    }
}
