use tch::nn;
use tch_dist::Shardable;

#[derive(Shardable)]
#[shardable(path = "::tch_dist")]
struct Model {
    fc: nn::Linear,
}

fn main() {}
