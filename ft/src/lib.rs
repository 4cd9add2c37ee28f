//! tch-dist's fault-tolerance control plane, torchft's model in Rust: a **lighthouse** (one
//! per job) forms a quorum of the live replica groups for each step, and a **manager** per
//! replica group (on its rank 0) gathers the group's ranks for that quorum and their votes on
//! committing the step. It speaks torchft's gRPC protocol (`proto/torchft.proto`, package
//! `torchft`), so that tch-dist replica groups and PyTorch torchft ones can share one
//! lighthouse; tests/torchft.rs runs it against the `torchft` wheel's lighthouse, manager and
//! clients. No libtorch here: the training side (the reconfigurable replicate group, the
//! commit) builds on it.
//!
//! | file | what it does | torchft's counterpart |
//! |---|---|---|
//! | `proto.rs` | the wire messages (hand-written prost) and the generated services (`build.rs`) | `proto/torchft.proto`, `build.rs` |
//! | `lighthouse/` | the lighthouse: the quorum rule, the server | `src/lighthouse.rs` |
//! | `manager/` | a group's manager: one view of a quorum per rank, the server | `src/manager.rs`, `src/timeout.rs` |
//! | `client.rs` | blocking clients of both services | `LighthouseClient`, `ManagerClient` (src/lib.rs) |
//! | `server.rs` | what both servers share: a runtime, the bound listener, shutdown | (tokio and tonic in each) |
//! | `error.rs` | [`FtError`]: a kind, the operation and address, the cause | (anyhow / `Status`) |
//! | `main.rs` | `tch-dist-lighthouse`, the lighthouse as a command, torchft's options | `torchft_lighthouse`, `src/bin/lighthouse.rs` |
//!
//! ```
//! use std::time::Duration;
//! use tch_dist_ft::{LighthouseClient, LighthouseOptions, LighthouseServer, QuorumMember};
//!
//! let lighthouse = LighthouseServer::start(LighthouseOptions {
//!     bind: "127.0.0.1:0".into(),
//!     join_timeout: Duration::from_millis(1),
//!     ..LighthouseOptions::new(1)
//! })?;
//! let client = LighthouseClient::connect(&lighthouse.address(), Duration::from_secs(10))?;
//! let me = QuorumMember { replica_id: "replica_0:a".into(), world_size: 1, ..Default::default() };
//! let quorum = client.quorum(me, Duration::from_secs(10))?;
//! assert_eq!(quorum.participants.len(), 1);
//! # Ok::<(), tch_dist_ft::FtError>(())
//! ```

#![warn(missing_docs)]

mod client;
mod error;
mod lighthouse;
mod manager;
pub mod proto;
mod server;

pub use client::{LighthouseClient, ManagerClient};
pub use error::{FtError, FtErrorKind, Result};
pub use lighthouse::{LighthouseOptions, LighthouseServer};
pub use manager::{ManagerOptions, ManagerServer, QuorumMembers, TCH_DIST_MEMBER};
pub use proto::{ManagerQuorumRequest, ManagerQuorumResponse, Quorum, QuorumMember};
/// A gRPC status code, as [`FtErrorKind::Rpc`] carries it.
pub use tonic::Code as RpcCode;
