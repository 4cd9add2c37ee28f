//! `replicate`: data-parallel training (PyTorch's composable `replicate`, i.e. DDP).
//!
//! Applied to a module, it checks that every rank holds the same parameters, broadcasts
//! rank 0's parameters and buffers, and installs a [`Reducer`] whose gradient hooks average
//! gradients across ranks in buckets while backward is still running. The training loop
//! stays an ordinary tch loop; forward goes through [`Call::call`](crate::Call) so that
//! replicate's forward hooks run.
//!
//! ```no_run
//! use tch::nn::{self, Module, OptimizerConfig};
//! use tch_dist::{replicate, Call, Shardable};
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
//! let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
//! let (x, y) = (tch::Tensor::randn([16, 4], tch::kind::FLOAT_CPU), tch::Tensor::zeros([16], tch::kind::INT64_CPU));
//! opt.backward_step(&model.call(&x).cross_entropy_for_logits(&y));
//! # Ok(()) }
//! ```

use tch::{Device, Tensor};
use tch_dist_core::hooks::{
    register_fallible_forward_pre_hook, ForwardError, HookError, RemovableHandle,
};
use tch_dist_core::{contract, registry, ContractError, ModuleKey, ModuleVisitor, Shardable};
use tch_dist_runtime::{
    default_group, CommHook, DistError, ProcessGroup, Reducer, ReducerOptions, ReducerStats,
    BROADCAST_BUCKET_BYTES,
};

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
}

/// `device_id` accepts an index or a device, as PyTorch's replicate does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceId {
    /// A CUDA device index.
    Index(usize),
    /// A device; `Device::Cpu` means "no device ids" (CPU training).
    Device(Device),
}

impl From<usize> for DeviceId {
    fn from(i: usize) -> Self {
        DeviceId::Index(i)
    }
}

impl From<Device> for DeviceId {
    fn from(d: Device) -> Self {
        DeviceId::Device(d)
    }
}

impl DeviceId {
    fn device(self) -> Device {
        match self {
            DeviceId::Index(i) => Device::Cuda(i),
            DeviceId::Device(d) => d,
        }
    }
}

/// replicate's options, with PyTorch DDP's names and defaults.
#[derive(Clone)]
pub struct Options {
    /// Bucket size in MiB (default 25; the first bucket is 1 MiB).
    pub bucket_cap_mb: f64,
    /// Modules whose parameters replicate leaves alone (and their children).
    pub ignored_modules: Vec<ModuleKey>,
    /// The device of the module (CUDA index or device; CPU means none): inputs are moved
    /// there and every parameter must be there. Default: for a module on CUDA, the group's
    /// bound device ([`ProcessGroup::bound_device`]: LOCAL_RANK, or `init_process_group`'s
    /// device_id); none for a CPU module.
    pub device_id: Option<DeviceId>,
    /// Broadcast rank 0's buffers before each forward (default true).
    pub broadcast_buffers: bool,
    /// Parameters without a gradient count as zero instead of failing the next iteration.
    pub find_unused_parameters: bool,
    /// The autograd graph is the same in every iteration: the first iteration finds the
    /// unused parameters (as `find_unused_parameters`); later ones count them as zero when
    /// backward starts (their buckets need not wait for the end of backward) without the
    /// extra all-reduce, and a backward whose parameters' use changed fails with PyTorch's
    /// "the training graph changed" error naming the parameter.
    pub static_graph: bool,
    /// `.grad` tensors are views into the communication buckets (saves memory and a copy).
    pub gradient_as_bucket_view: bool,
    /// How buckets are communicated (default: all-reduce mean; `CommHook::Fp16Compress`,
    /// `CommHook::Bf16Compress` and `CommHook::PowerSgd(PowerSgdOptions { .. })` as PyTorch's
    /// `register_comm_hook` with its default hooks).
    pub comm_hook: CommHook,
    /// With the default hook, a gradient of at least this many bytes is all-reduced on its
    /// own, in place in `.grad`, instead of being copied into its bucket and back (default
    /// [`DEFAULT_IN_PLACE_MIN_BYTES`](crate::DEFAULT_IN_PLACE_MIN_BYTES); `usize::MAX` copies
    /// every gradient, as PyTorch does). A tch-dist tuning knob, not a DDP option.
    pub in_place_min_bytes: usize,
    /// The group to average over (default: the default process group).
    pub process_group: Option<ProcessGroup>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            ignored_modules: Vec::new(),
            device_id: None,
            broadcast_buffers: true,
            find_unused_parameters: false,
            static_graph: false,
            gradient_as_bucket_view: false,
            comm_hook: CommHook::AllReduceMean,
            in_place_min_bytes: tch_dist_runtime::DEFAULT_IN_PLACE_MIN_BYTES,
            process_group: None,
        }
    }
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("bucket_cap_mb", &self.bucket_cap_mb)
            .field("ignored_modules", &self.ignored_modules)
            .field("device_id", &self.device_id)
            .field("broadcast_buffers", &self.broadcast_buffers)
            .field("find_unused_parameters", &self.find_unused_parameters)
            .field("static_graph", &self.static_graph)
            .field("gradient_as_bucket_view", &self.gradient_as_bucket_view)
            .field("comm_hook", &self.comm_hook)
            .field("in_place_min_bytes", &self.in_place_min_bytes)
            .finish()
    }
}

impl Options {
    /// Adds `module` to `ignored_modules`.
    pub fn ignore<M: Shardable + ?Sized>(mut self, module: &M) -> Result<Self, ReplicateError> {
        let key = ModuleKey::of(module).ok_or(ReplicateError::CannotIgnore {
            module: module.type_name(),
        })?;
        self.ignored_modules.push(key);
        Ok(self)
    }
}

/// What replicate keeps per module: see [`state`].
pub struct ReplicateState {
    reducer: Reducer,
    param_fqns: Vec<String>,
    /// Handles on the managed buffers (behind a mutex: tch tensors are Send, not Sync).
    buffers: std::sync::Mutex<Vec<Tensor>>,
    pre_hook: RemovableHandle,
}

impl std::fmt::Debug for ReplicateState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicateState")
            .field("param_fqns", &self.param_fqns)
            .finish()
    }
}

impl ReplicateState {
    /// FQNs of the parameters whose gradients replicate averages, in registration order.
    pub fn param_fqns(&self) -> &[String] {
        &self.param_fqns
    }

    /// The bucket layout: FQNs per bucket, in launch order.
    pub fn buckets(&self) -> Vec<Vec<String>> {
        self.reducer.bucket_fqns()
    }

    /// Figures of the last synchronised step (buckets, bytes, communication and overlap).
    pub fn stats(&self) -> ReducerStats {
        self.reducer.stats()
    }

    /// The group gradients are averaged over.
    pub fn group(&self) -> &ProcessGroup {
        self.reducer.group()
    }

    /// Removes replicate's forward hook (gradient hooks go when the state is dropped).
    pub fn remove_forward_hook(&self) -> bool {
        self.pre_hook.remove()
    }
}

/// Collects the parameters replicate manages: requires-grad parameters outside ignored
/// modules, outside submodules managed by `fully_shard`, and not sharded by `shard_module`.
struct ParamCollector<'a> {
    ignored: &'a [ModuleKey],
    /// FQNs of parameters held as shards by `shard_module` (they are not replicated).
    sharded: std::collections::HashSet<String>,
    path: Vec<String>,
    /// Depth at which a skipped subtree started.
    skip_from: Option<usize>,
    params: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
}

impl<'a> ParamCollector<'a> {
    fn fqn(&self, leaf: &str) -> String {
        let mut parts: Vec<&str> = self.path.iter().map(String::as_str).collect();
        parts.push(leaf);
        parts.retain(|p| !p.is_empty());
        parts.join(".")
    }
}

impl<'m> ModuleVisitor<'m> for ParamCollector<'_> {
    fn enter_module(&mut self, name: &str, module: &'m dyn Shardable) {
        self.path.push(name.to_string());
        if self.skip_from.is_none() {
            let ignored = ModuleKey::of(module).is_some_and(|k| self.ignored.contains(&k));
            if ignored || registry(module).contains(&"fully_shard") {
                self.skip_from = Some(self.path.len());
            }
        }
    }

    fn exit_module(&mut self, _name: &str) {
        if self.skip_from == Some(self.path.len()) {
            self.skip_from = None;
        }
        self.path.pop();
    }

    fn visit_param(&mut self, name: &str, tensor: &'m Tensor) {
        let fqn = self.fqn(name);
        if self.skip_from.is_none() && tensor.requires_grad() && !self.sharded.contains(&fqn) {
            self.params.push((fqn, tensor.shallow_clone()));
        }
    }

    fn visit_buffer(&mut self, name: &str, tensor: &'m Tensor) {
        if self.skip_from.is_none() {
            self.buffers.push((self.fqn(name), tensor.shallow_clone()));
        }
    }
}

/// The parameters `shard_module` sharded anywhere in `module`, by FQN.
fn sharded_params<M: Shardable + ?Sized>(module: &M) -> std::collections::HashSet<String> {
    let mut out = std::collections::HashSet::new();
    for (prefix, m) in module.named_modules() {
        if let Some(state) = crate::sharding::shard_module_state(m) {
            for fqn in state.sharded_params() {
                out.insert(tch_dist_core::path::join_fqn(&prefix, fqn));
            }
        }
    }
    out
}

/// `device_id`'s default: a module on CUDA uses its group's bound device (the device
/// `init_process_group` bound from LOCAL_RANK or its `device_id`), as PyTorch users pass
/// `device_ids=[local_rank]`; a CPU module (or a group without a device) has none.
fn default_device(group: &ProcessGroup, params: &[(String, Tensor)]) -> Option<Device> {
    group
        .bound_device()
        .filter(|_| params.iter().any(|(_, t)| t.device().is_cuda()))
}

/// Applies replicate to `module`: checks and synchronises parameters across ranks and
/// installs the gradient reducer and forward hook. See the module docs for an example.
#[contract(crate = "crate", conflicts(fully_shard))]
pub fn apply<M: Shardable + ?Sized>(
    module: &M,
    opts: Options,
) -> Result<ReplicateState, ReplicateError> {
    let group = match &opts.process_group {
        Some(g) => g.clone(),
        None => default_group()?,
    };
    // Every option is checked before anything is sent or changed.
    let reducer_opts = ReducerOptions {
        bucket_cap_mb: opts.bucket_cap_mb,
        find_unused_parameters: opts.find_unused_parameters,
        gradient_as_bucket_view: opts.gradient_as_bucket_view,
        static_graph: opts.static_graph,
        comm_hook: opts.comm_hook,
        in_place_min_bytes: opts.in_place_min_bytes,
        ..ReducerOptions::default()
    };

    // The root itself may be ignored (then nothing is managed), like PyTorch.
    let root_ignored = ModuleKey::of(module).is_some_and(|k| opts.ignored_modules.contains(&k));
    let mut c = ParamCollector {
        ignored: &opts.ignored_modules,
        sharded: sharded_params(module),
        path: Vec::new(),
        skip_from: root_ignored.then_some(0),
        params: Vec::new(),
        buffers: Vec::new(),
    };
    module.visit(&mut c);
    let (params, buffers) = (c.params, c.buffers);
    let device = opts
        .device_id
        .map(DeviceId::device)
        .or_else(|| default_device(&group, &params));
    // Checks each rank makes on its own, shared so that every rank fails together before
    // anything is sent or changed.
    let rank = group.rank();
    let misplaced = device
        .filter(|d| d.is_cuda())
        .and_then(|d| params.iter().find(|(_, t)| t.device() != d).map(|p| (d, p)));
    let local = match (reducer_opts.validate(), misplaced) {
        (Err(problem), _) => Err(ReplicateError::from(DistError::InvalidArgument {
            rank,
            op: "replicate",
            problem: Box::new(problem),
        })),
        (Ok(()), Some((device_id, (fqn, t)))) => Err(ReplicateError::DeviceMismatch {
            rank,
            device_id,
            fqn: fqn.clone(),
            device: t.device(),
        }),
        (Ok(()), None) if params.is_empty() => Err(ReplicateError::NothingToReplicate { rank }),
        (Ok(()), None) => Ok(()),
    };
    group.agree("replicate", local)?;
    // The same options on every rank, or ranks would bucket, wait and reduce differently
    // (mismatched collectives abort Gloo or hang until the timeout).
    let options = [
        ("bucket_cap_mb", opts.bucket_cap_mb.to_string()),
        (
            "find_unused_parameters",
            opts.find_unused_parameters.to_string(),
        ),
        ("static_graph", opts.static_graph.to_string()),
        (
            "gradient_as_bucket_view",
            opts.gradient_as_bucket_view.to_string(),
        ),
        ("broadcast_buffers", opts.broadcast_buffers.to_string()),
        ("comm_hook", format!("{:?}", opts.comm_hook)),
        ("in_place_min_bytes", opts.in_place_min_bytes.to_string()),
    ];
    let options: Vec<(String, String)> = options
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect();
    group.verify_same_options("replicate", &options)?;
    let named: Vec<(&str, &Tensor)> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    group.verify_same_tensors("replicate", "parameters", 0, &named)?;
    let states: Vec<&Tensor> = params
        .iter()
        .chain(buffers.iter())
        .map(|(_, t)| t)
        .collect();
    group.broadcast_coalesced(&states, 0, BROADCAST_BUCKET_BYTES)?;

    let param_fqns: Vec<String> = params.iter().map(|(n, _)| n.clone()).collect();
    let reducer = Reducer::new(params, group.clone(), reducer_opts)?;
    let buffer_handles: Vec<Tensor> = buffers.iter().map(|(_, t)| t.shallow_clone()).collect();
    let broadcast_buffers =
        opts.broadcast_buffers && !group.skips_communication() && !buffers.is_empty();
    let input_device = device.filter(|d| d.is_cuda());
    let pre_hook = register_fallible_forward_pre_hook(module, move |m, xs| {
        // PyTorch raises from forward here: `f_call` returns the error, `call` panics with it
        // (`replicate::prepare_forward` checks the same ahead of the call).
        if let Some(s) = state(m) {
            s.reducer
                .prepare_for_forward()
                .map_err(ForwardError::from_error)?;
            if broadcast_buffers {
                let buffers = s.buffers.lock().unwrap_or_else(|e| e.into_inner());
                let buffers: Vec<&Tensor> = buffers.iter().collect();
                s.reducer
                    .group()
                    .broadcast_coalesced(&buffers, 0, BROADCAST_BUCKET_BYTES)
                    .map_err(ForwardError::from_error)?;
            }
        }
        Ok(input_device
            .filter(|d| xs.device() != *d)
            .map(|d| xs.to_device(d)))
    })?;
    Ok(ReplicateState {
        reducer,
        param_fqns,
        buffers: std::sync::Mutex::new(buffer_handles),
        pre_hook,
    })
}

/// The checks replicate's forward hook makes, as a value: fails with PyTorch's
/// "Expected to have finished reduction in the prior iteration..." error when the last
/// backward left parameters without gradients (and `find_unused_parameters` is off).
pub fn prepare_forward<M: Shardable + ?Sized>(module: &M) -> Result<(), ReplicateError> {
    let s = state(module).ok_or(ReplicateError::NotReplicated)?;
    s.reducer.prepare_for_forward()?;
    Ok(())
}

/// Runs `f` without gradient synchronisation (gradient accumulation, PyTorch's `no_sync`):
/// gradients accumulate locally and the next synchronised backward averages the sum.
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
    struct Restore<'a>(&'a Reducer, bool);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            self.0.set_require_sync(self.1);
        }
    }
    let _restore = Restore(&s.reducer, s.reducer.require_sync());
    s.reducer.set_require_sync(false);
    Ok(f())
}
