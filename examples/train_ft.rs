//! One replica group of a fault-tolerant job (`tch_dist::ft`): a small MLP trained with SGD
//! and momentum, its gradients averaged with the other groups of each step's quorum.
//!
//! ```text
//! tch-dist-run --replica-groups 2 --start-lighthouse 1 --nproc-per-node 1 --max-restarts 1 \
//!     -- target/debug/examples/train_ft --steps 40
//! ```
//!
//! Options: `--replica-id NAME`, `--lighthouse URL` (by default `replica_{REPLICA_GROUP_ID}`
//! and `TORCHFT_LIGHTHOUSE`, as `tch-dist-run --replica-groups` sets them), `--steps N` (committed steps to reach),
//! `--step-ms MS` (a pause per step, so that a test's restarted group catches up),
//! `--exit-at STEP` (the process exits with status 3 at that step, before its gradients are
//! averaged: an injected failure; at the launcher's first start only, and with
//! `--exit-replica G` in replica group G only; so are the next two), `--fail-at STEP` (the
//! step reports an error: `Manager::report_error`), `--stop-at STEP` (the process stops
//! itself with SIGSTOP: a hung group, until a SIGCONT), `--average-twice-at STEP` (the
//! misuse of averaging twice in one step), `--timeout-ms MS` (the cross-group group's timeout),
//! `--min-replica-size N` (the fewest participants a step commits with),
//! `--quorum-timeout-ms MS` (a quorum's and a vote's bound; 60 s), `--progress FILE` (the
//! committed steps so far, rewritten at each commit), `--seed S` (the
//! initial weights' seed; by default the process id; `--seed-per-group` adds 1000 times
//! REPLICA_GROUP_ID), `--hidden H` (the hidden width, 16), `--shard` (within a group of several
//! ranks, `fully_shard` instead of `replicate`: HSDP, fault tolerance on its replicate
//! dimension), `--fail-rank R` (`--fail-at` at group rank R only), `--drop-grad FQN` (every
//! step, in group `--exit-replica` only where given, the parameter's `.grad` is set to none
//! after backward, as for a parameter this group did not use), `--bucket-view` (`replicate`'s `gradient_as_bucket_view`), `--no-manager-rank R`
//! (the misuse of a group rank R that makes no `Manager`: it waits 30 s and exits),
//! `--wire torchft` (average on torchft's DDP wire, `Wire::TorchftDdp`, to train in one
//! quorum with torchft's Python groups), `--init-sin` (the k-th parameter by name starts as
//! `0.3 sin(0.7 i + k)`: weights a Python group can start from too), `--no-init-sync`,
//! `--overlap` (`Manager::prepare_for_backward` before each backward: the average's chunks
//! leave during backward), `--accumulate-at STEP` (with `--overlap`, that step runs a second
//! backward of its batch after the first: the misuse of accumulating after the average's
//! chunks left), `--start-file PATH` (prints `manager up` once its manager heartbeats, and asks for its
//! first quorum once PATH exists: a test's groups then meet in their first quorum).
//! The batches are keyed by (step, the group's index, its rank), and groups start from their own random
//! weights (`init_sync` makes them alike at step 0; a group that restarts heals). At the end
//! it prints `FINAL {json}`: the step, the batches committed, and every parameter's and
//! momentum buffer's values (this rank's shards of them with `--shard`).

use std::error::Error;
use std::time::Duration;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_dist::ft::{FtOptions, Manager, TorchftDdp, Wire};
use tch_dist::{Call, Shardable};

/// The model: two linear layers around a tanh.
#[derive(Debug, Shardable)]
struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.fc2.call(&self.fc1.call(xs).tanh())
    }
}

/// The model's forward: the module itself, or `replicate`'s wrapper around it.
type Forward = dyn Fn(&Tensor) -> Result<Tensor, Box<dyn Error>>;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train_ft: {e}");
            let mut cause = e.source();
            while let Some(c) = cause {
                eprintln!("  caused by: {c}");
                cause = c.source();
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    // By default what tch-dist-run --replica-groups sets: REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE.
    let from_env = || FtOptions::from_env();
    let replica = match arg(&args, "--replica-id") {
        Some(r) => r,
        None => from_env()?.replica_id,
    };
    let lighthouse = match arg(&args, "--lighthouse") {
        Some(l) => l,
        None => from_env()?.lighthouse,
    };
    // The injected failure: at the first start only, and only in group --exit-replica.
    let first_start = std::env::var("TORCHELASTIC_RESTART_COUNT").map_or(true, |c| c == "0");
    let exit_replica = arg(&args, "--exit-replica");
    let this_group = std::env::var("REPLICA_GROUP_ID").ok();
    let steps: i64 = arg(&args, "--steps").map_or(Ok(20), |s| s.parse())?;
    let step_ms: u64 = arg(&args, "--step-ms").map_or(Ok(0), |s| s.parse())?;
    // An injected fault's step: at the first start only, in group --exit-replica only.
    let injected = |name: &str| -> Result<Option<i64>, std::num::ParseIntError> {
        Ok(arg(&args, name)
            .map(|s| s.parse())
            .transpose()?
            .filter(|_| first_start && (exit_replica.is_none() || exit_replica == this_group)))
    };
    let exit_at = injected("--exit-at")?;
    let fail_rank = arg(&args, "--fail-rank");
    let drop_grad =
        arg(&args, "--drop-grad").filter(|_| exit_replica.is_none() || exit_replica == this_group);
    let stop_at = injected("--stop-at")?;
    let twice_at = injected("--average-twice-at")?;
    let accumulate_at = injected("--accumulate-at")?;
    let overlap = args.iter().any(|a| a == "--overlap");
    let timeout_ms: u64 = arg(&args, "--timeout-ms").map_or(Ok(5000), |s| s.parse())?;
    let min_replica_size: usize = arg(&args, "--min-replica-size").map_or(Ok(1), |s| s.parse())?;
    let seed: i64 =
        arg(&args, "--seed").map_or(Ok(i64::from(std::process::id())), |s| s.parse())?;
    let hidden: i64 = arg(&args, "--hidden").map_or(Ok(16), |s| s.parse())?;
    let quorum_timeout_ms: u64 =
        arg(&args, "--quorum-timeout-ms").map_or(Ok(60_000), |s| s.parse())?;
    let progress = arg(&args, "--progress");

    let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
    let fail_at = injected("--fail-at")?
        .filter(|_| fail_rank.is_none() || fail_rank == Some(pg.rank().to_string()));
    // --seed-per-group: each group from its own weights (the seed plus its index), the
    // ranks of one group alike.
    let group_offset = if args.iter().any(|a| a == "--seed-per-group") {
        std::env::var("REPLICA_GROUP_ID")
            .ok()
            .and_then(|g| g.parse::<i64>().ok())
            .unwrap_or(0)
    } else {
        0
    };
    tch::manual_seed(seed + 1000 * group_offset);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = Mlp {
        fc1: nn::linear(vs.root() / "fc1", 6, hidden, Default::default()),
        fc2: nn::linear(vs.root() / "fc2", hidden, 3, Default::default()),
    };
    if args.iter().any(|a| a == "--init-sin") {
        // The k-th parameter by name: 0.3 sin(0.7 i + k), i its element's index.
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for (k, (_, p)) in named.iter_mut().enumerate() {
            let i = Tensor::arange(p.numel() as i64, (Kind::Float, tch::Device::Cpu));
            let init = ((i * 0.7 + k as f64).sin() * 0.3).reshape(p.size());
            tch::no_grad(|| p.copy_(&init));
        }
    }
    let wire = match arg(&args, "--wire").as_deref() {
        None | Some("tch-dist") => Wire::TchDist,
        Some("torchft") => Wire::TorchftDdp(TorchftDdp::of(&net)),
        Some(other) => return Err(format!("--wire {other}: tch-dist or torchft").into()),
    };
    // Within a group of several ranks, data parallelism as usual (`replicate`, or
    // `fully_shard` with --shard); across the groups, the fault-tolerant average below
    // (HSDP's split, with FT on the replicate dim).
    let forward: Box<Forward> = if pg.world_size() == 1 {
        Box::new(move |x| Ok(net.forward(x)))
    } else if args.iter().any(|a| a == "--shard") {
        tch_dist::fully_shard(&net.fc1, Default::default())?;
        tch_dist::fully_shard(&net.fc2, Default::default())?;
        tch_dist::fully_shard(&net, Default::default())?;
        Box::new(move |x| Ok(net.f_call(x)?))
    } else {
        let opts = tch_dist::replicate::Options {
            gradient_as_bucket_view: args.iter().any(|a| a == "--bucket-view"),
            ..Default::default()
        };
        let model = tch_dist::replicate::wrap(net, &vs, opts)?;
        Box::new(move |x| Ok(model.f_forward(x)?))
    };
    let mut opt = tch_dist::optim::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, 0.05)?;
    let opts = FtOptions {
        timeout: Duration::from_millis(timeout_ms),
        quorum_timeout: Duration::from_millis(quorum_timeout_ms),
        connect_timeout: Duration::from_secs(30),
        min_replica_size,
        init_sync: !args.iter().any(|a| a == "--no-init-sync"),
        wire,
        ..FtOptions::new(replica, lighthouse)
    };
    let group_index: i64 = opts
        .replica_id
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|d| d.parse().ok())
        .unwrap_or(0);
    if arg(&args, "--no-manager-rank") == Some(pg.rank().to_string()) {
        std::thread::sleep(Duration::from_secs(30));
        return Ok(());
    }
    let mut ft = Manager::new(&pg, opts)?;
    if let Some(path) = arg(&args, "--start-file") {
        println!("manager up");
        let waiting = std::time::Instant::now();
        while !std::path::Path::new(&path).exists() {
            if waiting.elapsed() > Duration::from_secs(60) {
                return Err(format!("--start-file {path}: not there after 60 s").into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let (mut failed_once, mut stopped_once, mut twice_once) = (false, false, false);
    let mut accumulated_once = false;
    while ft.step() < steps {
        ft.start_quorum(&vs, &mut opt)?;
        opt.zero_grad();
        // This step's batch for this rank of this group, keyed by the group's own index (the
        // digits its name ends with, as torchft's data sharding reads them), not by its rank
        // in the quorum: that one is the last quorum's until the background quorum is
        // applied, and is none after a quorum's group could not be joined.
        let index = group_index;
        tch::manual_seed(1000 * ft.step() + 10 * index + pg.rank() as i64);
        let x = Tensor::randn([32, 6], (Kind::Float, tch::Device::Cpu));
        let y = Tensor::randn([32, 3], (Kind::Float, tch::Device::Cpu));
        let loss = forward(&x)?.mse_loss(&y, tch::Reduction::Mean);
        if overlap {
            ft.prepare_for_backward(&vs, &mut opt)?;
        }
        loss.f_backward()?;
        if accumulate_at == Some(ft.step()) && !std::mem::replace(&mut accumulated_once, true) {
            eprintln!(
                "train_ft: a second backward at step {} (injected misuse)",
                ft.step()
            );
            forward(&x)?
                .mse_loss(&y, tch::Reduction::Mean)
                .f_backward()?;
        }
        if let Some(fqn) = &drop_grad {
            let p = vs
                .variables()
                .remove(fqn)
                .ok_or("--drop-grad: no such parameter")?;
            tch_dist_runtime::set_grad_for(&p, None, pg.rank(), "train_ft")?;
        }
        if exit_at == Some(ft.step()) {
            eprintln!("train_ft: exiting at step {} (injected)", ft.step());
            std::process::exit(3);
        }
        // Each injected fault fires once: the retried step is a step like any other.
        if fail_at == Some(ft.step()) && !std::mem::replace(&mut failed_once, true) {
            eprintln!("train_ft: failing step {} (injected)", ft.step());
            ft.report_error("an injected failure");
        }
        if stop_at == Some(ft.step()) && !std::mem::replace(&mut stopped_once, true) {
            eprintln!(
                "train_ft: stopping at step {} (injected; SIGCONT goes on)",
                ft.step()
            );
            // SAFETY: raise(3) on this process: it stops until a SIGCONT, a hung group.
            unsafe { libc::raise(libc::SIGSTOP) };
        }
        ft.allreduce_gradients(&vs, &mut opt)?;
        if twice_at == Some(ft.step()) && !std::mem::replace(&mut twice_once, true) {
            eprintln!(
                "train_ft: averaging twice at step {} (injected misuse)",
                ft.step()
            );
            ft.allreduce_gradients(&vs, &mut opt)?;
        }
        if ft.should_commit()? {
            opt.step()?;
            println!("committed step {}", ft.step() - 1);
            if let Some(path) = &progress {
                std::fs::write(path, ft.step().to_string())?;
            }
        } else {
            eprintln!(
                "train_ft: step {} not committed: {}",
                ft.step(),
                ft.errored().unwrap_or("another rank of this group failed")
            );
        }
        std::thread::sleep(Duration::from_millis(step_ms));
    }
    let mut names: Vec<String> = opt.param_names().map(str::to_string).collect();
    names.sort();
    let variables = vs.variables();
    let values = |t: &Tensor| Vec::<f64>::try_from(&t.to_kind(Kind::Double).flatten(0, -1));
    let mut params = serde_json::Map::new();
    let mut momentum = serde_json::Map::new();
    for name in &names {
        params.insert(name.clone(), serde_json::json!(values(&variables[name])?));
        if let Some(m) = opt.state(name).and_then(|s| s.get("momentum_buffer")) {
            momentum.insert(name.clone(), serde_json::json!(values(m)?));
        }
    }
    let out = serde_json::json!({
        "replica_id": ft.replica_id(),
        "step": ft.step(),
        "batches_committed": ft.batches_committed(),
        "params": params,
        "momentum": momentum,
    });
    println!("FINAL {out}");
    Ok(())
}
