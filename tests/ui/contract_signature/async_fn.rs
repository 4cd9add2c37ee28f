use tch_dist::{contract, ContractError, Shardable};

#[contract]
pub async fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
    let _ = module;
    Ok(())
}

fn main() {}
