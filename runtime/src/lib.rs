//! tch-dist's runtime: the C++ shim over libtorch's c10d and autograd, process groups,
//! collectives, the gradient reducer, sharded tensors, and the helpers that run ranks as
//! real processes.
//!
//! All `unsafe` code talks to the shim (csrc/shim.h, the contract of csrc/*.cpp) through the private
//! `ffi` module; everything public returns [`Result`] with a [`DistError`] naming the rank,
//! the operation and the cause.

#![warn(missing_docs)]

mod autograd;
mod c10d;
mod error;
mod ffi;
pub mod fsdp;
pub mod kernels;
mod reducer;
#[cfg(test)]
mod rules;
pub mod sharding;
pub mod testing;

/// The fused optimizers under their first path (`tch_dist_runtime::fused::adamw`); they live in
/// [`kernels`].
pub mod fused {
    pub use crate::kernels::{adamw, sgd, AdamWHyper, KernelError, SgdHyper};
}

#[allow(deprecated)]
pub use autograd::checkpointed;
pub use autograd::{
    autograd_mark, backward_input, check_enter, check_exit, recomputed, take_fence_hit, unfenced,
    FenceOwner, Recomputation, ShardFence, UseGuard, WeightBackward,
};
pub use c10d::coalesced::BROADCAST_BUCKET_BYTES;
pub use c10d::collectives::{ReduceOp, Work};
pub use c10d::devices::{first_shared_gpu, DeviceClaim};
pub use c10d::env::{
    DebugLevel, LaunchEnv, DEBUG_ENV, DEFAULT_MASTER_PORT, DEFAULT_NCCL_TIMEOUT, DEFAULT_TIMEOUT,
    RUN_ID_ENV, TORCH_DEBUG_ENV,
};
pub use c10d::group::{
    default_group, destroy_process_group, init_process_group, init_process_group_with,
    is_initialized, Backend, GroupOptions, InitOptions, ProcessGroup, CUDA_VIA_GLOO_ENV,
    INIT_BARRIER_ENV, NO_SHORTCUTS_ENV, USE_AGENT_STORE_ENV,
};
pub use c10d::objects::Object;
pub use c10d::step_check::passes::{
    forward_begins as managed_forward_begins, forward_ends as managed_forward_ends,
};
pub use c10d::step_check::{grad_enabled, set_step, step_check_time, NO_STEP_CHECK_ENV};
pub use c10d::store::Store;
pub use error::{
    ArgumentError, AutogradError, CallTensor, CollectiveCall, CollectiveSignature, Departure,
    Desync, DistError, EnvError, Mismatch, MisuseProblem, NamedSignature, PassProgram, Phase,
    PickleError, ReducerError, RendezvousError, Result, StepPosition, TensorSignature,
};
pub use reducer::{
    CommHook, PowerSgdOptions, Reducer, ReducerOptions, ReducerStats, DEFAULT_FIRST_BUCKET_BYTES,
    DEFAULT_IN_PLACE_MIN_BYTES,
};
