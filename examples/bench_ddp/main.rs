//! The DDP benchmark's tch side (see docs/PERFORMANCE.md; `make bench` runs it).
//!
//! ```text
//! bench_ddp --mode plain      [--device cpu|cuda] [--model NAME] [options]
//! tch-dist-run --nproc-per-node 2 -- bench_ddp --mode replicate [--bucket-cap-mb 25] [--grad-as-bucket-view] [--no-broadcast-buffers] [--in-place-min-bytes N] [--comm-hook allreduce|fp16|bf16|powersgd]
//! tch-dist-run --nproc-per-node 2 -- bench_ddp --mode allreduce [--sizes BYTES,BYTES,...]
//! tch-dist-run --nproc-per-node 2 -- bench_ddp --mode fully_shard [--model NAME] [--optim adamw] [--activation-checkpointing]
//! tch-dist-run --nproc-per-node 2 -- bench_ddp --mode pipeline --model transformer [--microbatches 4] [--schedule 1f1b|zb|zbv]
//! tch-dist-run --nproc-per-node 4 -- bench_ddp --mode hsdp|fsdp_tp
//! tch-dist-run --nproc-per-node 1|2|4 -- bench_ddp --mode cp [--seq-len 2048]
//! tch-dist-run --nproc-per-node 4 -- bench_ddp --mode moe
//! tch-dist-run --nproc-per-node 2 -- bench_ddp --mode loss_parallel
//! tch-dist-run --nproc-per-node 2 -- bench_ddp --mode ft_baseline
//! tch-dist-run --replica-groups 2 --lighthouse URL --nproc-per-node 1 -- bench_ddp --mode ft|ft_after_backward [--exit-at STEP]
//! ```
//!
//! - `plain`: one process trains the model (no process group);
//! - `replicate`: every rank trains it under `replicate::apply` (Gloo on CPU, NCCL on CUDA);
//! - `allreduce`: the floor: raw all-reduces of the model's gradient bytes, one tensor and
//!   per bucket size, in the same kind of process group;
//! - `fully_shard`: every rank trains it under `fully_shard` (FSDP2), one group per block
//!   (the MLP's layers, the transformer's and the convnet's blocks), then the root, with the
//!   defaults;
//! - `pipeline`: the transformer as 2 pipeline stages, one per rank, `Schedule1F1B` on
//!   `--microbatches` (default 4) microbatches of a batch of 8 sequences (pipeline.rs;
//!   `--schedule zb` zero bubble, `zbv` ZB-V on 4 stages, two per rank);
//! - `hsdp`, `fsdp_tp`: the transformer (with separate q, k, v) on a 2x2 mesh of 4 ranks,
//!   HSDP or FSDP x tensor parallelism, AdamW (two_d.rs);
//! - `cp`: a transformer on one long sequence, whole on one rank or split over the ranks by
//!   context parallelism (ring attention), SGD (context.rs);
//! - `moe`: a stack of MoE layers, the experts split over the ranks (expert parallelism),
//!   fully_shard on the rest, SGD (moe.rs);
//! - `loss_parallel`: what a column-parallel head's loss keeps for backward, local logits
//!   with `loss_parallel` against gathered ones (loss.rs);
//! - `ft`, `ft_after_backward`, `ft_baseline`: fault tolerance's cost without faults (two
//!   replica groups, the average overlapping backward or after it, against `replicate` over
//!   two ranks) and a fault's (ft.rs).
//!
//! `--comm-hook` (replicate): how buckets are communicated: `allreduce` (the default, mean),
//! `fp16` or `bf16` (`CommHook::Fp16Compress`, `Bf16Compress`: PyTorch's
//! `fp16_compress_hook`, `bf16_compress_hook`) or `powersgd` (`CommHook::PowerSgd` with
//! PyTorch's `PowerSGDState` defaults but `start_powersgd_iter` 2, the smallest allowed, so
//! that the warm-up steps run the exact all-reduce and the timed ones compress at rank 1).
//!
//! `--optim sgd` (the default: SGD, no momentum) or `adamw` (tch's `nn::AdamW` defaults);
//! `--lr` (default 0.01 for SGD, 1e-3 for AdamW). `--activation-checkpointing` (the
//! transformer): `checkpoint_activations` on each block before any other API.
//!
//! Models (`--model`), each defined exactly as in bench/pytorch_ddp.py (same shapes, the
//! same parameter registration order, batch, loss and SGD with lr 0.01):
//!
//! - `mlp` (alias `cpu`, the default on CPU): 1024-2048-2048-1024-10 with ReLUs (8.4M
//!   parameters in 8 tensors), batch 64, cross-entropy on 10 classes;
//! - `transformer`: GPT-2-style, 6 pre-LayerNorm blocks of width 256 (4 heads, fused qkv,
//!   causal attention from matmuls and softmax, GELU MLP at 4x), token and position
//!   embeddings, final LayerNorm and head; vocabulary 128, sequence 64 (4.8M parameters in
//!   78 tensors), batch 2 sequences, cross-entropy on the next token;
//! - `convnet`: nine 3x3 conv (no bias) + BatchNorm2d + ReLU blocks on 3x32x32 images,
//!   channels 32-32-32 / 64-64-64 (stride 2 at the first) / 128-128-128 (stride 2), global
//!   average pooling and a Linear head (0.48M parameters in 29 tensors, 18 BatchNorm
//!   buffers, broadcast before each forward by default), batch 8, cross-entropy on 10
//!   classes, trained with `forward_t(xs, true)`;
//! - `gpu` (the default on CUDA): 12 blocks of 2048-8192-2048 (403M parameters), batch 64,
//!   MSE.
//!
//! Every rank prints one `BENCH {json}` line with per-step times (ms), phase medians, its
//! peak RSS (VmHWM) and, after the last step (before the next `zero_grad`), the bytes of
//! parameters, gradients and optimizer state it holds, counted from the tensors: the
//! `VarStore`'s trainable variables (under fully_shard: this rank's shards), their `.grad`,
//! and AdamW's two moments per parameter (`exp_avg`, `exp_avg_sq`: twice the parameters).
//! `forward_kept_bytes`: the median over timed steps of what malloc holds after the forward
//! beyond what it held before it (`mallinfo2`): the activations kept for backward.

use std::time::Instant;

use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::{
    fully_shard, init_process_group, replicate, Backend, Call, CallT, CallWith, CommHook,
    FsdpOptions, PowerSgdOptions, ProcessGroup, ReduceOp, Shardable,
};

#[path = "../common/attention_block.rs"]
mod attention_block;
#[path = "../common/cli.rs"]
mod cli;
use attention_block::{attention, Block};

mod context;
mod ft;
mod loss;
mod measure;
mod models;
mod moe;
mod pipeline;
mod two_d;
use measure::*;
use models::*;

struct Args {
    mode: String,
    device: Device,
    model: String,
    batch: i64,
    /// `--mode cp`: the sequence's length.
    seq_len: i64,
    warmup: usize,
    steps: usize,
    threads: i32,
    bucket_cap_mb: f64,
    in_place_min_bytes: usize,
    as_view: bool,
    broadcast_buffers: bool,
    sizes: Vec<usize>,
    tag: String,
    optim: String,
    /// The learning rate; 0: the optimizer's default here (0.01 for SGD, 1e-3 for AdamW).
    lr: f64,
    /// `checkpoint_activations` on each block (the transformer).
    activation_checkpointing: bool,
    /// `--mode pipeline`: microbatches per step.
    microbatches: usize,
    /// `--mode pipeline`: `1f1b` (Schedule1F1B) or `zb` (ScheduleInterleavedZeroBubble).
    schedule: String,
    /// `--mode replicate`: the bucket hook (`allreduce`, `fp16`, `bf16` or `powersgd`).
    comm_hook: String,
    /// `--mode ft`: the step at which replica group 1 exits (its first start only).
    exit_at: Option<i64>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        mode: "plain".into(),
        device: Device::Cpu,
        model: String::new(),
        batch: 0,
        seq_len: 2048,
        warmup: 5,
        steps: 30,
        threads: 1,
        bucket_cap_mb: 25.0,
        in_place_min_bytes: tch_dist::DEFAULT_IN_PLACE_MIN_BYTES,
        as_view: false,
        broadcast_buffers: true,
        sizes: Vec::new(),
        tag: String::new(),
        optim: "sgd".into(),
        lr: 0.0,
        microbatches: 4,
        schedule: "1f1b".to_string(),
        activation_checkpointing: false,
        comm_hook: "allreduce".to_string(),
        exit_at: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        let num = |v: String, what: &str| -> Result<f64, String> {
            v.parse::<f64>().map_err(|e| format!("{what} {v:?}: {e}"))
        };
        match arg.as_str() {
            "--mode" => a.mode = value()?,
            "--exit-at" => {
                a.exit_at = Some(value()?.parse().map_err(|_| "--exit-at takes a step")?)
            }
            "--device" => {
                a.device = match value()?.as_str() {
                    "cpu" => Device::Cpu,
                    // The rank's own GPU: its group's bound device (LOCAL_RANK), see `run`.
                    "cuda" => Device::Cuda(0),
                    d => return Err(format!("unknown --device {d} (cpu or cuda)")),
                }
            }
            "--model" => a.model = value()?,
            "--batch" => a.batch = num(value()?, "--batch")? as i64,
            "--seq-len" => a.seq_len = num(value()?, "--seq-len")? as i64,
            "--warmup" => a.warmup = num(value()?, "--warmup")? as usize,
            "--steps" => a.steps = num(value()?, "--steps")? as usize,
            "--threads" => a.threads = num(value()?, "--threads")? as i32,
            "--bucket-cap-mb" => a.bucket_cap_mb = num(value()?, "--bucket-cap-mb")?,
            "--in-place-min-bytes" => {
                let v = value()?;
                a.in_place_min_bytes = v
                    .parse()
                    .map_err(|e| format!("--in-place-min-bytes {v:?}: {e}"))?;
            }
            "--grad-as-bucket-view" => a.as_view = true,
            "--no-broadcast-buffers" => a.broadcast_buffers = false,
            "--sizes" => {
                a.sizes = value()?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| {
                        s.parse::<usize>()
                            .map_err(|e| format!("--sizes {s:?}: {e}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--tag" => a.tag = value()?,
            "--optim" => a.optim = value()?,
            "--lr" => a.lr = num(value()?, "--lr")?,
            "--activation-checkpointing" => a.activation_checkpointing = true,
            "--microbatches" => a.microbatches = num(value()?, "--microbatches")? as usize,
            "--schedule" => a.schedule = value()?,
            "--comm-hook" => a.comm_hook = value()?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.model.is_empty() {
        a.model = if a.device.is_cuda() { "gpu" } else { "mlp" }.into();
    }
    if a.model == "cpu" {
        a.model = "mlp".into(); // the old name of the CPU MLP
    }
    if a.steps == 0 {
        return Err("--steps must be positive".into());
    }
    if a.optim != "sgd" && a.optim != "adamw" {
        return Err(format!("unknown --optim {} (sgd or adamw)", a.optim));
    }
    comm_hook(&a.comm_hook)?;
    Ok(a)
}

/// The replicate bucket hook `--comm-hook` names.
fn comm_hook(name: &str) -> Result<CommHook, String> {
    Ok(match name {
        "allreduce" => CommHook::AllReduceMean,
        "fp16" => CommHook::Fp16Compress,
        "bf16" => CommHook::Bf16Compress,
        "powersgd" => CommHook::PowerSgd(PowerSgdOptions {
            start_powersgd_iter: 2,
            ..Default::default()
        }),
        other => {
            return Err(format!(
                "unknown --comm-hook {other} (allreduce, fp16, bf16 or powersgd)"
            ))
        }
    })
}

fn main() {
    cli::main_with(run);
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = parse_args()?;
    if args.threads > 0 {
        tch::set_num_threads(args.threads);
    }
    if args.device.is_cuda() && !tch::Cuda::is_available() {
        return Err("--device cuda but CUDA is not available".into());
    }
    let pg = match args.mode.as_str() {
        "plain" => {
            if args.device.is_cuda() {
                let local = tch_dist::LaunchEnv::from_process_env().map_or(0, |e| e.local_rank);
                args.device = Device::Cuda(local);
            }
            None
        }
        "replicate" | "allreduce" | "fully_shard" | "pipeline" | "hsdp" | "fsdp_tp" | "cp" | "moe" | "loss_parallel" | "ft" | "ft_after_backward" | "ft_baseline" => {
            let backend = if args.device.is_cuda() {
                Backend::Nccl
            } else {
                Backend::Gloo
            };
            let pg = init_process_group(backend)?;
            // Each rank on its own GPU: the device the group bound (LOCAL_RANK).
            if let (true, Some(d)) = (args.device.is_cuda(), pg.bound_device()) {
                args.device = d;
            }
            Some(pg)
        }
        other => {
            return Err(format!(
                "unknown --mode {other} (plain, replicate, fully_shard, pipeline, hsdp, fsdp_tp, cp, moe, loss_parallel, ft, ft_after_backward, ft_baseline or allreduce)"
            )
            .into())
        }
    };
    if let ("hsdp" | "fsdp_tp", Some(pg)) = (args.mode.as_str(), &pg) {
        // Its own model and mesh: --model does not apply.
        return two_d::two_d(&args, pg);
    }
    if let ("cp", Some(pg)) = (args.mode.as_str(), &pg) {
        return context::cp(&args, pg);
    }
    if let ("moe", Some(pg)) = (args.mode.as_str(), &pg) {
        return moe::moe(&args, pg);
    }
    if let ("loss_parallel", Some(pg)) = (args.mode.as_str(), &pg) {
        return loss::loss_parallel_memory(&args, pg);
    }
    match args.model.as_str() {
        "mlp" | "gpu" => dispatch::<Mlp>(&args, pg),
        "transformer" => dispatch::<Transformer>(&args, pg),
        "convnet" => dispatch::<Convnet>(&args, pg),
        other => Err(format!("unknown --model {other} (mlp, transformer, convnet or gpu)").into()),
    }
}

fn dispatch<M: BenchModel>(
    args: &Args,
    pg: Option<ProcessGroup>,
) -> Result<(), Box<dyn std::error::Error>> {
    match (args.mode.as_str(), pg) {
        ("allreduce", Some(pg)) => allreduce::<M>(args, pg),
        ("ft" | "ft_after_backward" | "ft_baseline", Some(pg)) => {
            ft::ft::<M>(args, &pg, args.exit_at)
        }
        ("pipeline", Some(pg)) => pipeline::pipeline(args, pg),
        (_, pg) => train::<M>(args, pg),
    }
}

fn train<M: BenchModel>(
    args: &Args,
    pg: Option<ProcessGroup>,
) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, world) = pg.as_ref().map_or((0, 1), |g| (g.rank(), g.world_size()));
    tch::manual_seed(0);
    let vs = nn::VarStore::new(args.device);
    let model = M::build(&vs.root(), &args.model)?;
    let params = vs.trainable_variables();
    let n_params: i64 = params.iter().map(|t| t.numel() as i64).sum();
    let mut fsdp_groups = 0;
    let checkpointed = if args.activation_checkpointing {
        model.checkpoint_blocks()?
    } else {
        0
    };
    if args.mode == "fully_shard" {
        fsdp_groups = model.shard_blocks()? + 1;
        fully_shard(&model, FsdpOptions::default())?;
    } else if pg.is_some() {
        let opts = replicate::Options {
            bucket_cap_mb: args.bucket_cap_mb,
            gradient_as_bucket_view: args.as_view,
            broadcast_buffers: args.broadcast_buffers,
            in_place_min_bytes: args.in_place_min_bytes,
            comm_hook: comm_hook(&args.comm_hook)?,
            ..Default::default()
        };
        replicate::apply(&model, opts)?;
    }
    // Built after fully_shard: the optimizer sees this rank's shards.
    let mut opt = match args.optim.as_str() {
        "adamw" => nn::AdamW::default().build(&vs, if args.lr > 0.0 { args.lr } else { 1e-3 })?,
        _ => nn::Sgd::default().build(&vs, if args.lr > 0.0 { args.lr } else { 0.01 })?,
    };
    // One fixed batch per rank (the data pipeline is not what is measured).
    tch::manual_seed(1 + rank as i64);
    let batch = if args.batch > 0 {
        args.batch
    } else {
        M::default_batch()
    };
    let (x, target) = M::batch(&args.model, batch, args.device)?;
    let loss_of = |out: &Tensor| M::loss(&args.model, out, &target);

    let (mut steps, mut fwd, mut bwd, mut upd) = (vec![], vec![], vec![], vec![]);
    let (mut comm, mut overlap) = (vec![], vec![]);
    // What the forward leaves allocated for backward (activations, outputs), per step.
    let mut kept = vec![];
    if let Some(g) = &pg {
        g.barrier()?;
    }
    sync(args.device);
    let (mut cpu0, mut busy0, mut wall0, mut faults0) = (0.0, 0.0, Instant::now(), 0.0);
    let mut check0 = CheckClock::default();
    let mut net0 = None;
    for i in 0..args.warmup + args.steps {
        if i == args.warmup {
            (cpu0, busy0, wall0) = (cpu_ms(), machine_busy_ms(), Instant::now());
            faults0 = page_faults();
            check0 = CheckClock::now();
            net0 = eth0_bytes();
        }
        let t0 = Instant::now();
        opt.zero_grad();
        let before = malloc_in_use();
        // `call_t` runs replicate's forward hook (buffer broadcast); train mode for BatchNorm.
        let loss = loss_of(&model.f_call_t(&x, true)?);
        sync(args.device);
        let f = ms(t0);
        let kept_bytes = malloc_in_use() - before;
        let t1 = Instant::now();
        if let Err(e) = loss.f_backward() {
            // A collective that failed during backward: the reducer's typed error.
            if args.mode == "replicate" {
                replicate::prepare_forward(&model)?;
            }
            return Err(e.into());
        }
        sync(args.device);
        let b = ms(t1);
        let t2 = Instant::now();
        opt.step();
        sync(args.device);
        let u = ms(t2);
        let total = ms(t0);
        if i >= args.warmup {
            steps.push(total);
            fwd.push(f);
            bwd.push(b);
            upd.push(u);
            kept.push(kept_bytes);
            if let Some(s) = replicate::state(&model) {
                let st = s.stats();
                comm.push(st.comm_time.as_secs_f64() * 1e3);
                overlap.push(st.overlapped_time.as_secs_f64() * 1e3);
            }
        }
    }
    let net = net_window(net0, args.steps);
    let window = Window {
        wall_ms: ms(wall0),
        cpu_ms: cpu_ms() - cpu0,
        machine_busy_ms: machine_busy_ms() - busy0,
    };
    // The always-on step check's time (replicate, fully_shard), per timed step.
    let step_check = check0.per_step_since(args.steps);
    let (peak, current) = rss_mib();
    // What this rank holds between steps (after the last one, before the next zero_grad),
    // counted from the tensors.
    let (param_bytes, grad_bytes) = held_bytes(&vs);
    // AdamW keeps exp_avg and exp_avg_sq, each the parameter's shape; SGD without momentum
    // nothing.
    let optim_bytes = if args.optim == "adamw" {
        2 * param_bytes
    } else {
        0
    };
    let mut gathered_bytes = 0;
    for (_, m) in model.named_modules() {
        if let Some(s) = tch_dist::fully_shard::state(m) {
            gathered_bytes += s.gathered_bytes();
        }
    }
    let mut out = serde_json::json!({
        "cpu_ms": window.cpu_ms / args.steps as f64,
        "page_faults": (page_faults() - faults0) / args.steps as f64,
        "window": window.json(),
        "impl": "tch-dist",
        "mode": args.mode,
        "tag": args.tag,
        "device": format!("{:?}", args.device),
        "model": args.model,
        "params": n_params,
        "param_tensors": params.len(),
        "buffers": vs.variables().len() - params.len(),
        "batch": batch,
        "rank": rank,
        "world": world,
        "threads": tch::get_num_threads(),
        "debug": format!("{:?}", pg.as_ref().map_or(tch_dist::DebugLevel::Off, |g| g.debug_level())),
        "median_ms": median(&steps),
        "fwd_ms": median(&fwd),
        "bwd_ms": median(&bwd),
        "opt_ms": median(&upd),
        "peak_rss_mib": peak,
        "rss_mib": current,
        "forward_kept_bytes": median(&kept),
        "checkpointed_blocks": checkpointed,
        "steps_ms": steps,
        "optim": args.optim,
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optim_bytes": optim_bytes,
        "state_bytes": param_bytes + grad_bytes + optim_bytes,
        "fsdp_groups": fsdp_groups,
        "gathered_bytes": gathered_bytes,
        "comm_hook": args.comm_hook,
    });
    for (key, value) in step_check {
        out[key] = value.into();
    }
    add_net(&mut out, net);
    if let Some(s) = replicate::state(&model) {
        let st = s.stats();
        let size_of: std::collections::HashMap<String, usize> = vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.numel() * t.kind().elt_size_in_bytes()))
            .collect();
        let bucket_bytes: Vec<usize> = s
            .buckets()
            .iter()
            .map(|b| b.iter().map(|f| size_of.get(f).copied().unwrap_or(0)).sum())
            .collect();
        // False with the test switch TCH_DIST_NO_SHORTCUTS=1 at world size 1: every bucket
        // communicates, as PyTorch DDP's do.
        out["skips_communication"] = s.group().skips_communication().into();
        out["bucket_cap_mb"] = args.bucket_cap_mb.into();
        out["in_place_min_bytes"] = args.in_place_min_bytes.into();
        out["gradient_as_bucket_view"] = args.as_view.into();
        out["broadcast_buffers"] = args.broadcast_buffers.into();
        out["buckets"] = st.buckets.into();
        // The collectives replicate launches: per bucket, each gradient of at least
        // `in_place_min_bytes` alone (in place), then the rest together.
        let min = args.in_place_min_bytes;
        let mut collectives = Vec::new();
        for b in s.buckets() {
            let sizes: Vec<usize> = b
                .iter()
                .map(|f| size_of.get(f).copied().unwrap_or(0))
                .collect();
            collectives.extend(sizes.iter().copied().filter(|&n| n >= min));
            let packed: usize = sizes.iter().copied().filter(|&n| n < min).sum();
            if packed > 0 {
                collectives.push(packed);
            }
        }
        out["bucket_bytes"] = bucket_bytes.into();
        out["collective_bytes"] = collectives.into();
        out["bytes"] = st.bytes.into();
        out["comm_ms"] = median(&comm).into();
        out["overlapped_ms"] = median(&overlap).into();
    }
    println!("BENCH {out}");
    if let Some(g) = &pg {
        g.barrier()?;
    }
    Ok(())
}

/// Raw all-reduce times: the whole gradient as one tensor (SUM, with its CPU time, and AVG),
/// each of `--sizes` alone (AVG, as the reducer), and all of them launched back to back then
/// awaited (what the reducer does, without backward around it).
fn allreduce<M: BenchModel>(
    args: &Args,
    pg: ProcessGroup,
) -> Result<(), Box<dyn std::error::Error>> {
    // The model's gradient bytes (fp32); the GPU MLP is counted, not built.
    let total = match widths(&args.model) {
        Ok((w, _)) => w.windows(2).map(|io| io[0] * io[1] + io[1]).sum::<i64>() as usize * 4,
        Err(_) => {
            let vs = nn::VarStore::new(Device::Cpu);
            let _model = M::build(&vs.root(), &args.model)?;
            vs.trainable_variables()
                .iter()
                .map(|t| t.numel() * t.kind().elt_size_in_bytes())
                .sum()
        }
    };
    let sizes = if args.sizes.is_empty() {
        vec![total]
    } else {
        args.sizes.clone()
    };
    let tensor = |bytes: usize| Tensor::ones([(bytes / 4) as i64], (Kind::Float, args.device));
    let time = |f: &mut dyn FnMut() -> Result<(), tch_dist::DistError>| {
        let mut v = Vec::new();
        let mut c0 = 0.0;
        for i in 0..args.warmup + args.steps {
            if i == args.warmup {
                c0 = cpu_ms();
            }
            let t = Instant::now();
            f()?;
            sync(args.device);
            if i >= args.warmup {
                v.push(ms(t));
            }
        }
        let cpu_per_op = (cpu_ms() - c0) / args.steps as f64;
        pg.barrier()?;
        Ok::<_, tch_dist::DistError>((v, cpu_per_op))
    };
    let whole = tensor(total);
    pg.barrier()?;
    let (cpu0, busy0, wall0) = (cpu_ms(), machine_busy_ms(), Instant::now());
    let (sum, sum_cpu) = time(&mut || pg.all_reduce(&whole, ReduceOp::Sum))?;
    let (avg, _) = time(&mut || pg.all_reduce(&whole, ReduceOp::Avg))?;
    let mut per_size = Vec::new();
    for &s in &sizes {
        let t = tensor(s);
        per_size.push(median(&time(&mut || pg.all_reduce(&t, ReduceOp::Avg))?.0));
    }
    let buckets: Vec<Tensor> = sizes.iter().map(|&s| tensor(s)).collect();
    let (seq, _) = time(&mut || {
        let works = buckets
            .iter()
            .map(|t| pg.all_reduce_async(t, ReduceOp::Avg))
            .collect::<Result<Vec<_>, _>>()?;
        works.into_iter().try_for_each(|w| w.wait())
    })?;
    let window = Window {
        wall_ms: ms(wall0),
        cpu_ms: cpu_ms() - cpu0,
        machine_busy_ms: machine_busy_ms() - busy0,
    };
    let (peak, current) = rss_mib();
    let out = serde_json::json!({
        "impl": "tch-dist",
        "mode": "allreduce",
        "window": window.json(),
        "tag": args.tag,
        "device": format!("{:?}", args.device),
        "rank": pg.rank(),
        "world": pg.world_size(),
        "bytes": total,
        "sum_ms": median(&sum),
        "sum_cpu_ms": sum_cpu,
        "avg_ms": median(&avg),
        "sizes": sizes,
        "per_size_ms": per_size,
        "buckets_ms": median(&seq),
        "peak_rss_mib": peak,
        "rss_mib": current,
        "steps_ms": sum,
    });
    println!("BENCH {out}");
    pg.barrier()?;
    Ok(())
}
