//! Hosts that are lost, noticed in bounded time: a host whose link goes down, or that
//! freezes, sends nothing more — no FIN, no RST — so its peers' collectives would wait out the
//! group's timeout (30 minutes by default; Gloo sets no TCP keepalive, and Linux's would take
//! two hours).
//!
//! Every tch-dist rank's process runs a **heartbeat**: a thread that adds 1 to
//! `tch_dist/alive/<global rank>` in the rendezvous store every [`HEARTBEAT_EVERY`], over a
//! connection of its own. A long step does not stop it (it is not the training thread), so
//! a step may take minutes without an alarm; a frozen host or a cut link stops it. The
//! departures watch (`departures.rs`), which runs while a wait lasts, reads the counts of the
//! group's members at most every [`HEARTBEAT_EVERY`] ([`Liveness`]): a member whose count has
//! not moved for the heartbeat timeout (`TCH_DIST_HEARTBEAT_TIMEOUT_SECS`, default
//! [`DEFAULT_HEARTBEAT_TIMEOUT`]) is lost, and the wait fails naming it. A rank whose watch
//! cannot reach the store for as long (its own link is down, or rank 0's host, which hosts
//! the store, is gone) fails its wait saying so. A rank that never heartbeats (a PyTorch
//! rank of a mixed job: its count stays 0) is never judged.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::c10d::store::Store;
use crate::error::DistError;

/// How often a rank's heartbeat adds to its count, and how often a watch reads the counts.
pub(crate) const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// How long a member's count may stay still, or the store stay unreachable, before the
/// watch calls it lost: twelve heartbeats, so that a store that is slow to answer is no
/// alarm, and a lost host is reported within 90 s of its loss (torchrun's rendezvous calls a
/// node dead after 15 s; NCCL's heartbeat monitor waits 8 minutes).
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(60);

/// The key of global rank `rank`'s heartbeat count.
pub(crate) fn alive_key(rank: usize) -> String {
    format!("tch_dist/alive/{rank}")
}

/// A rank's heartbeat thread; stopped when dropped (with the last group of its rendezvous).
pub(crate) struct Heartbeat {
    stop: Arc<AtomicBool>,
}

impl Heartbeat {
    /// Starts global rank `rank`'s heartbeat into the store at `master` (MASTER_ADDR,
    /// MASTER_PORT). Best effort: a heartbeat that cannot start or reach the store only makes
    /// this rank look lost to its peers once they wait for it that long.
    pub(crate) fn start(master: (String, u16), rank: usize) -> Heartbeat {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let key = alive_key(rank);
        let _ = std::thread::Builder::new()
            .name("tch-dist heartbeat".into())
            .spawn(move || {
                let mut client: Option<Store> = None;
                while !stopped.load(Ordering::Relaxed) {
                    let store = client.take().or_else(|| {
                        let (host, port) = (&master.0, master.1);
                        Store::tcp(host, port, false, 0, HEARTBEAT_EVERY, HEARTBEAT_EVERY).ok()
                    });
                    // A client whose request failed is dropped: a TCPStore client that timed
                    // out mid-request could read the late reply as the next request's.
                    client = store.filter(|s| s.add(&key, 1).is_ok());
                    let next = Instant::now() + HEARTBEAT_EVERY;
                    while !stopped.load(Ordering::Relaxed) && Instant::now() < next {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            });
        Heartbeat { stop }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Who the watch found silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Silence {
    /// The member of this global rank: its heartbeat has not moved for this long.
    Member {
        /// Its global rank.
        global_rank: usize,
        /// Since when its count stood still (as this rank saw it).
        silent: Duration,
    },
    /// The store has not answered this rank's watch for this long.
    Store {
        /// Since the first failed look.
        silent: Duration,
    },
}

/// What this process's watches have seen of the heartbeats (one per rendezvous, shared by
/// its groups): each global rank's last count and when it last moved, and since when the
/// store has been unreachable.
pub(crate) struct Liveness {
    timeout: Duration,
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    last_look: Option<Instant>,
    counts: HashMap<usize, (i64, Instant)>,
    unreachable_since: Option<Instant>,
}

impl Liveness {
    /// A tracker that calls a member lost after `timeout` without a heartbeat.
    pub(crate) fn new(timeout: Duration) -> Liveness {
        Liveness {
            timeout,
            seen: Mutex::new(Seen::default()),
        }
    }

    /// A look at the heartbeats of `members` (global ranks, this rank's excluded) over the
    /// watch's connection, at most every [`HEARTBEAT_EVERY`]: the first member silent for
    /// the timeout. `Err` when the store could not be read (the caller then counts it with
    /// [`unreachable`](Self::unreachable)).
    pub(crate) fn look(
        &self,
        store: &Store,
        members: impl Iterator<Item = usize>,
    ) -> Result<Option<Silence>, DistError> {
        let now = Instant::now();
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.unreachable_since = None;
        if seen.last_look.is_some_and(|t| now - t < HEARTBEAT_EVERY) {
            return Ok(None);
        }
        seen.last_look = Some(now);
        let mut silent = None;
        for global_rank in members {
            // ADD 0 reads the count (0 for a rank that never heartbeats: never judged).
            let count = store.add(&alive_key(global_rank), 0)?;
            let entry = seen.counts.entry(global_rank).or_insert((count, now));
            if entry.0 != count {
                *entry = (count, now);
            } else if count > 0 && now - entry.1 >= self.timeout && silent.is_none() {
                silent = Some(Silence::Member {
                    global_rank,
                    silent: now - entry.1,
                });
            }
        }
        Ok(silent)
    }

    /// The watch could not reach the store: how long it has been unreachable, once that is
    /// the timeout or more.
    pub(crate) fn unreachable(&self) -> Option<Silence> {
        let now = Instant::now();
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let since = *seen.unreachable_since.get_or_insert(now);
        (now - since >= self.timeout).then(|| Silence::Store {
            silent: now - since,
        })
    }
}
