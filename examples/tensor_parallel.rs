//! Tensor-parallel training with the Megatron planner: a residual MLP classifier on
//! scikit-learn's handwritten digits whose blocks are split across the ranks.
//!
//! [`MegatronPlanner`] finds each block's `fc1` (column-parallel: every rank computes its
//! slice of the hidden features) and `fc2` (row-parallel: partial sums all-reduced);
//! `shard_module` scatters rank 0's weights so that every rank keeps 1/world of them, and
//! the loop is an ordinary tch loop on the same batch on every rank. Rank 0 shows a progress
//! bar and prints `test_accuracy=0.xx`.
//!
//! ```text
//! target/release/tch-dist-run --nproc-per-node 2 -- target/release/examples/tensor_parallel [--epochs N]
//! ```
//!
//! Every failure ends the program with one line, `error: ...`, and exit status 1 (a failing
//! collective in a sharded layer's hook is `f_call`'s error; `tch_dist::optim::Sgd`'s
//! `backward_step` returns a failed backward as an error, where tch's unwraps).

use std::time::Instant;

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_dist::sharding::{shard_module, MegatronPlanner, ShardingPlanner};
use tch_dist::{init_process_group, Backend, Call, Shardable};

#[path = "common/digits.rs"]
mod digits;

#[path = "common/cli.rs"]
mod cli;

#[derive(Debug, Shardable)]
struct Block {
    norm: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

#[derive(Debug, Shardable)]
struct Net {
    embed: nn::Linear,
    blocks: Vec<Block>,
    head: nn::Linear,
}

const WIDTH: i64 = 64;
const HIDDEN: i64 = 256;

impl Net {
    fn new(vs: &nn::Path, depth: usize) -> Net {
        Net {
            embed: nn::linear(vs / "embed", 64, WIDTH, Default::default()),
            blocks: (0..depth)
                .map(|i| {
                    let b = vs / "blocks" / i;
                    Block {
                        norm: nn::layer_norm(&b / "norm", vec![WIDTH], Default::default()),
                        fc1: nn::linear(&b / "fc1", WIDTH, HIDDEN, Default::default()),
                        fc2: nn::linear(&b / "fc2", HIDDEN, WIDTH, Default::default()),
                    }
                })
                .collect(),
            head: nn::linear(vs / "head", WIDTH, 10, Default::default()),
        }
    }
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut h = self.embed.call(xs).relu();
        for b in &self.blocks {
            h = &h + b.fc2.call(&b.fc1.call(&b.norm.call(&h)).gelu("none"));
        }
        self.head.call(&h)
    }
}

/// The command line: `--epochs N`, `--batch-size N`, `--lr X`; anything else is refused
/// (a misspelt flag must not silently train with the default).
struct Args {
    epochs: usize,
    batch: i64,
    lr: f64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        epochs: 15,
        batch: 64,
        lr: 0.01,
    };
    let mut flags = cli::Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--epochs" => a.epochs = flags.parsed(&flag)?,
            "--batch-size" => a.batch = flags.parsed(&flag)?,
            "--lr" => a.lr = flags.parsed(&flag)?,
            other => return Err(cli::unknown(other)),
        }
    }
    Ok(a)
}

fn main() {
    cli::main_with(run);
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let Args { epochs, batch, lr } = parse_args()?;
    cli::one_thread_per_rank();
    let pg = init_process_group(Backend::Gloo)?;
    let rank = pg.rank();

    let (x_train, y_train, x_test, y_test) = digits::load_split(&digits::default_path())?;
    let n_train = x_train.size()[0];

    // The same initialisation everywhere: replicated parameters (embed, norms, head) start
    // equal, and shard_module keeps each rank's slice of rank 0's sharded weights.
    tch::manual_seed(42);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut model = Net::new(&vs.root(), 2);
    let whole: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    let plan = MegatronPlanner::default().build_plan(&model)?;
    shard_module(&mut model, &plan, 0, &pg)?;
    let local: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    if rank == 0 {
        println!(
            "plan: {}",
            plan.plan.keys().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    println!(
        "rank {rank}: {local} of {whole} parameters (blocks.0.fc1.weight {:?})",
        model.blocks[0].fc1.ws.size()
    );
    let mut opt = tch_dist::optim::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, lr)?;

    let steps = (n_train + batch - 1) / batch;
    let bar = (rank == 0).then(|| {
        let b = indicatif::ProgressBar::new(steps as u64 * epochs as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let start = Instant::now();
    for epoch in 0..epochs {
        tch::manual_seed(1000 + epoch as i64); // the same batches on every rank
        let order = Tensor::randperm(n_train, (Kind::Int64, Device::Cpu));
        for step in 0..steps {
            // The same on every rank: a rank off by a step fails every rank (the step check).
            tch_dist::set_step((epoch as i64 * steps + step) as u64);
            let idx = order.narrow(0, step * batch, batch.min(n_train - step * batch));
            let loss = model
                .f_call(&x_train.index_select(0, &idx))?
                .cross_entropy_for_logits(&y_train.index_select(0, &idx));
            opt.backward_step(&loss)?;
            if let Some(b) = &bar {
                b.set_message(format!(
                    "epoch {} loss {:.4}",
                    epoch + 1,
                    loss.double_value(&[])
                ));
                b.inc(1);
            }
        }
    }
    if let Some(b) = &bar {
        b.finish();
    }
    // Evaluation runs the sharded forward, so every rank takes part.
    let acc = tch::no_grad(|| model.f_call(&x_test))?
        .accuracy_for_logits(&y_test)
        .double_value(&[]);
    if rank == 0 {
        println!(
            "trained {epochs} epochs on {} ranks in {:.1}s",
            pg.world_size(),
            start.elapsed().as_secs_f64()
        );
        println!("test_accuracy={acc:.2}");
    }
    pg.barrier()?;
    Ok(())
}
