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
    /// PyTorch's `device_mesh`, instead of `process_group`: a 1-D mesh (a dim of a larger
    /// one, `mesh.dim("dp")?`) whose group replicate averages over.
    pub device_mesh: Option<crate::device_mesh::DeviceMesh>,
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
            device_mesh: None,
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
