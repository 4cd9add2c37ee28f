//! The step check that runs always, not only under `TCH_DIST_DEBUG=DETAIL`: before the first
//! collective of each pass (a forward, a backward, or between them) over a process group,
//! every rank sends every other one fixed-size header saying where it is and what the pass
//! will run, and every rank fails with [`Mismatch::Step`] or [`Mismatch::Program`] when the
//! headers differ.
//!
//! The headers travel through shared memory when every rank of the group runs on this host
//! (each rank writes its header into its slot of a mapped file and sleeps on a futex until
//! every peer's is there: a few writes and at most one wake-up), and otherwise by one
//! all-to-all of equal chunks through the backend (each rank's header repeated for every
//! peer; Gloo's all-to-all sends to every peer at once, one hop, where its all-gather is a
//! ring of world − 1 hops). The group's first two checks go through the backend and decide
//! (`lane.rs`). Through the backend, the check's cost was that collective's latency: 3.5-4.5%
//! of the MoE part's step at 4 ranks on 2 cores, 1.4-2% of the suite's (issue 47 asked for
//! 1%).
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `mod.rs` | the header (where a rank is: [`StepPosition`]; what its pass runs: [`PassProgram`]; both defined in `error/step.rs`), its encoding, exchange and comparison; [`set_step`] | (none: tch-dist's step check; DETAIL's fingerprints are c10d's `ProcessGroupWrapper`) |
//! | `lane.rs` | which way a group's headers travel, decided by its first two checks | (none) |
//! | `shared.rs` | the headers through a shared-memory segment: publish, wait (futex, the peers' pids and mirrored collective counts, the departures watch), the host's key | (none; c10d's Gloo has no shared-memory transport) |
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
use crate::c10d::departures::WATCH_SLICE;
use crate::c10d::group::ProcessGroup;
use crate::error::{
    CollectiveSignature, Desync, DistError, Mismatch, MisuseProblem, PassProgram, Phase, Result,
    StepPosition, TensorSignature, SIGNATURE_OPS,
};

mod lane;
pub(crate) mod passes;
mod shared;

pub(crate) use lane::Lane;
pub use lane::COLLECTIVE_STEP_CHECK_ENV;
use lane::WORDS;
pub(crate) use shared::CallMirror;
use shared::Unfinished;

/// The header's first element: a value no pass counter takes, so that a header never reads
/// as something else.
const TAG: i64 = 0x7464_735f_7374_6570; // "tds_step"
/// The dims of a first collective's tensor a header carries (more are folded into the last).
pub const DIMS: usize = 6;
/// Elements of a header: the tag, the position (4), the recorded count, the settings'
/// fingerprint, the signature's op, dtype and rank count, and its dims.
const LEN: usize = 10 + DIMS;
/// Elements of a header's row on the backend: the header and the lane's words.
const ROW: usize = LEN + WORDS;

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

/// Nanoseconds of [`CHECK_NANOS`] spent waiting for the last peer to arrive.
static CHECK_WAIT_NANOS: AtomicU64 = AtomicU64::new(0);

/// The time this process has spent in step checks so far, every group together, waiting
/// for its peers to arrive included (an upper bound on what the always-on check costs).
///
/// ```
/// let spent = tch_dist_runtime::step_check_time();
/// assert!(spent >= tch_dist_runtime::step_check_wait_time());
/// ```
pub fn step_check_time() -> Duration {
    Duration::from_nanos(CHECK_NANOS.load(Ordering::Relaxed))
}

/// Of [`step_check_time`], the time spent waiting for the last peer's header to be written,
/// in groups whose headers travel through shared memory (all ranks on one host): time this
/// rank would otherwise wait at the pass's first collective. [`step_check_time`] less this
/// is what the check itself costs there (`make bench` prints it per step as
/// `step_check_vs_step`). Through the backend (ranks on several hosts) the two cannot be
/// told apart, and this counts nothing.
///
/// ```
/// let cost = tch_dist_runtime::step_check_time() - tch_dist_runtime::step_check_wait_time();
/// # let _ = cost;
/// ```
pub fn step_check_wait_time() -> Duration {
    Duration::from_nanos(CHECK_WAIT_NANOS.load(Ordering::Relaxed))
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
    let mut lane = group.step_check_lane();
    let travel = match &mut *lane {
        Lane::Shared(segment) => Travel::Shared {
            seq: segment.publish(&me.encode()),
            began: start,
        },
        other => {
            let world = group.world_size();
            let mut row = me.encode().to_vec();
            row.extend(other.words(group));
            let mine = Tensor::from_slice(&row.repeat(world));
            let all = Tensor::zeros([(world * ROW) as i64], (Kind::Int64, mine.device()));
            let work = group.all_to_all_single_async(&all, &mine)?;
            Travel::Collective {
                work,
                all,
                sent: mine,
            }
        }
    };
    drop(lane);
    note_time(start);
    Ok(PendingCheck {
        flight: Some(Flight {
            travel,
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
    travel: Travel,
    group: ProcessGroup,
    op: &'static str,
    me: Header,
}

/// How a check's headers travel (`lane.rs`).
enum Travel {
    /// The backend's all-to-all: each row the header and the lane's words.
    Collective {
        work: Work,
        all: Tensor,
        /// This rank's rows, alive until the work completes.
        sent: Tensor,
    },
    /// This rank's header is in the segment as check `seq`.
    Shared { seq: u64, began: Instant },
}

impl PendingCheck {
    /// Waits for the exchange and compares every rank's position with this rank's.
    pub(crate) fn finish(self) -> Result<()> {
        let Some(Flight {
            travel,
            group,
            op,
            me,
        }) = self.flight
        else {
            return Ok(());
        };
        let start = Instant::now();
        let start_ns = shared::now_ns();
        let result = match travel {
            Travel::Collective { work, all, sent } => {
                let rows = work.wait().and_then(|()| read_rows(&group, op, &all));
                drop(sent);
                rows.and_then(|rows| {
                    let words: Vec<[i64; WORDS]> = rows
                        .iter()
                        .map(|r| std::array::from_fn(|i| r[LEN + i]))
                        .collect();
                    let mut lane = group.step_check_lane();
                    lane.advance(&words, group.rank());
                    if let Lane::Shared(segment) = &*lane {
                        group.mirror_collectives(segment.call_mirror());
                    }
                    drop(lane);
                    compare(&group, op, me, rows.iter().map(|r| &r[..LEN]))
                })
            }
            Travel::Shared { seq, began } => {
                let arrived = wait_shared(&group, op, seq, began);
                arrived.and_then(|arrived| {
                    // Waiting for the last peer to arrive is no cost of the check: without
                    // it, this rank would wait for that peer at the pass's first collective.
                    let waited = arrived.last_ns.saturating_sub(start_ns);
                    CHECK_WAIT_NANOS.fetch_add(waited, Ordering::Relaxed);
                    compare(&group, op, me, arrived.rows.iter().map(|r| &r[..]))
                })
            }
        };
        note_time(start);
        result
    }
}

/// Waits for every rank's header of check `seq` in the group's segment.
fn wait_shared(
    group: &ProcessGroup,
    op: &'static str,
    seq: u64,
    began: Instant,
) -> Result<shared::Arrived> {
    let lane = group.step_check_lane();
    let Lane::Shared(segment) = &*lane else {
        return Err(DistError::Internal {
            rank: group.rank(),
            op,
            what: "a step check through shared memory without its segment",
        });
    };
    let deadline = began + group.timeout();
    let result = segment.wait(
        seq,
        deadline,
        WATCH_SLICE,
        || group.collectives_launched(),
        || group.watch(op),
    );
    drop(lane);
    result.map_err(|end| match end {
        Unfinished::Timeout => DistError::Timeout {
            rank: group.rank(),
            op,
            timeout: group.timeout(),
        },
        Unfinished::Watched(e) => e,
        Unfinished::PeerElsewhere {
            peer,
            calls,
            last_call,
        } => {
            let e = DistError::Desync {
                rank: group.rank(),
                op,
                desync: Box::new(Desync::Elsewhere {
                    peer,
                    call: last_call,
                    seq: calls - 1,
                    own: group.collectives_launched(),
                }),
            };
            group.stop_after_failure(&e.to_string());
            e
        }
        Unfinished::PeerExited { peer, pid } => group.watch(op).unwrap_or_else(|| {
            let e = DistError::PeerGone {
                rank: group.rank(),
                op,
                peer: Some(peer),
                cause: format!(
                    "its process (pid {pid}) exited before it wrote its step-check header"
                ),
            };
            group.stop_after_failure(&e.to_string());
            e
        }),
    })
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn note_time(start: Instant) {
    CHECK_NANOS.fetch_add(nanos(start.elapsed()), Ordering::Relaxed);
}

/// The rows of a check through the backend.
fn read_rows(group: &ProcessGroup, op: &'static str, all: &Tensor) -> Result<Vec<Vec<i64>>> {
    let all = Vec::<i64>::try_from(all).map_err(|e| DistError::Collective {
        rank: group.rank(),
        op,
        cause: format!("reading the step check: {e}"),
    })?;
    Ok(all.chunks(ROW).map(<[i64]>::to_vec).collect())
}

/// Every rank's header in `rows` against `me`: positions first (a rank in another pass),
/// then programs.
fn compare<'a>(
    group: &ProcessGroup,
    op: &'static str,
    me: Header,
    rows: impl Iterator<Item = &'a [i64]>,
) -> Result<()> {
    let mut others = Vec::with_capacity(group.world_size());
    for (other_rank, row) in rows.enumerate() {
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
