use tch::nn;
use tch_dist::sharding::{ChunkShardingSpec, Placement, ShardingPlan};
use tch_dist::Shardable;

#[derive(Shardable)]
struct Net {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

fn main() {
    let rows = ChunkShardingSpec::new(0, vec![Placement::new(0, tch::Device::Cpu)]);
    ShardingPlan::builder()
        .shard_param(Net::path().fc1().weight(), rows.clone())
        .shard_param(Net::path().fc1(), rows)
        .build();
}
