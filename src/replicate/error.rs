//! [`ReplicateError`]: why replicate (either form) or its forward-side checks failed.

use tch::Device;
use tch_dist_core::hooks::HookError;
use tch_dist_core::ContractError;
use tch_dist_runtime::DistError;

use crate::{Composition, OnRank};

/// Errors of `replicate`. This rank's refusal is [`OnRank`](Self::OnRank) of a
/// [`ReplicateProblem`], or [`Composition`](Self::Composition) of a rule of composing the
/// APIs, its rank written once; another layer's error names its own.
///
/// ```
/// use tch_dist::replicate::{ReplicateError, ReplicateProblem};
/// let e = ReplicateProblem::DeviceMismatch {
///     device_id: tch::Device::Cuda(1),
///     fqn: "fc.weight".into(),
///     device: tch::Device::Cpu,
/// }
/// .on(1);
/// assert_eq!(
///     e.to_string(),
///     "rank 1: replicate: device_id is Cuda(1) but parameter `fc.weight` is on Cpu; move the module first"
/// );
/// assert_eq!(e.rank(), Some(1));
/// assert!(matches!(e.problem(), Some(ReplicateProblem::DeviceMismatch { .. })));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplicateError {
    /// Applied twice, or together with a conflicting API, or the module's names changed.
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// The engine failed or refused (rendezvous, a collective, a timeout, a bad option,
    /// parameters that differ across ranks, an unfinished or changed backward pass).
    #[error(transparent)]
    Dist(#[from] DistError),
    /// replicate's forward hook could not be registered.
    #[error(transparent)]
    Hook(#[from] HookError),
    /// This rank refused: its rank and the problem.
    #[error(transparent)]
    OnRank(#[from] OnRank<ReplicateProblem>),
    /// A rule of composing replicate with the other APIs, broken on this rank
    /// ([`Api::Replicate`](crate::Api::Replicate)'s [`Composition`]): a parameter
    /// `shard_module` sharded over other ranks than replicate's group
    /// ([`Composition::TensorParallelRanks`]): left out of replicate's buckets
    /// (tensor-parallel parameters are), its gradient would not be averaged over them.
    #[error(transparent)]
    Composition(#[from] OnRank<Composition>),
    /// `Options::ignore` got a module without parameters or buffers, which cannot be
    /// identified.
    #[error("replicate: cannot ignore a `{module}`: it has no parameters or buffers")]
    CannotIgnore {
        /// The module's type name.
        module: &'static str,
    },
    /// The module was not passed to `replicate::apply`.
    #[error("replicate: this module is not managed by replicate (call replicate::apply first)")]
    NotReplicated,
}

impl ReplicateError {
    /// The rank the error names (this rank's, or the collective's); `None` where it names
    /// none ([`CannotIgnore`](Self::CannotIgnore), [`NotReplicated`](Self::NotReplicated),
    /// a contract's or a hook's error).
    pub fn rank(&self) -> Option<usize> {
        match self {
            ReplicateError::OnRank(e) => Some(e.rank),
            ReplicateError::Composition(e) => Some(e.rank),
            ReplicateError::Dist(e) => e.rank(),
            ReplicateError::Contract(_)
            | ReplicateError::Hook(_)
            | ReplicateError::CannotIgnore { .. }
            | ReplicateError::NotReplicated => None,
        }
    }

    /// This rank's problem (`None` for another layer's error, a [`Composition`] or a
    /// rankless variant).
    pub fn problem(&self) -> Option<&ReplicateProblem> {
        match self {
            ReplicateError::OnRank(e) => Some(&e.problem),
            _ => None,
        }
    }

    /// The rule of composing the APIs this rank broke (`None` for any other error).
    ///
    /// ```
    /// use tch_dist::replicate::ReplicateError;
    /// use tch_dist::{Api, Composition, OnRank};
    /// let e = ReplicateError::from(OnRank::new(
    ///     0,
    ///     Composition::TensorParallelRanks {
    ///         api: Api::Replicate,
    ///         fqn: "fc.weight".into(),
    ///         tp_ranks: vec![0, 1],
    ///         ranks: vec![0, 1, 2, 3],
    ///     },
    /// ));
    /// assert!(e.to_string().starts_with("rank 0: replicate: parameter `fc.weight` is tensor-parallel"));
    /// assert!(matches!(e.composition(), Some(Composition::TensorParallelRanks { .. })));
    /// ```
    pub fn composition(&self) -> Option<&Composition> {
        match self {
            ReplicateError::Composition(e) => Some(&e.problem),
            _ => None,
        }
    }
}

impl ReplicateProblem {
    /// This problem as rank `rank`'s [`ReplicateError`].
    pub fn on(self, rank: usize) -> ReplicateError {
        ReplicateError::OnRank(OnRank::new(rank, self))
    }
}

/// Why `replicate` refused on a rank ([`ReplicateError::OnRank`] adds the rank).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplicateProblem {
    /// `device_mesh` is not 1-D.
    #[error(
        "replicate: the device_mesh has {ndim} dims; replicate averages over a 1-D mesh (one \
         dim of it: `mesh.dim(\"dp\")`)"
    )]
    MeshDims {
        /// The mesh's dims.
        ndim: usize,
    },
    /// Both `device_mesh` and `process_group` were given.
    #[error("replicate: both `device_mesh` and `process_group` were given; give one")]
    MeshAndGroup,
    /// `device_id` names a CUDA device the module is not on.
    #[error(
        "replicate: device_id is {device_id:?} but parameter `{fqn}` is on {device:?}; move \
         the module first"
    )]
    DeviceMismatch {
        /// The option's device.
        device_id: Device,
        /// The first parameter elsewhere.
        fqn: String,
        /// Its device.
        device: Device,
    },
    /// No parameter requires a gradient once ignored and sharded ones are left out (PyTorch:
    /// "DistributedDataParallel is not needed when a module doesn't have any parameter that
    /// requires a gradient").
    #[error(
        "replicate: the module has no parameter that requires a gradient (all are frozen, \
         ignored or sharded), so there is nothing to replicate"
    )]
    NothingToReplicate,
    /// An entry of `Options::ignored_params` names no parameter or buffer of the module,
    /// and no module holding one.
    #[error(
        "replicate: ignored_params names `{name}`, which is neither a parameter or buffer of \
         the module nor a module prefix of one"
    )]
    UnknownIgnoredParam {
        /// The entry.
        name: String,
    },
    /// [`wrap`](crate::replicate::wrap)/[`wrap_t`](crate::replicate::wrap_t) got
    /// `Options::ignored_modules`: a wrapped module is not walked, so its submodules cannot
    /// be found; `Options::ignored_params` names what to ignore.
    #[error(
        "replicate: ignored_modules ({modules:?}) cannot be used with replicate::wrap, which \
         does not walk the module; name their variables in ignored_params instead"
    )]
    IgnoredModulesInWrap {
        /// The type names of the modules in `ignored_modules`.
        modules: Vec<&'static str>,
    },
    /// A parameter is already managed by another replicate (the derive form on the model
    /// and the wrapper on its store, or two wrappers over one store): two reducers would
    /// all-reduce the same gradients at once.
    #[error(
        "replicate: parameter `{fqn}` is already managed by replicate (apply or wrap of the \
         same variables); replicate a model once"
    )]
    AlreadyReplicated {
        /// The first such parameter.
        fqn: String,
    },
}
