use tch::Tensor;
use tch_dist::Shardable;

#[derive(Shardable)]
struct Model {
    #[shardable(param)]
    #[shardable(param)]
    w: Tensor,
    #[shardable(skip, skip)]
    cache: Vec<f32>,
}

fn main() {}
