//! The main job: data-parallel training of a digit classifier with `replicate`.
//!
//! Trains an MLP on scikit-learn's handwritten digits (8x8 images, 1797 samples, shipped in
//! the `.venv`'s scikit-learn), each rank on its `DistributedSampler` share of every epoch, in
//! batches of its share of the global batch; rank 0 shows a progress
//! bar, prints `test_accuracy=0.xx`, and saves a safetensors checkpoint under PyTorch's
//! parameter names (`fc1.weight`, ...). `--resume` continues from it, once it has checked
//! that the checkpoint has exactly the model's keys, shapes and dtypes.
//!
//! With `--checkpoint-dir DIR --checkpoint-every N` it writes a distributed checkpoint
//! (`tch_dist::checkpoint`, loadable by PyTorch) every N steps into `DIR/step-00000010`, ...
//! (`checkpoint::async_save` of a `State` with the optimizer: staged to host memory, written while the next
//! step trains, waited for once that step is done and at the end),
//! with the SGD optimizer's momentum buffers and a train state (step, epoch, position in the
//! epoch), keeping the last `--keep-last K` (3). Started again with `--resume`, or
//! automatically after a restart (torchrun's `TORCHELASTIC_RESTART_COUNT` above 0 on any
//! rank, or tch-dist-run's `TCH_DIST_RDZV_ROUND`: common/resume.rs), it continues from the
//! newest checkpoint that verifies
//! (`checkpoint::latest_valid`: a damaged newer one is skipped, and said so): the same step,
//! the same data order, the same optimizer state, so that a killed and restarted job ends
//! where an uninterrupted one does. `--max-steps S` stops after S steps in all.
//!
//! ```text
//! target/release/tch-dist-run --nproc-per-node 2 --max-restarts 1 -- target/release/examples/train_ddp \
//!     [--epochs N] [--checkpoint-dir DIR --checkpoint-every N] [--resume]
//! target/release/examples/train_ddp --verify DIR/step-00000100   # checks every byte, one process
//! ```
//!
//! Every failure ends the program with one line, `error: ...`, and exit status 1: a peer
//! that dies mid-training is `error: rank 0: all_reduce failed: rank 1 closed the
//! connection`, not a panic (tch's `backward_step` unwraps the backward pass; this loop
//! uses `f_backward` and hands on the reducer's typed error).

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use tch::nn::{self, Module};
use tch::{Device, Tensor};
use tch_dist::checkpoint::State;
use tch_dist::checkpoint::{self as dcp, SaveOptions};
use tch_dist::data::{DistributedSampler, SamplerOptions};
use tch_dist::optim::{self, Optimizer};
use tch_dist::{init_process_group, replicate, Backend, Call, Shardable};

#[path = "common/checkpoint.rs"]
mod checkpoint;
#[path = "common/digits.rs"]
mod digits;

#[path = "common/cli.rs"]
mod cli;
#[path = "common/resume.rs"]
mod resume;
use resume::Position;

#[derive(Debug, Shardable)]
struct Net {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Net {
    fn new(vs: &nn::Path) -> Net {
        Net {
            fc1: nn::linear(vs / "fc1", 64, 128, Default::default()),
            fc2: nn::linear(vs / "fc2", 128, 10, Default::default()),
        }
    }
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.fc2.call(&self.fc1.call(xs).relu())
    }
}

struct Args {
    epochs: usize,
    batch: i64,
    lr: f64,
    resume: bool,
    checkpoint: PathBuf,
    data: PathBuf,
    checkpoint_dir: Option<PathBuf>,
    verify: Option<PathBuf>,
    checkpoint_every: u64,
    keep_last: usize,
    max_steps: Option<u64>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        epochs: 20,
        batch: 64,
        lr: 0.05,
        resume: false,
        // Relative to the working directory (the repository's root under `make demo`).
        checkpoint: PathBuf::from("data/digits_ddp.safetensors"),
        data: digits::default_path(),
        checkpoint_dir: None,
        verify: None,
        checkpoint_every: 0,
        keep_last: 3,
        max_steps: None,
    };
    let mut flags = cli::Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--epochs" => a.epochs = flags.parsed(&flag)?,
            "--batch-size" => a.batch = flags.parsed(&flag)?,
            "--lr" => a.lr = flags.parsed(&flag)?,
            "--resume" => a.resume = true,
            "--checkpoint" => a.checkpoint = flags.value(&flag)?.into(),
            "--data" => a.data = flags.value(&flag)?.into(),
            "--checkpoint-dir" => a.checkpoint_dir = Some(flags.value(&flag)?.into()),
            "--verify" => a.verify = Some(flags.value(&flag)?.into()),
            "--checkpoint-every" => a.checkpoint_every = flags.parsed(&flag)?,
            "--keep-last" => a.keep_last = flags.parsed(&flag)?,
            "--max-steps" => a.max_steps = Some(flags.parsed(&flag)?),
            other => return Err(cli::unknown(other)),
        }
    }
    if a.checkpoint_every > 0 && a.checkpoint_dir.is_none() {
        return Err("--checkpoint-every needs --checkpoint-dir".into());
    }
    Ok(a)
}

fn main() {
    train_main(|_step| {});
}

/// The program, calling `after_step(step)` after each optimizer step, before any checkpoint
/// of it (tests/resume/train_ddp_crash.rs, a test build of this example, crashes a rank
/// there).
pub fn train_main(after_step: impl FnMut(u64)) {
    cli::main_with(|| run(after_step));
}

/// `opt.backward_step(&loss)` with failures as values: a collective that failed during
/// backward (a dead peer) is the reducer's typed error, which it keeps for the next forward.
fn backward_step(model: &Net, opt: &mut Optimizer, loss: &Tensor) -> Result<(), Box<dyn Error>> {
    opt.zero_grad();
    if let Err(e) = loss.f_backward() {
        replicate::prepare_forward(model)?;
        return Err(e.into());
    }
    opt.step()?;
    Ok(())
}

/// The restart count and the round, for tests/resume/train_ddp_crash.rs (a test build of
/// this example that crashes on the first start only).
pub use resume::{rdzv_round, restart_count};

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

    tch::manual_seed(42);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Net::new(&vs.root());
    let mut opt = optim::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, args.lr)?;
    let mut start_at = Position::default();
    match &args.checkpoint_dir {
        // A restart under --max-restarts resumes by itself (every rank alike: see
        // common/resume.rs); a fresh start only when asked.
        Some(dir) if resume::should_resume(&pg, args.resume)? => {
            // Every rank sees the same folder: nothing writes there while the ranks start.
            // A damaged newest checkpoint (a changed byte, a missing file) is skipped for the
            // newest one that verifies on every rank.
            let mut state = State::new(&model).with_optimizer(&mut opt);
            if let Some(at) = resume::load_newest(dir, &mut state, &pg)? {
                start_at = at;
            }
        }
        None if args.resume => checkpoint::load_exact(&vs, &args.checkpoint)?,
        _ => {}
    }
    tch_dist::check_against_var_store(&model, &vs)?;
    replicate::apply(&model, replicate::Options::default())?;

    // Each rank reads its own share of every epoch's shuffled rows (PyTorch's
    // DistributedSampler: the same rows a PyTorch rank with the same seed would read), in
    // batches of its share of the global batch.
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
    let total =
        (steps_per_epoch as u64 * args.epochs as u64).min(args.max_steps.unwrap_or(u64::MAX));
    let bar = (rank == 0).then(|| {
        let b = indicatif::ProgressBar::new(total);
        b.set_position(start_at.step);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} epoch {prefix} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    if rank == 0 {
        println!(
            "training on {world} ranks: {n_train} samples, {steps_per_epoch} steps per epoch, {} \
             epochs",
            args.epochs
        );
    }
    let start = Instant::now();
    let mut seen = 0i64;
    let mut global = start_at.step;
    // The checkpoint being written in the background, if any.
    let mut pending: Option<dcp::AsyncSave> = None;
    'epochs: for epoch in start_at.epoch..args.epochs as u64 {
        sampler.set_epoch(epoch);
        let order = Tensor::from_slice(&sampler.indices()?);
        for step in start_at.first_batch(epoch)..steps_per_epoch {
            if global >= total {
                break 'epochs;
            }
            // The loop's step number, the same on every rank: a rank that skips or repeats a
            // step fails every rank at its next pass, naming both steps (the step check).
            tch_dist::set_step(global);
            let lo = step * per;
            let mine = order.narrow(0, lo, per.min(sampler.len() as i64 - lo));
            let len = mine.size()[0] * world;
            let loss = model
                .f_call(&x_train.index_select(0, &mine))?
                .cross_entropy_for_logits(&y_train.index_select(0, &mine));
            backward_step(&model, &mut opt, &loss)?;
            // The checkpoint of the step before was written while this step trained; it
            // is complete before anything else happens, so that a crash from here on finds
            // it (a killed job resumes from the last checkpoint before the step it died at).
            if let Some(p) = pending.take() {
                p.wait()?;
            }
            global += 1;
            seen += len;
            after_step(global);
            if let (Some(dir), true) = (
                &args.checkpoint_dir,
                args.checkpoint_every > 0 && global % args.checkpoint_every == 0,
            ) {
                let next = Position::after(global, epoch, step as u64, steps_per_epoch as u64);
                let opts = SaveOptions {
                    keep_last: Some(args.keep_last),
                };
                let state = State::new(&model)
                    .with_optimizer(&mut opt)
                    .with_train_state(next.to_json());
                // Staged to host memory now, written while the next step trains.
                let dir = dir.join(format!("step-{global:08}"));
                pending = Some(dcp::async_save(dir, &state, &pg, &opts)?);
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
    if rank == 0 {
        let acc =
            tch::no_grad(|| model.forward(&x_test).accuracy_for_logits(&y_test)).double_value(&[]);
        println!(
            "trained to step {global} ({} epochs at most) on {} ranks in {:.1}s",
            args.epochs,
            world,
            start.elapsed().as_secs_f64()
        );
        println!("test_accuracy={acc:.2}");
        if let Some(dir) = args.checkpoint.parent() {
            std::fs::create_dir_all(dir)?;
        }
        vs.save(&args.checkpoint)?;
        println!("checkpoint: {}", args.checkpoint.display());
    }
    pg.barrier()?;
    Ok(())
}
