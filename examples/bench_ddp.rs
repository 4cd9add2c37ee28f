//! The DDP benchmark's tch side (see docs/PERFORMANCE.md; `make bench` runs it).
//!
//! ```text
//! bench_ddp --mode plain      [--device cpu|cuda] [--model cpu|gpu] [options]
//! tch-dist-run --nproc-per-node 2 -- bench_ddp --mode replicate [--bucket-cap-mb 25] [--grad-as-bucket-view]
//! tch-dist-run --nproc-per-node 2 -- bench_ddp --mode allreduce [--sizes BYTES,BYTES,...]
//! ```
//!
//! - `plain`: one process trains the model (no process group);
//! - `replicate`: every rank trains it under `replicate::apply` (Gloo on CPU, NCCL on CUDA);
//! - `allreduce`: the floor: raw all-reduces of the model's gradient bytes, one tensor and
//!   per bucket size, in the same kind of process group.
//!
//! Models: `cpu` is the MLP 1024-2048-2048-1024-10 (8.4M parameters), `gpu` is 12 blocks of
//! 2048-8192-2048 (403M parameters); batch 64, SGD (lr 0.01), cross-entropy on 10 classes
//! (`cpu`) or MSE (`gpu`), the same as bench/pytorch_ddp.py. Every rank prints one
//! `BENCH {json}` line with per-step times (ms), phase medians and its peak RSS (VmHWM).

use std::time::Instant;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::{init_process_group, replicate, Backend, Call, ProcessGroup, ReduceOp, Shardable};

#[derive(Debug, Shardable)]
struct Mlp {
    layers: Vec<nn::Linear>,
    /// Whether a ReLU follows layer i (false for the last layer).
    #[shardable(skip)]
    relu_after: Vec<bool>,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut h = xs.shallow_clone();
        for (l, relu) in self.layers.iter().zip(&self.relu_after) {
            h = l.call(&h);
            if *relu {
                h = h.relu();
            }
        }
        h
    }
}

/// Layer widths and where ReLUs go for the two models.
fn widths(model: &str) -> Result<(Vec<i64>, Vec<bool>), String> {
    match model {
        // 1024-2048-2048-1024-10: ReLU after every layer but the last.
        "cpu" => Ok((
            vec![1024, 2048, 2048, 1024, 10],
            vec![true, true, true, false],
        )),
        // 12 blocks 2048-8192-2048: ReLU inside each block (after the 8192-wide layer).
        "gpu" => {
            let mut w = vec![2048];
            let mut relu = Vec::new();
            for _ in 0..12 {
                w.extend([8192, 2048]);
                relu.extend([true, false]);
            }
            Ok((w, relu))
        }
        other => Err(format!("unknown --model {other} (cpu or gpu)")),
    }
}

fn build(vs: &nn::Path, model: &str) -> Result<Mlp, String> {
    let (w, relu_after) = widths(model)?;
    let layers = w
        .windows(2)
        .enumerate()
        .map(|(i, io)| nn::linear(vs / "layers" / i, io[0], io[1], Default::default()))
        .collect();
    Ok(Mlp { layers, relu_after })
}

struct Args {
    mode: String,
    device: Device,
    model: String,
    batch: i64,
    warmup: usize,
    steps: usize,
    threads: i32,
    bucket_cap_mb: f64,
    as_view: bool,
    sizes: Vec<usize>,
    tag: String,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        mode: "plain".into(),
        device: Device::Cpu,
        model: String::new(),
        batch: 64,
        warmup: 5,
        steps: 30,
        threads: 1,
        bucket_cap_mb: 25.0,
        as_view: false,
        sizes: Vec::new(),
        tag: String::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        let num = |v: String, what: &str| -> Result<f64, String> {
            v.parse::<f64>().map_err(|e| format!("{what} {v:?}: {e}"))
        };
        match arg.as_str() {
            "--mode" => a.mode = value()?,
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
            "--warmup" => a.warmup = num(value()?, "--warmup")? as usize,
            "--steps" => a.steps = num(value()?, "--steps")? as usize,
            "--threads" => a.threads = num(value()?, "--threads")? as i32,
            "--bucket-cap-mb" => a.bucket_cap_mb = num(value()?, "--bucket-cap-mb")?,
            "--grad-as-bucket-view" => a.as_view = true,
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
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.model.is_empty() {
        a.model = if a.device.is_cuda() { "gpu" } else { "cpu" }.into();
    }
    if a.steps == 0 {
        return Err("--steps must be positive".into());
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

/// Peak and current resident set size in MiB (VmHWM and VmRSS of /proc/self/status).
fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

fn rusage() -> libc::rusage {
    // SAFETY: getrusage fills the struct we pass; RUSAGE_SELF covers every thread.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru
}

/// CPU time (user + system, all threads) this process has used, in ms.
fn cpu_ms() -> f64 {
    let ru = rusage();
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Minor page faults (fresh memory touched) so far.
fn page_faults() -> f64 {
    rusage().ru_minflt as f64
}

/// Busy CPU time of the whole machine so far, in ms (from /proc/stat; USER_HZ is 100): with
/// the ranks' own CPU time it tells how much other programs ran during a measurement.
fn machine_busy_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal: everything but idle and iowait.
    let busy: f64 = ticks
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, t)| t)
        .sum();
    busy * 10.0
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The timed part of a run: wall time, this process's CPU time and the machine's busy time.
struct Window {
    wall_ms: f64,
    cpu_ms: f64,
    machine_busy_ms: f64,
}

impl Window {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "wall_ms": self.wall_ms,
            "cpu_ms": self.cpu_ms,
            "machine_busy_ms": self.machine_busy_ms,
        })
    }
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = parse_args()?;
    if args.threads > 0 {
        tch::set_num_threads(args.threads);
    }
    if args.device.is_cuda() && !tch::Cuda::is_available() {
        return Err("--device cuda but CUDA is not available".into());
    }
    let group = |args: &mut Args| -> Result<ProcessGroup, tch_dist::DistError> {
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
        Ok(pg)
    };
    match args.mode.as_str() {
        "plain" => {
            if args.device.is_cuda() {
                let local = tch_dist::LaunchEnv::from_process_env().map_or(0, |e| e.local_rank);
                args.device = Device::Cuda(local);
            }
            train(&args, None)
        }
        "replicate" => {
            let pg = group(&mut args)?;
            train(&args, Some(pg))
        }
        "allreduce" => {
            let pg = group(&mut args)?;
            allreduce(&args, pg)
        }
        other => Err(format!("unknown --mode {other} (plain, replicate or allreduce)").into()),
    }
}

fn train(args: &Args, pg: Option<ProcessGroup>) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, world) = pg.as_ref().map_or((0, 1), |g| (g.rank(), g.world_size()));
    tch::manual_seed(0);
    let vs = nn::VarStore::new(args.device);
    let model = build(&vs.root(), &args.model)?;
    let params = vs.trainable_variables();
    let n_params: i64 = params.iter().map(|t| t.numel() as i64).sum();
    if pg.is_some() {
        let opts = replicate::Options {
            bucket_cap_mb: args.bucket_cap_mb,
            gradient_as_bucket_view: args.as_view,
            ..Default::default()
        };
        replicate::apply(&model, opts)?;
    }
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    // One fixed batch per rank (the data pipeline is not what is measured).
    tch::manual_seed(1 + rank as i64);
    let in_dim = widths(&args.model)?.0[0];
    let out_dim = *widths(&args.model)?.0.last().unwrap_or(&10);
    let x = Tensor::randn([args.batch, in_dim], (Kind::Float, args.device));
    let y_class = Tensor::randint(10, [args.batch], (Kind::Int64, args.device));
    let y_reg = Tensor::randn([args.batch, out_dim], (Kind::Float, args.device));
    let loss_of = |out: &Tensor| {
        if args.model == "cpu" {
            out.cross_entropy_for_logits(&y_class)
        } else {
            out.mse_loss(&y_reg, tch::Reduction::Mean)
        }
    };

    let (mut steps, mut fwd, mut bwd, mut upd) = (vec![], vec![], vec![], vec![]);
    let (mut comm, mut overlap) = (vec![], vec![]);
    if let Some(g) = &pg {
        g.barrier()?;
    }
    sync(args.device);
    let (mut cpu0, mut busy0, mut wall0, mut faults0) = (0.0, 0.0, Instant::now(), 0.0);
    for i in 0..args.warmup + args.steps {
        if i == args.warmup {
            (cpu0, busy0, wall0) = (cpu_ms(), machine_busy_ms(), Instant::now());
            faults0 = page_faults();
        }
        let t0 = Instant::now();
        opt.zero_grad();
        let loss = loss_of(&model.f_call(&x)?);
        sync(args.device);
        let f = ms(t0);
        let t1 = Instant::now();
        if let Err(e) = loss.f_backward() {
            // A collective that failed during backward: the reducer's typed error.
            if pg.is_some() {
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
            if let Some(s) = replicate::state(&model) {
                let st = s.stats();
                comm.push(st.comm_time.as_secs_f64() * 1e3);
                overlap.push(st.overlapped_time.as_secs_f64() * 1e3);
            }
        }
    }
    let window = Window {
        wall_ms: ms(wall0),
        cpu_ms: cpu_ms() - cpu0,
        machine_busy_ms: machine_busy_ms() - busy0,
    };
    let (peak, current) = rss_mib();
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
        "steps_ms": steps,
    });
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
        out["gradient_as_bucket_view"] = args.as_view.into();
        out["buckets"] = st.buckets.into();
        // The collectives replicate launches with its defaults: per bucket, each gradient of
        // at least 1 MiB alone (in place), then the rest together (`in_place_min_bytes`).
        let mut collectives = Vec::new();
        for b in s.buckets() {
            let sizes: Vec<usize> = b
                .iter()
                .map(|f| size_of.get(f).copied().unwrap_or(0))
                .collect();
            collectives.extend(sizes.iter().copied().filter(|&n| n >= 1 << 20));
            let packed: usize = sizes.iter().copied().filter(|&n| n < 1 << 20).sum();
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
fn allreduce(args: &Args, pg: ProcessGroup) -> Result<(), Box<dyn std::error::Error>> {
    let (w, _) = widths(&args.model)?;
    let numel: i64 = w.windows(2).map(|io| io[0] * io[1] + io[1]).sum();
    let total = numel as usize * 4;
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
