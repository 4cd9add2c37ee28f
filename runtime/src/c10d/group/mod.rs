//! Process groups: rendezvous through c10d's TCPStore, Gloo for CPU tensors, NCCL for CUDA
//! tensors, and a process-wide default group like `torch.distributed`'s.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tch::Device;

use crate::devices::DeviceClaim;
use crate::env::{
    is_loopback, read_switch, DebugLevel, LaunchEnv, DEFAULT_NCCL_TIMEOUT, DEFAULT_TIMEOUT,
};
use crate::error::{ArgumentError, DistError, EnvError, RendezvousError, Result};
use crate::ffi::{self, shim};
use crate::rendezvous::{self, Deadline};
use crate::store::{millis, Store};

/// Test switch: `TCH_DIST_NO_SHORTCUTS=1` turns off the shortcuts of a group of one (see
/// [`InitOptions::shortcuts`]).
pub const NO_SHORTCUTS_ENV: &str = "TCH_DIST_NO_SHORTCUTS";

/// Test switch: `TCH_DIST_CUDA_VIA_GLOO=1` routes CUDA tensors through Gloo (see
/// [`InitOptions::cuda_via_gloo`]).
pub const CUDA_VIA_GLOO_ENV: &str = "TCH_DIST_CUDA_VIA_GLOO";

/// Which c10d backends a group has, as PyTorch's backend strings name them.
///
/// `Gloo` is PyTorch's `"gloo"` (CPU tensors), `Nccl` its `"cpu:gloo,cuda:nccl"`
/// (ProcessGroupNCCL for CUDA tensors, with Gloo beside it for CPU tensors and control
/// traffic: barriers, monitored barriers, metadata checks) and `NcclOnly` its `"nccl"`
/// (CUDA tensors only; barriers go through NCCL, CPU tensors and monitored barriers are
/// refused). A Rust rank and a PyTorch rank of one job must name the same set: each backend
/// has a rendezvous of its own, which waits for every rank. A CPU-only machine simply never
/// asks for NCCL, so one binary serves both.
///
/// ```
/// use tch_dist_runtime::Backend;
/// assert_eq!("gloo".parse::<Backend>().unwrap(), Backend::Gloo);
/// assert_eq!("nccl".parse::<Backend>().unwrap(), Backend::NcclOnly);
/// assert_eq!(Backend::try_from("cpu:gloo,cuda:nccl").unwrap(), Backend::Nccl);
/// assert_eq!(Backend::Nccl.to_string(), "cpu:gloo,cuda:nccl");
/// assert!("mpi".parse::<Backend>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Gloo only: CPU tensors (PyTorch's `"gloo"`).
    Gloo,
    /// NCCL for CUDA tensors, with Gloo beside it for CPU tensors (PyTorch's
    /// `"cpu:gloo,cuda:nccl"`).
    Nccl,
    /// NCCL only (PyTorch's `"nccl"`, also what its bare `init_process_group()` picks on a
    /// machine with CUDA).
    NcclOnly,
}

impl Backend {
    /// `Nccl` when CUDA is available, else `Gloo` (PyTorch's usual choice, with Gloo kept
    /// beside NCCL for CPU tensors).
    pub fn default_for_machine() -> Backend {
        if tch::Cuda::is_available() {
            Backend::Nccl
        } else {
            Backend::Gloo
        }
    }

    /// PyTorch's default timeout for a group of this backend (`_get_default_timeout`): 10
    /// minutes for `"nccl"` ([`Backend::NcclOnly`]), 30 minutes otherwise, `"cpu:gloo,cuda:nccl"`
    /// included.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tch_dist_runtime::Backend;
    /// assert_eq!(Backend::NcclOnly.default_timeout(), Duration::from_secs(600));
    /// assert_eq!(Backend::Nccl.default_timeout(), Duration::from_secs(1800));
    /// ```
    pub fn default_timeout(&self) -> Duration {
        match self {
            Backend::NcclOnly => DEFAULT_NCCL_TIMEOUT,
            Backend::Gloo | Backend::Nccl => DEFAULT_TIMEOUT,
        }
    }

    /// Whether this build of tch-dist can create NCCL groups.
    pub fn nccl_compiled() -> bool {
        // SAFETY: a constant query without arguments.
        unsafe { ffi::tdr_nccl_compiled() }
    }

    /// PyTorch's string for this backend set.
    ///
    /// ```
    /// assert_eq!(tch_dist_runtime::Backend::NcclOnly.as_str(), "nccl");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "cpu:gloo,cuda:nccl",
            Backend::NcclOnly => "nccl",
        }
    }

    /// Whether the group has a Gloo backend (CPU tensors).
    pub fn has_gloo(self) -> bool {
        self != Backend::NcclOnly
    }

    /// Whether the group has an NCCL backend (CUDA tensors).
    pub fn has_nccl(self) -> bool {
        self != Backend::Gloo
    }

    /// Reads PyTorch's backend strings, in any case: `"gloo"`, `"nccl"`, and the
    /// device-to-backend map `"cpu:gloo,cuda:nccl"` (either order; `"cpu:gloo"` alone is
    /// `"gloo"`, `"cuda:nccl"` alone is `"nccl"`). Anything else is
    /// [`DistError::UnknownBackend`].
    pub fn parse(value: &str) -> Result<Backend> {
        let unknown = || DistError::UnknownBackend {
            value: value.to_string(),
        };
        let lower = value.trim().to_ascii_lowercase();
        match lower.as_str() {
            "gloo" => return Ok(Backend::Gloo),
            "nccl" => return Ok(Backend::NcclOnly),
            _ => {}
        }
        let (mut cpu, mut cuda) = (false, false);
        for pair in lower.split(',') {
            match pair.split_once(':').map(|(d, b)| (d.trim(), b.trim())) {
                Some(("cpu", "gloo")) if !cpu => cpu = true,
                Some(("cuda", "nccl")) if !cuda => cuda = true,
                _ => return Err(unknown()),
            }
        }
        Ok(match (cpu, cuda) {
            (true, true) => Backend::Nccl,
            (true, false) => Backend::Gloo,
            (false, true) => Backend::NcclOnly,
            (false, false) => return Err(unknown()),
        })
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Backend {
    type Err = DistError;
    fn from_str(s: &str) -> Result<Backend> {
        Backend::parse(s)
    }
}

impl TryFrom<&str> for Backend {
    type Error = DistError;
    fn try_from(s: &str) -> Result<Backend> {
        Backend::parse(s)
    }
}

impl TryFrom<String> for Backend {
    type Error = DistError;
    fn try_from(s: String) -> Result<Backend> {
        Backend::parse(&s)
    }
}

/// PyTorch's `TORCHELASTIC_USE_AGENT_STORE`: `True` (exactly, as PyTorch compares it) under
/// torchrun, whose agent hosts the rendezvous store; every rank is then a client of it.
pub const USE_AGENT_STORE_ENV: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// PyTorch's `TORCH_DIST_INIT_BARRIER`: `1` adds its store-based barrier after
/// `init_process_group` and `new_group` (see [`InitOptions::init_barrier`]).
pub const INIT_BARRIER_ENV: &str = "TORCH_DIST_INIT_BARRIER";

/// Everything needed to create a process group explicitly.
///
/// ```no_run
/// use std::time::Duration;
/// use tch_dist_runtime::{Backend, InitOptions, ProcessGroup};
/// let opts = InitOptions::new(Backend::Gloo, 0, 2, "127.0.0.1", 29500)
///     .with_timeout(Duration::from_secs(60));
/// let pg = ProcessGroup::new(&opts)?;
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
///
/// An NCCL group binds one CUDA device, as `init_process_group(device_id=...)` with
/// `torch.cuda.set_device(local_rank)` does in PyTorch: `device_id` when given, else the
/// local rank (LOCAL_RANK). It becomes the creating thread's current device and NCCL's bound
/// device, and [`ProcessGroup::bound_device`] reports it.
///
/// ```
/// use tch_dist_runtime::{Backend, InitOptions};
/// let opts = InitOptions::new(Backend::Nccl, 3, 8, "10.0.0.1", 29500).with_local_rank(1);
/// assert_eq!(opts.cuda_device(4).unwrap(), Some(1)); // LOCAL_RANK=1 on a node of 4 GPUs
/// assert_eq!(opts.clone().with_device_id(2).cuda_device(4).unwrap(), Some(2));
/// assert!(opts.cuda_device(1).is_err()); // no cuda:1 here
/// let gloo = InitOptions::new(Backend::Gloo, 3, 8, "10.0.0.1", 29500);
/// assert_eq!(gloo.cuda_device(4).unwrap(), None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitOptions {
    /// The device backend.
    pub backend: Backend,
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// This process's rank on its node (LOCAL_RANK, SLURM_LOCALID): the CUDA device an NCCL
    /// group binds when `device_id` is `None`. [`InitOptions::new`] sets it to `rank`.
    pub local_rank: usize,
    /// The CUDA device this rank uses (PyTorch's `device_id`); `None`: `local_rank`.
    pub device_id: Option<usize>,
    /// Create NCCL's communicator while the group is created, instead of at its first
    /// collective (PyTorch's eager init, which `init_process_group(device_id=...)` does).
    /// [`InitOptions::with_device_id`] sets it.
    pub eager_connect: bool,
    /// Rendezvous host (rank 0 hosts the TCPStore there).
    pub master_addr: String,
    /// Rendezvous port.
    pub master_port: u16,
    /// Limit for the rendezvous and for every collective (default 30 minutes, as PyTorch).
    pub timeout: Duration,
    /// Whether a group of one may skip communicating (default true): the average of one rank
    /// is its own value, so the gradient reducer communicates nothing and `replicate` skips
    /// its broadcasts. **A test switch**: `false` (`TCH_DIST_NO_SHORTCUTS=1`) makes a group of
    /// one run every bucket path, so that one GPU checks what a node of GPUs would run.
    pub shortcuts: bool,
    /// **A test switch** (`TCH_DIST_CUDA_VIA_GLOO=1`): CUDA tensors go through Gloo, copied
    /// through host memory, and no NCCL backend is created, so that several ranks can share
    /// one GPU (each binds `local_rank % device count`, or `device_id`). Slow; never for
    /// training.
    pub cuda_via_gloo: bool,
    /// The checks made before each collective (`TCH_DIST_DEBUG`, else PyTorch's
    /// `TORCH_DISTRIBUTED_DEBUG`; default [`DebugLevel::Off`]): with
    /// [`DebugLevel::Detail`] every collective's fingerprint is checked across the group
    /// first. Subgroups inherit it.
    pub debug: DebugLevel,
    /// The launcher's run id (TORCHELASTIC_RUN_ID, which `tch-dist-run` and torchrun set):
    /// a rank that carries one refuses to join a rendezvous store claimed by a run with
    /// another id. `None` (a PyTorch rank, a hand-started one) is never checked.
    pub run_id: Option<String>,
    /// Every rank is a client of a store someone else hosts at MASTER_ADDR:MASTER_PORT
    /// (torchrun's agent store, `TORCHELASTIC_USE_AGENT_STORE=True`); otherwise rank 0 hosts
    /// it and waits for every rank to check in, as PyTorch's rank 0 does.
    pub use_agent_store: bool,
    /// PyTorch's store-based barrier after the group's creation and after every `new_group`
    /// (`TORCH_DIST_INIT_BARRIER=1`), with its keys: every rank of the job must agree on it.
    pub init_barrier: bool,
    /// How many times the launcher restarted the job (`TORCHELASTIC_RESTART_COUNT`; 0 at
    /// the first start). A restarted rank on an agent store that still holds the previous
    /// attempt's keys works under PyTorch's `/worker/attempt_{n}` prefix.
    pub restart_count: u64,
}

impl InitOptions {
    /// Options with PyTorch's default timeout for `backend` ([`Backend::default_timeout`]),
    /// the local rank equal to `rank`, no
    /// `device_id`, lazy NCCL connection and no test switch.
    pub fn new(
        backend: Backend,
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Self {
        Self {
            backend,
            rank,
            world_size,
            local_rank: rank,
            device_id: None,
            eager_connect: false,
            master_addr: master_addr.into(),
            master_port,
            timeout: backend.default_timeout(),
            shortcuts: true,
            cuda_via_gloo: false,
            debug: DebugLevel::Off,
            run_id: None,
            use_agent_store: false,
            init_barrier: false,
            restart_count: 0,
        }
    }

    /// Options from the launch environment (torchrun's or Slurm's variables, LOCAL_RANK
    /// and TORCHELASTIC_RUN_ID included), `TCH_DIST_TIMEOUT_SECS`, `TCH_DIST_DEBUG` (or
    /// `TORCH_DISTRIBUTED_DEBUG`), PyTorch's `TORCHELASTIC_USE_AGENT_STORE` and
    /// `TORCH_DIST_INIT_BARRIER`, and the test switches `TCH_DIST_NO_SHORTCUTS` and
    /// `TCH_DIST_CUDA_VIA_GLOO`.
    pub fn from_env(backend: Backend) -> Result<Self> {
        let env = LaunchEnv::from_process_env()?;
        let mut opts = Self::new(
            backend,
            env.rank,
            env.world_size,
            env.master_addr,
            env.master_port,
        )
        .with_local_rank(env.local_rank);
        opts.run_id = env.run_id;
        opts.debug = DebugLevel::from_vars(|k| std::env::var(k).ok())?;
        if let Ok(t) = std::env::var("TCH_DIST_TIMEOUT_SECS") {
            let secs = t
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0);
            let secs = secs.ok_or_else(|| EnvError::BadTimeout { value: t.clone() })?;
            opts.timeout = Duration::from_secs_f64(secs);
        }
        let switch = |var| read_switch(var, |k| std::env::var(k).ok());
        opts.shortcuts = !switch(NO_SHORTCUTS_ENV)?;
        opts.cuda_via_gloo = switch(CUDA_VIA_GLOO_ENV)?;
        opts.use_agent_store = read_agent_store(|k| std::env::var(k).ok());
        opts.init_barrier = read_init_barrier(|k| std::env::var(k).ok())?;
        opts.restart_count = std::env::var("TORCHELASTIC_RESTART_COUNT")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        Ok(opts)
    }

    /// Makes every rank a client of a store hosted by someone else (see
    /// [`InitOptions::use_agent_store`]).
    pub fn with_agent_store(mut self) -> Self {
        self.use_agent_store = true;
        self
    }

    /// Adds PyTorch's store-based barrier (see [`InitOptions::init_barrier`]).
    pub fn with_init_barrier(mut self) -> Self {
        self.init_barrier = true;
        self
    }

    /// Replaces the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Replaces the local rank (the default CUDA device).
    pub fn with_local_rank(mut self, local_rank: usize) -> Self {
        self.local_rank = local_rank;
        self
    }

    /// Binds CUDA device `device` and connects NCCL eagerly, as PyTorch's
    /// `init_process_group(device_id=...)`.
    pub fn with_device_id(mut self, device: usize) -> Self {
        self.device_id = Some(device);
        self.eager_connect = true;
        self
    }

    /// Sets the debug level (see [`InitOptions::debug`]).
    pub fn with_debug(mut self, debug: DebugLevel) -> Self {
        self.debug = debug;
        self
    }

    /// Sets the run id (see [`InitOptions::run_id`]).
    pub fn with_run_id(mut self, run_id: impl Into<String>) -> Self {
        self.run_id = Some(run_id.into());
        self
    }

    /// Turns off the shortcuts of a group of one (the test switch `shortcuts`).
    pub fn without_shortcuts(mut self) -> Self {
        self.shortcuts = false;
        self
    }

    /// Routes CUDA tensors through Gloo (the test switch `cuda_via_gloo`).
    pub fn with_cuda_via_gloo(mut self) -> Self {
        self.cuda_via_gloo = true;
        self
    }

    /// The CUDA device this rank binds, in a process that sees `device_count` CUDA devices:
    /// for NCCL, `device_id` or else `local_rank`, which must exist; with `cuda_via_gloo`
    /// the same modulo `device_count` (ranks share GPUs; none without CUDA); for Gloo,
    /// none.
    pub fn cuda_device(&self, device_count: usize) -> Result<Option<usize>> {
        let (from, device) = match self.device_id {
            Some(d) => ("device_id", d),
            None => ("LOCAL_RANK", self.local_rank),
        };
        if self.cuda_via_gloo {
            return Ok(match (self.device_id, device_count) {
                (_, 0) => None,
                (Some(d), n) if d >= n => {
                    return Err(EnvError::DeviceOutOfRange {
                        from,
                        device: d,
                        count: n,
                    }
                    .into())
                }
                (_, n) => Some(device % n),
            });
        }
        match self.backend {
            Backend::Gloo => Ok(None),
            Backend::Nccl | Backend::NcclOnly if device < device_count => Ok(Some(device)),
            Backend::Nccl | Backend::NcclOnly => Err(EnvError::DeviceOutOfRange {
                from,
                device,
                count: device_count,
            }
            .into()),
        }
    }
}

/// A group of processes that run collectives together. Cheap to clone; thread-safe.
///
/// Ranks, as in `torch.distributed`, are the group's own (0..world_size); `global_ranks`
/// maps them back to the default group's.
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<GroupInner>,
}

struct GroupHandle(NonNull<ffi::TdrGroup>);

// SAFETY: c10d backends are designed to be driven from several threads (PyTorch's Python
// threads and DDP's reducer do so); the handle is freed once, when the last Arc drops.
unsafe impl Send for GroupHandle {}
unsafe impl Sync for GroupHandle {}

impl Drop for GroupHandle {
    fn drop(&mut self) {
        // SAFETY: created by tdr_group_new, freed exactly once here.
        unsafe { ffi::tdr_group_free(self.0.as_ptr()) }
    }
}

/// What every group created from one rendezvous shares: PyTorch's `_world` for the groups of
/// one default group (one per process, when there is one default group).
struct World {
    /// The TCPStore itself (what [`ProcessGroup::store`] returns; tch-dist's `tch_dist/`
    /// keys and the worker count `init/` live here).
    root: Store,
    /// PyTorch's default store: `PrefixStore("0/", PrefixStore("default_pg", root))`, over
    /// which every subgroup's `"{name}/"` prefix goes.
    default_store: Store,
    /// PyTorch's `_world.group_count`: the default group took "0"; each `new_group` without
    /// `use_local_synchronization` takes the next number, on every rank, members or not.
    group_count: AtomicUsize,
    /// `len(_world.pg_names)`: the groups this process is a member of and has not shut down
    /// (the default group included), which names `use_local_synchronization` groups.
    live_groups: AtomicUsize,
    /// PyTorch's store-based barrier after every `new_group` (TORCH_DIST_INIT_BARRIER=1).
    init_barrier: bool,
}

struct GroupInner {
    handle: GroupHandle,
    world: Arc<World>,
    /// PyTorch's group name: "0" for the default group, the group count or a hash for
    /// subgroups.
    name: String,
    rank: usize,
    world_size: usize,
    backend: Backend,
    timeout: Duration,
    global_ranks: Vec<usize>,
    master: (String, u16),
    /// The bound CUDA device.
    device: Option<usize>,
    shortcuts: bool,
    cuda_via_gloo: bool,
    debug: DebugLevel,
    /// Set by `shutdown`: every later operation fails with `DistError::ShutDown`.
    shut_down: AtomicBool,
    /// Collectives and transfers launched so far.
    launched: AtomicU64,
    /// The subgroups created from this group, shut down with it.
    children: Mutex<Vec<Weak<GroupInner>>>,
}

/// What a new group's `GroupInner` takes beyond its handle.
struct Shape {
    name: String,
    rank: usize,
    world_size: usize,
    backend: Backend,
    timeout: Duration,
    global_ranks: Vec<usize>,
    master: (String, u16),
    device: Option<usize>,
    shortcuts: bool,
    cuda_via_gloo: bool,
    debug: DebugLevel,
}

impl GroupInner {
    fn new(handle: GroupHandle, world: Arc<World>, s: Shape) -> GroupInner {
        GroupInner {
            handle,
            world,
            name: s.name,
            rank: s.rank,
            world_size: s.world_size,
            backend: s.backend,
            timeout: s.timeout,
            global_ranks: s.global_ranks,
            master: s.master,
            device: s.device,
            shortcuts: s.shortcuts,
            cuda_via_gloo: s.cuda_via_gloo,
            debug: s.debug,
            shut_down: AtomicBool::new(false),
            launched: AtomicU64::new(0),
            children: Mutex::new(Vec::new()),
        }
    }

    /// Shuts this group's backends down, and its subgroups' first (PyTorch's
    /// `destroy_process_group(group)`: the group no longer counts among the live ones).
    fn shutdown(&self) {
        let children =
            std::mem::take(&mut *self.children.lock().unwrap_or_else(|e| e.into_inner()));
        for child in children.iter().filter_map(Weak::upgrade) {
            child.shutdown();
        }
        if !self.shut_down.swap(true, Ordering::SeqCst) {
            let _ = self
                .world
                .live_groups
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            // SAFETY: live handle; the shim takes its backends out under an exclusive lock,
            // so launches on other threads either finished or fail with ShutDownError.
            let _ = shim!(tdr_group_shutdown(self.handle.0.as_ptr()));
        }
    }
}

/// How [`ProcessGroup::new_group_with`] creates a subgroup.
///
/// ```
/// use tch_dist_runtime::{Backend, GroupOptions};
/// let opts = GroupOptions::new(Backend::Gloo).with_local_synchronization();
/// assert!(opts.use_local_synchronization);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupOptions {
    /// The subgroup's backends.
    pub backend: Backend,
    /// PyTorch's `use_local_synchronization=True`: only the members call `new_group`; the
    /// group is named by a hash of its ranks and takes no number from the group count.
    pub use_local_synchronization: bool,
}

impl GroupOptions {
    /// A subgroup with `backend`, which every rank of the parent creates.
    pub fn new(backend: Backend) -> GroupOptions {
        GroupOptions {
            backend,
            use_local_synchronization: false,
        }
    }

    /// Only the members create it (PyTorch's `use_local_synchronization=True`).
    pub fn with_local_synchronization(mut self) -> GroupOptions {
        self.use_local_synchronization = true;
        self
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("name", &self.inner.name)
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("backend", &self.backend())
            .field("global_ranks", &self.inner.global_ranks)
            .finish()
    }
}

impl ProcessGroup {
    /// Creates a group explicitly, with PyTorch 2.11's rendezvous: rank 0 hosts the TCPStore
    /// at `master_addr:master_port` (unless [`InitOptions::use_agent_store`]) and waits for
    /// every rank to check in, every rank connects to it, then the backends connect to each
    /// other under PyTorch's default group's prefixes (`default_pg/0//cpu//` for Gloo,
    /// `default_pg/0//cuda//` for NCCL), so that PyTorch ranks may be ranks of the same
    /// group (docs/ARCHITECTURE.md, "Rendezvous and naming").
    ///
    /// An NCCL group binds its CUDA device ([`InitOptions::cuda_device`]) before anything
    /// else, checks with every rank that no two ranks share a GPU (every rank fails with
    /// [`DistError::DuplicateDevice`] naming both, before NCCL would refuse them; with Gloo
    /// beside NCCL only), and, with `eager_connect`, creates NCCL's communicator.
    pub fn new(opts: &InitOptions) -> Result<ProcessGroup> {
        flush_trace_at_exit();
        let deadline = Deadline::after(opts.timeout);
        let rendezvous = |problem: RendezvousError| DistError::Rendezvous {
            rank: opts.rank,
            addr: opts.master_addr.clone(),
            port: opts.master_port,
            problem: Box::new(problem),
        };
        let engine = |cause: String| rendezvous(RendezvousError::Engine { cause });
        if opts.world_size == 0 || opts.rank >= opts.world_size {
            return Err(EnvError::RankOutOfRange {
                rank_var: "rank",
                rank: opts.rank,
                world_var: "world_size",
                world_size: opts.world_size,
            }
            .into());
        }
        if opts.backend.has_nccl() && !opts.cuda_via_gloo && !Backend::nccl_compiled() {
            return Err(EnvError::NcclNotCompiled.into());
        }
        let device = if opts.backend.has_nccl() || opts.cuda_via_gloo {
            opts.cuda_device(tch::Cuda::device_count().max(0) as usize)?
        } else {
            None
        };
        // Every step below ends by the deadline: the host resolves, something listens (rank
        // 0's store, or the agent's), then the store client connects, the run id is
        // checked, every rank checks in (rank 0 waits for all), and the backends
        // rendezvous with what is left.
        let addrs = rendezvous::resolve(&opts.master_addr, opts.master_port, deadline)
            .map_err(rendezvous)?;
        let is_server = opts.rank == 0 && !opts.use_agent_store;
        if !is_server {
            rendezvous::wait_for_listener(&addrs, deadline).map_err(rendezvous)?;
        }
        let store = Store::tcp(
            &opts.master_addr,
            opts.master_port,
            is_server,
            opts.world_size,
            deadline.left(),
            opts.timeout,
        )
        .map_err(engine)?;
        rendezvous::check_run(&store, opts.rank, opts.run_id.as_deref()).map_err(rendezvous)?;
        let prefixed =
            |base: &Store, prefix: &str| base.prefixed(prefix).map_err(|e| engine(e.to_string()));
        const NAME: &str = "0";
        // A restart on an agent store that outlived the last attempt (torch 2.11's torchrun
        // shares its rendezvous store with the workers and keeps it): that attempt's keys
        // (every Gloo rank's address) are still there, and would send this attempt's ranks
        // to dead peers. Each rank finds its own join key of then, so all of them take the
        // fresh prefix PyTorch uses for attempts on one store; a new store per attempt holds
        // no such key and nothing changes.
        let tcp = store;
        let store = if opts.use_agent_store
            && opts.restart_count > 0
            && rendezvous::joined_before(&tcp, NAME, opts.rank)
        {
            prefixed(&tcp, &format!("/worker/attempt_{}", opts.restart_count))?
        } else {
            tcp.clone()
        };
        let default_store = prefixed(&prefixed(&store, "default_pg")?, "0/")?;
        rendezvous::join(&store, NAME, opts.rank).map_err(rendezvous)?;
        let missing = |cause: RendezvousError| {
            rendezvous(
                rendezvous::never_joined(
                    &store,
                    &default_store,
                    NAME,
                    opts.world_size,
                    opts.timeout,
                )
                .unwrap_or(cause),
            )
        };
        // PyTorch's waitWorkers handshake: every rank checks in, the server waits for all.
        tcp.check_in(deadline.left())
            .map_err(|cause| missing(RendezvousError::Engine { cause }))?;
        let gloo_host = if is_loopback(&opts.master_addr) {
            "127.0.0.1"
        } else {
            ""
        };
        let handle = new_group_handle(
            &default_store,
            NAME,
            opts.rank,
            opts.world_size,
            GroupTimes {
                timeout: opts.timeout,
                rendezvous: deadline.left(),
            },
            gloo_host,
            opts.backend,
            device,
            opts.cuda_via_gloo,
            opts.debug,
        )
        .map_err(|cause| missing(RendezvousError::Engine { cause }))?;
        detail_with_foreign_ranks(&handle, &store, NAME, opts.world_size, opts.debug)
            .map_err(engine)?;
        if opts.init_barrier {
            // PyTorch's barrier of init_process_group: on PrefixStore("default_pg").
            let barrier_store = prefixed(&store, "default_pg")?;
            rendezvous::store_barrier(&barrier_store, NAME, opts.world_size, deadline)
                .map_err(rendezvous)?;
        }
        let world = Arc::new(World {
            root: store,
            default_store,
            group_count: AtomicUsize::new(1),
            live_groups: AtomicUsize::new(1),
            init_barrier: opts.init_barrier,
        });
        let pg = ProcessGroup {
            inner: Arc::new(GroupInner::new(
                handle,
                world,
                Shape {
                    name: NAME.to_string(),
                    rank: opts.rank,
                    world_size: opts.world_size,
                    backend: opts.backend,
                    timeout: opts.timeout,
                    global_ranks: (0..opts.world_size).collect(),
                    master: (opts.master_addr.clone(), opts.master_port),
                    device,
                    shortcuts: opts.shortcuts,
                    cuda_via_gloo: opts.cuda_via_gloo,
                    debug: opts.debug,
                },
            )),
        };
        if pg.uses_nccl() {
            if let Some(d) = device.filter(|_| opts.world_size > 1 && opts.backend.has_gloo()) {
                pg.verify_distinct_devices(&DeviceClaim::of_cuda_device(d)?)?;
            }
            if opts.eager_connect {
                // SAFETY: live group handle; exceptions are caught in the shim.
                shim!(tdr_group_connect(pg.raw())).map_err(|e| engine(e.message))?;
            }
        }
        Ok(pg)
    }

    /// Creates a group from torchrun's (or Slurm's) variables.
    pub fn from_env(backend: Backend) -> Result<ProcessGroup> {
        Self::new(&InitOptions::from_env(backend)?)
    }

    /// Creates a subgroup of this group's `ranks` (like `torch.distributed.new_group`).
    ///
    /// Every rank of this group must call it, in the same order relative to other
    /// `new_group` calls; members get `Some(group)`, the others `None`. As in PyTorch the
    /// ranks are sorted: a member's rank in the subgroup is its place in the sorted list.
    /// For a job with PyTorch ranks, call it on the default group (PyTorch's ranks are the
    /// default group's), in the order the PyTorch ranks call `new_group`.
    ///
    /// ```no_run
    /// use tch_dist_runtime::{default_group, Backend};
    /// let pg = default_group()?;
    /// // Ranks 0 and 1 get Some(group); every other rank gets None.
    /// if let Some(pair) = pg.new_group(&[1, 0], Backend::Gloo)? {
    ///     assert_eq!(pair.global_ranks(), &[0, 1]);
    /// }
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn new_group(&self, ranks: &[usize], backend: Backend) -> Result<Option<ProcessGroup>> {
        self.new_group_with(ranks, &GroupOptions::new(backend))
    }

    /// [`new_group`](Self::new_group) with options: with
    /// [`GroupOptions::use_local_synchronization`] only the members call it (PyTorch's
    /// `new_group(ranks, use_local_synchronization=True)`; the others must not).
    ///
    /// ```no_run
    /// use tch_dist_runtime::{default_group, Backend, GroupOptions};
    /// let pg = default_group()?;
    /// if pg.rank() < 2 {
    ///     let opts = GroupOptions::new(Backend::Gloo).with_local_synchronization();
    ///     let pair = pg.new_group_with(&[0, 1], &opts)?.expect("a member");
    /// }
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn new_group_with(
        &self,
        ranks: &[usize],
        opts: &GroupOptions,
    ) -> Result<Option<ProcessGroup>> {
        let invalid = |problem: ArgumentError| DistError::InvalidArgument {
            rank: self.rank(),
            op: "new_group",
            problem: Box::new(problem),
        };
        self.check_open("new_group")?;
        if ranks.is_empty() {
            return Err(invalid(ArgumentError::EmptyRankList));
        }
        let mut seen = vec![false; self.world_size()];
        for &r in ranks {
            if r >= self.world_size() {
                return Err(invalid(ArgumentError::RankNotInGroup {
                    what: "rank",
                    rank: r,
                    world_size: self.world_size(),
                }));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(invalid(ArgumentError::DuplicateRank { rank: r }));
            }
        }
        let mut ranks = ranks.to_vec();
        ranks.sort_unstable();
        let global: Vec<usize> = ranks.iter().map(|&r| self.inner.global_ranks[r]).collect();
        let sub_rank = ranks.iter().position(|&r| r == self.rank());
        let local = opts.use_local_synchronization;
        if local && sub_rank.is_none() {
            return Ok(None);
        }
        let world = &self.inner.world;
        let name = if local {
            rendezvous::hashed_group_name(&global, world.live_groups.load(Ordering::SeqCst))
        } else {
            world.group_count.fetch_add(1, Ordering::SeqCst).to_string()
        };
        let deadline = Deadline::after(self.inner.timeout);
        let (addr, port) = self.inner.master.clone();
        let rendezvous = |problem: RendezvousError| DistError::Rendezvous {
            rank: self.rank(),
            addr: addr.clone(),
            port,
            problem: Box::new(problem),
        };
        let engine = |cause: String| rendezvous(RendezvousError::Engine { cause });
        // PyTorch's barrier of new_group: over the default store and every rank that calls
        // new_group, or over the group's own store and its members.
        let barrier = |store: &Store, world_size: usize| {
            if world.init_barrier {
                rendezvous::store_barrier(store, &name, world_size, deadline).map_err(rendezvous)
            } else {
                Ok(())
            }
        };
        let Some(sub_rank) = sub_rank else {
            barrier(&world.default_store, self.world_size())?;
            return Ok(None);
        };
        let store = world
            .default_store
            .prefixed(&format!("{name}/"))
            .map_err(|e| engine(e.to_string()))?;
        rendezvous::join(&world.root, &name, sub_rank).map_err(rendezvous)?;
        let gloo_host = if is_loopback(&addr) { "127.0.0.1" } else { "" };
        let handle = new_group_handle(
            &store,
            &name,
            sub_rank,
            ranks.len(),
            GroupTimes {
                timeout: self.inner.timeout,
                rendezvous: deadline.left(),
            },
            gloo_host,
            opts.backend,
            self.inner.device,
            self.inner.cuda_via_gloo,
            self.inner.debug,
        )
        .map_err(|cause| {
            rendezvous(
                rendezvous::never_joined(
                    &world.root,
                    &store,
                    &name,
                    ranks.len(),
                    self.inner.timeout,
                )
                .map(|e| match e {
                    // The subgroup's ranks, named as the caller named them.
                    RendezvousError::NeverJoined {
                        ranks: missing,
                        timeout,
                        ..
                    } => RendezvousError::NeverJoined {
                        ranks: missing.iter().map(|&r| ranks[r]).collect(),
                        timeout,
                        refused: Vec::new(),
                    },
                    e => e,
                })
                .unwrap_or(RendezvousError::Engine { cause }),
            )
        })?;
        detail_with_foreign_ranks(&handle, &world.root, &name, ranks.len(), self.inner.debug)
            .map_err(engine)?;
        world.live_groups.fetch_add(1, Ordering::SeqCst);
        let inner = Arc::new(GroupInner::new(
            handle,
            world.clone(),
            Shape {
                name: name.clone(),
                rank: sub_rank,
                world_size: ranks.len(),
                backend: opts.backend,
                timeout: self.inner.timeout,
                global_ranks: global,
                master: self.inner.master.clone(),
                device: self.inner.device,
                shortcuts: self.inner.shortcuts,
                cuda_via_gloo: self.inner.cuda_via_gloo,
                debug: self.inner.debug,
            },
        ));
        {
            let mut children = self
                .inner
                .children
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            children.retain(|c| c.strong_count() > 0);
            children.push(Arc::downgrade(&inner));
        }
        if local {
            barrier(&store, ranks.len())?;
        } else {
            barrier(&world.default_store, self.world_size())?;
        }
        Ok(Some(ProcessGroup { inner }))
    }

    /// PyTorch's name of this group (`_get_process_group_name`): "0" for the default group,
    /// then the group count ("1", "2", ...) or, for `use_local_synchronization` groups, a
    /// hash of the ranks. Its backends' store prefixes are made from it.
    pub fn group_name(&self) -> &str {
        &self.inner.name
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of processes in the group.
    pub fn world_size(&self) -> usize {
        self.inner.world_size
    }

    /// The device backend the group was created with.
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// The timeout of every collective of this group.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The default group's rank of each rank of this group.
    pub fn global_ranks(&self) -> &[usize] {
        &self.inner.global_ranks
    }

    /// The rendezvous store (shared by all groups created from the same rendezvous).
    pub fn store(&self) -> &Store {
        &self.inner.world.root
    }

    /// The CUDA device this group is bound to (PyTorch's `bound_device_id`): NCCL groups,
    /// and groups with the test switch `cuda_via_gloo` on a machine with CUDA.
    pub fn bound_device(&self) -> Option<Device> {
        self.inner.device.map(Device::Cuda)
    }

    /// Whether this group may skip communicating because it has one rank: true for a group
    /// of one unless it was created without shortcuts ([`InitOptions::shortcuts`], the test
    /// switch `TCH_DIST_NO_SHORTCUTS=1`). Where the gradient reducer and `replicate` decide
    /// to communicate nothing; collectives called directly always run.
    pub fn skips_communication(&self) -> bool {
        self.inner.world_size == 1 && self.inner.shortcuts
    }

    /// The checks this group makes before each collective ([`InitOptions::debug`]).
    pub fn debug_level(&self) -> DebugLevel {
        self.inner.debug
    }

    /// Whether CUDA tensors go through Gloo (the test switch [`InitOptions::cuda_via_gloo`]).
    pub fn cuda_via_gloo(&self) -> bool {
        self.inner.cuda_via_gloo
    }

    /// How many collectives and point-to-point transfers were launched on this group so far
    /// (through any clone of it; barriers included, monitored barriers not).
    pub fn launched_collectives(&self) -> u64 {
        self.inner.launched.load(Ordering::Relaxed)
    }

    /// Shuts the group's backends down now, even while clones of it are alive (the
    /// reducer's, a sharded tensor's), with the subgroups created from it: NCCL's
    /// communicators are flushed and destroyed, Gloo is released once its queued work is
    /// done. Every later operation on this group, through any clone, fails with
    /// [`DistError::ShutDown`]; works already launched may still be waited on. Call it (or
    /// [`destroy_process_group`]) before the process exits: NCCL's threads must not outlive
    /// CUDA's teardown. Idempotent.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let clone = pg.clone();
    /// pg.shutdown();
    /// let t = tch::Tensor::from_slice(&[1.0f32]);
    /// assert!(matches!(
    ///     clone.all_reduce(&t, tch_dist_runtime::ReduceOp::Sum),
    ///     Err(tch_dist_runtime::DistError::ShutDown { .. })
    /// ));
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn shutdown(&self) {
        self.inner.shutdown();
        tch_dist_core::trace::flush();
    }

    /// Whether [`shutdown`](Self::shutdown) was called on this group (or on the group it was
    /// created from).
    pub fn is_shut_down(&self) -> bool {
        self.inner.shut_down.load(Ordering::SeqCst)
    }

    /// `Err(ShutDown)` once the group was shut down.
    pub(crate) fn check_open(&self, op: &'static str) -> Result<()> {
        if self.is_shut_down() {
            return Err(DistError::ShutDown {
                rank: self.rank(),
                op,
            });
        }
        Ok(())
    }

    /// Counts a launched collective.
    pub(crate) fn note_launch(&self) {
        self.inner.launched.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether CUDA tensors go through an NCCL backend.
    fn uses_nccl(&self) -> bool {
        self.inner.backend.has_nccl() && !self.inner.cuda_via_gloo
    }

    pub(crate) fn raw(&self) -> *mut ffi::TdrGroup {
        self.inner.handle.0.as_ptr()
    }
}

/// DETAIL in a job with ranks that wrote no join key (PyTorch's): the group makes c10d's
/// checks only, which those ranks make too (see docs/ARCHITECTURE.md, "Rendezvous and
/// naming").
fn detail_with_foreign_ranks(
    handle: &GroupHandle,
    root: &Store,
    name: &str,
    world_size: usize,
    debug: DebugLevel,
) -> std::result::Result<(), String> {
    if debug != DebugLevel::Detail || !rendezvous::has_foreign_ranks(root, name, world_size) {
        return Ok(());
    }
    // SAFETY: live group handle; the shim catches every exception.
    shim!(tdr_group_set_foreign_peers(handle.0.as_ptr(), true)).map_err(|e| e.message)
}

/// A new group's limits: its collectives' timeout, and what is left for its rendezvous.
struct GroupTimes {
    timeout: Duration,
    rendezvous: Duration,
}

#[allow(clippy::too_many_arguments)]
fn new_group_handle(
    store: &Store,
    name: &str,
    rank: usize,
    world_size: usize,
    times: GroupTimes,
    gloo_host: &str,
    backend: Backend,
    device: Option<usize>,
    cuda_via_gloo: bool,
    debug: DebugLevel,
) -> std::result::Result<GroupHandle, String> {
    let host = CString::new(gloo_host).map_err(|_| "host contains a NUL byte".to_string())?;
    let name = CString::new(name).map_err(|_| "group name contains a NUL byte".to_string())?;
    let mut out = std::ptr::null_mut();
    // SAFETY: live store, valid C strings and out-pointer; exceptions are caught in the shim.
    shim!(tdr_group_new(
        store.raw(),
        name.as_ptr(),
        rank as i32,
        world_size as i32,
        millis(times.timeout),
        millis(times.rendezvous).max(1),
        host.as_ptr(),
        backend.has_gloo(),
        backend.has_nccl(),
        device.map_or(-1, |d| d as i32),
        cuda_via_gloo,
        debug == DebugLevel::Detail,
        &mut out,
    ))?;
    NonNull::new(out)
        .map(GroupHandle)
        .ok_or_else(|| "the engine returned no group".to_string())
}

static DEFAULT_GROUP: Mutex<Option<ProcessGroup>> = Mutex::new(None);

fn default_slot() -> std::sync::MutexGuard<'static, Option<ProcessGroup>> {
    // A panic while holding this lock cannot leave the Option half-written.
    DEFAULT_GROUP.lock().unwrap_or_else(|e| e.into_inner())
}

/// Creates the default process group from the launch environment (torchrun's RANK,
/// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, else Slurm's) and returns it.
///
/// `backend` is a [`Backend`] or one of PyTorch's strings (`"gloo"`, `"nccl"`,
/// `"cpu:gloo,cuda:nccl"`; another string is [`DistError::UnknownBackend`]). The group is
/// PyTorch 2.11's default group, store keys and handshake included, so PyTorch ranks that call
/// `torch.distributed.init_process_group` with the same string and variables join it.
///
/// With `Backend::Nccl` the group binds CUDA device LOCAL_RANK (PyTorch's
/// `torch.cuda.set_device(local_rank)` plus `device_id`): it becomes this thread's current
/// device, NCCL's bound device and [`ProcessGroup::bound_device`]. For an explicit device,
/// eager connection or the test switches, use [`init_process_group_with`] with
/// [`InitOptions::from_env`] and its builders.
///
/// ```no_run
/// let pg = tch_dist_runtime::init_process_group(tch_dist_runtime::Backend::Gloo)?;
/// println!("rank {} of {}", pg.rank(), pg.world_size());
/// # tch_dist_runtime::destroy_process_group();
/// let pg = tch_dist_runtime::init_process_group("gloo")?; // as torch.distributed
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn init_process_group<B>(backend: B) -> Result<ProcessGroup>
where
    B: TryInto<Backend>,
    DistError: From<B::Error>,
{
    init_process_group_with(&InitOptions::from_env(backend.try_into()?)?)
}

/// `TORCHELASTIC_USE_AGENT_STORE` as PyTorch reads it: exactly `True`.
pub(crate) fn read_agent_store(get: impl Fn(&str) -> Option<String>) -> bool {
    get(USE_AGENT_STORE_ENV).as_deref() == Some("True")
}

/// `TORCH_DIST_INIT_BARRIER` as PyTorch reads it (`int(value) == 1`, unset: 0); a value
/// that is not an integer is an error naming the variable.
pub(crate) fn read_init_barrier(get: impl Fn(&str) -> Option<String>) -> Result<bool> {
    let Some(value) = get(INIT_BARRIER_ENV) else {
        return Ok(false);
    };
    match value.trim().parse::<i64>() {
        Ok(n) => Ok(n == 1),
        Err(_) => Err(EnvError::NotAnInteger {
            var: INIT_BARRIER_ENV,
            value,
        }
        .into()),
    }
}

/// Creates the default process group from explicit options.
pub fn init_process_group_with(opts: &InitOptions) -> Result<ProcessGroup> {
    if default_slot().is_some() {
        return Err(DistError::AlreadyInitialized);
    }
    let pg = ProcessGroup::new(opts)?;
    let mut slot = default_slot();
    if slot.is_some() {
        return Err(DistError::AlreadyInitialized);
    }
    *slot = Some(pg.clone());
    Ok(pg)
}

/// The default process group.
pub fn default_group() -> Result<ProcessGroup> {
    default_slot().clone().ok_or(DistError::NotInitialized)
}

/// Whether a default process group exists.
pub fn is_initialized() -> bool {
    default_slot().is_some()
}

/// Shuts the default group down (see [`ProcessGroup::shutdown`]: even while clones of it
/// are alive, with every subgroup created from it) and forgets it, so that
/// `init_process_group` may be called again. Call it before the process exits.
pub fn destroy_process_group() {
    let group = default_slot().take();
    if let Some(pg) = group {
        pg.shutdown();
    }
}

/// With `TCH_DIST_TRACE`, the trace's last events are written when the process exits
/// (registered once, by the first group a process creates).
fn flush_trace_at_exit() {
    extern "C" fn flush_at_exit() {
        // Nothing may unwind out of an atexit handler.
        let _ = std::panic::catch_unwind(tch_dist_core::trace::flush);
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    if tch_dist_core::trace::enabled() {
        ONCE.call_once(|| {
            // SAFETY: registers a handler that takes no arguments and catches every panic;
            // atexit only fails when its table is full, and then the trace keeps what the
            // last periodic write put there.
            unsafe { libc::atexit(flush_at_exit) };
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_strings_are_pytorchs() {
        for (text, backend) in [
            ("gloo", Backend::Gloo),
            ("GLOO", Backend::Gloo),
            ("nccl", Backend::NcclOnly),
            ("cpu:gloo,cuda:nccl", Backend::Nccl),
            ("cuda:nccl, cpu:gloo", Backend::Nccl),
            ("cpu:gloo", Backend::Gloo),
            ("cuda:nccl", Backend::NcclOnly),
        ] {
            assert_eq!(Backend::parse(text).unwrap(), backend, "{text}");
        }
        for b in [Backend::Gloo, Backend::Nccl, Backend::NcclOnly] {
            assert_eq!(Backend::parse(b.as_str()).unwrap(), b);
        }
        for bad in [
            "",
            "mpi",
            "cpu:nccl",
            "cpu:gloo,cpu:gloo",
            "gloo,nccl",
            "cuda:gloo",
        ] {
            assert_eq!(
                Backend::parse(bad).unwrap_err(),
                DistError::UnknownBackend {
                    value: bad.to_string()
                },
                "{bad}"
            );
        }
        assert_eq!(
            Backend::parse("ucc").unwrap_err().to_string(),
            "unknown backend \"ucc\": expected \"gloo\", \"nccl\" or \"cpu:gloo,cuda:nccl\""
        );
        // init_process_group's argument: a Backend or a string.
        fn takes<B: TryInto<Backend>>(b: B) -> Result<Backend>
        where
            DistError: From<B::Error>,
        {
            Ok(b.try_into()?)
        }
        assert_eq!(takes(Backend::Gloo).unwrap(), Backend::Gloo);
        assert_eq!(takes("nccl").unwrap(), Backend::NcclOnly);
        assert!(takes(String::from("bogus")).is_err());
    }

    #[test]
    fn pytorchs_switches() {
        let one = |k: &'static str, v: &'static str| move |q: &str| (q == k).then(|| v.to_string());
        assert!(read_agent_store(one(USE_AGENT_STORE_ENV, "True")));
        // PyTorch compares with str(True) exactly.
        assert!(!read_agent_store(one(USE_AGENT_STORE_ENV, "true")));
        assert!(!read_agent_store(|_| None));
        assert!(read_init_barrier(one(INIT_BARRIER_ENV, " 1 ")).unwrap());
        assert!(!read_init_barrier(one(INIT_BARRIER_ENV, "0")).unwrap());
        assert!(!read_init_barrier(one(INIT_BARRIER_ENV, "2")).unwrap());
        assert!(!read_init_barrier(|_| None).unwrap());
        assert_eq!(
            read_init_barrier(one(INIT_BARRIER_ENV, "yes")).unwrap_err(),
            DistError::Env(EnvError::NotAnInteger {
                var: INIT_BARRIER_ENV,
                value: "yes".into()
            })
        );
    }
}
