use tch_dist::{contract, ContractError};

#[contract]
pub fn apply(bucket_mb: usize) -> Result<(), ContractError> {
    let _ = bucket_mb;
    Ok(())
}

fn main() {}
