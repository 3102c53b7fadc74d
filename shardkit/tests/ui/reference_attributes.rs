use shardkit::EntityGroup;

#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Customer;

pub mod currency {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "currencies")]
    #[shardkit(reference, group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub code: String,
        #[shardkit(shard_key)]
        pub customer_id: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

fn main() {}
