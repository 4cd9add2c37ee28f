//! What every API's error shares: its context written once ([`OnRank`]) and the rules of
//! composing the APIs on one model ([`Composition`]).
//!
//! An API's error type (`CheckpointError`, `FsdpError`, ...) is an enum whose variants are
//! either another layer's error, which names its own rank (a [`DistError`](crate::DistError),
//! a `ContractError`), or `OnRank` of the API's problem enum: the rank written once, the
//! problem's variants without it, as `std::io::Error` is a kind plus its context.

use std::fmt;

/// An API's error on one rank, its context written once: the rank, then the problem (whose
/// text names the API). `Display` is `rank {rank}: {problem}`; the problem's cause is the
/// [`source`](std::error::Error::source), as `std::io::Error`'s kind plus its context.
///
/// ```
/// use tch_dist::checkpoint::{CheckpointError, CheckpointProblem};
/// use tch_dist::OnRank;
/// let e = CheckpointError::from(OnRank::new(1, CheckpointProblem::MissingKey { fqn: "fc.weight".into() }));
/// assert_eq!(e.to_string(), "rank 1: checkpoint: `fc.weight` is not in the checkpoint");
/// assert_eq!(e.rank(), Some(1));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OnRank<P> {
    /// The rank the problem happened on (its rank in the API's group where the error
    /// says so, else in the world).
    pub rank: usize,
    /// What went wrong.
    pub problem: P,
}

impl<P> OnRank<P> {
    /// `problem` on `rank`.
    pub fn new(rank: usize, problem: P) -> Self {
        OnRank { rank, problem }
    }
}

impl<P: fmt::Display> fmt::Display for OnRank<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.problem)
    }
}

impl<P: std::error::Error> std::error::Error for OnRank<P> {
    // The problem's cause, not the problem: its text is this error's already.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.problem.source()
    }
}

/// An API of this crate that manages a module, as a [`Composition`] rule names it.
///
/// ```
/// assert_eq!(tch_dist::Api::FullyShard.to_string(), "fully_shard");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Api {
    /// `replicate` (DDP).
    Replicate,
    /// `fully_shard` (FSDP2).
    FullyShard,
    /// `shard_module` / `parallelize_module` (tensor parallelism).
    ShardModule,
    /// `checkpoint_activations` (PyTorch's composable `checkpoint`, whose errors say
    /// `checkpoint`).
    CheckpointActivations,
}

impl fmt::Display for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Api::Replicate => "replicate",
            Api::FullyShard => "fully_shard",
            Api::ShardModule => "shard_module",
            Api::CheckpointActivations => "checkpoint",
        })
    }
}

/// A rule of composing the APIs on one model, broken: one enum for every API's error
/// (`FsdpError::Composition`, `ShardError::Composition`, ...), each rule's text written
/// once with the API's part of it.
///
/// ```
/// use tch_dist::{Api, Composition};
/// let e = Composition::TensorParallelRanks {
///     api: Api::Replicate,
///     fqn: "fc.weight".into(),
///     tp_ranks: vec![0, 1],
///     ranks: vec![0, 1, 2, 3],
/// };
/// assert_eq!(
///     e.to_string(),
///     "replicate: parameter `fc.weight` is tensor-parallel over ranks [0, 1] and replicate \
///      averages over ranks [0, 1, 2, 3]: left out of its buckets, its gradient would not be \
///      averaged; use the same ranks for both"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Composition {
    /// A parameter of a managed module was used outside a call of the module through its
    /// hooks (`x.apply(&layer)`, `layer.forward(&x)`), where it holds only this rank's
    /// shard (fully_shard), this rank's shard alone gives a wrong result (shard_module), or
    /// the forward kept its activations (checkpoint_activations).
    #[error("{api}: parameter `{param}` of {} was used outside {}", Subject(*api, module), Bypass(*api, module))]
    HooksBypassed {
        /// The API whose hooks were bypassed.
        api: Api,
        /// The bypassed module's FQN (`""` for the API's root module).
        module: String,
        /// The parameter's FQN.
        param: String,
    },
    /// A parameter `shard_module` sharded over other ranks than the data-parallel API
    /// averages over.
    #[error(
        "{api}: parameter `{fqn}` is tensor-parallel over ranks {tp_ranks:?} and {api} \
         averages over ranks {ranks:?}: {}",
        RanksFix(*api)
    )]
    TensorParallelRanks {
        /// `replicate` or `fully_shard`.
        api: Api,
        /// The parameter.
        fqn: String,
        /// The tensor-parallel group's global ranks.
        tp_ranks: Vec<usize>,
        /// The data-parallel API's.
        ranks: Vec<usize>,
    },
    /// A data-parallel API was given the ranks a parameter is tensor-parallel over, and
    /// they are not the whole world: the ranks outside (the mesh's other dim, which sees
    /// other data) would never average with these.
    #[error(
        "{api}: parameter `{fqn}` is tensor-parallel over ranks {ranks:?}, the ranks {api} \
         was given: give {api} the data-parallel dim of the mesh (`mesh.dim(\"dp\")`), not \
         the tensor-parallel one"
    )]
    TensorParallelDim {
        /// The data-parallel API (`fully_shard`).
        api: Api,
        /// The parameter.
        fqn: String,
        /// The global ranks of both groups.
        ranks: Vec<usize>,
    },
    /// A submodule is managed by `replicate`, which cannot run inside `api`.
    #[error(
        "{api}: submodule `{module}` is managed by replicate; apply replicate only to modules \
         outside every {api} module"
    )]
    ReplicatedInside {
        /// The enclosing API (`fully_shard`).
        api: Api,
        /// The submodule's FQN.
        module: String,
    },
}

/// A module in a [`Composition`] text: checkpoint_activations names it in backquotes as
/// "checkpointed", the others the root module by name.
struct Subject<'a>(Api, &'a str);

impl fmt::Display for Subject<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.0, self.1) {
            (Api::CheckpointActivations, module) => write!(f, "checkpointed `{module}`"),
            (_, "") => f.write_str("the root module"),
            (_, module) => write!(f, "`{module}`"),
        }
    }
}

/// Where a bypassed parameter was used, what that costs, and the fix, by API.
struct Bypass<'a>(Api, &'a str);

impl fmt::Display for Bypass<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Bypass(api, module) = *self;
        match api {
            Api::CheckpointActivations => f.write_str(
                "the module's hooked call; call it with `.call(&x)` (`call_with` for several \
                 inputs), not `x.apply(&m)` or `m.forward(&x)`",
            ),
            Api::ShardModule => write!(
                f,
                "a call of the module through its forward hooks, where this rank's shard alone \
                 gives a wrong result; {} (a deliberate direct use goes in \
                 ShardState::allow_direct_use)",
                HookedCall(module)
            ),
            Api::FullyShard | Api::Replicate => write!(
                f,
                "a call of the module through its hooks, where it holds only this rank's \
                 shard; {}",
                HookedCall(module)
            ),
        }
    }
}

/// How to call a hooked module: with `call`, as its parent's field.
pub(crate) struct HookedCall<'a>(pub(crate) &'a str);

impl fmt::Display for HookedCall<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.rsplit('.').next().filter(|s| !s.is_empty()) {
            Some(field) => write!(
                f,
                "call the module as `self.{field}.call(&x)`, not `x.apply(&self.{field})` or \
                 `self.{field}.forward(&x)`"
            ),
            None => {
                f.write_str("call the module with `.call(&x)`, not `x.apply(..)` or `.forward(..)`")
            }
        }
    }
}

/// What a [`Composition::TensorParallelRanks`] costs and its fix, by API.
struct RanksFix(Api);

impl fmt::Display for RanksFix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Api::Replicate => {
                "left out of its buckets, its gradient would not be averaged; use the same \
                 ranks for both"
            }
            _ => {
                "give fully_shard the same ranks, or the other dim of the mesh (FSDP x TP: \
                 `mesh.dim(\"dp\")` beside `mesh.dim(\"tp\")`)"
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rule's text for each API that raises it, pinned (the texts the APIs' own
    /// variants had).
    #[test]
    fn composition_texts() {
        let bypassed = |api, module: &str| Composition::HooksBypassed {
            api,
            module: module.into(),
            param: "layers.0.fc.weight".into(),
        };
        assert_eq!(
            bypassed(Api::FullyShard, "layers.0").to_string(),
            "fully_shard: parameter `layers.0.fc.weight` of `layers.0` was used outside a call \
             of the module through its hooks, where it holds only this rank's shard; call the \
             module as `self.0.call(&x)`, not `x.apply(&self.0)` or `self.0.forward(&x)`"
        );
        assert_eq!(
            bypassed(Api::ShardModule, "").to_string(),
            "shard_module: parameter `layers.0.fc.weight` of the root module was used outside \
             a call of the module through its forward hooks, where this rank's shard alone \
             gives a wrong result; call the module with `.call(&x)`, not `x.apply(..)` or \
             `.forward(..)` (a deliberate direct use goes in ShardState::allow_direct_use)"
        );
        assert_eq!(
            bypassed(Api::CheckpointActivations, "layers.0").to_string(),
            "checkpoint: parameter `layers.0.fc.weight` of checkpointed `layers.0` was used \
             outside the module's hooked call; call it with `.call(&x)` (`call_with` for \
             several inputs), not `x.apply(&m)` or `m.forward(&x)`"
        );
        let ranks = Composition::TensorParallelRanks {
            api: Api::FullyShard,
            fqn: "fc.weight".into(),
            tp_ranks: vec![0, 1],
            ranks: vec![0, 2],
        };
        assert_eq!(
            ranks.to_string(),
            "fully_shard: parameter `fc.weight` is tensor-parallel over ranks [0, 1] and \
             fully_shard averages over ranks [0, 2]: give fully_shard the same ranks, or the \
             other dim of the mesh (FSDP x TP: `mesh.dim(\"dp\")` beside `mesh.dim(\"tp\")`)"
        );
        let dim = Composition::TensorParallelDim {
            api: Api::FullyShard,
            fqn: "fc.weight".into(),
            ranks: vec![0, 1],
        };
        assert_eq!(
            dim.to_string(),
            "fully_shard: parameter `fc.weight` is tensor-parallel over ranks [0, 1], the ranks \
             fully_shard was given: give fully_shard the data-parallel dim of the mesh \
             (`mesh.dim(\"dp\")`), not the tensor-parallel one"
        );
        let inside = Composition::ReplicatedInside {
            api: Api::FullyShard,
            module: "layers.1".into(),
        };
        assert_eq!(
            inside.to_string(),
            "fully_shard: submodule `layers.1` is managed by replicate; apply replicate only \
             to modules outside every fully_shard module"
        );
    }

    /// `OnRank`'s source is the problem's cause, not the problem (whose text is the
    /// error's already).
    #[test]
    fn on_rank_source_is_the_problems_cause() {
        #[derive(Debug, thiserror::Error)]
        #[error("api: reading failed")]
        struct Reading(#[source] std::io::Error);
        let e = OnRank::new(3, Reading(std::io::Error::other("disk gone")));
        assert_eq!(e.to_string(), "rank 3: api: reading failed");
        let source = std::error::Error::source(&e).map(|s| s.to_string());
        assert_eq!(source.as_deref(), Some("disk gone"));
    }
}
