//! [`ActivationCheckpointError`]: why `checkpoint_activations` refused, or why a
//! checkpointed call or its recomputation failed.

use tch_dist_core::hooks::HookError;
use tch_dist_core::ContractError;
use tch_dist_runtime::DistError;

/// Errors of [`checkpoint_activations`](super::checkpoint_activations) and of the calls of a
/// checkpointed module. A refusal at apply leaves the module unchanged; a refused call runs
/// nothing.
///
/// ```
/// use tch_dist::activation_checkpoint::ActivationCheckpointError;
/// let e = ActivationCheckpointError::Nondeterministic {
///     rank: 1,
///     module: "layers.0".into(),
///     output: 0,
///     first: "[4, 8] Float cpu".into(),
///     again: "[4, 9] Float cpu".into(),
/// };
/// assert_eq!(
///     e.to_string(),
///     "rank 1: checkpoint: the recomputation of `layers.0` differs from its first run: \
///      output 0 is [4, 9] Float cpu, was [4, 8] Float cpu; make the block's forward \
///      deterministic in shape, or set `determinism_check: DeterminismCheck::None`"
/// );
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ActivationCheckpointError {
    /// Applied twice, or the module's names changed.
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// The forward wrapper could not be registered (another API wraps the forward).
    #[error(transparent)]
    Hook(#[from] HookError),
    /// The use guard over the module's parameters could not be made.
    #[error(transparent)]
    Dist(#[from] DistError),
    /// The module was called as another type than it was checkpointed as.
    #[error(
        "rank {rank}: checkpoint: `{module}` was checkpointed as a `{expected}` and called \
         as a `{got}`; call it as the type `checkpoint_activations` was given"
    )]
    CalledAs {
        /// This rank.
        rank: usize,
        /// The module.
        module: String,
        /// The type given to `checkpoint_activations`.
        expected: &'static str,
        /// The type called.
        got: &'static str,
    },
    /// A submodule of the checkpointed module is managed by its own `fully_shard` call: its
    /// parameters hold their shards outside its calls, so they cannot be inputs of the
    /// checkpoint.
    #[error(
        "rank {rank}: checkpoint: `{module}` holds `{child}`, which fully_shard manages on its \
         own; apply checkpoint_activations to `{child}` instead, or fully_shard to `{module}` \
         (as torchtitan does: one block, both APIs)"
    )]
    NestedFullyShard {
        /// This rank.
        rank: usize,
        /// The checkpointed module.
        module: String,
        /// The submodule, by its FQN within the module.
        child: String,
    },
    /// The engine failed to run the checkpointed forward.
    #[error("rank {rank}: checkpoint: the forward of `{module}` failed: {message}")]
    Forward {
        /// This rank.
        rank: usize,
        /// The module.
        module: String,
        /// The engine's message.
        message: String,
    },
    /// The recomputation returned another number of outputs than the first run.
    #[error(
        "rank {rank}: checkpoint: the recomputation of `{module}` returned {again} outputs, \
         its first run {first}; make the block's forward return the same outputs every time"
    )]
    OutputCount {
        /// This rank.
        rank: usize,
        /// The module.
        module: String,
        /// Outputs of the first run.
        first: usize,
        /// Outputs of the recomputation.
        again: usize,
    },
    /// A recomputed output's shape, dtype or device differs from the first run's.
    #[error(
        "rank {rank}: checkpoint: the recomputation of `{module}` differs from its first \
         run: output {output} is {again}, was {first}; make the block's forward \
         deterministic in shape, or set `determinism_check: DeterminismCheck::None`"
    )]
    Nondeterministic {
        /// This rank.
        rank: usize,
        /// The module.
        module: String,
        /// The output's position.
        output: usize,
        /// The first run's shape, dtype and device.
        first: String,
        /// The recomputation's.
        again: String,
    },
    /// A parameter of the checkpointed module was used outside its hooked call
    /// (`x.apply(&block)`, `block.forward(&x)`): that forward kept its activations and
    /// bypassed every hook of the module.
    #[error(
        "rank {rank}: checkpoint: parameter `{param}` of checkpointed `{module}` was used \
         outside the module's hooked call; call it with `.call(&x)` (`call_with` for several \
         inputs), not `x.apply(&m)` or `m.forward(&x)`"
    )]
    HooksBypassed {
        /// This rank.
        rank: usize,
        /// The module.
        module: String,
        /// The parameter, by its FQN within the module.
        param: String,
    },
}
