use shardkit::EntityGroup;

#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Customer;
#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Merchant;

pub mod order {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "orders")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub product_id: i64,
        #[sea_orm(belongs_to, from = "product_id", to = "id")]
        pub product: BelongsTo<super::product::Entity>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod product {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "products")]
    #[shardkit(group = crate::Merchant)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub merchant_id: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

// A relation to another group's entity cannot be read inside one key:
// one error per read.
async fn with_related(cluster: shardkit::Cluster) -> shardkit::Result<()> {
    cluster
        .find::<order::Entity>()
        .key(1)
        .find_with_related(product::Entity)
        .await?;
    Ok(())
}

async fn also_related(cluster: shardkit::Cluster) -> shardkit::Result<()> {
    cluster
        .find::<order::Entity>()
        .key(1)
        .find_also_related(product::Entity)
        .await?;
    Ok(())
}

async fn in_tx(tx: shardkit::ShardTx<Customer>) -> shardkit::Result<()> {
    tx.find::<order::Entity>()
        .find_with_related(product::Entity)
        .await?;
    tx.find::<order::Entity>()
        .find_also_related(product::Entity)
        .await?;
    Ok(())
}

async fn related(tx: shardkit::ShardTx<Customer>, row: order::Model) -> shardkit::Result<()> {
    tx.find_related(&row, product::Entity).all().await?;
    Ok(())
}

async fn related_by_key(cluster: shardkit::Cluster, row: order::Model) -> shardkit::Result<()> {
    cluster.find_related(&row, product::Entity).all().await?;
    Ok(())
}

// A rollout converts rows inside one key: its new entity must be of the old
// one's group.
async fn rollout(cluster: shardkit::Cluster) -> shardkit::Result<()> {
    let rollout = shardkit::Rollout::<order::Entity, product::Entity>::new("orders", |o| {
        product::Model {
            id: o.id,
            merchant_id: o.customer_id,
        }
    });
    cluster.register_rollout(rollout).await?;
    Ok(())
}

fn main() {
    let _ = (with_related, also_related, in_tx, related, related_by_key, rollout);
}
