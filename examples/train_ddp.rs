//! The main job: data-parallel training of a digit classifier with `replicate`.
//!
//! Trains an MLP on scikit-learn's handwritten digits (8x8 images, 1797 samples, shipped in
//! the `.venv`'s scikit-learn), each rank on its shard of every batch; rank 0 shows a progress
//! bar, prints `test_accuracy=0.xx`, and saves a safetensors checkpoint under PyTorch's
//! parameter names (`fc1.weight`, ...). `--resume` continues from it.
//!
//! ```text
//! target/release/tch-dist-run --nproc-per-node 2 -- target/release/examples/train_ddp [--epochs N] [--resume]
//! ```

use std::io::Read;
use std::path::PathBuf;
use std::time::Instant;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::{init_process_group, replicate, Backend, Call, Shardable};

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
        data: root.join(".venv/lib/python3.11/site-packages/sklearn/datasets/data/digits.csv.gz"),
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

/// The digits as (images [n, 64] scaled to [0, 1], labels [n]).
fn load_digits(path: &PathBuf) -> Result<(Tensor, Tensor), String> {
    let file = std::fs::File::open(path)
        .map_err(|e| format!("{}: {e} (run `make setup`)", path.display()))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let v: Vec<f32> = line
            .split(',')
            .map(|f| f.trim().parse::<f32>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("line {}: {e}", i + 1))?;
        if v.len() != 65 {
            return Err(format!(
                "line {}: expected 65 values, got {}",
                i + 1,
                v.len()
            ));
        }
        xs.extend(v[..64].iter().map(|p| p / 16.0));
        ys.push(v[64] as i64);
    }
    let n = ys.len() as i64;
    Ok((
        Tensor::from_slice(&xs).view([n, 64]),
        Tensor::from_slice(&ys),
    ))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    tch::set_num_threads(1);
    let pg = init_process_group(Backend::Gloo)?;
    let (rank, world) = (pg.rank() as i64, pg.world_size() as i64);

    // The same shuffle and 80/20 split on every rank.
    let (x, y) = load_digits(&args.data)?;
    tch::manual_seed(0);
    let perm = Tensor::randperm(x.size()[0], (Kind::Int64, Device::Cpu));
    let (x, y) = (x.index_select(0, &perm), y.index_select(0, &perm));
    let n_train = x.size()[0] * 4 / 5;
    let (x_train, y_train) = (x.narrow(0, 0, n_train), y.narrow(0, 0, n_train));
    let (x_test, y_test) = (
        x.narrow(0, n_train, x.size()[0] - n_train),
        y.narrow(0, n_train, y.size()[0] - n_train),
    );

    tch::manual_seed(42);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = Net::new(&vs.root());
    if args.resume {
        vs.load(&args.checkpoint)
            .map_err(|e| format!("--resume: {}: {e}", args.checkpoint.display()))?;
    }
    tch_dist::check_against_var_store(&model, &vs)?;
    replicate::apply(&model, replicate::Options::default())?;
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, args.lr)?;

    let steps_per_epoch = (n_train + args.batch - 1) / args.batch;
    let total = steps_per_epoch as u64 * args.epochs as u64;
    let bar = (rank == 0).then(|| {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} epoch {prefix} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let start = Instant::now();
    let mut seen = 0i64;
    for epoch in 0..args.epochs {
        tch::manual_seed(1000 + epoch as i64);
        let order = Tensor::randperm(n_train, (Kind::Int64, Device::Cpu));
        for step in 0..steps_per_epoch {
            let len = args.batch.min(n_train - step * args.batch);
            let idx = order.narrow(0, step * args.batch, len);
            // This rank's shard of the global batch.
            let per = (len + world - 1) / world;
            let lo = (rank * per).min(len);
            let mine = idx.narrow(0, lo, per.min(len - lo));
            if mine.size()[0] == 0 {
                return Err(
                    "a batch too small to give every rank a sample; lower the world size".into(),
                );
            }
            let loss = model
                .call(&x_train.index_select(0, &mine))
                .cross_entropy_for_logits(&y_train.index_select(0, &mine));
            opt.backward_step(&loss);
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
