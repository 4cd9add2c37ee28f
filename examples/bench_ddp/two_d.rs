//! `--mode hsdp` and `--mode fsdp_tp`: the suite's transformer on 4 ranks laid out as a 2x2
//! mesh, as bench/pytorch_two_d.py lays out PyTorch's:
//!
//! - `hsdp`: mesh `[2, 2]` named `dp_replicate` x `dp_shard`, `fully_shard` on each block
//!   then the root with `FsdpOptions::mesh` (HSDP: each parameter sharded over the 2 ranks of
//!   a `dp_shard` group, replicated over `dp_replicate`); every rank trains its own batch;
//! - `fsdp_tp`: mesh `[2, 2]` named `dp` x `tp`, `parallelize_module` over `tp` (q, k, v and
//!   fc1 column-parallel, proj and fc2 row-parallel: each tp rank computes half of the heads
//!   and half of the MLP), then `fully_shard` on each block and the root over `dp`; the two
//!   tp ranks of a dp group train the same batch, the dp groups different ones.
//!
//! The model is the suite's transformer with q, k and v as three Linear(dim, dim) instead of
//! the fused qkv (a fused layer's column split would hand a tp rank a piece of q, k and v
//! each, not whole heads), and a forward whose head count is the local one (the q output's
//! width / the head width), so that the same code runs whole (HSDP) and tensor-parallel; the
//! same shapes and FLOPs as PyTorch's side, in both layouts. AdamW (lr 1e-3) with
//! `tch_dist::optim::AdamW`, libtorch's fused kernel, as PyTorch's `AdamW(fused=True)`.

use super::*;
use tch_dist::device_mesh::{init_device_mesh, DeviceMesh};
use tch_dist::sharding::{parallelize_module, ColwiseParallel, ParallelizePlan, RowwiseParallel};

/// The suite's block with separate q, k and v (see the module docs).
#[derive(Debug, Shardable)]
pub(crate) struct TpBlock {
    pub(crate) ln1: nn::LayerNorm,
    pub(crate) q: nn::Linear,
    pub(crate) k: nn::Linear,
    pub(crate) v: nn::Linear,
    pub(crate) proj: nn::Linear,
    pub(crate) ln2: nn::LayerNorm,
    pub(crate) fc1: nn::Linear,
    pub(crate) fc2: nn::Linear,
}

impl TpBlock {
    pub(crate) fn new(p: nn::Path) -> TpBlock {
        let d = T_DIM;
        let linear = |name: &str, i, o| nn::linear(&p / name, i, o, Default::default());
        TpBlock {
            ln1: nn::layer_norm(&p / "ln1", vec![d], Default::default()),
            q: linear("q", d, d),
            k: linear("k", d, d),
            v: linear("v", d, d),
            proj: linear("proj", d, d),
            ln2: nn::layer_norm(&p / "ln2", vec![d], Default::default()),
            fc1: linear("fc1", d, 4 * d),
            fc2: linear("fc2", 4 * d, d),
        }
    }

    /// `x` `[batch, seq, dim]` to the same. Under tensor parallelism q, k and v hand on this
    /// rank's columns (whole heads: the column split is even and a head's width divides
    /// it), attention runs on those heads only, and proj (row-parallel) sums the ranks'
    /// partial outputs.
    fn forward(&self, x: &Tensor, mask: &Tensor) -> Tensor {
        let h = self.ln1.call(x);
        let (q, k, v) = (self.q.call(&h), self.k.call(&h), self.v.call(&h));
        // Over q's width: T_DIM whole, T_DIM / tp under tensor parallelism.
        let y = attention(&q, &k, &v, T_DIM / T_HEADS, Some(mask));
        let x = x + self.proj.call(&y);
        let h = self.fc1.call(&self.ln2.call(&x)).gelu("none");
        &x + self.fc2.call(&h)
    }
}

/// The suite's transformer (models.rs's `Transformer`) with [`TpBlock`]s.
#[derive(Debug, Shardable)]
pub(crate) struct TpTransformer {
    pub(crate) tok: nn::Embedding,
    pub(crate) pos: nn::Embedding,
    pub(crate) blocks: Vec<TpBlock>,
    pub(crate) ln_f: nn::LayerNorm,
    pub(crate) head: nn::Linear,
    #[shardable(skip)]
    positions: Tensor,
    #[shardable(skip)]
    mask: Tensor,
}

impl TpTransformer {
    fn new(p: &nn::Path) -> TpTransformer {
        let d = T_DIM;
        let dev = p.device();
        TpTransformer {
            tok: nn::embedding(p / "tok", T_VOCAB, d, Default::default()),
            pos: nn::embedding(p / "pos", T_SEQ, d, Default::default()),
            blocks: (0..T_BLOCKS)
                .map(|i| TpBlock::new(p / "blocks" / i))
                .collect(),
            ln_f: nn::layer_norm(p / "ln_f", vec![d], Default::default()),
            head: nn::linear(p / "head", d, T_VOCAB, Default::default()),
            positions: Tensor::arange(T_SEQ, (Kind::Int64, dev)),
            mask: Tensor::ones([T_SEQ, T_SEQ], (Kind::Bool, dev)).triu(1),
        }
    }
}

impl Module for TpTransformer {
    fn forward(&self, idx: &Tensor) -> Tensor {
        let mut x = self.tok.call(idx) + self.pos.call(&self.positions);
        for b in &self.blocks {
            // Through `call_with`, so that the block's fully_shard hooks run.
            x = b.call_with([&x, &self.mask], |b, [x, mask]| b.forward(x, mask));
        }
        self.head.call(&self.ln_f.call(&x))
    }
}

/// Megatron's plan on every block: q, k, v and fc1 column-parallel, proj and fc2
/// row-parallel (the embeddings, norms and head stay whole on every tp rank).
fn tp_plan() -> ParallelizePlan {
    let mut plan = ParallelizePlan::new();
    for i in 0..T_BLOCKS {
        for l in ["q", "k", "v", "fc1"] {
            plan = plan.style(
                format!("blocks.{i}.{l}").as_str(),
                ColwiseParallel::default(),
            );
        }
        for l in ["proj", "fc2"] {
            plan = plan.style(
                format!("blocks.{i}.{l}").as_str(),
                RowwiseParallel::default(),
            );
        }
    }
    plan
}

/// Lays the model out as `mode` says; returns the mesh and which data-parallel replica this
/// rank is (its batch's seed).
fn lay_out(
    mode: &str,
    model: &mut TpTransformer,
) -> Result<(DeviceMesh, usize), Box<dyn std::error::Error>> {
    let fsdp = |mesh: &DeviceMesh| FsdpOptions {
        mesh: Some(mesh.clone()),
        ..Default::default()
    };
    Ok(match mode {
        "hsdp" => {
            let mesh = init_device_mesh("cpu", &[2, 2], &["dp_replicate", "dp_shard"])?;
            for b in &model.blocks {
                fully_shard(b, fsdp(&mesh))?;
            }
            fully_shard(&*model, fsdp(&mesh))?;
            // All four ranks are data-parallel.
            let rank = mesh.get_coordinate();
            (mesh, rank[0] * 2 + rank[1])
        }
        _ => {
            let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
            parallelize_module(model, &mesh.dim("tp")?, &tp_plan())?;
            let dp = mesh.dim("dp")?;
            for b in &model.blocks {
                fully_shard(b, fsdp(&dp))?;
            }
            fully_shard(&*model, fsdp(&dp))?;
            // The tp ranks of a dp group share its batch.
            let replica = mesh.get_local_rank("dp")?;
            (mesh, replica)
        }
    })
}

/// Trains the 2-D layout `args.mode` and prints the rank's `BENCH` line (the fields of
/// `train`'s that driver.py reads).
pub(crate) fn two_d(args: &Args, pg: &ProcessGroup) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, world) = (pg.rank(), pg.world_size());
    if world != 4 || args.device != Device::Cpu {
        return Err(format!("--mode {}: 4 ranks on CPU (a 2x2 mesh)", args.mode).into());
    }
    tch::manual_seed(0);
    let vs = nn::VarStore::new(args.device);
    let mut model = TpTransformer::new(&vs.root());
    let n_params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    let n_tensors = vs.trainable_variables().len();
    let (_mesh, replica) = lay_out(&args.mode, &mut model)?;
    // Built after both APIs: it sees (and keeps AdamW state for) this rank's pieces only.
    let lr = if args.lr > 0.0 { args.lr } else { 1e-3 };
    let mut opt = tch_dist::optim::AdamW::default().build(&vs, lr)?;
    tch::manual_seed(1 + replica as i64);
    let batch = if args.batch > 0 { args.batch } else { 2 };
    let (x, target) = Transformer::batch("transformer", batch, args.device)?;

    let (mut steps, mut fwd, mut bwd, mut upd) = (vec![], vec![], vec![], vec![]);
    // The first and last steps' losses: a check that both sides train alike (read after the
    // timed steps, so that no step waits for it).
    let mut losses = vec![];
    pg.barrier()?;
    let (mut cpu0, mut busy0, mut wall0) = (0.0, 0.0, Instant::now());
    let mut sys0 = 0.0;
    let mut net0 = None;
    for i in 0..args.warmup + args.steps {
        if i == args.warmup {
            (cpu0, busy0, wall0) = (cpu_ms(), machine_busy_ms(), Instant::now());
            sys0 = sys_ms();
            net0 = eth0_bytes();
        }
        let t0 = Instant::now();
        opt.zero_grad();
        let loss = Transformer::loss("transformer", &model.f_call(&x)?, &target);
        let f = ms(t0);
        let t1 = Instant::now();
        loss.f_backward()?;
        let b = ms(t1);
        let t2 = Instant::now();
        opt.step()?;
        let u = ms(t2);
        if i == 0 || i + 1 == args.warmup + args.steps {
            losses.push(loss.detach());
        }
        if i >= args.warmup {
            steps.push(ms(t0));
            fwd.push(f);
            bwd.push(b);
            upd.push(u);
        }
    }
    let net = net_window(net0, args.steps);
    let window = Window {
        wall_ms: ms(wall0),
        cpu_ms: cpu_ms() - cpu0,
        machine_busy_ms: machine_busy_ms() - busy0,
    };
    let sys_per_step = (sys_ms() - sys0) / args.steps as f64;
    let (peak, current) = rss_mib();
    let (param_bytes, grad_bytes) = held_bytes(&vs);
    // exp_avg and exp_avg_sq (the float32 `step` scalars left out, as PyTorch's side does).
    let optim_bytes: usize = opt
        .states()
        .flat_map(|(_, s)| {
            s.iter()
                .filter(|(k, _)| *k != "step")
                .map(|(_, t)| tensor_bytes(t))
        })
        .sum();
    let mut out = serde_json::json!({
        "cpu_ms": window.cpu_ms / args.steps as f64,
        "sys_ms": sys_per_step,
        "window": window.json(),
        "impl": "tch-dist",
        "mode": args.mode,
        "model": "transformer_tp",
        "params": n_params,
        "param_tensors": n_tensors,
        "batch": batch,
        "replica": replica,
        "rank": rank,
        "world": world,
        "threads": tch::get_num_threads(),
        "median_ms": median(&steps),
        "fwd_ms": median(&fwd),
        "bwd_ms": median(&bwd),
        "opt_ms": median(&upd),
        "peak_rss_mib": peak,
        "rss_mib": current,
        "steps_ms": steps,
        "losses": losses.iter().map(|l| l.double_value(&[])).collect::<Vec<_>>(),
        "optim": "adamw_fused",
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optim_bytes": optim_bytes,
        "state_bytes": param_bytes + grad_bytes + optim_bytes,
    });
    add_net(&mut out, net);
    println!("BENCH {out}");
    pg.barrier()?;
    Ok(())
}

/// System CPU time (all threads) so far, in ms: Gloo over loopback TCP spends its
/// communication's CPU time in the kernel, so this is most of a rank's communication cost.
fn sys_ms() -> f64 {
    let t = rusage().ru_stime;
    t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3
}
