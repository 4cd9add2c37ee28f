use tch::nn;
use tch_dist::Shardable;

#[derive(Shardable)]
enum Head {
    #[shardable(skip)]
    Linear(nn::Linear),
}

fn main() {}
