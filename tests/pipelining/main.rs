//! `tch_dist::pipelining` end to end, ranks as real processes over 127.0.0.1: GPipe, 1F1B,
//! Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble training equal one process training the whole model (SGD with
//! momentum, 1e-5 after 3 steps) for 2 and 4 stages with 4 and 8 microbatches, stages of
//! uneven sizes, one with an embedding (integer input) and one with a LayerNorm; and the
//! refusals and failures.
//!
//! | file | what it tests | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `main.rs` | the model and the one-process reference; parity of every schedule | `test/distributed/pipelining/test_schedule_multiproc.py` (`test_forward_only`, `test_grad_with_manual`) |
//! | `composition.rs` | pp 2 × dp 2 on a mesh with `fully_shard` per stage, gradients reduced once per step; its checkpoint loaded into the unsplit model (tch-dist's and PyTorch's, by DCP) and back into the stages; pp 2 × tp 2 with `parallelize_module` per stage | torchtitan's pp × FSDP, `test_composability/test_pp_composability.py` |
//! | `errors.rs` | refusals on every rank, a shape that changes, a stage killed mid-step | the `ValueError`s of `schedules.py`, `test_schedule.py` |

use std::ops::Range;

use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};
use tch_dist::optim;
use tch_dist::pipelining::{
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
};
use tch_dist::testing::run_ranks;
use tch_dist::ProcessGroup;

mod composition;
mod errors;
#[path = "../common/python.rs"]
mod python;

/// The whole batch of every step.
pub const BATCH: i64 = 16;
/// Training steps compared.
const STEPS: usize = 3;
const LR: f64 = 0.05;
const VOCAB: i64 = 11;

/// One layer of the test model (built under `layers.<i>`, the whole model's paths).
#[derive(Debug, Clone, Copy)]
pub enum Spec {
    /// An embedding table: integer input of shape `[batch]` to `[batch, dim]`.
    Embed(i64, i64),
    /// A linear layer, with a ReLU after it or not.
    Linear(i64, i64, bool),
    /// A LayerNorm over the last dim.
    Norm(i64),
}

/// The model: an embedding, a LayerNorm between linears, uneven widths.
pub const MODEL: [Spec; 6] = [
    Spec::Embed(VOCAB, 6),
    Spec::Linear(6, 12, true),
    Spec::Norm(12),
    Spec::Linear(12, 9, true),
    Spec::Linear(9, 7, true),
    Spec::Linear(7, 3, false),
];

/// The model with two more linears, for 8 stages of one layer each.
pub const MODEL_8: [Spec; 8] = [
    Spec::Embed(VOCAB, 6),
    Spec::Linear(6, 12, true),
    Spec::Norm(12),
    Spec::Linear(12, 9, true),
    Spec::Linear(9, 8, true),
    Spec::Linear(8, 8, true),
    Spec::Linear(8, 7, true),
    Spec::Linear(7, 3, false),
];

#[derive(Debug)]
pub enum Layer {
    Embed(nn::Embedding),
    Linear(nn::Linear, bool),
    Norm(nn::LayerNorm),
}

/// Layers `range` of [`MODEL`], in order.
#[derive(Debug)]
pub struct Part {
    pub layers: Vec<Layer>,
}

impl Module for Part {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut h = xs.shallow_clone();
        for layer in &self.layers {
            h = match layer {
                Layer::Embed(e) => e.forward(&h),
                Layer::Linear(l, relu) => {
                    let y = l.forward(&h);
                    if *relu {
                        y.relu()
                    } else {
                        y
                    }
                }
                Layer::Norm(n) => n.forward(&h),
            };
        }
        h
    }
}

/// Layers `range` of `specs` built in `vs` under the whole model's paths (`layers.<i>`).
pub fn part(vs: &nn::VarStore, specs: &[Spec], range: Range<usize>) -> Part {
    let root = vs.root() / "layers";
    let layers = range
        .map(|i| {
            let p = &root / i;
            match specs[i] {
                Spec::Embed(n, d) => Layer::Embed(nn::embedding(p, n, d, Default::default())),
                Spec::Linear(i, o, relu) => {
                    Layer::Linear(nn::linear(p, i, o, Default::default()), relu)
                }
                Spec::Norm(d) => Layer::Norm(nn::layer_norm(p, vec![d], Default::default())),
            }
        })
        .collect();
    Part { layers }
}

/// The whole model with the initial values every test starts from (seed 0).
pub fn initial(specs: &[Spec]) -> (nn::VarStore, Part) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = part(&vs, specs, 0..specs.len());
    (vs, model)
}

/// Step `step`'s batch, the same on every rank: tokens and a regression target.
pub fn batch(step: usize, rows: i64) -> (Tensor, Tensor) {
    tch::manual_seed(100 + step as i64);
    let x = Tensor::randint(VOCAB, [rows], (Kind::Int64, Device::Cpu));
    let y = Tensor::randn([rows, 3], (Kind::Float, Device::Cpu));
    (x, y)
}

pub fn mse(out: &Tensor, y: &Tensor) -> Tensor {
    out.mse_loss(y, Reduction::Mean)
}

pub fn sgd(vs: &nn::VarStore) -> optim::Optimizer {
    optim::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(vs, LR)
    .unwrap()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    GPipe,
    OneFOneB,
    Interleaved,
    ZeroBubble,
    ZeroBubbleV,
}

/// A schedule of any kind over `Part` stages.
pub enum AnySchedule {
    GPipe(ScheduleGPipe<Part>),
    OneFOneB(Schedule1F1B<Part>),
    Interleaved(ScheduleInterleaved1F1B<Part>),
    ZeroBubble(ScheduleInterleavedZeroBubble<Part>),
    ZeroBubbleV(ScheduleZBVZeroBubble<Part>),
}

impl AnySchedule {
    pub fn step(
        &mut self,
        x: Option<&Tensor>,
        y: Option<&Tensor>,
        losses: &mut Vec<Tensor>,
    ) -> Result<(), tch_dist::pipelining::PipelineError> {
        match self {
            AnySchedule::GPipe(s) => s.step(x, y, losses),
            AnySchedule::OneFOneB(s) => s.step(x, y, losses),
            AnySchedule::Interleaved(s) => s.step(x, y, losses),
            AnySchedule::ZeroBubble(s) => s.step(x, y, losses),
            AnySchedule::ZeroBubbleV(s) => s.step(x, y, losses),
        }
    }

    /// How many backwards of this rank's stages ran split.
    pub fn split_backwards(&self) -> u64 {
        match self {
            AnySchedule::GPipe(s) => s.stage().split_backwards(),
            AnySchedule::OneFOneB(s) => s.stage().split_backwards(),
            AnySchedule::Interleaved(s) => s.stages().iter().map(|s| s.split_backwards()).sum(),
            AnySchedule::ZeroBubble(s) => s.stages().iter().map(|s| s.split_backwards()).sum(),
            AnySchedule::ZeroBubbleV(s) => s.stages().iter().map(|s| s.split_backwards()).sum(),
        }
    }
}

/// This rank's stages of `specs` cut at `cuts` (stage `s` holds layers `cuts[s]..cuts[s+1]`),
/// loop placement, in `vs`.
pub fn stages(
    pg: &ProcessGroup,
    vs: &nn::VarStore,
    specs: &[Spec],
    cuts: &[usize],
) -> Vec<PipelineStage<Part>> {
    let held = held(Which::GPipe, pg.rank(), pg.world_size(), cuts.len() - 1);
    stages_at(pg, vs, specs, cuts, &held)
}

/// The stages rank `rank` of `p` holds of `num_stages` under `kind`'s placement: loop (rank
/// r: r, r + p, ...), or the V for ZB-V (r and 2p - 1 - r).
pub fn held(kind: Which, rank: usize, p: usize, num_stages: usize) -> Vec<usize> {
    if kind == Which::ZeroBubbleV {
        vec![rank, 2 * p - 1 - rank]
    } else {
        (rank..num_stages).step_by(p).collect()
    }
}

/// Stages `held` of `specs` cut at `cuts`, in `vs`.
pub fn stages_at(
    pg: &ProcessGroup,
    vs: &nn::VarStore,
    specs: &[Spec],
    cuts: &[usize],
    held: &[usize],
) -> Vec<PipelineStage<Part>> {
    let num_stages = cuts.len() - 1;
    held.iter()
        .map(|&s| {
            PipelineStage::new(
                part(vs, specs, cuts[s]..cuts[s + 1]),
                s,
                num_stages,
                Device::Cpu,
                pg,
            )
        })
        .collect()
}

pub fn schedule(
    kind: Which,
    mut stages: Vec<PipelineStage<Part>>,
    n: usize,
) -> Result<AnySchedule, tch_dist::pipelining::PipelineError> {
    Ok(match kind {
        Which::GPipe => AnySchedule::GPipe(ScheduleGPipe::new(stages.remove(0), n, mse)?),
        Which::OneFOneB => AnySchedule::OneFOneB(Schedule1F1B::new(stages.remove(0), n, mse)?),
        Which::Interleaved => {
            AnySchedule::Interleaved(ScheduleInterleaved1F1B::new(stages, n, mse)?)
        }
        Which::ZeroBubble => {
            AnySchedule::ZeroBubble(ScheduleInterleavedZeroBubble::new(stages, n, mse)?)
        }
        Which::ZeroBubbleV => AnySchedule::ZeroBubbleV(ScheduleZBVZeroBubble::new(stages, n, mse)?),
    })
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Trains the pipelined model and, in this process, the whole model on the same batches;
/// every parameter of this rank's stages, and the last stage's mean loss, must equal the
/// whole model's within 1e-5 after every step.
fn check_parity(pg: &ProcessGroup, kind: Which, cuts: &[usize], n: usize) {
    check_parity_of(pg, kind, &MODEL, cuts, n)
}

/// [`check_parity`] of the model `specs`.
fn check_parity_of(pg: &ProcessGroup, kind: Which, specs: &[Spec], cuts: &[usize], n: usize) {
    let (init, _) = initial(specs);
    let (mut whole_vs, whole) = initial(specs);
    whole_vs.copy(&init).unwrap();
    let mut whole_opt = sgd(&whole_vs);

    let mut vs = nn::VarStore::new(Device::Cpu);
    let held = held(kind, pg.rank(), pg.world_size(), cuts.len() - 1);
    let mine = stages_at(pg, &vs, specs, cuts, &held);
    let holds_first = mine.iter().any(|s| s.is_first());
    let holds_last = mine.iter().any(|s| s.is_last());
    vs.copy(&init).unwrap();
    let mut opt = sgd(&vs);
    let mut schedule = schedule(kind, mine, n).unwrap();

    let whole_vars = whole_vs.variables();
    for step in 0..STEPS {
        let (x, y) = batch(step, BATCH);
        let loss = mse(&whole.forward(&x), &y);
        whole_opt.backward_step(&loss).unwrap();

        let mut losses = Vec::new();
        schedule
            .step(
                holds_first.then_some(&x),
                holds_last.then_some(&y),
                &mut losses,
            )
            .unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        if holds_last {
            assert_eq!(losses.len(), n);
            let mean = Tensor::stack(&losses, 0)
                .mean(Kind::Float)
                .double_value(&[]);
            let expected = loss.double_value(&[]);
            assert!(
                (mean - expected).abs() < 1e-5,
                "{kind:?} step {step}: mean loss {mean} vs {expected}"
            );
        } else {
            assert!(losses.is_empty());
        }
        for (name, t) in vs.variables() {
            let d = max_diff(&t, &whole_vars[&name]);
            assert!(
                d < 1e-5,
                "{kind:?} cuts {cuts:?} n {n} step {step}: {name} differs by {d}"
            );
        }
    }
    assert!(!vs.variables().is_empty());
    // Every schedule split every backward of every stage but the first (which has no input
    // gradient to send): the input's gradient went back before the weights' were computed.
    let split_stages = held.iter().filter(|&&s| s != 0).count();
    assert_eq!(
        schedule.split_backwards(),
        (STEPS * n * split_stages) as u64,
        "{kind:?} cuts {cuts:?} n {n}"
    );
}

/// 2 stages of uneven size: the embedding and a linear; the LayerNorm and three linears.
const CUTS_2: [usize; 3] = [0, 2, 6];
/// 4 stages: the embedding; a linear and the LayerNorm; a linear; two linears.
const CUTS_4: [usize; 5] = [0, 1, 3, 4, 6];
/// 8 stages of [`MODEL_8`], a layer each.
const CUTS_8: [usize; 9] = [0, 1, 2, 3, 4, 5, 6, 7, 8];

#[test]
fn gpipe_equals_one_process_at_2_stages() {
    run_ranks("gpipe_equals_one_process_at_2_stages", 2, |pg| {
        for n in [4, 8] {
            check_parity(&pg, Which::GPipe, &CUTS_2, n);
        }
    });
}

#[test]
fn gpipe_equals_one_process_at_4_stages() {
    run_ranks("gpipe_equals_one_process_at_4_stages", 4, |pg| {
        for n in [4, 8] {
            check_parity(&pg, Which::GPipe, &CUTS_4, n);
        }
    });
}

#[test]
fn one_f_one_b_equals_one_process_at_2_stages() {
    run_ranks("one_f_one_b_equals_one_process_at_2_stages", 2, |pg| {
        for n in [4, 8] {
            check_parity(&pg, Which::OneFOneB, &CUTS_2, n);
        }
    });
}

#[test]
fn one_f_one_b_equals_one_process_at_4_stages() {
    run_ranks("one_f_one_b_equals_one_process_at_4_stages", 4, |pg| {
        for n in [4, 8] {
            check_parity(&pg, Which::OneFOneB, &CUTS_4, n);
        }
    });
}

/// 2 ranks x 2 stages each (rank 0: stages 0 and 2, rank 1: stages 1 and 3).
#[test]
fn interleaved_1f1b_equals_one_process_at_2_ranks_x_2_stages() {
    run_ranks(
        "interleaved_1f1b_equals_one_process_at_2_ranks_x_2_stages",
        2,
        |pg| {
            for n in [4, 8] {
                check_parity(&pg, Which::Interleaved, &CUTS_4, n);
            }
        },
    );
}

#[test]
fn zero_bubble_equals_one_process_at_2_stages() {
    run_ranks("zero_bubble_equals_one_process_at_2_stages", 2, |pg| {
        for n in [4, 8] {
            check_parity(&pg, Which::ZeroBubble, &CUTS_2, n);
        }
    });
}

#[test]
fn zero_bubble_equals_one_process_at_4_stages() {
    run_ranks("zero_bubble_equals_one_process_at_4_stages", 4, |pg| {
        for n in [4, 8] {
            check_parity(&pg, Which::ZeroBubble, &CUTS_4, n);
        }
    });
}

/// 2 ranks x 2 stages each, as the interleaved 1F1B test.
#[test]
fn zero_bubble_equals_one_process_at_2_ranks_x_2_stages() {
    run_ranks(
        "zero_bubble_equals_one_process_at_2_ranks_x_2_stages",
        2,
        |pg| {
            for n in [4, 8] {
                check_parity(&pg, Which::ZeroBubble, &CUTS_4, n);
            }
        },
    );
}

/// ZB-V on 2 ranks: rank 0 holds stages 0 and 3 (the input and the loss), rank 1 stages 1
/// and 2, handed over in memory; 2 microbatches are fewer than PyTorch's planned 3.
#[test]
fn zero_bubble_v_equals_one_process_at_2_ranks() {
    run_ranks("zero_bubble_v_equals_one_process_at_2_ranks", 2, |pg| {
        for n in [2, 4, 8] {
            check_parity(&pg, Which::ZeroBubbleV, &CUTS_4, n);
        }
    });
}

/// ZB-V on 4 ranks, 8 stages of one layer each.
#[test]
fn zero_bubble_v_equals_one_process_at_4_ranks() {
    run_ranks("zero_bubble_v_equals_one_process_at_4_ranks", 4, |pg| {
        for n in [4, 8] {
            check_parity_of(&pg, Which::ZeroBubbleV, &MODEL_8, &CUTS_8, n);
        }
    });
}

/// A batch of another size than the last step's: the activation metadata is sent again
/// (every rank knows the batch from the step's check), and training still equals one process.
#[test]
fn a_new_batch_size_sends_the_metadata_again() {
    run_ranks("a_new_batch_size_sends_the_metadata_again", 2, |pg| {
        let (init, _) = initial(&MODEL);
        let (mut whole_vs, whole) = initial(&MODEL);
        whole_vs.copy(&init).unwrap();
        let mut vs = nn::VarStore::new(Device::Cpu);
        let mine = stages(&pg, &vs, &MODEL, &CUTS_2);
        vs.copy(&init).unwrap();
        let (mut opt, mut whole_opt) = (sgd(&vs), sgd(&whole_vs));
        let mut schedule = schedule(Which::OneFOneB, mine, 4).unwrap();
        let first = pg.rank() == 0;
        for (step, rows) in [(0, 8), (1, 16), (2, 8)] {
            let (x, y) = batch(step, rows);
            whole_opt
                .backward_step(&mse(&whole.forward(&x), &y))
                .unwrap();
            let mut losses = Vec::new();
            schedule
                .step(first.then_some(&x), (!first).then_some(&y), &mut losses)
                .unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        }
        let whole_vars = whole_vs.variables();
        for (name, t) in vs.variables() {
            assert!(max_diff(&t, &whole_vars[&name]) < 1e-5, "{name}");
        }
    });
}
