use tch::Tensor;
use tch_dist::Shardable;

#[derive(Shardable)]
struct Model {
    #[shardable(param, buffer)]
    w: Tensor,
    #[shardable(skip, rename = "c")]
    cache: Vec<f32>,
}

fn main() {}
