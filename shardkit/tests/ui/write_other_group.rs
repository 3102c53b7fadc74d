use shardkit::EntityGroup;

#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Customer;
#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Merchant;

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

async fn write(cluster: shardkit::Cluster) -> shardkit::Result<()> {
    use sea_orm::ActiveValue::Set;
    let tx = cluster.begin::<Customer>(42).await?;
    tx.insert(product::ActiveModel {
        id: Set(1),
        merchant_id: Set(42),
    })
    .await?;
    tx.commit().await
}

fn main() {
    let _ = write;
}
