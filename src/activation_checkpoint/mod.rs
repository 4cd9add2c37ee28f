//! Composable activation checkpointing: [`checkpoint_activations`] (PyTorch's
//! `torch.distributed._composable.checkpoint`) trades compute for memory, per block.
//!
//! A checkpointed module's hooked calls (`block.call(&x)`, `call_with`) with grad enabled
//! keep only the call's inputs: its forward runs without recording activations, and the
//! backward pass runs it again, with grad and with the first run's random numbers, then
//! differentiates it. The gradients of the block's parameters and inputs equal those without
//! checkpointing (bit for bit on CPU). FQNs, the registry and every other API's hooks are
//! unchanged: it composes with `fully_shard` and `replicate` (on the block or around it) and
//! with tensor-parallel layers inside the block, whose hooks and collectives run again in
//! the recomputation on every rank alike.
//!
//! ```
//! use tch::{nn, Device, Kind, Tensor};
//! use tch_dist::activation_checkpoint::{checkpoint_activations, CheckpointOptions};
//! use tch_dist::{Call, ShallowClone, Shardable};
//!
//! #[derive(Debug, Shardable, ShallowClone)]
//! struct Block {
//!     fc1: nn::Linear,
//!     fc2: nn::Linear,
//! }
//! impl nn::Module for Block {
//!     fn forward(&self, x: &Tensor) -> Tensor {
//!         x.apply(&self.fc1).gelu("none").apply(&self.fc2)
//!     }
//! }
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let block = Block {
//!     fc1: nn::linear(vs.root() / "fc1", 4, 16, Default::default()),
//!     fc2: nn::linear(vs.root() / "fc2", 16, 4, Default::default()),
//! };
//! let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
//! let expected = {
//!     let y = nn::Module::forward(&block, &x).sum(Kind::Float);
//!     y.backward();
//!     let g = block.fc1.ws.grad().copy();
//!     for mut t in vs.trainable_variables() {
//!         t.zero_grad();
//!     }
//!     g
//! };
//! checkpoint_activations(&block, CheckpointOptions::default())?;
//! block.call(&x).sum(Kind::Float).backward();
//! assert!(block.fc1.ws.grad().equal(&expected));
//! # Ok::<(), tch_dist::activation_checkpoint::ActivationCheckpointError>(())
//! ```
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `mod.rs` | the API: the contract, the state, the use guard | `torch/distributed/_composable/checkpoint_activation.py` |
//! | `options.rs` | [`CheckpointOptions`], [`DeterminismCheck`] | its keyword arguments |
//! | `wrapper.rs` | each call's run through the engine's checkpoint function, its snapshot and its determinism check | `torch/utils/checkpoint.py` (`_checkpoint_without_reentrant_generator`, `CheckpointFunction`) |
//! | `error.rs` | [`ActivationCheckpointError`], [`ActivationCheckpointProblem`] | the `RuntimeError`s of `torch/utils/checkpoint.py` |
//!
//! The engine's half (the custom autograd function, the RNG states) is
//! `tch_dist_runtime`'s `autograd/checkpoint.rs` over the shim's csrc/checkpoint.cpp.

mod error;
mod options;
mod wrapper;

use std::sync::Arc;

use tch_dist_core::hooks::{register_forward_wrapper, RemovableHandle};
use tch_dist_core::path::join_fqn;
use tch_dist_core::{contract, ShallowClone, Shardable};
use tch_dist_runtime::UseGuard;

use crate::{Api, Composition, OnRank};

pub use error::{ActivationCheckpointError, ActivationCheckpointProblem};
pub use options::{CheckpointOptions, DeterminismCheck};

/// What [`checkpoint_activations`] keeps for a module (PyTorch's `_CheckpointState`).
///
/// ```
/// use tch_dist::activation_checkpoint::{checkpoint_activations, CheckpointOptions};
/// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// # let fc = tch::nn::linear(vs.root() / "fc", 4, 4, Default::default());
/// let state = checkpoint_activations(&fc, CheckpointOptions::default())?;
/// assert_eq!(state.options(), CheckpointOptions::default());
/// # Ok::<(), tch_dist::activation_checkpoint::ActivationCheckpointError>(())
/// ```
#[derive(Debug)]
pub struct CheckpointState {
    options: CheckpointOptions,
    // Held for the module's life: removing either would silently end the checkpointing or
    // the bypass check.
    _wrapper: RemovableHandle,
    _guard: Option<UseGuard>,
}

impl CheckpointState {
    /// The options it was applied with.
    ///
    /// ```
    /// use tch_dist::activation_checkpoint::{checkpoint_activations, CheckpointOptions};
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let fc = tch::nn::linear(vs.root() / "fc", 4, 4, Default::default());
    /// let opts = CheckpointOptions { preserve_rng_state: false, ..Default::default() };
    /// assert!(!checkpoint_activations(&fc, opts)?.options().preserve_rng_state);
    /// # Ok::<(), tch_dist::activation_checkpoint::ActivationCheckpointError>(())
    /// ```
    pub fn options(&self) -> CheckpointOptions {
        self.options
    }
}

/// Checkpoints the activations of `module`'s hooked calls (PyTorch's composable
/// `checkpoint(module)`; named so as not to collide with [`crate::checkpoint`], distributed
/// checkpoints): see the [module docs](self). Its registry name is `"checkpoint"`, as
/// PyTorch's.
///
/// Call the module with `.call(&x)` (or `call_with`): a call that bypasses the hooks
/// (`x.apply(&block)`, `block.forward(&x)`) keeps its activations, and its backward fails
/// with [`ActivationCheckpointError::Composition`] ([`Composition::HooksBypassed`]). The
/// block's type must be [`ShallowClone`] (`#[derive(ShallowClone)]`): the recomputation runs
/// on a second handle of the block taken at the call.
///
/// ```
/// use tch_dist::activation_checkpoint::{checkpoint_activations, CheckpointOptions};
/// use tch_dist::Call;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let fc = tch::nn::linear(vs.root() / "fc", 4, 4, Default::default());
/// checkpoint_activations(&fc, CheckpointOptions::default())?;
/// let y = fc.call(&tch::Tensor::ones([2, 4], tch::kind::FLOAT_CPU)); // keeps only its input
/// y.sum(tch::Kind::Float).backward(); // runs `fc` again, then differentiates it
/// # Ok::<(), tch_dist::activation_checkpoint::ActivationCheckpointError>(())
/// ```
///
/// # Errors
///
/// Applied twice ([`ActivationCheckpointError::Contract`]), or on a module whose forward
/// another API wraps ([`ActivationCheckpointError::Hook`]); nothing changes then.
#[contract(
    crate = "crate",
    name = "checkpoint",
    state = state,
    state_doc = r#"
```
use tch_dist::activation_checkpoint::{self, checkpoint_activations, CheckpointOptions};
let vs = tch::nn::VarStore::new(tch::Device::Cpu);
let fc = tch::nn::linear(vs.root() / "fc", 4, 4, Default::default());
assert!(activation_checkpoint::state(&fc).is_none());
checkpoint_activations(&fc, CheckpointOptions::default())?;
assert!(activation_checkpoint::state(&fc).is_some());
# Ok::<(), tch_dist::activation_checkpoint::ActivationCheckpointError>(())
```
"#
)]
pub fn checkpoint_activations<M>(
    module: &M,
    options: CheckpointOptions,
) -> Result<CheckpointState, ActivationCheckpointError>
where
    M: Shardable + ShallowClone + Send + 'static,
{
    let rank = tch_dist_runtime::default_group().map_or(0, |g| g.rank());
    let name = Arc::new(wrapper::ModuleName::new(short_type(module.type_name())));
    let guard = bypass_guard(module, rank, &name)?;
    let wrapper = wrapper::Wrapper {
        rank,
        name,
        type_name: std::any::type_name::<M>(),
        options,
        snapshot: wrapper::snapshot_of::<M>(),
    };
    let handle = register_forward_wrapper(module, Arc::new(wrapper))?;
    Ok(CheckpointState {
        options,
        _wrapper: handle,
        _guard: guard,
    })
}

/// The use guard over the module's trainable parameters: a use outside its hooked calls
/// fails the backward pass (`None` when nothing is trainable).
fn bypass_guard<M: Shardable + ?Sized>(
    module: &M,
    rank: usize,
    name: &Arc<wrapper::ModuleName>,
) -> Result<Option<UseGuard>, ActivationCheckpointError> {
    let named: Vec<(String, &tch::Tensor)> = module
        .named_parameters()
        .into_iter()
        .filter(|(_, p)| p.requires_grad())
        .collect();
    if named.is_empty() {
        return Ok(None);
    }
    let params: Vec<&tch::Tensor> = named.iter().map(|(_, p)| *p).collect();
    let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    let name = Arc::clone(name);
    let guard = UseGuard::new(rank, "checkpoint", &params, move |i| {
        let prefix = name.fqn().unwrap_or_default();
        ActivationCheckpointError::from(OnRank::new(
            rank,
            Composition::HooksBypassed {
                api: Api::CheckpointActivations,
                param: join_fqn(&prefix, names.get(i).map_or("", String::as_str)),
                module: name.get(),
            },
        ))
        .to_string()
    })?;
    Ok(Some(guard))
}

/// `Block` for `my_crate::model::Block`.
fn short_type(name: &str) -> String {
    let base = name.split('<').next().unwrap_or(name);
    base.rsplit("::").next().unwrap_or(base).to_string()
}
