//! Ranks 1..N of examples/weight_sync: tch-dist workers that receive a PyTorch trainer's
//! policy weights (trainer.py, rank 0) into their own model by name after every step, run
//! inference, and send their actions back.
//!
//! The model's parameter names are PyTorch's (`fc1.weight`, ...: the `Shardable` derive
//! names fields as `nn.Module` does), so the worker copies each broadcast tensor into the
//! parameter of the same name. See README.md for the protocol and how to start the job.
//!
//! ```text
//! torchrun --nproc-per-node 3 --no-python examples/weight_sync/rank.sh
//! ```

use std::collections::BTreeMap;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_dist::{init_process_group, Object, Shardable};

#[path = "../common/cli.rs"]
mod cli;

#[derive(Debug, Shardable)]
struct Policy {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Policy {
    fn new(vs: &nn::Path) -> Policy {
        Policy {
            fc1: nn::linear(vs / "fc1", 4, 16, Default::default()),
            fc2: nn::linear(vs / "fc2", 16, 2, Default::default()),
        }
    }
}

impl Module for Policy {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.fc2.forward(&self.fc1.forward(xs).tanh())
    }
}

/// What this worker observes at `step` (trainer.py's `observations`).
fn observations(rank: usize, step: usize) -> Tensor {
    Tensor::arange(12, (Kind::Float, tch::Device::Cpu)).reshape([3, 4]) / 12.0
        + rank as f64
        + 0.01 * step as f64
}

fn main() {
    cli::main_with(run);
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let pg = init_process_group("gloo")?;
    if pg.rank() == 0 {
        return Err("rank 0 is the trainer (trainer.py); start workers as ranks 1..N".into());
    }
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let policy = Policy::new(&vs.root());
    let params: BTreeMap<String, Tensor> = policy
        .named_parameters()
        .into_iter()
        .map(|(name, t)| (name, t.shallow_clone()))
        .collect();

    // The trainer's state_dict names and the step count.
    let mut header = vec![Object::from(""), Object::from("")];
    pg.broadcast_object_list(&mut header, 0)?;
    let names: Vec<String> = header[0]
        .as_str()
        .ok_or("the trainer sent no names")?
        .split(',')
        .map(str::to_string)
        .collect();
    let steps: usize = header[1].as_str().ok_or("no step count")?.parse()?;
    let mine: Vec<&String> = params.keys().collect();
    let mut theirs: Vec<&String> = names.iter().collect();
    theirs.sort();
    if mine != theirs {
        return Err(
            format!("the trainer's parameters are {theirs:?}, this model's {mine:?}").into(),
        );
    }

    for step in 0..steps {
        for name in &names {
            let mut param = params[name].shallow_clone();
            let incoming = param.zeros_like();
            pg.broadcast(&incoming, 0)?;
            tch::no_grad(|| param.copy_(&incoming));
        }
        let actions = tch::no_grad(|| policy.forward(&observations(pg.rank(), step)));
        pg.send(&actions.contiguous(), 0, step as i32)?;
    }
    println!(
        "rank {}: received {} tensors x {steps} steps, sent actions back",
        pg.rank(),
        names.len()
    );
    Ok(())
}
