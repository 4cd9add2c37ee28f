//! The runtime's errors: every engine failure and every refused argument reaches Rust as one
//! of these values, with the rank, the operation and what went wrong as fields.
//!
//! Messages follow one shape, `rank R: OP ...: what`, and name the rank, the operation and the
//! parameter (FQN) once. Text only enters where the engine speaks (`cause`: what c10d or
//! Gloo said) and where a value crosses libtorch's autograd engine as a message (a failed
//! backward pass); the reducer keeps the typed value and returns it from the next call.
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `mod.rs` | [`DistError`], the runtime's one error type, and [`Result`] | `torch.distributed.DistError` and its subclasses (`DistBackendError`, `DistNetworkError`, `DistStoreError`; c10d's `exception.h`) |
//! | `autograd.rs` | [`AutogradError`]: a split backward or a recomputation libtorch's engine failed, before the caller names the rank and the API | the `RuntimeError` of `torch.autograd.backward` |
//! | `env.rs` | [`EnvError`]: a launch variable, by name | the `ValueError`s of `torch/distributed/rendezvous.py`'s `_env_rendezvous_handler` |
//! | `rendezvous.rs` | [`RendezvousError`]: why the store or the backends could not be joined | `DistNetworkError`, `DistStoreError` from `TCPStore` |
//! | `argument.rs` | [`ArgumentError`]: a refused argument, nothing sent | the `ValueError`s of `distributed_c10d.py`, DDP's and PowerSGD's checks |
//! | `mismatch.rs` | [`Mismatch`], [`TensorSignature`], [`NamedSignature`]: what differs across ranks | DDP's `_verify_param_shape_across_processes` |
//! | `desync.rs` | [`Desync`], [`CollectiveCall`]: what `TCH_DIST_DEBUG=DETAIL` found | c10d's `ProcessGroupWrapper` fingerprint check |
//! | `misuse.rs` | [`MisuseProblem`]: what tch-dist refused on its own (not the engine's text) | the `RuntimeError`s DDP's and FSDP's Python code raises |
//! | `step.rs` | [`StepPosition`], [`Phase`], [`PassProgram`], [`CollectiveSignature`]: what the always-on step check compares (the header's wire form is the check's, `c10d/step_check/`) | (none: tch-dist's step check) |
//! | `reducer.rs` | [`ReducerError`]: the backward passes the reducer refuses, named after the API that runs it | the `RuntimeError`s of `reducer.cpp` |
//! | `pickle.rs` | [`PickleError`]: a received object tch-dist does not read | `pickle.UnpicklingError` |
//! | `text.rs` | the Display helpers several errors share (rank lists, joined items) | — |
//! | `tests.rs` | the exact text of every variant | — |

mod argument;
mod autograd;
mod desync;
mod env;
mod mismatch;
mod misuse;
mod pickle;
mod reducer;
mod rendezvous;
mod step;
mod text;

use std::time::Duration;

pub use argument::ArgumentError;
pub use autograd::AutogradError;
pub use desync::{CallTensor, CollectiveCall, Desync};
pub use env::EnvError;
pub use mismatch::{Mismatch, NamedSignature, TensorSignature};
pub use misuse::MisuseProblem;
pub use pickle::PickleError;
pub use reducer::ReducerError;
pub use rendezvous::RendezvousError;
pub(crate) use step::SIGNATURE_OPS;
pub use step::{CollectiveSignature, PassProgram, Phase, StepPosition};
use text::{PeerText, RankList};

/// What a rank that left a job's collectives reported, or what was reported of it
/// ([`DistError::PeerDeparted`]).
///
/// ```
/// use tch_dist_runtime::Departure;
/// let exited = Departure::Exited { status: "exited with status 0".into() };
/// assert_eq!(
///     exited.to_string(),
///     "exited with status 0 (its launcher reported it), so it will not take part"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Departure {
    /// Its process exited, as its launcher (`tch-dist-run`) reported.
    Exited {
        /// The launcher's words (`exited with status 0`, `was killed by signal 9 (SIGKILL)`).
        status: String,
    },
    /// It failed and stopped taking part in the group's collectives.
    Failed {
        /// Its error, as it reported it.
        error: String,
    },
    /// Its heartbeat stopped: its host lost its link, or froze (`heartbeat.rs`).
    Silent {
        /// How long its heartbeat has stood still, as this rank saw it.
        silent: Duration,
    },
}

impl std::fmt::Display for Departure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Departure::Exited { status } => write!(
                f,
                "{status} (its launcher reported it), so it will not take part"
            ),
            Departure::Failed { error } => {
                write!(f, "failed and stopped taking part: {error}")
            }
            Departure::Silent { silent } => write!(
                f,
                "has not been heard from for {} s (its heartbeat stopped: its host lost its \
                 link, or froze)",
                silent.as_secs()
            ),
        }
    }
}

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
    Env(EnvError),
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
    /// tch-dist refused a use of the runtime on its own (a gradient that does not fit its
    /// shard, ranks that run different builds): its words, not the engine's.
    #[error("rank {rank}: {op} failed: {problem}")]
    Misuse {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What was wrong (boxed, as `problem` below).
        problem: Box<MisuseProblem>,
    },
    /// A fault inside tch-dist (a state its own code should never reach, or the engine
    /// returning nothing where it returns a value): a bug to report.
    #[error("rank {rank}: {op} failed: internal error: {what}")]
    Internal {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What went wrong.
        what: &'static str,
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
    /// A rank this one waited for has left: its launcher reported that its process exited,
    /// or it reported that it failed and stopped taking part in the group's collectives.
    /// Seen within seconds ([`Departure`]), where the wait would otherwise have run to the
    /// group's timeout.
    #[error("rank {rank}: {op}: rank {peer} {departure}")]
    PeerDeparted {
        /// This process's rank in the group.
        rank: usize,
        /// The operation that waited.
        op: &'static str,
        /// The rank that left, in the group.
        peer: usize,
        /// What it reported, or what was reported of it.
        departure: Departure,
    },
    /// The rendezvous store (rank 0's host) has not answered this rank's watch for the
    /// heartbeat timeout while a wait of `op` lasted: this host lost its link, or rank 0's
    /// host is gone or frozen. Its peers are beyond reach too, so the wait ends here rather
    /// than at the group's timeout.
    #[error(
        "rank {rank}: {op}: the store at {store} (rank 0's host) has not answered for {} s: \
         this host lost its link, or rank 0's host is gone; no peer can be reached",
        silent.as_secs()
    )]
    StoreUnreachable {
        /// This process's rank in the group.
        rank: usize,
        /// The operation that waited.
        op: &'static str,
        /// MASTER_ADDR:MASTER_PORT.
        store: String,
        /// How long it has not answered.
        silent: Duration,
    },
    /// This rank stopped taking part in the group's collectives after a failure (and told
    /// the other ranks, who fail with [`PeerDeparted`](Self::PeerDeparted)): a transfer or
    /// collective of it may be left pending, so nothing more is sent over the group.
    #[error(
        "rank {rank}: {op}: the group stopped after this rank's failure ({cause}); create a \
         new group to go on"
    )]
    GroupStopped {
        /// This process's rank in the group.
        rank: usize,
        /// The operation refused.
        op: &'static str,
        /// The failure, as this rank reported it.
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
    /// collective; nothing was sent. Without it, on one host: a peer called a collective
    /// where this rank waits for its step-check header ([`Desync::Elsewhere`]); the group
    /// is stopped.
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
    /// The reducer refused a backward pass (a changed graph under `static_graph`, an
    /// unfinished reduction, a gradient after its all-reduce started), named after the API
    /// that runs it (boxed, as `problem` above).
    #[error(transparent)]
    Reducer(Box<ReducerError>),
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

impl DistError {
    /// The rank the message names (`rank R: ...`), where it names one: an error that wraps
    /// this one names its own context and leaves the rank to it.
    pub fn rank(&self) -> Option<usize> {
        match self {
            DistError::Rendezvous { rank, .. }
            | DistError::Collective { rank, .. }
            | DistError::Misuse { rank, .. }
            | DistError::Internal { rank, .. }
            | DistError::PeerGone { rank, .. }
            | DistError::PeerDeparted { rank, .. }
            | DistError::StoreUnreachable { rank, .. }
            | DistError::GroupStopped { rank, .. }
            | DistError::Timeout { rank, .. }
            | DistError::InvalidArgument { rank, .. }
            | DistError::Mismatch { rank, .. }
            | DistError::Desync { rank, .. }
            | DistError::PeersFailed { rank, .. }
            | DistError::ShutDown { rank, .. }
            | DistError::DuplicateDevice { rank, .. }
            | DistError::Object { rank, .. } => Some(*rank),
            DistError::Reducer(e) => Some(e.rank()),
            DistError::Env(_)
            | DistError::Store { .. }
            | DistError::NotInitialized
            | DistError::AlreadyInitialized
            | DistError::UnknownBackend { .. } => None,
        }
    }
}

// The EnvError is part of this error's message (as every problem below), not a source.
impl From<EnvError> for DistError {
    fn from(e: EnvError) -> DistError {
        DistError::Env(e)
    }
}

impl From<std::convert::Infallible> for DistError {
    fn from(never: std::convert::Infallible) -> DistError {
        match never {}
    }
}

/// The runtime's result type.
pub type Result<T, E = DistError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests;
