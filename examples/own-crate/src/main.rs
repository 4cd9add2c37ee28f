//! Data-parallel training with tch-dist from a crate of your own: each rank fits a small
//! network to `y = x . [1, -2, 0.5, 3]` on batches of its own, with gradients averaged
//! across ranks by `replicate`, and prints its first and last loss and the sum of its
//! parameters (the same on every rank: the replicas stay equal).
//!
//! ```text
//! cargo build --release
//! tch-dist-run --nproc-per-node 2 -- target/release/my-trainer
//! torchrun --standalone --nproc-per-node 2 --no-python target/release/my-trainer
//! ```

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_dist::{init_process_group, optim, replicate, Backend};

const STEPS: usize = 60;

fn main() {
    let result = train();
    // Whatever happened, shut the default group's backends down before the process exits.
    tch_dist::destroy_process_group();
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn train() -> Result<(), Box<dyn std::error::Error>> {
    // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from tch-dist-run, torchrun or srun.
    let pg = init_process_group(Backend::Gloo)?;
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 4, 16, Default::default()))
        .add_fn(|xs| xs.relu())
        .add(nn::linear(vs.root() / "fc2", 16, 1, Default::default()));
    // Rank 0's initial weights on every rank; gradients averaged during backward.
    let model = replicate::wrap(net, &vs, replicate::Options::default())?;
    // tch-dist's optimizers return a failed backward (a peer gone, a desync) as an error;
    // tch's `nn::Sgd` would panic in `backward_step`.
    let mut opt = optim::Sgd::default().build(&vs, 0.05)?;
    let truth = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0]).view([4, 1]);
    // Each rank draws batches of its own.
    tch::manual_seed(1 + pg.rank() as i64);
    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let x = Tensor::randn([16, 4], tch::kind::FLOAT_CPU);
        let loss = model
            .forward(&x)
            .mse_loss(&x.matmul(&truth), tch::Reduction::Mean);
        opt.backward_step(&loss)?;
        losses.push(loss.double_value(&[]));
    }
    let params: f64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.sum(Kind::Double).double_value(&[]))
        .sum();
    println!(
        "rank={} world={} first_loss={:.4} last_loss={:.4} params_sum={params:.6}",
        pg.rank(),
        pg.world_size(),
        losses[0],
        losses[STEPS - 1]
    );
    Ok(())
}
