//! Per-step fault tolerance, torchft's model: a job runs as several **replica groups** (each
//! an ordinary job with its own store and launcher), only the replicate dimension crosses
//! them, and a group that fails is left out of the next step's quorum while the others keep
//! training; a group that starts (after a crash, or as a new one) heals from a live member
//! before its first step, with no checkpoint on disk.
//!
//! Each step: [`Manager::start_quorum`] (the lighthouse's quorum; a new quorum makes a new
//! cross-group process group; a group behind heals), the forward and backward,
//! [`Manager::allreduce_gradients`] (the average over the members at the highest step; a
//! failure is recorded, not raised), then [`Manager::should_commit`]: the optimizer steps
//! only when every rank of every member succeeded. In a group of one rank,
//! [`Manager::prepare_for_backward`] between the forward and the backward lets the average
//! leave during backward.
//!
//! The control plane (`tch-dist-ft`) speaks torchft's gRPC protocol: a tch-dist replica
//! group and a PyTorch torchft one can share one lighthouse's quorum. With
//! [`Wire::TorchftDdp`] they also train together: a tch-dist group averages as torchft's
//! `DistributedDataParallel` does. Healing does not cross languages (torchft's transports
//! carry pickled Python objects).
//!
//! | file | what it does | torchft's counterpart |
//! |---|---|---|
//! | `mod.rs` | [`Manager`]: the quorum per step, the cross-group group's reconfiguration, the gradient average, the commit | `torchft/manager.py` (`Manager`) |
//! | `average.rs` | tch-dist's average: the buffer (last parameter first), its chunks, their launch during backward in a group of one rank | `torchft/ddp.py` (its comm hook), PyTorch's reducer |
//! | `torchft_ddp.rs` | the average on torchft's wire ([`Wire::TorchftDdp`]: DDP's buckets, a quorum shared with torchft's Python groups) | `torchft/ddp.py`, `Manager.allreduce` |
//! | `heal.rs` | live recovery: the state a healthy member sends a group that is behind | `torchft/checkpointing/pg_transport.py` |
//! | `error.rs` | [`FtError`] | (exceptions of `manager.py`) |
//!
//! ```no_run
//! use tch::nn::{self, Module, OptimizerConfig};
//! use tch_dist::ft::{FtOptions, Manager};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // this replica group's own
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let net = nn::linear(vs.root() / "fc", 4, 2, Default::default());
//! let mut opt = tch_dist::optim::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.1)?;
//! let mut ft = Manager::new(&pg, FtOptions::new("replica_0", "http://10.0.0.1:29510"))?;
//! while ft.step() < 100 {
//!     ft.start_quorum(&vs, &mut opt)?;
//!     opt.zero_grad();
//!     let x = tch::Tensor::randn([8, 4], tch::kind::FLOAT_CPU);
//!     net.forward(&x).square().mean(None).backward();
//!     ft.allreduce_gradients(&vs, &mut opt)?;
//!     if ft.should_commit()? {
//!         opt.step()?;
//!     }
//! }
//! # Ok(()) }
//! ```

mod average;
mod error;
mod heal;
mod torchft_ddp;

use std::hash::Hasher;
use std::time::Duration;

use tch::{Kind, Tensor};
use tch_dist_core::sharding::Dtype;
use tch_dist_ft::{
    FtErrorKind, ManagerClient, ManagerOptions, ManagerQuorumRequest, ManagerQuorumResponse,
    ManagerServer, QuorumMembers, RpcCode, TCH_DIST_MEMBER,
};
use tch_dist_runtime::{Fingerprint, ProcessGroup, QuorumGroupOptions};

pub use error::FtError;
pub use tch_dist_ft::{LighthouseOptions, LighthouseServer};
pub use torchft_ddp::TorchftDdp;

use crate::optim::Optimizer;

/// The store key under which a replica group's rank 0 publishes its manager for the group's
/// other ranks.
const MANAGER_KEY: &str = "tch_dist/ft/manager";

/// What the members of a quorum say to each other when they average gradients.
///
/// ```
/// let opts = tch_dist::ft::FtOptions::new("replica_0", "http://10.0.0.1:29510");
/// assert_eq!(opts.wire, tch_dist::ft::Wire::TchDist);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Wire {
    /// tch-dist's: every member is a tch-dist group (a quorum with a torchft Python group is
    /// refused, naming it). A new quorum compares the members' models (names, shapes,
    /// dtypes); the average is one buffer, with each member's failure flag, so that a member
    /// whose step failed tells the others at once.
    #[default]
    TchDist,
    /// torchft's `DistributedDataParallel`: members may be torchft Python groups, and this
    /// group averages as theirs do (DDP's buckets over the parameters in the Python module's
    /// order, see [`TorchftDdp`]). What torchft does not have is lost: the models are not
    /// compared (a mismatch the sizes do not show averages the wrong numbers: the order is
    /// the user's contract), and a member whose step failed makes no collective, so the
    /// others' fail at their timeout. Healing from a torchft member is refused, naming it,
    /// and so is `init_sync` (every group starts from the same weights).
    TorchftDdp(TorchftDdp),
}

/// A replica group's settings for fault tolerance (torchft's `Manager` arguments).
///
/// ```
/// let opts = tch_dist::ft::FtOptions {
///     min_replica_size: 2,
///     ..tch_dist::ft::FtOptions::new("replica_0", "http://10.0.0.1:29510")
/// };
/// assert_eq!(opts.timeout, std::time::Duration::from_secs(10));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FtOptions {
    /// The group's name; a unique suffix is added per start (`"{name}:{uuid}"`), so a
    /// restarted group is a new member. torchft's Python groups read an index from the
    /// digits at its end: name groups `replica_0`, `replica_1`, ... (zero-padded past 9:
    /// quorums order members by id, as strings).
    pub replica_id: String,
    /// The lighthouse, `http://host:port` (torchft's `TORCHFT_LIGHTHOUSE`).
    pub lighthouse: String,
    /// The fewest members a step may be committed with (torchft's `min_replica_size`).
    pub min_replica_size: usize,
    /// The cross-group group's timeout (joining it, each collective): short, so that a
    /// member that died mid-step only costs that step (torchtitan: 10 s).
    pub timeout: Duration,
    /// How long a quorum or a commit vote may take (torchft: 60 s).
    pub quorum_timeout: Duration,
    /// How long connecting to the lighthouse or the manager may take (torchft: 60 s).
    pub connect_timeout: Duration,
    /// At step 0 every group takes the first group's parameters (torchft's default): groups
    /// whose random initialisations differ start alike.
    pub init_sync: bool,
    /// The host other groups reach this group's manager at; by default its store's host.
    pub hostname: Option<String>,
    /// How often the manager heartbeats to the lighthouse (torchft: 100 ms).
    pub heartbeat_interval: Duration,
    /// Ask for the quorum in the background, overlapping the forward and backward
    /// (torchft's `use_async_quorum`, default true): `start_quorum` returns at once and
    /// `allreduce_gradients` applies the answer (a new quorum's group, healing) before it
    /// averages. A group that heals then computed its step on its old weights, which its
    /// zero contribution makes harmless, and takes the healed ones before the optimizer
    /// step. Until then [`Manager::replica_rank`] is the last quorum's. Never at step 0
    /// (the job's start with `init_sync`, a restarted group): there the weights are taken
    /// before the first forward.
    pub async_quorum: bool,
    /// How the quorum's members average (tch-dist's own, or torchft's DDP to share quorums
    /// with torchft's Python groups).
    pub wire: Wire,
}

impl FtOptions {
    /// torchft's defaults: `min_replica_size` 1, a 10 s group timeout, 60 s for quorums and
    /// connecting, `init_sync`, heartbeats every 100 ms.
    ///
    /// ```
    /// let opts = tch_dist::ft::FtOptions::new("replica_0", "http://127.0.0.1:29510");
    /// assert!(opts.init_sync);
    /// ```
    pub fn new(replica_id: impl Into<String>, lighthouse: impl Into<String>) -> Self {
        FtOptions {
            replica_id: replica_id.into(),
            lighthouse: lighthouse.into(),
            min_replica_size: 1,
            timeout: Duration::from_secs(10),
            quorum_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(60),
            init_sync: true,
            hostname: None,
            heartbeat_interval: Duration::from_millis(100),
            async_quorum: true,
            wire: Wire::TchDist,
        }
    }

    /// The options of a rank that `tch-dist-run --replica-groups` (or torchft's tooling)
    /// started: `replica_{REPLICA_GROUP_ID}` at `TORCHFT_LIGHTHOUSE`, torchft's defaults
    /// otherwise.
    ///
    /// ```no_run
    /// let opts = tch_dist::ft::FtOptions::from_env()?;
    /// # Ok::<(), tch_dist::ft::FtError>(())
    /// ```
    pub fn from_env() -> Result<Self, FtError> {
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.trim().is_empty())
                .ok_or_else(|| {
                    FtError::Options(format!(
                        "{name} is not set (tch-dist-run --replica-groups sets it)"
                    ))
                })
        };
        let group = var("REPLICA_GROUP_ID")?;
        let index: usize = group.trim().parse().map_err(|_| {
            FtError::Options(format!("REPLICA_GROUP_ID {group:?} is not a group index"))
        })?;
        Ok(FtOptions::new(
            format!("replica_{index}"),
            var("TORCHFT_LIGHTHOUSE")?,
        ))
    }

    fn check(&self) -> Result<(), FtError> {
        let refuse = |why: String| Err(FtError::Options(why));
        if self.replica_id.is_empty() || self.replica_id.contains(':') {
            return refuse(format!(
                "replica_id {:?} must be a non-empty name without ':' (a unique suffix follows one)",
                self.replica_id
            ));
        }
        if self.min_replica_size == 0 {
            return refuse("min_replica_size must be at least 1".into());
        }
        // At step 0 init_sync heals every group but the first from it; on torchft's wire that
        // source or its receivers may be torchft's Python groups, and healing does not cross
        // languages.
        if matches!(self.wire, Wire::TorchftDdp(_)) && self.init_sync {
            return refuse(
                "torchft's wire needs init_sync false (torchft's init_sync=False on the Python \
                 groups too): healing does not cross languages, so every group starts from the \
                 same weights"
                    .into(),
            );
        }
        for (name, t) in [
            ("timeout", self.timeout),
            ("quorum_timeout", self.quorum_timeout),
            ("connect_timeout", self.connect_timeout),
            ("heartbeat_interval", self.heartbeat_interval),
        ] {
            if t.is_zero() {
                return refuse(format!("{name} must be longer than zero"));
            }
        }
        Ok(())
    }
}

/// The quorum this group takes part in now.
struct Current {
    id: i64,
    /// The members' Gloo group, this quorum's only.
    pg: ProcessGroup,
    replica_ids: Vec<String>,
    /// Whether this group contributes gradients (it was at the highest step when the quorum
    /// formed, and does not heal after its backward).
    participating: bool,
    /// The members at the highest step: the divisor of the average, and what
    /// `min_replica_size` counts.
    participants: i64,
}

/// One rank's part in fault-tolerant training (torchft's `Manager`): see the module's docs.
///
/// ```no_run
/// # fn demo(pg: &tch_dist::ProcessGroup) -> Result<(), tch_dist::ft::FtError> {
/// let ft = tch_dist::ft::Manager::new(pg, tch_dist::ft::FtOptions::new("replica_0", "http://10.0.0.1:29510"))?;
/// # Ok(()) }
/// ```
pub struct Manager {
    group: ProcessGroup,
    opts: FtOptions,
    replica_id: String,
    _server: Option<ManagerServer>,
    client: std::sync::Arc<ManagerClient>,
    current: Option<Current>,
    step: i64,
    batches_committed: i64,
    commit_failures: i64,
    /// The first failure of this step, which makes this group vote against committing it.
    errored: Option<String>,
    /// The gradient average's buffer, kept between steps.
    buffer: Option<average::Buffer>,
    /// The hooks that launch the average's chunks during backward, once armed
    /// ([`prepare_for_backward`](Self::prepare_for_backward)).
    overlap: Option<average::Overlap>,
    /// Whether this step has averaged its gradients (once per step).
    averaged: bool,
    /// The quorum `start_quorum` asked for in the background (`async_quorum`), applied by
    /// `allreduce_gradients`.
    pending: Option<Asked>,
}

/// A quorum's answer as the manager gives it.
type QuorumAnswer = Result<ManagerQuorumResponse, tch_dist_ft::FtError>;

/// A quorum asked for in the background.
enum Asked {
    /// Still on its way.
    Asking(std::thread::JoinHandle<QuorumAnswer>),
    /// Answered, and kept to be applied after backward (it heals this group, which must
    /// not happen between a forward and its backward).
    Answered(QuorumAnswer),
}

impl Asked {
    /// The answer, waiting for it.
    fn answer(self) -> QuorumAnswer {
        match self {
            Asked::Asking(thread) => thread.join().unwrap_or_else(|_| {
                Err(tch_dist_ft::FtError::panicked(
                    "manager quorum",
                    "the quorum's thread",
                ))
            }),
            Asked::Answered(answer) => answer,
        }
    }
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager")
            .field("replica_id", &self.replica_id)
            .field("group_rank", &self.group.rank())
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

/// The average buffer's dtype: the parameters' own where they share one, else one that
/// holds each of theirs (a bf16 parameter first must not average the f32 ones in bf16);
/// none without parameters.
fn average_kind(params: &[(String, Tensor)]) -> Option<Kind> {
    params
        .iter()
        .map(|(_, p)| p.kind())
        .reduce(|a, b| match (a, b) {
            _ if a == b => a,
            (Kind::Double, _) | (_, Kind::Double) => Kind::Double,
            _ => Kind::Float,
        })
}

/// Who heals from whom: `(the replica rank this member receives from, the replica ranks it
/// sends to)`. The manager's plan (torchft's: sources round robin, offset by the group rank),
/// except at step 0 with init_sync, where every member takes replica rank 0's state, at
/// every group rank alike: the manager's plan gives each group rank its own source there,
/// and the ranks of a group that replicates within itself would then start from different
/// groups' weights. Every member computes the same plan from the same answer.
fn heal_plan(answer: &ManagerQuorumResponse, init_sync: bool) -> (Option<usize>, Vec<i64>) {
    if init_sync && answer.max_step == 0 {
        return if answer.replica_rank == 0 {
            (None, (1..answer.replica_world_size).collect())
        } else {
            (Some(0), Vec::new())
        };
    }
    let src = answer
        .recover_src_replica_rank
        .filter(|_| answer.heal)
        .and_then(|r| usize::try_from(r).ok());
    (src, answer.recover_dst_replica_ranks.clone())
}

/// The first name (the part of an id before its `:`) that two members of a quorum share:
/// two replica groups started under one name (a restarted group's earlier start is no
/// longer a member).
fn duplicate_name(ids: &[String]) -> Option<&str> {
    let names: Vec<&str> = ids
        .iter()
        .map(|id| id.split_once(':').map_or(id.as_str(), |(name, _)| name))
        .collect();
    names
        .iter()
        .enumerate()
        .find(|(i, n)| names[..*i].contains(n))
        .map(|(_, n)| *n)
}

/// A random id for this start of the group (Linux's kernel UUID source; the process id and
/// time where it is missing).
fn unique_suffix() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/uuid")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            format!("{}-{nanos}", std::process::id())
        })
}

impl Manager {
    /// Joins fault-tolerant training as this rank of its replica group `group` (the group's
    /// own process group: its store is where other groups meet this one's ranks). Rank 0
    /// starts the group's manager server; every rank connects to it.
    ///
    /// ```no_run
    /// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
    /// let ft = tch_dist::ft::Manager::new(&pg, tch_dist::ft::FtOptions::from_env()?)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(group: &ProcessGroup, opts: FtOptions) -> Result<Manager, FtError> {
        opts.check()?;
        let group_rank = group.rank();
        let (store_host, store_port) = group.store_address();
        let store_host = store_host.to_string();
        let collective = |op, source| FtError::Collective {
            replica: opts.replica_id.clone(),
            group_rank,
            op,
            source: Box::new(source),
        };
        let (server, replica_id, address) = if group_rank == 0 {
            let replica_id = format!("{}:{}", opts.replica_id, unique_suffix());
            let server = ManagerServer::start(ManagerOptions {
                replica_id: replica_id.clone(),
                lighthouse_addr: opts.lighthouse.clone(),
                hostname: opts.hostname.clone().unwrap_or_else(|| store_host.clone()),
                bind: "0.0.0.0:0".into(),
                store_addr: format!("{store_host}:{store_port}"),
                world_size: group.world_size() as u64,
                heartbeat_interval: opts.heartbeat_interval,
                connect_timeout: opts.connect_timeout,
                quorum_retries: 0,
                // On tch-dist's wire the members of a quorum run tch-dist's average
                // together; on torchft's, any torchft member may join.
                members: match opts.wire {
                    Wire::TchDist => QuorumMembers::TchDistOnly,
                    Wire::TorchftDdp(_) => QuorumMembers::Any,
                },
            })
            .map_err(|source| FtError::control(&opts.replica_id, group_rank, source))?;
            let address = server.address();
            let published = format!("{replica_id}\n{address}");
            group
                .store()
                .set(MANAGER_KEY, published.as_bytes())
                .map_err(|e| collective("publishing the manager's address", e))?;
            (Some(server), replica_id, address)
        } else {
            // Bounded by the quorum timeout, not the store's (half an hour): a rank 0 that
            // makes no manager is a misuse, named here.
            let waiting = std::time::Instant::now();
            while !group
                .store()
                .check(MANAGER_KEY)
                .map_err(|e| collective("reading the manager's address", e))?
            {
                if waiting.elapsed() >= opts.quorum_timeout {
                    return Err(FtError::NoManager {
                        replica: opts.replica_id.clone(),
                        group_rank,
                        waited: opts.quorum_timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let published = group
                .store()
                .get(MANAGER_KEY)
                .map_err(|e| collective("reading the manager's address", e))?;
            let published = String::from_utf8_lossy(&published).into_owned();
            let (id, address) = published.split_once('\n').unwrap_or((&published, ""));
            (None, id.to_string(), address.to_string())
        };
        let client = ManagerClient::connect(&address, opts.connect_timeout)
            .map_err(|source| FtError::control(&replica_id, group_rank, source))?;
        Ok(Manager {
            group: group.clone(),
            opts,
            replica_id,
            _server: server,
            client: std::sync::Arc::new(client),
            current: None,
            step: 0,
            batches_committed: 0,
            commit_failures: 0,
            errored: None,
            buffer: None,
            overlap: None,
            averaged: false,
            pending: None,
        })
    }

    /// The committed steps so far (a healed group's is its source's).
    ///
    /// ```no_run
    /// # fn demo(ft: &tch_dist::ft::Manager) {
    /// println!("step {}", ft.step());
    /// # }
    /// ```
    pub fn step(&self) -> i64 {
        self.step
    }

    /// Batches committed across all members so far (each committed step adds its
    /// participants).
    ///
    /// ```no_run
    /// # fn demo(ft: &tch_dist::ft::Manager) {
    /// println!("{} batches", ft.batches_committed());
    /// # }
    /// ```
    pub fn batches_committed(&self) -> i64 {
        self.batches_committed
    }

    /// This group's id in the quorums (`"{name}:{uuid}"`).
    ///
    /// ```no_run
    /// # fn demo(ft: &tch_dist::ft::Manager) {
    /// assert!(ft.replica_id().starts_with("replica_0:"));
    /// # }
    /// ```
    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }

    /// This group's rank among the current quorum's members, none before the first quorum
    /// (what data sharding across replica groups keys on).
    ///
    /// ```no_run
    /// # fn demo(ft: &tch_dist::ft::Manager) {
    /// let shard = ft.replica_rank().unwrap_or(0); // which part of the data this group reads
    /// # }
    /// ```
    pub fn replica_rank(&self) -> Option<usize> {
        self.current.as_ref().map(|c| c.pg.rank())
    }

    /// The members whose gradients the current step averages (the divisor), 0 before the
    /// first quorum.
    ///
    /// ```no_run
    /// # fn demo(ft: &tch_dist::ft::Manager) {
    /// println!("averaging over {} groups", ft.participants());
    /// # }
    /// ```
    pub fn participants(&self) -> i64 {
        self.current.as_ref().map_or(0, |c| c.participants)
    }

    /// This step's first failure (which makes the group vote against committing it), if any.
    ///
    /// ```no_run
    /// # fn demo(ft: &tch_dist::ft::Manager) {
    /// if let Some(why) = ft.errored() {
    ///     eprintln!("this step will not commit: {why}");
    /// }
    /// # }
    /// ```
    pub fn errored(&self) -> Option<&str> {
        self.errored.as_deref()
    }

    fn control(&self, source: tch_dist_ft::FtError) -> FtError {
        FtError::control(&self.replica_id, self.group.rank(), source)
    }

    /// Records the step's first failure.
    fn fail(&mut self, what: String) {
        self.errored.get_or_insert(what);
    }

    /// Begins a step: this group's quorum with the others. With
    /// [`FtOptions::async_quorum`] (the default) it is asked for in the background and
    /// applied by [`allreduce_gradients`](Self::allreduce_gradients); otherwise here, waiting
    /// for the lighthouse. A new quorum makes a new cross-group group and checks that every
    /// member trains the same model ([`FtError::DifferentModel`] on every member otherwise);
    /// a group behind then receives the live state of `vs` and `opt` from an up-to-date
    /// member, and up-to-date members send theirs to the groups assigned to them. A
    /// collective that fails there is recorded: the step will not commit.
    ///
    /// ```no_run
    /// # fn demo(ft: &mut tch_dist::ft::Manager, vs: &tch::nn::VarStore, opt: &mut tch_dist::optim::Optimizer) -> Result<(), tch_dist::ft::FtError> {
    /// ft.start_quorum(vs, opt)?; // then zero_grad, forward, backward
    /// # Ok(()) }
    /// ```
    pub fn start_quorum(
        &mut self,
        vs: &tch::nn::VarStore,
        opt: &mut Optimizer,
    ) -> Result<(), FtError> {
        self.errored = None;
        self.averaged = false;
        // On torchft's wire, the order must name this model's parameters, each once: checked
        // before the quorum, so that no member ever meets a group that cannot average.
        if let Wire::TorchftDdp(wire) = &self.opts.wire {
            wire.arrange(&heal::parameters(opt, vs))
                .map_err(|problem| {
                    FtError::Options(format!(
                        "replica {}, group rank {}: {problem}",
                        self.replica_id,
                        self.group.rank()
                    ))
                })?;
        }
        // A quorum still pending from a step that never averaged: its answer is dropped.
        self.drop_pending();
        let request = ManagerQuorumRequest {
            group_rank: self.group.rank() as i64,
            step: self.step,
            // What a member that heals from this one reads first (torchft's transport
            // address): on torchft's wire it tells a tch-dist source from a Python one.
            checkpoint_metadata: TCH_DIST_MEMBER.to_string(),
            shrink_only: false,
            init_sync: self.opts.init_sync,
            commit_failures: self.commit_failures,
        };
        let timeout = self.opts.quorum_timeout;
        // Never at step 0: a group that starts (the job's first step with init_sync, or a
        // restart) takes its weights before its first forward.
        if self.opts.async_quorum && self.step > 0 {
            let client = self.client.clone();
            self.pending = Some(Asked::Asking(std::thread::spawn(move || {
                client.quorum(request, timeout)
            })));
            return Ok(());
        }
        let asked = self.client.quorum(request, timeout);
        self.apply_quorum(asked, false, vs, opt)
    }

    /// Waits for a quorum that `start_quorum` asked for in the background, and drops it;
    /// waits for chunks of an average that never finished.
    fn drop_pending(&mut self) {
        if let Some(pending) = self.pending.take() {
            let _ = pending.answer();
        }
        if let Some(step) = self.overlap.as_ref().and_then(average::Overlap::take) {
            step.drain();
        }
    }

    /// What a quorum's answer makes of this step: the quorum's group (made anew for a new
    /// quorum, its members' models compared), healing, and the state this group sends.
    fn apply_quorum(
        &mut self,
        asked: QuorumAnswer,
        in_background: bool,
        vs: &tch::nn::VarStore,
        opt: &mut Optimizer,
    ) -> Result<(), FtError> {
        let group_rank = self.group.rank();
        let answer = match asked {
            Ok(a) => a,
            // A rank of this group that never asks, or a member that is no tch-dist group:
            // asking again would not help.
            Err(e) if e.kind() == &FtErrorKind::Rpc(RpcCode::FailedPrecondition) => {
                return Err(self.control(e))
            }
            // The lighthouse restarting, say: this step does not commit, the next asks again.
            // (A manager that is gone fails `should_commit`, which is an error.)
            Err(e) => {
                self.fail(format!("the quorum: {e}"));
                return Ok(());
            }
        };
        if self.current.as_ref().map(|c| c.id) != Some(answer.quorum_id) {
            if let Some(old) = self.current.take() {
                old.pg.shutdown();
            }
            let Some((host, port)) = answer
                .store_address
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h.trim_matches(['[', ']']), p.parse::<u16>().ok()?)))
            else {
                self.fail(format!(
                    "the quorum's store address {:?}",
                    answer.store_address
                ));
                return Ok(());
            };
            let joined = ProcessGroup::for_quorum(&QuorumGroupOptions {
                name: format!("torchft_quorum_{}_rank_{group_rank}", answer.quorum_id),
                store_host: host.to_string(),
                store_port: port,
                prefix: format!("torchft/{}/{group_rank}", answer.quorum_id),
                rank: usize::try_from(answer.replica_rank).unwrap_or(0),
                world_size: usize::try_from(answer.replica_world_size).unwrap_or(0),
                timeout: self.opts.timeout,
            });
            let pg = match joined {
                Ok(pg) => pg,
                Err(e) => {
                    self.fail(format!("joining quorum {}: {e}", answer.quorum_id));
                    return Ok(());
                }
            };
            let current = Current {
                id: answer.quorum_id,
                pg,
                replica_ids: answer.replica_ids.clone(),
                participating: false,
                participants: 0,
            };
            // torchft's members make no such exchange: on its wire the order is the check.
            let compared = match self.opts.wire {
                Wire::TchDist => self.same_model(&current, vs, opt),
                Wire::TorchftDdp(_) => Ok(()),
            };
            match compared {
                Ok(()) => {}
                Err(Some(other)) => {
                    return Err(FtError::DifferentModel {
                        replica: self.replica_id.clone(),
                        group_rank,
                        other,
                    })
                }
                Err(None) => {
                    self.fail("comparing the members' models".into());
                    return Ok(());
                }
            }
            self.current = Some(current);
        }
        if let Some(name) = duplicate_name(&answer.replica_ids) {
            return Err(FtError::DuplicateName {
                replica: self.replica_id.clone(),
                group_rank,
                name: name.to_string(),
            });
        }
        let Some(current) = self.current.as_mut() else {
            return Ok(());
        };
        // A quorum asked in the background is applied after the backward: a group that
        // heals then computed its gradients on the weights it replaces, and contributes
        // zeros (torchft's `_healing`).
        current.participating =
            answer.max_replica_rank.is_some() && !(in_background && answer.heal);
        current.participants = answer.max_world_size;
        let pg = current.pg.clone();
        let sources = current.replica_ids.clone();
        let (recover_src, recover_dst) = heal_plan(&answer, self.opts.init_sync);
        if let Some(src) = recover_src {
            let from_tch_dist = match self.opts.wire {
                Wire::TchDist => true,
                Wire::TorchftDdp(_) => self.source_is_tch_dist(&answer, sources.get(src))?,
            };
            // (Not from tch-dist: the failure to ask is recorded, the step will not commit.)
            if from_tch_dist {
                match heal::receive(&pg, src, vs, opt) {
                    Ok(healed) => {
                        self.step = healed.step;
                        self.batches_committed = healed.batches_committed;
                    }
                    Err(heal::HealFailure::Transfer(e)) => self.fail(format!("healing: {e}")),
                    Err(heal::HealFailure::Misfit(problem)) => {
                        return Err(FtError::Heal {
                            replica: self.replica_id.clone(),
                            group_rank,
                            from: sources.get(src).cloned().unwrap_or_default(),
                            problem,
                        })
                    }
                }
            }
        }
        let healed = heal::Healed {
            step: self.step,
            batches_committed: self.batches_committed,
        };
        for dst in recover_dst {
            let dst = usize::try_from(dst).unwrap_or(0);
            if let Err(e) = heal::send(&pg, dst, healed, vs, opt) {
                self.fail(format!("sending the live state to replica rank {dst}: {e}"));
            }
        }
        Ok(())
    }

    /// On torchft's wire, before healing: the source's manager must be a tch-dist one (its
    /// checkpoint metadata is [`TCH_DIST_MEMBER`]; a torchft manager's is its transport's
    /// address). A torchft source is an error naming it: its state comes as pickled Python
    /// objects. A manager that cannot be asked fails the step (the next quorum asks again),
    /// and `Ok(false)` says not to heal now.
    fn source_is_tch_dist(
        &mut self,
        answer: &ManagerQuorumResponse,
        source: Option<&String>,
    ) -> Result<bool, FtError> {
        let group_rank = self.group.rank();
        let asked = ManagerClient::connect(
            &answer.recover_src_manager_address,
            self.opts.connect_timeout,
        )
        .and_then(|c| c.checkpoint_metadata(group_rank as i64, self.opts.quorum_timeout));
        match asked {
            Ok(metadata) if metadata == TCH_DIST_MEMBER => Ok(true),
            Ok(_) => Err(FtError::Heal {
                replica: self.replica_id.clone(),
                group_rank,
                from: source.cloned().unwrap_or_default(),
                problem: "it is a torchft Python group, whose state travels as pickled Python \
                          objects: healing does not cross languages"
                    .into(),
            }),
            Err(e) => {
                self.fail(format!("asking the healing source's manager: {e}"));
                Ok(false)
            }
        }
    }

    /// Whether every member of `current` trains the model of `vs` (parameter names, shapes
    /// and dtypes): `Err(Some(id))` names the first member that does not, `Err(None)` is a
    /// failed exchange.
    fn same_model(
        &self,
        current: &Current,
        vs: &tch::nn::VarStore,
        opt: &Optimizer,
    ) -> Result<(), Option<String>> {
        let mut h = Fingerprint::default();
        for (fqn, p) in heal::parameters(opt, vs) {
            h.write(fqn.as_bytes());
            for d in p.size() {
                h.write(&d.to_le_bytes());
            }
            h.write(&Dtype(p.kind()).code().to_le_bytes());
        }
        let own = h.finish() as i64;
        let mine = Tensor::from_slice(&[own]);
        let all = Tensor::zeros(
            [current.pg.world_size() as i64],
            (Kind::Int64, tch::Device::Cpu),
        );
        current
            .pg
            .all_gather_into_tensor(&all, &mine)
            .map_err(|_| None)?;
        let all = Vec::<i64>::try_from(&all).map_err(|_| None)?;
        match all.iter().position(|f| *f != own) {
            None => Ok(()),
            Some(r) => Err(Some(
                current.replica_ids.get(r).cloned().unwrap_or_default(),
            )),
        }
    }

    /// Records a failure of this rank's step (torchft's `report_error`): an error inside
    /// the forward or backward, a bad batch. The step will not commit anywhere: this group
    /// votes against it, and its part of the gradient average tells every other member
    /// (which then vote against it too, without waiting for a timeout).
    ///
    /// ```no_run
    /// # fn demo(ft: &mut tch_dist::ft::Manager, loss: &tch::Tensor) {
    /// if loss.isnan().any().int64_value(&[]) != 0 {
    ///     ft.report_error("the loss is NaN");
    /// }
    /// # }
    /// ```
    pub fn report_error(&mut self, what: impl Into<String>) {
        self.fail(what.into());
    }

    /// Applies the step's quorum if it was asked for in the background (see
    /// [`start_quorum`](Self::start_quorum); an error there is returned), then averages the
    /// gradients of `opt`'s parameters in `vs` over the quorum's members at the highest step (the
    /// gradients flattened into one buffer, all-reduced in chunks; a group that healed this step contributes
    /// zeros, and the divisor is the participants, not the members). One more element
    /// carries whether each member's step failed so far ([`report_error`](Self::report_error),
    /// a failed heal): a member that failed takes part with zeros, and every member learns
    /// of it. A failure is recorded (see [`errored`](Self::errored)) and the gradients are
    /// then no average: the step will not commit. Once per step: a second call
    /// communicates nothing and fails the step (it would meet the other members' next
    /// average).
    ///
    /// ```no_run
    /// # fn demo(ft: &mut tch_dist::ft::Manager, vs: &tch::nn::VarStore, opt: &mut tch_dist::optim::Optimizer) -> Result<(), tch_dist::ft::FtError> {
    /// ft.allreduce_gradients(vs, opt)?; // after backward
    /// # Ok(()) }
    /// ```
    pub fn allreduce_gradients(
        &mut self,
        vs: &tch::nn::VarStore,
        opt: &mut Optimizer,
    ) -> Result<(), FtError> {
        if let Some(pending) = self.pending.take() {
            self.apply_quorum(pending.answer(), true, vs, opt)?;
        }
        // One average per step: a second one here would meet the other members' next
        // step's, and average other gradients than they think, silently.
        if std::mem::replace(&mut self.averaged, true) {
            self.fail("allreduce_gradients was called twice in one step".into());
            return Ok(());
        }
        self.average(vs, opt);
        Ok(())
    }

    /// Makes the next backward this step's last: in a replica group of one rank, on
    /// tch-dist's wire, each chunk of the gradient average then leaves as soon as its
    /// gradients are accumulated, overlapping the rest of backward (DDP's buckets do the
    /// same), and [`allreduce_gradients`](Self::allreduce_gradients) sends what is left and
    /// waits. Call it after the forward, before the backward. It waits for the background
    /// quorum's answer and applies it, unless this group heals in it (the weights must not
    /// change between a forward and its backward): that step's average then waits for
    /// backward, as it does without this call, and so does a group of several ranks (its
    /// `replicate` or `fully_shard` reduces within the group first), torchft's wire, and a
    /// step that already failed.
    ///
    /// A gradient accumulated again after its chunk left (a second backward after this
    /// call, as in gradient accumulation: call this before the last backward only) fails
    /// the step on every member: what left was not the step's gradient.
    ///
    /// ```no_run
    /// # use tch::nn::Module;
    /// # fn demo(ft: &mut tch_dist::ft::Manager, vs: &tch::nn::VarStore, opt: &mut tch_dist::optim::Optimizer, net: &tch::nn::Linear, x: &tch::Tensor) -> Result<(), Box<dyn std::error::Error>> {
    /// ft.start_quorum(vs, opt)?;
    /// opt.zero_grad();
    /// let loss = net.forward(x).square().mean(None);
    /// ft.prepare_for_backward(vs, opt)?;
    /// loss.backward(); // the average's chunks leave as their gradients are ready
    /// ft.allreduce_gradients(vs, opt)?;
    /// if ft.should_commit()? {
    ///     opt.step()?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn prepare_for_backward(
        &mut self,
        vs: &tch::nn::VarStore,
        opt: &mut Optimizer,
    ) -> Result<(), FtError> {
        if self.group.world_size() > 1 || self.opts.wire != Wire::TchDist || self.averaged {
            return Ok(());
        }
        if let Some(pending) = self.pending.take() {
            let answer = pending.answer();
            let heals_here =
                matches!(&answer, Ok(a) if heal_plan(a, self.opts.init_sync).0.is_some());
            if heals_here {
                self.pending = Some(Asked::Answered(answer));
                return Ok(());
            }
            self.apply_quorum(answer, true, vs, opt)?;
        }
        let Some(current) = self.current.as_ref().filter(|c| c.participating) else {
            return Ok(());
        };
        if self.errored.is_some() {
            return Ok(());
        }
        let pg = current.pg.clone();
        let rank = self.group.rank();
        self.ensure_buffer(heal::parameters(opt, vs));
        let Some(buffer) = self.buffer.as_ref() else {
            return Ok(());
        };
        if !self.overlap.as_ref().is_some_and(|o| o.serves(buffer)) {
            let hooks =
                average::Overlap::new(buffer, rank).map_err(|source| FtError::Collective {
                    replica: self.replica_id.clone(),
                    group_rank: rank,
                    op: "hooking the gradients for the average",
                    source: Box::new(source),
                })?;
            self.overlap = Some(hooks);
        }
        if let Some(overlap) = &self.overlap {
            overlap.arm(average::Step::new(&pg, buffer));
        }
        Ok(())
    }

    /// Makes the average's buffer for `params` (the optimizer's, in any order) anew unless
    /// the one kept serves them (the hooks of the old one go with it); without parameters
    /// there is none.
    fn ensure_buffer(&mut self, params: Vec<(String, Tensor)>) {
        let params = average::buffer_order(params);
        let Some(kind) = average_kind(&params) else {
            self.overlap = None;
            self.buffer = None;
            return;
        };
        if !self
            .buffer
            .as_ref()
            .is_some_and(|b| b.serves(&params, kind))
        {
            self.overlap = None;
            self.buffer = Some(average::Buffer::new(&params, kind, self.group.rank()));
        }
    }

    /// The average itself (see [`allreduce_gradients`](Self::allreduce_gradients)).
    fn average(&mut self, vs: &tch::nn::VarStore, opt: &Optimizer) {
        let armed = self.overlap.as_ref().and_then(average::Overlap::take);
        let Some(current) = &self.current else {
            if let Some(step) = armed {
                step.drain();
            }
            self.fail("no quorum".into());
            return;
        };
        let failed_here = self.errored.is_some();
        let params = heal::parameters(opt, vs);
        if let Wire::TorchftDdp(wire) = &self.opts.wire {
            // torchft's member whose step failed makes no collective (its `allreduce` is a
            // no-op after an error): the others' fail at their timeout, and none commits.
            if failed_here {
                return;
            }
            let contribution = if current.participating {
                torchft_ddp::Contribution::Gradients
            } else {
                torchft_ddp::Contribution::Zeros
            };
            let averaged = wire.arrange(&params).and_then(|arranged| {
                torchft_ddp::average(
                    &current.pg,
                    wire,
                    &arranged,
                    contribution,
                    current.participants,
                    self.group.rank(),
                )
            });
            if let Err(e) = averaged {
                self.fail(format!("averaging the gradients on torchft's wire: {e}"));
            }
            return;
        }
        let (pg, id) = (current.pg.clone(), current.id);
        let (participating, participants) = (current.participating, current.participants);
        self.ensure_buffer(params);
        let Some(buffer) = self.buffer.as_ref() else {
            return;
        };
        // The step the hooks fed during backward, if armed (prepare_for_backward) on this
        // buffer; else one that starts now.
        let step = match armed {
            Some(step) if step.serves(buffer) => step,
            other => {
                if let Some(stale) = other {
                    stale.drain();
                }
                average::Step::new(&pg, buffer)
            }
        };
        if let Some(fqn) = step.accumulated_again() {
            let why = format!(
                "the gradient of `{fqn}` was accumulated again after its part of the average \
                 had left: call prepare_for_backward before the step's last backward only"
            );
            self.fail(why);
        }
        // (The step may have failed just now.)
        let failed_here = self.errored.is_some();
        let contributes = participating && !failed_here;
        match step.finish(contributes, failed_here, participants, self.group.rank()) {
            Err(e) => self.fail(format!("averaging the gradients: {e}")),
            Ok(failed) if failed > 0.0 => self.fail(format!(
                "{failed} member(s) of quorum {id} failed this step"
            )),
            Ok(_) => {}
        }
    }

    /// Ends the step: this rank's vote (no failure recorded, the gradients averaged, and at
    /// least `min_replica_size` participants) and the group's decision, true only when every
    /// rank of the group voted true. A step without
    /// [`allreduce_gradients`](Self::allreduce_gradients) is not committed: its gradients
    /// are this group's alone. On true the step counts (step the optimizer then); on false
    /// nothing of the step may be applied, and the next quorum rebuilds the cross-group
    /// group (a reported commit failure gives it a new id).
    ///
    /// ```no_run
    /// # fn demo(ft: &mut tch_dist::ft::Manager, opt: &mut tch_dist::optim::Optimizer) -> Result<(), Box<dyn std::error::Error>> {
    /// if ft.should_commit()? {
    ///     opt.step()?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn should_commit(&mut self) -> Result<bool, FtError> {
        if !self.averaged {
            // Nothing of this step was averaged: committing would step this group on its
            // own gradients alone.
            self.drop_pending();
            self.fail("the step's gradients were not averaged (allreduce_gradients)".into());
        }
        let participants = self.participants();
        if participants < self.opts.min_replica_size as i64 {
            self.fail(format!(
                "{participants} participant(s), fewer than min_replica_size {}",
                self.opts.min_replica_size
            ));
        }
        let vote = self.errored.is_none();
        // The group's decision is every rank's vote; a group of one rank decides alone (no
        // call to its manager).
        let decision = if self.group.world_size() == 1 {
            vote
        } else {
            self.client
                .should_commit(
                    self.group.rank() as i64,
                    self.step,
                    vote,
                    self.opts.quorum_timeout,
                )
                .map_err(|e| self.control(e))?
        };
        if decision {
            self.step += 1;
            self.batches_committed += self.participants();
            self.commit_failures = 0;
        } else {
            self.commit_failures += 1;
        }
        Ok(decision)
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        if let Some(current) = self.current.take() {
            current.pg.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unusable_options_are_named() {
        let base = FtOptions::new("replica_0", "http://127.0.0.1:1");
        let refused = |opts: FtOptions| opts.check().unwrap_err().to_string();
        assert_eq!(
            refused(FtOptions {
                replica_id: "a:b".into(),
                ..base.clone()
            }),
            "fault tolerance: replica_id \"a:b\" must be a non-empty name without ':' (a unique \
             suffix follows one)"
        );
        assert_eq!(
            refused(FtOptions {
                min_replica_size: 0,
                ..base.clone()
            }),
            "fault tolerance: min_replica_size must be at least 1"
        );
        assert_eq!(
            refused(FtOptions {
                timeout: Duration::ZERO,
                ..base.clone()
            }),
            "fault tolerance: timeout must be longer than zero"
        );
        let torchft = Wire::TorchftDdp(TorchftDdp {
            order: vec!["fc.weight".into()],
            bucket_cap_bytes: None,
        });
        assert_eq!(
            refused(FtOptions {
                wire: torchft.clone(),
                ..base.clone()
            }),
            "fault tolerance: torchft's wire needs init_sync false (torchft's init_sync=False on \
             the Python groups too): healing does not cross languages, so every group starts \
             from the same weights"
        );
        assert!(FtOptions {
            wire: torchft,
            init_sync: false,
            ..base
        }
        .check()
        .is_ok());
    }
}
