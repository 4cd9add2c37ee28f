use tch::Tensor;
use tch_dist::Shardable;

// A plain tensor needs #[shardable(param)] or #[shardable(buffer)].
#[derive(Shardable)]
struct Model {
    weight: Tensor,
}

fn main() {}
