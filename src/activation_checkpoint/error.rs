//! [`ActivationCheckpointError`]: why `checkpoint_activations` refused, or why a
//! checkpointed call or its recomputation failed.

use tch_dist_core::hooks::HookError;
use tch_dist_core::ContractError;
use tch_dist_runtime::DistError;

use crate::{Composition, OnRank};

/// Errors of [`checkpoint_activations`](super::checkpoint_activations) and of the calls of a
/// checkpointed module. A refusal at apply leaves the module unchanged; a refused call runs
/// nothing. This rank's problem is [`OnRank`](Self::OnRank) of an
/// [`ActivationCheckpointProblem`], or [`Composition`](Self::Composition) of a rule of
/// composing the APIs, its rank written once; another layer's error names its own.
///
/// ```
/// use tch_dist::activation_checkpoint::{ActivationCheckpointError, ActivationCheckpointProblem};
/// let e = ActivationCheckpointProblem::Nondeterministic {
///     module: "layers.0".into(),
///     output: 0,
///     first: "[4, 8] Float cpu".into(),
///     again: "[4, 9] Float cpu".into(),
/// }
/// .on(1);
/// assert_eq!(
///     e.to_string(),
///     "rank 1: checkpoint: the recomputation of `layers.0` differs from its first run: \
///      output 0 is [4, 9] Float cpu, was [4, 8] Float cpu; make the block's forward \
///      deterministic in shape, or set `determinism_check: DeterminismCheck::None`"
/// );
/// assert_eq!(e.rank(), Some(1));
/// assert!(matches!(e.problem(), Some(ActivationCheckpointProblem::Nondeterministic { .. })));
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
    /// This rank refused or failed: its rank and the problem.
    #[error(transparent)]
    OnRank(#[from] OnRank<ActivationCheckpointProblem>),
    /// A rule of composing the APIs, broken on this rank
    /// ([`Api::CheckpointActivations`](crate::Api::CheckpointActivations)'s
    /// [`Composition`]): a parameter of the checkpointed module used outside its hooked call
    /// (`x.apply(&block)`, `block.forward(&x)`), whose forward kept its activations and
    /// bypassed every hook of the module ([`Composition::HooksBypassed`]; its `param` is the
    /// parameter's FQN within the module).
    #[error(transparent)]
    Composition(#[from] OnRank<Composition>),
}

impl ActivationCheckpointError {
    /// The rank the error names (this rank's, or the collective's); `None` for a contract's
    /// or a hook's error.
    pub fn rank(&self) -> Option<usize> {
        match self {
            ActivationCheckpointError::OnRank(e) => Some(e.rank),
            ActivationCheckpointError::Composition(e) => Some(e.rank),
            ActivationCheckpointError::Dist(e) => e.rank(),
            ActivationCheckpointError::Contract(_) | ActivationCheckpointError::Hook(_) => None,
        }
    }

    /// This rank's problem (`None` for another layer's error or a [`Composition`]).
    pub fn problem(&self) -> Option<&ActivationCheckpointProblem> {
        match self {
            ActivationCheckpointError::OnRank(e) => Some(&e.problem),
            _ => None,
        }
    }

    /// The rule of composing the APIs this rank broke (`None` for any other error).
    ///
    /// ```
    /// use tch_dist::activation_checkpoint::ActivationCheckpointError;
    /// use tch_dist::{Api, Composition, OnRank};
    /// let e = ActivationCheckpointError::from(OnRank::new(
    ///     0,
    ///     Composition::HooksBypassed {
    ///         api: Api::CheckpointActivations,
    ///         module: "layers.0".into(),
    ///         param: "layers.0.fc.weight".into(),
    ///     },
    /// ));
    /// assert!(e.to_string().starts_with(
    ///     "rank 0: checkpoint: parameter `layers.0.fc.weight` of checkpointed `layers.0` was used"
    /// ));
    /// assert!(matches!(e.composition(), Some(Composition::HooksBypassed { .. })));
    /// ```
    pub fn composition(&self) -> Option<&Composition> {
        match self {
            ActivationCheckpointError::Composition(e) => Some(&e.problem),
            _ => None,
        }
    }
}

impl ActivationCheckpointProblem {
    /// This problem as rank `rank`'s [`ActivationCheckpointError`].
    pub fn on(self, rank: usize) -> ActivationCheckpointError {
        ActivationCheckpointError::OnRank(OnRank::new(rank, self))
    }
}

/// What went wrong on a rank checkpointing a module or calling it
/// ([`ActivationCheckpointError::OnRank`] adds the rank).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ActivationCheckpointProblem {
    /// The module was called as another type than it was checkpointed as.
    #[error(
        "checkpoint: `{module}` was checkpointed as a `{expected}` and called as a `{got}`; \
         call it as the type `checkpoint_activations` was given"
    )]
    CalledAs {
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
        "checkpoint: `{module}` holds `{child}`, which fully_shard manages on its own; apply \
         checkpoint_activations to `{child}` instead, or fully_shard to `{module}` (as \
         torchtitan does: one block, both APIs)"
    )]
    NestedFullyShard {
        /// The checkpointed module.
        module: String,
        /// The submodule, by its FQN within the module.
        child: String,
    },
    /// The engine failed to run the checkpointed forward.
    #[error("checkpoint: the forward of `{module}` failed: {message}")]
    Forward {
        /// The module.
        module: String,
        /// The engine's message.
        message: String,
    },
    /// The recomputation returned another number of outputs than the first run.
    #[error(
        "checkpoint: the recomputation of `{module}` returned {again} outputs, its first run \
         {first}; make the block's forward return the same outputs every time"
    )]
    OutputCount {
        /// The module.
        module: String,
        /// Outputs of the first run.
        first: usize,
        /// Outputs of the recomputation.
        again: usize,
    },
    /// A recomputed output's shape, dtype or device differs from the first run's.
    #[error(
        "checkpoint: the recomputation of `{module}` differs from its first run: output \
         {output} is {again}, was {first}; make the block's forward deterministic in shape, \
         or set `determinism_check: DeterminismCheck::None`"
    )]
    Nondeterministic {
        /// The module.
        module: String,
        /// The output's position.
        output: usize,
        /// The first run's shape, dtype and device.
        first: String,
        /// The recomputation's.
        again: String,
    },
}
