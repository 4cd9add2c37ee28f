//! The runtime's errors: every engine failure and every refused argument reaches Rust as one
//! of these values, with the rank, the operation and what went wrong as fields.
//!
//! Messages follow one shape, `rank R: OP ...: what`, and name the rank, the operation and the
//! parameter (FQN) once. Text only enters where the engine speaks (`cause`: what c10d or
//! Gloo said) and where a value crosses libtorch's autograd engine as a message (a failed
//! backward pass); the reducer keeps the typed value and returns it from the next call.

use std::fmt;
use std::time::Duration;

use tch::{Device, Kind};

pub use crate::step_check::{Phase, StepPosition};

/// An error from tch-dist's runtime.
///
/// ```
/// use tch_dist_runtime::DistError;
/// let e = DistError::PeerGone { rank: 0, op: "all_reduce", peer: Some(1), cause: "Connection closed by peer".into() };
/// assert_eq!(e.to_string(), "rank 0: all_reduce failed: rank 1 closed the connection");
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// A launch variable (RANK, WORLD_SIZE, MASTER_PORT, ...) is missing or malformed.
    #[error("invalid launch environment: {0}")]
    Env(#[from] EnvError),
    /// Connecting to the rendezvous store or creating the backends failed.
    #[error("rank {rank}: rendezvous with {addr}:{port} failed: {problem}")]
    Rendezvous {
        /// This process's rank.
        rank: usize,
        /// MASTER_ADDR.
        addr: String,
        /// MASTER_PORT.
        port: u16,
        /// What went wrong (boxed, as `problem` below).
        problem: Box<RendezvousError>,
    },
    /// The engine failed an operation (a collective, a point-to-point transfer, a hook
    /// registration) for a reason other than a timeout or a departed peer.
    #[error("rank {rank}: {op} failed: {cause}")]
    Collective {
        /// This process's rank in the group.
        rank: usize,
        /// The operation, named as in torch.distributed.
        op: &'static str,
        /// What the engine said.
        cause: String,
    },
    /// A peer closed its connection in the middle of an operation: it exited or crashed.
    #[error("rank {rank}: {op} failed: {}", PeerText(*peer))]
    PeerGone {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The peer's rank in the group, where it is known (a group of two, a
        /// point-to-point transfer).
        peer: Option<usize>,
        /// What the engine said.
        cause: String,
    },
    /// A wait gave up after `timeout`.
    #[error("rank {rank}: {op} timed out after {timeout:?}")]
    Timeout {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The limit that passed.
        timeout: Duration,
    },
    /// An argument is out of range or inconsistent; nothing was sent.
    #[error("rank {rank}: invalid argument to {op}: {problem}")]
    InvalidArgument {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What is wrong (boxed: it keeps every `Result` of the runtime small).
        problem: Box<ArgumentError>,
    },
    /// The ranks passed different things to an operation that needs the same on every rank;
    /// every rank reports the first difference.
    #[error("rank {rank}: {op}: {mismatch}")]
    Mismatch {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What differs, and on which ranks (boxed, as `problem` above).
        mismatch: Box<Mismatch>,
    },
    /// With `TCH_DIST_DEBUG=DETAIL` (PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`): the ranks
    /// called different collectives, or a rank did not reach the check that runs before each
    /// collective; nothing was sent.
    #[error("rank {rank}: {op}: {desync}")]
    Desync {
        /// This process's rank in the group.
        rank: usize,
        /// The operation this rank called.
        op: &'static str,
        /// What each rank called (boxed, as `problem` above).
        desync: Box<Desync>,
    },
    /// Other ranks failed a check of their own (their errors say which), so this rank
    /// stopped too; nothing was sent or changed.
    #[error(
        "rank {rank}: {op}: {} failed {} (see {} error); nothing was changed",
        RankList(ranks),
        if ranks.len() == 1 { "its own check" } else { "their own checks" },
        if ranks.len() == 1 { "its" } else { "their" }
    )]
    PeersFailed {
        /// This process's rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The ranks that failed.
        ranks: Vec<usize>,
    },
    /// `static_graph`: a parameter's use changed after the first iteration.
    #[error(
        "rank {rank}: replicate: the training graph changed in this iteration: `{fqn}` {} in \
         the first iteration but {} in this one, which static_graph=true does not allow",
        if *used_in_first_pass { "got a gradient" } else { "got no gradient" },
        if *used_in_first_pass { "none" } else { "one" }
    )]
    GraphChanged {
        /// This process's rank.
        rank: usize,
        /// The parameter whose use changed.
        fqn: String,
        /// Whether it got a gradient in the first iteration.
        used_in_first_pass: bool,
    },
    /// The previous backward pass left parameters without a gradient (PyTorch's
    /// "Expected to have finished reduction in the prior iteration" error, whose wording
    /// names the rank again where it lists the parameters).
    #[error(
        "rank {rank}: replicate failed: Expected to have finished reduction in the prior iteration \
         before starting a new one. This error indicates that your module has parameters that \
         were not used in producing loss. You can enable unused parameter detection by passing \
         `find_unused_parameters: true` in replicate::Options, and by making sure all forward \
         outputs participate in calculating loss. Parameter indices which did not receive \
         grad: {}. Parameters which did not receive grad for rank {rank}: {}",
        Joined(indices, " "),
        Joined(fqns, ", ")
    )]
    UnfinishedReduction {
        /// This process's rank.
        rank: usize,
        /// The parameters' indices in registration order.
        indices: Vec<usize>,
        /// The parameters' FQNs, in the same order.
        fqns: Vec<String>,
    },
    /// A parameter's gradient changed after its all-reduce had started (it was marked ready
    /// twice in one backward pass).
    #[error(
        "rank {rank}: replicate: parameter `{fqn}` received a gradient after its all-reduce \
         had started (it was marked ready twice in one backward pass, e.g. used in several \
         reentrant backward passes or outside forward)"
    )]
    GradientAfterLaunch {
        /// This process's rank.
        rank: usize,
        /// The parameter.
        fqn: String,
    },
    /// A key-value store operation (c10d's TCPStore) failed or timed out.
    #[error("store {op} of `{key}` failed: {cause}")]
    Store {
        /// The operation: `set`, `get`, `add`, `prefix`.
        op: &'static str,
        /// The key (or prefix).
        key: String,
        /// What the engine said.
        cause: String,
    },
    /// The group was shut down ([`ProcessGroup::shutdown`](crate::ProcessGroup::shutdown) or
    /// [`destroy_process_group`](crate::destroy_process_group)) before this operation, on
    /// this handle or on any clone of it.
    #[error(
        "rank {rank}: {op} failed: the process group was shut down (ProcessGroup::shutdown or \
         destroy_process_group)"
    )]
    ShutDown {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
    },
    /// Two ranks of an NCCL group would use the same GPU (NCCL refuses them with "Duplicate
    /// GPU detected"); every rank reports the same pair, the first in rank order.
    #[error(
        "rank {rank}: init_process_group: rank {first} (cuda:{first_device}) and rank {second} \
         (cuda:{second_device}) on {host} use the same GPU{}; NCCL needs a GPU per rank: start at \
         most one rank per GPU, or give each rank its own device_id",
        gpu.as_ref().map(|g| format!(" ({g})")).unwrap_or_default()
    )]
    DuplicateDevice {
        /// This process's rank.
        rank: usize,
        /// The lower rank of the pair.
        first: usize,
        /// Its CUDA device index.
        first_device: usize,
        /// The higher rank of the pair.
        second: usize,
        /// Its CUDA device index (another index can name the same GPU under another
        /// CUDA_VISIBLE_DEVICES).
        second_device: usize,
        /// The host both run on.
        host: String,
        /// The GPU's UUID, where CUDA reported it.
        gpu: Option<String>,
    },
    /// No default process group exists yet.
    #[error("the default process group is not initialized; call init_process_group first")]
    NotInitialized,
    /// `init_process_group` was called while a default group exists.
    #[error("the default process group is already initialized; call destroy_process_group first")]
    AlreadyInitialized,
    /// An object collective received a pickle tch-dist does not read (from a PyTorch rank
    /// that sent something other than a `str` or `bytes`).
    #[error("rank {rank}: {op}: the object from rank {from} cannot be read: {problem}")]
    Object {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The group rank whose object it is.
        from: usize,
        /// What is wrong with it.
        problem: PickleError,
    },
    /// A backend string that is none of PyTorch's that tch-dist has.
    #[error("unknown backend {value:?}: expected \"gloo\", \"nccl\" or \"cpu:gloo,cuda:nccl\"")]
    UnknownBackend {
        /// The string.
        value: String,
    },
}

impl From<std::convert::Infallible> for DistError {
    fn from(never: std::convert::Infallible) -> DistError {
        match never {}
    }
}

/// The runtime's result type.
pub type Result<T, E = DistError> = std::result::Result<T, E>;

/// What is wrong with the launch environment (the variables torchrun, Slurm or
/// `tch-dist-run` set, or the explicit [`InitOptions`](crate::InitOptions)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// Neither RANK nor SLURM_PROCID is set.
    #[error(
        "neither RANK (torchrun, tch-dist-run) nor SLURM_PROCID is set; start the program \
         with tch-dist-run, torchrun or srun"
    )]
    NoRank,
    /// Neither WORLD_SIZE nor SLURM_NTASKS is set.
    #[error("neither WORLD_SIZE nor SLURM_NTASKS is set")]
    NoWorldSize,
    /// A variable that must hold a non-negative integer does not.
    #[error("{var}={value:?} is not a non-negative integer")]
    NotAnInteger {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// The world size is zero.
    #[error("{var}=0: the world size must be at least 1")]
    ZeroWorldSize {
        /// WORLD_SIZE or SLURM_NTASKS.
        var: &'static str,
    },
    /// The rank is not below the world size.
    #[error("{rank_var}={rank} is out of range for {world_var}={world_size} (ranks are 0..{world_size})")]
    RankOutOfRange {
        /// RANK or SLURM_PROCID (`rank` for explicit options).
        rank_var: &'static str,
        /// The rank.
        rank: usize,
        /// WORLD_SIZE or SLURM_NTASKS (`world_size` for explicit options).
        world_var: &'static str,
        /// The world size.
        world_size: usize,
    },
    /// MASTER_ADDR is set but empty.
    #[error("MASTER_ADDR is empty")]
    EmptyMasterAddr,
    /// MASTER_ADDR is needed and not set.
    #[error("MASTER_ADDR is not set (the rendezvous host, rank 0's address)")]
    NoMasterAddr,
    /// MASTER_PORT is not a port number.
    #[error("MASTER_PORT={value:?} is not a port number (1-65535)")]
    BadPort {
        /// Its value.
        value: String,
    },
    /// TCH_DIST_TIMEOUT_SECS is not a positive number.
    #[error("TCH_DIST_TIMEOUT_SECS={value:?} is not a positive number")]
    BadTimeout {
        /// Its value.
        value: String,
    },
    /// NCCL was asked for, but this build of tch-dist has no NCCL support.
    #[error("tch-dist was built without NCCL support")]
    NcclNotCompiled,
    /// The CUDA device a rank would bind (its local rank, or an explicit `device_id`) does
    /// not exist in this process.
    #[error(
        "{from} {device} names CUDA device {device}, but this process sees {count} CUDA \
         device(s); start at most one rank per GPU (or set device_id, CUDA_VISIBLE_DEVICES)"
    )]
    DeviceOutOfRange {
        /// Where the index came from: `LOCAL_RANK` (the local rank) or `device_id`.
        from: &'static str,
        /// The index.
        device: usize,
        /// How many CUDA devices this process sees.
        count: usize,
    },
    /// TCH_DIST_DEBUG (or TORCH_DISTRIBUTED_DEBUG) is not a debug level.
    #[error("{var}={value:?} is not a debug level (OFF, INFO or DETAIL)")]
    BadDebugLevel {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// A test switch (TCH_DIST_NO_SHORTCUTS, TCH_DIST_CUDA_VIA_GLOO) has a value that is not
    /// a switch.
    #[error("{var}={value:?} is not a switch (1, true, yes, on; or 0, false, no, off)")]
    BadSwitch {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
}

/// Why a pickle is not one tch-dist reads (the `problem` of [`DistError::Object`]): it reads
/// one `str` or `bytes` and nothing else, so that no received object runs code.
///
/// ```
/// use tch_dist_runtime::{Object, PickleError};
/// // pickle.dumps(5): an int
/// let err = Object::from_pickle(b"\x80\x04K\x05.").unwrap_err();
/// assert_eq!(err, PickleError::Unsupported { opcode: b'K', at: 2 });
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PickleError {
    /// The data ends inside an opcode or its argument.
    #[error("it ends early, at byte {at}")]
    Truncated {
        /// Where the opcode that runs past the end starts.
        at: usize,
    },
    /// An opcode outside the subset (a value other than one str or bytes).
    #[error(
        "opcode 0x{opcode:02x} at byte {at} is outside what tch-dist reads (one str or bytes)"
    )]
    Unsupported {
        /// The opcode.
        opcode: u8,
        /// Its offset.
        at: usize,
    },
    /// It stops before any value.
    #[error("it holds no value")]
    Empty,
    /// A second value follows the first.
    #[error("a second value starts at byte {at} (tch-dist reads one str or bytes)")]
    Several {
        /// Where the second value starts.
        at: usize,
    },
    /// A `str` whose bytes are not UTF-8.
    #[error("its str is not UTF-8")]
    NotUtf8,
}

/// Why a rendezvous failed (the `problem` of [`DistError::Rendezvous`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// MASTER_ADDR names no host the resolver knows.
    #[error("MASTER_ADDR `{host}` does not resolve: {cause}")]
    UnresolvableHost {
        /// MASTER_ADDR.
        host: String,
        /// What the resolver said.
        cause: String,
    },
    /// Nothing accepted a connection at MASTER_ADDR:MASTER_PORT within the timeout.
    #[error(
        "no rendezvous store accepted a connection within {timeout:?} (last attempt: {cause}); \
         rank 0 hosts it: is rank 0 running, with the same MASTER_ADDR and MASTER_PORT?"
    )]
    NobodyListening {
        /// The timeout that passed.
        timeout: Duration,
        /// What the last connection attempt got.
        cause: String,
    },
    /// Ranks of the group never joined its rendezvous within the timeout.
    #[error(
        "{} never joined within {timeout:?}{}",
        RankList(ranks),
        Refused(refused)
    )]
    NeverJoined {
        /// The ranks that never joined.
        ranks: Vec<usize>,
        /// The timeout that passed.
        timeout: Duration,
        /// Processes of other runs that came as one of those ranks and were refused, as
        /// (rank, their run id).
        refused: Vec<(usize, String)>,
    },
    /// The store at MASTER_ADDR:MASTER_PORT belongs to another run (TORCHELASTIC_RUN_ID,
    /// which `tch-dist-run` and torchrun set); this rank did not join it.
    #[error(
        "this rank belongs to run `{mine}` but the rendezvous store there belongs to run \
         `{theirs}` (TORCHELASTIC_RUN_ID): is MASTER_PORT another job's?"
    )]
    OtherRun {
        /// This rank's run id.
        mine: String,
        /// The run id of the ranks that created the store.
        theirs: String,
    },
    /// Fewer ranks than the world size checked in at a store-side count by the timeout: the
    /// TCPStore's worker count (`init/`, rank 0 waits for it) or PyTorch's store-based
    /// barrier; used when the store cannot tell which ranks are missing.
    #[error("{what}: {joined} of {world_size} ranks checked in within {timeout:?}")]
    NotAllCheckedIn {
        /// The count that fell short.
        what: &'static str,
        /// How many checked in (-1: the store could not say).
        joined: i64,
        /// How many should have.
        world_size: usize,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// The engine failed the rendezvous for another reason.
    #[error("{cause}")]
    Engine {
        /// What the engine said.
        cause: String,
    },
}

/// What `TCH_DIST_DEBUG=DETAIL` found (the `desync` of [`DistError::Desync`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Desync {
    /// The ranks called different collectives, or the same with other tensors: each rank's
    /// call, in rank order.
    #[error(
        "the ranks called different collectives (TCH_DIST_DEBUG=DETAIL checks each one before \
         it runs): {}; nothing was sent",
        Calls(calls)
    )]
    Differ {
        /// Every rank's call, in rank order.
        calls: Vec<CollectiveCall>,
    },
    /// Seen from rank 0, which runs the check: ranks did not reach this collective.
    #[error(
        "{} {} (rank {} called {}; TCH_DIST_DEBUG=DETAIL checks that every rank calls each \
         collective before it runs)",
        MaybeRanks(ranks),
        Gone(*within, "without reaching this collective", "did not reach this collective"),
        call.rank,
        call
    )]
    Missing {
        /// This rank's call.
        call: CollectiveCall,
        /// The ranks that did not reach it (empty: the engine did not say).
        ranks: Vec<usize>,
        /// `Some(timeout)`: they did not arrive within it; `None`: a connection closed
        /// before the timeout (a rank left).
        within: Option<Duration>,
        /// What the engine said.
        cause: String,
    },
    /// Seen from the other ranks: rank 0, which runs the check, did not confirm that every
    /// rank reached this collective.
    #[error(
        "rank {} called {}, but rank 0 {} that every rank called it (see rank 0's error; \
         TCH_DIST_DEBUG=DETAIL checks each collective before it runs)",
        call.rank,
        call,
        Confirm(*within)
    )]
    Unconfirmed {
        /// This rank's call.
        call: CollectiveCall,
        /// `Some(timeout)`: rank 0 did not answer within it; `None`: its connection closed.
        within: Option<Duration>,
        /// What the engine said.
        cause: String,
    },
}

/// One rank's collective as `TCH_DIST_DEBUG=DETAIL` checks it (c10d's collective
/// fingerprint, and a broadcast's root): written `all_reduce of [4] (Float) on Cpu as its
/// collective 3`, `broadcast from rank 1 of [4] (Float) on Cpu as its collective 0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveCall {
    /// The rank that called it.
    pub rank: usize,
    /// How many collectives the rank's backend ran before it (c10d's sequence number).
    pub seq: u64,
    /// The operation, named as in torch.distributed.
    pub op: String,
    /// The tensors the check compares (none for a barrier or an all-to-all).
    pub tensors: Vec<CallTensor>,
    /// A broadcast's source rank.
    pub root: Option<usize>,
}

/// A tensor of a [`CollectiveCall`]: its shape, dtype and device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallTensor {
    /// Shape and dtype.
    pub signature: TensorSignature,
    /// Device.
    pub device: Device,
}

impl fmt::Display for CollectiveCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.describe(f)?;
        write!(f, " as its collective {}", self.seq)
    }
}

impl CollectiveCall {
    /// `all_reduce of [4] (Float) on Cpu`: the call without its rank and number.
    fn describe(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.op)?;
        if let Some(root) = self.root {
            write!(f, " from rank {root}")?;
        }
        let Some(first) = self.tensors.first() else {
            return Ok(());
        };
        f.write_str(" of ")?;
        let one_device = self.tensors.iter().all(|t| t.device == first.device);
        for (i, t) in self.tensors.iter().enumerate() {
            if i > 0 {
                f.write_str(" and ")?;
            }
            write!(f, "{}", t.signature)?;
            if !one_device {
                write!(f, " on {:?}", t.device)?;
            }
        }
        if one_device {
            write!(f, " on {:?}", first.device)?;
        }
        Ok(())
    }

    /// The same call, ignoring the rank.
    fn same_as(&self, other: &CollectiveCall) -> bool {
        (self.seq, &self.op, &self.tensors, self.root)
            == (other.seq, &other.op, &other.tensors, other.root)
    }
}

/// `rank 0 called X as its collective 3, ranks 1 and 2 called Y as their collective 3`:
/// consecutive ranks with the same call are named together.
struct Calls<'a>(&'a [CollectiveCall]);

impl fmt::Display for Calls<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        let mut first = true;
        while let Some(call) = rest.first() {
            let n = rest.iter().take_while(|c| c.same_as(call)).count();
            let ranks: Vec<usize> = rest[..n].iter().map(|c| c.rank).collect();
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{} called ", RankList(&ranks))?;
            struct Described<'a>(&'a CollectiveCall);
            impl fmt::Display for Described<'_> {
                fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    self.0.describe(f)
                }
            }
            write!(
                f,
                "{} as {} collective {}",
                Described(call),
                if n == 1 { "its" } else { "their" },
                call.seq
            )?;
            rest = &rest[n..];
        }
        Ok(())
    }
}

/// `rank 1` / `ranks 1 and 2` / `a rank` (not known).
struct MaybeRanks<'a>(&'a [usize]);

impl fmt::Display for MaybeRanks<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("a rank")
        } else {
            write!(f, "{}", RankList(self.0))
        }
    }
}

/// `did not reach this collective within 5s`, or `left (closed its connection) without
/// reaching this collective`.
struct Gone(Option<Duration>, &'static str, &'static str);

impl fmt::Display for Gone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(t) => write!(f, "{} within {t:?}", self.2),
            None => write!(f, "left (closed the connection) {}", self.1),
        }
    }
}

/// `did not confirm within 5s` or `closed its connection before confirming`.
struct Confirm(Option<Duration>);

impl fmt::Display for Confirm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(t) => write!(f, "did not confirm within {t:?}"),
            None => f.write_str("closed its connection before confirming"),
        }
    }
}

/// ` (a process of run `b` came as rank 1 and was refused)`, or nothing.
struct Refused<'a>(&'a [(usize, String)]);

impl fmt::Display for Refused<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (rank, run)) in self.0.iter().enumerate() {
            f.write_str(if i == 0 { " (" } else { "; " })?;
            write!(
                f,
                "a process of run `{run}` came as rank {rank} and was refused"
            )?;
        }
        if !self.0.is_empty() {
            f.write_str(")")?;
        }
        Ok(())
    }
}

/// What is wrong with an argument (the `problem` of [`DistError::InvalidArgument`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ArgumentError {
    /// A rank argument (`what`: "source rank", "peer rank", "src_rank", "dst", ...) is not in
    /// the group.
    #[error("{what} {rank} is not in a group of size {world_size}")]
    RankNotInGroup {
        /// Which argument.
        what: &'static str,
        /// Its value.
        rank: usize,
        /// The group's size.
        world_size: usize,
    },
    /// A point-to-point operation names this rank as its peer.
    #[error("a rank cannot send to or receive from itself")]
    SelfPeer,
    /// `new_group` got no ranks.
    #[error("the rank list is empty")]
    EmptyRankList,
    /// `new_group` got a rank twice.
    #[error("rank {rank} is listed twice")]
    DuplicateRank {
        /// The repeated rank.
        rank: usize,
    },
    /// A numeric option that must be positive is not.
    #[error("{option} must be positive, got {value}")]
    NotPositive {
        /// The option's name.
        option: &'static str,
        /// Its value.
        value: f64,
    },
    /// PowerSGD's rank is zero.
    #[error("PowerSGD: matrix_approximation_rank must be at least 1")]
    PowerSgdRank,
    /// PowerSGD with error feedback or warm start needs to start after the rebuild.
    #[error(
        "PowerSGD: expected start_powersgd_iter > 1 if use_error_feedback or warm_start is \
         enabled (got {start_powersgd_iter}), because PowerSGD can only be applied after the \
         buckets are rebuilt at the end of the first step"
    )]
    PowerSgdStartIter {
        /// The value given.
        start_powersgd_iter: u64,
    },
    /// PowerSGD's `min_compression_rate` is negative or not a number.
    #[error("PowerSGD: min_compression_rate must be a non-negative number, got {value}")]
    PowerSgdCompressionRate {
        /// The value given.
        value: f64,
    },
    /// A parameter handed to the reducer does not require grad.
    #[error("parameter `{fqn}` does not require grad")]
    NoGrad {
        /// The parameter.
        fqn: String,
    },
    /// The parameters handed to the reducer live on different devices.
    #[error(
        "parameter `{fqn}` is on {device:?} but `{first_fqn}` is on {first_device:?}; a \
         replicated module lives on one device"
    )]
    MixedDevices {
        /// The parameter on another device.
        fqn: String,
        /// Its device.
        device: Device,
        /// The first parameter.
        first_fqn: String,
        /// Its device.
        first_device: Device,
    },
    /// A sharding spec or metadata does not fit (see
    /// [`ShardingError`](tch_dist_core::sharding::ShardingError)).
    #[error(transparent)]
    Sharding(#[from] tch_dist_core::sharding::ShardingError),
    /// A placement names a rank outside the group.
    #[error("placement `{placement}` names rank {}, but the group has {world_size} ranks", placement.rank())]
    PlacementRank {
        /// The placement.
        placement: tch_dist_core::sharding::Placement,
        /// The group's size.
        world_size: usize,
    },
    /// A placement needs CUDA, which this process does not have.
    #[error("placement `{placement}` needs CUDA, which is not available")]
    PlacementNeedsCuda {
        /// The placement.
        placement: tch_dist_core::sharding::Placement,
    },
    /// The local shards handed over are not the ones the metadata places on this rank.
    #[error(
        "the global metadata places {expected} shard(s) on this rank, got {got} that do not \
         match it"
    )]
    LocalShards {
        /// How many the metadata places here.
        expected: usize,
        /// How many were given.
        got: usize,
    },
    /// A local shard's shape or dtype differs from its metadata.
    #[error("a local shard is {actual}, its metadata says {expected}")]
    LocalShardSignature {
        /// What the tensor is.
        actual: TensorSignature,
        /// What the metadata says.
        expected: TensorSignature,
    },
    /// `local_tensor()` needs exactly one local shard.
    #[error("local_tensor() needs exactly one local shard, this rank holds {held}")]
    LocalTensorCount {
        /// How many this rank holds.
        held: usize,
    },
    /// This rank should hold a shard and does not.
    #[error("this rank should hold the shard at offsets {offsets:?} but does not")]
    MissingShard {
        /// The shard's offsets.
        offsets: Vec<i64>,
    },
}

/// A tensor's shape and dtype, as ranks compare them (written `[8, 4] (Float)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSignature {
    /// The shape.
    pub shape: Vec<i64>,
    /// The element type.
    pub kind: Kind,
}

impl fmt::Display for TensorSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} ({:?})", self.shape, self.kind)
    }
}

/// One entry of a list of tensors the ranks compare: its name and signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedSignature {
    /// The tensor's FQN.
    pub fqn: String,
    /// Its shape and dtype.
    pub signature: TensorSignature,
}

impl fmt::Display for NamedSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` with shape {:?} ({:?})",
            self.fqn, self.signature.shape, self.signature.kind
        )
    }
}

/// What differs across ranks (the `mismatch` of [`DistError::Mismatch`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Mismatch {
    /// A named tensor has another shape or dtype on `other_rank` than on `reference_rank`.
    #[error(
        "{what} differ across ranks: `{fqn}` has shape {:?} ({:?}) on rank {reference_rank} but \
         shape {:?} ({:?}) on rank {other_rank}",
        reference.shape, reference.kind, other.shape, other.kind
    )]
    Tensor {
        /// What the list holds ("parameters", "buffers").
        what: &'static str,
        /// The tensor's FQN.
        fqn: String,
        /// The rank whose list is the reference.
        reference_rank: usize,
        /// The tensor there.
        reference: TensorSignature,
        /// The rank that differs.
        other_rank: usize,
        /// The tensor there.
        other: TensorSignature,
    },
    /// The ranks' lists differ in length or names; `index` is the first entry that differs.
    #[error(
        "{what} differ across ranks: rank {reference_rank} has {reference_len} {what} and rank \
         {other_rank} has {other_len}; entry {index} is {} on rank {reference_rank} but {} on \
         rank {other_rank}",
        Entry(reference_entry.as_ref()),
        Entry(other_entry.as_ref())
    )]
    List {
        /// What the list holds ("parameters", "buffers").
        what: &'static str,
        /// The rank whose list is the reference.
        reference_rank: usize,
        /// Its length.
        reference_len: usize,
        /// The rank that differs.
        other_rank: usize,
        /// Its length.
        other_len: usize,
        /// The first differing position.
        index: usize,
        /// The entry there on the reference rank (`None`: its list is shorter).
        reference_entry: Option<NamedSignature>,
        /// The entry there on the other rank.
        other_entry: Option<NamedSignature>,
    },
    /// An option has different values on different ranks.
    #[error("option `{option}` differs across ranks: {}", RankValues(values))]
    OptionValue {
        /// The option's name.
        option: String,
        /// Its value on each rank, in rank order.
        values: Vec<String>,
    },
    /// One unnamed tensor (the source of a scatter) differs.
    #[error("rank {reference_rank} passes a tensor of shape {reference}, but rank {other_rank} passed {other}")]
    Shape {
        /// The rank whose tensor is the reference (the source).
        reference_rank: usize,
        /// Its tensor.
        reference: TensorSignature,
        /// The rank that differs.
        other_rank: usize,
        /// Its tensor.
        other: TensorSignature,
    },
    /// The always-on step check (`step_check.rs`): another rank is at another step or in
    /// another pass; nothing of this pass was sent.
    #[error(
        "rank {other_rank} is {other} while this rank is {this} (a rank skipped or repeated \
         a step, a forward or a backward)"
    )]
    Step {
        /// The rank that differs (the lowest one).
        other_rank: usize,
        /// Where it is.
        other: StepPosition,
        /// Where this rank is.
        this: StepPosition,
    },
}

/// `rank 1 closed the connection`, or `a peer ...` when the rank is not known.
struct PeerText(Option<usize>);

impl fmt::Display for PeerText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(p) => write!(f, "rank {p} closed the connection"),
            None => f.write_str("a peer closed the connection"),
        }
    }
}

/// `rank 1`, `ranks 1 and 3`, `ranks 1, 2 and 3`.
struct RankList<'a>(&'a [usize]);

impl fmt::Display for RankList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            [one] => write!(f, "rank {one}"),
            [rest @ .., last] => {
                f.write_str("ranks ")?;
                for (i, r) in rest.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{r}")?;
                }
                write!(f, " and {last}")
            }
            [] => f.write_str("no rank"),
        }
    }
}

/// `rank 0 has 25, rank 1 has 10`.
struct RankValues<'a>(&'a [String]);

impl fmt::Display for RankValues<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (rank, value) in self.0.iter().enumerate() {
            if rank > 0 {
                f.write_str(", ")?;
            }
            write!(f, "rank {rank} has {value}")?;
        }
        Ok(())
    }
}

/// Items joined by a separator.
struct Joined<'a, T>(&'a [T], &'static str);

impl<T: fmt::Display> fmt::Display for Joined<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, item) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(self.1)?;
            }
            write!(f, "{item}")?;
        }
        Ok(())
    }
}

/// A list entry, or `missing` past the list's end.
struct Entry<'a>(Option<&'a NamedSignature>);

impl fmt::Display for Entry<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(e) => write!(f, "{e}"),
            None => f.write_str("missing"),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The exact text of every variant: messages name the rank, the operation and the
    //! parameter once, in one shape.

    use super::*;
    use tch_dist_core::sharding::Placement;

    fn sig(shape: &[i64]) -> TensorSignature {
        TensorSignature {
            shape: shape.to_vec(),
            kind: Kind::Float,
        }
    }

    fn invalid(problem: ArgumentError) -> String {
        DistError::InvalidArgument {
            rank: 1,
            op: "op",
            problem: Box::new(problem),
        }
        .to_string()
    }

    #[test]
    fn dist_error_texts() {
        let cases: Vec<(DistError, &str)> = vec![
            (
                EnvError::NoRank.into(),
                "invalid launch environment: neither RANK (torchrun, tch-dist-run) nor \
                 SLURM_PROCID is set; start the program with tch-dist-run, torchrun or srun",
            ),
            (
                DistError::Rendezvous {
                    rank: 1,
                    addr: "10.0.0.1".into(),
                    port: 29500,
                    problem: Box::new(RendezvousError::Engine {
                        cause: "Connection refused".into(),
                    }),
                },
                "rank 1: rendezvous with 10.0.0.1:29500 failed: Connection refused",
            ),
            (
                DistError::Collective {
                    rank: 1,
                    op: "all_gather",
                    cause: "bad sizes".into(),
                },
                "rank 1: all_gather failed: bad sizes",
            ),
            (
                DistError::PeerGone {
                    rank: 0,
                    op: "all_reduce",
                    peer: Some(1),
                    cause: "Connection closed by peer".into(),
                },
                "rank 0: all_reduce failed: rank 1 closed the connection",
            ),
            (
                DistError::PeerGone {
                    rank: 0,
                    op: "all_reduce",
                    peer: None,
                    cause: "Connection closed by peer".into(),
                },
                "rank 0: all_reduce failed: a peer closed the connection",
            ),
            (
                DistError::Timeout {
                    rank: 2,
                    op: "barrier",
                    timeout: Duration::from_secs(10),
                },
                "rank 2: barrier timed out after 10s",
            ),
            (
                DistError::InvalidArgument {
                    rank: 1,
                    op: "send",
                    problem: Box::new(ArgumentError::SelfPeer),
                },
                "rank 1: invalid argument to send: a rank cannot send to or receive from itself",
            ),
            (
                DistError::Mismatch {
                    rank: 1,
                    op: "replicate",
                    mismatch: Box::new(Mismatch::Tensor {
                        what: "parameters",
                        fqn: "fc1.weight".into(),
                        reference_rank: 0,
                        reference: sig(&[8, 4]),
                        other_rank: 1,
                        other: sig(&[9, 4]),
                    }),
                },
                "rank 1: replicate: parameters differ across ranks: `fc1.weight` has shape [8, 4] \
                 (Float) on rank 0 but shape [9, 4] (Float) on rank 1",
            ),
            (
                DistError::PeersFailed {
                    rank: 0,
                    op: "replicate",
                    ranks: vec![1],
                },
                "rank 0: replicate: rank 1 failed its own check (see its error); nothing was \
                 changed",
            ),
            (
                DistError::PeersFailed {
                    rank: 0,
                    op: "replicate",
                    ranks: vec![1, 2, 3],
                },
                "rank 0: replicate: ranks 1, 2 and 3 failed their own checks (see their error); \
                 nothing was changed",
            ),
            (
                DistError::GraphChanged {
                    rank: 1,
                    fqn: "b".into(),
                    used_in_first_pass: true,
                },
                "rank 1: replicate: the training graph changed in this iteration: `b` got a \
                 gradient in the first iteration but none in this one, which static_graph=true \
                 does not allow",
            ),
            (
                DistError::GraphChanged {
                    rank: 1,
                    fqn: "b".into(),
                    used_in_first_pass: false,
                },
                "rank 1: replicate: the training graph changed in this iteration: `b` got no \
                 gradient in the first iteration but one in this one, which static_graph=true \
                 does not allow",
            ),
            (
                DistError::UnfinishedReduction {
                    rank: 0,
                    indices: vec![2, 3],
                    fqns: vec!["head.weight".into(), "head.bias".into()],
                },
                "rank 0: replicate failed: Expected to have finished reduction in the prior \
                 iteration before starting a new one. This error indicates that your module has \
                 parameters that were not used in producing loss. You can enable unused \
                 parameter detection by passing `find_unused_parameters: true` in \
                 replicate::Options, and by making sure all forward outputs participate in \
                 calculating loss. Parameter indices which did not receive grad: 2 3. \
                 Parameters which did not receive grad for rank 0: head.weight, head.bias",
            ),
            (
                DistError::GradientAfterLaunch {
                    rank: 1,
                    fqn: "fc.weight".into(),
                },
                "rank 1: replicate: parameter `fc.weight` received a gradient after its \
                 all-reduce had started (it was marked ready twice in one backward pass, e.g. \
                 used in several reentrant backward passes or outside forward)",
            ),
            (
                DistError::Store {
                    op: "get",
                    key: "epoch".into(),
                    cause: "wait timeout after 1000ms".into(),
                },
                "store get of `epoch` failed: wait timeout after 1000ms",
            ),
            (
                DistError::ShutDown {
                    rank: 1,
                    op: "all_reduce",
                },
                "rank 1: all_reduce failed: the process group was shut down \
                 (ProcessGroup::shutdown or destroy_process_group)",
            ),
            (
                DistError::DuplicateDevice {
                    rank: 1,
                    first: 0,
                    first_device: 0,
                    second: 1,
                    second_device: 0,
                    host: "gpu-node-3".into(),
                    gpu: Some("GPU-5e7c2a1b-0d3f-4c1e-9a2b-7f6e5d4c3b2a".into()),
                },
                "rank 1: init_process_group: rank 0 (cuda:0) and rank 1 (cuda:0) on gpu-node-3 \
                 use the same GPU (GPU-5e7c2a1b-0d3f-4c1e-9a2b-7f6e5d4c3b2a); NCCL needs a GPU per \
                 rank: start at most one rank per GPU, or give each rank its own device_id",
            ),
            (
                DistError::DuplicateDevice {
                    rank: 0,
                    first: 0,
                    first_device: 1,
                    second: 2,
                    second_device: 1,
                    host: "h".into(),
                    gpu: None,
                },
                "rank 0: init_process_group: rank 0 (cuda:1) and rank 2 (cuda:1) on h use the \
                 same GPU; NCCL needs a GPU per rank: start at most one rank per GPU, or give \
                 each rank its own device_id",
            ),
            (
                DistError::Desync {
                    rank: 1,
                    op: "all_reduce",
                    desync: Box::new(Desync::Differ {
                        calls: vec![
                            call(0, 3, "all_reduce", &[(&[4], Kind::Float)]),
                            call(1, 3, "all_reduce", &[(&[4], Kind::Int)]),
                        ],
                    }),
                },
                "rank 1: all_reduce: the ranks called different collectives (TCH_DIST_DEBUG=DETAIL \
                 checks each one before it runs): rank 0 called all_reduce of [4] (Float) on Cpu \
                 as its collective 3, rank 1 called all_reduce of [4] (Int) on Cpu as its \
                 collective 3; nothing was sent",
            ),
            (
                DistError::Desync {
                    rank: 0,
                    op: "broadcast",
                    desync: Box::new(Desync::Differ {
                        calls: vec![
                            CollectiveCall {
                                root: Some(0),
                                ..call(0, 1, "broadcast", &[(&[4], Kind::Float)])
                            },
                            CollectiveCall {
                                root: Some(1),
                                ..call(1, 1, "broadcast", &[(&[4], Kind::Float)])
                            },
                        ],
                    }),
                },
                "rank 0: broadcast: the ranks called different collectives (TCH_DIST_DEBUG=DETAIL \
                 checks each one before it runs): rank 0 called broadcast from rank 0 of [4] \
                 (Float) on Cpu as its collective 1, rank 1 called broadcast from rank 1 of [4] \
                 (Float) on Cpu as its collective 1; nothing was sent",
            ),
            (
                DistError::Desync {
                    rank: 0,
                    op: "all_reduce",
                    desync: Box::new(Desync::Missing {
                        call: call(0, 12, "all_reduce", &[(&[10], Kind::Float)]),
                        ranks: vec![1],
                        within: Some(Duration::from_secs(5)),
                        cause: "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 5000 ms"
                            .into(),
                    }),
                },
                "rank 0: all_reduce: rank 1 did not reach this collective within 5s (rank 0 \
                 called all_reduce of [10] (Float) on Cpu as its collective 12; \
                 TCH_DIST_DEBUG=DETAIL checks that every rank calls each collective before it \
                 runs)",
            ),
            (
                DistError::Desync {
                    rank: 0,
                    op: "barrier",
                    desync: Box::new(Desync::Missing {
                        call: call(0, 2, "barrier", &[]),
                        ranks: vec![1, 2],
                        within: None,
                        cause: String::new(),
                    }),
                },
                "rank 0: barrier: ranks 1 and 2 left (closed the connection) without reaching \
                 this collective (rank 0 called barrier as its collective 2; \
                 TCH_DIST_DEBUG=DETAIL checks that every rank calls each collective before it \
                 runs)",
            ),
            (
                DistError::Desync {
                    rank: 1,
                    op: "broadcast",
                    desync: Box::new(Desync::Unconfirmed {
                        call: call(1, 0, "broadcast", &[(&[2, 2], Kind::Double)]),
                        within: Some(Duration::from_secs(3)),
                        cause: String::new(),
                    }),
                },
                "rank 1: broadcast: rank 1 called broadcast of [2, 2] (Double) on Cpu as its \
                 collective 0, but rank 0 did not confirm within 3s that every rank called it \
                 (see rank 0's error; TCH_DIST_DEBUG=DETAIL checks each collective before it \
                 runs)",
            ),
            (
                DistError::Desync {
                    rank: 2,
                    op: "all_gather",
                    desync: Box::new(Desync::Unconfirmed {
                        call: call(2, 0, "all_gather", &[(&[1], Kind::Int64)]),
                        within: None,
                        cause: String::new(),
                    }),
                },
                "rank 2: all_gather: rank 2 called all_gather of [1] (Int64) on Cpu as its \
                 collective 0, but rank 0 closed its connection before confirming that every \
                 rank called it (see rank 0's error; TCH_DIST_DEBUG=DETAIL checks each \
                 collective before it runs)",
            ),
            (
                DistError::NotInitialized,
                "the default process group is not initialized; call init_process_group first",
            ),
            (
                DistError::AlreadyInitialized,
                "the default process group is already initialized; call destroy_process_group \
                 first",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
    }

    fn call(rank: usize, seq: u64, op: &str, tensors: &[(&[i64], Kind)]) -> CollectiveCall {
        CollectiveCall {
            rank,
            seq,
            op: op.into(),
            tensors: tensors
                .iter()
                .map(|(shape, kind)| CallTensor {
                    signature: TensorSignature {
                        shape: shape.to_vec(),
                        kind: *kind,
                    },
                    device: Device::Cpu,
                })
                .collect(),
            root: None,
        }
    }

    /// Ranks with the same call are named together; a call's tensors on several devices
    /// name each device.
    #[test]
    fn desync_calls_group_ranks() {
        let mut on_cuda = call(
            2,
            5,
            "reduce_scatter_tensor",
            &[(&[8], Kind::Half), (&[4], Kind::Half)],
        );
        on_cuda.tensors[1].device = Device::Cuda(1);
        let d = Desync::Differ {
            calls: vec![
                call(0, 5, "barrier", &[]),
                call(1, 5, "barrier", &[]),
                on_cuda,
                call(3, 4, "barrier", &[]),
            ],
        };
        assert_eq!(
            d.to_string(),
            "the ranks called different collectives (TCH_DIST_DEBUG=DETAIL checks each one \
             before it runs): ranks 0 and 1 called barrier as their collective 5, rank 2 called \
             reduce_scatter_tensor of [8] (Half) on Cpu and [4] (Half) on Cuda(1) as its \
             collective 5, rank 3 called barrier as its collective 4; nothing was sent"
        );
    }

    #[test]
    fn rendezvous_error_texts() {
        let cases: Vec<(RendezvousError, &str)> = vec![
            (
                RendezvousError::UnresolvableHost {
                    host: "no-such-host.invalid".into(),
                    cause: "failed to lookup address information: Name or service not known".into(),
                },
                "MASTER_ADDR `no-such-host.invalid` does not resolve: failed to lookup address \
                 information: Name or service not known",
            ),
            (
                RendezvousError::NobodyListening {
                    timeout: Duration::from_secs(3),
                    cause: "Connection refused (os error 111)".into(),
                },
                "no rendezvous store accepted a connection within 3s (last attempt: Connection \
                 refused (os error 111)); rank 0 hosts it: is rank 0 running, with the same \
                 MASTER_ADDR and MASTER_PORT?",
            ),
            (
                RendezvousError::NeverJoined {
                    ranks: vec![1],
                    timeout: Duration::from_secs(10),
                    refused: vec![],
                },
                "rank 1 never joined within 10s",
            ),
            (
                RendezvousError::NeverJoined {
                    ranks: vec![1, 3],
                    timeout: Duration::from_millis(2500),
                    refused: vec![(3, "job-b".into())],
                },
                "ranks 1 and 3 never joined within 2.5s (a process of run `job-b` came as rank 3 \
                 and was refused)",
            ),
            (
                RendezvousError::OtherRun {
                    mine: "job-b".into(),
                    theirs: "job-a".into(),
                },
                "this rank belongs to run `job-b` but the rendezvous store there belongs to run \
                 `job-a` (TORCHELASTIC_RUN_ID): is MASTER_PORT another job's?",
            ),
            (
                RendezvousError::Engine {
                    cause: "wait timeout".into(),
                },
                "wait timeout",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
            let full = DistError::Rendezvous {
                rank: 1,
                addr: "h".into(),
                port: 1,
                problem: Box::new(e),
            };
            assert_eq!(
                full.to_string(),
                format!("rank 1: rendezvous with h:1 failed: {text}")
            );
        }
    }

    #[test]
    fn env_error_texts() {
        let cases: Vec<(EnvError, &str)> = vec![
            (
                EnvError::NoWorldSize,
                "neither WORLD_SIZE nor SLURM_NTASKS is set",
            ),
            (
                EnvError::NotAnInteger {
                    var: "RANK",
                    value: "x".into(),
                },
                "RANK=\"x\" is not a non-negative integer",
            ),
            (
                EnvError::ZeroWorldSize { var: "WORLD_SIZE" },
                "WORLD_SIZE=0: the world size must be at least 1",
            ),
            (
                EnvError::RankOutOfRange {
                    rank_var: "RANK",
                    rank: 2,
                    world_var: "WORLD_SIZE",
                    world_size: 2,
                },
                "RANK=2 is out of range for WORLD_SIZE=2 (ranks are 0..2)",
            ),
            (EnvError::EmptyMasterAddr, "MASTER_ADDR is empty"),
            (
                EnvError::NoMasterAddr,
                "MASTER_ADDR is not set (the rendezvous host, rank 0's address)",
            ),
            (
                EnvError::BadPort {
                    value: "99999".into(),
                },
                "MASTER_PORT=\"99999\" is not a port number (1-65535)",
            ),
            (
                EnvError::BadTimeout { value: "-1".into() },
                "TCH_DIST_TIMEOUT_SECS=\"-1\" is not a positive number",
            ),
            (
                EnvError::NcclNotCompiled,
                "tch-dist was built without NCCL support",
            ),
            (
                EnvError::DeviceOutOfRange {
                    from: "LOCAL_RANK",
                    device: 1,
                    count: 1,
                },
                "LOCAL_RANK 1 names CUDA device 1, but this process sees 1 CUDA device(s); start \
                 at most one rank per GPU (or set device_id, CUDA_VISIBLE_DEVICES)",
            ),
            (
                EnvError::BadDebugLevel {
                    var: "TCH_DIST_DEBUG",
                    value: "all".into(),
                },
                "TCH_DIST_DEBUG=\"all\" is not a debug level (OFF, INFO or DETAIL)",
            ),
            (
                EnvError::BadSwitch {
                    var: "TCH_DIST_NO_SHORTCUTS",
                    value: "maybe".into(),
                },
                "TCH_DIST_NO_SHORTCUTS=\"maybe\" is not a switch (1, true, yes, on; or 0, false, \
                 no, off)",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
    }

    #[test]
    fn argument_error_texts() {
        let on = |rank| Placement::new(rank, Device::Cpu);
        let cases: Vec<(ArgumentError, &str)> = vec![
            (
                ArgumentError::RankNotInGroup {
                    what: "src_rank",
                    rank: 2,
                    world_size: 2,
                },
                "src_rank 2 is not in a group of size 2",
            ),
            (ArgumentError::EmptyRankList, "the rank list is empty"),
            (
                ArgumentError::DuplicateRank { rank: 1 },
                "rank 1 is listed twice",
            ),
            (
                ArgumentError::NotPositive {
                    option: "bucket_cap_mb",
                    value: -1.0,
                },
                "bucket_cap_mb must be positive, got -1",
            ),
            (
                ArgumentError::PowerSgdRank,
                "PowerSGD: matrix_approximation_rank must be at least 1",
            ),
            (
                ArgumentError::PowerSgdStartIter {
                    start_powersgd_iter: 1,
                },
                "PowerSGD: expected start_powersgd_iter > 1 if use_error_feedback or warm_start \
                 is enabled (got 1), because PowerSGD can only be applied after the buckets are \
                 rebuilt at the end of the first step",
            ),
            (
                ArgumentError::PowerSgdCompressionRate { value: -2.0 },
                "PowerSGD: min_compression_rate must be a non-negative number, got -2",
            ),
            (
                ArgumentError::NoGrad { fqn: "w".into() },
                "parameter `w` does not require grad",
            ),
            (
                ArgumentError::MixedDevices {
                    fqn: "b".into(),
                    device: Device::Cuda(0),
                    first_fqn: "a".into(),
                    first_device: Device::Cpu,
                },
                "parameter `b` is on Cuda(0) but `a` is on Cpu; a replicated module lives on one \
                 device",
            ),
            (
                ArgumentError::PlacementRank {
                    placement: on(3),
                    world_size: 2,
                },
                "placement `rank:3/cpu` names rank 3, but the group has 2 ranks",
            ),
            (
                ArgumentError::PlacementNeedsCuda {
                    placement: Placement::new(0, Device::Cuda(0)),
                },
                "placement `rank:0/cuda:0` needs CUDA, which is not available",
            ),
            (
                ArgumentError::LocalShards {
                    expected: 1,
                    got: 2,
                },
                "the global metadata places 1 shard(s) on this rank, got 2 that do not match it",
            ),
            (
                ArgumentError::LocalShardSignature {
                    actual: sig(&[2, 2]),
                    expected: sig(&[3, 2]),
                },
                "a local shard is [2, 2] (Float), its metadata says [3, 2] (Float)",
            ),
            (
                ArgumentError::LocalTensorCount { held: 0 },
                "local_tensor() needs exactly one local shard, this rank holds 0",
            ),
            (
                ArgumentError::MissingShard {
                    offsets: vec![4, 0],
                },
                "this rank should hold the shard at offsets [4, 0] but does not",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(
                invalid(e),
                format!("rank 1: invalid argument to op: {text}")
            );
        }
        let sharding = tch_dist_core::sharding::ShardingError::UnknownDtype { name: "f33".into() };
        assert_eq!(
            invalid(sharding.clone().into()),
            format!("rank 1: invalid argument to op: {sharding}")
        );
    }

    #[test]
    fn mismatch_texts() {
        let named = |fqn: &str, shape: &[i64]| NamedSignature {
            fqn: fqn.into(),
            signature: sig(shape),
        };
        let cases: Vec<(Mismatch, &str)> = vec![
            (
                Mismatch::List {
                    what: "parameters",
                    reference_rank: 0,
                    reference_len: 2,
                    other_rank: 1,
                    other_len: 1,
                    index: 1,
                    reference_entry: Some(named("fc.bias", &[4])),
                    other_entry: None,
                },
                "parameters differ across ranks: rank 0 has 2 parameters and rank 1 has 1; entry 1 \
                 is `fc.bias` with shape [4] (Float) on rank 0 but missing on rank 1",
            ),
            (
                Mismatch::OptionValue {
                    option: "bucket_cap_mb".into(),
                    values: vec!["25".into(), "10".into()],
                },
                "option `bucket_cap_mb` differs across ranks: rank 0 has 25, rank 1 has 10",
            ),
            (
                Mismatch::Shape {
                    reference_rank: 0,
                    reference: sig(&[10, 2]),
                    other_rank: 2,
                    other: sig(&[9, 2]),
                },
                "rank 0 passes a tensor of shape [10, 2] (Float), but rank 2 passed [9, 2] (Float)",
            ),
        ];
        for (m, text) in cases {
            assert_eq!(m.to_string(), text);
        }
    }
}
