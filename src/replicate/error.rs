//! [`ReplicateError`]: why replicate (either form) or its forward-side checks failed.

use tch::Device;
use tch_dist_core::hooks::HookError;
use tch_dist_core::ContractError;
use tch_dist_runtime::DistError;

/// Errors of `replicate`.
///
/// ```
/// use tch_dist::replicate::ReplicateError;
/// let e = ReplicateError::DeviceMismatch {
///     rank: 1,
///     device_id: tch::Device::Cuda(1),
///     fqn: "fc.weight".into(),
///     device: tch::Device::Cpu,
/// };
/// assert_eq!(
///     e.to_string(),
///     "rank 1: replicate: device_id is Cuda(1) but parameter `fc.weight` is on Cpu; move the module first"
/// );
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
    /// A parameter `shard_module` sharded over other ranks than replicate's group: left
    /// out of replicate's buckets (tensor-parallel parameters are), its gradient would not
    /// be averaged over them.
    #[error(
        "rank {rank}: replicate: parameter `{fqn}` is tensor-parallel over ranks \
         {tp_ranks:?} and replicate averages over ranks {ranks:?}: left out of its buckets, \
         its gradient would not be averaged; use the same ranks for both"
    )]
    TensorParallelRanks {
        /// This rank.
        rank: usize,
        /// The parameter.
        fqn: String,
        /// The tensor-parallel group's global ranks.
        tp_ranks: Vec<usize>,
        /// replicate's.
        ranks: Vec<usize>,
    },
    /// `device_mesh` is not 1-D, or was given with `process_group`.
    #[error(
        "rank {rank}: replicate: {}",
        if *with_group {
            "both `device_mesh` and `process_group` were given; give one".to_string()
        } else {
            format!(
                "the device_mesh has {ndim} dims; replicate averages over a 1-D mesh (one dim \
                 of it: `mesh.dim(\"dp\")`)"
            )
        }
    )]
    Mesh {
        /// This rank.
        rank: usize,
        /// The mesh's dims.
        ndim: usize,
        /// Whether `process_group` was given too.
        with_group: bool,
    },
    /// `Options::ignore` got a module without parameters or buffers, which cannot be
    /// identified.
    #[error("replicate: cannot ignore a `{module}`: it has no parameters or buffers")]
    CannotIgnore {
        /// The module's type name.
        module: &'static str,
    },
    /// `device_id` names a CUDA device the module is not on.
    #[error(
        "rank {rank}: replicate: device_id is {device_id:?} but parameter `{fqn}` is on \
         {device:?}; move the module first"
    )]
    DeviceMismatch {
        /// This rank.
        rank: usize,
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
        "rank {rank}: replicate: the module has no parameter that requires a gradient (all are \
         frozen, ignored or sharded), so there is nothing to replicate"
    )]
    NothingToReplicate {
        /// This rank.
        rank: usize,
    },
    /// The module was not passed to `replicate::apply`.
    #[error("replicate: this module is not managed by replicate (call replicate::apply first)")]
    NotReplicated,
    /// An entry of `Options::ignored_params` names no parameter or buffer of the module,
    /// and no module holding one.
    #[error(
        "rank {rank}: replicate: ignored_params names `{name}`, which is neither a parameter \
         or buffer of the module nor a module prefix of one"
    )]
    UnknownIgnoredParam {
        /// This rank.
        rank: usize,
        /// The entry.
        name: String,
    },
    /// [`wrap`](crate::replicate::wrap)/[`wrap_t`](crate::replicate::wrap_t) got `Options::ignored_modules`: a wrapped module is not walked,
    /// so its submodules cannot be found; `Options::ignored_params` names what to ignore.
    #[error(
        "rank {rank}: replicate: ignored_modules ({modules:?}) cannot be used with \
         replicate::wrap, which does not walk the module; name their variables in \
         ignored_params instead"
    )]
    IgnoredModulesInWrap {
        /// This rank.
        rank: usize,
        /// The type names of the modules in `ignored_modules`.
        modules: Vec<&'static str>,
    },
    /// A parameter is already managed by another replicate (the derive form on the model
    /// and the wrapper on its store, or two wrappers over one store): two reducers would
    /// all-reduce the same gradients at once.
    #[error(
        "rank {rank}: replicate: parameter `{fqn}` is already managed by replicate (apply or \
         wrap of the same variables); replicate a model once"
    )]
    AlreadyReplicated {
        /// This rank.
        rank: usize,
        /// The first such parameter.
        fqn: String,
    },
}
