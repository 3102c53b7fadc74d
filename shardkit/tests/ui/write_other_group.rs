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

// Every write method of a `ShardTx<Customer>` refuses `product` (one error
// each, at the call).
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

async fn update(tx: shardkit::ShardTx<Customer>, row: product::ActiveModel) -> shardkit::Result<()> {
    tx.update(row).await?;
    Ok(())
}

async fn save(tx: shardkit::ShardTx<Customer>, row: product::ActiveModel) -> shardkit::Result<()> {
    tx.save(row).await?;
    Ok(())
}

async fn delete(tx: shardkit::ShardTx<Customer>, row: product::ActiveModel) -> shardkit::Result<()> {
    tx.delete(row).await?;
    Ok(())
}

async fn insert_many(tx: shardkit::ShardTx<Customer>, row: product::ActiveModel) -> shardkit::Result<()> {
    tx.insert_many([row]).await?;
    Ok(())
}

async fn update_many(tx: shardkit::ShardTx<Customer>) -> shardkit::Result<()> {
    use sea_orm::sea_query::Expr;
    tx.update_many::<product::Entity>()
        .col_expr(product::Column::Id, Expr::value(2))
        .exec()
        .await?;
    Ok(())
}

async fn delete_many(tx: shardkit::ShardTx<Customer>) -> shardkit::Result<()> {
    tx.delete_many::<product::Entity>().exec().await?;
    Ok(())
}

async fn read(tx: shardkit::ShardTx<Customer>) -> shardkit::Result<()> {
    tx.find::<product::Entity>().all().await?;
    Ok(())
}

fn main() {
    let _ = (write, update, save, delete, insert_many, update_many, delete_many, read);
}
