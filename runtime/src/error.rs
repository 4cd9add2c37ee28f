//! The runtime's error type: every engine failure reaches Rust as one of these values.

use std::time::Duration;

/// An error from tch-dist's runtime. Messages name the rank, the operation and the cause.
///
/// ```
/// use tch_dist_runtime::DistError;
/// let e = DistError::Collective { rank: 1, op: "all_reduce", cause: "Connection closed by peer".into() };
/// assert_eq!(e.to_string(), "rank 1: all_reduce failed: Connection closed by peer");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DistError {
    /// A launch variable (RANK, WORLD_SIZE, MASTER_PORT, ...) is missing or malformed.
    #[error("invalid launch environment: {0}")]
    Env(String),
    /// Connecting to the rendezvous store or creating the backends failed.
    #[error("rank {rank}: rendezvous with {addr}:{port} failed: {cause}")]
    Rendezvous {
        /// This process's rank.
        rank: usize,
        /// MASTER_ADDR.
        addr: String,
        /// MASTER_PORT.
        port: u16,
        /// What the engine said.
        cause: String,
    },
    /// A collective (or point-to-point operation) failed or timed out.
    #[error("rank {rank}: {op} failed: {cause}")]
    Collective {
        /// This process's rank in the group.
        rank: usize,
        /// The operation, named as in torch.distributed.
        op: &'static str,
        /// What the engine said.
        cause: String,
    },
    /// An argument is out of range or inconsistent; nothing was sent.
    #[error("rank {rank}: invalid argument to {op}: {msg}")]
    InvalidArgument {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// No default process group exists yet.
    #[error("the default process group is not initialized; call init_process_group first")]
    NotInitialized,
    /// `init_process_group` was called while a default group exists.
    #[error("the default process group is already initialized; call destroy_process_group first")]
    AlreadyInitialized,
    /// A wait gave up.
    #[error("rank {rank}: {op} timed out after {timeout:?}")]
    Timeout {
        /// This process's rank in the group.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The limit that passed.
        timeout: Duration,
    },
}

/// The runtime's result type.
pub type Result<T, E = DistError> = std::result::Result<T, E>;
