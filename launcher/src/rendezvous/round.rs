//! The rendezvous' rounds as a pure state machine: what the hosting launcher keeps, and how
//! each request (and the passing of time) changes it. No sockets and no clock of its own:
//! every call takes `now`, so that the tests below drive it through whole jobs.
//!
//! torchrun's `dynamic_rendezvous.py` keeps the same state (round, complete, deadline,
//! closed, participants, wait list, redundancy list, last heartbeats) in a pickled object
//! that every agent updates with compare-and-set; here one launcher holds it and the others
//! ask, so one clock decides every deadline.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

/// One launcher of the job, as torchrun's `_NodeDesc` names it: the address it reaches the
/// rendezvous from (or its `--local-addr`), its pid, and a number it drew at start (a pid can
/// come back after a reboot, or twice in two containers). Nodes are ranked in this order
/// (address, then pid), as torchrun sorts its node descriptors.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId {
    pub addr: String,
    pub pid: u32,
    pub token: u64,
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, pid {}", self.addr, self.pid)
    }
}

/// What a node brings to a round: its ranks, and two ports that were free on its host a
/// moment ago, for the workers' store should it be node 0 (the second when the first is the
/// last round's: a store of the last round must never be met again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub nproc: usize,
    pub ports: [u16; 2],
}

/// The node counts and timeouts of a rendezvous (torchrun's `RendezvousSettings` and
/// `RendezvousTimeout`, `--nnodes MIN:MAX` and `--rdzv-conf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    pub min_nodes: usize,
    pub max_nodes: usize,
    /// From MIN nodes present to the round's completion, for late nodes to come in.
    pub last_call: Duration,
    /// A node says it lives at least this often.
    pub keep_alive_interval: Duration,
    /// Missed keep-alives after which a node is dropped.
    pub keep_alive_max_attempt: u32,
}

impl Rules {
    /// How long a node may be silent before it is dropped (15 s by default).
    pub fn dead_after(&self) -> Duration {
        self.keep_alive_interval
            .saturating_mul(self.keep_alive_max_attempt.max(1))
    }
}

/// Why a node closed the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseWhy {
    /// Its ranks all succeeded: the job is over, nobody restarts any more.
    Finished,
    /// Its ranks failed and it has no restart left; `failure` says how they failed.
    OutOfRestarts { restarts: u32, failure: String },
}

/// The rendezvous is closed: by whom, in which round, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closure {
    pub round: u64,
    pub by: NodeId,
    /// Its group rank in that round, when it had one.
    pub group_rank: Option<usize>,
    pub why: CloseWhy,
}

impl fmt::Display for Closure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let node = match self.group_rank {
            Some(g) => format!("node {g} ({})", self.by),
            None => format!("node {}", self.by),
        };
        match &self.why {
            CloseWhy::Finished => write!(
                f,
                "the rendezvous was closed in round {} by {node}, whose ranks finished",
                self.round
            ),
            CloseWhy::OutOfRestarts { restarts, failure } => write!(
                f,
                "the rendezvous was closed in round {} by {node}, which ran out of restarts \
                 ({restarts} used; {failure})",
                self.round
            ),
        }
    }
}

/// A node's place in a complete round: what its ranks' variables say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub round: u64,
    /// GROUP_RANK: the node's index in the round's sorted nodes.
    pub group_rank: usize,
    /// GROUP_WORLD_SIZE: the nodes in the round.
    pub group_world_size: usize,
    /// The global rank of the node's first rank: the ranks of the nodes before it.
    pub rank_base: usize,
    /// WORLD_SIZE: every node's ranks.
    pub world_size: usize,
    /// MASTER_ADDR and MASTER_PORT: node 0's address, and a port free on its host.
    pub master_addr: String,
    pub master_port: u16,
}

/// What a node asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Into the next round it can be in (leaving its complete round first, if it is in one).
    Join {
        id: NodeId,
        member: Member,
        /// Its `--nnodes MIN:MAX`, which must be the rendezvous'.
        nnodes: (usize, usize),
    },
    /// Where it stands (and a keep-alive).
    Poll { id: NodeId },
    /// Closes the rendezvous (the node ends: success, or no restart left).
    Close { id: NodeId, why: CloseWhy },
    /// Leaves for good without closing (its launcher got a signal).
    Leave { id: NodeId },
}

impl Request {
    pub fn node(&self) -> &NodeId {
        match self {
            Request::Join { id, .. }
            | Request::Poll { id }
            | Request::Close { id, .. }
            | Request::Leave { id } => id,
        }
    }
}

/// What a node is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Round `round` is not complete yet: `present` nodes of MIN..MAX are in it; the last
    /// call ends in `last_call_left` once MIN are there.
    Waiting {
        round: u64,
        present: usize,
        last_call_left: Option<Duration>,
    },
    /// Round `round` is complete and the node is in it.
    Assigned(Assignment),
    /// The node's round `round` is over (a node left, failed, died, or is waiting to come
    /// in): stop the ranks and join again.
    Restart { round: u64, why: String },
    /// The rendezvous is closed.
    Closed(Closure),
    /// The rendezvous does not know this node (it was dropped as dead): join again.
    Unknown { round: u64 },
    /// The request cannot be served (a node count that differs from the rendezvous').
    Refused { why: String },
    /// Done (a close or a leave).
    Done,
}

/// The state of a rendezvous.
#[derive(Debug)]
pub struct Rendezvous {
    rules: Rules,
    round: u64,
    complete: bool,
    /// When the last call ends (set once MIN nodes are in an incomplete round).
    deadline: Option<Instant>,
    /// The round's nodes, in rank order.
    participants: BTreeMap<NodeId, Member>,
    /// Nodes waiting for the next round (torchrun's wait list and redundancy list in one:
    /// whether they call the running round off depends on whether there is room).
    waiting: BTreeMap<NodeId, Member>,
    /// When each known node was last heard from.
    seen: BTreeMap<NodeId, Instant>,
    /// The complete round's placement of each participant.
    assigned: BTreeMap<NodeId, Assignment>,
    /// The participants that were told their placement.
    delivered: BTreeSet<NodeId>,
    /// Why the complete round is over for its participants (one left or died).
    broken: Option<String>,
    closed: Option<Closure>,
    /// After the closure: the nodes not told yet.
    to_tell: BTreeSet<NodeId>,
    /// The last round's store, which the next round's must not be.
    last_master: Option<(String, u16)>,
}

impl Rendezvous {
    pub fn new(rules: Rules) -> Rendezvous {
        Rendezvous {
            rules,
            round: 0,
            complete: false,
            deadline: None,
            participants: BTreeMap::new(),
            waiting: BTreeMap::new(),
            seen: BTreeMap::new(),
            assigned: BTreeMap::new(),
            delivered: BTreeSet::new(),
            broken: None,
            closed: None,
            to_tell: BTreeSet::new(),
            last_master: None,
        }
    }

    /// The closure, once closed.
    pub fn closure(&self) -> Option<&Closure> {
        self.closed.as_ref()
    }

    /// Whether every node known at the closure has been told of it (or has died since), so
    /// that the host may go.
    pub fn everyone_told(&self) -> bool {
        self.closed.is_some() && self.to_tell.is_empty()
    }

    /// Serves one request at `now`.
    pub fn handle(&mut self, now: Instant, request: Request) -> Reply {
        self.tick(now);
        match request {
            Request::Join { id, member, nnodes } => self.join(now, id, member, nnodes),
            Request::Poll { id } => {
                if self.closed.is_some() {
                    return self.after_closure(&id);
                }
                if !self.knows(&id) {
                    return Reply::Unknown { round: self.round };
                }
                self.seen.insert(id.clone(), now);
                self.view(now, &id)
            }
            Request::Close { id, why } => {
                if self.closed.is_none() {
                    let group_rank = self.assigned.get(&id).map(|a| a.group_rank);
                    self.to_tell = self.seen.keys().filter(|n| **n != id).cloned().collect();
                    self.closed = Some(Closure {
                        round: self.round,
                        by: id.clone(),
                        group_rank,
                        why,
                    });
                }
                // The rounds are over: the closer stays where it was (its round's other
                // nodes may still be about to start).
                self.to_tell.remove(&id);
                self.seen.remove(&id);
                Reply::Done
            }
            Request::Leave { id } => {
                self.to_tell.remove(&id);
                self.forget(now, &id, "left (its launcher got a signal)");
                Reply::Done
            }
        }
    }

    /// What time alone changes: silent nodes dropped, a last call that ended.
    pub fn tick(&mut self, now: Instant) {
        let dead_after = self.rules.dead_after();
        let dead: Vec<NodeId> = self
            .seen
            .iter()
            .filter(|&(_, &at)| now.saturating_duration_since(at) > dead_after)
            .map(|(id, _)| id.clone())
            .collect();
        for id in dead {
            self.to_tell.remove(&id);
            let why = format!(
                "stopped answering (no keep-alive for {} s)",
                dead_after.as_secs_f64()
            );
            self.forget(now, &id, &why);
        }
        if !self.complete
            && self.participants.len() >= self.rules.min_nodes
            && self.deadline.is_some_and(|d| now >= d)
        {
            self.complete_round();
        }
    }

    fn knows(&self, id: &NodeId) -> bool {
        self.participants.contains_key(id) || self.waiting.contains_key(id)
    }

    fn join(&mut self, now: Instant, id: NodeId, member: Member, nnodes: (usize, usize)) -> Reply {
        let ours = (self.rules.min_nodes, self.rules.max_nodes);
        if nnodes != ours {
            return Reply::Refused {
                why: format!(
                    "node {id} asks for --nnodes {}:{}, but this rendezvous was opened with \
                     --nnodes {}:{} (every node needs the same)",
                    nnodes.0, nnodes.1, ours.0, ours.1
                ),
            };
        }
        if self.closed.is_some() {
            // A join as much as a poll: a node that asked again (its reply lost, or a
            // restart's second join) may be in the last round.
            return self.after_closure(&id);
        }
        self.seen.insert(id.clone(), now);
        if self.participants.contains_key(&id) {
            if !self.complete {
                // Asked again (a reply that was lost): it stays where it is.
                self.participants.insert(id.clone(), member);
                return self.view(now, &id);
            }
            // It leaves its complete round to restart, and waits for the next one: when it
            // is the last to leave, the next round opens with it among the waiting.
            let why = format!(
                "node {} left round {} to restart its ranks",
                self.describe(&id),
                self.round
            );
            self.waiting.insert(id.clone(), member.clone());
            self.leave_round(now, &id, &why);
        }
        if self.participants.contains_key(&id) {
            // Taken into the round that opened as it left.
        } else if !self.complete && self.participants.len() < self.rules.max_nodes {
            self.waiting.remove(&id);
            self.participants.insert(id.clone(), member);
            self.counted(now);
        } else {
            self.waiting.insert(id.clone(), member);
        }
        self.view(now, &id)
    }

    /// `id` is gone from the rendezvous (dead, left, or it closed it).
    fn forget(&mut self, now: Instant, id: &NodeId, what: &str) {
        self.seen.remove(id);
        self.waiting.remove(id);
        if self.participants.contains_key(id) {
            let why = format!("node {} {what}", self.describe(id));
            self.leave_round(now, id, &why);
        }
    }

    /// `id` leaves the participants: a complete round is over for the others (the next
    /// begins once the last has left), an incomplete one may fall below MIN.
    fn leave_round(&mut self, now: Instant, id: &NodeId, why: &str) {
        self.participants.remove(id);
        self.assigned.remove(id);
        if self.complete {
            if self.participants.is_empty() {
                self.next_round(now);
            } else if self.broken.is_none() {
                self.broken = Some(why.to_string());
            }
        } else if self.participants.len() < self.rules.min_nodes {
            self.deadline = None;
        }
    }

    /// The next round opens, with the waiting nodes in it (in rank order, up to MAX).
    fn next_round(&mut self, now: Instant) {
        self.round += 1;
        self.complete = false;
        self.deadline = None;
        self.broken = None;
        self.assigned.clear();
        let room = self.rules.max_nodes.saturating_sub(self.participants.len());
        let coming: Vec<NodeId> = self.waiting.keys().take(room).cloned().collect();
        for id in coming {
            if let Some(m) = self.waiting.remove(&id) {
                self.participants.insert(id, m);
            }
        }
        self.counted(now);
    }

    /// MIN present starts the last call; MAX completes the round.
    fn counted(&mut self, now: Instant) {
        let n = self.participants.len();
        if n >= self.rules.max_nodes {
            self.complete_round();
        } else if n >= self.rules.min_nodes && self.deadline.is_none() {
            self.deadline = Some(now + self.rules.last_call);
        }
    }

    /// Ranks by sorted node, node 0's address and a port of its for the workers' store.
    fn complete_round(&mut self) {
        self.complete = true;
        self.deadline = None;
        self.broken = None;
        self.assigned.clear();
        self.delivered.clear();
        let world_size: usize = self.participants.values().map(|m| m.nproc).sum();
        let Some((first, member)) = self.participants.iter().next() else {
            return;
        };
        let mut port = member.ports[0];
        if self.last_master.as_ref() == Some(&(first.addr.clone(), port)) {
            port = member.ports[1];
        }
        let master = (first.addr.clone(), port);
        self.last_master = Some(master.clone());
        let mut base = 0;
        let n = self.participants.len();
        for (g, (id, m)) in self.participants.iter().enumerate() {
            self.assigned.insert(
                id.clone(),
                Assignment {
                    round: self.round,
                    group_rank: g,
                    group_world_size: n,
                    rank_base: base,
                    world_size,
                    master_addr: master.0.clone(),
                    master_port: master.1,
                },
            );
            base += m.nproc;
        }
    }

    /// Where `id`, a known node, stands.
    fn view(&mut self, now: Instant, id: &NodeId) -> Reply {
        if self.participants.contains_key(id) {
            if !self.complete {
                return Reply::Waiting {
                    round: self.round,
                    present: self.participants.len(),
                    last_call_left: self.deadline.map(|d| d.saturating_duration_since(now)),
                };
            }
            if let Some(why) = &self.broken {
                return Reply::Restart {
                    round: self.round,
                    why: why.clone(),
                };
            }
            if self.participants.len() < self.rules.max_nodes
                && let Some(w) = self.waiting.keys().next()
            {
                return Reply::Restart {
                    round: self.round,
                    why: format!("node {} (pid {}) is waiting to join", w.addr, w.pid),
                };
            }
            if let Some(a) = self.assigned.get(id).cloned() {
                self.delivered.insert(id.clone());
                return Reply::Assigned(a);
            }
        }
        Reply::Waiting {
            round: if self.complete {
                self.round + 1
            } else {
                self.round
            },
            present: self.participants.len(),
            last_call_left: None,
        }
    }

    /// What `id` hears once the rendezvous is closed: its placement when it is a node of the
    /// last round that has not heard it yet and the closure is `finished` (which ends the
    /// rounds to come, not this one: its ranks are the job's as much as the closer's), the
    /// closure otherwise.
    fn after_closure(&mut self, id: &NodeId) -> Reply {
        let finished = self
            .closed
            .as_ref()
            .is_some_and(|c| c.why == CloseWhy::Finished);
        if finished
            && !self.delivered.contains(id)
            && let Some(a) = self.assigned.get(id).cloned()
        {
            self.delivered.insert(id.clone());
            return Reply::Assigned(a);
        }
        self.tell(id)
    }

    /// The closure, told to `id`.
    fn tell(&mut self, id: &NodeId) -> Reply {
        self.to_tell.remove(id);
        match &self.closed {
            Some(c) => Reply::Closed(c.clone()),
            None => Reply::Unknown { round: self.round },
        }
    }

    /// `id` with its group rank in the complete round, for messages.
    fn describe(&self, id: &NodeId) -> String {
        match self.assigned.get(id) {
            Some(a) => format!("{} ({id})", a.group_rank),
            None => id.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(min: usize, max: usize) -> Rules {
        Rules {
            min_nodes: min,
            max_nodes: max,
            last_call: Duration::from_secs(30),
            keep_alive_interval: Duration::from_secs(5),
            keep_alive_max_attempt: 3,
        }
    }

    fn node(i: u8) -> NodeId {
        NodeId {
            addr: format!("10.77.0.{}", i + 1),
            pid: 100 + i as u32,
            token: 7,
        }
    }

    fn member(port: u16) -> Member {
        Member {
            nproc: 2,
            ports: [port, port + 1],
        }
    }

    struct Job {
        r: Rendezvous,
        t0: Instant,
        nnodes: (usize, usize),
    }

    impl Job {
        fn new(min: usize, max: usize) -> Job {
            Job {
                r: Rendezvous::new(rules(min, max)),
                t0: Instant::now(),
                nnodes: (min, max),
            }
        }
        fn at(&self, secs: f64) -> Instant {
            self.t0 + Duration::from_secs_f64(secs)
        }
        fn join(&mut self, secs: f64, i: u8) -> Reply {
            let now = self.at(secs);
            self.r.handle(
                now,
                Request::Join {
                    id: node(i),
                    member: member(20000 + 10 * i as u16),
                    nnodes: self.nnodes,
                },
            )
        }
        fn poll(&mut self, secs: f64, i: u8) -> Reply {
            let now = self.at(secs);
            self.r.handle(now, Request::Poll { id: node(i) })
        }
        /// Nodes `nodes` poll every second from `from` to `to` (their keep-alives), each
        /// reply `expect`ed.
        fn keep(&mut self, from: u32, to: u32, nodes: &[u8], expect: fn(&Reply) -> bool) {
            for t in from..to {
                for &i in nodes {
                    let reply = self.poll(t as f64, i);
                    assert!(expect(&reply), "node {i} at {t} s: {reply:?}");
                }
            }
        }
        fn assigned(&mut self, secs: f64, i: u8) -> Assignment {
            match self.poll(secs, i) {
                Reply::Assigned(a) => a,
                other => panic!("node {i} at {secs} s: {other:?}"),
            }
        }
    }

    #[test]
    fn max_nodes_complete_the_round_at_once_in_address_order() {
        let mut job = Job::new(2, 2);
        assert!(matches!(
            job.join(0.0, 1),
            Reply::Waiting {
                round: 0,
                present: 1,
                ..
            }
        ));
        let Reply::Assigned(a1) = job.join(0.1, 0) else {
            panic!("the second node completes the round");
        };
        assert_eq!((a1.group_rank, a1.rank_base, a1.world_size), (0, 0, 4));
        let a2 = job.assigned(0.2, 1);
        assert_eq!(
            (a2.group_rank, a2.group_world_size, a2.rank_base),
            (1, 2, 2)
        );
        // Node 0's address and its first port.
        assert_eq!(
            (a2.master_addr.as_str(), a2.master_port),
            ("10.77.0.1", 20000)
        );
        assert_eq!(
            a1,
            Assignment {
                group_rank: 0,
                rank_base: 0,
                ..a2.clone()
            }
        );
    }

    #[test]
    fn min_nodes_start_the_last_call_and_its_end_completes_the_round() {
        let mut job = Job::new(2, 3);
        job.join(0.0, 0);
        let Reply::Waiting {
            present: 2,
            last_call_left: Some(left),
            ..
        } = job.join(1.0, 1)
        else {
            panic!("a last call");
        };
        assert_eq!(left, Duration::from_secs(30));
        job.keep(2, 31, &[0, 1], |r| {
            matches!(r, Reply::Waiting { round: 0, .. })
        });
        let a = job.assigned(31.0, 1);
        assert_eq!((a.round, a.group_world_size, a.world_size), (0, 2, 4));
        // A late node waits for the next round, and calls the running one off (there is
        // room for it).
        assert!(matches!(job.join(32.0, 2), Reply::Waiting { round: 1, .. }));
        let Reply::Restart { round: 0, why } = job.poll(32.1, 0) else {
            panic!("a restart");
        };
        assert!(
            why.contains("node 10.77.0.3 (pid 102) is waiting to join"),
            "{why}"
        );
        // Both leave; the round after has all three, complete at MAX at once.
        assert!(matches!(job.join(33.0, 0), Reply::Waiting { round: 1, .. }));
        let Reply::Assigned(a) = job.join(33.5, 1) else {
            panic!("complete at three");
        };
        assert_eq!(
            (a.round, a.group_rank, a.group_world_size, a.world_size),
            (1, 1, 3, 6)
        );
        assert_eq!(job.assigned(33.6, 2).rank_base, 4);
    }

    #[test]
    fn a_node_below_min_does_not_start_the_last_call() {
        let mut job = Job::new(2, 3);
        job.join(0.0, 0);
        job.keep(1, 40, &[0], |r| {
            matches!(
                r,
                Reply::Waiting {
                    last_call_left: None,
                    ..
                }
            )
        });
    }

    /// A failing node leaves its complete round and waits; the others are told to restart
    /// (without spending anything: that is theirs to decide) and the next round has all.
    #[test]
    fn a_failed_node_restarts_everyone_in_the_next_round() {
        let mut job = Job::new(2, 2);
        job.join(0.0, 0);
        job.join(0.0, 1);
        let first = job.assigned(0.1, 0);
        assert!(matches!(job.join(5.0, 1), Reply::Waiting { round: 1, .. }));
        let Reply::Restart { round: 0, why } = job.poll(5.1, 0) else {
            panic!("restart");
        };
        assert!(
            why.contains("node 1 (10.77.0.2, pid 101) left round 0"),
            "{why}"
        );
        // Node 0 leaves last: round 1 opens with both, complete at once.
        let Reply::Assigned(a) = job.join(5.2, 0) else {
            panic!("round 1");
        };
        assert_eq!(a.round, 1);
        // A fresh store: node 0's other port, since its first one was round 0's.
        assert_eq!(first.master_port, 20000);
        assert_eq!(a.master_port, 20001);
        assert_eq!(job.assigned(5.3, 1).round, 1);
        // And round 2 may use the first port again.
        job.join(6.0, 0);
        let Reply::Assigned(a) = job.join(6.0, 1) else {
            panic!("round 2");
        };
        assert_eq!((a.round, a.master_port), (2, 20000));
    }

    /// A node that stops answering is dropped after 3 keep-alive intervals: its round is
    /// over for the others, who meet again without it (MIN 2 of 3: after the last call).
    #[test]
    fn a_silent_node_is_dropped_after_its_keep_alives() {
        let mut job = Job::new(2, 3);
        for i in 0..3 {
            job.join(0.0, i);
        }
        assert_eq!(job.assigned(0.1, 2).world_size, 6);
        // Nodes 0 and 1 keep polling; node 2 is silent from 0.1 s on.
        job.keep(1, 16, &[0, 1], |r| matches!(r, Reply::Assigned(_)));
        let Reply::Restart { round: 0, why } = job.poll(16.0, 0) else {
            panic!("node 2 dropped at 15.1 s");
        };
        assert!(
            why.contains("node 2 (10.77.0.3, pid 102) stopped answering"),
            "{why}"
        );
        assert!(matches!(job.poll(16.0, 2), Reply::Unknown { .. }));
        job.join(16.0, 0);
        let Reply::Waiting {
            round: 1,
            present: 2,
            last_call_left: Some(_),
        } = job.join(16.0, 1)
        else {
            panic!("round 1 with two");
        };
        job.keep(17, 46, &[0, 1], |r| {
            matches!(r, Reply::Waiting { round: 1, .. })
        });
        let a = job.assigned(46.0, 1);
        assert_eq!(
            (a.round, a.group_world_size, a.world_size, a.group_rank),
            (1, 2, 4, 1)
        );
    }

    /// A node that comes when the round is full waits, without calling it off; it comes in
    /// when the round ends for another reason.
    #[test]
    fn a_spare_node_waits_without_restarting_a_full_round() {
        let mut job = Job::new(2, 2);
        job.join(0.0, 0);
        job.join(0.0, 1);
        assert!(matches!(job.join(1.0, 2), Reply::Waiting { round: 1, .. }));
        job.assigned(1.1, 0);
        job.assigned(1.1, 1);
        // Node 1 fails and waits beside node 2: the next round takes the first MAX nodes in
        // address order (0 and 1), and node 2 waits on.
        job.join(2.0, 1);
        assert!(matches!(job.poll(2.1, 0), Reply::Restart { .. }));
        let Reply::Assigned(a) = job.join(2.2, 0) else {
            panic!("round 1");
        };
        assert_eq!(a.round, 1);
        assert_eq!(job.assigned(2.3, 1).group_rank, 1);
        assert!(matches!(job.poll(2.3, 2), Reply::Waiting { round: 2, .. }));
    }

    /// A node out of restarts closes: everyone is told once, by whom and why; a join after
    /// it is told too; the host may go once all have heard.
    #[test]
    fn a_closure_is_told_to_every_node() {
        let mut job = Job::new(2, 2);
        job.join(0.0, 0);
        job.join(0.0, 1);
        job.assigned(0.1, 0);
        let why = CloseWhy::OutOfRestarts {
            restarts: 1,
            failure: "a rank exited with status 3".into(),
        };
        let now = job.at(1.0);
        assert_eq!(
            job.r.handle(now, Request::Close { id: node(1), why }),
            Reply::Done
        );
        assert!(!job.r.everyone_told());
        let Reply::Closed(c) = job.poll(1.1, 0) else {
            panic!("closed");
        };
        assert_eq!(
            c.to_string(),
            "the rendezvous was closed in round 0 by node 1 (10.77.0.2, pid 101), which ran \
             out of restarts (1 used; a rank exited with status 3)"
        );
        assert!(job.r.everyone_told());
        assert!(matches!(job.join(2.0, 2), Reply::Closed(_)));
    }

    /// A node whose round completed closes it as finished before another node of the round
    /// heard its placement: that node still starts its ranks (then hears of the closure),
    /// whether its next request is a poll or a join.
    #[test]
    fn a_finished_closure_still_lets_the_rounds_nodes_start() {
        // Node 1 waits; node 0 completes the round, hears its placement at once and closes
        // the rendezvous as finished.
        let closed_before_node_1_heard = || {
            let mut job = Job::new(2, 2);
            job.join(0.0, 1);
            assert!(matches!(job.join(0.0, 0), Reply::Assigned(_)));
            let now = job.at(0.2);
            job.r.handle(
                now,
                Request::Close {
                    id: node(0),
                    why: CloseWhy::Finished,
                },
            );
            job
        };
        let mut job = closed_before_node_1_heard();
        assert_eq!(job.assigned(0.3, 1).group_rank, 1);
        assert!(!job.r.everyone_told());
        assert!(matches!(job.poll(0.4, 1), Reply::Closed(_)));
        assert!(job.r.everyone_told());
        // The same when its next request is a join (a restart's second join, a lost reply):
        // the race that once left a restarted node's ranks unstarted.
        let mut job = closed_before_node_1_heard();
        let Reply::Assigned(a) = job.join(0.3, 1) else {
            panic!("node 1 hears its placement");
        };
        assert_eq!(a.group_rank, 1);
        assert!(matches!(job.join(0.4, 1), Reply::Closed(_)));
        // Out of restarts, the round's other nodes do not start.
        let mut job = Job::new(2, 2);
        job.join(0.0, 0);
        job.join(0.0, 1);
        job.assigned(0.1, 0);
        let now = job.at(0.2);
        let why = CloseWhy::OutOfRestarts {
            restarts: 0,
            failure: "x".into(),
        };
        job.r.handle(now, Request::Close { id: node(0), why });
        assert!(matches!(job.poll(0.3, 1), Reply::Closed(_)));
    }

    /// The host waits for nodes to hear of the closure, but not for dead ones.
    #[test]
    fn dead_nodes_need_not_be_told() {
        let mut job = Job::new(1, 2);
        job.join(0.0, 0);
        job.join(0.0, 1);
        let now = job.at(1.0);
        job.r.handle(
            now,
            Request::Close {
                id: node(0),
                why: CloseWhy::Finished,
            },
        );
        assert!(!job.r.everyone_told());
        job.r.tick(job.at(16.1));
        assert!(job.r.everyone_told());
    }

    #[test]
    fn a_node_with_other_node_counts_is_refused() {
        let mut job = Job::new(2, 3);
        job.nnodes = (2, 2);
        let Reply::Refused { why } = job.join(0.0, 0) else {
            panic!("refused");
        };
        assert!(
            why.contains("asks for --nnodes 2:2, but this rendezvous was opened with --nnodes 2:3"),
            "{why}"
        );
    }

    /// A node that leaves before the round completes takes it below MIN: no last call.
    #[test]
    fn leaving_below_min_cancels_the_last_call() {
        let mut job = Job::new(2, 3);
        job.join(0.0, 0);
        job.join(0.0, 1);
        let now = job.at(1.0);
        job.r.handle(now, Request::Leave { id: node(1) });
        job.keep(2, 40, &[0], |r| {
            matches!(
                r,
                Reply::Waiting {
                    present: 1,
                    last_call_left: None,
                    ..
                }
            )
        });
    }

    /// A join asked twice (its reply lost) changes nothing.
    #[test]
    fn a_repeated_join_is_harmless() {
        let mut job = Job::new(3, 3);
        job.join(0.0, 0);
        job.join(0.1, 0);
        assert!(matches!(
            job.poll(0.2, 0),
            Reply::Waiting { present: 1, .. }
        ));
    }
}
