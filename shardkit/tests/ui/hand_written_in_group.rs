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

// An entity is of one group: `InGroup` for another group does not compile,
// so no write or relation read can be routed by another group's key.
impl shardkit::InGroup<Customer> for product::Entity {}

fn main() {}
