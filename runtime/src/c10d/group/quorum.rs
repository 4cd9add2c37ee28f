//! A quorum's group: the ranks of several replica groups (one per group, at one group rank)
//! that a fault-tolerance quorum put together for as long as the quorum lasts — torchft's
//! reconfigurable process group (`ProcessGroupGloo._create_pg` in torchft's
//! process_group.py). A new quorum makes a new group, over a new store prefix, without
//! restarting any process; the old one is shut down.
//!
//! It differs from a job's groups in four ways:
//! - Its store is one of the replica groups' TCPStores, reached as a client: no rank of
//!   the group hosts it, and nobody checks in there.
//! - Only Gloo: a step that fails in it must end within its own short timeout, and Gloo's
//!   collectives end at theirs (torch 2.11 cannot abort them).
//! - No departures watch and no heartbeat of its own (see [`Membership::Quorum`]).
//! - Its Gloo backend meets on the quorum's prefix itself, without PyTorch's `cpu/`:
//!   torchft's layout, so that torchft's Python members of a quorum meet tch-dist's.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use crate::c10d::departures::WatchStore;
use crate::c10d::env::DebugLevel;
use crate::c10d::heartbeat::Liveness;
use crate::c10d::interface::gloo_host;
use crate::c10d::rendezvous::{self, Deadline};
use crate::c10d::store::Store;
use crate::error::{DistError, EnvError, RendezvousError, Result};

use super::init::{BackendStores, NewBackends};
use super::{Backend, GroupInner, Membership, ProcessGroup, Shape, World};

/// Where and as what a rank joins a quorum's group.
///
/// ```no_run
/// use std::time::Duration;
/// use tch_dist_runtime::{ProcessGroup, QuorumGroupOptions};
///
/// // Replica rank 1 of 2, meeting at replica group 0's store under the quorum's prefix.
/// let pg = ProcessGroup::for_quorum(&QuorumGroupOptions {
///     name: "torchft_quorum_3_rank_0".into(),
///     store_host: "10.0.0.1".into(),
///     store_port: 29500,
///     prefix: "torchft/3/0".into(),
///     rank: 1,
///     world_size: 2,
///     timeout: Duration::from_secs(10),
/// })?;
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumGroupOptions {
    /// The group's name (torchft's `torchft_quorum_{quorum_id}_rank_{group_rank}`), which its
    /// failure reports are keyed by.
    pub name: String,
    /// The store's host (the replica group the quorum chose for this group rank).
    pub store_host: String,
    /// The store's port.
    pub store_port: u16,
    /// The quorum's prefix in that store (torchft's `torchft/{quorum_id}/{group_rank}`).
    pub prefix: String,
    /// This rank's replica rank in the quorum.
    pub rank: usize,
    /// The quorum's replica groups.
    pub world_size: usize,
    /// Both the rendezvous' bound and every collective's: short, since a member that died
    /// mid-step is only seen when its collectives end.
    pub timeout: Duration,
}

impl ProcessGroup {
    /// Joins the Gloo group of a quorum (see [`QuorumGroupOptions`]); returns once every
    /// member joined, or fails with [`DistError::Rendezvous`] when they have not within the
    /// timeout.
    pub fn for_quorum(opts: &QuorumGroupOptions) -> Result<ProcessGroup> {
        if opts.world_size == 0 || opts.rank >= opts.world_size {
            return Err(EnvError::RankOutOfRange {
                rank_var: "replica rank",
                rank: opts.rank,
                world_var: "replica world size",
                world_size: opts.world_size,
            }
            .into());
        }
        let deadline = Deadline::after(opts.timeout);
        let failed = |problem: RendezvousError| DistError::Rendezvous {
            rank: opts.rank,
            addr: opts.store_host.clone(),
            port: opts.store_port,
            problem: Box::new(problem),
        };
        let engine = |cause: String| failed(RendezvousError::Engine { cause });
        let addrs =
            rendezvous::resolve(&opts.store_host, opts.store_port, deadline).map_err(failed)?;
        rendezvous::wait_for_listener(&addrs, deadline).map_err(failed)?;
        let root = Store::tcp(
            &opts.store_host,
            opts.store_port,
            false,
            0,
            deadline.left(),
            opts.timeout,
        )
        .map_err(engine)?;
        // torchft's layout, key for key (`create_store_client`'s `PrefixStore(prefix)`, the
        // Gloo backend straight on it): a quorum may have torchft's Python members.
        let store = root
            .prefixed(&opts.prefix)
            .map_err(|e| engine(e.to_string()))?;
        let handle = NewBackends {
            name: opts.name.clone(),
            rank: opts.rank,
            world_size: opts.world_size,
            timeout: opts.timeout,
            rendezvous: deadline.left(),
            gloo_host: gloo_host(&opts.store_host),
            backend: Backend::Gloo,
            device: None,
            cuda_via_gloo: false,
            debug: DebugLevel::Off,
            stores: BackendStores::AsGiven,
        }
        .create(&store)
        .map_err(engine)?;
        let master = (opts.store_host.clone(), opts.store_port);
        let world = Arc::new(World {
            watch: WatchStore::new(master.clone()),
            liveness: Liveness::new(opts.timeout),
            _heartbeat: None,
            membership: Membership::Quorum,
            root,
            default_store: store,
            group_count: AtomicUsize::new(1),
            live_groups: AtomicUsize::new(1),
            init_barrier: false,
        });
        let inner = GroupInner::new(
            handle,
            world,
            Shape {
                name: opts.name.clone(),
                rank: opts.rank,
                world_size: opts.world_size,
                backend: Backend::Gloo,
                timeout: opts.timeout,
                global_ranks: (0..opts.world_size).collect(),
                master,
                device: None,
                shortcuts: true,
                cuda_via_gloo: false,
                debug: DebugLevel::Off,
            },
        );
        Ok(ProcessGroup {
            inner: Arc::new(inner),
        })
    }
}
