use tch::nn;
use tch_dist::Shardable;

#[derive(Shardable)]
struct Net {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

fn shard_param(_: impl Into<tch_dist::path::ParamPath>) {}

fn main() {
    shard_param(Net::path().fc1().weight());
    shard_param(Net::path().fc1());
}
