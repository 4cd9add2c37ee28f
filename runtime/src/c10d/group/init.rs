//! Creating groups: [`ProcessGroup::new`] (the default group's rendezvous and backends,
//! PyTorch's `init_process_group` minus the global slot) and [`ProcessGroup::new_group_with`]
//! (`new_group`), each a sequence of named steps, and the shim call that creates a group's
//! backends (`_new_process_group_helper`).

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::c10d::departures::WatchStore;
use crate::c10d::devices::DeviceClaim;
use crate::c10d::env::DebugLevel;
use crate::c10d::heartbeat::{Heartbeat, Liveness};
use crate::c10d::interface::gloo_host;
use crate::c10d::rendezvous::{self, Deadline};
use crate::c10d::store::{millis, Store};
use crate::error::{ArgumentError, DistError, EnvError, RendezvousError, Result};
use crate::ffi;

use super::{
    Backend, GroupHandle, GroupInner, GroupOptions, InitOptions, Membership, ProcessGroup, Shape,
    World,
};

/// PyTorch's name of the default group, the first number of its group count.
const DEFAULT_NAME: &str = "0";

impl ProcessGroup {
    /// Creates a group explicitly, with PyTorch 2.11's rendezvous: rank 0 hosts the TCPStore
    /// at `master_addr:master_port` (unless [`InitOptions::use_agent_store`]) and waits for
    /// every rank to check in, every rank connects to it, then the backends connect to each
    /// other under PyTorch's default group's prefixes (`default_pg/0//cpu//` for Gloo,
    /// `default_pg/0//cuda//` for NCCL), so that PyTorch ranks may be ranks of the same
    /// group (docs/design/rendezvous-and-interop.md).
    ///
    /// An NCCL group binds its CUDA device ([`InitOptions::cuda_device`]) before anything
    /// else, checks with every rank that no two ranks share a GPU (every rank fails with
    /// [`DistError::DuplicateDevice`] naming both, before NCCL would refuse them; with Gloo
    /// beside NCCL only), and, with `eager_connect`, creates NCCL's communicator.
    pub fn new(opts: &InitOptions) -> Result<ProcessGroup> {
        flush_trace_at_exit();
        let deadline = Deadline::after(opts.timeout);
        let at = Meeting {
            rank: opts.rank,
            addr: opts.master_addr.clone(),
            port: opts.master_port,
        };
        let device = checked_device(opts)?;
        // Every step below ends by the deadline: the host resolves, something listens (rank
        // 0's store, or the agent's), then the store client connects, the run id is
        // checked, every rank checks in (rank 0 waits for all), and the backends
        // rendezvous with what is left.
        let tcp = connect_store(opts, deadline, &at)?;
        let store = attempt_store(opts, &tcp, &at)?;
        let default_store = at.prefixed(&at.prefixed(&store, "default_pg")?, "0/")?;
        rendezvous::join(&store, DEFAULT_NAME, opts.rank).map_err(|p| at.failed(p))?;
        let missing = |cause: String| {
            at.failed(
                rendezvous::never_joined(
                    &store,
                    &default_store,
                    DEFAULT_NAME,
                    opts.world_size,
                    opts.timeout,
                )
                .unwrap_or(RendezvousError::Engine { cause }),
            )
        };
        // PyTorch's waitWorkers handshake: every rank checks in, the server waits for all;
        // then the backends connect. Both wait for the other ranks, watched for ranks whose
        // launcher reported their exit (they will never come).
        let everyone: Vec<usize> = (0..opts.world_size).collect();
        let watch = WatchStore::new((opts.master_addr.clone(), opts.master_port));
        let checking_in = tcp.clone();
        let left = deadline.left();
        rendezvous::watched(&watch, &everyone, opts.rank, move || {
            checking_in.check_in(left)
        })
        .map_err(|p| at.failed(p))?
        .map_err(missing)?;
        let backends = NewBackends {
            name: DEFAULT_NAME.to_string(),
            rank: opts.rank,
            world_size: opts.world_size,
            timeout: opts.timeout,
            rendezvous: deadline.left(),
            gloo_host: gloo_host(&opts.master_addr),
            backend: opts.backend,
            device,
            cuda_via_gloo: opts.cuda_via_gloo,
            debug: opts.debug,
            stores: BackendStores::PerDevice,
        };
        let connecting = default_store.clone();
        let handle = rendezvous::watched(&watch, &everyone, opts.rank, move || {
            backends.create(&connecting)
        })
        .map_err(|p| at.failed(p))?
        .map_err(missing)?;
        detail_with_foreign_ranks(&handle, &store, DEFAULT_NAME, opts.world_size, opts.debug)
            .map_err(|cause| at.engine(cause))?;
        rendezvous::all_connected(
            &store,
            &default_store,
            DEFAULT_NAME,
            opts.world_size,
            gloo_lazy_init(),
            deadline,
        )
        .map_err(|p| at.failed(p))?;
        if opts.init_barrier {
            // PyTorch's barrier of init_process_group: on PrefixStore("default_pg").
            let barrier_store = at.prefixed(&store, "default_pg")?;
            rendezvous::store_barrier(&barrier_store, DEFAULT_NAME, opts.world_size, deadline)
                .map_err(|p| at.failed(p))?;
        }
        let master = (opts.master_addr.clone(), opts.master_port);
        let world = Arc::new(World {
            watch: WatchStore::new(master.clone()),
            liveness: Liveness::new(opts.heartbeat_timeout),
            _heartbeat: Some(Heartbeat::start(master, opts.rank)),
            membership: Membership::Job,
            root: store,
            default_store,
            group_count: AtomicUsize::new(1),
            live_groups: AtomicUsize::new(1),
            init_barrier: opts.init_barrier,
        });
        let pg = ProcessGroup {
            inner: Arc::new(GroupInner::new(handle, world, default_shape(opts, device))),
        };
        pg.finish_nccl(opts, device, &at)?;
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
        self.check_open("new_group")?;
        let ranks = self.sorted_members(ranks)?;
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
        let at = Meeting {
            rank: self.rank(),
            addr,
            port,
        };
        // PyTorch's barrier of new_group: over the default store and every rank that calls
        // new_group, or over the group's own store and its members.
        let barrier = |store: &Store, world_size: usize| {
            if world.init_barrier {
                rendezvous::store_barrier(store, &name, world_size, deadline)
                    .map_err(|p| at.failed(p))
            } else {
                Ok(())
            }
        };
        let Some(sub_rank) = sub_rank else {
            barrier(&world.default_store, self.world_size())?;
            return Ok(None);
        };
        let store = at.prefixed(&world.default_store, &format!("{name}/"))?;
        rendezvous::join(&world.root, &name, sub_rank).map_err(|p| at.failed(p))?;
        let backends = NewBackends {
            name: name.clone(),
            rank: sub_rank,
            world_size: ranks.len(),
            timeout: self.inner.timeout,
            rendezvous: deadline.left(),
            gloo_host: gloo_host(&at.addr),
            backend: opts.backend,
            device: self.inner.device,
            cuda_via_gloo: self.inner.cuda_via_gloo,
            debug: self.inner.debug,
            stores: BackendStores::PerDevice,
        };
        let connecting = store.clone();
        // Watched for members whose launcher reported their exit (a group created on one
        // rank only while the others finished: they will never come).
        let handle = rendezvous::watched(&world.watch, &global, sub_rank, move || {
            backends.create(&connecting)
        })
        .map_err(|p| at.failed(p))?
        .map_err(|cause| {
            at.failed(
                subgroup_never_joined(world, &store, &name, &ranks, self.inner.timeout)
                    .unwrap_or(RendezvousError::Engine { cause }),
            )
        })?;
        detail_with_foreign_ranks(&handle, &world.root, &name, ranks.len(), self.inner.debug)
            .map_err(|cause| at.engine(cause))?;
        rendezvous::all_connected(
            &world.root,
            &store,
            &name,
            ranks.len(),
            gloo_lazy_init(),
            deadline,
        )
        .map_err(|p| at.failed(p))?;
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
        self.adopt(&inner);
        if local {
            barrier(&store, ranks.len())?;
        } else {
            barrier(&world.default_store, self.world_size())?;
        }
        Ok(Some(ProcessGroup { inner }))
    }

    /// `new_group`'s ranks, checked (in this group, each once, at least one) and sorted, as
    /// PyTorch sorts them.
    fn sorted_members(&self, ranks: &[usize]) -> Result<Vec<usize>> {
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
        let mut ranks = ranks.to_vec();
        ranks.sort_unstable();
        Ok(ranks)
    }

    /// Registers a new subgroup, to be shut down with this group.
    fn adopt(&self, child: &Arc<GroupInner>) {
        let mut children = self
            .inner
            .children
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        children.retain(|c| c.strong_count() > 0);
        children.push(Arc::downgrade(child));
    }

    /// An NCCL group's last steps: no two ranks on one GPU (checked through Gloo, so only
    /// with Gloo beside NCCL), and with `eager_connect` NCCL's communicator now.
    fn finish_nccl(&self, opts: &InitOptions, device: Option<usize>, at: &Meeting) -> Result<()> {
        if !self.uses_nccl() {
            return Ok(());
        }
        if let Some(d) = device.filter(|_| opts.world_size > 1 && opts.backend.has_gloo()) {
            self.verify_distinct_devices(&DeviceClaim::of_cuda_device(d)?)?;
        }
        if opts.eager_connect {
            // SAFETY: live group handle; exceptions are caught in the shim.
            ffi::check(unsafe { ffi::tdr_group_connect(self.raw()) })
                .map_err(|e| at.engine(e.message))?;
        }
        Ok(())
    }
}

/// Where a group's rendezvous happens, to name it in its errors
/// ([`DistError::Rendezvous`]).
struct Meeting {
    rank: usize,
    addr: String,
    port: u16,
}

impl Meeting {
    fn failed(&self, problem: RendezvousError) -> DistError {
        DistError::Rendezvous {
            rank: self.rank,
            addr: self.addr.clone(),
            port: self.port,
            problem: Box::new(problem),
        }
    }

    fn engine(&self, cause: String) -> DistError {
        self.failed(RendezvousError::Engine { cause })
    }

    /// `base.prefixed(prefix)`, a failure being the rendezvous's.
    fn prefixed(&self, base: &Store, prefix: &str) -> Result<Store> {
        base.prefixed(prefix)
            .map_err(|e| self.engine(e.to_string()))
    }
}

/// The checks before anything connects: the rank is inside the world, NCCL is compiled in
/// when asked for, and the CUDA device to bind exists. Returns that device (`None` for a
/// Gloo group).
fn checked_device(opts: &InitOptions) -> Result<Option<usize>> {
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
    if opts.backend.has_nccl() || opts.cuda_via_gloo {
        opts.cuda_device(tch::Cuda::device_count().max(0) as usize)
    } else {
        Ok(None)
    }
}

/// The rendezvous store, by the deadline: MASTER_ADDR resolves, something listens there
/// (rank 0's store, or the agent's) unless this rank hosts it, the client connects, and
/// the run id is checked.
fn connect_store(opts: &InitOptions, deadline: Deadline, at: &Meeting) -> Result<Store> {
    let addrs = rendezvous::resolve(&opts.master_addr, opts.master_port, deadline)
        .map_err(|p| at.failed(p))?;
    let is_server = opts.rank == 0 && !opts.use_agent_store;
    if !is_server {
        rendezvous::wait_for_listener(&addrs, deadline).map_err(|p| at.failed(p))?;
    }
    let store = Store::tcp(
        &opts.master_addr,
        opts.master_port,
        is_server,
        opts.world_size,
        deadline.left(),
        opts.timeout,
    )
    .map_err(|cause| at.engine(cause))?;
    rendezvous::check_run(&store, opts.rank, opts.run_id.as_deref()).map_err(|p| at.failed(p))?;
    Ok(store)
}

/// The store this attempt works in: the TCPStore itself, or on a restart over an agent
/// store that outlived the last attempt, PyTorch's `/worker/attempt_{n}` prefix of it.
fn attempt_store(opts: &InitOptions, tcp: &Store, at: &Meeting) -> Result<Store> {
    // A restart on an agent store that outlived the last attempt (torch 2.11's torchrun
    // shares its rendezvous store with the workers and keeps it): that attempt's keys
    // (every Gloo rank's address) are still there, and would send this attempt's ranks
    // to dead peers. Each rank finds its own join key of then, so all of them take the
    // fresh prefix PyTorch uses for attempts on one store; a new store per attempt holds
    // no such key and nothing changes.
    if opts.use_agent_store
        && opts.restart_count > 0
        && rendezvous::joined_before(tcp, DEFAULT_NAME, opts.rank)
    {
        at.prefixed(tcp, &format!("/worker/attempt_{}", opts.restart_count))
    } else {
        Ok(tcp.clone())
    }
}

/// The default group's record.
fn default_shape(opts: &InitOptions, device: Option<usize>) -> Shape {
    Shape {
        name: DEFAULT_NAME.to_string(),
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
    }
}

/// The parent's ranks among a subgroup's that never joined its rendezvous, named as the
/// caller of `new_group` named them.
fn subgroup_never_joined(
    world: &World,
    store: &Store,
    name: &str,
    ranks: &[usize],
    timeout: Duration,
) -> Option<RendezvousError> {
    rendezvous::never_joined(&world.root, store, name, ranks.len(), timeout).map(|e| match e {
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
}

/// DETAIL in a job with ranks that wrote no join key (PyTorch's): the group makes c10d's
/// checks only, which those ranks make too (see docs/design/rendezvous-and-interop.md,
/// "DETAIL").
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
    ffi::check(unsafe { ffi::tdr_group_set_foreign_peers(handle.0.as_ptr(), true) })
        .map_err(|e| e.message)
}

/// c10d's `TORCH_GLOO_LAZY_INIT` as its groups' devices read it (false if the shim cannot
/// say).
fn gloo_lazy_init() -> bool {
    let mut lazy = false;
    // SAFETY: a valid out-pointer; the shim catches every exception.
    ffi::check(unsafe { ffi::tdr_gloo_lazy_init(&mut lazy) }).is_ok() && lazy
}

/// What the shim needs to create a group's backends (`tdr_group_new`).
pub(super) struct NewBackends {
    pub(super) name: String,
    pub(super) rank: usize,
    pub(super) world_size: usize,
    /// The collectives' timeout.
    pub(super) timeout: Duration,
    /// What is left of the deadline for the backends' rendezvous.
    pub(super) rendezvous: Duration,
    /// The address Gloo binds (`interface.rs`; `""` for Gloo's own pick).
    pub(super) gloo_host: String,
    pub(super) backend: Backend,
    pub(super) device: Option<usize>,
    pub(super) cuda_via_gloo: bool,
    pub(super) debug: DebugLevel,
    pub(super) stores: BackendStores,
}

/// Where a group's backends meet in its store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BackendStores {
    /// Each under its device's prefix, `cpu/` or `cuda/` (PyTorch's
    /// `_new_process_group_helper`): the layout every PyTorch group has.
    PerDevice,
    /// On the store as given, with no prefix of their own: torchft's reconfigurable group
    /// (`ProcessGroupGloo._create_pg`), which a quorum's torchft members make.
    AsGiven,
}

impl NewBackends {
    /// The group's backends, rendezvoused over `store`.
    pub(super) fn create(&self, store: &Store) -> std::result::Result<GroupHandle, String> {
        let host = CString::new(self.gloo_host.as_str())
            .map_err(|_| "host contains a NUL byte".to_string())?;
        let name = CString::new(self.name.as_str())
            .map_err(|_| "group name contains a NUL byte".to_string())?;
        let mut out = std::ptr::null_mut();
        // SAFETY: live store, valid C strings and out-pointer; exceptions are caught in the
        // shim.
        ffi::check(unsafe {
            ffi::tdr_group_new(
                store.raw(),
                name.as_ptr(),
                self.rank as i32,
                self.world_size as i32,
                millis(self.timeout),
                millis(self.rendezvous).max(1),
                host.as_ptr(),
                self.backend.has_gloo(),
                self.backend.has_nccl(),
                self.device.map_or(-1, |d| d as i32),
                self.cuda_via_gloo,
                self.debug == DebugLevel::Detail,
                self.stores == BackendStores::AsGiven,
                &mut out,
            )
        })?;
        NonNull::new(out)
            .map(GroupHandle)
            .ok_or_else(|| "the engine returned no group".to_string())
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
