use tch_dist::Shardable;

#[derive(Shardable)]
struct Model {
    #[shardable(param)]
    weight: Vec<f32>,
}

fn main() {}
