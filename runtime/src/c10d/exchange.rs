//! What the tch-dist ranks of a group tell each other through the rendezvous store rather
//! than through a collective: agreements before anything is created (a mesh's shape and
//! names), in a job where PyTorch ranks, which take no part in them, may be members too. A
//! collective would meet a PyTorch rank's next collective; the store meets nobody.
//!
//! Each exchange over a group has a number (every tch-dist rank of the group makes its
//! exchanges in the same order, as it makes its collectives): rank r writes
//! `tch_dist/exchange/<group name>/<number>/<r>`, then reads every other tch-dist member's
//! (those that wrote a join key for the group), waiting up to the group's timeout and
//! looking every [`WATCH_SLICE`] for members that left (`departures.rs`), so that a rank
//! that will never write its part is named within seconds.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::c10d::departures::WATCH_SLICE;
use crate::c10d::group::ProcessGroup;
use crate::c10d::rendezvous;
use crate::error::{DistError, Result};

impl ProcessGroup {
    /// Every member's `mine` for this exchange: this rank's and every other tch-dist rank's
    /// (`None` for a PyTorch rank, which takes no part), in rank order. Every tch-dist rank
    /// of the group must call it, in the same order relative to its other exchanges. Fails
    /// with [`DistError::PeerDeparted`] when a member left before it wrote its part, and
    /// with [`DistError::Timeout`] at the group's timeout.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let all = pg.exchange_in_store("my_api", b"shape 2x2")?;
    /// assert!(all.iter().flatten().all(|v| v == b"shape 2x2"));
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn exchange_in_store(&self, op: &'static str, mine: &[u8]) -> Result<Vec<Option<Vec<u8>>>> {
        self.check_open(op)?;
        let number = self.next_exchange();
        let store = self.store();
        let key = |r: usize| format!("tch_dist/exchange/{}/{number}/{r}", self.group_name());
        store.set(&key(self.rank()), mine)?;
        let deadline = Instant::now() + self.timeout();
        let mut next_watch = Instant::now() + WATCH_SLICE;
        let mut all = Vec::with_capacity(self.world_size());
        for r in 0..self.world_size() {
            if r == self.rank() {
                all.push(Some(mine.to_vec()));
                continue;
            }
            if !rendezvous::is_tch_dist_rank(store, self.group_name(), r) {
                all.push(None);
                continue;
            }
            loop {
                if store.check(&key(r))? {
                    all.push(Some(store.get(&key(r))?));
                    break;
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(DistError::Timeout {
                        rank: self.rank(),
                        op,
                        timeout: self.timeout(),
                    });
                }
                if now >= next_watch {
                    next_watch = now + WATCH_SLICE;
                    if let Some(departed) = self.watch(op) {
                        return Err(departed);
                    }
                }
                std::thread::sleep(Duration::from_millis(10).min(deadline - now));
            }
        }
        Ok(all)
    }

    /// This exchange's number over the group.
    fn next_exchange(&self) -> u64 {
        self.exchanges().fetch_add(1, Ordering::SeqCst)
    }
}
