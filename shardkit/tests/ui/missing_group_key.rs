use shardkit::EntityGroup;

#[derive(EntityGroup)]
pub struct Customer;

fn main() {}
