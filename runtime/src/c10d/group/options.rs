//! What a group is created with: [`InitOptions`] (`init_process_group`'s arguments and the
//! launch environment), [`GroupOptions`] (`new_group`'s), and the switches both read.

use std::time::Duration;

use crate::c10d::env::{read_switch, DebugLevel, LaunchEnv};
use crate::c10d::heartbeat::DEFAULT_HEARTBEAT_TIMEOUT;
use crate::error::{EnvError, Result};

use super::Backend;

/// Test switch: `TCH_DIST_NO_SHORTCUTS=1` turns off the shortcuts of a group of one (see
/// [`InitOptions::shortcuts`]).
pub const NO_SHORTCUTS_ENV: &str = "TCH_DIST_NO_SHORTCUTS";

/// Test switch: `TCH_DIST_CUDA_VIA_GLOO=1` routes CUDA tensors through Gloo (see
/// [`InitOptions::cuda_via_gloo`]).
pub const CUDA_VIA_GLOO_ENV: &str = "TCH_DIST_CUDA_VIA_GLOO";

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
/// device, and [`ProcessGroup::bound_device`](crate::ProcessGroup::bound_device) reports it.
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
    /// How long a member's heartbeat may stand still, or the store stay out of reach,
    /// before a wait calls it lost (`TCH_DIST_HEARTBEAT_TIMEOUT_SECS`; default
    /// [`DEFAULT_HEARTBEAT_TIMEOUT`], 60 s; see `heartbeat.rs`).
    pub heartbeat_timeout: Duration,
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
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
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
        if let Some(timeout) = read_seconds("TCH_DIST_TIMEOUT_SECS")? {
            opts.timeout = timeout;
        }
        if let Some(timeout) = read_seconds(HEARTBEAT_TIMEOUT_ENV)? {
            opts.heartbeat_timeout = timeout;
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

/// How [`ProcessGroup::new_group_with`](crate::ProcessGroup::new_group_with) creates a subgroup.
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

/// The variable that sets [`InitOptions::heartbeat_timeout`] (seconds).
pub const HEARTBEAT_TIMEOUT_ENV: &str = "TCH_DIST_HEARTBEAT_TIMEOUT_SECS";

/// A positive number of seconds from `var`, if it is set.
fn read_seconds(var: &'static str) -> Result<Option<Duration>> {
    let Ok(value) = std::env::var(var) else {
        return Ok(None);
    };
    let secs = value
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0);
    match secs {
        Some(secs) => Ok(Some(Duration::from_secs_f64(secs))),
        None => Err(EnvError::BadTimeout { var, value }.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::DistError;

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
