//! Blocking clients of the two services, for training code (which is not async): each owns a
//! one-thread tokio runtime that drives its connection while a call waits. Every call takes a
//! timeout, sent to the peer as gRPC's deadline (`grpc-timeout`; torchft's manager refuses a
//! quorum call without one) and enforced here as well.

use std::future::Future;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::error::{FtError, FtErrorKind, Result};
use crate::proto::lighthouse_service_client::LighthouseServiceClient;
use crate::proto::manager_service_client::ManagerServiceClient;
use crate::proto::{
    CheckpointMetadataRequest, LighthouseHeartbeatRequest, LighthouseQuorumRequest,
    ManagerQuorumRequest, ManagerQuorumResponse, Quorum, QuorumMember, ShouldCommitRequest,
};

/// A channel to `address` (`http://host:port`) that connects when first used and reconnects
/// after a failure (a restarted lighthouse is found again), with `connect_timeout` per try;
/// its connection is driven on `runtime`.
pub(crate) fn lazy_channel(
    runtime: &tokio::runtime::Handle,
    op: &'static str,
    address: &str,
    connect_timeout: Duration,
) -> Result<Channel> {
    let endpoint = Endpoint::from_shared(address.to_string())
        .map_err(|e| FtError::new(FtErrorKind::BadAddress, op, address).because(e))?;
    let _entered = runtime.enter();
    Ok(endpoint.connect_timeout(connect_timeout).connect_lazy())
}

/// `request` with `timeout` as its gRPC deadline.
pub(crate) fn with_deadline<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(timeout);
    request
}

/// Runs one call of `op` against `address`, bounded by `timeout` here too (a peer that
/// accepted the connection and never answers).
pub(crate) async fn bounded<T>(
    op: &'static str,
    address: &str,
    timeout: Duration,
    call: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T> {
    let start = tokio::time::Instant::now();
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        // The peer's deadline (the one this call sent) passed first: tonic's server answers
        // Cancelled ("Timeout expired"), a proxy DeadlineExceeded.
        Ok(Err(status))
            if status.code() == tonic::Code::DeadlineExceeded
                || (status.code() == tonic::Code::Cancelled && start.elapsed() >= timeout) =>
        {
            Err(FtError::new(FtErrorKind::TimedOut(timeout), op, address)
                .because(status.message().to_string()))
        }
        Ok(Err(status)) => Err(FtError::from_status(op, address, status)),
        Err(_) => Err(FtError::new(FtErrorKind::TimedOut(timeout), op, address)),
    }
}

/// The runtime a blocking client drives its connection on.
fn client_runtime(op: &'static str, address: &str) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| FtError::new(FtErrorKind::Runtime, op, address).because(e))
}

/// Connects a channel to `address` within `connect_timeout`, on `rt`: an address that does
/// not answer is an error now, not at the first call.
fn connect(
    rt: &tokio::runtime::Runtime,
    op: &'static str,
    address: &str,
    connect_timeout: Duration,
) -> Result<Channel> {
    let endpoint = Endpoint::from_shared(address.to_string())
        .map_err(|e| FtError::new(FtErrorKind::BadAddress, op, address).because(e))?
        .connect_timeout(connect_timeout);
    rt.block_on(async {
        match tokio::time::timeout(connect_timeout, endpoint.connect()).await {
            Ok(Ok(channel)) => Ok(channel),
            Ok(Err(e)) => Err(FtError::new(FtErrorKind::Connect, op, address).because(e)),
            Err(_) => Err(FtError::new(
                FtErrorKind::TimedOut(connect_timeout),
                op,
                address,
            )),
        }
    })
}

/// A connection either client drives on a runtime of its own: the runtime, the peer's
/// address (which errors name) and the generated client.
struct Blocking<C> {
    rt: tokio::runtime::Runtime,
    address: String,
    inner: C,
}

impl<C: Clone> Blocking<C> {
    /// Connects to `address` within `connect_timeout`; `op` names the connection in errors.
    fn open(
        op: &'static str,
        address: &str,
        connect_timeout: Duration,
        client: impl FnOnce(Channel) -> C,
    ) -> Result<Self> {
        let rt = client_runtime(op, address)?;
        let channel = connect(&rt, op, address, connect_timeout)?;
        Ok(Blocking {
            rt,
            address: address.to_string(),
            inner: client(channel),
        })
    }

    /// One call of `op`: `message` sent with `timeout` as its deadline, and waited for at
    /// most that long.
    fn call<M, T, F>(
        &self,
        op: &'static str,
        timeout: Duration,
        message: M,
        send: impl FnOnce(C, tonic::Request<M>) -> F,
    ) -> Result<T>
    where
        F: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let call = send(self.inner.clone(), with_deadline(message, timeout));
        self.rt.block_on(bounded(op, &self.address, timeout, call))
    }
}

/// A client of a lighthouse (torchft's `LighthouseClient`): asks it for quorums and tells it
/// a replica group is alive.
///
/// ```no_run
/// use std::time::Duration;
/// use tch_dist_ft::{LighthouseClient, QuorumMember};
///
/// let client = LighthouseClient::connect("http://127.0.0.1:29510", Duration::from_secs(10))?;
/// client.heartbeat("replica_0:1", Duration::from_secs(5))?;
/// let quorum = client.quorum(
///     QuorumMember { replica_id: "replica_0:1".into(), world_size: 1, ..Default::default() },
///     Duration::from_secs(60),
/// )?;
/// println!("quorum {} of {} groups", quorum.quorum_id, quorum.participants.len());
/// # Ok::<(), tch_dist_ft::FtError>(())
/// ```
pub struct LighthouseClient {
    conn: Blocking<LighthouseServiceClient<Channel>>,
}

impl LighthouseClient {
    /// Connects to the lighthouse at `address` (`http://host:port`).
    pub fn connect(address: &str, connect_timeout: Duration) -> Result<Self> {
        let conn = Blocking::open(
            "lighthouse connect",
            address,
            connect_timeout,
            LighthouseServiceClient::new,
        )?;
        Ok(LighthouseClient { conn })
    }

    /// Joins the next quorum as `requester` and waits (up to `timeout`) for the first quorum
    /// the lighthouse issues that holds it.
    pub fn quorum(&self, requester: QuorumMember, timeout: Duration) -> Result<Quorum> {
        const OP: &str = "lighthouse quorum";
        let message = LighthouseQuorumRequest {
            requester: Some(requester),
        };
        let response =
            self.conn.call(
                OP,
                timeout,
                message,
                |mut c, r| async move { c.quorum(r).await },
            )?;
        response
            .quorum
            .ok_or_else(|| FtError::new(FtErrorKind::Malformed("quorum"), OP, &self.conn.address))
    }

    /// Tells the lighthouse that `replica_id` is alive.
    pub fn heartbeat(&self, replica_id: &str, timeout: Duration) -> Result<()> {
        let message = LighthouseHeartbeatRequest {
            replica_id: replica_id.to_string(),
        };
        self.conn
            .call(
                "lighthouse heartbeat",
                timeout,
                message,
                |mut c, r| async move { c.heartbeat(r).await },
            )
            .map(|_| ())
    }
}

/// A client of a replica group's manager (torchft's `ManagerClient`), one per rank of the
/// group: the per-step quorum, the commit vote, and a peer's checkpoint metadata.
///
/// ```no_run
/// use std::time::Duration;
/// use tch_dist_ft::{ManagerClient, ManagerQuorumRequest};
///
/// let manager = ManagerClient::connect("http://127.0.0.1:29512", Duration::from_secs(10))?;
/// let t = Duration::from_secs(60);
/// let quorum = manager.quorum(ManagerQuorumRequest { group_rank: 0, step: 0, init_sync: true, ..Default::default() }, t)?;
/// // ... the step, with the quorum's members averaging gradients ...
/// let commit = manager.should_commit(0, quorum.max_step, true, t)?;
/// # Ok::<(), tch_dist_ft::FtError>(())
/// ```
pub struct ManagerClient {
    conn: Blocking<ManagerServiceClient<Channel>>,
}

impl ManagerClient {
    /// Connects to the manager at `address` (`http://host:port`).
    pub fn connect(address: &str, connect_timeout: Duration) -> Result<Self> {
        let conn = Blocking::open(
            "manager connect",
            address,
            connect_timeout,
            ManagerServiceClient::new,
        )?;
        Ok(ManagerClient { conn })
    }

    /// This rank's part of the group's quorum for its next step: returns once every rank of
    /// the group asked and the lighthouse issued a quorum holding the group.
    pub fn quorum(
        &self,
        request: ManagerQuorumRequest,
        timeout: Duration,
    ) -> Result<ManagerQuorumResponse> {
        self.conn
            .call("manager quorum", timeout, request, |mut c, r| async move {
                c.quorum(r).await
            })
    }

    /// This rank's vote on committing `step`: true only when every rank of the group voted
    /// true.
    pub fn should_commit(
        &self,
        group_rank: i64,
        step: i64,
        vote: bool,
        timeout: Duration,
    ) -> Result<bool> {
        let message = ShouldCommitRequest {
            should_commit: vote,
            group_rank,
            step,
        };
        self.conn
            .call(
                "manager should_commit",
                timeout,
                message,
                |mut c, r| async move { c.should_commit(r).await },
            )
            .map(|r| r.should_commit)
    }

    /// The checkpoint metadata that group rank `rank` sent with its last quorum request.
    pub fn checkpoint_metadata(&self, rank: i64, timeout: Duration) -> Result<String> {
        let message = CheckpointMetadataRequest { rank };
        self.conn
            .call(
                "manager checkpoint_metadata",
                timeout,
                message,
                |mut c, r| async move { c.checkpoint_metadata(r).await },
            )
            .map(|r| r.checkpoint_metadata)
    }
}

impl std::fmt::Debug for LighthouseClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LighthouseClient")
            .field("address", &self.conn.address)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for ManagerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagerClient")
            .field("address", &self.conn.address)
            .finish_non_exhaustive()
    }
}
