use tch_dist::{contract, Shardable};

#[derive(Debug)]
pub struct MyError;

// MyError has no `From<ContractError>`.
#[contract]
pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), MyError> {
    let _ = module;
    Ok(())
}

fn main() {}
