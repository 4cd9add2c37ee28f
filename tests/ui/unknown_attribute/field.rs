use tch::nn;
use tch_dist::Shardable;

#[derive(Shardable)]
struct Model {
    #[shardable(frozen)]
    fc: nn::Linear,
    #[shardable(rename = "b", init = "zeros")]
    fc2: nn::Linear,
}

fn main() {}
