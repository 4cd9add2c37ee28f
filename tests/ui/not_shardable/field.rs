use tch::nn;
use tch_dist::Shardable;

struct Config {
    hidden: i64,
}

#[derive(Shardable)]
struct Model {
    fc: nn::Linear,
    config: Config,
}

fn main() {}
