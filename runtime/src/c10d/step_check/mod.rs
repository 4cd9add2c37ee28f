//! The step check that runs always, not only under `TCH_DIST_DEBUG=DETAIL`: before the first
//! collective of each pass (a forward, a backward, or between them) over a process group,
//! every rank sends every other one fixed-size header saying where it is and what the pass
//! will run, and every rank fails with [`Mismatch::Step`] or [`Mismatch::Program`] when the
//! headers differ.
//!
//! The headers travel by one all-to-all of equal chunks (each rank's header repeated for
//! every peer), not by an all-gather: Gloo's all-gather is a ring of world − 1 hops one after
//! the other, its all-to-all sends to every peer at once, one hop. The check's cost is that
//! latency (a few bytes), so at 4 ranks this cut the MoE part's check from 6% of the step to
//! 3.5-4.5% (bench/driver.py `step_check_vs_step`); at 2 ranks the two are the same.
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `mod.rs` | the header (where a rank is: [`StepPosition`]; what its pass runs: [`PassProgram`]; both defined in `error/step.rs`), its encoding, exchange and comparison; [`set_step`] | (none: tch-dist's step check; DETAIL's fingerprints are c10d's `ProcessGroupWrapper`) |
//! | `passes.rs` | which pass this process is in, for fully_shard and tensor parallelism, and the check before each pass's first collective over each group | (none) |
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
//! Why not the runtime's helper for "ranks agree on these settings"
//! ([`ProcessGroup::agree_on_values`] / [`ProcessGroup::exchange_values`], which the
//! pipeline's checks use): the step check is no like-for-like case of it, and issue 42's
//! step 3 left it out on purpose.
//! - It overlaps the pass. replicate's backward starts the header's exchange in its first
//!   gradient hook and waits for it only before its first bucket ([`begin`], then
//!   [`PendingCheck::finish`]), so backward computes meanwhile; the helper is one blocking
//!   all-reduce, which would put the whole exchange on every backward's critical path.
//! - It compares whole values, not named settings. [`Mismatch::Step`] and
//!   [`Mismatch::Program`] name the lowest rank whose position (then program) differs from
//!   this rank's, with that rank's whole [`StepPosition`] and [`PassProgram`];
//!   `agree_on_values`' `Refusal::Differs` names the first setting that differs, the lowest
//!   rank differing in that one setting and its one `i64`, from which neither the same rank
//!   nor its position can be rebuilt (the texts the tests pin would change).
//! - Nothing refuses: no rank has a problem of its own to report, so the helper's refusal
//!   half (`Refusal::Own`, `Refusal::Peer`) has nothing to carry.
//! - The encoding stays either way: the helper exchanges `i64`s, and a position and a
//!   program become `i64`s only through [`Header::encode`] (phase codes, the signature's op
//!   and dtype codes, dims folded into [`DIMS`]). `exchange_values` could replace only the
//!   exchange's few lines, at the cost of the overlap above and a row per rank all-reduced
//!   by every rank (world × 17 `i64`s, and a ring's hops, instead of 16 to each peer).
//!
//! The header (int64): a tag, the pass, the forward passes begun, the backward passes begun,
//! the caller's own step number ([`set_step`], -1 without one), then the pass's program:
//! the tensor-parallel collectives the forward passes recorded for this backward, a
//! fingerprint of the group's settings ([`passes::note_setting`]: fully_shard's setters that
//! change what a pass sends or computes but not its collectives' sizes), and the
//! signature of the pass's first collective (an op code, a dtype code, the rank count and
//! up to [`DIMS`] dims of its whole tensor). A whole step left out on one rank leaves no
//! trace in that rank's counters (its next step is simply its step `k`); only [`set_step`]
//! (or the end of training, where the other rank's last header meets a departed peer, a
//! timeout, or a header between passes) tells it apart.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use tch_dist_core::sharding::Dtype;

use crate::c10d::collectives::Work;
use crate::c10d::group::ProcessGroup;
use crate::error::{
    CollectiveSignature, DistError, Mismatch, MisuseProblem, PassProgram, Phase, Result,
    StepPosition, TensorSignature, SIGNATURE_OPS,
};

pub(crate) mod passes;

/// The header's first element: a value no pass counter takes, so that a header never reads
/// as something else.
const TAG: i64 = 0x7464_735f_7374_6570; // "tds_step"
/// The dims of a first collective's tensor a header carries (more are folded into the last).
pub const DIMS: usize = 6;
/// Elements of a header: the tag, the position (4), the recorded count, the settings'
/// fingerprint, the signature's op, dtype and rank count, and its dims.
const LEN: usize = 10 + DIMS;

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

// The header's encoding of the values error/step.rs defines: what a rank's position and
// program are is the errors' vocabulary (a `Mismatch` carries them), how they travel is the
// check's.
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

impl CollectiveSignature {
    /// `[op, dtype, ndim, dims...]`; the dims past [`DIMS`] multiplied into the last slot.
    fn encode(&self) -> [i64; 3 + DIMS] {
        let mut out = [0i64; 3 + DIMS];
        out[0] = SIGNATURE_OPS
            .iter()
            .position(|o| *o == self.op)
            .map_or(-1, |i| i as i64 + 1);
        out[1] = Dtype(self.tensor.kind).code();
        let shape = &self.tensor.shape;
        out[2] = shape.len() as i64;
        for (i, d) in shape.iter().enumerate() {
            let slot = i.min(DIMS - 1);
            out[3 + slot] = if i > slot {
                out[3 + slot].saturating_mul(*d)
            } else {
                *d
            };
        }
        out
    }

    fn decode(row: &[i64]) -> Option<Option<CollectiveSignature>> {
        let [op, dtype, ndim, ref dims @ ..] = *row else {
            return None;
        };
        if op == 0 {
            return Some(None);
        }
        let op = *SIGNATURE_OPS.get(usize::try_from(op - 1).ok()?)?;
        let kind = Dtype::from_code(dtype)?.into();
        let ndim = usize::try_from(ndim).ok()?;
        let shape = dims[..ndim.min(DIMS)].to_vec();
        Some(Some(CollectiveSignature {
            op,
            tensor: TensorSignature { shape, kind },
        }))
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
}

/// One rank's header: where it is and what its pass runs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    position: StepPosition,
    program: PassProgram,
}

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Header {
    fn encode(&self) -> [i64; LEN] {
        let p = &self.position;
        let mut out = [0i64; LEN];
        out[..6].copy_from_slice(&[
            TAG,
            p.phase.code(),
            count(p.forwards),
            count(p.backwards),
            p.step.map_or(-1, count),
            count(self.program.recorded),
        ]);
        out[6] = self.program.settings as i64; // the bits, not the number
        if let Some(first) = &self.program.first {
            out[7..].copy_from_slice(&first.encode());
        }
        out
    }

    fn decode(row: &[i64]) -> Option<Header> {
        if row.len() != LEN || row[0] != TAG {
            return None;
        }
        let [_, phase, forwards, backwards, step, recorded, settings] = row[..7] else {
            return None;
        };
        Some(Header {
            position: StepPosition {
                phase: Phase::from_code(phase)?,
                forwards: u64::try_from(forwards).ok()?,
                backwards: u64::try_from(backwards).ok()?,
                step: (step >= 0).then_some(step as u64),
            },
            program: PassProgram {
                recorded: u64::try_from(recorded).ok()?,
                first: CollectiveSignature::decode(&row[7..])?,
                settings: settings as u64,
            },
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

/// The step check over `group` for operation `op` (`replicate`, `fully_shard`, tensor
/// parallelism): every rank sends `me` and `program`, and fails with [`Mismatch::Step`] (or,
/// at the same position, [`Mismatch::Program`]), naming the lowest rank that differs, unless
/// every rank agrees. Nothing to do in a group of one (no other rank to disagree with; so
/// also nothing to count among its collectives).
pub(crate) fn check(
    group: &ProcessGroup,
    op: &'static str,
    me: StepPosition,
    program: PassProgram,
) -> Result<()> {
    begin(group, op, me, program)?.finish()
}

/// [`check`] in two halves: the exchange starts now, [`PendingCheck::finish`] waits for it
/// and compares, so that the pass can compute meanwhile. Nothing of the pass may be launched
/// over `group` before `finish` returned Ok.
pub(crate) fn begin(
    group: &ProcessGroup,
    op: &'static str,
    me: StepPosition,
    program: PassProgram,
) -> Result<PendingCheck> {
    if group.world_size() == 1 || check_off() {
        return Ok(PendingCheck { flight: None });
    }
    let start = Instant::now();
    let me = Header {
        position: me,
        program,
    };
    let world = group.world_size();
    let mine = Tensor::from_slice(&me.encode().repeat(world));
    let all = Tensor::zeros([(world * LEN) as i64], (Kind::Int64, mine.device()));
    let work = group.all_to_all_single_async(&all, &mine);
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

/// A step check whose exchange is in flight ([`begin`]).
pub(crate) struct PendingCheck {
    flight: Option<Flight>,
}

struct Flight {
    work: Work,
    all: Tensor,
    _mine: Tensor,
    group: ProcessGroup,
    op: &'static str,
    me: Header,
}

impl PendingCheck {
    /// Waits for the exchange and compares every rank's position with this rank's.
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

/// Every rank's header in `all` against `me`: positions first (a rank in another pass), then
/// programs.
fn compare(group: &ProcessGroup, op: &'static str, me: Header, all: &Tensor) -> Result<()> {
    let all = Vec::<i64>::try_from(all).map_err(|e| DistError::Collective {
        rank: group.rank(),
        op,
        cause: format!("reading the step check: {e}"),
    })?;
    let mut others = Vec::with_capacity(group.world_size());
    for (other_rank, row) in all.chunks(LEN).enumerate() {
        let other = Header::decode(row).ok_or_else(|| DistError::Misuse {
            rank: group.rank(),
            op,
            problem: Box::new(MisuseProblem::Undecodable {
                what: "a step check",
                from: Some(other_rank),
            }),
        })?;
        others.push(other);
    }
    let mismatch = |mismatch| DistError::Mismatch {
        rank: group.rank(),
        op,
        mismatch: Box::new(mismatch),
    };
    if let Some((other_rank, other)) = others
        .iter()
        .enumerate()
        .find(|(_, o)| o.position != me.position)
    {
        return Err(mismatch(Mismatch::Step {
            other_rank,
            other: other.position,
            this: me.position,
        }));
    }
    if let Some((other_rank, other)) = others
        .iter()
        .enumerate()
        .find(|(_, o)| o.program != me.program)
    {
        return Err(mismatch(Mismatch::Program {
            other_rank,
            position: me.position,
            other: other.program.clone(),
            this: me.program,
        }));
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
        let header = |position, program| Header { position, program };
        let h = header(p, PassProgram::default());
        assert_eq!(Header::decode(&h.encode()), Some(h.clone()));
        assert_eq!(
            p.to_string(),
            "in the backward of step 7 (set_step; 4 forward and 3 backward passes)"
        );
        let q = StepPosition {
            phase: Phase::Between,
            step: None,
            ..p
        };
        let programmed = header(
            q,
            PassProgram {
                recorded: 5,
                first: Some(CollectiveSignature::new(
                    "all_reduce (tensor-parallel forward)",
                    vec![4, 128, 16],
                    Kind::BFloat16,
                )),
                settings: u64::MAX - 3,
            },
        );
        assert_eq!(Header::decode(&programmed.encode()), Some(programmed));
        assert_eq!(
            q.to_string(),
            "between passes after step 4 (4 forward and 3 backward passes)"
        );
        // Dims past DIMS are folded into the last one (the rank count is kept).
        let deep = CollectiveSignature::new(
            "all_gather (tensor-parallel backward)",
            vec![1, 2, 3, 4, 5, 6, 7],
            Kind::Float,
        );
        let row = deep.encode();
        assert_eq!(row[2..], [7, 1, 2, 3, 4, 5, 42]);
        // Not a header: another tag, an unknown pass, a short row, an unknown op.
        let mut bad = h.encode();
        bad[0] = 1;
        assert_eq!(Header::decode(&bad), None);
        let mut bad = h.encode();
        bad[1] = 9;
        assert_eq!(Header::decode(&bad), None);
        assert_eq!(Header::decode(&h.encode()[..4]), None);
        let mut bad = h.encode();
        bad[7] = 99;
        assert_eq!(Header::decode(&bad), None);
    }
}
