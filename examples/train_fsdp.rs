//! Fully sharded data-parallel training (`fully_shard`, PyTorch's FSDP2) of a small
//! transformer on scikit-learn's handwritten digits.
//!
//! Each 8x8 image is a sequence of 8 rows of 8 pixels: a linear patch projection to width
//! 64 plus a learned position embedding, two pre-LayerNorm transformer blocks (4-head
//! self-attention and a GELU MLP), a final LayerNorm, mean pooling and a linear head. Each
//! block is its own `fully_shard` group, then the root (embedding, final norm, head); between
//! steps every rank holds only its half of every parameter, gradient and AdamW state. Each
//! rank trains on its `DistributedSampler` share of every epoch, in batches of its share of
//! the global batch; rank 0 shows a progress bar. At the end every rank evaluates the test
//! set through the sharded model under `no_grad` (forward is a collective: the groups are
//! gathered one by one), and rank 0 prints `test_accuracy=0.xx`.
//!
//! With `--checkpoint-dir DIR --checkpoint-every N` it writes a distributed checkpoint of
//! the model and its AdamW state (`tch_dist::optim::AdamW`, torch.optim's) every N steps
//! into `DIR/step-00000010`, ... (each rank its shards, with a train state `{"step",
//! "epoch", "batch"}`; the last 3 kept) by `checkpoint::async_save`: staged to host memory,
//! written while the next step trains, waited for once that step is done and at the end.
//! Started again with `--resume`, or automatically after a restart (torchrun's or
//! tch-dist-run's, on any host: common/resume.rs), it continues from the newest checkpoint
//! that verifies, at the same step and data position with the same optimizer state.
//! `--max-steps S` stops after S steps in all.
//!
//! With `--activation-checkpointing` each block is checkpointed before it is sharded
//! (`checkpoint_activations`): its forward keeps only its input, and backward runs it again.
//! Rank 0 prints the memory either way: the most a forward left allocated for its backward,
//! and the peak RSS.
//!
//! With `--pp N` the model is also split into N pipeline stages (`tch_dist::pipelining`, on
//! a `pp` x `dp` mesh, torchtitan's order): stage 0 holds the patch and position embedding
//! and the first blocks, the last stage the last blocks, the final norm and the head; each
//! stage's part is fully sharded over its `dp` group and trained by `Schedule1F1B` on 4
//! microbatches per step, gradients reduced once per step (in the last microbatch's
//! backward). Each part keeps the whole model's FQNs (the other stages' layers are `None`),
//! so its checkpoints are the unsplit model's. The test set is run through the stages in
//! turn (each sends its activations to the next).
//!
//! ```text
//! target/release/tch-dist-run --nproc-per-node 2 -- target/release/examples/train_fsdp [--epochs N] [--batch-size N] [--lr LR] \
//!     [--checkpoint-dir DIR --checkpoint-every N [--resume]] [--max-steps S] [--activation-checkpointing] [--pp N]
//! target/release/examples/train_fsdp --verify DIR/step-00000010   # checks every byte, one process
//! ```
//!
//! Every failure ends the program with one line, `error: ...`, and exit status 1 (tch's
//! `backward_step` unwraps the backward pass; this loop uses `f_backward` and hands on
//! fully_shard's error).

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_dist::checkpoint;
use tch_dist::checkpoint::{SaveOptions, State};
use tch_dist::data::{DistributedSampler, SamplerOptions};
use tch_dist::device_mesh::init_device_mesh;
use tch_dist::optim::{self, Optimizer};
use tch_dist::pipelining::{PipelineStage, Schedule1F1B};
use tch_dist::{
    fully_shard, init_process_group, Backend, Call, FsdpOptions, ProcessGroup, ReduceOp, Shardable,
};

#[path = "common/digits.rs"]
mod digits;

#[path = "common/attention_block.rs"]
mod attention_block;
#[path = "common/cli.rs"]
mod cli;
#[path = "common/memory.rs"]
mod memory;
#[path = "common/progress.rs"]
mod progress;
#[path = "common/resume.rs"]
mod resume;
use attention_block::Block;
use memory::{malloc_in_use, rss_mib};
use resume::Position;

/// Tokens per image (its rows), pixels per token, model width, heads, blocks.
const SEQ: i64 = 8;
const PIXELS: i64 = 8;
const DIM: i64 = 64;
const HEADS: i64 = 4;
const BLOCKS: usize = 2;
/// Microbatches per step with `--pp`.
const MICROBATCHES: usize = 4;

/// A block of the shared pre-LayerNorm transformer (common/attention_block.rs), called with
/// one input: its attention is bidirectional (the whole image is seen at once), no mask.
impl Module for Block {
    /// `[batch, seq, dim]` to `[batch, seq, dim]`.
    fn forward(&self, x: &Tensor) -> Tensor {
        Block::forward(self, x, None)
    }
}

/// The model, or one pipeline stage's part of it: the other stages' layers are `None`, so
/// that every part walks the whole model's FQNs (`blocks.1.attn...` on the stage with
/// block 1), as torchtitan deletes them.
#[derive(Debug, Shardable)]
struct Net {
    patch: Option<nn::Linear>,
    pos: Option<nn::Embedding>,
    blocks: Vec<Option<Block>>,
    ln_f: Option<nn::LayerNorm>,
    head: Option<nn::Linear>,
    /// Positions 0..SEQ (not a buffer: nothing to shard or broadcast).
    #[shardable(skip)]
    positions: Tensor,
}

impl Net {
    /// Stage `stage` of `stages` (the whole model for one): the blocks split evenly, the
    /// embeddings on the first stage, the final norm and the head on the last.
    fn new(p: &nn::Path, stage: usize, stages: usize) -> Net {
        let (first, last) = (stage == 0, stage + 1 == stages);
        let mine = (stage * BLOCKS / stages)..((stage + 1) * BLOCKS / stages);
        Net {
            patch: first.then(|| nn::linear(p / "patch", PIXELS, DIM, Default::default())),
            pos: first.then(|| nn::embedding(p / "pos", SEQ, DIM, Default::default())),
            blocks: (0..BLOCKS)
                .map(|i| {
                    mine.contains(&i)
                        .then(|| Block::new(p / "blocks" / i, DIM, HEADS))
                })
                .collect(),
            ln_f: last.then(|| nn::layer_norm(p / "ln_f", vec![DIM], Default::default())),
            head: last.then(|| nn::linear(p / "head", DIM, 10, Default::default())),
            positions: Tensor::arange(SEQ, (Kind::Int64, p.device())),
        }
    }
}

impl Module for Net {
    /// Images `[batch, 64]` (or the previous stage's `[batch, seq, dim]`) to logits
    /// `[batch, 10]` (or this stage's activations). Every child runs through `.call`, so
    /// that fully_shard's hooks gather its group's parameters.
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut h = match (&self.patch, &self.pos) {
            (Some(patch), Some(pos)) => {
                patch.call(&xs.view([-1, SEQ, PIXELS])) + pos.call(&self.positions)
            }
            _ => xs.shallow_clone(),
        };
        for b in self.blocks.iter().flatten() {
            h = b.call(&h);
        }
        match (&self.ln_f, &self.head) {
            (Some(ln_f), Some(head)) => head.call(&ln_f.call(&h).mean_dim(1, false, Kind::Float)),
            _ => h,
        }
    }
}

/// How the model trains: whole on every rank (fully_shard over the world), or as one
/// pipeline stage of a `pp` x `dp` mesh (fully_shard over the stage's `dp` group).
enum Trainer {
    Whole(Net),
    Pipelined {
        schedule: Schedule1F1B<Net>,
        pp: ProcessGroup,
    },
}

impl Trainer {
    fn model(&self) -> &Net {
        match self {
            Trainer::Whole(m) => m,
            Trainer::Pipelined { schedule, .. } => schedule.stage().module(),
        }
    }

    /// One step on this rank's batch: the loss where this rank computes one (every rank
    /// of the whole model, the last stage of a pipeline: the mean over its microbatches).
    /// `kept_max`: the most a forward of the whole model left allocated for its backward.
    fn step(
        &mut self,
        opt: &mut Optimizer,
        inputs: &Tensor,
        targets: &Tensor,
        kept_max: &mut f64,
    ) -> Result<Option<f64>, Box<dyn Error>> {
        match self {
            Trainer::Whole(model) => {
                let before = malloc_in_use();
                let loss = model.f_call(inputs)?.cross_entropy_for_logits(targets);
                *kept_max = kept_max.max(malloc_in_use() - before);
                backward_step(model, opt, &loss)?;
                Ok(Some(loss.double_value(&[])))
            }
            Trainer::Pipelined { schedule, .. } => {
                let stage = schedule.stage();
                let (first, last) = (
                    stage.stage_index() == 0,
                    stage.stage_index() + 1 == stage.num_stages(),
                );
                let mut losses = Vec::new();
                opt.zero_grad();
                schedule.step(
                    first.then_some(inputs),
                    last.then_some(targets),
                    &mut losses,
                )?;
                opt.step()?;
                let n = losses.len() as f64;
                Ok((!losses.is_empty())
                    .then(|| losses.iter().map(|l| l.double_value(&[])).sum::<f64>() / n))
            }
        }
    }

    /// The logits of `x` on the last stage (`None` elsewhere), under `no_grad`: every rank
    /// runs its part (a collective over its fully_shard group); a pipeline's stages hand
    /// their activations on in turn.
    fn logits(&self, x: &Tensor) -> Result<Option<Tensor>, Box<dyn Error>> {
        let _guard = tch::no_grad_guard();
        match self {
            Trainer::Whole(model) => Ok(Some(model.f_call(x)?)),
            Trainer::Pipelined { schedule, pp } => {
                let stage = schedule.stage();
                let (s, n) = (stage.stage_index(), stage.num_stages());
                let input = if s == 0 {
                    x.shallow_clone()
                } else {
                    let h = Tensor::empty([x.size()[0], SEQ, DIM], (Kind::Float, Device::Cpu));
                    pp.recv_async(&h, s - 1, 0)?.wait()?;
                    h
                };
                let out = stage.module().f_call(&input)?;
                if s + 1 == n {
                    return Ok(Some(out));
                }
                pp.send_async(&out, s + 1, 0)?.wait()?;
                Ok(None)
            }
        }
    }
}

struct Args {
    epochs: usize,
    batch: i64,
    lr: f64,
    data: PathBuf,
    checkpoint_dir: Option<PathBuf>,
    verify: Option<PathBuf>,
    checkpoint_every: u64,
    /// Continue from the newest checkpoint in `checkpoint_dir` (also after a restart).
    resume: bool,
    /// Stop after this many steps in all.
    max_steps: Option<u64>,
    /// `checkpoint_activations` on each block before fully_shard (torchtitan's order).
    activation_checkpointing: bool,
    /// Pipeline stages (1: no pipeline).
    pp: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        epochs: 15,
        batch: 64,
        lr: 3e-3,
        data: digits::default_path(),
        checkpoint_dir: None,
        verify: None,
        checkpoint_every: 0,
        resume: false,
        max_steps: None,
        activation_checkpointing: false,
        pp: 1,
    };
    let mut flags = cli::Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--epochs" => a.epochs = flags.parsed(&flag)?,
            "--batch-size" => a.batch = flags.parsed(&flag)?,
            "--lr" => a.lr = flags.parsed(&flag)?,
            "--data" => a.data = flags.value(&flag)?.into(),
            "--checkpoint-dir" => a.checkpoint_dir = Some(flags.value(&flag)?.into()),
            "--verify" => a.verify = Some(flags.value(&flag)?.into()),
            "--checkpoint-every" => a.checkpoint_every = flags.parsed(&flag)?,
            "--resume" => a.resume = true,
            "--max-steps" => a.max_steps = Some(flags.parsed(&flag)?),
            "--activation-checkpointing" => a.activation_checkpointing = true,
            "--pp" => a.pp = flags.parsed(&flag)?,
            other => return Err(cli::unknown(other)),
        }
    }
    if a.checkpoint_every > 0 && a.checkpoint_dir.is_none() {
        return Err("--checkpoint-every needs --checkpoint-dir".into());
    }
    if a.resume && a.checkpoint_dir.is_none() {
        return Err("--resume needs --checkpoint-dir".into());
    }
    if a.batch <= 0 {
        return Err("--batch-size must be positive".into());
    }
    if !(1..=BLOCKS).contains(&a.pp) {
        return Err(format!(
            "--pp must be 1 to {BLOCKS} (the model has {BLOCKS} blocks)"
        ));
    }
    Ok(a)
}

fn main() {
    train_main(|_step| {});
}

/// The restart count and the round, for tests/resume/train_fsdp_crash.rs (a test build of
/// this example that crashes on the first start only).
pub use resume::{rdzv_round, restart_count};

/// The program, calling `after_step(step)` after each optimizer step, before any checkpoint
/// of it (tests/resume/train_fsdp_crash.rs, a test build of this example, crashes a rank
/// there).
pub fn train_main(after_step: impl FnMut(u64)) {
    cli::main_with(|| run(after_step));
}

/// `opt.backward_step(&loss)` with failures as values: a collective that failed during
/// backward (a dead peer) is fully_shard's typed error, naming the module.
fn backward_step<M: tch_dist::Shardable>(
    model: &M,
    opt: &mut Optimizer,
    loss: &Tensor,
) -> Result<(), Box<dyn Error>> {
    opt.zero_grad();
    if let Err(text) = loss.f_backward() {
        let state = tch_dist::fully_shard::state(model);
        return Err(match state.and_then(|s| s.take_backward_error()) {
            Some(typed) => typed.into(),
            None => text.into(),
        });
    }
    opt.step()?;
    Ok(())
}

fn run(mut after_step: impl FnMut(u64)) -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    // `--verify DIR` checks a checkpoint and ends: one process, no group.
    if let Some(dir) = &args.verify {
        return Ok(cli::verify_checkpoint(dir)?);
    }
    cli::one_thread_per_rank();
    let pg = init_process_group(Backend::Gloo)?;
    let (rank, world) = (pg.rank() as i64, pg.world_size() as i64);

    let (x_train, y_train, x_test, y_test) = digits::load_split(&args.data)?;
    let n_train = x_train.size()[0];

    // With --pp: a pp x dp mesh (PyTorch's order of the dims, as torchtitan's); this rank
    // holds stage `stage` of the model, sharded over its dp group.
    let pp = args.pp;
    if !(world as usize).is_multiple_of(pp) {
        return Err(format!("--pp {pp} does not divide the {world} ranks").into());
    }
    let (stage, pp_group, dp, dp_rank) = if pp > 1 {
        let mesh = init_device_mesh("cpu", &[pp, world as usize / pp], &["pp", "dp"])?;
        (
            mesh.get_local_rank("pp")?,
            Some(mesh.get_group("pp")?.clone()),
            mesh.get_group("dp")?.clone(),
            mesh.get_local_rank("dp")?,
        )
    } else {
        (0, None, pg.clone(), rank as usize)
    };
    let dp_size = dp.world_size() as i64;
    let last_stage = stage + 1 == pp;

    let count = |vs: &nn::VarStore| -> i64 {
        vs.trainable_variables()
            .iter()
            .map(|t| t.numel() as i64)
            .sum()
    };
    let full_params = {
        let whole = nn::VarStore::new(Device::Cpu);
        let _ = Net::new(&whole.root(), 0, 1);
        count(&whole)
    };
    tch::manual_seed(42);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Net::new(&vs.root(), stage, pp);
    // The part and its VarStore name the same tensors: the whole model's FQNs.
    tch_dist::check_against_var_store(&model, &vs)?;
    let groups = model.blocks.iter().flatten().count() + 1;
    // Bottom-up: each block its own group, then the root (patch, pos, ln_f, head: those
    // this stage holds); each block checkpointed first with --activation-checkpointing (its
    // activations recomputed in backward instead of kept).
    let over_dp = || FsdpOptions {
        process_group: Some(dp.clone()),
        ..Default::default()
    };
    for b in model.blocks.iter().flatten() {
        if args.activation_checkpointing {
            tch_dist::checkpoint_activations(b, tch_dist::CheckpointOptions::default())?;
        }
        fully_shard(b, over_dp())?;
    }
    let root = fully_shard(&model, over_dp())?;
    let local_params = count(&vs);
    // Built after fully_shard: the optimizer sees (and keeps state for) the shards only;
    // tch-dist's AdamW (torch.optim.AdamW's settings), whose state a checkpoint saves.
    let mut opt = optim::AdamW::default().build(&vs, args.lr)?;
    let mut trainer = match pp_group {
        Some(pp_group) => {
            let part = PipelineStage::with_forward(
                model,
                |m: &Net, x: &Tensor, _train| m.f_call(x),
                stage,
                pp,
                Device::Cpu,
                &pp_group,
            )
            .on_backward(move |last| {
                // PyTorch's `backward_maybe_with_nosync`: the microbatches' gradients
                // accumulate unsharded, reduced over dp in the last one's backward.
                root.set_requires_gradient_sync(last);
                root.set_reshard_after_backward(last);
                Ok(())
            });
            let schedule =
                Schedule1F1B::new(part, MICROBATCHES, |out, y| out.cross_entropy_for_logits(y))?;
            Trainer::Pipelined {
                schedule,
                pp: pp_group,
            }
        }
        None => Trainer::Whole(model),
    };

    // With --resume, or after a restart (every rank alike: common/resume.rs), from the
    // newest checkpoint that verifies: each rank's shards of the model and of AdamW's state,
    // and where the loop was.
    let mut start_at = Position::default();
    if let Some(dir) = &args.checkpoint_dir
        && resume::should_resume(&pg, args.resume)?
    {
        let mut state = State::new(trainer.model()).with_optimizer(&mut opt);
        if let Some(at) = resume::load_newest(dir, &mut state, &pg)? {
            start_at = at;
        }
    }

    let mut sampler = DistributedSampler::new(
        n_train as usize,
        SamplerOptions {
            num_replicas: Some(dp_size as usize),
            rank: Some(dp_rank),
            seed: 1000,
            ..Default::default()
        },
    )?;
    if sampler.is_empty() {
        return Err("no training sample for this rank; lower the world size".into());
    }
    let mut per = (args.batch + dp_size - 1) / dp_size;
    let steps_per_epoch = if pp > 1 {
        // Whole batches of equal microbatches only (a pipeline step splits its batch).
        let m = MICROBATCHES as i64;
        per = (per + m - 1) / m * m;
        sampler.len() as i64 / per
    } else {
        (sampler.len() as i64 + per - 1) / per
    };
    if steps_per_epoch == 0 {
        return Err(format!(
            "--batch-size {} leaves no whole batch per epoch",
            args.batch
        )
        .into());
    }
    let total =
        (steps_per_epoch as u64 * args.epochs as u64).min(args.max_steps.unwrap_or(u64::MAX));
    let bar = (rank == 0).then(|| progress::progress_bar(total, String::new()));
    if let Some(b) = &bar {
        b.set_position(start_at.step);
    }
    if rank == 0 {
        println!(
            "training on {world} ranks: {n_train} samples, {steps_per_epoch} steps per epoch, {} \
             epochs; {full_params} parameters, {groups} fully_shard groups and {local_params} \
             parameters on this rank",
            args.epochs,
        );
        if pp > 1 {
            println!(
                "pipeline: {pp} stages x {dp_size} data-parallel ranks, Schedule1F1B, \
                 {MICROBATCHES} microbatches per step"
            );
        }
    }
    let start = Instant::now();
    // The most any forward left allocated for its backward (the activations kept).
    let mut kept_max = 0f64;
    let mut seen = 0i64;
    let mut global = start_at.step;
    // The checkpoint being written in the background, if any.
    let mut pending: Option<checkpoint::AsyncSave> = None;
    'epochs: for epoch in start_at.epoch..args.epochs as u64 {
        sampler.set_epoch(epoch);
        let order = Tensor::from_slice(&sampler.indices()?);
        for step in start_at.first_batch(epoch)..steps_per_epoch {
            if global >= total {
                break 'epochs;
            }
            tch_dist::set_step(global); // for the step check, as in train_ddp
            let lo = step * per;
            let mine = order.narrow(0, lo, per.min(sampler.len() as i64 - lo));
            let len = mine.size()[0] * dp_size;
            let (inputs, targets) = (
                x_train.index_select(0, &mine),
                y_train.index_select(0, &mine),
            );
            let loss = trainer.step(&mut opt, &inputs, &targets, &mut kept_max)?;
            // The checkpoint of the step before was written while this step trained.
            if let Some(p) = pending.take() {
                p.wait()?;
            }
            global += 1;
            seen += len;
            after_step(global);
            if let (Some(dir), true) = (
                &args.checkpoint_dir,
                args.checkpoint_every > 0 && global.is_multiple_of(args.checkpoint_every),
            ) {
                // Each rank's shards, staged to host memory now and written while the next
                // step trains.
                let opts = SaveOptions { keep_last: Some(3) };
                let dir = dir.join(format!("step-{global:08}"));
                // Over every rank: a pipeline's stages each save their part, with their
                // AdamW state and where the next step starts.
                let next = Position::after(global, epoch, step as u64, steps_per_epoch as u64);
                let state = State::new(trainer.model())
                    .with_optimizer(&mut opt)
                    .with_train_state(next.to_json());
                pending = Some(checkpoint::async_save(dir, &state, &pg, &opts)?);
            }
            if let Some(b) = &bar {
                b.set_prefix(format!("{}/{}", epoch + 1, args.epochs));
                let rate = seen as f64 / start.elapsed().as_secs_f64();
                b.set_message(match loss {
                    Some(loss) => format!("loss {loss:.4} {rate:.0} samples/s"),
                    // A pipeline's first stage has no loss.
                    None => format!("{rate:.0} samples/s"),
                });
                b.inc(1);
            }
        }
    }
    // The last checkpoint, complete before the program ends.
    if let Some(p) = pending.take() {
        p.wait()?;
    }
    if let Some(b) = bar {
        // Dropped here: drawn as lines, its last state is written now.
        b.finish();
    }
    // Every rank runs the sharded model's forward (each group is gathered, used and freed
    // again); no_grad: no backward follows.
    let acc = trainer
        .logits(&x_test)?
        .map(|l| l.accuracy_for_logits(&y_test).double_value(&[]));
    // A pipeline's accuracy is its last stage's: its first dp rank's figure, summed to all.
    let acc = match (pp, acc) {
        (1, Some(acc)) => acc,
        _ => {
            let mine = if last_stage && dp_rank == 0 {
                acc.unwrap_or(0.0)
            } else {
                0.0
            };
            let t = Tensor::from_slice(&[mine]);
            pg.all_reduce(&t, ReduceOp::Sum)?;
            t.double_value(&[0])
        }
    };
    if rank == 0 {
        println!(
            "trained {} epochs on {} ranks in {:.1}s",
            args.epochs,
            world,
            start.elapsed().as_secs_f64()
        );
        println!("test_accuracy={acc:.2}");
        let ac = if args.activation_checkpointing {
            "on"
        } else {
            "off"
        };
        if pp > 1 {
            // The schedule runs forwards and backwards in turn: no one forward's figure.
            println!(
                "memory: activation checkpointing {ac}, peak RSS {:.0} MiB",
                rss_mib().0
            );
        } else {
            println!(
                "memory: activation checkpointing {ac}, forward kept at most {:.2} MB for \
                 backward, peak RSS {:.0} MiB",
                kept_max / 1e6,
                rss_mib().0
            );
        }
    }
    pg.barrier()?;
    Ok(())
}
