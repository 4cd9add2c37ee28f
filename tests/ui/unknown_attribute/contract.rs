use tch_dist::{contract, ContractError, Shardable};

#[contract(conflict(fully_shard))]
pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
    let _ = module;
    Ok(())
}

fn main() {}
