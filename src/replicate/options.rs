//! [`Options`]: replicate's options, with PyTorch DDP's names and defaults, and
//! [`DeviceId`].

use tch::Device;
use tch_dist_core::{ModuleKey, Shardable};
use tch_dist_runtime::{CommHook, ProcessGroup};

use super::ReplicateError;

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
    /// The device the index or device names.
    pub(super) fn device(self) -> Device {
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
    /// PyTorch's `bucket_cap_mb_list`: one cap per bucket, in MiB, in launch order (each
    /// dtype and device's k-th bucket closes once it holds at least entry k; the last entry
    /// caps every later bucket), used instead of the 1 MiB first bucket and `bucket_cap_mb`,
    /// when the buckets are built and when they are rebuilt after the first iteration.
    /// Empty (the default, PyTorch's `None`): not used. Every entry must be positive.
    ///
    /// ```no_run
    /// # use tch::nn;
    /// # use tch_dist::replicate;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let net = nn::seq().add(nn::linear(vs.root() / "fc", 1024, 1024, Default::default()));
    /// // A small first bucket (launched first), then 50 MiB buckets.
    /// let opts = replicate::Options { bucket_cap_mb_list: vec![0.5, 50.0], ..Default::default() };
    /// let model = replicate::wrap(net, &vs, opts)?;
    /// println!("{:?}", model.state().buckets());
    /// # Ok(()) }
    /// ```
    pub bucket_cap_mb_list: Vec<f64>,
    /// Modules whose parameters replicate leaves alone (and their children). Only for
    /// [`apply`](crate::replicate::apply): a wrapped module is not walked ([`wrap`](crate::replicate::wrap) refuses it); use `ignored_params`.
    pub ignored_modules: Vec<ModuleKey>,
    /// Parameters and buffers replicate leaves alone, by FQN (`"head.weight"`), or by the
    /// FQN of a module holding them (`"head"`: every `head.*`); PyTorch's
    /// `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`. An entry that
    /// matches nothing is an error. Both forms ([`apply`](crate::replicate::apply), [`wrap`](crate::replicate::wrap)).
    pub ignored_params: Vec<String>,
    /// The device of the module (CUDA index or device; CPU means none): inputs are moved
    /// there and every parameter must be there. Default: for a module on CUDA, the group's
    /// bound device ([`ProcessGroup::bound_device`]: LOCAL_RANK, or `init_process_group`'s
    /// device_id); none for a CPU module.
    pub device_id: Option<DeviceId>,
    /// Broadcast rank 0's buffers before each forward (default true).
    pub broadcast_buffers: bool,
    /// PyTorch's `init_sync` (default true): rank 0's parameters and buffers are broadcast
    /// to every rank when replicate is applied. False skips that broadcast: each rank keeps
    /// its own values, so they must already be equal (seeded alike, or loaded from one
    /// checkpoint), or the ranks train different models. The check that every rank has the
    /// same names, shapes and dtypes still runs (PyTorch skips its shape check too; it
    /// sends no values).
    ///
    /// ```no_run
    /// # use tch::nn;
    /// # use tch_dist::replicate;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
    /// tch::manual_seed(0); // the same initial values on every rank
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let net = nn::seq().add(nn::linear(vs.root() / "fc", 4, 2, Default::default()));
    /// let opts = replicate::Options { init_sync: false, ..Default::default() };
    /// let model = replicate::wrap(net, &vs, opts)?;
    /// # Ok(()) }
    /// ```
    pub init_sync: bool,
    /// Parameters without a gradient count as zero instead of failing the next iteration.
    pub find_unused_parameters: bool,
    /// PyTorch's `skip_all_reduce_unused_params` (default false): with
    /// `find_unused_parameters` (or `static_graph`), a bucket none of whose parameters got a
    /// gradient on any rank is not all-reduced; no effect without either, as in PyTorch.
    /// The gradients are those DDP gives without it (parameters unused everywhere keep
    /// their `.grad`); only the communication is saved. PyTorch decides on each rank alone
    /// from its own unused parameters, so a parameter that one rank uses and another does
    /// not desynchronises the ranks (its docs: "may cause desynchronization and result in
    /// training hang"); tch-dist decides on every rank alike, from the previous synchronised
    /// pass's used map (all-reduced with MAX, which `find_unused_parameters` sends anyway):
    /// the first pass skips nothing, later passes skip the buckets no rank used before, and
    /// a skipped bucket that some rank used after all is all-reduced at the end of
    /// backward. [`ReducerStats::buckets_reduced`](crate::ReducerStats::buckets_reduced)
    /// counts the buckets sent.
    ///
    /// ```no_run
    /// # use tch_dist::replicate;
    /// let opts = replicate::Options {
    ///     find_unused_parameters: true,
    ///     skip_all_reduce_unused_params: true,
    ///     ..Default::default()
    /// };
    /// ```
    pub skip_all_reduce_unused_params: bool,
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
    /// PyTorch's `device_mesh`, instead of `process_group`: a 1-D mesh (a dim of a larger
    /// one, `mesh.dim("dp")?`) whose group replicate averages over.
    pub device_mesh: Option<crate::device_mesh::DeviceMesh>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            bucket_cap_mb_list: Vec::new(),
            ignored_modules: Vec::new(),
            ignored_params: Vec::new(),
            device_id: None,
            broadcast_buffers: true,
            init_sync: true,
            find_unused_parameters: false,
            skip_all_reduce_unused_params: false,
            static_graph: false,
            gradient_as_bucket_view: false,
            comm_hook: CommHook::AllReduceMean,
            in_place_min_bytes: tch_dist_runtime::DEFAULT_IN_PLACE_MIN_BYTES,
            process_group: None,
            device_mesh: None,
        }
    }
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("bucket_cap_mb", &self.bucket_cap_mb)
            .field("bucket_cap_mb_list", &self.bucket_cap_mb_list)
            .field("ignored_modules", &self.ignored_modules)
            .field("ignored_params", &self.ignored_params)
            .field("device_id", &self.device_id)
            .field("broadcast_buffers", &self.broadcast_buffers)
            .field("init_sync", &self.init_sync)
            .field("find_unused_parameters", &self.find_unused_parameters)
            .field(
                "skip_all_reduce_unused_params",
                &self.skip_all_reduce_unused_params,
            )
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
