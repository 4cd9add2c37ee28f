//! Process groups: rendezvous through c10d's TCPStore, Gloo for CPU tensors, NCCL for CUDA
//! tensors, and a process-wide default group like `torch.distributed`'s.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::env::{is_loopback, LaunchEnv, DEFAULT_TIMEOUT};
use crate::error::{ArgumentError, DistError, EnvError, Result};
use crate::ffi::{self, shim};
use crate::store::{millis, Store};

/// Which c10d backend carries device tensors.
///
/// Every group has a Gloo backend, which carries CPU tensors and control traffic (barriers,
/// metadata checks). `Nccl` adds ProcessGroupNCCL for CUDA tensors; a CPU-only machine
/// simply never asks for it, so one binary serves both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Gloo only: CPU tensors.
    Gloo,
    /// NCCL for CUDA tensors, with Gloo beside it for CPU tensors.
    Nccl,
}

impl Backend {
    /// `Nccl` when CUDA is available, else `Gloo` (PyTorch's usual choice).
    pub fn default_for_machine() -> Backend {
        if tch::Cuda::is_available() {
            Backend::Nccl
        } else {
            Backend::Gloo
        }
    }

    /// Whether this build of tch-dist can create NCCL groups.
    pub fn nccl_compiled() -> bool {
        // SAFETY: a constant query without arguments.
        unsafe { ffi::tdr_nccl_compiled() }
    }
}

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitOptions {
    /// The device backend.
    pub backend: Backend,
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rendezvous host (rank 0 hosts the TCPStore there).
    pub master_addr: String,
    /// Rendezvous port.
    pub master_port: u16,
    /// Limit for the rendezvous and for every collective (default 30 minutes, as PyTorch).
    pub timeout: Duration,
}

impl InitOptions {
    /// Options with PyTorch's default timeout.
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
            master_addr: master_addr.into(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Options from the launch environment (torchrun's or Slurm's variables).
    pub fn from_env(backend: Backend) -> Result<Self> {
        let env = LaunchEnv::from_process_env()?;
        let mut opts = Self::new(
            backend,
            env.rank,
            env.world_size,
            env.master_addr,
            env.master_port,
        );
        if let Ok(t) = std::env::var("TCH_DIST_TIMEOUT_SECS") {
            let secs = t
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0);
            let secs = secs.ok_or_else(|| EnvError::BadTimeout { value: t.clone() })?;
            opts.timeout = Duration::from_secs_f64(secs);
        }
        Ok(opts)
    }

    /// Replaces the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
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

struct GroupInner {
    handle: GroupHandle,
    store: Store,
    rank: usize,
    world_size: usize,
    backend: Backend,
    timeout: Duration,
    global_ranks: Vec<usize>,
    /// Counts `new_group` calls so every subgroup gets its own store prefix.
    subgroups: AtomicUsize,
    master: (String, u16),
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("backend", &self.backend())
            .field("global_ranks", &self.inner.global_ranks)
            .finish()
    }
}

impl ProcessGroup {
    /// Creates a group explicitly: rank 0 hosts the TCPStore at `master_addr:master_port`,
    /// every rank connects to it, then the backends connect to each other.
    pub fn new(opts: &InitOptions) -> Result<ProcessGroup> {
        let rendezvous = |cause: String| DistError::Rendezvous {
            rank: opts.rank,
            addr: opts.master_addr.clone(),
            port: opts.master_port,
            cause,
        };
        if opts.world_size == 0 || opts.rank >= opts.world_size {
            return Err(EnvError::RankOutOfRange {
                rank_var: "rank",
                rank: opts.rank,
                world_var: "world_size",
                world_size: opts.world_size,
            }
            .into());
        }
        if opts.backend == Backend::Nccl && !Backend::nccl_compiled() {
            return Err(EnvError::NcclNotCompiled.into());
        }
        let store = Store::tcp(
            &opts.master_addr,
            opts.master_port,
            opts.rank == 0,
            opts.world_size,
            opts.timeout,
        )
        .map_err(rendezvous)?;
        let group_store = store
            .prefixed("default_pg/")
            .map_err(|e| rendezvous(e.to_string()))?;
        let gloo_host = if is_loopback(&opts.master_addr) {
            "127.0.0.1"
        } else {
            ""
        };
        let handle = new_group_handle(
            &group_store,
            opts.rank,
            opts.world_size,
            opts.timeout,
            gloo_host,
            opts.backend,
        )
        .map_err(rendezvous)?;
        Ok(ProcessGroup {
            inner: Arc::new(GroupInner {
                handle,
                store,
                rank: opts.rank,
                world_size: opts.world_size,
                backend: opts.backend,
                timeout: opts.timeout,
                global_ranks: (0..opts.world_size).collect(),
                subgroups: AtomicUsize::new(0),
                master: (opts.master_addr.clone(), opts.master_port),
            }),
        })
    }

    /// Creates a group from torchrun's (or Slurm's) variables.
    pub fn from_env(backend: Backend) -> Result<ProcessGroup> {
        Self::new(&InitOptions::from_env(backend)?)
    }

    /// Creates a subgroup of this group's `ranks` (like `torch.distributed.new_group`).
    ///
    /// Every rank of this group must call it, in the same order relative to other
    /// `new_group` calls; members get `Some(group)`, the others `None`.
    pub fn new_group(&self, ranks: &[usize], backend: Backend) -> Result<Option<ProcessGroup>> {
        let invalid = |problem: ArgumentError| DistError::InvalidArgument {
            rank: self.rank(),
            op: "new_group",
            problem: Box::new(problem),
        };
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
        let n = self.inner.subgroups.fetch_add(1, Ordering::SeqCst);
        let Some(sub_rank) = ranks.iter().position(|&r| r == self.rank()) else {
            return Ok(None);
        };
        let (addr, port) = self.inner.master.clone();
        let rendezvous = |cause: String| DistError::Rendezvous {
            rank: self.rank(),
            addr: addr.clone(),
            port,
            cause,
        };
        let key: Vec<String> = ranks.iter().map(usize::to_string).collect();
        let prefix = format!("{}subgroup{n}[{}]/", self.store_prefix(), key.join(","));
        let store = self
            .inner
            .store
            .prefixed(&prefix)
            .map_err(|e| rendezvous(e.to_string()))?;
        let gloo_host = if is_loopback(&addr) { "127.0.0.1" } else { "" };
        let handle = new_group_handle(
            &store,
            sub_rank,
            ranks.len(),
            self.inner.timeout,
            gloo_host,
            backend,
        )
        .map_err(rendezvous)?;
        Ok(Some(ProcessGroup {
            inner: Arc::new(GroupInner {
                handle,
                store: self.inner.store.clone(),
                rank: sub_rank,
                world_size: ranks.len(),
                backend,
                timeout: self.inner.timeout,
                global_ranks: ranks.iter().map(|&r| self.inner.global_ranks[r]).collect(),
                subgroups: AtomicUsize::new(0),
                master: self.inner.master.clone(),
            }),
        }))
    }

    fn store_prefix(&self) -> String {
        let g: Vec<String> = self
            .inner
            .global_ranks
            .iter()
            .map(usize::to_string)
            .collect();
        format!("g[{}]/", g.join(","))
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
        &self.inner.store
    }

    pub(crate) fn raw(&self) -> *mut ffi::TdrGroup {
        self.inner.handle.0.as_ptr()
    }
}

fn new_group_handle(
    store: &Store,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    gloo_host: &str,
    backend: Backend,
) -> std::result::Result<GroupHandle, String> {
    let host = CString::new(gloo_host).map_err(|_| "host contains a NUL byte".to_string())?;
    let mut out = std::ptr::null_mut();
    // SAFETY: live store, valid C string and out-pointer; exceptions are caught in the shim.
    shim!(tdr_group_new(
        store.raw(),
        rank as i32,
        world_size as i32,
        millis(timeout),
        host.as_ptr(),
        backend == Backend::Nccl,
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
/// WORLD_SIZE, MASTER_ADDR, MASTER_PORT, else Slurm's) and returns it.
///
/// ```no_run
/// let pg = tch_dist_runtime::init_process_group(tch_dist_runtime::Backend::Gloo)?;
/// println!("rank {} of {}", pg.rank(), pg.world_size());
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn init_process_group(backend: Backend) -> Result<ProcessGroup> {
    init_process_group_with(&InitOptions::from_env(backend)?)
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

/// Forgets the default group; it is torn down once no clone of it is left.
pub fn destroy_process_group() {
    default_slot().take();
}
