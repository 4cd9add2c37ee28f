//! # tch-dist
//!
//! PyTorch's composable distributed training APIs for Rust, on [`tch`] (libtorch), running on
//! PyTorch's own engine, c10d (Gloo for CPU tensors, NCCL for CUDA tensors):
//!
//! - process groups and collectives on `tch::Tensor` ([`ProcessGroup`], [`init_process_group`]);
//! - `#[derive(Shardable)]` parameter walking with typed paths ([`path`]) and `#[contract]`
//!   composable-API registries ([`macro@contract`], [`registry()`]);
//! - [`replicate`]: data parallelism (PyTorch's composable `replicate` / DDP), gradients
//!   averaged in buckets while backward runs, with DDP's options and communication hooks;
//!   [`replicate::apply`] for `#[derive(Shardable)]` models, [`replicate::wrap`] for any
//!   `impl Module` (`nn::seq()`, `nn::func`) with its `VarStore`;
//! - [`fully_shard()`](fully_shard()): fully sharded data parallelism (PyTorch's FSDP2):
//!   parameters, gradients and optimizer state sharded across ranks, gathered per block
//!   around forward and backward;
//! - [`device_mesh`]: ranks laid out as a mesh with a group per dim ([`init_device_mesh`]),
//!   for HSDP (`fully_shard` over a 2-D mesh) and FSDP x TP;
//! - [`sharding`]: tensor parallelism (`parallelize_module` with PyTorch's styles,
//!   `ShardingPlan`, sharders, planners, `shard_module`), sequence parallelism included;
//! - [`pipelining`]: pipeline parallelism (`PipelineStage` and five schedules:
//!   `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`,
//!   `ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`);
//! - [`activation_checkpoint`]: activation checkpointing ([`checkpoint_activations`]:
//!   a module's activations recomputed in backward instead of kept);
//! - [`checkpoint`]: distributed checkpoints in PyTorch DCP's safetensors layout (`save`,
//!   `async_save`, `load` of a [`checkpoint::State`], resharding to any world size), read and
//!   written by PyTorch's `dcp` too; [`state_dict`]: where each rank's pieces lie;
//! - [`optim`]: SGD and AdamW over sharded and replicated parameters, with PyTorch's
//!   settings, whose state a checkpoint carries;
//! - the launcher, `tch-dist-run` (crate `tch-dist-launcher`): torchrun's command line, across
//!   hosts and restarts included.
//!
//! Data-parallel training is an ordinary tch loop once the model is replicated:
//!
//! ```no_run
//! use tch::nn::{self, Module};
//! use tch::{Device, Kind, Tensor};
//! use tch_dist::{init_process_group, optim, replicate, Backend, Call, Shardable};
//!
//! #[derive(Debug, Shardable)]
//! struct Net {
//!     fc1: nn::Linear,
//!     fc2: nn::Linear,
//! }
//!
//! impl Module for Net {
//!     fn forward(&self, xs: &Tensor) -> Tensor {
//!         self.fc2.call(&self.fc1.call(xs).relu())
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pg = init_process_group(Backend::Gloo)?; // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//! let vs = nn::VarStore::new(Device::Cpu);
//! let root = vs.root();
//! let model = Net {
//!     fc1: nn::linear(&root / "fc1", 4, 16, Default::default()),
//!     fc2: nn::linear(&root / "fc2", 16, 2, Default::default()),
//! };
//! // Broadcasts rank 0's parameters and hooks gradient averaging into backward.
//! replicate::apply(&model, replicate::Options::default())?;
//! let mut opt = optim::Sgd::default().build(&vs, 0.1)?; // torch.optim.SGD
//! for _ in 0..10 {
//!     let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu)); // this rank's batch
//!     let y = Tensor::randint(2, [8], (Kind::Int64, Device::Cpu));
//!     // `f_call` runs replicate's forward hook; backward averages gradients across ranks.
//!     opt.backward_step(&model.f_call(&x)?.cross_entropy_for_logits(&y))?;
//! }
//! # let _ = pg;
//! # Ok(()) }
//! ```
//!
//! Start it with the launcher: `tch-dist-run --nproc-per-node 2 -- target/release/my_program`
//! (or under `torchrun --no-python`, or `srun`).
//!
//! **Where it lives, and how to depend on it.** The repository is
//! <https://github.com/tch-dist/tch-dist>; its README has a quickstart per API, and
//! `examples/own-crate/` is a crate to copy. tch-dist is not on crates.io yet: depend on it
//! by git (or by path, from a checkout), with tch 0.24 beside it and `tch-dist-build` for a
//! one-line `build.rs` that gives your binaries an rpath to libtorch:
//!
//! ```toml
//! [dependencies]
//! tch-dist = { git = "https://github.com/tch-dist/tch-dist" }
//! tch = "0.24"
//!
//! [build-dependencies]
//! tch-dist-build = { git = "https://github.com/tch-dist/tch-dist" }
//! ```
//!
//! The build needs the libtorch of torch 2.11.0 (`LIBTORCH=/path/to/site-packages/torch`, or
//! `LIBTORCH_USE_PYTORCH=1` with that torch on the `python3` of `PATH`). These API docs also
//! build without it, as docs.rs builds them: `cargo doc -p tch-dist --features doc-only`
//! (tch's `doc-only`: nothing compiled against libtorch, nothing linked).
//!
//! **Optimizers.** [`optim`]'s `Sgd` and `AdamW` are torch.optim's; their state is
//! reachable, so [`checkpoint::save`] saves it (`State::with_optimizer`), and `backward_step` returns
//! an error. tch's `nn::Sgd`/`nn::AdamW` train these models too, but their state cannot be
//! checkpointed and their `backward_step` panics when a collective fails.
//!
//! **Errors from forward and backward.** tch's `Module::forward` returns no `Result`, so
//! `call` panics with a failing hook's error and [`Call::f_call`] returns it
//! ([`ForwardError::downcast_ref`] gives the typed error). libtorch's backward pass carries
//! only a message: `opt.backward_step(&loss)?` returns it (`optim::OptimError::Backward`),
//! and the typed error of the collective that failed is kept by the API that ran it:
//! [`replicate::prepare_forward`] (the wrapper's `prepare_forward`) returns the reducer's
//! after the failed backward, [`fully_shard::FsdpState::take_backward_error`] fully_shard's.
//!
//! **Field names are `VarStore` paths.** A `#[derive(Shardable)]` struct names its tensors
//! after its fields, the `VarStore` after the paths its layers were built under; the
//! optimizer goes by the second, checkpoints and plans by the first, so build each field
//! under its own name and call [`check_against_var_store`] once the model is built.
//!
//! Tensor parallelism shards the layers a plan names; FQNs and the `VarStore` stay as they
//! were:
//!
//! ```no_run
//! # use tch::nn;
//! # use tch_dist::{init_process_group, Backend, Shardable};
//! use tch_dist::sharding::{shard_module, ColwiseLinear, RowwiseLinear, ShardingPlan};
//!
//! #[derive(Debug, Shardable)]
//! struct Mlp {
//!     fc1: nn::Linear,
//!     fc2: nn::Linear,
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let pg = init_process_group(Backend::Gloo)?;
//! # let vs = nn::VarStore::new(tch::Device::Cpu);
//! # let mut model = Mlp {
//! #     fc1: nn::linear(vs.root() / "fc1", 8, 32, Default::default()),
//! #     fc2: nn::linear(vs.root() / "fc2", 32, 8, Default::default()),
//! # };
//! // Megatron's MLP: fc1 column-parallel, its local output straight into row-parallel fc2.
//! let plan = ShardingPlan::builder()
//!     .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
//!     .shard_module(Mlp::path().fc2(), RowwiseLinear)
//!     .return_local_tensor(Mlp::path().fc1())
//!     .build();
//! shard_module(&mut model, &plan, 0, &pg)?; // rank 0's values, scattered
//! # Ok(()) }
//! ```
//!
//! **Call hooked layers with `call`.** APIs such as replicate and sharding work through
//! forward hooks, which only `call` runs: a model's `forward` calls a sharded layer as
//! `self.fc1.call(&x)`, not `x.apply(&self.fc1)` or `self.fc1.forward(&x)` (a sharded layer
//! computes the unsharded layer's result only through its hooks). `shard_module` makes a
//! bypass an error naming the layer and the fix (see [`sharding`]). A block whose forward
//! takes several tensors (`forward(x, mask)`) is called with [`CallWith::call_with`]:
//! `self.block.call_with([&x, &mask], |b, [x, mask]| b.forward(x, mask))`, whose hooks see
//! every input and output (a tuple of tensors too).
//!
//! For a model that is not a `Shardable` struct (`nn::seq()`, `nn::func`, any `impl Module`),
//! [`replicate::wrap`] is PyTorch's `DistributedDataParallel(model)`:
//!
//! ```no_run
//! # use tch::nn::{self, Module};
//! # use tch_dist::replicate;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let net = nn::seq().add(nn::linear(vs.root() / "fc", 4, 2, Default::default()));
//! let model = replicate::wrap(net, &vs, replicate::Options::default())?;
//! let ys = model.forward(&tch::Tensor::ones([8, 4], tch::kind::FLOAT_CPU));
//! # Ok(()) }
//! ```
//!
//! See docs/FROM_PYTORCH.md for each `torch.distributed` call and its tch-dist line,
//! docs/ARCHITECTURE.md for how the crates fit together and docs/PERFORMANCE.md for the
//! benchmarks against PyTorch DDP.
//!
//! **What else is public at the root, and why.** Some items a training loop never names
//! are public on purpose:
//! - [`Reducer`] is the engine under [`replicate`], for a data-parallel wrapper of one's own.
//! - [`Store`] is the job's key-value store ([`ProcessGroup::store`], PyTorch's `Store`), for
//!   a rendezvous of one's own.
//! - [`CallTensor`] and [`CollectiveCall`] are the data of a [`Desync`] error, which callers
//!   read.
//! - The `*_ENV` constants are the names of the variables tch-dist reads, for programs that
//!   set them for the ranks they start.
//! - [`testing`] holds the multi-process harness this crate's own tests use, for tests of
//!   distributed code of one's own.
//!
//! The old paths `tch_dist::sync_batch_norm` and `tch_dist_runtime::fused` are deprecated.

#![warn(missing_docs)]

// --- the engine: process groups, collectives, the reducer (tch-dist-runtime) ---

pub use tch_dist_runtime::{
    default_group, destroy_process_group, first_shared_gpu, init_process_group,
    init_process_group_with, is_initialized, set_step, step_check_time, step_check_wait_time,
    ArgumentError, Backend, CallTensor, CollectiveCall, CommHook, DebugLevel, Desync, DeviceClaim,
    DistError, EnvError, GroupOptions, InitOptions, LaunchEnv, Mismatch, NamedSignature, Object,
    Phase, PickleError, PowerSgdOptions, ProcessGroup, ReduceOp, Reducer, ReducerOptions,
    ReducerStats, RendezvousError, Result, StepPosition, Store, TensorSignature, Work,
    BROADCAST_BUCKET_BYTES, COLLECTIVE_STEP_CHECK_ENV, CUDA_VIA_GLOO_ENV, DEBUG_ENV,
    DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_IN_PLACE_MIN_BYTES,
    DEFAULT_MASTER_PORT, DEFAULT_NCCL_TIMEOUT, DEFAULT_TIMEOUT, INIT_BARRIER_ENV, NO_SHORTCUTS_ENV,
    RUN_ID_ENV, TORCH_DEBUG_ENV, USE_AGENT_STORE_ENV,
};

pub mod activation_checkpoint;
pub mod checkpoint;
pub mod context_parallel;
pub mod data;
pub mod device_mesh;
pub mod ft;
pub mod fully_shard;
pub mod nn;
pub mod optim;
pub mod pipelining;
pub mod replicate;
pub mod sharding;
pub mod state_dict;
pub mod utils;

pub use activation_checkpoint::{checkpoint_activations, CheckpointOptions};
pub use device_mesh::{init_device_mesh, DeviceMesh};
/// [`nn::sync_batch_norm`] at its path before `tch_dist::nn` held it.
#[deprecated(note = "use tch_dist::nn::sync_batch_norm (the same items)")]
pub mod sync_batch_norm {
    pub use crate::nn::sync_batch_norm::*;
}

pub use fully_shard::{fully_shard, FsdpOptions};

// --- errors: the composed message (src/report.rs) ---

mod error;
mod report;
pub use error::{Api, Composition, OnRank};
pub use report::report;
pub use tch_dist_runtime::{MisuseProblem, ReducerError};

// --- macros and core (issue 3) ---

#[doc(hidden)]
pub use tch_dist_core::__private;
pub use tch_dist_core::hooks::{Call, CallT, CallWith, ForwardError};
pub use tch_dist_core::path;
pub use tch_dist_core::trace;
pub use tch_dist_core::{
    check_against_var_store, contract, hooks, registry, AsDynShardable, ContractApi, ContractError,
    FqnPath, ModuleKey, ModuleVisitor, ModuleVisitorMut, ShallowClone, Shardable, TensorField,
    TensorKind, VarStoreMismatch,
};

/// The Rust blocks of README.md, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// docs/FROM_PYTORCH.md (each `torch.distributed` call and its tch-dist line), compiled as
/// doctests: every Rust block there must build against this crate.
#[cfg(doctest)]
#[doc = include_str!("../docs/FROM_PYTORCH.md")]
struct FromPytorchDoctests;

/// Multi-process test helpers (ranks as real processes) and stand-in composable APIs.
pub mod testing {
    pub use tch_dist_core::testing::*;
    pub use tch_dist_runtime::testing::*;
}
