//! [`FsdpError`]: why `fully_shard` refused, or why one of its hooks failed.

use tch_dist_core::hooks::HookError;
use tch_dist_core::ContractError;
use tch_dist_runtime::DistError;

use crate::error::HookedCall as Fix;
use crate::sharding::Key;

/// Errors of [`fully_shard`](super::fully_shard) and its state. A refusal at apply happens on
/// every rank together and leaves the model unchanged.
///
/// ```
/// use tch_dist::fully_shard::FsdpError;
/// let e = FsdpError::TiedParameter {
///     rank: 0,
///     fqn: "head.weight".into(),
///     other: "embed.weight".into(),
/// };
/// assert_eq!(
///     e.to_string(),
///     "rank 0: fully_shard: parameter `head.weight` is already managed by another \
///      fully_shard call (as `embed.weight`): apply fully_shard bottom-up, children before \
///      their parents, and manage a parameter tied between two modules by one call on a \
///      module that holds both"
/// );
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
    /// A parameter is not contiguous: its shard would not be a view of its flat shard.
    #[error(
        "rank {rank}: fully_shard: parameter `{fqn}` is not contiguous; make it contiguous \
         (`set_data(&t.contiguous())`) before applying fully_shard"
    )]
    NonContiguous {
        /// This rank.
        rank: usize,
        /// The parameter.
        fqn: String,
    },
    /// A parameter is (the same tensor as) one another `fully_shard` call manages: applied
    /// to a parent before its child, or tied between two calls' modules.
    #[error(
        "rank {rank}: fully_shard: parameter `{fqn}` is already managed by another \
         fully_shard call (as `{other}`): apply fully_shard bottom-up, children before \
         their parents, and manage a parameter tied between two modules by one call on a \
         module that holds both"
    )]
    TiedParameter {
        /// This rank.
        rank: usize,
        /// The parameter, as this call sees it.
        fqn: String,
        /// Its FQN in the call that manages it.
        other: String,
    },
    /// `shard_placement_fn` chose a dimension the parameter does not have, or one other
    /// than 0 that the ranks do not divide evenly.
    #[error(
        "rank {rank}: fully_shard: shard_placement_fn chose dim {dim} for parameter `{fqn}` \
         of shape {shape:?}, which {world} ranks cannot shard (a dim other than 0 must exist \
         and divide evenly)"
    )]
    ShardDim {
        /// This rank.
        rank: usize,
        /// The parameter.
        fqn: String,
        /// The dimension chosen.
        dim: usize,
        /// The parameter's shape.
        shape: Vec<i64>,
        /// The number of ranks.
        world: usize,
    },
    /// `reshard_after_forward` names a number of ranks that does not divide the group.
    #[error(
        "rank {rank}: fully_shard: reshard_after_forward = {ranks} ranks does not divide the \
         group's {world} ranks"
    )]
    ReshardRanks {
        /// This rank.
        rank: usize,
        /// The number given.
        ranks: usize,
        /// The group's size.
        world: usize,
    },
    /// `mesh` has another number of dims than 1 (FSDP) or 2 (HSDP), or both `mesh` and
    /// `process_group` were given, or a 2-D mesh does not span the default group.
    #[error("rank {rank}: fully_shard: {problem}")]
    Mesh {
        /// This rank.
        rank: usize,
        /// What is wrong with it.
        problem: MeshUse,
    },
    /// A parameter `shard_module` sharded over ranks that overlap the ones fully_shard
    /// averages over in more than this rank, without being the same ranks: neither layout
    /// (tensor parallelism beside fully_shard on one group, or FSDP x TP on the two dims of
    /// a mesh) holds.
    #[error(
        "rank {rank}: fully_shard: parameter `{fqn}` is tensor-parallel over ranks \
         {tp_ranks:?} and fully_shard averages over ranks {ranks:?}: give fully_shard the \
         same ranks, or the other dim of the mesh (FSDP x TP: `mesh.dim(\"dp\")` beside \
         `mesh.dim(\"tp\")`)"
    )]
    TensorParallelRanks {
        /// This rank.
        rank: usize,
        /// The parameter.
        fqn: String,
        /// The tensor-parallel group's global ranks.
        tp_ranks: Vec<usize>,
        /// fully_shard's.
        ranks: Vec<usize>,
    },
    /// fully_shard was given the ranks a parameter is tensor-parallel over, and they are not
    /// the whole world: the ranks outside (the mesh's other dim, which sees other data)
    /// would never average with these.
    #[error(
        "rank {rank}: fully_shard: parameter `{fqn}` is tensor-parallel over ranks {ranks:?}, \
         the ranks fully_shard was given: give fully_shard the data-parallel dim of the mesh \
         (`mesh.dim(\"dp\")`), not the tensor-parallel one"
    )]
    TensorParallelDim {
        /// This rank.
        rank: usize,
        /// The parameter.
        fqn: String,
        /// The global ranks of both groups.
        ranks: Vec<usize>,
    },
    /// A submodule is managed by `replicate`, which cannot run inside `fully_shard`.
    #[error(
        "rank {rank}: fully_shard: submodule `{module}` is managed by replicate; apply \
         replicate only to modules outside every fully_shard module"
    )]
    ReplicatedInside {
        /// This rank.
        rank: usize,
        /// The submodule's FQN.
        module: String,
    },
    /// An entry of `ignored_params` names no parameter of the module and no module prefix
    /// of one.
    #[error(
        "rank {rank}: fully_shard: ignored_params names `{name}`, which is neither a \
         parameter of the module nor a module prefix of one"
    )]
    UnknownIgnoredParam {
        /// This rank.
        rank: usize,
        /// The entry.
        name: String,
    },
    /// A managed module ran without its hooks (`x.apply(&layer)`, `layer.forward(&x)`)
    /// inside a hooked call, where its parameters hold only this rank's shards: refused at
    /// the first op that used one (in every grad mode; `f_call` returns this error, `call`
    /// panics with its message), or found in the autograd graph (the forward's check, the
    /// backward pass's).
    #[error(
        "rank {rank}: fully_shard: parameter `{param}` of {} was used outside a call of the \
         module through its hooks, where it holds only this rank's shard; {}",
        Key(module),
        Fix(module)
    )]
    HooksBypassed {
        /// This rank.
        rank: usize,
        /// The bypassed module's FQN (within the outermost enclosing fully_shard call's
        /// module; `""` for that module itself).
        module: String,
        /// The parameter's FQN (same base).
        param: String,
    },
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

impl From<crate::state_dict::StateDictError> for FsdpError {
    fn from(e: crate::state_dict::StateDictError) -> Self {
        FsdpError::StateDict(Box::new(e))
    }
}

/// What is wrong with the `mesh` given to `fully_shard` ([`FsdpError::Mesh`]).
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
