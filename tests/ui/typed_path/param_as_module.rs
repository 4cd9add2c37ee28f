use tch::nn;
use tch_dist::sharding::{ColwiseLinear, ShardingPlan};
use tch_dist::Shardable;

#[derive(Shardable)]
struct Net {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

fn main() {
    ShardingPlan::builder()
        .shard_module(Net::path().fc1(), ColwiseLinear::default())
        .shard_module(Net::path().fc1().weight(), ColwiseLinear::default())
        .build();
}
