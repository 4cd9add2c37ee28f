use tch::nn;
use tch_dist::Shardable;

#[derive(Shardable)]
struct Net {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

fn shard_module(_: impl tch_dist::path::ModulePath) {}

fn main() {
    shard_module(Net::path().fc1());
    shard_module(Net::path().fc1().weight());
}
