//! Pipeline × data parallelism on a 2 × 2 mesh (`pp`, `dp`, torchtitan's order): each
//! stage's module under `fully_shard` over its `dp` group, gradients reduced once per step
//! (`set_requires_gradient_sync(false)` for all but the last microbatch's backward, through
//! `PipelineStage::on_backward`), equal to one process training the whole model on both
//! replicas' rows; its checkpoint (each stage's part under the whole model's FQNs) loads
//! into the unsplit model and back into the stages. And pp × tp: each stage's block
//! tensor-parallel over its `tp` dim; pp × cp: each stage's attention a ring over its `cp`
//! dim.

use std::ops::Range;
use std::path::{Path, PathBuf};

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_dist::checkpoint::{LoadOptions, State};
use tch_dist::device_mesh::init_device_mesh;
use tch_dist::fully_shard::full_state_dict;
use tch_dist::pipelining::{
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble,
};
use tch_dist::testing::run_ranks;
use tch_dist::{checkpoint, fully_shard, Call, FsdpOptions, ProcessGroup, Shardable};

use super::python::{bounded, clean, python};
use super::{mse, sgd};

#[path = "../common/chain.rs"]
mod chain;
use chain::Chain;

/// The widths of [`Chain`]'s layers.
const DIMS: [i64; 4] = [5, 8, 6, 4];
/// Rows per data-parallel replica.
const ROWS: i64 = 8;

/// A folder for this test's files, the same for every rank (emptied by rank 0).
fn scratch(name: &str, pg: &ProcessGroup) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    if pg.rank() == 0 {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
    }
    pg.barrier().unwrap();
    dir
}

/// The largest difference between `model`'s tensors (gathered) and the reference's, by the
/// whole model's FQNs; and how many tensors were compared.
fn diff_to(model: &Chain, reference: &nn::VarStore) -> (f64, usize) {
    let ref_vars = reference.variables();
    let full = full_state_dict(model).unwrap();
    let n = full.len();
    let d = full
        .into_iter()
        .map(|(fqn, t)| (&t - &ref_vars[&fqn]).abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    (d, n)
}

fn whole(seed: i64) -> (nn::VarStore, Chain) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let c = Chain::new(&vs, &DIMS, |_| true);
    (vs, c)
}

fn global_batch(step: usize) -> (Tensor, Tensor) {
    tch::manual_seed(200 + step as i64);
    let x = Tensor::randn([2 * ROWS, DIMS[0]], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([2 * ROWS, DIMS[3]], (Kind::Float, Device::Cpu));
    (x, y)
}

/// GPipe, 1F1B or zero bubble over one stage of [`Chain`]: the schedules the compositions
/// run.
enum ChainSchedule {
    GPipe(ScheduleGPipe<Chain>),
    OneFOneB(Schedule1F1B<Chain>),
    ZeroBubble(ScheduleInterleavedZeroBubble<Chain>),
}

/// Which of [`ChainSchedule`]'s.
#[derive(Debug, Clone, Copy)]
enum Which {
    GPipe,
    OneFOneB,
    ZeroBubble,
}

impl ChainSchedule {
    /// `which` schedule of `stage` on 4 microbatches, MSE.
    fn new(stage: PipelineStage<Chain>, which: Which) -> ChainSchedule {
        match which {
            Which::GPipe => ChainSchedule::GPipe(ScheduleGPipe::new(stage, 4, mse).unwrap()),
            Which::OneFOneB => ChainSchedule::OneFOneB(Schedule1F1B::new(stage, 4, mse).unwrap()),
            Which::ZeroBubble => ChainSchedule::ZeroBubble(
                ScheduleInterleavedZeroBubble::new(vec![stage], 4, mse).unwrap(),
            ),
        }
    }

    fn step(&mut self, x: Option<&Tensor>, y: Option<&Tensor>, losses: &mut Vec<Tensor>) {
        match self {
            ChainSchedule::GPipe(s) => s.step(x, y, losses).unwrap(),
            ChainSchedule::OneFOneB(s) => s.step(x, y, losses).unwrap(),
            ChainSchedule::ZeroBubble(s) => s.step(x, y, losses).unwrap(),
        }
    }

    fn stage(&self) -> &PipelineStage<Chain> {
        match self {
            ChainSchedule::GPipe(s) => s.stage(),
            ChainSchedule::OneFOneB(s) => s.stage(),
            ChainSchedule::ZeroBubble(s) => &s.stages()[0],
        }
    }

    fn module(&self) -> &Chain {
        self.stage().module()
    }
}

/// This rank's place on the 2 x 2 `pp` x `dp` mesh, the one-process reference, and this
/// stage's part built from the reference's start (stage 0: layer 0; stage 1: layers 1, 2).
struct PpDp {
    pp: tch_dist::ProcessGroup,
    dp: tch_dist::ProcessGroup,
    stage_index: usize,
    replica: i64,
    range: Range<usize>,
    ref_vs: nn::VarStore,
    reference: Chain,
    ref_opt: tch_dist::optim::Optimizer,
    vs: nn::VarStore,
}

impl PpDp {
    /// The mesh, the reference and this stage's part (returned beside).
    fn new() -> (PpDp, Chain) {
        let mesh = init_device_mesh("cpu", &[2, 2], &["pp", "dp"]).unwrap();
        let stage_index = mesh.get_local_rank("pp").unwrap();
        let (init, _) = whole(0);
        let (mut ref_vs, reference) = whole(0);
        ref_vs.copy(&init).unwrap();
        let ref_opt = sgd(&ref_vs);
        let range = if stage_index == 0 { 0..1 } else { 1..3 };
        let mut vs = nn::VarStore::new(Device::Cpu);
        let part = Chain::new(&vs, &DIMS, |i| range.contains(&i));
        vs.copy(&init).unwrap();
        let setup = PpDp {
            pp: mesh.get_group("pp").unwrap().clone(),
            dp: mesh.get_group("dp").unwrap().clone(),
            stage_index,
            replica: mesh.get_local_rank("dp").unwrap() as i64,
            range,
            ref_vs,
            reference,
            ref_opt,
            vs,
        };
        (setup, part)
    }

    /// The reference's step on the global batch of `step`, and the pipeline's on this
    /// replica's rows of it.
    fn step_both(
        &mut self,
        step: usize,
        schedule: &mut ChainSchedule,
        opt: &mut tch_dist::optim::Optimizer,
    ) {
        let (x, y) = global_batch(step);
        self.ref_opt
            .backward_step(&mse(&self.reference.forward(&x), &y))
            .unwrap();
        let mine = |t: &Tensor| t.narrow(0, self.replica * ROWS, ROWS);
        let (x, y) = (mine(&x), mine(&y));
        let (first, last) = (self.stage_index == 0, self.stage_index == 1);
        let mut losses = Vec::new();
        schedule.step(first.then_some(&x), last.then_some(&y), &mut losses);
        opt.step().unwrap();
        opt.zero_grad();
    }
}

fn pp_dp_equals_one_process(world: &ProcessGroup, which: Which) {
    let (mut setup, part) = PpDp::new();
    let (stage_index, range) = (setup.stage_index, setup.range.clone());
    let dp = setup.dp.clone();
    let dp_options = || FsdpOptions {
        process_group: Some(dp.clone()),
        ..Default::default()
    };
    let state = fully_shard(&part, dp_options()).unwrap();
    let mut opt = sgd(&setup.vs);
    let stage = PipelineStage::with_forward(
        part,
        |m: &Chain, x: &Tensor, _train| m.f_call(x),
        stage_index,
        2,
        Device::Cpu,
        &setup.pp,
    )
    .on_backward(move |last| {
        // PyTorch's `backward_maybe_with_nosync` for FSDP: accumulate unsharded, reduce in
        // the last microbatch's backward.
        state.set_requires_gradient_sync(last);
        state.set_reshard_after_backward(last);
        Ok(())
    });
    let mut schedule = ChainSchedule::new(stage, which);
    for step in 0..3 {
        setup.step_both(step, &mut schedule, &mut opt);
        let (d, n) = diff_to(schedule.module(), &setup.ref_vs);
        assert_eq!(n, 2 * range.len());
        assert!(d < 1e-5, "{which:?} step {step}: differs by {d}");
    }
    // fully_shard reduces in the backward: every backward ran whole, in one pass.
    assert_eq!(schedule.stage().split_backwards(), 0);

    // The pipelined checkpoint: each stage's ranks save their shards under the whole
    // model's names, each tensor once.
    let module = schedule.module();
    let dir = scratch(&format!("pp_dp_checkpoint_{which:?}"), world);
    let ckpt = dir.join("step-00000003");
    checkpoint::save(
        &ckpt,
        &State::new(module).with_optimizer(&mut opt),
        world,
        &Default::default(),
    )
    .unwrap();
    // Into the unsplit model (every rank the whole model, replicated).
    let (whole_vs, unsplit) = whole(7);
    checkpoint::load(
        &ckpt,
        &mut State::new(&unsplit),
        world,
        &LoadOptions::default(),
    )
    .unwrap();
    for (fqn, t) in whole_vs.variables() {
        let d = (&t - &setup.ref_vs.variables()[&fqn])
            .abs()
            .max()
            .double_value(&[]);
        assert!(d < 1e-5, "{which:?}: unsplit {fqn} differs by {d}");
    }
    // Into PyTorch's unsplit model (DCP, one process).
    if world.rank() == 0 {
        let full = dir.join("full.safetensors");
        setup.ref_vs.save(&full).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pipelining/pytorch_load.py");
        let mut cmd = clean(python().join("python"));
        cmd.arg(&script).arg(&ckpt).arg(&full);
        let out = bounded(cmd);
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
            "PyTorch's load: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Back into the stages (a resume): the parts, fully sharded again, and the optimizer.
    let resumed_vs = nn::VarStore::new(Device::Cpu);
    let resumed = Chain::new(&resumed_vs, &DIMS, |i| range.contains(&i));
    fully_shard(&resumed, dp_options()).unwrap();
    let mut resumed_opt = sgd(&resumed_vs);
    checkpoint::load(
        &ckpt,
        &mut State::new(&resumed).with_optimizer(&mut resumed_opt),
        world,
        &LoadOptions::default(),
    )
    .unwrap();
    let (d, n) = diff_to(&resumed, &setup.ref_vs);
    assert_eq!(n, 2 * range.len());
    assert!(d < 1e-5, "{which:?}: resumed stage differs by {d}");
    assert_eq!(
        resumed_opt.states().count(),
        opt.states().count(),
        "the stage's optimizer state is back"
    );
}

/// pp 2 x dp 2 with `fully_shard` on each stage's part: several forwards run before their
/// backwards (GPipe's F F F F B B B B, 1F1B's and zero bubble's warm-up), each backward its
/// own pass (zero bubble's too: its input backward is the whole backward under fully_shard); every
/// pass that reaches a group enters it again, so every microbatch's gradients are reduced
/// (before the fix, the passes after the first left theirs behind: off by about 1e-2).
/// Then its checkpoint loads into the unsplit model and back into the stages.
#[test]
fn pp_2_x_dp_2_with_fully_shard_equals_one_process() {
    run_ranks(
        "composition::pp_2_x_dp_2_with_fully_shard_equals_one_process",
        4,
        |pg| {
            for which in [Which::OneFOneB, Which::GPipe, Which::ZeroBubble] {
                pp_dp_equals_one_process(&pg, which);
            }
        },
    );
}

/// A Megatron MLP block: `fc2(gelu(fc1(x)))`, `fc1` colwise and `fc2` rowwise under tp.
#[derive(Debug, Shardable)]
struct MlpBlock {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

/// The whole model's MLP blocks `blocks.<i>`, tanh between them; a stage's part holds its own
/// (`None` for the others').
#[derive(Debug, Shardable)]
struct MlpChain {
    blocks: Vec<Option<MlpBlock>>,
}

impl Module for MlpChain {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.blocks
            .iter()
            .flatten()
            .fold(xs.shallow_clone(), |h, b| {
                b.fc2.call(&b.fc1.call(&h).gelu("none")).tanh()
            })
    }
}

/// Width of the blocks' input and output, and of their hidden layer (4 columns per tp rank).
const WIDTH: i64 = 6;
const HIDDEN: i64 = 8;

fn mlp_chain(vs: &nn::VarStore, stages: Range<usize>) -> MlpChain {
    let root = vs.root() / "blocks";
    MlpChain {
        blocks: (0..2)
            .map(|i| {
                stages.contains(&i).then(|| MlpBlock {
                    fc1: nn::linear(&root / i / "fc1", WIDTH, HIDDEN, Default::default()),
                    fc2: nn::linear(&root / i / "fc2", HIDDEN, WIDTH, Default::default()),
                })
            })
            .collect(),
    }
}

/// pp 2 x tp 2 on a mesh: each stage's block tensor-parallel over its `tp` dim
/// (`parallelize_module`, Megatron's colwise-then-rowwise), 1F1B across the stages. Stage 1's
/// input gradient, sent back to stage 0, is the sum over the tp ranks' column shards (the
/// colwise layer's replicated input): training equals one process.
#[test]
fn pp_2_x_tp_2_with_parallelize_module_equals_one_process() {
    run_ranks(
        "composition::pp_2_x_tp_2_with_parallelize_module_equals_one_process",
        4,
        |_pg| {
            use tch_dist::sharding::{
                parallelize_module, ColwiseParallel, ParallelizePlan, RowwiseParallel,
            };
            let mesh = init_device_mesh("cpu", &[2, 2], &["pp", "tp"]).unwrap();
            let pp = mesh.get_group("pp").unwrap().clone();
            let stage_index = mesh.get_local_rank("pp").unwrap();
            tch::manual_seed(0);
            let init_vs = nn::VarStore::new(Device::Cpu);
            let _ = mlp_chain(&init_vs, 0..2);
            let mut ref_vs = nn::VarStore::new(Device::Cpu);
            let reference = mlp_chain(&ref_vs, 0..2);
            ref_vs.copy(&init_vs).unwrap();
            let mut ref_opt = sgd(&ref_vs);

            let mut vs = nn::VarStore::new(Device::Cpu);
            let mut part = mlp_chain(&vs, stage_index..stage_index + 1);
            vs.copy(&init_vs).unwrap();
            let plan = ParallelizePlan::new()
                .style(
                    format!("blocks.{stage_index}.fc1"),
                    ColwiseParallel::default(),
                )
                .style(
                    format!("blocks.{stage_index}.fc2"),
                    RowwiseParallel::default(),
                );
            parallelize_module(&mut part, &mesh.dim("tp").unwrap(), &plan).unwrap();
            let block = part.blocks[stage_index].as_ref().unwrap();
            assert_eq!(
                block.fc1.ws.size(),
                [HIDDEN / 2, WIDTH],
                "fc1's column shard"
            );
            assert_eq!(block.fc2.ws.size(), [WIDTH, HIDDEN / 2], "fc2's row shard");
            let mut opt = sgd(&vs);
            let stage = PipelineStage::with_forward(
                part,
                |m: &MlpChain, x: &Tensor, _train| m.f_call(x),
                stage_index,
                2,
                Device::Cpu,
                &pp,
            );
            let mut schedule = Schedule1F1B::new(stage, 4, mse).unwrap();
            let (first, last) = (stage_index == 0, stage_index == 1);
            for step in 0..3 {
                tch::manual_seed(300 + step);
                let x = Tensor::randn([8, WIDTH], (Kind::Float, Device::Cpu));
                let y = Tensor::randn([8, WIDTH], (Kind::Float, Device::Cpu));
                ref_opt
                    .backward_step(&mse(&reference.forward(&x), &y))
                    .unwrap();
                let mut losses = Vec::new();
                schedule
                    .step(first.then_some(&x), last.then_some(&y), &mut losses)
                    .unwrap();
                opt.step().unwrap();
                opt.zero_grad();
                let module = schedule.stage().module();
                let ref_vars = ref_vs.variables();
                let full = full_state_dict(module).unwrap();
                assert_eq!(full.len(), 4);
                for (fqn, t) in full {
                    let d = (&t - &ref_vars[&fqn]).abs().max().double_value(&[]);
                    assert!(d < 1e-5, "step {step}: {fqn} differs by {d}");
                }
            }
            // Tensor parallelism's collectives run in the backward: every backward whole.
            assert_eq!(schedule.stage().split_backwards(), 0);
        },
    );
}

/// pp 2 x dp 2 with `replicate` on each stage's part: the gradients accumulate locally for
/// all but the last microbatch's backward (`set_requires_gradient_sync` in `on_backward`)
/// and are averaged once per step; GPipe and 1F1B equal one process.
#[test]
fn pp_2_x_dp_2_with_replicate_equals_one_process() {
    run_ranks(
        "composition::pp_2_x_dp_2_with_replicate_equals_one_process",
        4,
        |_pg| {
            for which in [Which::OneFOneB, Which::GPipe] {
                let (mut setup, part) = PpDp::new();
                let options = tch_dist::replicate::Options {
                    process_group: Some(setup.dp.clone()),
                    ..Default::default()
                };
                let state = tch_dist::replicate::apply(&part, options).unwrap();
                let mut opt = sgd(&setup.vs);
                let stage = PipelineStage::with_forward(
                    part,
                    |m: &Chain, x: &Tensor, _train| m.f_call(x),
                    setup.stage_index,
                    2,
                    Device::Cpu,
                    &setup.pp,
                )
                .on_backward(move |last| {
                    state.set_requires_gradient_sync(last);
                    Ok(())
                });
                let mut schedule = ChainSchedule::new(stage, which);
                for step in 0..3 {
                    setup.step_both(step, &mut schedule, &mut opt);
                    let ref_vars = setup.ref_vs.variables();
                    for (fqn, t) in setup.vs.variables() {
                        let d = (&t - &ref_vars[&fqn]).abs().max().double_value(&[]);
                        assert!(d < 1e-5, "{which:?} step {step}: {fqn} differs by {d}");
                    }
                }
                let synced = tch_dist::replicate::state(schedule.module())
                    .unwrap()
                    .stats()
                    .steps;
                assert_eq!(
                    synced, 3,
                    "one synchronised backward per step, not per microbatch"
                );
            }
        },
    );
}

/// An attention block: `x + o(attention(q(x), k(x), v(x)))`, causal, two heads, its
/// attention through `tch_dist::nn` (ring attention inside a `context_parallel` region).
#[derive(Debug, Shardable)]
struct AttnBlock {
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    o: nn::Linear,
}

/// The whole model's attention blocks `blocks.<i>`; a stage's part holds its own.
#[derive(Debug, Shardable)]
struct AttnChain {
    blocks: Vec<Option<AttnBlock>>,
}

impl Module for AttnChain {
    /// `xs` `[batch, seq, WIDTH]`.
    fn forward(&self, xs: &Tensor) -> Tensor {
        let (b, t) = (xs.size()[0], xs.size()[1]);
        let heads = |z: Tensor| z.view([b, t, 2, WIDTH / 2]).transpose(1, 2);
        self.blocks
            .iter()
            .flatten()
            .fold(xs.shallow_clone(), |x, blk| {
                let (q, k, v) = (
                    heads(blk.q.call(&x)),
                    heads(blk.k.call(&x)),
                    heads(blk.v.call(&x)),
                );
                let y =
                    tch_dist::nn::scaled_dot_product_attention(&q, &k, &v, None, 0.0, true, None);
                &x + blk
                    .o
                    .call(&y.transpose(1, 2).contiguous().view([b, t, WIDTH]))
            })
    }
}

fn attn_chain(vs: &nn::VarStore, stages: Range<usize>) -> AttnChain {
    let root = vs.root() / "blocks";
    let linear =
        |i: usize, name: &str| nn::linear(&root / i / name, WIDTH, WIDTH, Default::default());
    AttnChain {
        blocks: (0..2)
            .map(|i| {
                stages.contains(&i).then(|| AttnBlock {
                    q: linear(i, "q"),
                    k: linear(i, "k"),
                    v: linear(i, "v"),
                    o: linear(i, "o"),
                })
            })
            .collect(),
    }
}

/// pp 2 x cp 2 on a mesh (torchtitan's order): 1F1B across the stages, each step's inputs
/// and targets split head-tail along the sequence over the `cp` ranks by `context_parallel`
/// around the schedule's step, so that each stage's attention runs the ring over its cp
/// group; the cp ranks' gradients averaged. Training equals one process on the whole
/// sequences.
#[test]
fn pp_2_x_cp_2_with_context_parallel_equals_one_process() {
    use tch_dist::context_parallel::{context_parallel, CpOptions};
    run_ranks(
        "composition::pp_2_x_cp_2_with_context_parallel_equals_one_process",
        4,
        |_pg| {
            let mesh = init_device_mesh("cpu", &[2, 2], &["pp", "cp"]).unwrap();
            let pp = mesh.get_group("pp").unwrap().clone();
            let cp = mesh.get_group("cp").unwrap().clone();
            let stage_index = mesh.get_local_rank("pp").unwrap();
            tch::manual_seed(0);
            let init_vs = nn::VarStore::new(Device::Cpu);
            let _ = attn_chain(&init_vs, 0..2);
            let mut ref_vs = nn::VarStore::new(Device::Cpu);
            let reference = attn_chain(&ref_vs, 0..2);
            ref_vs.copy(&init_vs).unwrap();
            let mut ref_opt = sgd(&ref_vs);

            let mut vs = nn::VarStore::new(Device::Cpu);
            let part = attn_chain(&vs, stage_index..stage_index + 1);
            vs.copy(&init_vs).unwrap();
            let mut opt = sgd(&vs);
            let stage = PipelineStage::with_forward(
                part,
                |m: &AttnChain, x: &Tensor, _train| m.f_call(x),
                stage_index,
                2,
                Device::Cpu,
                &pp,
            );
            let mut schedule = Schedule1F1B::new(stage, 4, mse).unwrap();
            let (first, last) = (stage_index == 0, stage_index == 1);
            for step in 0..3 {
                tch::manual_seed(300 + step);
                let x = Tensor::randn([8, 12, WIDTH], (Kind::Float, Device::Cpu));
                let y = Tensor::randn([8, 12, WIDTH], (Kind::Float, Device::Cpu));
                ref_opt
                    .backward_step(&mse(&reference.forward(&x), &y))
                    .unwrap();
                let mut losses = Vec::new();
                {
                    let _cp = context_parallel(&cp, &[&x, &y], &[1, 1], &[], CpOptions::default())
                        .unwrap();
                    assert_eq!(x.size(), [8, 6, WIDTH]);
                    schedule
                        .step(first.then_some(&x), last.then_some(&y), &mut losses)
                        .unwrap();
                }
                // The cp ranks hold the same weights and saw other tokens: the mean of their
                // gradients is the whole sequences' (each loss is its tokens' mean).
                for g in vs.trainable_variables().iter().map(Tensor::grad) {
                    cp.all_reduce(&g, tch_dist::ReduceOp::Sum).unwrap();
                    let _ = g.shallow_clone().g_div_scalar_(2.0);
                }
                opt.step().unwrap();
                opt.zero_grad();
                let ref_vars = ref_vs.variables();
                for (fqn, t) in vs.variables() {
                    let d = (&t - &ref_vars[&fqn]).abs().max().double_value(&[]);
                    assert!(d < 1e-5, "step {step}: {fqn} differs by {d}");
                }
            }
        },
    );
}
