//! The lighthouse: one per job, it forms a quorum of the live replica groups for each step
//! (torchft's `Lighthouse`, src/lighthouse.rs).
//!
//! | file | what it does | torchft's counterpart |
//! |---|---|---|
//! | `quorum.rs` | the rule: who is alive, who asks, when a quorum is issued and under which id | `quorum_compute`, `_quorum_tick` |
//! | `mod.rs` | the gRPC server: a long-polled `Quorum` (also a heartbeat), `Heartbeat`, the tick | `Lighthouse::{new, run, quorum, heartbeat}` |
//! | `dashboard.rs` | the HTTP dashboard on the same port: the status page, the kill button | `Lighthouse::{get_status, kill}`, `templates/` |
//!
//! Like torchft's, it also serves an HTTP dashboard on the same port (`/status`, a kill
//! button per group). Its quorum ids start above the time of its
//! start in milliseconds, where torchft's start at 1 (see `first_id_base`).

mod dashboard;
mod quorum;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{broadcast, Mutex};
use tonic::service::Routes;
use tonic::{Request, Response, Status};

pub use quorum::LighthouseOptions;
use quorum::Membership;

use crate::error::Result;
use crate::proto::lighthouse_service_server::{LighthouseService, LighthouseServiceServer};
use crate::proto::{
    LighthouseHeartbeatRequest, LighthouseHeartbeatResponse, LighthouseQuorumRequest,
    LighthouseQuorumResponse, Quorum,
};
use crate::server::{hostname, Bound, Serving};

/// The lighthouse's state behind its lock, and the channel its quorums go out on.
struct Shared {
    membership: Mutex<Membership>,
    issued: broadcast::Sender<Quorum>,
    opts: LighthouseOptions,
}

impl Shared {
    /// Runs the rule now and sends out the quorum it issues, if any.
    fn tick(&self, membership: &mut Membership) {
        if let Some(quorum) = membership.tick(Instant::now(), &self.opts) {
            // No receiver is no error: nobody was waiting (they all timed out).
            let _ = self.issued.send(quorum);
        }
    }
}

#[tonic::async_trait]
impl LighthouseService for Arc<Shared> {
    async fn quorum(
        &self,
        request: Request<LighthouseQuorumRequest>,
    ) -> Result<Response<LighthouseQuorumResponse>, Status> {
        let requester = request
            .into_inner()
            .requester
            .ok_or_else(|| Status::invalid_argument("missing requester"))?;
        let mut issued = {
            let mut membership = self.membership.lock().await;
            membership.ask(requester.clone(), Instant::now());
            let issued = self.issued.subscribe();
            self.tick(&mut membership);
            issued
        };
        loop {
            let quorum = match issued.recv().await {
                Ok(q) => q,
                // Quorums this waiter missed were not for it (it would have left): go on.
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => {
                    return Err(Status::unavailable("the lighthouse is shutting down"));
                }
            };
            if quorum
                .participants
                .iter()
                .any(|p| p.replica_id == requester.replica_id)
            {
                return Ok(Response::new(LighthouseQuorumResponse {
                    quorum: Some(quorum),
                }));
            }
            // Issued without this group (it joined late, or shrink_only left it out): it asks
            // again for the next one.
            self.membership
                .lock()
                .await
                .ask(requester.clone(), Instant::now());
        }
    }

    async fn heartbeat(
        &self,
        request: Request<LighthouseHeartbeatRequest>,
    ) -> Result<Response<LighthouseHeartbeatResponse>, Status> {
        let replica_id = request.into_inner().replica_id;
        self.membership
            .lock()
            .await
            .heartbeat(&replica_id, Instant::now());
        Ok(Response::new(LighthouseHeartbeatResponse {}))
    }
}

/// A running lighthouse (torchft's `LighthouseServer`); it stops when dropped.
///
/// ```
/// use tch_dist_ft::{LighthouseOptions, LighthouseServer};
///
/// let lighthouse = LighthouseServer::start(LighthouseOptions {
///     bind: "127.0.0.1:0".into(),
///     ..LighthouseOptions::new(2)
/// })?;
/// assert!(lighthouse.address().starts_with("http://127.0.0.1:"));
/// # Ok::<(), tch_dist_ft::FtError>(())
/// ```
pub struct LighthouseServer {
    serving: Serving,
}

impl LighthouseServer {
    /// Listens on `opts.bind` and starts the quorum rule's tick.
    pub fn start(opts: LighthouseOptions) -> Result<Self> {
        let tick = opts.quorum_tick;
        let shared = Arc::new(Shared {
            membership: Mutex::new(Membership::starting_after(first_id_base())),
            issued: broadcast::channel(16).0,
            opts,
        });
        let ticking = shared.clone();
        let routes = Routes::new(LighthouseServiceServer::new(shared.clone()))
            .into_axum_router()
            .merge(dashboard::routes(shared.clone()));
        let serving = Bound::new("lighthouse bind", &shared.opts.bind)?.serve(
            Routes::from(routes),
            async move {
                let mut interval = tokio::time::interval(tick);
                loop {
                    interval.tick().await;
                    let mut membership = ticking.membership.lock().await;
                    ticking.tick(&mut membership);
                }
            },
        );
        Ok(LighthouseServer { serving })
    }

    /// `http://host:port`: the bound IP, or this machine's host name when bound to every
    /// interface (as torchft's).
    pub fn address(&self) -> String {
        address_of(self.serving.local_addr())
    }

    /// Stops serving (also on drop).
    pub fn shutdown(self) {}
}

/// The id before a lighthouse's first quorum: the milliseconds since the Unix epoch at its
/// start. torchft's lighthouse starts from 0, so after a restart it issues ids it issued
/// before, and a quorum's group (keyed in its store by id) can meet the keys of the earlier
/// quorum with the same id, addresses of processes long gone; a restarted tch-dist lighthouse
/// issues ids above every one it issued before (ids grow by at most one per quorum, and
/// quorums take longer than a millisecond each).
fn first_id_base() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(0))
}

/// `http://ip:port` for a specific IP, `http://hostname:port` for an unspecified one.
pub(crate) fn address_of(addr: SocketAddr) -> String {
    if addr.ip().is_unspecified() {
        format!("http://{}:{}", hostname(), addr.port())
    } else if addr.is_ipv6() {
        format!("http://[{}]:{}", addr.ip(), addr.port())
    } else {
        format!("http://{}:{}", addr.ip(), addr.port())
    }
}

impl std::fmt::Debug for LighthouseServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LighthouseServer")
            .field("address", &self.address())
            .finish_non_exhaustive()
    }
}
