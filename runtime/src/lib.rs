//! tch-dist's runtime: the C++ shim over libtorch's c10d and autograd, process groups,
//! collectives, the gradient reducer, sharded tensors, and the helpers that run ranks as
//! real processes.
//!
//! All `unsafe` code talks to the shim (csrc/shim.h, the contract of csrc/*.cpp) through the private
//! `ffi` module; everything public returns [`Result`] with a [`DistError`] naming the rank,
//! the operation and the cause.
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `ffi.rs` | the shim's `extern "C"` surface, mirrored from csrc/shim.h, and its errors as Rust values | pybind11's bindings of `torch/csrc/distributed/c10d` and `torch/csrc/autograd` |
//! | `error/` | [`DistError`] and the values the errors carry, split by domain (its own table); imports no engine | `torch.distributed.DistError` and its subclasses |
//! | `c10d/` | launch variables, rendezvous, [`Store`], [`ProcessGroup`], collectives, the step check (its own table) | `torch/csrc/distributed/c10d`, `torch/distributed/distributed_c10d.py` |
//! | `autograd/` | libtorch's callbacks into Rust, hooks, tensor primitives, use guards and shard fences, activation recomputation, the split backward (its own table) | `torch/csrc/autograd` hooks, `torch.utils.checkpoint`, `torch.distributed.pipelining._backward` |
//! | `reducer/` | the gradient [`Reducer`] beneath `replicate` (its own table) | DDP's `reducer.cpp` |
//! | `fsdp/` | the engine side of `fully_shard` (its own table) | `torch/distributed/fsdp/_fully_shard/` |
//! | `sharding/` | [`ShardedTensor`](sharding::ShardedTensor) and tensor parallelism's differentiable collectives (its own table) | `torch.distributed._shard`, `torch.distributed.tensor.parallel`'s collectives |
//! | `fingerprint.rs` | [`Fingerprint`]: FNV-1a, for values the ranks compare as one number | — |
//! | `kernels.rs` | libtorch kernels tch does not expose: the fused optimizers (also at the deprecated `fused`), a seeded `randperm` | `torch._fused_adamw_`, `torch._fused_sgd_`, `torch.randperm(generator=)` |
//! | `testing.rs` | running ranks as real processes, for tests | `MultiProcessTestCase` |
//! | `rules.rs` | (tests) rules of the source tree the compiler does not see: `error/` imports no engine, no `pub fn` returns `Result<_, String>`, callbacks only through `autograd/callback.rs` | — |

#![warn(missing_docs)]

mod autograd;
mod c10d;
mod error;
mod ffi;
mod fingerprint;
pub mod fsdp;
pub mod kernels;
mod reducer;
#[cfg(test)]
mod rules;
pub mod sharding;
pub mod testing;

/// The fused optimizers under their first path (`tch_dist_runtime::fused::adamw`); they live in
/// [`kernels`], which is the path to use.
#[deprecated(note = "use tch_dist_runtime::kernels (the same items)")]
pub mod fused {
    pub use crate::kernels::{adamw, sgd, AdamWHyper, KernelError, SgdHyper};
}

#[allow(deprecated)]
pub use autograd::checkpointed;
pub use autograd::{
    apply_function, autograd_mark, backward_input, check_enter, check_exit, recomputed,
    set_grad_for, take_fence_hit, unfenced, Backward, FenceOwner, FunctionForward,
    PostAccumulateGradHooks, Recomputation, ShardFence, UseGuard, WeightBackward,
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
    is_initialized, Backend, GroupOptions, InitOptions, ProcessGroup, QuorumGroupOptions,
    CUDA_VIA_GLOO_ENV, HEARTBEAT_TIMEOUT_ENV, INIT_BARRIER_ENV, NO_SHORTCUTS_ENV,
    USE_AGENT_STORE_ENV,
};
pub use c10d::heartbeat::DEFAULT_HEARTBEAT_TIMEOUT;
pub use c10d::objects::Object;
pub use c10d::step_check::passes::{
    forward_begins as managed_forward_begins, forward_ends as managed_forward_ends,
};
pub use c10d::step_check::{
    grad_enabled, set_step, step_check_time, step_check_wait_time, COLLECTIVE_STEP_CHECK_ENV,
    NO_STEP_CHECK_ENV,
};
pub use c10d::store::Store;
pub use c10d::verify::Refusal;
pub use error::{
    ArgumentError, AutogradError, CallTensor, CollectiveCall, CollectiveSignature, Departure,
    Desync, DistError, EnvError, Mismatch, MisuseProblem, NamedSignature, PassProgram, Phase,
    PickleError, ReducerError, RendezvousError, Result, StepPosition, TensorSignature,
};
pub use fingerprint::Fingerprint;
pub use reducer::{
    compute_bucket_assignment_by_size, CommHook, PowerSgdOptions, Reducer, ReducerOptions,
    ReducerStats, DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_IN_PLACE_MIN_BYTES,
};
