use tch::nn;
use tch_dist::Shardable;

#[derive(Shardable)]
struct Model {
    fc: nn::Linear,
    #[shardable(rename = "fc")]
    other: nn::Linear,
}

fn main() {}
