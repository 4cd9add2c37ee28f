use tch::nn;
use tch_dist::Shardable;

#[derive(Shardable)]
struct Block {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

#[derive(Shardable)]
struct Net {
    blocks: Vec<Block>,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

fn main() {
    let _ = Net::path().fc3();
    let _ = Net::path().blocks().at(0).fc3().weight();
}
