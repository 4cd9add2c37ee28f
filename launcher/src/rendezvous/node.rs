//! One launcher's life in the dynamic rendezvous (torchrun's `_invoke_run`): join a round,
//! wait for it to complete, start this node's ranks with the round's placement, watch the
//! round while they run (a thread polls every [`POLL`]), and when they end:
//!
//! - all succeeded: close the rendezvous (`finished`: nobody restarts any more) and exit 0;
//! - a rank failed: spend one of this node's own restarts and join the next round, or, with
//!   none left, close the rendezvous naming this node and exit with the rank's status;
//! - the round was called off (a node waits to join, a node left, failed or stopped
//!   answering): stop the ranks without spending a restart and join the next round;
//! - the rendezvous was closed by a node out of restarts: stop the ranks and exit 1;
//! - a signal: leave the rendezvous (without closing it, as torchrun) and exit 128+N.
//!
//! The hosting launcher stays, once closed, until every node has heard (at most the close
//! timeout), so that the others learn from it why the job ends.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::client::{Client, Failure};
use super::host::listen_if_host;
use super::round::{Assignment, CloseWhy, Closure, Member, NodeId, Reply, Request};
use super::server::Server;
use super::Config;
use crate::supervise::{first_signal, signal_name};
use crate::Start;

/// How often a node asks where it stands (also its keep-alive), waiting or running.
pub const POLL: Duration = Duration::from_millis(250);

/// How often a node that never reached the rendezvous tries again (its host may start
/// later, up to the join timeout).
const RETRY: Duration = Duration::from_millis(500);

/// What ends a wait for a round.
enum Met {
    Assigned(Assignment),
    Closed(Closure),
    Signal(libc::c_int),
}

/// What the watch of a running round found.
#[derive(Clone)]
enum Verdict {
    /// The round is over: restart in the next one.
    Restart(String),
    /// Closed by a node out of restarts.
    Closed(Closure),
}

/// This node: its rendezvous, its name in it, its restarts.
struct Node<'a> {
    cfg: &'a Config,
    client: Client,
    server: Option<Server>,
    token: u64,
    nproc: usize,
    /// Known once the first join went through (the address comes from its connection).
    id: Option<NodeId>,
    /// When the rendezvous last answered.
    last_contact: Option<Instant>,
    /// The round this node last ran in, and its group rank there, for messages.
    placed: Option<(u64, usize)>,
    /// A closure this node heard of (a `finished` one lets running ranks run on).
    closed: Option<Closure>,
}

/// Runs this node of the job until it ends; returns the launcher's exit status. `start`
/// starts and supervises one start of the ranks, stopping them (without a failure) when its
/// second argument returns true, and returns their status and whether a rank failed.
pub fn run_node(
    cfg: &Config,
    run_id: &str,
    nproc: usize,
    max_restarts: u32,
    mut start: impl FnMut(&Start, &mut dyn FnMut() -> bool) -> Result<(i32, bool), String>,
) -> Result<i32, String> {
    for key in &cfg.ignored {
        eprintln!("tch-dist-run: --rdzv-conf {key} is torchrun's and not used here");
    }
    // Up to the join timeout for a name to resolve: the endpoint's host may come up later.
    let addrs = crate::store::resolve(
        &cfg.host,
        cfg.port,
        Instant::now() + Duration::from_secs(30).min(cfg.join_timeout),
    )
    .map_err(|e| format!("the rendezvous endpoint {}: {e}", cfg.endpoint))?;
    let server = match listen_if_host(&cfg.endpoint, &addrs, cfg.is_host)? {
        Some(listener) => {
            let server = Server::start(listener, cfg.rules(), run_id)?;
            eprintln!(
                "tch-dist-run: hosting the rendezvous of run {run_id} at {}",
                server.addr()
            );
            Some(server)
        }
        None => None,
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut node = Node {
        cfg,
        client: Client::new(&cfg.endpoint, addrs, run_id, cfg.heartbeat),
        server,
        token: now.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32),
        nproc,
        id: None,
        last_contact: None,
        placed: None,
        closed: None,
    };
    let mut restarts = 0u32;
    // The status of the last failed start, for an exit after it.
    let mut failed: Option<i32> = None;
    loop {
        let a = match node.meet()? {
            Met::Assigned(a) => a,
            Met::Closed(c) => {
                eprintln!("tch-dist-run: {c}; not starting the ranks ({})", node.who());
                node.closed = Some(c);
                return Ok(node.exit(failed.unwrap_or(1)));
            }
            Met::Signal(sig) => {
                eprintln!(
                    "tch-dist-run: received signal {sig} ({}) while waiting for a round; leaving \
                     the rendezvous",
                    signal_name(sig).unwrap_or("signal")
                );
                node.leave();
                return Ok(128 + sig);
            }
        };
        node.placed = Some((a.round, a.group_rank));
        eprintln!(
            "tch-dist-run: round {}: node {} of {} ({}): ranks {}..{} of {}, master {}:{}",
            a.round,
            a.group_rank,
            a.group_world_size,
            node.id_text(),
            a.rank_base,
            a.rank_base + nproc - 1,
            a.world_size,
            a.master_addr,
            a.master_port
        );
        let this = Start {
            rank_base: a.rank_base,
            world_size: a.world_size,
            group_rank: a.group_rank,
            group_world_size: a.group_world_size,
            master_addr: a.master_addr.clone(),
            master_port: a.master_port,
            run_id: run_id.to_string(),
            restart: restarts,
            max_restarts,
            round: Some(a.round),
        };
        let watch = Watch::start(&node);
        let mut verdict = None;
        let started = start(&this, &mut || {
            verdict = watch.verdict();
            verdict.is_some()
        });
        let (code, rank_failed) = match started {
            Ok(ended) => ended,
            Err(e) => {
                // The ranks could not be started: the others go on without this node
                // rather than wait for its keep-alives to stop.
                watch.stop();
                node.leave();
                return Err(format!("{e} ({})", node.who()));
            }
        };
        if let Some(c) = watch.stop() {
            node.closed.get_or_insert(c);
        }
        if first_signal().is_some() {
            // The supervisor said which signal, and stopped the ranks.
            node.leave();
            return Ok(code);
        }
        if rank_failed {
            failed = Some(code);
            if let Some(c) = node.closed.clone() {
                eprintln!("tch-dist-run: {c}; not restarting ({})", node.who());
                return Ok(node.exit(code));
            }
            if restarts < max_restarts {
                restarts += 1;
                eprintln!(
                    "tch-dist-run: starting the ranks again in the next round (restart \
                     {restarts} of {max_restarts}; {})",
                    node.who()
                );
                continue;
            }
            let failure = format!("its ranks failed with exit status {code}");
            eprintln!(
                "tch-dist-run: {} has used its {max_restarts} restart(s) and {failure}; \
                 closing the rendezvous",
                node.who()
            );
            node.close(CloseWhy::OutOfRestarts {
                restarts: max_restarts,
                failure,
            });
            return Ok(node.exit(code));
        }
        match verdict {
            Some(Verdict::Restart(why)) => {
                eprintln!(
                    "tch-dist-run: round {}: {why}; stopped this node's ranks to meet in the \
                     next round, no restart spent ({})",
                    a.round,
                    node.who()
                );
            }
            Some(Verdict::Closed(c)) => {
                eprintln!(
                    "tch-dist-run: {c}; stopped this node's ranks ({})",
                    node.who()
                );
                node.closed = Some(c);
                return Ok(node.exit(1));
            }
            None => {
                // Every rank succeeded.
                if node.closed.is_none() {
                    node.close(CloseWhy::Finished);
                }
                return Ok(node.exit(code));
            }
        }
    }
}

impl Node<'_> {
    /// This node for messages: its place in its last round, its address and pid.
    fn who(&self) -> String {
        match self.placed {
            Some((round, g)) => format!("node {g} of round {round} ({})", self.id_text()),
            None => format!("node {}", self.id_text()),
        }
    }

    fn id_text(&self) -> String {
        match &self.id {
            Some(id) => format!("{}, pid {}", id.addr, id.pid),
            None => format!("pid {}", std::process::id()),
        }
    }

    /// One request, with this node's name; the join also names it the first time.
    fn ask(&mut self, make: impl FnOnce(NodeId) -> Request) -> Result<Reply, Failure> {
        let (local, token) = (self.cfg.local_addr.clone(), self.token);
        let known = self.id.clone();
        let mut named = None;
        let reply = self.client.ask(|ip: IpAddr| {
            let id = known.unwrap_or_else(|| NodeId {
                addr: local.unwrap_or_else(|| ip.to_string()),
                pid: std::process::id(),
                token,
            });
            named = Some(id.clone());
            make(id)
        })?;
        self.last_contact = Some(Instant::now());
        if self.id.is_none() {
            self.id = named;
        }
        Ok(reply)
    }

    /// Joins and waits until a round takes this node in.
    fn meet(&mut self) -> Result<Met, String> {
        let deadline = Instant::now() + self.cfg.join_timeout;
        // The watch heard from the rendezvous while the ranks ran: the silence that counts
        // starts now.
        if self.last_contact.is_some() {
            self.last_contact = Some(Instant::now());
        }
        let nnodes = (self.cfg.min_nodes, self.cfg.max_nodes);
        let member = Member {
            nproc: self.nproc,
            ports: two_free_ports()?,
        };
        let mut joined = false;
        let mut last_waiting = None;
        let mut said_unreachable = false;
        loop {
            if let Some(sig) = first_signal() {
                return Ok(Met::Signal(sig));
            }
            if Instant::now() >= deadline {
                let present = match last_waiting {
                    Some((round, present)) => {
                        format!("round {round} had {present} node(s)")
                    }
                    None => "the rendezvous never answered".to_string(),
                };
                return Err(format!(
                    "no round took this node in within the join timeout ({} s): {present} of \
                     --nnodes {}:{} ({})",
                    self.cfg.join_timeout.as_secs(),
                    nnodes.0,
                    nnodes.1,
                    self.who()
                ));
            }
            let reply = if joined {
                self.ask(|id| Request::Poll { id })
            } else {
                let member = member.clone();
                self.ask(|id| Request::Join { id, member, nnodes })
            };
            let reply = match reply {
                Ok(r) => r,
                Err(Failure::Garbled(e)) => return Err(format!("{e} ({})", self.who())),
                Err(Failure::Unreachable(e)) => {
                    match self.last_contact {
                        Some(at) if at.elapsed() > self.cfg.rules().dead_after() => {
                            return Err(format!(
                                "lost the rendezvous for {} s: {e} ({})",
                                at.elapsed().as_secs(),
                                self.who()
                            ));
                        }
                        None if !said_unreachable => {
                            eprintln!(
                                "tch-dist-run: waiting for the rendezvous at {} ({e})",
                                self.cfg.endpoint
                            );
                            said_unreachable = true;
                        }
                        _ => {}
                    }
                    pause(if self.last_contact.is_some() {
                        POLL
                    } else {
                        RETRY
                    });
                    continue;
                }
            };
            match reply {
                Reply::Assigned(a) => return Ok(Met::Assigned(a)),
                Reply::Closed(c) => return Ok(Met::Closed(c)),
                Reply::Refused { why } => {
                    return Err(format!(
                        "the rendezvous at {} refused this node: {why}",
                        self.cfg.endpoint
                    ))
                }
                Reply::Waiting { round, present, .. } => {
                    joined = true;
                    last_waiting = Some((round, present));
                }
                // The round it was put in ended before it started, or it was dropped:
                // join again.
                Reply::Restart { .. } | Reply::Unknown { .. } | Reply::Done => joined = false,
            }
            pause(POLL);
        }
    }

    /// Closes the rendezvous, best effort (the host may be gone: then nobody can restart
    /// anyway).
    fn close(&mut self, why: CloseWhy) {
        if let Err(e) = self.ask(|id| Request::Close { id, why }) {
            eprintln!("tch-dist-run: could not close the rendezvous: {e}");
        }
    }

    /// Leaves the rendezvous, best effort.
    fn leave(&mut self) {
        if self.id.is_some() {
            let _ = self.ask(|id| Request::Leave { id });
        }
    }

    /// The exit status `code`, once the host (if this is it) has told the others.
    fn exit(&self, code: i32) -> i32 {
        if let Some(server) = &self.server
            && !server.linger(self.cfg.close_timeout, || first_signal().is_some())
        {
            eprintln!(
                "tch-dist-run: leaving the rendezvous' host before every node heard that it \
                     closed"
            );
        }
        code
    }
}

/// Sleeps `d` in slices, waking early on a signal.
fn pause(d: Duration) {
    let end = Instant::now() + d;
    while first_signal().is_none() && Instant::now() < end {
        std::thread::sleep(
            Duration::from_millis(20).min(end.saturating_duration_since(Instant::now())),
        );
    }
}

/// Two different ports free on this host a moment ago (for the workers' store, should this
/// node be node 0 of the round).
fn two_free_ports() -> Result<[u16; 2], String> {
    let bind = || {
        TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)))
            .or_else(|_| TcpListener::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0))))
    };
    // Both held at once: they differ.
    let (a, b) = bind()
        .and_then(|a| Ok((bind()?, a)))
        .map(|(b, a)| (a, b))
        .map_err(|e| format!("cannot find a free port for the workers' store: {e}"))?;
    let port = |l: &TcpListener| {
        l.local_addr()
            .map(|a| a.port())
            .map_err(|e| format!("cannot find a free port for the workers' store: {e}"))
    };
    Ok([port(&a)?, port(&b)?])
}

/// The watch of a running round: a thread polls the rendezvous every [`POLL`] and keeps
/// what it found for the supervision loop, which must not wait on the network.
struct Watch {
    shared: Arc<Mutex<Watched>>,
}

#[derive(Default)]
struct Watched {
    verdict: Option<Verdict>,
    /// A `finished` closure: the ranks run on, but nobody restarts.
    finished: Option<Closure>,
    stop: bool,
}

fn lock(m: &Mutex<Watched>) -> std::sync::MutexGuard<'_, Watched> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Watch {
    fn start(node: &Node<'_>) -> Watch {
        let shared = Arc::new(Mutex::new(Watched::default()));
        let (Some(id), false) = (node.id.clone(), node.closed.is_some()) else {
            // Closed already (finished): nothing to watch.
            return Watch { shared };
        };
        let client = node.client.clone();
        let dead_after = node.cfg.rules().dead_after();
        let endpoint = node.cfg.endpoint.clone();
        let watched = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("rendezvous watch".into())
            .spawn(move || {
                let mut last_contact = Instant::now();
                loop {
                    let reply = client.ask(|_| Request::Poll { id: id.clone() });
                    let mut w = lock(&watched);
                    if w.stop {
                        return;
                    }
                    let found = match reply {
                        Ok(Reply::Assigned(_)) | Ok(Reply::Waiting { .. }) | Ok(Reply::Done) => {
                            last_contact = Instant::now();
                            None
                        }
                        Ok(Reply::Restart { why, .. }) => Some(Verdict::Restart(why)),
                        Ok(Reply::Unknown { .. }) => Some(Verdict::Restart(
                            "the rendezvous dropped this node (it did not hear from it in time)"
                                .into(),
                        )),
                        Ok(Reply::Closed(c)) => match c.why {
                            CloseWhy::Finished => {
                                w.finished = Some(c);
                                // Nothing more to learn: the ranks run to their end.
                                return;
                            }
                            CloseWhy::OutOfRestarts { .. } => Some(Verdict::Closed(c)),
                        },
                        Ok(Reply::Refused { why }) => Some(Verdict::Restart(format!(
                            "the rendezvous at {endpoint} refused this node: {why}"
                        ))),
                        Err(e) if last_contact.elapsed() > dead_after => {
                            Some(Verdict::Restart(format!(
                                "no answer from the rendezvous for {} s, which has dropped this \
                                 node by now ({e})",
                                last_contact.elapsed().as_secs()
                            )))
                        }
                        Err(_) => None,
                    };
                    if let Some(v) = found {
                        w.verdict = Some(v);
                        return;
                    }
                    drop(w);
                    std::thread::sleep(POLL);
                }
            });
        if spawned.is_err() {
            eprintln!("tch-dist-run: cannot start the rendezvous watch; the ranks run unwatched");
        }
        Watch { shared }
    }

    /// What the watch found, if anything (it stops looking once it found something).
    fn verdict(&self) -> Option<Verdict> {
        lock(&self.shared).verdict.clone()
    }

    /// Stops the watch (its thread ends after its current request); returns the `finished`
    /// closure it heard of, if any.
    fn stop(self) -> Option<Closure> {
        let mut w = lock(&self.shared);
        w.stop = true;
        w.finished.take().or_else(|| match &w.verdict {
            Some(Verdict::Closed(c)) => Some(c.clone()),
            _ => None,
        })
    }
}
