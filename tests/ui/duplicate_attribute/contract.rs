use tch_dist::{contract, ContractError, Shardable};

#[contract(name = "a", name = "b")]
pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
    let _ = module;
    Ok(())
}

fn main() {}
