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

use tch::{Device, Kind, Tensor};
use tch_dist_core::hooks::{register_fallible_forward_pre_hook, ForwardError, RemovableHandle};
use tch_dist_core::{contract, registry, ContractError, ModuleKey, ModuleVisitor, Shardable};
use tch_dist_runtime::{
    default_group, CommHook, DistError, ProcessGroup, Reducer, ReducerOptions, ReducerStats,
};

/// Errors of `replicate`.
#[derive(Debug, thiserror::Error)]
pub enum ReplicateError {
    /// Applied twice, or together with a conflicting API, or the module's names changed.
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// The engine failed (rendezvous, a collective, a timeout).
    #[error(transparent)]
    Dist(#[from] DistError),
    /// The ranks do not hold the same parameters; every rank reports the first difference.
    #[error("rank {rank}: replicate: parameters differ across ranks: {detail}")]
    ParameterMismatch {
        /// This rank.
        rank: usize,
        /// The first differing FQN with both shapes and dtypes.
        detail: String,
    },
    /// A bad option or a module replicate cannot manage.
    #[error("replicate: {0}")]
    Invalid(String),
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
    /// The device of the module (CUDA index or device; CPU means none).
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
            .finish()
    }
}

impl Options {
    /// Adds `module` to `ignored_modules`.
    pub fn ignore<M: Shardable + ?Sized>(mut self, module: &M) -> Result<Self, ReplicateError> {
        let key = ModuleKey::of(module).ok_or_else(|| {
            ReplicateError::Invalid(format!(
                "cannot ignore a `{}`: it has no parameters or buffers",
                module.type_name()
            ))
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

/// Applies replicate to `module`: checks and synchronises parameters across ranks and
/// installs the gradient reducer and forward hook. See the module docs for an example.
#[contract(crate = "crate", conflicts(fully_shard))]
pub fn apply<M: Shardable + ?Sized>(
    module: &M,
    opts: Options,
) -> Result<ReplicateState, ReplicateError> {
    if !opts.bucket_cap_mb.is_finite() || opts.bucket_cap_mb <= 0.0 {
        return Err(ReplicateError::Invalid(format!(
            "bucket_cap_mb must be positive, got {}",
            opts.bucket_cap_mb
        )));
    }
    let group = match &opts.process_group {
        Some(g) => g.clone(),
        None => default_group()?,
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
    let device = opts.device_id.map(DeviceId::device);
    if let Some(d) = device.filter(|d| d.is_cuda()) {
        if let Some((fqn, t)) = params.iter().find(|(_, t)| t.device() != d) {
            return Err(ReplicateError::Invalid(format!(
                "device_id is {d:?} but parameter `{fqn}` is on {:?}; move the module first",
                t.device()
            )));
        }
    }
    verify_same_parameters(&group, &params)?;
    sync_from_rank0(&group, params.iter().chain(buffers.iter()).map(|(_, t)| t))?;

    let reducer_opts = ReducerOptions {
        bucket_cap_mb: opts.bucket_cap_mb,
        find_unused_parameters: opts.find_unused_parameters,
        gradient_as_bucket_view: opts.gradient_as_bucket_view,
        static_graph: opts.static_graph,
        comm_hook: opts.comm_hook,
        ..ReducerOptions::default()
    };
    let param_fqns: Vec<String> = params.iter().map(|(n, _)| n.clone()).collect();
    let reducer = Reducer::new(params, group.clone(), reducer_opts)?;
    let buffer_handles: Vec<Tensor> = buffers.iter().map(|(_, t)| t.shallow_clone()).collect();
    let broadcast_buffers = opts.broadcast_buffers && group.world_size() > 1 && !buffers.is_empty();
    let input_device = device.filter(|d| d.is_cuda());
    let pre_hook = register_fallible_forward_pre_hook(module, move |m, xs| {
        // PyTorch raises from forward here: `f_call` returns the error, `call` panics with it
        // (`replicate::prepare_forward` checks the same ahead of the call).
        if let Some(s) = state(m) {
            let fail = |e: &dyn std::fmt::Display| ForwardError::new(e.to_string());
            s.reducer.prepare_for_forward().map_err(|e| fail(&e))?;
            if broadcast_buffers {
                let buffers = s.buffers.lock().unwrap_or_else(|e| e.into_inner());
                sync_from_rank0(s.reducer.group(), buffers.iter()).map_err(|e| fail(&e))?;
            }
        }
        Ok(input_device
            .filter(|d| xs.device() != *d)
            .map(|d| xs.to_device(d)))
    })
    .map_err(|e| ReplicateError::Invalid(e.to_string()))?;
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

/// One parameter as the ranks compare it: "fqn\tshape\tdtype".
fn describe_param(line: Option<&str>) -> String {
    match line.map(|l| l.split('\t').collect::<Vec<_>>()) {
        Some(f) if f.len() == 3 => format!("`{}` with shape {} ({})", f[0], f[1], f[2]),
        _ => "missing".to_string(),
    }
}

/// Every rank gathers every rank's (FQN, shape, dtype) list and compares it with rank 0's,
/// so that all ranks fail together, each naming the first difference.
fn verify_same_parameters(
    group: &ProcessGroup,
    params: &[(String, Tensor)],
) -> Result<(), ReplicateError> {
    let encoded: String = params
        .iter()
        .map(|(n, t)| format!("{n}\t{:?}\t{:?}\n", t.size(), t.kind()))
        .collect();
    let all = all_gather_bytes(group, encoded.as_bytes())?;
    let text: Vec<String> = all
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    let reference: Vec<&str> = text[0].lines().collect();
    for (r, t) in text.iter().enumerate().skip(1) {
        let lines: Vec<&str> = t.lines().collect();
        let Some(i) =
            (0..reference.len().max(lines.len())).find(|&i| reference.get(i) != lines.get(i))
        else {
            continue;
        };
        let fields =
            |l: Option<&&str>| l.map(|l| l.split('\t').map(str::to_string).collect::<Vec<_>>());
        let (a, b) = (fields(reference.get(i)), fields(lines.get(i)));
        let detail = match (a, b) {
            (Some(a), Some(b)) if a.len() == 3 && b.len() == 3 && a[0] == b[0] => format!(
                "`{}` has shape {} ({}) on rank 0 but shape {} ({}) on rank {r}",
                a[0], a[1], a[2], b[1], b[2]
            ),
            _ => format!(
                "rank 0 has {} parameters and rank {r} has {}; parameter {i} is {} on rank 0 but {} on rank {r}",
                reference.len(),
                lines.len(),
                describe_param(reference.get(i).copied()),
                describe_param(lines.get(i).copied())
            ),
        };
        return Err(ReplicateError::ParameterMismatch {
            rank: group.rank(),
            detail,
        });
    }
    Ok(())
}

/// All-gathers a byte string of any length from every rank.
fn all_gather_bytes(group: &ProcessGroup, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
    let w = group.world_size();
    let len = Tensor::from_slice(&[bytes.len() as i64]);
    let lens: Vec<Tensor> = (0..w)
        .map(|_| Tensor::zeros([1], (Kind::Int64, Device::Cpu)))
        .collect();
    group.all_gather(&lens, &len)?;
    let lens: Vec<usize> = lens
        .iter()
        .map(|t| t.int64_value(&[0]).max(0) as usize)
        .collect();
    let max = lens.iter().copied().max().unwrap_or(0).max(1);
    let mut padded = bytes.to_vec();
    padded.resize(max, 0);
    let mine = Tensor::from_slice(&padded);
    let outs: Vec<Tensor> = (0..w)
        .map(|_| Tensor::zeros([max as i64], (Kind::Uint8, Device::Cpu)))
        .collect();
    group.all_gather(&outs, &mine)?;
    Ok(outs
        .iter()
        .zip(lens)
        .map(|(t, n)| {
            let v = Vec::<u8>::try_from(t).unwrap_or_default();
            v[..n.min(v.len())].to_vec()
        })
        .collect())
}

/// Broadcasts tensors from rank 0 in place (all launched, then all awaited).
fn sync_from_rank0<'a>(
    group: &ProcessGroup,
    tensors: impl Iterator<Item = &'a Tensor>,
) -> Result<(), DistError> {
    if group.world_size() == 1 {
        return Ok(());
    }
    tch::no_grad(|| {
        let works = tensors
            .map(|t| group.broadcast_async(t, 0))
            .collect::<Result<Vec<_>, _>>()?;
        works.into_iter().try_for_each(|w| w.wait())
    })
}
