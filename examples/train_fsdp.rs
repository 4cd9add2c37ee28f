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
//! the model every N steps into `DIR/step-00000010`, ... (each rank its shards, with a train
//! state `{"step", "epoch"}`; the last 3 kept) by `checkpoint::async_save_with`: staged to
//! host memory, written while the next step trains, waited for once that step is done and
//! at the end.
//!
//! With `--activation-checkpointing` each block is checkpointed before it is sharded
//! (`checkpoint_activations`): its forward keeps only its input, and backward runs it again.
//! Rank 0 prints the memory either way: the most a forward left allocated for its backward,
//! and the peak RSS.
//!
//! ```text
//! target/release/tch-dist-run --nproc-per-node 2 -- target/release/examples/train_fsdp [--epochs N] [--batch-size N] [--lr LR] \
//!     [--checkpoint-dir DIR --checkpoint-every N] [--activation-checkpointing]
//! target/release/examples/train_fsdp --verify DIR/step-00000010   # checks every byte, one process
//! ```
//!
//! Every failure ends the program with one line, `error: ...`, and exit status 1 (tch's
//! `backward_step` unwraps the backward pass; this loop uses `f_backward` and hands on
//! fully_shard's error).

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::checkpoint;
use tch_dist::data::{DistributedSampler, SamplerOptions};
use tch_dist::{fully_shard, init_process_group, Backend, Call, FsdpOptions, Shardable};

#[path = "common/digits.rs"]
mod digits;
use digits::load_digits;

#[path = "common/attention_block.rs"]
mod attention_block;
#[path = "common/cli.rs"]
mod cli;
use attention_block::Block;

/// Tokens per image (its rows), pixels per token, model width, heads, blocks.
const SEQ: i64 = 8;
const PIXELS: i64 = 8;
const DIM: i64 = 64;
const HEADS: i64 = 4;
const BLOCKS: usize = 2;

/// A block of the shared pre-LayerNorm transformer (common/attention_block.rs), called with
/// one input: its attention is bidirectional (the whole image is seen at once), no mask.
impl Module for Block {
    /// `[batch, seq, dim]` to `[batch, seq, dim]`.
    fn forward(&self, x: &Tensor) -> Tensor {
        Block::forward(self, x, None)
    }
}

#[derive(Debug, Shardable)]
struct Net {
    patch: nn::Linear,
    pos: nn::Embedding,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
    /// Positions 0..SEQ (not a buffer: nothing to shard or broadcast).
    #[shardable(skip)]
    positions: Tensor,
}

impl Net {
    fn new(p: &nn::Path) -> Net {
        Net {
            patch: nn::linear(p / "patch", PIXELS, DIM, Default::default()),
            pos: nn::embedding(p / "pos", SEQ, DIM, Default::default()),
            blocks: (0..BLOCKS)
                .map(|i| Block::new(p / "blocks" / i, DIM, HEADS))
                .collect(),
            ln_f: nn::layer_norm(p / "ln_f", vec![DIM], Default::default()),
            head: nn::linear(p / "head", DIM, 10, Default::default()),
            positions: Tensor::arange(SEQ, (Kind::Int64, p.device())),
        }
    }
}

impl Module for Net {
    /// Images `[batch, 64]` to logits `[batch, 10]`. Every child runs through `.call`, so
    /// that fully_shard's hooks gather its group's parameters.
    fn forward(&self, xs: &Tensor) -> Tensor {
        let rows = xs.view([-1, SEQ, PIXELS]);
        let mut h = self.patch.call(&rows) + self.pos.call(&self.positions);
        for b in &self.blocks {
            h = b.call(&h);
        }
        let pooled = self.ln_f.call(&h).mean_dim(1, false, Kind::Float);
        self.head.call(&pooled)
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
    /// `checkpoint_activations` on each block before fully_shard (torchtitan's order).
    activation_checkpointing: bool,
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
        activation_checkpointing: false,
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
            "--activation-checkpointing" => a.activation_checkpointing = true,
            other => return Err(cli::unknown(other)),
        }
    }
    if a.checkpoint_every > 0 && a.checkpoint_dir.is_none() {
        return Err("--checkpoint-every needs --checkpoint-dir".into());
    }
    if a.batch <= 0 {
        return Err("--batch-size must be positive".into());
    }
    Ok(a)
}

fn main() {
    cli::main_with(run);
}

/// Bytes malloc has handed out and not had back (`mallinfo2`): on CPU, tensors' memory.
fn malloc_in_use() -> f64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2(3) only reads the allocator's counters.
        let m = unsafe { libc::mallinfo2() };
        (m.uordblks + m.hblkhd) as f64
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0.0
    }
}

/// The process's peak resident set size (VmHWM), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// `opt.backward_step(&loss)` with failures as values: a collective that failed during
/// backward (a dead peer) is fully_shard's typed error, naming the module.
fn backward_step<M: tch_dist::Shardable>(
    model: &M,
    opt: &mut nn::Optimizer,
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
    opt.step();
    Ok(())
}

fn run() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    // `--verify DIR` checks a checkpoint and ends: one process, no group.
    if let Some(dir) = &args.verify {
        return Ok(cli::verify_checkpoint(dir)?);
    }
    // One intra-op thread per rank: the benchmarks and CI run both ranks on one 2-core
    // machine. A benchmark setting, not advice: on your machine give each rank its share of
    // the cores (or leave libtorch's default).
    tch::set_num_threads(1);
    let pg = init_process_group(Backend::Gloo)?;
    let (rank, world) = (pg.rank() as i64, pg.world_size() as i64);

    let (x, y) = load_digits(&args.data)?;
    let (x_train, y_train, x_test, y_test) = digits::train_test_split(&x, &y);
    let n_train = x_train.size()[0];

    tch::manual_seed(42);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Net::new(&vs.root());
    tch_dist::check_against_var_store(&model, &vs)?;
    let full_params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    // Bottom-up: each block its own group, then the root (patch, pos, ln_f, head); each
    // block checkpointed first with --activation-checkpointing (its activations recomputed
    // in backward instead of kept).
    for b in &model.blocks {
        if args.activation_checkpointing {
            tch_dist::checkpoint_activations(b, tch_dist::CheckpointOptions::default())?;
        }
        fully_shard(b, FsdpOptions::default())?;
    }
    fully_shard(&model, FsdpOptions::default())?;
    let local_params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    // Built after fully_shard: the optimizer sees (and keeps state for) the shards only.
    let mut opt = nn::AdamW::default().build(&vs, args.lr)?;

    let mut sampler = DistributedSampler::new(
        n_train as usize,
        SamplerOptions {
            seed: 1000,
            ..Default::default()
        },
    )?;
    if sampler.is_empty() {
        return Err("no training sample for this rank; lower the world size".into());
    }
    let per = (args.batch + world - 1) / world;
    let steps_per_epoch = (sampler.len() as i64 + per - 1) / per;
    let total = steps_per_epoch as u64 * args.epochs as u64;
    let bar = (rank == 0).then(|| {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} epoch {prefix} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    if rank == 0 {
        println!(
            "training on {world} ranks: {n_train} samples, {steps_per_epoch} steps per epoch, {} \
             epochs; {full_params} parameters in {} fully_shard groups, {local_params} on this \
             rank",
            args.epochs,
            BLOCKS + 1
        );
    }
    let start = Instant::now();
    // The most any forward left allocated for its backward (the activations kept).
    let mut kept_max = 0f64;
    let mut seen = 0i64;
    let mut global = 0u64;
    // The checkpoint being written in the background, if any.
    let mut pending: Option<checkpoint::AsyncSave> = None;
    for epoch in 0..args.epochs {
        sampler.set_epoch(epoch as u64);
        let order = Tensor::from_slice(&sampler.indices()?);
        for step in 0..steps_per_epoch {
            let lo = step * per;
            let mine = order.narrow(0, lo, per.min(sampler.len() as i64 - lo));
            let len = mine.size()[0] * world;
            let (inputs, targets) = (
                x_train.index_select(0, &mine),
                y_train.index_select(0, &mine),
            );
            let before = malloc_in_use();
            let loss = model.f_call(&inputs)?.cross_entropy_for_logits(&targets);
            kept_max = kept_max.max(malloc_in_use() - before);
            backward_step(&model, &mut opt, &loss)?;
            // The checkpoint of the step before was written while this step trained.
            if let Some(p) = pending.take() {
                p.wait()?;
            }
            global += 1;
            seen += len;
            if let (Some(dir), true) = (
                &args.checkpoint_dir,
                args.checkpoint_every > 0 && global.is_multiple_of(args.checkpoint_every),
            ) {
                // Each rank's shards, staged to host memory now and written while the next
                // step trains.
                let opts = checkpoint::SaveOptions {
                    train_state: Some(serde_json::json!({ "step": global, "epoch": epoch })),
                    keep_last: Some(3),
                };
                let dir = dir.join(format!("step-{global:08}"));
                pending = Some(checkpoint::async_save_with(dir, &model, &pg, &opts)?);
            }
            if let Some(b) = &bar {
                b.set_prefix(format!("{}/{}", epoch + 1, args.epochs));
                b.set_message(format!(
                    "loss {:.4} {:.0} samples/s",
                    loss.double_value(&[]),
                    seen as f64 / start.elapsed().as_secs_f64()
                ));
                b.inc(1);
            }
        }
    }
    // The last checkpoint, complete before the program ends.
    if let Some(p) = pending.take() {
        p.wait()?;
    }
    if let Some(b) = &bar {
        b.finish();
    }
    // Every rank runs the sharded model's forward (each group is gathered, used and freed
    // again); no_grad: no backward follows.
    let logits = tch::no_grad(|| model.f_call(&x_test))?;
    let acc = logits.accuracy_for_logits(&y_test).double_value(&[]);
    if rank == 0 {
        println!(
            "trained {} epochs on {} ranks in {:.1}s",
            args.epochs,
            world,
            start.elapsed().as_secs_f64()
        );
        println!("test_accuracy={acc:.2}");
        println!(
            "memory: activation checkpointing {}, forward kept at most {:.2} MB for backward, \
             peak RSS {:.0} MiB",
            if args.activation_checkpointing {
                "on"
            } else {
                "off"
            },
            kept_max / 1e6,
            peak_rss_mib()
        );
    }
    pg.barrier()?;
    Ok(())
}
