//! The lighthouse's quorum rule as plain data: what the lighthouse knows ([`Membership`]),
//! and at an instant either a quorum to issue or why it waits ([`Decision`]). torchft's
//! `quorum_compute` and `_quorum_tick` (src/lighthouse.rs), whose tests pin the same cases
//! (the tests below).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::{Duration, Instant, SystemTime};

use crate::proto::{Quorum, QuorumMember};

/// The lighthouse's settings (torchft's `LighthouseOpt`, same names and defaults).
///
/// ```
/// use std::time::Duration;
/// let opts = tch_dist_ft::LighthouseOptions {
///     heartbeat_timeout: Duration::from_millis(1000),
///     ..tch_dist_ft::LighthouseOptions::new(2)
/// };
/// assert_eq!(opts.join_timeout, Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LighthouseOptions {
    /// Where the server listens (`[::]:29510`; port 0 picks a free one).
    pub bind: String,
    /// The fewest replica groups that form a new quorum.
    pub min_replicas: u64,
    /// How long to wait, from the first join, for heartbeating groups that have not asked.
    pub join_timeout: Duration,
    /// How often the rule runs while groups wait.
    pub quorum_tick: Duration,
    /// How old a group's last heartbeat may be while it counts as alive.
    pub heartbeat_timeout: Duration,
}

impl LighthouseOptions {
    /// torchft's defaults with `min_replicas`: bind `[::]:29510`, join timeout 60 s, a tick
    /// every 100 ms, heartbeats valid for 5 s.
    ///
    /// ```
    /// let opts = tch_dist_ft::LighthouseOptions::new(2);
    /// assert_eq!(opts.bind, "[::]:29510");
    /// ```
    pub fn new(min_replicas: u64) -> Self {
        LighthouseOptions {
            bind: "[::]:29510".into(),
            min_replicas,
            join_timeout: Duration::from_millis(60_000),
            quorum_tick: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(5_000),
        }
    }
}

/// A group waiting for the next quorum, since when.
#[derive(Debug, Clone)]
struct Joined {
    at: Instant,
    member: QuorumMember,
}

/// What the lighthouse knows: the groups asking for the next quorum, every group's last
/// heartbeat, and the last quorum issued.
#[derive(Debug, Default)]
pub(crate) struct Membership {
    asking: HashMap<String, Joined>,
    heartbeats: HashMap<String, Instant>,
    previous: Option<Quorum>,
    quorum_id: i64,
}

/// Why the rule issues a quorum now, or why it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Every member of the previous quorum is alive and asking.
    Fast(Vec<QuorumMember>),
    /// Enough groups ask, and no alive group is left to wait for (or the join timeout
    /// passed).
    Valid(Vec<QuorumMember>),
    /// Fewer alive groups ask than `min_replicas`.
    TooFew { asking: usize, min_replicas: u64 },
    /// No more than half of the alive groups ask (the split-brain guard).
    NoMajority { asking: usize, alive: usize },
    /// Enough ask, but alive groups that have not asked yet are waited for.
    Stragglers { asking: usize, waiting_for: usize },
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Fast(m) => write!(f, "fast quorum of {} groups", m.len()),
            Decision::Valid(m) => write!(f, "quorum of {} groups", m.len()),
            Decision::TooFew {
                asking,
                min_replicas,
            } => write!(
                f,
                "waiting: {asking} groups ask for a quorum, min_replicas is {min_replicas}"
            ),
            Decision::NoMajority { asking, alive } => write!(
                f,
                "waiting: {asking} groups ask for a quorum, more than half of the {alive} alive ones must"
            ),
            Decision::Stragglers {
                asking,
                waiting_for,
            } => write!(
                f,
                "waiting: {asking} groups ask for a quorum, {waiting_for} alive ones have not yet (join timeout)"
            ),
        }
    }
}

impl Decision {
    fn members(self) -> Option<Vec<QuorumMember>> {
        match self {
            Decision::Fast(m) | Decision::Valid(m) => Some(m),
            Decision::TooFew { .. } | Decision::NoMajority { .. } | Decision::Stragglers { .. } => {
                None
            }
        }
    }
}

/// What the lighthouse's dashboard shows: the rule's decision now, the last quorum, and the
/// groups heard from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StatusView {
    /// The rule's decision if it ran now (`Decision`'s text).
    pub decision: String,
    /// The last quorum issued, if any.
    pub previous: Option<Quorum>,
    /// The groups asking for the next quorum, by id.
    pub asking: Vec<QuorumMember>,
    /// Each group heard from, by id: the time since its last heartbeat, and whether that is
    /// within the heartbeat timeout.
    pub heartbeats: Vec<(String, Duration, bool)>,
}

impl Membership {
    /// What the dashboard shows at `now`.
    pub(crate) fn status(&self, now: Instant, opts: &LighthouseOptions) -> StatusView {
        let mut asking: Vec<QuorumMember> =
            self.asking.values().map(|j| j.member.clone()).collect();
        asking.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
        let mut heartbeats: Vec<(String, Duration, bool)> = self
            .heartbeats
            .iter()
            .map(|(id, last)| {
                let age = now.saturating_duration_since(*last);
                (id.clone(), age, age < opts.heartbeat_timeout)
            })
            .collect();
        heartbeats.sort_by(|a, b| a.0.cmp(&b.0));
        StatusView {
            decision: self.decide(now, opts).to_string(),
            previous: self.previous.clone(),
            asking,
            heartbeats,
        }
    }

    /// The manager address of group `replica_id`, from the groups asking or the last quorum.
    pub(crate) fn address_of(&self, replica_id: &str) -> Option<String> {
        self.asking
            .get(replica_id)
            .map(|j| j.member.address.clone())
            .or_else(|| {
                self.previous.as_ref().and_then(|q| {
                    q.participants
                        .iter()
                        .find(|p| p.replica_id == replica_id)
                        .map(|p| p.address.clone())
                })
            })
    }

    /// A lighthouse's first state, whose first quorum gets id `last_id + 1`.
    pub(crate) fn starting_after(last_id: i64) -> Self {
        Membership {
            quorum_id: last_id,
            ..Membership::default()
        }
    }

    /// A heartbeat from `replica_id` at `now`.
    pub(crate) fn heartbeat(&mut self, replica_id: &str, now: Instant) {
        self.heartbeats.insert(replica_id.to_string(), now);
    }

    /// `member` asks for the next quorum at `now` (which is also a heartbeat).
    pub(crate) fn ask(&mut self, member: QuorumMember, now: Instant) {
        self.heartbeat(&member.replica_id, now);
        self.asking
            .insert(member.replica_id.clone(), Joined { at: now, member });
    }

    /// The rule at `now`: a quorum of the alive groups asking (sorted by id, as strings), or
    /// why not yet.
    pub(crate) fn decide(&self, now: Instant, opts: &LighthouseOptions) -> Decision {
        let alive: HashSet<&String> = self
            .heartbeats
            .iter()
            .filter(|(_, last)| now.saturating_duration_since(**last) < opts.heartbeat_timeout)
            .map(|(id, _)| id)
            .collect();
        let asking: Vec<&Joined> = self
            .asking
            .iter()
            .filter(|(id, _)| alive.contains(id))
            .map(|(_, j)| j)
            .collect();
        let mut candidates: Vec<QuorumMember> = asking.iter().map(|j| j.member.clone()).collect();
        candidates.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));

        if let Some(previous) = &self.previous {
            let before: HashSet<&String> = previous
                .participants
                .iter()
                .map(|p| &p.replica_id)
                .collect();
            if asking.iter().any(|j| j.member.shrink_only) {
                candidates.retain(|p| before.contains(&p.replica_id));
            }
            let all_back = previous
                .participants
                .iter()
                .all(|p| asking.iter().any(|j| j.member.replica_id == p.replica_id));
            if all_back {
                return Decision::Fast(candidates);
            }
        }
        if (asking.len() as u64) < opts.min_replicas {
            return Decision::TooFew {
                asking: asking.len(),
                min_replicas: opts.min_replicas,
            };
        }
        if asking.len() <= alive.len() / 2 {
            return Decision::NoMajority {
                asking: asking.len(),
                alive: alive.len(),
            };
        }
        let first = asking.iter().map(|j| j.at).min().unwrap_or(now);
        if asking.len() != alive.len() && now.saturating_duration_since(first) < opts.join_timeout {
            return Decision::Stragglers {
                asking: asking.len(),
                waiting_for: alive.len() - asking.len(),
            };
        }
        Decision::Valid(candidates)
    }

    /// Runs the rule at `now`; when it issues a quorum, the quorum (its id bumped when the
    /// members changed or any reports a commit failure), which the asking groups then leave.
    pub(crate) fn tick(&mut self, now: Instant, opts: &LighthouseOptions) -> Option<Quorum> {
        let members = self.decide(now, opts).members()?;
        let same_members = self.previous.as_ref().is_some_and(|p| {
            p.participants
                .iter()
                .map(|m| &m.replica_id)
                .eq(members.iter().map(|m| &m.replica_id))
        });
        if !same_members || members.iter().any(|m| m.commit_failures > 0) {
            self.quorum_id += 1;
        }
        let quorum = Quorum {
            quorum_id: self.quorum_id,
            participants: members,
            created: Some(SystemTime::now().into()),
        };
        self.previous = Some(quorum.clone());
        self.asking.clear();
        Some(quorum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str) -> QuorumMember {
        QuorumMember {
            replica_id: id.into(),
            address: format!("http://{id}:1"),
            store_address: format!("{id}:2"),
            step: 1,
            world_size: 1,
            ..QuorumMember::default()
        }
    }

    fn opts(min_replicas: u64) -> LighthouseOptions {
        LighthouseOptions {
            bind: "[::]:0".into(),
            join_timeout: Duration::from_secs(3600),
            quorum_tick: Duration::from_millis(10),
            ..LighthouseOptions::new(min_replicas)
        }
    }

    fn ids(d: &Decision) -> Vec<String> {
        d.clone()
            .members()
            .unwrap_or_default()
            .into_iter()
            .map(|m| m.replica_id)
            .collect()
    }

    // torchft's test_quorum_join_timeout: a heartbeating group that has not asked is waited
    // for until the join timeout, counted from the first join.
    #[test]
    fn stragglers_are_waited_for_until_the_join_timeout() {
        let now = Instant::now();
        let mut m = Membership::default();
        let o = opts(1);
        assert_eq!(
            m.decide(now, &o),
            Decision::TooFew {
                asking: 0,
                min_replicas: 1
            }
        );
        m.ask(member("a"), now);
        m.ask(member("b"), now);
        assert_eq!(ids(&m.decide(now, &o)), ["a", "b"]);
        m.heartbeat("c", now);
        let waiting = m.decide(now, &o);
        assert_eq!(
            waiting,
            Decision::Stragglers {
                asking: 2,
                waiting_for: 1
            }
        );
        assert_eq!(
            waiting.to_string(),
            "waiting: 2 groups ask for a quorum, 1 alive ones have not yet (join timeout)"
        );
        let later = now + o.join_timeout;
        for id in ["a", "b", "c"] {
            m.heartbeat(id, later);
        }
        assert_eq!(ids(&m.decide(later, &o)), ["a", "b"]);
    }

    // torchft's test_quorum_heartbeats: a group whose heartbeat is too old does not count.
    #[test]
    fn a_group_without_a_recent_heartbeat_is_left_out() {
        let now = Instant::now();
        let o = LighthouseOptions {
            join_timeout: Duration::ZERO,
            ..opts(1)
        };
        let mut m = Membership::default();
        m.ask(member("a"), now);
        assert_eq!(ids(&m.decide(now, &o)), ["a"]);
        let late = now + o.heartbeat_timeout;
        assert_eq!(
            m.decide(late, &o),
            Decision::TooFew {
                asking: 0,
                min_replicas: 1
            }
        );
        m.ask(member("b"), late);
        assert_eq!(ids(&m.decide(late, &o)), ["b"]);
    }

    // torchft's test_quorum_fast_prev_quorum, and the id rules of its _quorum_tick.
    #[test]
    fn the_previous_members_form_a_fast_quorum_and_ids_change_only_with_reason() {
        let now = Instant::now();
        let o = opts(1);
        let mut m = Membership::default();
        m.ask(member("a"), now);
        m.heartbeat("b", now);
        assert_eq!(
            m.decide(now, &o),
            Decision::NoMajority {
                asking: 1,
                alive: 2
            }
        );
        m.previous = Some(Quorum {
            quorum_id: 1,
            participants: vec![member("a")],
            created: None,
        });
        m.quorum_id = 1;
        assert_eq!(m.decide(now, &o), Decision::Fast(vec![member("a")]));
        // A new member joins a fast quorum.
        m.ask(member("b"), now);
        assert_eq!(ids(&m.decide(now, &o)), ["a", "b"]);
        let q = m.tick(now, &o).expect("fast");
        assert_eq!(q.quorum_id, 2, "the members changed");
        // The same members again: the same id.
        m.ask(member("b"), now);
        m.ask(member("a"), now);
        assert_eq!(m.tick(now, &o).map(|q| q.quorum_id), Some(2));
        // A reported commit failure forces a new id with the same members.
        m.ask(
            QuorumMember {
                commit_failures: 1,
                ..member("a")
            },
            now,
        );
        m.ask(member("b"), now);
        assert_eq!(m.tick(now, &o).map(|q| q.quorum_id), Some(3));
        assert_eq!(m.previous.as_ref().map(|p| p.quorum_id), Some(3));
    }

    // torchft's test_quorum_shrink_only: only previous members are kept.
    #[test]
    fn shrink_only_keeps_the_previous_members() {
        let now = Instant::now();
        let o = opts(1);
        let mut m = Membership {
            previous: Some(Quorum {
                quorum_id: 1,
                participants: vec![member("a"), member("b")],
                created: None,
            }),
            ..Membership::default()
        };
        let shrinking = |id| QuorumMember {
            shrink_only: true,
            ..member(id)
        };
        m.ask(shrinking("a"), now);
        m.ask(shrinking("c"), now);
        assert_eq!(m.decide(now, &o), Decision::Valid(vec![shrinking("a")]));
    }

    // The split-brain guard: half of the alive groups are not enough.
    #[test]
    fn half_of_the_alive_groups_is_no_quorum() {
        let now = Instant::now();
        let o = opts(1);
        let mut m = Membership::default();
        m.ask(member("a"), now);
        m.heartbeat("b", now);
        // One of two alive asks: at most half.
        assert_eq!(
            m.decide(now, &o),
            Decision::NoMajority {
                asking: 1,
                alive: 2
            }
        );
        m.ask(member("b"), now);
        assert_eq!(ids(&m.decide(now, &o)), ["a", "b"]);
    }
}
