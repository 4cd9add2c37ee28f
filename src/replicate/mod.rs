//! `replicate`: data-parallel training (PyTorch's composable `replicate`, i.e. DDP).
//!
//! Applied to a module, it checks that every rank holds the same parameters, broadcasts
//! rank 0's parameters and buffers, and installs a [`Reducer`](crate::Reducer) whose gradient hooks average
//! gradients across ranks in buckets while backward is still running. The training loop
//! stays an ordinary tch loop.
//!
//! Two forms, one implementation (the same checks, broadcast, reducer and options):
//!
//! - [`apply`], the composable form (PyTorch's `replicate(module)`), for a
//!   `#[derive(Shardable)]` model: forward goes through [`Call::call`](crate::Call) so that
//!   replicate's forward hook runs; [`state`], [`no_sync`] and [`prepare_forward`] take the
//!   model;
//! - [`wrap`] / [`wrap_t`], the wrapper form (PyTorch's `DistributedDataParallel(module)`),
//!   for any `impl Module` / `impl ModuleT` (`nn::seq()`, `nn::func`) with the `VarStore`
//!   that owns its variables: the returned [`Replicated`] / [`ReplicatedT`] owns the model
//!   and its `forward` does the hook's work; `state`, `no_sync` and `prepare_forward` are
//!   its methods.
//!
//! | file | what it does | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `mod.rs` | the composable form's contract and API: [`apply`], [`prepare_forward`], [`no_sync`], [`state`] | `torch/distributed/_composable/replicate.py` (`replicate`, `_ReplicateState`'s hooks) |
//! | `options.rs` | [`Options`], [`DeviceId`] | `DistributedDataParallel.__init__`'s arguments |
//! | `collect.rs` | what a call manages: the parameters and buffers a walk finds, `ignored_modules`, `ignored_params` | `replicate.py` (`_ReplicateState._collect_params`) |
//! | `state.rs` | [`ReplicateState`] and `set_up`, the one implementation behind both forms: the checks, the start-up broadcast, the reducer, the forward-side work | `torch/nn/parallel/distributed.py` (`_verify_param_shape_across_processes`, `_sync_module_states`, `_pre_forward`) |
//! | `wrap.rs` | the wrapper form: [`wrap`], [`wrap_t`], [`Replicated`], [`ReplicatedT`] over a `VarStore` | `torch/nn/parallel/distributed.py` (`DistributedDataParallel`) |
//! | `error.rs` | [`ReplicateError`], [`ReplicateProblem`] | the errors DDP raises |
//!
//! The reducer itself is the runtime's ([`Reducer`](crate::Reducer): c10d's `reducer.cpp`).
//!
//! ```no_run
//! use tch::nn::{self, Module};
//! use tch_dist::{optim, replicate, Call, Shardable};
//!
//! #[derive(Debug, Shardable)]
//! struct Net { fc1: nn::Linear, fc2: nn::Linear }
//! impl Module for Net {
//!     fn forward(&self, xs: &tch::Tensor) -> tch::Tensor { xs.apply(&self.fc1).relu().apply(&self.fc2) }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let model = Net { fc1: nn::linear(vs.root() / "fc1", 4, 8, Default::default()),
//!                   fc2: nn::linear(vs.root() / "fc2", 8, 2, Default::default()) };
//! replicate::apply(&model, replicate::Options::default())?;
//! let mut opt = optim::Sgd::default().build(&vs, 0.1)?;
//! let (x, y) = (tch::Tensor::randn([16, 4], tch::kind::FLOAT_CPU), tch::Tensor::zeros([16], tch::kind::INT64_CPU));
//! opt.backward_step(&model.f_call(&x)?.cross_entropy_for_logits(&y))?;
//! # Ok(()) }
//! ```

mod collect;
mod error;
mod options;
mod state;
mod wrap;

use tch_dist_core::hooks::{register_fallible_forward_pre_hook_n, ForwardError};
use tch_dist_core::{contract, Shardable};

pub use error::{ReplicateError, ReplicateProblem};
pub use options::{DeviceId, Options};
pub use state::ReplicateState;
pub use wrap::{wrap, wrap_t, Replicated, ReplicatedT};

use collect::{group_of, is_ignored, unknown_ignored, Found};
use state::{move_inputs, set_up};

/// Applies replicate to `module`: checks and synchronises parameters across ranks and
/// installs the gradient reducer and forward hook. See the module docs for an example; for
/// a model that is not `Shardable` (`nn::seq()`, `nn::func`, any `impl Module`), see
/// [`wrap`].
///
/// ```no_run
/// use tch_dist::{replicate, Call};
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let fc = tch::nn::linear(vs.root() / "fc", 4, 2, Default::default());
/// replicate::apply(&fc, replicate::Options::default())?; // rank 0's parameters everywhere
/// let loss = fc.f_call(&tch::Tensor::ones([8, 4], tch::kind::FLOAT_CPU))?.sum(tch::Kind::Float);
/// loss.backward(); // gradients averaged over the ranks
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[contract(
    crate = "crate",
    conflicts(fully_shard),
    state_doc = r#"
```no_run
# fn demo(model: &impl tch_dist::Shardable) {
let state = tch_dist::replicate::state(model).expect("replicate::apply(model, ..) was called");
println!("gradient buckets: {:?}", state.buckets());
# }
```
"#
)]
pub fn apply<M: Shardable + ?Sized>(
    module: &M,
    opts: Options,
) -> Result<ReplicateState, ReplicateError> {
    let group = group_of(&opts)?;
    collect::tensor_parallel_elsewhere(module, &group)?;
    let found = collect::in_module(module, &opts, group.rank());
    let mut replicated = set_up(group, found, &opts)?;
    // fully_shard blocks under this root run one backward pass, as under a fully_shard root.
    crate::fully_shard::share_backward_pass(module);
    let input_device = replicated.input_device;
    let pre_hook = register_fallible_forward_pre_hook_n(module, move |m, xs| {
        // PyTorch raises from forward here: `f_call` returns the error, `call` panics with it
        // (`replicate::prepare_forward` checks the same ahead of the call).
        match state(m) {
            Some(s) => s.pre_forward(xs).map_err(ForwardError::from_error),
            None => Ok(move_inputs(input_device, xs)),
        }
    })?;
    replicated.pre_hook = Some(pre_hook);
    Ok(replicated)
}

/// The checks replicate's forward hook makes, as a value: fails with PyTorch's
/// "Expected to have finished reduction in the prior iteration..." error when the last
/// backward left parameters without gradients (and `find_unused_parameters` is off).
/// [`Replicated::prepare_forward`] is the wrapper form's.
///
/// ```no_run
/// # use tch_dist::{replicate, Shardable};
/// # fn demo<M: Shardable>(model: &M) -> Result<(), replicate::ReplicateError> {
/// replicate::prepare_forward(model)?; // what `model.call(&x)` checks first
/// # Ok(()) }
/// ```
pub fn prepare_forward<M: Shardable + ?Sized>(module: &M) -> Result<(), ReplicateError> {
    let s = state(module).ok_or(ReplicateError::NotReplicated)?;
    s.reducer.prepare_for_forward()?;
    Ok(())
}

/// Runs `f` without gradient synchronisation (gradient accumulation, PyTorch's `no_sync`):
/// gradients accumulate locally and the next synchronised backward averages the sum.
/// [`Replicated::no_sync`] is the wrapper form's.
///
/// ```no_run
/// # use tch_dist::{replicate, Shardable};
/// # fn demo<M: Shardable>(model: &M, micro_batches: &[tch::Tensor]) -> Result<(), replicate::ReplicateError> {
/// replicate::no_sync(model, || {
///     for loss in micro_batches { loss.backward(); }
/// })?;
/// # Ok(()) }
/// ```
pub fn no_sync<M: Shardable + ?Sized, R>(
    module: &M,
    f: impl FnOnce() -> R,
) -> Result<R, ReplicateError> {
    let s = state(module).ok_or(ReplicateError::NotReplicated)?;
    Ok(s.without_sync(f))
}
