//! `--mode moe`: the mixture-of-experts part (bench/pytorch_moe.py is PyTorch's side, in
//! torchtitan's approach). A stack of `MOE_LAYERS` layers `x + moe(x)` of
//! `tch_dist::nn::moe::MoE` (dim 128, 8 SwiGLU experts of width 256, top-2 by sigmoid
//! scores, one shared expert of width 256) on `MOE_TOKENS` tokens per rank; the experts split
//! over every rank (`parallelize_experts`: the counts exchanged first, then the tokens, by
//! the differentiable `all_to_all_single`), `fully_shard` on each layer and the root over
//! every rank (the experts left to expert parallelism). MSE against a random target, SGD (lr
//! 0.01). Prints the rank's `BENCH` line.

use super::*;
use tch_dist::nn::moe::{MoE, MoeConfig};

const MOE_DIM: i64 = 128;
const MOE_HIDDEN: i64 = 256;
const MOE_EXPERTS: i64 = 8;
const MOE_LAYERS: i64 = 2;
const MOE_TOKENS: i64 = 1024;

/// The layers, `layers.<i>`.
#[derive(Debug, Shardable)]
struct MoeStack {
    layers: Vec<MoE>,
}

impl Module for MoeStack {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.layers
            .iter()
            .fold(x.shallow_clone(), |x, layer| &x + layer.call(&x))
    }
}

pub(crate) fn moe(args: &Args, pg: &ProcessGroup) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, world) = (pg.rank(), pg.world_size());
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let config = MoeConfig {
        shared_hidden: Some(MOE_HIDDEN),
        ..MoeConfig::new(MOE_DIM, MOE_HIDDEN, MOE_EXPERTS, 2)
    };
    let mut model = MoeStack {
        layers: (0..MOE_LAYERS)
            .map(|i| MoE::new(vs.root() / "layers" / i, config.clone()))
            .collect::<Result<_, _>>()?,
    };
    let n_params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    for layer in &mut model.layers {
        layer.parallelize_experts(pg)?;
    }
    for layer in &model.layers {
        fully_shard(layer, FsdpOptions::default())?;
    }
    fully_shard(&model, FsdpOptions::default())?;
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    tch::manual_seed(1 + rank as i64);
    let x = Tensor::randn([MOE_TOKENS, MOE_DIM], (Kind::Float, Device::Cpu));
    let target = Tensor::randn([MOE_TOKENS, MOE_DIM], (Kind::Float, Device::Cpu));

    let (mut steps, mut fwd, mut bwd) = (vec![], vec![], vec![]);
    pg.barrier()?;
    let (mut cpu0, mut busy0, mut wall0) = (0.0, 0.0, Instant::now());
    let mut check0 = CheckClock::now();
    let mut loss_value = 0.0;
    for i in 0..args.warmup + args.steps {
        if i == args.warmup {
            (cpu0, busy0, wall0) = (cpu_ms(), machine_busy_ms(), Instant::now());
            check0 = CheckClock::now();
        }
        let t0 = Instant::now();
        opt.zero_grad();
        let loss = model.f_call(&x)?.mse_loss(&target, tch::Reduction::Mean);
        let f = ms(t0);
        let t1 = Instant::now();
        loss.f_backward()?;
        let b = ms(t1);
        opt.step();
        if i >= args.warmup {
            steps.push(ms(t0));
            fwd.push(f);
            bwd.push(b);
        }
        if i + 1 == args.warmup + args.steps {
            loss_value = loss.double_value(&[]);
        }
    }
    let window = Window {
        wall_ms: ms(wall0),
        cpu_ms: cpu_ms() - cpu0,
        machine_busy_ms: machine_busy_ms() - busy0,
    };
    let step_check = check0.per_step_since(args.steps);
    let (peak, current) = rss_mib();
    let mut out = serde_json::json!({
        "cpu_ms": window.cpu_ms / args.steps as f64,
        "window": window.json(),
        "impl": "tch-dist",
        "mode": "moe",
        "params": n_params,
        "rank": rank,
        "world": world,
        "threads": tch::get_num_threads(),
        "median_ms": median(&steps),
        "fwd_ms": median(&fwd),
        "bwd_ms": median(&bwd),
        "peak_rss_mib": peak,
        "rss_mib": current,
        "steps_ms": steps,
        "loss": loss_value,
    });
    for (key, value) in step_check {
        out[key] = value.into();
    }
    println!("BENCH {out}");
    pg.barrier()?;
    Ok(())
}
