use tch_dist::{contract, Shardable};

#[contract]
pub fn apply<M: Shardable + ?Sized>(module: &M) {
    let _ = module;
}

fn main() {}
