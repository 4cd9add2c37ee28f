//! Stand-in composable APIs for tests across the workspace. Not public API.

/// A stand-in for PyTorch's `fully_shard` (FSDP2): records the parameter names and does
/// nothing else. `replicate` declares a conflict with it; tests use it to check conflicts
/// across crates and the catalogue.
pub mod fully_shard {
    use crate::{contract, ContractError, Shardable};

    /// What the stand-in stores per module.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct FullyShardState {
        /// FQNs of the module's parameters when it was applied.
        pub param_names: Vec<String>,
    }

    /// Applies the stand-in to `module`.
    #[contract(crate = "crate")]
    pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<FullyShardState, ContractError> {
        let param_names = module
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        Ok(FullyShardState { param_names })
    }
}
