use shardkit::EntityGroup;

#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Customer;

pub mod currency {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "currencies")]
    #[shardkit(reference)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub code: String,
        pub name: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

// A reference table is written through `cluster.reference::<E>()`, never
// inside a key's transaction.
async fn write(tx: shardkit::ShardTx<Customer>, row: currency::ActiveModel) -> shardkit::Result<()> {
    tx.insert(row).await?;
    Ok(())
}

fn main() {
    let _ = write;
}
