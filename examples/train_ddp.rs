//! The main job: data-parallel training of a digit classifier with `replicate`.
//!
//! Trains an MLP on scikit-learn's handwritten digits (8x8 images, 1797 samples, shipped in
//! the `.venv`'s scikit-learn), each rank on its `DistributedSampler` share of every epoch, in
//! batches of its share of the global batch; rank 0 shows a progress
//! bar, prints `test_accuracy=0.xx`, and saves a safetensors checkpoint under PyTorch's
//! parameter names (`fc1.weight`, ...). `--resume` continues from it, once it has checked
//! that the checkpoint has exactly the model's keys, shapes and dtypes.
//!
//! ```text
//! target/release/tch-dist-run --nproc-per-node 2 -- target/release/examples/train_ddp [--epochs N] [--resume]
//! ```
//!
//! Every failure ends the program with one line, `error: ...`, and exit status 1: a peer
//! that dies mid-training is `error: rank 0: all_reduce failed: rank 1 closed the
//! connection`, not a panic (tch's `backward_step` unwraps the backward pass; this loop
//! uses `f_backward` and hands on the reducer's typed error).

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use tch_dist::data::{DistributedSampler, SamplerOptions};
use tch_dist::{init_process_group, replicate, Backend, Call, Shardable};

#[path = "common/checkpoint.rs"]
mod checkpoint;
#[path = "common/digits.rs"]
mod digits;
use digits::load_digits;

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
}

fn parse_args() -> Result<Args, String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut a = Args {
        epochs: 20,
        batch: 64,
        lr: 0.05,
        resume: false,
        checkpoint: root.join("data/digits_ddp.safetensors"),
        data: digits::default_path(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--epochs" => a.epochs = value()?.parse().map_err(|e| format!("--epochs: {e}"))?,
            "--batch-size" => {
                a.batch = value()?.parse().map_err(|e| format!("--batch-size: {e}"))?
            }
            "--lr" => a.lr = value()?.parse().map_err(|e| format!("--lr: {e}"))?,
            "--resume" => a.resume = true,
            "--checkpoint" => a.checkpoint = value()?.into(),
            "--data" => a.data = value()?.into(),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn main() {
    let result = run();
    // Before the process exits, whatever happened: the default group's backends are shut
    // down (NCCL's threads must not outlive CUDA's teardown).
    tch_dist::destroy_process_group();
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// `opt.backward_step(&loss)` with failures as values: a collective that failed during
/// backward (a dead peer) is the reducer's typed error, which it keeps for the next forward.
fn backward_step(
    model: &Net,
    opt: &mut nn::Optimizer,
    loss: &Tensor,
) -> Result<(), Box<dyn Error>> {
    opt.zero_grad();
    if let Err(e) = loss.f_backward() {
        replicate::prepare_forward(model)?;
        return Err(e.into());
    }
    opt.step();
    Ok(())
}

fn run() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    tch::set_num_threads(1);
    let pg = init_process_group(Backend::Gloo)?;
    let (rank, world) = (pg.rank() as i64, pg.world_size() as i64);

    let (x, y) = load_digits(&args.data)?;
    let (x_train, y_train, x_test, y_test) = digits::train_test_split(&x, &y);
    let n_train = x_train.size()[0];

    tch::manual_seed(42);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Net::new(&vs.root());
    if args.resume {
        checkpoint::load_exact(&vs, &args.checkpoint)?;
    }
    tch_dist::check_against_var_store(&model, &vs)?;
    replicate::apply(&model, replicate::Options::default())?;
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, args.lr)?;

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
             epochs",
            args.epochs
        );
    }
    let start = Instant::now();
    let mut seen = 0i64;
    for epoch in 0..args.epochs {
        sampler.set_epoch(epoch as u64);
        let order = Tensor::from_slice(&sampler.indices()?);
        for step in 0..steps_per_epoch {
            let lo = step * per;
            let mine = order.narrow(0, lo, per.min(sampler.len() as i64 - lo));
            let len = mine.size()[0] * world;
            let loss = model
                .f_call(&x_train.index_select(0, &mine))?
                .cross_entropy_for_logits(&y_train.index_select(0, &mine));
            backward_step(&model, &mut opt, &loss)?;
            seen += len;
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
    if let Some(b) = &bar {
        b.finish();
    }
    if rank == 0 {
        let acc =
            tch::no_grad(|| model.forward(&x_test).accuracy_for_logits(&y_test)).double_value(&[]);
        println!(
            "trained {} epochs on {} ranks in {:.1}s",
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
