//! The step check that runs always, not only under `TCH_DIST_DEBUG=DETAIL`: before the first
//! collective of each pass (a forward, a backward, or between them) over a process group,
//! every rank all-gathers one fixed-size header saying where it is, and every rank fails
//! with [`Mismatch::Step`] when the headers differ.
//!
//! Why a separate header and not a counter appended to a bucket: the collectives of a pass
//! have sizes that depend on the pass (a forward's all-gathers, a backward's
//! reduce-scatters, replicate's buffer broadcast and buckets). Gloo's pair thread enforces
//! the size it expects on receive and aborts the process (`std::terminate`) when a peer
//! sends another, so a check carried inside those collectives would come too late: two
//! ranks in different passes abort before they can compare. The header has the same size
//! on every rank in every pass, so whatever pass each rank is in, the first collective of
//! that pass on each rank is a header, the headers meet each other, and a difference is
//! seen before any pass-sized collective is sent. Once the headers agree, both ranks run
//! the same pass of the same program, whose collectives have the same sizes.
//!
//! The header (int64): a tag, the pass, the forward passes begun, the backward passes begun,
//! and the caller's own step number ([`set_step`], -1 without one). A whole step left out on
//! one rank leaves no trace in that rank's counters (its next step is simply its step
//! `k`); only [`set_step`] (or the end of training, where the other rank's last header
//! meets a departed peer, a timeout, or a header between passes) tells it apart.

use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use crate::collectives::Work;
use crate::error::{DistError, Mismatch, MisuseProblem, Result};
use crate::process_group::ProcessGroup;

/// The header's first element: a value no pass counter takes, so that a header never reads
/// as something else.
const TAG: i64 = 0x7464_735f_7374_6570; // "tds_step"
/// Elements of a header.
const LEN: usize = 5;

/// The caller's step number ([`set_step`]); -1 when never set.
static USER_STEP: AtomicI64 = AtomicI64::new(-1);

/// A benchmark switch: `TCH_DIST_NO_STEP_CHECK=1` turns the step check off, to measure what
/// it costs (`bench/ab.py`). Set it on every rank or on none: a rank that checks against
/// one that does not meets a pass-sized collective with its header.
pub const NO_STEP_CHECK_ENV: &str = "TCH_DIST_NO_STEP_CHECK";

fn check_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var(NO_STEP_CHECK_ENV).is_ok_and(|v| v == "1"))
}

/// Nanoseconds this process spent in step checks (for benchmarks).
static CHECK_NANOS: AtomicU64 = AtomicU64::new(0);

/// The time this process has spent in step checks so far, every group together: what the
/// always-on check costs (`make bench` prints it per step as `step_check_vs_step`).
pub fn step_check_time() -> Duration {
    Duration::from_nanos(CHECK_NANOS.load(Ordering::Relaxed))
}

/// Tells every later step check the training loop's own step number, so that a rank that
/// leaves out a whole step (or repeats one) is caught at its next forward or backward,
/// rather than averaged with the wrong step: without it a rank's pass counters cannot show
/// a step that was never begun. Call it once per step, with the same number on every rank.
///
/// ```no_run
/// for step in 0..10u64 {
///     tch_dist_runtime::set_step(step);
///     // forward, backward, optimizer step
/// }
/// ```
pub fn set_step(step: u64) {
    USER_STEP.store(i64::try_from(step).unwrap_or(i64::MAX), Ordering::Relaxed);
}

/// Which pass a rank is in when it checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Phase {
    /// A forward pass.
    Forward,
    /// A backward pass.
    Backward,
    /// Between passes (after a forward or a backward ended: a state dict, an explicit
    /// unshard).
    Between,
}

impl Phase {
    fn code(self) -> i64 {
        match self {
            Phase::Forward => 0,
            Phase::Backward => 1,
            Phase::Between => 2,
        }
    }

    fn from_code(code: i64) -> Option<Phase> {
        match code {
            0 => Some(Phase::Forward),
            1 => Some(Phase::Backward),
            2 => Some(Phase::Between),
            _ => None,
        }
    }
}

/// Where a rank is in training, as the step check compares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepPosition {
    /// The pass it is in.
    pub phase: Phase,
    /// Forward passes begun (the current one included): the step number.
    pub forwards: u64,
    /// Backward passes begun (the current one included).
    pub backwards: u64,
    /// The caller's step number ([`set_step`]), if it gave one.
    pub step: Option<u64>,
}

impl fmt::Display for StepPosition {
    /// `in the forward of step 3 (3 forward and 2 backward passes)`; with the caller's
    /// numbering, `in the forward of step 7 (set_step; 3 forward and 2 backward passes)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (forwards, backwards) = (self.forwards, self.backwards);
        let step = self.step.unwrap_or(forwards);
        match self.phase {
            Phase::Forward => write!(f, "in the forward of step {step}")?,
            Phase::Backward => write!(f, "in the backward of step {step}")?,
            Phase::Between => write!(f, "between passes after step {step}")?,
        }
        let numbered = if self.step.is_some() {
            "set_step; "
        } else {
            ""
        };
        write!(
            f,
            " ({numbered}{forwards} forward and {backwards} backward passes)"
        )
    }
}

impl StepPosition {
    /// This rank at `phase` after `forwards` and `backwards` passes, with the caller's step.
    pub(crate) fn now(phase: Phase, forwards: u64, backwards: u64) -> StepPosition {
        let step = USER_STEP.load(Ordering::Relaxed);
        StepPosition {
            phase,
            forwards,
            backwards,
            step: u64::try_from(step).ok(),
        }
    }

    fn encode(&self) -> [i64; LEN] {
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        [
            TAG,
            self.phase.code(),
            count(self.forwards),
            count(self.backwards),
            self.step.map_or(-1, count),
        ]
    }

    fn decode(row: &[i64]) -> Option<StepPosition> {
        let [tag, phase, forwards, backwards, step] = *row else {
            return None;
        };
        if tag != TAG {
            return None;
        }
        Some(StepPosition {
            phase: Phase::from_code(phase)?,
            forwards: u64::try_from(forwards).ok()?,
            backwards: u64::try_from(backwards).ok()?,
            step: (step >= 0).then_some(step as u64),
        })
    }
}

/// Whether autograd records graphs on this thread now (a forward under `no_grad` is no
/// training step).
pub fn grad_enabled() -> bool {
    // SAFETY: reads and restores this thread's grad mode (libtorch has no getter in tch).
    unsafe {
        let was = torch_sys::at_grad_set_enabled(1);
        torch_sys::at_grad_set_enabled(was);
        was != 0
    }
}

/// The step check over `group` for operation `op` (`replicate`, `fully_shard`): every rank
/// sends `me` and fails with [`Mismatch::Step`], naming the lowest rank that differs, unless
/// every rank is at the same position. Nothing to do in a group of one (no other rank to
/// disagree with; so also nothing to count among its collectives).
pub(crate) fn check(group: &ProcessGroup, op: &'static str, me: StepPosition) -> Result<()> {
    begin(group, op, me)?.finish()
}

/// [`check`] in two halves: the all-gather starts now, [`PendingCheck::finish`] waits for it
/// and compares, so that the pass can compute meanwhile. Nothing of the pass may be launched
/// over `group` before `finish` returned Ok.
pub(crate) fn begin(
    group: &ProcessGroup,
    op: &'static str,
    me: StepPosition,
) -> Result<PendingCheck> {
    if group.world_size() == 1 || check_off() {
        return Ok(PendingCheck { flight: None });
    }
    let start = Instant::now();
    let mine = Tensor::from_slice(&me.encode());
    let all = Tensor::zeros(
        [(group.world_size() * LEN) as i64],
        (Kind::Int64, mine.device()),
    );
    let work = group.all_gather_into_tensor_async(&all, &mine);
    note_time(start);
    Ok(PendingCheck {
        flight: Some(Flight {
            work: work?,
            all,
            _mine: mine,
            group: group.clone(),
            op,
            me,
        }),
    })
}

/// A step check whose all-gather is in flight ([`begin`]).
pub(crate) struct PendingCheck {
    flight: Option<Flight>,
}

struct Flight {
    work: Work,
    all: Tensor,
    _mine: Tensor,
    group: ProcessGroup,
    op: &'static str,
    me: StepPosition,
}

impl PendingCheck {
    /// Waits for the all-gather and compares every rank's position with this rank's.
    pub(crate) fn finish(self) -> Result<()> {
        let Some(f) = self.flight else {
            return Ok(());
        };
        let start = Instant::now();
        let Flight {
            work,
            all,
            _mine: mine,
            group,
            op,
            me,
        } = f;
        let result = work.wait().and_then(|()| compare(&group, op, me, &all));
        drop(mine);
        note_time(start);
        result
    }
}

fn note_time(start: Instant) {
    let spent = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    CHECK_NANOS.fetch_add(spent, Ordering::Relaxed);
}

/// Every rank's position in `all` against `me`.
fn compare(group: &ProcessGroup, op: &'static str, me: StepPosition, all: &Tensor) -> Result<()> {
    let all = Vec::<i64>::try_from(all).map_err(|e| DistError::Collective {
        rank: group.rank(),
        op,
        cause: format!("reading the step check: {e}"),
    })?;
    for (other_rank, row) in all.chunks(LEN).enumerate() {
        let other = StepPosition::decode(row).ok_or_else(|| DistError::Misuse {
            rank: group.rank(),
            op,
            problem: Box::new(MisuseProblem::Undecodable {
                what: "a step check",
                from: Some(other_rank),
            }),
        })?;
        if other != me {
            return Err(DistError::Mismatch {
                rank: group.rank(),
                op,
                mismatch: Box::new(Mismatch::Step {
                    other_rank,
                    other,
                    this: me,
                }),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_round_trip_and_read() {
        let p = StepPosition {
            phase: Phase::Backward,
            forwards: 4,
            backwards: 3,
            step: Some(7),
        };
        assert_eq!(StepPosition::decode(&p.encode()), Some(p));
        assert_eq!(
            p.to_string(),
            "in the backward of step 7 (set_step; 4 forward and 3 backward passes)"
        );
        let q = StepPosition {
            phase: Phase::Between,
            step: None,
            ..p
        };
        assert_eq!(StepPosition::decode(&q.encode()), Some(q));
        assert_eq!(
            q.to_string(),
            "between passes after step 4 (4 forward and 3 backward passes)"
        );
        // Not a header: another tag, an unknown pass, a short row.
        let mut bad = p.encode();
        bad[0] = 1;
        assert_eq!(StepPosition::decode(&bad), None);
        let mut bad = p.encode();
        bad[1] = 9;
        assert_eq!(StepPosition::decode(&bad), None);
        assert_eq!(StepPosition::decode(&p.encode()[..4]), None);
    }
}
