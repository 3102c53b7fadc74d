use shardkit::EntityGroup;

#[derive(EntityGroup)]
#[shardkit(key = f64)]
pub struct Sensor;

fn main() {}
