//! Process groups: rendezvous through c10d's TCPStore, Gloo for CPU tensors, NCCL for CUDA
//! tensors, and a process-wide default group like `torch.distributed`'s.
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `mod.rs` | [`ProcessGroup`]: the shim's group handle, what the groups of one rendezvous share, the accessors, shutdown | `ProcessGroup.hpp`, `distributed_c10d.py`'s `_World`, `destroy_process_group(group)` |
//! | `backend.rs` | [`Backend`]: PyTorch's backend strings, default timeouts | `distributed_c10d.py`'s `Backend` |
//! | `options.rs` | [`InitOptions`], [`GroupOptions`], the environment switches they read | `init_process_group`'s and `new_group`'s arguments |
//! | `init.rs` | creating the default group and subgroups, step by step; the backends' creation | `init_process_group`, `_new_process_group_helper`, `new_group` |
//! | `default.rs` | the default group: [`init_process_group`], [`default_group`], [`destroy_process_group`] | `_world.default_pg` |
//! | `quorum.rs` | a fault-tolerance quorum's group of replica groups, over one of their stores: [`ProcessGroup::for_quorum`] | torchft's `ProcessGroupGloo._create_pg` |

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use tch::Device;

use crate::c10d::departures::WatchStore;
use crate::c10d::env::DebugLevel;
use crate::c10d::heartbeat::{Heartbeat, Liveness};
use crate::c10d::step_check::{CallMirror, Lane};
use crate::c10d::store::Store;
use crate::error::{DistError, Result};
use crate::ffi;

mod backend;
mod default;
mod init;
mod options;
mod quorum;

pub use backend::Backend;
pub use default::{
    default_group, destroy_process_group, init_process_group, init_process_group_with,
    is_initialized,
};
pub use options::{
    GroupOptions, InitOptions, CUDA_VIA_GLOO_ENV, HEARTBEAT_TIMEOUT_ENV, INIT_BARRIER_ENV,
    NO_SHORTCUTS_ENV, USE_AGENT_STORE_ENV,
};
pub use quorum::QuorumGroupOptions;

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
    /// The departures watch's own connection to the store (`departures.rs`).
    watch: WatchStore,
    /// What the watches have seen of the members' heartbeats (`heartbeat.rs`).
    liveness: Liveness,
    /// This rank's heartbeat, stopped with the last group of the rendezvous; none for a
    /// quorum's group, whose store is another job's (its members' liveness is the
    /// lighthouse's business, and their global ranks would name that job's ranks).
    _heartbeat: Option<Heartbeat>,
    /// What the departures watch may read in the store (see [`Membership`]).
    membership: Membership,
}

/// Whose store a rendezvous used, which decides what the departures watch reads there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Membership {
    /// The job's own store: failures the members reported, exits their launchers
    /// reported, and their heartbeats.
    Job,
    /// A quorum's group of replica groups (`quorum.rs`), over one of the replica groups'
    /// stores: nothing. That job's exits and heartbeats are keyed by its own global ranks,
    /// not this group's, and the store goes with the member that hosts it (a watch would
    /// only wait out connect timeouts there); fault tolerance learns of a failed member
    /// from the average itself (its flag) or from the group's short timeout.
    Quorum,
}

/// A group's state: its handle, its [`Shape`] (read through `Deref`: `inner.rank`), and
/// what changes while it lives.
struct GroupInner {
    handle: GroupHandle,
    world: Arc<World>,
    shape: Shape,
    /// Set by `shutdown`: every later operation fails with `DistError::ShutDown`.
    shut_down: AtomicBool,
    /// Collectives and transfers launched so far.
    launched: AtomicU64,
    /// Collectives launched so far (transfers not: they differ by rank).
    collectives: AtomicU64,
    /// Where that count is mirrored for the peers, once the step check goes through shared
    /// memory (`step_check/shared.rs`).
    call_mirror: OnceLock<CallMirror>,
    /// The subgroups created from this group, shut down with it.
    children: Mutex<Vec<Weak<GroupInner>>>,
    /// Set once this rank stopped taking part in the group's collectives after a failure
    /// (`ProcessGroup::stop_after_failure`): the failure, which every later operation names.
    stopped: Mutex<Option<String>>,
    /// Exchanges through the store made over this group (`exchange.rs`): the next one's
    /// number.
    exchanges: AtomicU64,
    /// Which way this group's step-check headers travel (`step_check/lane.rs`).
    step_check_lane: Mutex<Lane>,
}

impl std::ops::Deref for GroupInner {
    type Target = Shape;

    fn deref(&self) -> &Shape {
        &self.shape
    }
}

/// What a group is, fixed when it is made.
struct Shape {
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
}

impl GroupInner {
    fn new(handle: GroupHandle, world: Arc<World>, shape: Shape) -> GroupInner {
        GroupInner {
            handle,
            world,
            shape,
            shut_down: AtomicBool::new(false),
            launched: AtomicU64::new(0),
            collectives: AtomicU64::new(0),
            call_mirror: OnceLock::new(),
            children: Mutex::new(Vec::new()),
            stopped: Mutex::new(None),
            exchanges: AtomicU64::new(0),
            step_check_lane: Mutex::new(Lane::default()),
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
            let _ = ffi::check(unsafe { ffi::tdr_group_shutdown(self.handle.0.as_ptr()) });
        }
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

    /// Where this group's store listens (MASTER_ADDR and MASTER_PORT for a job's groups):
    /// what other jobs reach it at, as fault tolerance's replica groups do each other's.
    ///
    /// ```no_run
    /// let pg = tch_dist_runtime::default_group()?;
    /// let (host, port) = pg.store_address();
    /// println!("{host}:{port}");
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn store_address(&self) -> (&str, u16) {
        (&self.inner.master.0, self.inner.master.1)
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
        if let Some(cause) = &*self.inner.stopped.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(DistError::GroupStopped {
                rank: self.rank(),
                op,
                cause: cause.clone(),
            });
        }
        Ok(())
    }

    /// What the departures watch may read in the group's store.
    pub(crate) fn membership(&self) -> Membership {
        self.inner.world.membership
    }

    /// The departures watch's connection to the store.
    pub(crate) fn watch_store(&self) -> &WatchStore {
        &self.inner.world.watch
    }

    /// What this process's watches have seen of the members' heartbeats.
    pub(crate) fn liveness(&self) -> &Liveness {
        &self.inner.world.liveness
    }

    /// The counter of this group's exchanges through the store.
    pub(crate) fn exchanges(&self) -> &AtomicU64 {
        &self.inner.exchanges
    }

    /// Which way this group's step-check headers travel; held for the whole of a check.
    pub(crate) fn step_check_lane(&self) -> MutexGuard<'_, Lane> {
        self.inner
            .step_check_lane
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `cause` as the failure after which this rank takes no part in the group's
    /// collectives; false when one was kept before (it stays).
    pub(crate) fn keep_stop(&self, cause: &str) -> bool {
        let mut stopped = self.inner.stopped.lock().unwrap_or_else(|e| e.into_inner());
        if stopped.is_some() {
            return false;
        }
        *stopped = Some(cause.to_string());
        true
    }

    /// Counts a launched collective or transfer (`op`).
    pub(crate) fn note_launch(&self, op: &'static str) {
        self.inner.launched.fetch_add(1, Ordering::Relaxed);
        if matches!(op, "send" | "recv") {
            return;
        }
        let count = self.inner.collectives.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(mirror) = self.inner.call_mirror.get() {
            mirror.store(count, op);
        }
    }

    /// How many collectives (transfers not) this rank launched on the group so far.
    pub(crate) fn collectives_launched(&self) -> u64 {
        self.inner.collectives.load(Ordering::Relaxed)
    }

    /// Mirrors this rank's count of collectives through `mirror` from now on (the first
    /// mirror only: a group's segment is mapped once).
    pub(crate) fn mirror_collectives(&self, mirror: CallMirror) {
        let mirror = self.inner.call_mirror.get_or_init(|| mirror);
        mirror.store(self.collectives_launched(), "");
    }

    /// Whether CUDA tensors go through an NCCL backend.
    fn uses_nccl(&self) -> bool {
        self.inner.backend.has_nccl() && !self.inner.cuda_via_gloo
    }

    pub(crate) fn raw(&self) -> *mut ffi::TdrGroup {
        self.inner.handle.0.as_ptr()
    }
}
