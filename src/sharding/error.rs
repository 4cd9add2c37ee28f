//! The errors of tensor parallelism: [`ShardError`] (what [`shard_module`](super::shard_module),
//! [`parallelize_module`](super::parallelize_module), the sharders and the sharded layers'
//! hooks fail with), its context written once — [`OnRank`] of a [`ShardProblem`] (the plan
//! entry's [`PlanProblem`], a style's [`StyleProblem`], an argument), [`OnRank`] of a
//! [`Composition`] rule, an [`EngineFailure`], an [`OnHook`] of a [`ForwardProblem`] — and
//! [`SharderError`] (why a [`Sharder`](super::Sharder) refuses a module).
//!
//! Every message names the rank, the operation (`shard_module`) and the FQN at fault once.
//! Plan errors read `rank R: shard_module: `FQN`: what`; a failing hook reads
//! `shard_module: <part> `FQN` on rank R: what`, as PyTorch's module call raises it.
//!
//! One rule (see [`report`](crate::report)): a variant's Display names only its own context,
//! and what went wrong inside it is its [`source`](std::error::Error::source): the plan
//! entry's [`PlanProblem`], the spec check's
//! [`ShardingError`](tch_dist_core::sharding::ShardingError), the [`DistError`] of a failed
//! collective. `report(&err)` gives the whole text. A [`DistError`] names its rank itself,
//! so the context around it does not.
//!
//! The problems live in files by job:
//!
//! | file | job | PyTorch |
//! |---|---|---|
//! | `plan.rs` | [`PlanProblem`], [`StyleProblem`]: a plan refused before anything changes | the `ValueError`s / `RuntimeError`s of `_shard/api.py`, `NotImplementedError`s of `tensor/parallel/style.py` |
//! | `sharder.rs` | [`SharderError`]: why a sharder refuses a module | (none: a `Sharder.shard` raises its own) |
//! | `forward.rs` | [`OnHook`], [`HookSite`], [`ForwardProblem`]: a sharded module's failed hook | the errors of the sharded ops and of the styles' hooks |

use std::fmt;

use tch_dist_core::hooks::HookError;
use tch_dist_core::ContractError;
use tch_dist_runtime::{ArgumentError, DistError, ProcessGroup};

use crate::{Api, Composition, OnRank};

mod forward;
mod plan;
mod sharder;

pub use forward::{ForwardProblem, HookSite, OnHook};
pub use plan::{PlanProblem, StyleProblem};
pub use sharder::SharderError;

/// Errors of [`shard_module`](super::shard_module), of the sharders and of the sharded
/// layers' forward hooks (which hand them to [`ForwardError`](crate::ForwardError): a
/// caller of `f_call` gets them back with
/// [`ForwardError::downcast_ref`](crate::ForwardError::downcast_ref)). This rank's refusal
/// is [`OnRank`](Self::OnRank) of a [`ShardProblem`], or [`Composition`](Self::Composition)
/// of a rule of composing the APIs, its rank written once; the engine's failure on this
/// rank is an [`EngineFailure`], a failed hook an [`OnHook`]; another layer's error names
/// its own.
///
/// ```
/// use tch_dist::sharding::{PlanProblem, ShardProblem};
/// let problem = PlanProblem::NotAParameter;
/// let e = ShardProblem::Plan { fqn: "fc3.weight".into(), problem }.on(1);
/// assert_eq!(e.to_string(), "rank 1: shard_module: `fc3.weight`");
/// assert_eq!(
///     tch_dist::report(&e),
///     "rank 1: shard_module: `fc3.weight`: is not a parameter of the model"
/// );
/// assert_eq!(e.rank(), Some(1));
/// assert!(matches!(
///     e.problem(),
///     Some(ShardProblem::Plan { problem: PlanProblem::NotAParameter, .. })
/// ));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// This rank refused: its rank and the problem (the plan, a style, an argument); nothing
    /// was changed.
    #[error(transparent)]
    OnRank(#[from] OnRank<ShardProblem>),
    /// A rule of composing shard_module with the other APIs, broken on this rank
    /// ([`Api::ShardModule`]'s [`Composition`]): a module `shard_module` hooked ran without
    /// its hooks ([`Composition::HooksBypassed`]: its parameter was used, in the autograd
    /// graph, outside a call of the module through them, where this rank's shard alone
    /// gives a wrong result). Raised by the check of the sharded model's call (`f_call`
    /// returns it in a [`ForwardError`](crate::ForwardError)) or, as its message, by the
    /// backward pass, before any guarded parameter gets a gradient.
    #[error(transparent)]
    Composition(#[from] OnRank<Composition>),
    /// The engine failed on this rank: sharding a module or parameter, or summing a
    /// sequence-parallel gradient.
    #[error(transparent)]
    Engine(#[from] EngineFailure),
    /// A sharded module's forward hook failed: the module call (`f_call`) returns this
    /// error inside a [`ForwardError`](crate::ForwardError), `call` panics with its message.
    #[error(transparent)]
    Forward(#[from] OnHook),
    /// Applied twice, or the module's names changed (the message names `shard_module`).
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// The ranks disagree: their plans differ, or a check failed on other ranks; nothing
    /// was changed on any rank.
    #[error(transparent)]
    Disagreement {
        /// What every rank shares ([`DistError::Mismatch`] naming the plan entry and each
        /// rank's value, or [`DistError::PeersFailed`] naming the ranks whose check failed).
        source: DistError,
    },
}

impl ShardError {
    /// The rank the error names (this rank's, or the disagreement's); `None` for a
    /// contract's error.
    pub fn rank(&self) -> Option<usize> {
        match self {
            ShardError::OnRank(e) => Some(e.rank),
            ShardError::Composition(e) => Some(e.rank),
            ShardError::Engine(e) => Some(e.rank),
            ShardError::Forward(e) => Some(e.rank),
            ShardError::Disagreement { source } => source.rank(),
            ShardError::Contract(_) => None,
        }
    }

    /// This rank's problem (`None` for any other error).
    pub fn problem(&self) -> Option<&ShardProblem> {
        match self {
            ShardError::OnRank(e) => Some(&e.problem),
            _ => None,
        }
    }

    /// The rule of composing the APIs this rank broke (`None` for any other error).
    ///
    /// ```
    /// use tch_dist::sharding::ShardError;
    /// use tch_dist::{Api, Composition, OnRank};
    /// let (module, param) = ("fc1".into(), "fc1.weight".into());
    /// let bypassed = Composition::HooksBypassed { api: Api::ShardModule, module, param };
    /// let e = ShardError::from(OnRank::new(0, bypassed));
    /// assert!(tch_dist::report(&e).starts_with(
    ///     "rank 0: shard_module: parameter `fc1.weight` of `fc1` was used outside a call of the \
    ///      module through its forward hooks"
    /// ));
    /// assert!(matches!(e.composition(), Some(Composition::HooksBypassed { .. })));
    /// ```
    pub fn composition(&self) -> Option<&Composition> {
        match self {
            ShardError::Composition(e) => Some(&e.problem),
            _ => None,
        }
    }

    /// A plan error of this rank of `group`.
    pub fn plan(group: &ProcessGroup, fqn: &str, problem: PlanProblem) -> ShardError {
        let fqn = fqn.to_string();
        ShardProblem::Plan { fqn, problem }.on(group.rank())
    }

    /// `fqn`'s hooks could not be registered, on this rank of `group`.
    pub(crate) fn unhookable(group: &ProcessGroup, fqn: &str, source: HookError) -> ShardError {
        ShardError::plan(group, fqn, PlanProblem::Unhookable { source })
    }

    /// An engine failure of this rank of `group` while sharding `fqn` (for a
    /// [`Sharder`](super::Sharder)'s collectives).
    pub fn dist(group: &ProcessGroup, fqn: &str, source: DistError) -> ShardError {
        let problem = EngineProblem::Sharding {
            fqn: fqn.to_string(),
            source: Box::new(source),
        };
        ShardError::Engine(EngineFailure {
            rank: group.rank(),
            problem,
        })
    }

    pub(crate) fn forward(
        group: &ProcessGroup,
        fqn: &str,
        site: HookSite,
        problem: ForwardProblem,
    ) -> ShardError {
        ShardError::Forward(OnHook {
            rank: group.rank(),
            site,
            fqn: fqn.to_string(),
            problem,
        })
    }

    /// `param` of `module` used outside a call of the module through its hooks, on `rank`.
    pub(crate) fn hooks_bypassed(rank: usize, module: &str, param: &str) -> ShardError {
        let bypassed = Composition::HooksBypassed {
            api: Api::ShardModule,
            module: module.to_string(),
            param: param.to_string(),
        };
        ShardError::Composition(OnRank::new(rank, bypassed))
    }
}

/// Why [`shard_module`](super::shard_module) or
/// [`parallelize_module`](super::parallelize_module) refused on a rank, before anything
/// changed ([`ShardError::OnRank`] adds the rank). Each names the operation and the plan
/// key at fault; what is wrong is the [`source`](std::error::Error::source).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ShardProblem {
    /// The plan does not fit the model or the group.
    #[error("shard_module: {}", Key(fqn))]
    Plan {
        /// The plan key (FQN) at fault (`""`: the root module).
        fqn: String,
        /// What is wrong.
        #[source]
        problem: PlanProblem,
    },
    /// [`parallelize_module`](super::parallelize_module)'s mesh or plan asks for what
    /// tch-dist does not build.
    #[error("parallelize_module: {}", Key(fqn))]
    Parallelize {
        /// The plan key (FQN) at fault (`""`: the mesh).
        fqn: String,
        /// What is wrong.
        #[source]
        problem: StyleProblem,
    },
    /// An argument of [`shard_module`](super::shard_module) is out of range (`src_rank`).
    #[error("shard_module")]
    InvalidArgument {
        /// What is wrong (boxed, so that every `Result` stays small).
        #[source]
        problem: Box<ArgumentError>,
    },
}

impl ShardProblem {
    /// This problem as rank `rank`'s [`ShardError`].
    pub fn on(self, rank: usize) -> ShardError {
        ShardError::OnRank(OnRank::new(rank, self))
    }
}

/// The engine failed on this rank, its context written once: the rank, then what
/// `shard_module` was doing ([`EngineProblem`]), whose [`DistError`] is the
/// [`source`](std::error::Error::source). The [`DistError`] names the rank itself, so the
/// context writes `rank R: ` only where it does not (an error of no group, of another rank).
///
/// ```
/// use tch_dist::sharding::{EngineFailure, EngineProblem};
/// use tch_dist::DistError;
/// let source = DistError::Collective { rank: 1, op: "scatter", cause: "Connection reset".into() };
/// let problem = EngineProblem::Sharding { fqn: "fc1.weight".into(), source: Box::new(source) };
/// let e = EngineFailure { rank: 1, problem };
/// assert_eq!(
///     tch_dist::report(&e),
///     "shard_module: `fc1.weight`: rank 1: scatter failed: Connection reset"
/// );
/// ```
#[derive(Debug, Clone)]
pub struct EngineFailure {
    /// This rank.
    pub rank: usize,
    /// What failed.
    pub problem: EngineProblem,
}

impl fmt::Display for EngineFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.problem.dist().rank() != Some(self.rank) {
            write!(f, "rank {}: ", self.rank)?;
        }
        write!(f, "{}", self.problem)
    }
}

impl std::error::Error for EngineFailure {
    // The problem's cause (the DistError), not the problem: its text is this error's already.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.problem.source()
    }
}

/// What `shard_module` was doing on a rank when the engine failed (the
/// [`problem`](EngineFailure::problem) of an [`EngineFailure`]); the engine's [`DistError`]
/// is the [`source`](std::error::Error::source).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum EngineProblem {
    /// Sharding `fqn` (scattering or broadcasting its values, or rebuilding a sharded
    /// tensor); the modules sharded before it stay sharded.
    #[error("shard_module: {}", Key(fqn))]
    Sharding {
        /// The module or parameter being sharded.
        fqn: String,
        /// What the engine said (boxed, so that every `Result` stays small).
        source: Box<DistError>,
    },
    /// Summing a sequence-parallel parameter's gradient over the tensor-parallel group:
    /// the backward pass fails with this message.
    #[error(
        "shard_module: sequence-parallel parameter `{param}`: summing its gradient over the \
         tensor-parallel group failed"
    )]
    GradientSum {
        /// The parameter (its FQN).
        param: String,
        /// What the engine said (boxed, so that every `Result` stays small).
        source: Box<DistError>,
    },
}

impl EngineProblem {
    /// The engine's error.
    fn dist(&self) -> &DistError {
        match self {
            EngineProblem::Sharding { source, .. } | EngineProblem::GradientSum { source, .. } => {
                source
            }
        }
    }
}

/// A plan key in backquotes, the root module by name (fully_shard's errors name modules
/// the same way).
pub(crate) struct Key<'a>(pub(crate) &'a str);

impl fmt::Display for Key<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("the root module")
        } else {
            write!(f, "`{}`", self.0)
        }
    }
}

#[cfg(test)]
mod tests;
