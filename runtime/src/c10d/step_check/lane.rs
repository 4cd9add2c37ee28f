//! Which way a group's step-check headers travel: the backend's all-to-all, or shared memory
//! when every rank runs on this host (`shared.rs`), decided by the group's first two checks.
//!
//! The first two checks go through the backend, each header with two more words:
//! 1. this host's key ([`shared::host_key`], 0 to decline) and a random number. When every
//!    rank sent the same non-zero key, each maps the segment named after rank 0's number.
//! 2. whether it could map it. When every rank could, the segment's name is removed (every
//!    rank holds it) and every later check goes through it; otherwise through the backend.
//!
//! Every rank reads the same words, so every rank decides the same. `TCH_DIST_STEP_CHECK_COLLECTIVE=1`
//! on any rank keeps the headers on the backend, and so does `TCH_DIST_DEBUG=DETAIL`, which
//! fingerprints every collective, the header's among them: a rank whose peer called another
//! collective instead (a barrier at the end of training) learns which, with its tensors,
//! where shared memory names only the collective (`shared.rs`).

use super::shared::{self, Segment};
use crate::c10d::env::DebugLevel;
use crate::c10d::group::ProcessGroup;

/// `TCH_DIST_STEP_CHECK_COLLECTIVE=1`: the step check's headers always go through the
/// backend's all-to-all, even between ranks of one host (to test that path, or to measure
/// it).
pub const COLLECTIVE_STEP_CHECK_ENV: &str = "TCH_DIST_STEP_CHECK_COLLECTIVE";

/// Words a header carries on the backend besides the header itself.
pub(super) const WORDS: usize = 2;

/// Where a group's step checks stand (one per group, in its state).
#[derive(Default)]
pub(crate) enum Lane {
    /// No check yet: the next offers shared memory.
    #[default]
    Offer,
    /// The first check found one host: the second says whether this rank mapped the
    /// segment.
    Mapping(Option<Segment>),
    /// Through the backend, for good.
    Collective,
    /// Through shared memory.
    Shared(Segment),
}

impl Lane {
    /// The words this rank's header carries on the backend over `group`.
    pub(super) fn words(&self, group: &ProcessGroup) -> [i64; WORDS] {
        match self {
            Lane::Offer => {
                // Under DETAIL every collective is fingerprinted before it runs: the header's
                // all-to-all among them, so that a rank whose peer called another collective
                // (a barrier at the end of training) is told which, at once.
                let detail = group.debug_level() == DebugLevel::Detail;
                let switched = std::env::var(COLLECTIVE_STEP_CHECK_ENV).is_ok_and(|v| v == "1");
                let host = if detail || switched {
                    0
                } else {
                    shared::host_key()
                };
                [host, shared::nonce() as i64]
            }
            Lane::Mapping(segment) => [0, i64::from(segment.is_some())],
            Lane::Collective | Lane::Shared(_) => [0, 0],
        }
    }

    /// The next state after a check through the backend whose rows (`words` of every rank,
    /// in rank order) came back.
    pub(super) fn advance(&mut self, words: &[[i64; WORDS]], rank: usize) {
        let next = match std::mem::take(self) {
            Lane::Offer => {
                let host = words[0][0];
                if host != 0 && words.iter().all(|w| w[0] == host) {
                    Lane::Mapping(Segment::attach(words[0][1] as u64, words.len(), rank).ok())
                } else {
                    Lane::Collective
                }
            }
            Lane::Mapping(Some(segment)) if words.iter().all(|w| w[1] == 1) => {
                // Every rank holds the mapping: the name has done its job.
                segment.unlink();
                Lane::Shared(segment)
            }
            // A segment this rank mapped is unlinked as it is dropped.
            Lane::Mapping(_) => Lane::Collective,
            other => other,
        };
        *self = next;
    }
}

impl ProcessGroup {
    /// Whether this group's step-check headers travel through shared memory: every rank
    /// on this host, decided by the group's first two checks (false before them, and where
    /// [`COLLECTIVE_STEP_CHECK_ENV`] is set on a rank, or under `TCH_DIST_DEBUG=DETAIL`).
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// // ... after two training steps under replicate on one host:
    /// assert!(pg.step_check_shares_memory());
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn step_check_shares_memory(&self) -> bool {
        matches!(*self.step_check_lane(), Lane::Shared(_))
    }
}
