//! # tch-dist
//!
//! PyTorch's composable distributed training APIs for Rust, on [`tch`] (libtorch):
//! process groups and collectives on c10d (Gloo for CPU tensors, NCCL for CUDA tensors),
//! `#[derive(Shardable)]` parameter walking, `#[contract]` composable-API registries, and
//! (in later milestones) `replicate` (DDP) and tensor-parallel sharding.
//!
//! ```no_run
//! use tch_dist::{init_process_group, Backend, ReduceOp};
//! # fn main() -> Result<(), tch_dist::DistError> {
//! let pg = init_process_group(Backend::Gloo)?; // reads RANK, WORLD_SIZE, MASTER_ADDR, ...
//! let t = tch::Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
//! pg.all_reduce(&t, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```

pub use tch_dist_runtime::*;

pub mod replicate;
pub mod sharding;

// --- macros and core (issue 3) ---

#[doc(hidden)]
pub use tch_dist_core::__private;
pub use tch_dist_core::hooks::{Call, CallT};
pub use tch_dist_core::path;
pub use tch_dist_core::{
    check_against_var_store, contract, hooks, nn, registry, AsDynShardable, ContractApi,
    ContractError, FqnPath, ModuleKey, ModuleVisitor, ModuleVisitorMut, Shardable, TensorField,
    TensorKind, VarStoreMismatch,
};

/// Multi-process test helpers (ranks as real processes) and stand-in composable APIs.
pub mod testing {
    pub use tch_dist_core::testing::*;
    pub use tch_dist_runtime::testing::*;
}
