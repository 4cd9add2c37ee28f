//! A replica group's manager server (torchft's `Manager`, src/manager.rs): it runs on the
//! group's rank 0, gathers the group's ranks for each step's quorum and asks the lighthouse
//! once for the whole group, counts the group's commit votes, keeps each rank's checkpoint
//! metadata for healing peers, and heartbeats to the lighthouse.
//!
//! | file | what it does | torchft's counterpart |
//! |---|---|---|
//! | `results.rs` | one group rank's view of a quorum: ranks, divisor, store, healing | `compute_quorum_results` |
//! | `deadline.rs` | the `grpc-timeout` header a quorum call must carry | `timeout.rs` |
//! | `mod.rs` | the gRPC server and its heartbeat loop | `Manager::{new, run, quorum, should_commit, checkpoint_metadata, kill}` |

mod deadline;
mod results;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, Mutex};
use tonic::service::Routes;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::client::{bounded, lazy_channel, with_deadline};
use crate::error::Result;
use crate::proto::lighthouse_service_client::LighthouseServiceClient;
use crate::proto::manager_service_server::{ManagerService, ManagerServiceServer};
use crate::proto::{
    CheckpointMetadataRequest, CheckpointMetadataResponse, KillRequest, KillResponse,
    LighthouseHeartbeatRequest, LighthouseQuorumRequest, ManagerQuorumRequest,
    ManagerQuorumResponse, Quorum, QuorumMember, ShouldCommitRequest, ShouldCommitResponse,
};
use crate::server::{Bound, Serving};

/// A manager's settings (torchft's `ManagerServer` arguments, same names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerOptions {
    /// The group's id: `"{name}{index}:{uuid}"` (torchft's Python groups read the index from
    /// the digits before the colon; zero-pad it, ids sort as strings).
    pub replica_id: String,
    /// The lighthouse, `http://host:port`.
    pub lighthouse_addr: String,
    /// The host name or IP other groups reach this manager at.
    pub hostname: String,
    /// Where it listens (`[::]:0` for any port).
    pub bind: String,
    /// The group's TCPStore, `host:port`, where other groups' ranks meet this group's for the
    /// cross-group process group.
    pub store_addr: String,
    /// The ranks of the group (each asks for every quorum and votes on every commit).
    pub world_size: u64,
    /// How often to heartbeat to the lighthouse (torchft's Python manager: 100 ms).
    pub heartbeat_interval: Duration,
    /// The connect timeout to the lighthouse.
    pub connect_timeout: Duration,
    /// How often a failed lighthouse quorum call is retried before the group's ranks fail.
    pub quorum_retries: i64,
    /// Which groups this group may share a quorum with.
    pub members: QuorumMembers,
}

/// Which groups a manager's group may share a quorum with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuorumMembers {
    /// Any group that speaks torchft's protocol (torchft's Python groups included): what the
    /// control plane alone needs, and training on torchft's wire (`tch_dist::ft::Wire`).
    #[default]
    Any,
    /// tch-dist groups only (each marks its quorum requests, [`TCH_DIST_MEMBER`]): what
    /// training on tch-dist's own wire needs, since the groups of a quorum then run
    /// tch-dist's cross-group collectives together. A quorum with another member is
    /// refused on every rank of this group, naming it.
    TchDistOnly,
}

/// What a tch-dist manager puts in its quorum requests' `data` (a JSON string, as torchft's
/// field is documented; torchft's own groups leave it empty), and what `tch_dist::ft`'s
/// ranks give as their checkpoint metadata (torchft's is its transport's address): a group
/// about to heal tells a tch-dist source from a torchft one by it.
pub const TCH_DIST_MEMBER: &str = r#"{"tch_dist":1}"#;

/// A group's quorum round: the ranks that asked, and where the result goes out. A failure of
/// the lighthouse call goes out too, so that no rank waits out its deadline for it.
type Issued = broadcast::Sender<std::result::Result<Quorum, String>>;

/// The group's commit votes for the current step.
struct Votes {
    voted: HashSet<i64>,
    against: HashSet<i64>,
    decided: broadcast::Sender<bool>,
}

impl Votes {
    fn new() -> Self {
        Votes {
            voted: HashSet::new(),
            against: HashSet::new(),
            decided: broadcast::channel(16).0,
        }
    }
}

struct Group {
    checkpoint_metadata: HashMap<i64, String>,
    asking: HashMap<i64, QuorumMember>,
    issued: Issued,
    votes: Votes,
}

struct Shared {
    opts: ManagerOptions,
    /// `http://hostname:port`, as other groups reach it.
    address: String,
    lighthouse: LighthouseServiceClient<Channel>,
    group: Mutex<Group>,
}

impl Shared {
    /// Refuses a group rank outside `0..world_size` (it would never complete a round).
    // A `Status` is what the handlers answer with (see `deadline::of`).
    #[allow(clippy::result_large_err)]
    fn check_rank(&self, group_rank: i64) -> std::result::Result<(), Status> {
        if u64::try_from(group_rank).is_ok_and(|r| r < self.opts.world_size) {
            Ok(())
        } else {
            Err(Status::invalid_argument(format!(
                "group rank {group_rank} is not in 0..{} (the manager of {})",
                self.opts.world_size, self.opts.replica_id
            )))
        }
    }

    /// The lighthouse's quorum for `member`, retried `quorum_retries` times.
    async fn lighthouse_quorum(
        &self,
        member: QuorumMember,
        timeout: Duration,
    ) -> std::result::Result<Quorum, String> {
        let mut tries = 0;
        loop {
            let request = with_deadline(
                LighthouseQuorumRequest {
                    requester: Some(member.clone()),
                },
                timeout,
            );
            let mut client = self.lighthouse.clone();
            let failure = match bounded(
                "lighthouse quorum",
                &self.opts.lighthouse_addr,
                timeout,
                client.quorum(request),
            )
            .await
            {
                Ok(response) => match response.quorum {
                    Some(q) => return Ok(q),
                    None => "the lighthouse answered without a quorum".to_string(),
                },
                Err(e) => e.to_string(),
            };
            if tries >= self.opts.quorum_retries {
                return Err(format!(
                    "{failure} (after {} retries, the manager of {})",
                    tries, self.opts.replica_id
                ));
            }
            tries += 1;
            let pause = timeout / u32::try_from(self.opts.quorum_retries + 1).unwrap_or(1);
            tokio::time::sleep(pause.max(Duration::from_millis(100))).await;
        }
    }

    async fn heartbeats(self: Arc<Self>) {
        loop {
            let request = with_deadline(
                LighthouseHeartbeatRequest {
                    replica_id: self.opts.replica_id.clone(),
                },
                self.opts.connect_timeout,
            );
            let mut client = self.lighthouse.clone();
            // A failed heartbeat is retried at the next one: the channel reconnects.
            let _ = bounded(
                "lighthouse heartbeat",
                &self.opts.lighthouse_addr,
                self.opts.connect_timeout,
                client.heartbeat(request),
            )
            .await;
            tokio::time::sleep(self.opts.heartbeat_interval).await;
        }
    }
}

#[tonic::async_trait]
impl ManagerService for Arc<Shared> {
    async fn quorum(
        &self,
        request: Request<ManagerQuorumRequest>,
    ) -> std::result::Result<Response<ManagerQuorumResponse>, Status> {
        let timeout = deadline::of(request.metadata())?;
        let req = request.into_inner();
        self.check_rank(req.group_rank)?;
        let mut issued = {
            let mut group = self.group.lock().await;
            group
                .checkpoint_metadata
                .insert(req.group_rank, req.checkpoint_metadata.clone());
            let member = QuorumMember {
                replica_id: self.opts.replica_id.clone(),
                address: self.address.clone(),
                store_address: self.opts.store_addr.clone(),
                step: req.step,
                world_size: self.opts.world_size,
                shrink_only: req.shrink_only,
                data: TCH_DIST_MEMBER.to_string(),
                commit_failures: req.commit_failures,
            };
            group.asking.insert(req.group_rank, member.clone());
            let issued = group.issued.subscribe();
            if group.asking.len() as u64 == self.opts.world_size {
                group.asking.clear();
                let shared = self.clone();
                let out = group.issued.clone();
                tokio::spawn(async move {
                    let _ = out.send(shared.lighthouse_quorum(member, timeout).await);
                });
            }
            issued
        };
        // The group's other ranks must ask too. A rank that never does (a rank that made no
        // manager, or calls no `start_quorum`) is named before the caller's deadline, rather
        // than left for the caller to time out on: a tenth of it stays for the answer.
        let received = match tokio::time::timeout(timeout - timeout / 10, issued.recv()).await {
            Ok(received) => received,
            Err(_) => {
                let group = self.group.lock().await;
                // Still unissued, this rank's request stays in it: were it this rank's last,
                // the answer would go to no one, and asking again replaces it.
                if group.asking.contains_key(&req.group_rank) {
                    let world_size = i64::try_from(self.opts.world_size).unwrap_or(i64::MAX);
                    let missing: Vec<i64> = (0..world_size)
                        .filter(|r| !group.asking.contains_key(r))
                        .collect();
                    return Err(Status::failed_precondition(format!(
                        "group ranks {missing:?} of {} did not ask for the quorum of step {} \
                         within {timeout:?} (every rank of a replica group makes a manager and \
                         begins each step with start_quorum)",
                        self.opts.replica_id, req.step
                    )));
                }
                // The round was issued meanwhile: its answer (or the lighthouse call's
                // failure) is on its way.
                drop(group);
                issued.recv().await
            }
        };
        let quorum = match received {
            Ok(Ok(q)) => q,
            Ok(Err(failure)) => return Err(Status::unavailable(failure)),
            Err(e) => return Err(Status::internal(e.to_string())),
        };
        let stranger = quorum
            .participants
            .iter()
            .find(|p| p.data != TCH_DIST_MEMBER)
            .filter(|_| self.opts.members == QuorumMembers::TchDistOnly);
        if let Some(other) = stranger {
            return Err(Status::failed_precondition(format!(
                "replica group {} of quorum {} is no tch-dist group (a torchft group, say): it \
                 shares the lighthouse, but cannot average with tch-dist's groups (their \
                 cross-group collectives differ)",
                other.replica_id, quorum.quorum_id
            )));
        }
        results::quorum_results(
            &self.opts.replica_id,
            req.group_rank,
            &quorum,
            req.init_sync,
        )
        .map(Response::new)
        .map_err(|results::NotAMember(id)| {
            Status::not_found(format!(
                "replica {id} is not in the quorum the lighthouse issued"
            ))
        })
    }

    async fn checkpoint_metadata(
        &self,
        request: Request<CheckpointMetadataRequest>,
    ) -> std::result::Result<Response<CheckpointMetadataResponse>, Status> {
        let rank = request.into_inner().rank;
        let group = self.group.lock().await;
        let metadata = group.checkpoint_metadata.get(&rank).ok_or_else(|| {
            Status::invalid_argument(format!("rank {rank} has sent no checkpoint metadata"))
        })?;
        Ok(Response::new(CheckpointMetadataResponse {
            checkpoint_metadata: metadata.clone(),
        }))
    }

    async fn should_commit(
        &self,
        request: Request<ShouldCommitRequest>,
    ) -> std::result::Result<Response<ShouldCommitResponse>, Status> {
        let req = request.into_inner();
        self.check_rank(req.group_rank)?;
        let mut decided = {
            let mut group = self.group.lock().await;
            let votes = &mut group.votes;
            if !req.should_commit {
                votes.against.insert(req.group_rank);
            }
            votes.voted.insert(req.group_rank);
            let decided = votes.decided.subscribe();
            if votes.voted.len() as u64 == self.opts.world_size {
                let _ = votes.decided.send(votes.against.is_empty());
                // The next step's votes start afresh, on a new channel.
                *votes = Votes::new();
            }
            decided
        };
        let should_commit = decided
            .recv()
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(ShouldCommitResponse { should_commit }))
    }

    async fn kill(
        &self,
        request: Request<KillRequest>,
    ) -> std::result::Result<Response<KillResponse>, Status> {
        // torchft's semantics (the lighthouse dashboard's kill button): the process ends.
        eprintln!(
            "tch-dist-ft: the manager of {} was asked to kill its process: {}",
            self.opts.replica_id,
            request.into_inner().msg
        );
        std::process::exit(1);
    }
}

/// A running manager server (torchft's `ManagerServer`), on the group's rank 0; it stops when
/// dropped.
///
/// ```no_run
/// use std::time::Duration;
/// use tch_dist_ft::{ManagerOptions, ManagerServer};
///
/// let manager = ManagerServer::start(ManagerOptions {
///     replica_id: "replica_0:1".into(),
///     lighthouse_addr: "http://127.0.0.1:29510".into(),
///     hostname: "127.0.0.1".into(),
///     bind: "127.0.0.1:0".into(),
///     store_addr: "127.0.0.1:29500".into(),
///     world_size: 1,
///     heartbeat_interval: Duration::from_millis(100),
///     connect_timeout: Duration::from_secs(10),
///     quorum_retries: 0,
///     members: Default::default(),
/// })?;
/// println!("the group's ranks call {}", manager.address());
/// # Ok::<(), tch_dist_ft::FtError>(())
/// ```
pub struct ManagerServer {
    _serving: Serving,
    address: String,
}

impl ManagerServer {
    /// Listens on `opts.bind` and starts heartbeating to the lighthouse (which need not be up
    /// yet: the connection is made, and remade, as needed).
    pub fn start(opts: ManagerOptions) -> Result<Self> {
        let bound = Bound::new("manager bind", &opts.bind)?;
        let lighthouse = LighthouseServiceClient::new(lazy_channel(
            bound.runtime(),
            "lighthouse connect",
            &opts.lighthouse_addr,
            opts.connect_timeout,
        )?);
        let address = advertised(&opts.hostname, bound.local_addr().port());
        let shared = Arc::new(Shared {
            opts,
            address: address.clone(),
            lighthouse,
            group: Mutex::new(Group {
                checkpoint_metadata: HashMap::new(),
                asking: HashMap::new(),
                issued: broadcast::channel(16).0,
                votes: Votes::new(),
            }),
        });
        let serving = bound.serve(
            Routes::new(ManagerServiceServer::new(shared.clone())),
            shared.heartbeats(),
        );
        Ok(ManagerServer {
            _serving: serving,
            address,
        })
    }

    /// `http://hostname:port`, where the group's ranks and other groups reach it.
    pub fn address(&self) -> String {
        self.address.clone()
    }

    /// Stops serving (also on drop).
    pub fn shutdown(self) {}
}

/// `http://host:port` (an IPv6 host in brackets).
fn advertised(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("http://[{host}]:{port}")
    } else {
        format!("http://{host}:{port}")
    }
}

impl std::fmt::Debug for ManagerServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagerServer")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}
