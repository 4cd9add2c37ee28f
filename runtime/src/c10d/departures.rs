//! Who has left a job, or stopped taking part in a group, as the ranks and their launchers
//! tell each other through the rendezvous store; and the watch a long wait keeps over it, so
//! that no rank waits out the group's timeout (30 minutes by default) for a rank that will
//! never come.
//!
//! The keys, in the root store (the TCPStore rank 0 hosts):
//!
//! | key | written by | when |
//! |---|---|---|
//! | `tch_dist/exited/<global rank>`, counted in `tch_dist/exited_count` | the rank's launcher (`tch-dist-run`) | its process exited, while the launcher was not stopping the job (`exited with status 0`) |
//! | `tch_dist/failed/<group name>/<group rank>`, counted in `tch_dist/failed/<group name>/count` | the rank itself ([`ProcessGroup::stop_after_failure`]) | it failed in a way that leaves its peers waiting (a pipeline step that failed after its transfers began), and takes no further part in the group's collectives |
//!
//! A wait that has lasted [`WATCH_SLICE`] reads the two counts (two round trips to the store)
//! and, when one moved, the keys of the group's members: a member that left fails the wait
//! with [`DistError::PeerDeparted`] naming it and what it reported. The rank that saw it stops
//! taking part too (its pending transfer would otherwise meet the next step's), and says so,
//! so that ranks waiting for it learn in turn. A wait that ends within the slice costs
//! nothing.

use std::time::Duration;

use crate::c10d::group::{Membership, ProcessGroup};
use crate::c10d::heartbeat::Silence;
use crate::c10d::store::Store;
use crate::error::{Departure, DistError};

/// How long a wait runs before it first looks for members that left, and between looks.
pub(crate) const WATCH_SLICE: Duration = Duration::from_secs(1);

/// A connection of its own to the rendezvous store, for the watch: a TCPStore client runs
/// one request at a time, and the rank's own client may be held for the whole of a blocking
/// wait (Gloo's connection of a group's backends waits on it for a peer's address), which
/// the watch would then wait behind. Made at the first look, once a wait has lasted a
/// slice; made again at the next look after one failed.
pub(crate) struct WatchStore {
    master: (String, u16),
    client: std::sync::Mutex<Option<Store>>,
}

/// The watch could not reach the store, or a request of its look failed.
#[derive(Debug)]
pub(crate) struct Unreachable;

impl WatchStore {
    /// A watch over the store at `master` (MASTER_ADDR, MASTER_PORT), not connected yet.
    pub(crate) fn new(master: (String, u16)) -> WatchStore {
        WatchStore {
            master,
            client: std::sync::Mutex::new(None),
        }
    }

    /// `MASTER_ADDR:MASTER_PORT`, as errors name the store.
    pub(crate) fn address(&self) -> String {
        format!("{}:{}", self.master.0, self.master.1)
    }

    /// Runs `look` over the watch's connection, connecting first when there is none. A
    /// look whose request failed drops the connection, so that the next one connects anew:
    /// a TCPStore client that timed out mid-request could read the late reply as the next
    /// request's.
    pub(crate) fn look<T>(
        &self,
        look: impl FnOnce(&Store) -> Result<T, DistError>,
    ) -> Result<T, Unreachable> {
        let mut client = self.client.lock().unwrap_or_else(|e| e.into_inner());
        let store = match client.take() {
            Some(store) => store,
            None => {
                let (host, port) = (&self.master.0, self.master.1);
                Store::tcp(host, port, false, 0, WATCH_SLICE, WATCH_SLICE)
                    .map_err(|_| Unreachable)?
            }
        };
        let seen = look(&store).map_err(|_| Unreachable)?;
        *client = Some(store);
        Ok(seen)
    }
}

/// The key of a rank's exit, in the launcher's words.
fn exited_key(global_rank: usize) -> String {
    format!("tch_dist/exited/{global_rank}")
}

/// How many exits were reported, job-wide.
const EXITED_COUNT: &str = "tch_dist/exited_count";

/// Whether any launcher reported an exit yet (one round trip).
pub(crate) fn any_exited(root: &Store) -> Result<bool, DistError> {
    root.add(EXITED_COUNT, 0).map(|n| n > 0)
}

/// How global rank `global_rank` exited, if its launcher reported it.
pub(crate) fn exit_of(root: &Store, global_rank: usize) -> Result<Option<String>, DistError> {
    read(root, &exited_key(global_rank))
}

/// `key`'s value as text, if it is there.
fn read(store: &Store, key: &str) -> Result<Option<String>, DistError> {
    if !store.check(key)? {
        return Ok(None);
    }
    let value = store.get(key)?;
    Ok(Some(String::from_utf8_lossy(&value).into_owned()))
}

/// The key of a rank's failure in the group named `group`.
fn failed_key(group: &str, rank: usize) -> String {
    format!("tch_dist/failed/{group}/{rank}")
}

/// How many ranks of the group named `group` reported a failure.
fn failed_count(group: &str) -> String {
    format!("tch_dist/failed/{group}/count")
}

impl ProcessGroup {
    /// The first other member of this group that reported a failure, whose launcher
    /// reported its exit, or whose heartbeat stopped (`heartbeat.rs`), as the store says.
    fn departed_member(&self, store: &Store) -> Result<Option<(usize, Departure)>, DistError> {
        let name = self.group_name();
        let others = || (0..self.world_size()).filter(|&r| r != self.rank());
        if store.add(&failed_count(name), 0)? > 0 {
            for r in others() {
                if let Some(error) = read(store, &failed_key(name, r))? {
                    return Ok(Some((r, Departure::Failed { error })));
                }
            }
        }
        if any_exited(store)? {
            for r in others() {
                if let Some(status) = exit_of(store, self.global_ranks()[r])? {
                    return Ok(Some((r, Departure::Exited { status })));
                }
            }
        }
        let members = others().map(|r| self.global_ranks()[r]);
        Ok(match self.liveness().look(store, members)? {
            Some(Silence::Member {
                global_rank,
                silent,
            }) => self
                .global_ranks()
                .iter()
                .position(|&g| g == global_rank)
                .map(|r| (r, Departure::Silent { silent })),
            _ => None,
        })
    }

    /// This rank failed in a way that leaves its peers waiting (`cause`: its error; a
    /// pipeline step that failed after its transfers began): it takes no further part in the
    /// group's collectives (every later one fails at once with [`DistError::GroupStopped`]),
    /// and tells the other members, whose waits for it fail within a second or two naming it
    /// ([`DistError::PeerDeparted`]) instead of running to the group's timeout. Idempotent:
    /// the first cause stays.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// pg.stop_after_failure("rank 0: my_api: the batch could not be loaded");
    /// let t = tch::Tensor::from_slice(&[1.0f32]);
    /// assert!(matches!(
    ///     pg.all_reduce(&t, tch_dist_runtime::ReduceOp::Sum),
    ///     Err(tch_dist_runtime::DistError::GroupStopped { .. })
    /// ));
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn stop_after_failure(&self, cause: &str) {
        if !self.keep_stop(cause) {
            return;
        }
        let store = self.store();
        let name = self.group_name();
        // Best effort: a store that is gone leaves the peers to their own errors.
        if store
            .set(&failed_key(name, self.rank()), cause.as_bytes())
            .is_ok()
        {
            let _ = store.add(&failed_count(name), 1);
        }
    }

    /// A wait of `op` has lasted a slice: the error it ends with if a member left, or if
    /// the store has not answered for the heartbeat timeout. This rank then stops taking
    /// part too, and says so where the store can still hear it.
    pub(crate) fn watch(&self, op: &'static str) -> Option<DistError> {
        if self.membership() == Membership::Quorum {
            // A quorum's group: its store is one member's, gone with it (connecting there
            // would only add connect timeouts), and fault tolerance learns of failed members
            // from the average itself or from its own timeout.
            return None;
        }
        let watch = self.watch_store();
        match watch.look(|store| self.departed_member(store)) {
            Ok(None) => None,
            Ok(Some((peer, departure))) => {
                let error = DistError::PeerDeparted {
                    rank: self.rank(),
                    op,
                    peer,
                    departure,
                };
                self.stop_after_failure(&error.to_string());
                Some(error)
            }
            Err(Unreachable) => {
                let Silence::Store { silent } = self.liveness().unreachable()? else {
                    return None;
                };
                let error = DistError::StoreUnreachable {
                    rank: self.rank(),
                    op,
                    store: watch.address(),
                    silent,
                };
                // Not through the store, which is out of reach: its client would wait out
                // its own timeout.
                self.keep_stop(&error.to_string());
                Some(error)
            }
        }
    }
}
