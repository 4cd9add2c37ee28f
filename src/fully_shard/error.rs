//! [`FsdpError`]: why `fully_shard` refused, or why one of its hooks failed.

use tch_dist_core::hooks::HookError;
use tch_dist_core::ContractError;
use tch_dist_runtime::DistError;

use crate::sharding::Key;
use crate::{Composition, OnRank};

/// Errors of [`fully_shard`](super::fully_shard) and its state. A refusal at apply happens on
/// every rank together and leaves the model unchanged. This rank's refusal is
/// [`OnRank`](Self::OnRank) of an [`FsdpProblem`], or [`Composition`](Self::Composition) of
/// a rule of composing the APIs, its rank written once; another layer's error names its own.
///
/// ```
/// use tch_dist::fully_shard::{FsdpError, FsdpProblem};
/// let e = FsdpProblem::TiedParameter {
///     fqn: "head.weight".into(),
///     other: "embed.weight".into(),
/// }
/// .on(0);
/// assert_eq!(
///     e.to_string(),
///     "rank 0: fully_shard: parameter `head.weight` is already managed by another \
///      fully_shard call (as `embed.weight`): apply fully_shard bottom-up, children before \
///      their parents, and manage a parameter tied between two modules by one call on a \
///      module that holds both"
/// );
/// assert_eq!(e.rank(), Some(0));
/// assert!(matches!(e.problem(), Some(FsdpProblem::TiedParameter { .. })));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FsdpError {
    /// Applied twice, or together with a conflicting API (`replicate`), or the module's
    /// names changed.
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// The engine failed or refused (a collective, a timeout, options or parameters that
    /// differ across ranks).
    #[error(transparent)]
    Dist(#[from] DistError),
    /// The full state dict could not be made (`full_state_dict`: a parameter's pieces could
    /// not be gathered).
    #[error(transparent)]
    StateDict(Box<crate::state_dict::StateDictError>),
    /// fully_shard's forward hooks could not be registered.
    #[error(transparent)]
    Hook(#[from] HookError),
    /// This rank refused: its rank and the problem.
    #[error(transparent)]
    OnRank(#[from] OnRank<FsdpProblem>),
    /// A rule of composing fully_shard with the other APIs, broken on this rank
    /// ([`Api::FullyShard`](crate::Api::FullyShard)'s [`Composition`]): a parameter
    /// tensor-parallel over other ranks ([`Composition::TensorParallelRanks`]) or over the
    /// ranks fully_shard was given ([`Composition::TensorParallelDim`]), a submodule
    /// `replicate` manages ([`Composition::ReplicatedInside`]), or a managed module run
    /// without its hooks ([`Composition::HooksBypassed`]: inside a hooked call, where its
    /// parameters hold only this rank's shards, refused at the first op that used one, in
    /// every grad mode, `f_call` returning this error and `call` panicking with its
    /// message; or found in the autograd graph by the forward's check or the backward
    /// pass's; its `module` and `param` are FQNs within the outermost enclosing fully_shard
    /// call's module, `""` for that module itself).
    #[error(transparent)]
    Composition(#[from] OnRank<Composition>),
    /// The module was not passed to `fully_shard`.
    #[error("fully_shard: this module is not managed by fully_shard (call fully_shard first)")]
    NotFullyShard,
    /// A forward or backward hook of the managed module `module` failed (the source names
    /// the rank and the collective; [`report`](crate::report) gives both).
    #[error("fully_shard: the hook of {} failed", Key(module))]
    Hooked {
        /// This rank.
        rank: usize,
        /// The managed module's FQN (within the outermost enclosing fully_shard call's
        /// module; `""` for that module itself).
        module: String,
        /// What failed.
        source: DistError,
    },
}

impl FsdpError {
    /// The rank the error names (this rank's, or the collective's); `None` where it names
    /// none ([`NotFullyShard`](Self::NotFullyShard), a contract's or a hook's error).
    pub fn rank(&self) -> Option<usize> {
        match self {
            FsdpError::OnRank(e) => Some(e.rank),
            FsdpError::Composition(e) => Some(e.rank),
            FsdpError::Hooked { rank, .. } => Some(*rank),
            FsdpError::Dist(e) => e.rank(),
            FsdpError::Contract(_)
            | FsdpError::StateDict(_)
            | FsdpError::Hook(_)
            | FsdpError::NotFullyShard => None,
        }
    }

    /// This rank's problem (`None` for another layer's error or a [`Composition`]).
    pub fn problem(&self) -> Option<&FsdpProblem> {
        match self {
            FsdpError::OnRank(e) => Some(&e.problem),
            _ => None,
        }
    }

    /// The rule of composing the APIs this rank broke (`None` for any other error).
    ///
    /// ```
    /// use tch_dist::fully_shard::FsdpError;
    /// use tch_dist::{Api, Composition, OnRank};
    /// let e = FsdpError::from(OnRank::new(
    ///     1,
    ///     Composition::ReplicatedInside { api: Api::FullyShard, module: "layers.1".into() },
    /// ));
    /// assert_eq!(
    ///     e.to_string(),
    ///     "rank 1: fully_shard: submodule `layers.1` is managed by replicate; apply replicate \
    ///      only to modules outside every fully_shard module"
    /// );
    /// assert!(matches!(e.composition(), Some(Composition::ReplicatedInside { .. })));
    /// ```
    pub fn composition(&self) -> Option<&Composition> {
        match self {
            FsdpError::Composition(e) => Some(&e.problem),
            _ => None,
        }
    }
}

impl FsdpProblem {
    /// This problem as rank `rank`'s [`FsdpError`].
    pub fn on(self, rank: usize) -> FsdpError {
        FsdpError::OnRank(OnRank::new(rank, self))
    }
}

impl From<crate::state_dict::StateDictError> for FsdpError {
    fn from(e: crate::state_dict::StateDictError) -> Self {
        FsdpError::StateDict(Box::new(e))
    }
}

/// Why `fully_shard` refused on a rank ([`FsdpError::OnRank`] adds the rank).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FsdpProblem {
    /// A parameter is not contiguous: its shard would not be a view of its flat shard.
    #[error(
        "fully_shard: parameter `{fqn}` is not contiguous; make it contiguous \
         (`set_data(&t.contiguous())`) before applying fully_shard"
    )]
    NonContiguous {
        /// The parameter.
        fqn: String,
    },
    /// A parameter is (the same tensor as) one another `fully_shard` call manages: applied
    /// to a parent before its child, or tied between two calls' modules.
    #[error(
        "fully_shard: parameter `{fqn}` is already managed by another fully_shard call (as \
         `{other}`): apply fully_shard bottom-up, children before their parents, and manage a \
         parameter tied between two modules by one call on a module that holds both"
    )]
    TiedParameter {
        /// The parameter, as this call sees it.
        fqn: String,
        /// Its FQN in the call that manages it.
        other: String,
    },
    /// `shard_placement_fn` chose a dimension the parameter does not have, or one other
    /// than 0 that the ranks do not divide evenly.
    #[error(
        "fully_shard: shard_placement_fn chose dim {dim} for parameter `{fqn}` of shape \
         {shape:?}, which {world} ranks cannot shard (a dim other than 0 must exist and divide \
         evenly)"
    )]
    ShardDim {
        /// The parameter.
        fqn: String,
        /// The dimension chosen.
        dim: usize,
        /// The parameter's shape.
        shape: Vec<i64>,
        /// The number of ranks.
        world: usize,
    },
    /// `shard_placement_fn` put a parameter on a mesh of its own but not the rest of the
    /// module that holds it.
    #[error(
        "fully_shard: shard_placement_fn puts `{fqn}` on a mesh of its own but not `{other}` \
         of the same module: a mesh of its own is for whole submodules (a MoE layer's \
         experts), each sharded by a fully_shard of its own"
    )]
    PartialOwnMesh {
        /// The parameter given a mesh of its own.
        fqn: String,
        /// A parameter of the same module left on another mesh.
        other: String,
    },
    /// `reshard_after_forward` names a number of ranks that does not divide the group.
    #[error(
        "fully_shard: reshard_after_forward = {ranks} ranks does not divide the group's \
         {world} ranks"
    )]
    ReshardRanks {
        /// The number given.
        ranks: usize,
        /// The group's size.
        world: usize,
    },
    /// `mesh` has another number of dims than 1 (FSDP) or 2 (HSDP), or both `mesh` and
    /// `process_group` were given, or a 2-D mesh does not span the default group.
    #[error("fully_shard: {0}")]
    Mesh(MeshUse),
    /// [`set_gradient_divide_factor`](super::FsdpState::set_gradient_divide_factor) got a
    /// factor that is not a finite number greater than 0 (the factor as written by `{:?}`:
    /// `NaN`, `inf`, `-2.0`).
    #[error(
        "fully_shard: set_gradient_divide_factor({factor}) on {}: the factor must be a \
         finite number greater than 0",
        Key(module)
    )]
    GradientDivideFactor {
        /// The managed module's FQN (within the outermost enclosing fully_shard call's
        /// module; `""` for that module itself).
        module: String,
        /// The factor given.
        factor: String,
    },
    /// An entry of `ignored_params` names no parameter of the module and no module prefix
    /// of one.
    #[error(
        "fully_shard: ignored_params names `{name}`, which is neither a parameter of the \
         module nor a module prefix of one"
    )]
    UnknownIgnoredParam {
        /// The entry.
        name: String,
    },
}

/// What is wrong with the `mesh` given to `fully_shard` ([`FsdpProblem::Mesh`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshUse {
    /// Neither 1-D nor 2-D.
    #[error(
        "the mesh has {ndim} dims; fully_shard takes a 1-D mesh (FSDP) or a 2-D one (HSDP: dim \
         0 replicates, dim 1 shards)"
    )]
    Dims {
        /// Its number of dims.
        ndim: usize,
    },
    /// Both `mesh` and `process_group`.
    #[error("both `mesh` and `process_group` were given; give one")]
    AndGroup,
    /// A 2-D mesh over fewer ranks than the default group.
    #[error("the 2-D mesh spans {numel} ranks and the default group {world}; it must span all")]
    NotWorld {
        /// The mesh's ranks.
        numel: usize,
        /// The default group's.
        world: usize,
    },
}
