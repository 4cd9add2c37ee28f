//! `replicate`: data-parallel training (PyTorch's composable `replicate`, i.e. DDP).
//!
//! Applied to a module, it checks that every rank holds the same parameters, broadcasts
//! rank 0's parameters and buffers, and installs a [`Reducer`] whose gradient hooks average
//! gradients across ranks in buckets while backward is still running. The training loop
//! stays an ordinary tch loop.
//!
//! Two forms, one implementation (the same checks, broadcast, reducer and options):
//!
//! - [`apply`], the composable form (PyTorch's `replicate(module)`), for a
//!   `#[derive(Shardable)]` model: forward goes through [`Call::call`](crate::Call) so that
//!   replicate's forward hook runs; [`state`], [`no_sync`] and [`prepare_forward`] take the
//!   model;
//! - [`wrap`] / [`wrap_t`], the wrapper form (PyTorch's `DistributedDataParallel(module)`),
//!   for any `impl Module` / `impl ModuleT` (`nn::seq()`, `nn::func`) with the `VarStore`
//!   that owns its variables: the returned [`Replicated`] / [`ReplicatedT`] owns the model
//!   and its `forward` does the hook's work; `state`, `no_sync` and `prepare_forward` are
//!   its methods.
//!
//! ```no_run
//! use tch::nn::{self, Module};
//! use tch_dist::{optim, replicate, Call, Shardable};
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
//! let mut opt = optim::Sgd::default().build(&vs, 0.1)?;
//! let (x, y) = (tch::Tensor::randn([16, 4], tch::kind::FLOAT_CPU), tch::Tensor::zeros([16], tch::kind::INT64_CPU));
//! opt.backward_step(&model.f_call(&x)?.cross_entropy_for_logits(&y))?;
//! # Ok(()) }
//! ```

use tch::{Device, Tensor};
use tch_dist_core::hooks::{
    register_fallible_forward_pre_hook_n, ForwardError, HookError, RemovableHandle,
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
    /// [`wrap`]/[`wrap_t`] got `Options::ignored_modules`: a wrapped module is not walked,
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

/// The data pointers of the parameters every live [`ReplicateState`] manages, across both
/// forms: a parameter can be managed once. A state's reducer holds its parameters, so their
/// memory (and pointer) cannot be reused while the entry exists; `Drop` removes it.
static MANAGED: std::sync::LazyLock<std::sync::Mutex<std::collections::HashSet<usize>>> =
    std::sync::LazyLock::new(Default::default);

fn managed() -> std::sync::MutexGuard<'static, std::collections::HashSet<usize>> {
    MANAGED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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
    /// Modules whose parameters replicate leaves alone (and their children). Only for
    /// [`apply`]: a wrapped module is not walked ([`wrap`] refuses it); use `ignored_params`.
    pub ignored_modules: Vec<ModuleKey>,
    /// Parameters and buffers replicate leaves alone, by FQN (`"head.weight"`), or by the
    /// FQN of a module holding them (`"head"`: every `head.*`); PyTorch's
    /// `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`. An entry that
    /// matches nothing is an error. Both forms ([`apply`], [`wrap`]).
    pub ignored_params: Vec<String>,
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
            ignored_params: Vec::new(),
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
            .field("ignored_params", &self.ignored_params)
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

/// What replicate keeps per model: see [`state`] (the derive form) and
/// [`Replicated::state`] (the wrapper form).
pub struct ReplicateState {
    reducer: Reducer,
    param_fqns: Vec<String>,
    buffer_fqns: Vec<String>,
    /// Handles on the managed buffers (behind a mutex: tch tensors are Send, not Sync).
    buffers: std::sync::Mutex<Vec<Tensor>>,
    /// Whether each forward broadcasts rank 0's buffers first.
    broadcast_buffers: bool,
    /// Where inputs are moved before the forward (a CUDA `device_id`).
    input_device: Option<Device>,
    /// The derive form's forward pre-hook; `None` for a wrapper, whose `forward` does its
    /// work.
    pre_hook: Option<RemovableHandle>,
    /// This state's entries in [`MANAGED`].
    managed: Vec<usize>,
}

impl Drop for ReplicateState {
    fn drop(&mut self) {
        let mut m = managed();
        for p in &self.managed {
            m.remove(p);
        }
    }
}

impl std::fmt::Debug for ReplicateState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicateState")
            .field("param_fqns", &self.param_fqns)
            .field("buffer_fqns", &self.buffer_fqns)
            .finish()
    }
}

impl ReplicateState {
    /// FQNs of the parameters whose gradients replicate averages, in registration order
    /// (walk order for [`apply`]; for [`wrap`], the `VarStore`'s creation order with each
    /// layer's `weight` before its `bias`, the same order for the same model).
    ///
    /// ```no_run
    /// # use tch::nn;
    /// # use tch_dist::replicate;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let net = nn::seq().add(nn::linear(vs.root() / "fc", 4, 2, Default::default()));
    /// let model = replicate::wrap(net, &vs, replicate::Options::default())?;
    /// assert_eq!(model.state().param_fqns(), ["fc.weight", "fc.bias"]);
    /// # Ok(()) }
    /// ```
    pub fn param_fqns(&self) -> &[String] {
        &self.param_fqns
    }

    /// FQNs of the buffers replicate broadcasts from rank 0 (at start-up, and before each
    /// forward with `broadcast_buffers`), in walk order for [`apply`], sorted for [`wrap`].
    ///
    /// ```no_run
    /// # use tch::nn;
    /// # use tch_dist::replicate;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let net = nn::seq_t().add(nn::batch_norm1d(vs.root() / "bn", 4, Default::default()));
    /// let model = replicate::wrap_t(net, &vs, replicate::Options::default())?;
    /// assert_eq!(model.state().buffer_fqns(), ["bn.running_mean", "bn.running_var"]);
    /// # Ok(()) }
    /// ```
    pub fn buffer_fqns(&self) -> &[String] {
        &self.buffer_fqns
    }

    /// The bucket layout: FQNs per bucket, in launch order.
    ///
    /// ```no_run
    /// # use tch_dist::{replicate, Shardable};
    /// # fn demo<M: Shardable>(model: &M) {
    /// for bucket in replicate::state(model).unwrap().buckets() {
    ///     println!("{}", bucket.join(", "));
    /// }
    /// # }
    /// ```
    pub fn buckets(&self) -> Vec<Vec<String>> {
        self.reducer.bucket_fqns()
    }

    /// Figures of the last synchronised step (buckets, bytes, communication and overlap).
    ///
    /// ```no_run
    /// # use tch_dist::{replicate, Shardable};
    /// # fn demo<M: Shardable>(model: &M) {
    /// println!("{:?}", replicate::state(model).unwrap().stats());
    /// # }
    /// ```
    pub fn stats(&self) -> ReducerStats {
        self.reducer.stats()
    }

    /// The group gradients are averaged over.
    ///
    /// ```no_run
    /// # use tch_dist::{replicate, Shardable};
    /// # fn demo<M: Shardable>(model: &M) {
    /// let world = replicate::state(model).unwrap().group().world_size();
    /// # }
    /// ```
    pub fn group(&self) -> &ProcessGroup {
        self.reducer.group()
    }

    /// Removes replicate's forward hook (gradient hooks go when the state is dropped).
    /// Returns whether it was still registered; always false for a wrapper, which has no
    /// hook (its `forward` does the work).
    ///
    /// ```no_run
    /// # use tch_dist::{replicate, Shardable};
    /// # fn demo<M: Shardable>(model: &M) {
    /// assert!(replicate::state(model).unwrap().remove_forward_hook());
    /// # }
    /// ```
    pub fn remove_forward_hook(&self) -> bool {
        self.pre_hook.as_ref().is_some_and(RemovableHandle::remove)
    }

    /// replicate's work before a forward, shared by the derive form's pre-hook and the
    /// wrapper's `forward`: the previous iteration's unfinished-reduction check, the buffer
    /// broadcast, and the input's move to `device_id` (`Some` when it moved).
    /// Over every input of the call (`Some`: the inputs moved to `input_device`).
    fn pre_forward(&self, xs: &[Tensor]) -> Result<Option<Vec<Tensor>>, DistError> {
        self.reducer.prepare_for_forward()?;
        if self.broadcast_buffers {
            // The buffers' sizes are not the backward's: the step check comes first.
            self.reducer.check_forward_step()?;
            let buffers = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
            let buffers: Vec<&Tensor> = buffers.iter().collect();
            self.reducer
                .group()
                .broadcast_coalesced(&buffers, 0, BROADCAST_BUCKET_BYTES)?;
        }
        Ok(move_inputs(self.input_device, xs))
    }

    /// Runs `f` with gradient synchronisation off, then restores it (also on a panic).
    fn without_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore<'a>(&'a Reducer, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.set_require_sync(self.1);
            }
        }
        let _restore = Restore(&self.reducer, self.reducer.require_sync());
        self.reducer.set_require_sync(false);
        f()
    }
}

/// Every input of `xs` moved to `device`, when one is on another device.
fn move_inputs(device: Option<Device>, xs: &[Tensor]) -> Option<Vec<Tensor>> {
    device
        .filter(|d| xs.iter().any(|x| x.device() != *d))
        .map(|d| xs.iter().map(|x| x.to_device(d)).collect())
}

/// Whether `ignored` names `fqn`: the FQN itself, or a module prefix of it.
fn is_ignored(fqn: &str, ignored: &[String]) -> bool {
    ignored.iter().any(|i| {
        fqn == i
            || (fqn.len() > i.len()
                && fqn.starts_with(i.as_str())
                && fqn.as_bytes()[i.len()] == b'.')
    })
}

/// The first entry of `ignored` that names none of `fqns`.
fn unknown_ignored<'a>(ignored: &'a [String], fqns: &[String]) -> Option<&'a String> {
    ignored
        .iter()
        .find(|i| !fqns.iter().any(|f| is_ignored(f, std::slice::from_ref(*i))))
}

/// The group `opts` names, or the default group.
fn group_of(opts: &Options) -> Result<ProcessGroup, ReplicateError> {
    Ok(match &opts.process_group {
        Some(g) => g.clone(),
        None => default_group()?,
    })
}

/// Collects the parameters replicate manages: requires-grad parameters outside ignored
/// modules, outside submodules managed by `fully_shard`, and not sharded by `shard_module`.
struct ParamCollector<'a> {
    ignored: &'a [ModuleKey],
    /// `Options::ignored_params`.
    ignored_params: &'a [String],
    /// Every parameter and buffer FQN walked (what `ignored_params` may name).
    seen: Vec<String>,
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
        self.seen.push(fqn.clone());
        if self.skip_from.is_none()
            && tensor.requires_grad()
            && !self.sharded.contains(&fqn)
            && !is_ignored(&fqn, self.ignored_params)
        {
            self.params.push((fqn, tensor.shallow_clone()));
        }
    }

    fn visit_buffer(&mut self, name: &str, tensor: &'m Tensor) {
        let fqn = self.fqn(name);
        self.seen.push(fqn.clone());
        if self.skip_from.is_none() && !is_ignored(&fqn, self.ignored_params) {
            self.buffers.push((fqn, tensor.shallow_clone()));
        }
    }
}

/// `device_id`'s default: a module on CUDA uses its group's bound device (the device
/// `init_process_group` bound from LOCAL_RANK or its `device_id`), as PyTorch users pass
/// `device_ids=[local_rank]`; a CPU module (or a group without a device) has none.
fn default_device(group: &ProcessGroup, params: &[(String, Tensor)]) -> Option<Device> {
    group
        .bound_device()
        .filter(|_| params.iter().any(|(_, t)| t.device().is_cuda()))
}

/// What a form found in its model, for [`set_up`].
struct Found {
    /// Requires-grad parameters replicate manages, in registration order.
    params: Vec<(String, Tensor)>,
    /// Buffers replicate broadcasts, in an order that is the same on every rank.
    buffers: Vec<(String, Tensor)>,
    /// A problem only this form can see (checked with the others, on every rank at once).
    problem: Option<ReplicateError>,
}

/// The one implementation behind both forms, from the tensors a form found: every check
/// (on every rank together, before anything is sent or changed), the start-up broadcast of
/// rank 0's parameters and buffers, and the [`Reducer`]. The derive form adds its forward
/// pre-hook; the wrapper calls [`ReplicateState::pre_forward`] from its `forward`.
fn set_up(
    group: ProcessGroup,
    found: Found,
    opts: &Options,
) -> Result<ReplicateState, ReplicateError> {
    let Found {
        params,
        buffers,
        problem,
    } = found;
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
    let device = opts
        .device_id
        .map(DeviceId::device)
        .or_else(|| default_device(&group, &params));
    // Checks each rank makes on its own, shared so that every rank fails together before
    // anything is sent or changed.
    let rank = group.rank();
    // Empty tensors have no memory of their own to tell them apart (pointer 0).
    let pointers: Vec<(usize, &String)> = params
        .iter()
        .map(|(fqn, t)| (t.data_ptr() as usize, fqn))
        .filter(|(p, _)| *p != 0)
        .collect();
    let taken = {
        let m = managed();
        pointers
            .iter()
            .find(|(p, _)| m.contains(p))
            .map(|(_, fqn)| (*fqn).clone())
    };
    let pointers: Vec<usize> = pointers.into_iter().map(|(p, _)| p).collect();
    let misplaced = device
        .filter(|d| d.is_cuda())
        .and_then(|d| params.iter().find(|(_, t)| t.device() != d).map(|p| (d, p)));
    let problem = problem.or(taken.map(|fqn| ReplicateError::AlreadyReplicated { rank, fqn }));
    let local = match (reducer_opts.validate(), problem, misplaced) {
        (Err(problem), _, _) => Err(ReplicateError::from(DistError::InvalidArgument {
            rank,
            op: "replicate",
            problem: Box::new(problem),
        })),
        (Ok(()), Some(problem), _) => Err(problem),
        (Ok(()), None, Some((device_id, (fqn, t)))) => Err(ReplicateError::DeviceMismatch {
            rank,
            device_id,
            fqn: fqn.clone(),
            device: t.device(),
        }),
        (Ok(()), None, None) if params.is_empty() => {
            Err(ReplicateError::NothingToReplicate { rank })
        }
        (Ok(()), None, None) => Ok(()),
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
        ("ignored_params", format!("{:?}", opts.ignored_params)),
    ];
    let options: Vec<(String, String)> = options
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect();
    group.verify_same_options("replicate", &options)?;
    let named: Vec<(&str, &Tensor)> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    group.verify_same_tensors("replicate", "parameters", 0, &named)?;
    // The buffers are broadcast as one coalesced list: the same names, shapes and dtypes on
    // every rank, or the broadcast would fail without a name (or mix values up).
    let named: Vec<(&str, &Tensor)> = buffers.iter().map(|(n, t)| (n.as_str(), t)).collect();
    group.verify_same_tensors("replicate", "buffers", 0, &named)?;
    let states: Vec<&Tensor> = params
        .iter()
        .chain(buffers.iter())
        .map(|(_, t)| t)
        .collect();
    group.broadcast_coalesced(&states, 0, BROADCAST_BUCKET_BYTES)?;

    let param_fqns: Vec<String> = params.iter().map(|(n, _)| n.clone()).collect();
    let buffer_fqns: Vec<String> = buffers.iter().map(|(n, _)| n.clone()).collect();
    let reducer = Reducer::new(params, group.clone(), reducer_opts)?;
    // Registered only once nothing can fail any more; the check above ran on every rank.
    {
        let mut m = managed();
        m.extend(pointers.iter().copied());
    }
    let broadcast_buffers =
        opts.broadcast_buffers && !group.skips_communication() && !buffers.is_empty();
    Ok(ReplicateState {
        reducer,
        param_fqns,
        buffer_fqns,
        buffers: std::sync::Mutex::new(buffers.into_iter().map(|(_, t)| t).collect()),
        broadcast_buffers,
        input_device: device.filter(|d| d.is_cuda()),
        pre_hook: None,
        managed: pointers,
    })
}

/// Applies replicate to `module`: checks and synchronises parameters across ranks and
/// installs the gradient reducer and forward hook. See the module docs for an example; for
/// a model that is not `Shardable` (`nn::seq()`, `nn::func`, any `impl Module`), see
/// [`wrap`].
#[contract(crate = "crate", conflicts(fully_shard))]
pub fn apply<M: Shardable + ?Sized>(
    module: &M,
    opts: Options,
) -> Result<ReplicateState, ReplicateError> {
    let group = group_of(&opts)?;
    // The root itself may be ignored (then nothing is managed), like PyTorch.
    let root_ignored = ModuleKey::of(module).is_some_and(|k| opts.ignored_modules.contains(&k));
    let mut c = ParamCollector {
        ignored: &opts.ignored_modules,
        ignored_params: &opts.ignored_params,
        sharded: crate::sharding::sharded_params_in(module)
            .into_keys()
            .collect(),
        path: Vec::new(),
        skip_from: root_ignored.then_some(0),
        seen: Vec::new(),
        params: Vec::new(),
        buffers: Vec::new(),
    };
    module.visit(&mut c);
    let problem = unknown_ignored(&opts.ignored_params, &c.seen).map(|name| {
        ReplicateError::UnknownIgnoredParam {
            rank: group.rank(),
            name: name.clone(),
        }
    });
    let found = Found {
        params: c.params,
        buffers: c.buffers,
        problem,
    };
    let mut replicated = set_up(group, found, &opts)?;
    let input_device = replicated.input_device;
    let pre_hook = register_fallible_forward_pre_hook_n(module, move |m, xs| {
        // PyTorch raises from forward here: `f_call` returns the error, `call` panics with it
        // (`replicate::prepare_forward` checks the same ahead of the call).
        match state(m) {
            Some(s) => s.pre_forward(xs).map_err(ForwardError::from_error),
            None => Ok(move_inputs(input_device, xs)),
        }
    })?;
    replicated.pre_hook = Some(pre_hook);
    Ok(replicated)
}

/// The checks replicate's forward hook makes, as a value: fails with PyTorch's
/// "Expected to have finished reduction in the prior iteration..." error when the last
/// backward left parameters without gradients (and `find_unused_parameters` is off).
/// [`Replicated::prepare_forward`] is the wrapper form's.
///
/// ```no_run
/// # use tch_dist::{replicate, Shardable};
/// # fn demo<M: Shardable>(model: &M) -> Result<(), replicate::ReplicateError> {
/// replicate::prepare_forward(model)?; // what `model.call(&x)` checks first
/// # Ok(()) }
/// ```
pub fn prepare_forward<M: Shardable + ?Sized>(module: &M) -> Result<(), ReplicateError> {
    let s = state(module).ok_or(ReplicateError::NotReplicated)?;
    s.reducer.prepare_for_forward()?;
    Ok(())
}

/// Runs `f` without gradient synchronisation (gradient accumulation, PyTorch's `no_sync`):
/// gradients accumulate locally and the next synchronised backward averages the sum.
/// [`Replicated::no_sync`] is the wrapper form's.
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
    Ok(s.without_sync(f))
}

mod wrap;
pub use wrap::{wrap, wrap_t, Replicated, ReplicatedT};
