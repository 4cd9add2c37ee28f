//! Each schedule's order of work on one rank: the list of (stage, forward or backward,
//! microbatch) actions it runs, as PyTorch's schedules order them
//! (`torch/distributed/pipelining/schedules.py`: `ScheduleGPipe._step_microbatches`,
//! `Schedule1F1B._step_microbatches`, `_get_1f1b_rank_ops` and
//! `ScheduleInterleaved1F1B._calculate_single_rank_operations`,
//! `ScheduleInterleavedZeroBubble._calculate_single_rank_operations`).
//!
//! Communication is not in the lists: a forward receives its input just before it runs and
//! sends its output right after, a backward likewise with gradients (see `transport.rs`).

use std::collections::BTreeMap;

/// Forward or backward, or one of a split backward's two passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Work {
    Forward,
    /// The whole backward: the input's and the parameters' gradients.
    Backward,
    /// The input's gradient only (PyTorch's `BACKWARD_INPUT`, "I").
    BackwardInput,
    /// The parameters' gradients of an earlier [`Work::BackwardInput`] (`BACKWARD_WEIGHT`,
    /// "W").
    BackwardWeight,
}

/// One compute action of a rank's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Action {
    pub stage: usize,
    pub work: Work,
    pub microbatch: usize,
}

impl Work {
    /// PyTorch's letter for it in an action's name (`_ComputationType`: F, B, I, W).
    fn letter(self) -> char {
        match self {
            Work::Forward => 'F',
            Work::Backward => 'B',
            Work::BackwardInput => 'I',
            Work::BackwardWeight => 'W',
        }
    }

    /// The category its span is traced in (`TCH_DIST_TRACE`).
    pub(crate) fn trace_category(self) -> &'static str {
        match self {
            Work::Forward => "forward",
            _ => "backward",
        }
    }
}

/// PyTorch's notation for an action (`_Action`'s): stage, letter, microbatch, e.g. `1F0`
/// for stage 1's forward of microbatch 0; the name of its span in a trace.
impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}{}", self.stage, self.work.letter(), self.microbatch)
    }
}

fn action(stage: usize, work: Work, microbatch: usize) -> Action {
    Action {
        stage,
        work,
        microbatch,
    }
}

fn f(stage: usize, microbatch: usize) -> Action {
    action(stage, Work::Forward, microbatch)
}

fn b(stage: usize, microbatch: usize) -> Action {
    action(stage, Work::Backward, microbatch)
}

/// GPipe (fill-drain): every forward, then every backward, in microbatch order.
pub(crate) fn gpipe(stage: usize, n: usize) -> Vec<Action> {
    (0..n)
        .map(|m| f(stage, m))
        .chain((0..n).map(|m| b(stage, m)))
        .collect()
}

/// 1F1B: `min(n, num_stages - stage)` warmup forwards, then a backward and a forward in
/// turn ("1B1F") while forwards remain, then the remaining backwards.
pub(crate) fn one_f_one_b(stage: usize, num_stages: usize, n: usize) -> Vec<Action> {
    let warmup = n.min(num_stages - stage);
    let mut order: Vec<Action> = (0..warmup).map(|m| f(stage, m)).collect();
    let (mut fwd, mut bwd) = (warmup, 0);
    loop {
        order.push(b(stage, bwd));
        bwd += 1;
        if fwd == n {
            break;
        }
        order.push(f(stage, fwd));
        fwd += 1;
    }
    order.extend((bwd..n).map(|m| b(stage, m)));
    order
}

/// Interleaved 1F1B's rounds: `max(1, n / group_size)`, and the microbatches per round.
pub(crate) fn rounds(group_size: usize, n: usize) -> (usize, usize) {
    let rounds = (n / group_size).max(1);
    (rounds, n / rounds)
}

/// What the interleaved schedules share on `rank` of `group_size` holding `n_local` stages
/// (`rank`, `rank + group_size`, ...): rounds of `per_round` microbatches per local stage,
/// `warmup` forwards first (`(n_local - 1) * per_round + hop * (group_size - 1 - rank)`, at
/// most all), then `op`s that each pair a forward with a backward, then the last backwards;
/// forwards go depth first through the local stages round by round, backwards from the last
/// local stage down.
struct Interleaving {
    rank: usize,
    group_size: usize,
    n_local: usize,
    per_round: usize,
    warmup: usize,
    total: usize,
}

impl Interleaving {
    fn new(rank: usize, group_size: usize, n_local: usize, n: usize, hop: usize) -> Self {
        let (_, per_round) = rounds(group_size, n);
        let total = n_local * n;
        let warmup = ((n_local - 1) * per_round + hop * (group_size - 1 - rank)).min(total);
        Interleaving {
            rank,
            group_size,
            n_local,
            per_round,
            warmup,
            total,
        }
    }

    /// Every op: a forward while `op < total`, a backward from `op >= warmup`.
    fn ops(&self) -> std::ops::Range<usize> {
        0..self.total + self.warmup
    }

    fn forward_stage(&self, op: usize) -> usize {
        ((op / self.per_round) % self.n_local) * self.group_size + self.rank
    }

    fn backward_stage(&self, op: usize) -> usize {
        let local = self.n_local - 1 - ((op - self.warmup) / self.per_round) % self.n_local;
        local * self.group_size + self.rank
    }
}

/// The next microbatch of each (stage, kind of work).
#[derive(Default)]
struct Next(BTreeMap<(usize, u8), usize>);

impl Next {
    fn action(&mut self, stage: usize, work: Work) -> Action {
        let m = self.0.entry((stage, work as u8)).or_insert(0);
        *m += 1;
        action(stage, work, *m - 1)
    }
}

/// Interleaved 1F1B on `rank` of `group_size` holding `n_local` stages: warmup
/// `(n_local - 1) * per_round + 2 * (group_size - 1 - rank)` forwards (at most all of them),
/// then one forward and one backward in turn, then the backwards (see [`Interleaving`]).
pub(crate) fn interleaved_1f1b(
    rank: usize,
    group_size: usize,
    n_local: usize,
    n: usize,
) -> Vec<Action> {
    let plan = Interleaving::new(rank, group_size, n_local, n, 2);
    let mut next = Next::default();
    let mut order = Vec::with_capacity(2 * plan.total);
    for op in plan.ops() {
        if op < plan.total {
            order.push(next.action(plan.forward_stage(op), Work::Forward));
        }
        if op >= plan.warmup {
            order.push(next.action(plan.backward_stage(op), Work::Backward));
        }
    }
    order
}

/// Interleaved zero bubble (ZB1P) on `rank` of `group_size` holding `n_local` stages, as
/// PyTorch's `_get_1f1b_rank_ops(..., enable_zero_bubble=True)`: warmup
/// `(n_local - 1) * per_round + (group_size - 1 - rank)` forwards (at most all), then a
/// forward and an input backward in turn, then the remaining input backwards; the weight
/// backwards follow their input backwards in the same order, each `rank` actions late, so
/// that they fill the time a later rank's gradient takes to arrive.
pub(crate) fn interleaved_zero_bubble(
    rank: usize,
    group_size: usize,
    n_local: usize,
    n: usize,
) -> Vec<Action> {
    let plan = Interleaving::new(rank, group_size, n_local, n, 1);
    let mut next = Next::default();
    let mut order = Vec::with_capacity(3 * plan.total);
    // The stage of each input backward so far; the weight backwards follow them.
    let mut inputs = Vec::with_capacity(plan.total);
    let mut weights = 0;
    for op in plan.ops() {
        if op < plan.total {
            order.push(next.action(plan.forward_stage(op), Work::Forward));
        }
        if op >= plan.warmup {
            let stage = plan.backward_stage(op);
            order.push(next.action(stage, Work::BackwardInput));
            inputs.push(stage);
            if op - plan.warmup >= rank {
                order.push(next.action(inputs[weights], Work::BackwardWeight));
                weights += 1;
            }
        }
    }
    for &stage in &inputs[weights..] {
        order.push(next.action(stage, Work::BackwardWeight));
    }
    order
}

/// The V-shaped zero bubble (ZB-V) on `rank` of `group_size`, holding stages `rank` (its
/// "down" stage) and `2 * group_size - 1 - rank` (its "up" stage), as PyTorch's
/// `ScheduleZBVZeroBubble._calculate_single_rank_operations`: warmup forwards of the down
/// stage, then down and up forwards in turn, then forward, input and weight backward of the
/// up stage; in the steady state a down forward (while any remain), the down stage's input
/// and weight backward, and the same three of the up stage; in the cooldown the input
/// backwards first and the weight backwards last. Planned for at least `2 * group_size - 1`
/// microbatches, as PyTorch plans it, with the actions of microbatches past `n` left out.
pub(crate) fn zero_bubble_v(rank: usize, group_size: usize, n: usize) -> Vec<Action> {
    let planned = n.max(2 * group_size - 1);
    let (down, up) = (rank, 2 * group_size - 1 - rank);
    let mut order = Vec::with_capacity(6 * planned);
    // Forwards, input backwards and weight backwards so far, of the down and the up stage.
    let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
    for _ in 0..2 * (group_size - rank) - 1 {
        order.push(f(down, f0));
        f0 += 1;
    }
    for _ in 0..rank {
        order.push(f(up, f1));
        f1 += 1;
        order.push(f(down, f0));
        f0 += 1;
    }
    for _ in 0..group_size - rank {
        order.push(f(up, f1));
        f1 += 1;
        order.push(action(up, Work::BackwardInput, b1));
        order.push(action(up, Work::BackwardWeight, b1));
        b1 += 1;
    }
    while f1 < f0 || f0 < planned {
        if f0 < planned {
            order.push(f(down, f0));
            f0 += 1;
        }
        order.push(action(down, Work::BackwardInput, b0));
        order.push(action(down, Work::BackwardWeight, b0));
        b0 += 1;
        order.push(f(up, f1));
        f1 += 1;
        order.push(action(up, Work::BackwardInput, b1));
        order.push(action(up, Work::BackwardWeight, b1));
        b1 += 1;
    }
    let (mut w0, w1) = (b0, b1);
    for _ in 0..rank {
        order.push(action(down, Work::BackwardInput, b0));
        b0 += 1;
        order.push(action(up, Work::BackwardInput, b1));
        b1 += 1;
    }
    for _ in 0..group_size - rank {
        order.push(action(down, Work::BackwardInput, b0));
        b0 += 1;
        order.push(action(down, Work::BackwardWeight, w0));
        w0 += 1;
    }
    order.extend((w1..b1).map(|m| action(up, Work::BackwardWeight, m)));
    order.extend((w0..b0).map(|m| action(down, Work::BackwardWeight, m)));
    order.retain(|a| a.microbatch < n);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(order: &[Action]) -> String {
        order
            .iter()
            .map(|a| format!("{}{}.{}", a.work.letter(), a.stage, a.microbatch))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// PyTorch 2.11's own orders (`ScheduleZBVZeroBubble._calculate_single_rank_operations`
    /// with `pp_group_size`, `num_stages = 2 * pp_group_size` and `_n_microbatches` set), in
    /// its notation.
    #[test]
    fn zero_bubble_v_is_pytorch_s_order() {
        let pytorch = |p: usize, n: usize| -> Vec<String> {
            (0..p)
                .map(|r| {
                    zero_bubble_v(r, p, n)
                        .iter()
                        .map(Action::to_string)
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect()
        };
        assert_eq!(
            pytorch(2, 4),
            [
                "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 \
                 0I2 0W2 0I3 0W3",
                "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 \
                 1I3 1W2 2W3 1W3",
            ]
        );
        assert_eq!(
            pytorch(2, 2),
            [
                "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
                "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1",
            ]
        );
        assert_eq!(
            pytorch(4, 8),
            [
                "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 \
                 0I0 0W0 7F4 7I4 7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7 \
                 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
                "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 \
                 6I3 6W3 1F7 1I1 1W1 6F5 6I4 6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 6W6 1I4 6I7 \
                 1I5 1W4 1I6 1W5 1I7 1W6 6W7 1W7",
                "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 \
                 2I1 2W1 5F5 5I3 5W3 2F7 2I2 2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 5W5 2I4 5I6 2I5 5I7 \
                 2I6 2W4 2I7 2W5 5W6 5W7 2W6 2W7",
                "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 \
                 4I2 4W2 3F6 3I2 3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 \
                 3I7 3W4 4W5 4W6 4W7 3W5 3W6 3W7",
            ]
        );
    }

    #[test]
    fn an_action_is_named_as_pytorch_names_it() {
        assert_eq!(f(1, 0).to_string(), "1F0");
        assert_eq!(b(0, 12).to_string(), "0B12");
        assert_eq!(action(3, Work::BackwardInput, 2).to_string(), "3I2");
        assert_eq!(action(3, Work::BackwardWeight, 2).to_string(), "3W2");
    }

    #[test]
    fn gpipe_fills_then_drains() {
        assert_eq!(text(&gpipe(1, 3)), "F1.0 F1.1 F1.2 B1.0 B1.1 B1.2");
    }

    #[test]
    fn one_f_one_b_warms_up_by_distance_to_the_end() {
        // 4 stages, 4 microbatches (PyTorch's warmup: num_stages - stage_index).
        assert_eq!(
            text(&one_f_one_b(0, 4, 4)),
            "F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3"
        );
        assert_eq!(
            text(&one_f_one_b(2, 4, 4)),
            "F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 B2.3"
        );
        assert_eq!(
            text(&one_f_one_b(3, 4, 4)),
            "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3"
        );
    }

    #[test]
    fn interleaved_goes_depth_first_in_rounds() {
        // 2 ranks x 2 stages, 4 microbatches: 2 rounds of 2 microbatches.
        assert_eq!(rounds(2, 4), (2, 2));
        assert_eq!(
            text(&interleaved_1f1b(0, 2, 2, 4)),
            "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3"
        );
        assert_eq!(
            text(&interleaved_1f1b(1, 2, 2, 4)),
            "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3"
        );
        // PyTorch's own orders (`_calculate_single_rank_operations`, Nones dropped).
        assert_eq!(
            text(&interleaved_1f1b(0, 2, 2, 8)),
            "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 F0.4 B2.2 F0.5 B2.3 \
             F2.4 B0.2 F2.5 B0.3 F0.6 B2.4 F0.7 B2.5 F2.6 B0.4 F2.7 B0.5 B2.6 B2.7 B0.6 B0.7"
        );
        assert_eq!(
            text(&interleaved_1f1b(0, 4, 2, 8)),
            "F0.0 F0.1 F0.2 F0.3 F4.0 F4.1 F4.2 F4.3 F0.4 F0.5 F0.6 B4.0 F0.7 B4.1 F4.4 B4.2 \
             F4.5 B4.3 F4.6 B0.0 F4.7 B0.1 B0.2 B0.3 B4.4 B4.5 B4.6 B4.7 B0.4 B0.5 B0.6 B0.7"
        );
        assert_eq!(
            text(&interleaved_1f1b(3, 4, 2, 8)),
            "F3.0 F3.1 F3.2 F3.3 F7.0 B7.0 F7.1 B7.1 F7.2 B7.2 F7.3 B7.3 F3.4 B3.0 F3.5 B3.1 \
             F3.6 B3.2 F3.7 B3.3 F7.4 B7.4 F7.5 B7.5 F7.6 B7.6 F7.7 B7.7 B3.4 B3.5 B3.6 B3.7"
        );
        // Every rank runs every forward and backward of its stages once.
        for rank in 0..2 {
            let order = interleaved_1f1b(rank, 2, 2, 8);
            assert_eq!(order.len(), 32);
            for s in [rank, rank + 2] {
                for m in 0..8 {
                    assert_eq!(
                        order
                            .iter()
                            .filter(|a| a.stage == s && a.microbatch == m)
                            .count(),
                        2
                    );
                }
            }
        }
    }

    #[test]
    fn zero_bubble_orders_are_pytorchs() {
        // PyTorch 2.11's `_get_1f1b_rank_ops(enable_zero_bubble=True)` with
        // ScheduleInterleavedZeroBubble's warmup (Nones dropped).
        let cases = [
            (
                2,
                1,
                4,
                0,
                "F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 F0.3 I0.2 W0.2 I0.3 W0.3",
            ),
            (
                2,
                1,
                4,
                1,
                "F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 F1.3 I1.3 W1.2 W1.3",
            ),
            (
                4,
                1,
                8,
                2,
                "F2.0 F2.1 I2.0 F2.2 I2.1 F2.3 I2.2 W2.0 F2.4 I2.3 W2.1 F2.5 I2.4 W2.2 F2.6 I2.5 \
                 W2.3 F2.7 I2.6 W2.4 I2.7 W2.5 W2.6 W2.7",
            ),
            (
                4,
                1,
                8,
                3,
                "F3.0 I3.0 F3.1 I3.1 F3.2 I3.2 F3.3 I3.3 W3.0 F3.4 I3.4 W3.1 F3.5 I3.5 W3.2 F3.6 \
                 I3.6 W3.3 F3.7 I3.7 W3.4 W3.5 W3.6 W3.7",
            ),
            (
                2,
                2,
                4,
                0,
                "F0.0 F0.1 F2.0 F2.1 I2.0 W2.0 F0.2 I2.1 W2.1 F0.3 I0.0 W0.0 F2.2 I0.1 W0.1 F2.3 \
                 I2.2 W2.2 I2.3 W2.3 I0.2 W0.2 I0.3 W0.3",
            ),
            (
                2,
                2,
                4,
                1,
                "F1.0 F1.1 F3.0 I3.0 F3.1 I3.1 W3.0 F1.2 I1.0 W3.1 F1.3 I1.1 W1.0 F3.2 I3.2 W1.1 \
                 F3.3 I3.3 W3.2 I1.2 W3.3 I1.3 W1.2 W1.3",
            ),
        ];
        for (group_size, n_local, n, rank, want) in cases {
            assert_eq!(
                text(&interleaved_zero_bubble(rank, group_size, n_local, n)),
                want,
                "{group_size} ranks x {n_local} stages, {n} microbatches, rank {rank}"
            );
        }
    }
}
