use tch::nn;
use tch_dist::Shardable;

#[derive(Shardable)]
struct Model {
    #[shardable(rename = "encoder.fc")]
    fc: nn::Linear,
    #[shardable(rename = "")]
    fc2: nn::Linear,
}

fn main() {}
