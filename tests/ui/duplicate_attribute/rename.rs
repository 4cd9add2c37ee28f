use tch::nn;
use tch_dist::Shardable;

#[derive(Shardable)]
struct Model {
    #[shardable(rename = "a", rename = "b")]
    fc: nn::Linear,
}

fn main() {}
