//! Stand-in composable APIs for tests across the workspace. Not public API.

/// A composable API declared in this crate that records the parameter names and does nothing
/// else; tests use it to check conflicts across crates and the catalogue (an API of one
/// crate refusing one it never heard of, from another crate's declaration).
pub mod record_names {
    use crate::{contract, ContractError, Shardable};

    /// What the stand-in stores per module.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct RecordNamesState {
        /// FQNs of the module's parameters when it was applied.
        pub param_names: Vec<String>,
    }

    /// Applies the stand-in to `module`.
    #[contract(crate = "crate")]
    pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<RecordNamesState, ContractError> {
        let param_names = module
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        Ok(RecordNamesState { param_names })
    }
}
