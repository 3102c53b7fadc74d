use shardkit::EntityGroup;

#[derive(EntityGroup)]
#[shardkit(key = i64)]
pub struct Customer;

pub mod order {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "orders")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(id = "autoincrement")]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        #[shardkit(id = "ticket:refs")]
        pub reference: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

fn main() {}
