//! `--mode cp`: context parallelism's cost and saving. A GPT-2-style model (the two-D part's
//! blocks, width 256, 4 heads, `CP_BLOCKS` blocks) on one sequence of `--seq-len` tokens
//! (default 2048), its causal attention through `tch_dist::nn::scaled_dot_product_attention`.
//! On one rank, the whole sequence (libtorch's attention); on N ranks, each holds its
//! head-tail part of the sequence inside `context_parallel` (token ids, targets and
//! position ids split alike; ring attention over the ranks), with `replicate` averaging the
//! gradients (the ranks hold the same weights but see other tokens). The `BENCH` line's
//! `forward_kept_bytes` is what malloc holds after the forward beyond before it: the
//! activations kept for backward, which context parallelism divides by the ranks.

use super::*;
use tch_dist::context_parallel::{context_parallel, CpOptions};
use two_d::TpBlock;

/// Blocks of the model.
const CP_BLOCKS: i64 = 2;

/// The model: embeddings of tokens and of their positions (ids: a buffer split with the
/// tokens), blocks, final norm and head.
#[derive(Debug, Shardable)]
struct CpModel {
    tok: nn::Embedding,
    pos: nn::Embedding,
    blocks: Vec<TpBlock>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl CpModel {
    fn new(p: &nn::Path, seq_len: i64) -> CpModel {
        let d = T_DIM;
        CpModel {
            tok: nn::embedding(p / "tok", T_VOCAB, d, Default::default()),
            pos: nn::embedding(p / "pos", seq_len, d, Default::default()),
            blocks: (0..CP_BLOCKS)
                .map(|i| TpBlock::new(p / "blocks" / i))
                .collect(),
            ln_f: nn::layer_norm(p / "ln_f", vec![d], Default::default()),
            head: nn::linear(p / "head", d, T_VOCAB, Default::default()),
        }
    }

    /// `ids` and `positions` `[batch, seq]` (this rank's part of them inside the context).
    fn forward(&self, ids: &Tensor, positions: &Tensor) -> Tensor {
        let mut x = self.tok.call(ids) + self.pos.call(positions);
        let (b, t) = (ids.size()[0], ids.size()[1]);
        let heads = |z: Tensor| z.view([b, t, T_HEADS, -1]).transpose(1, 2);
        for block in &self.blocks {
            let h = block.ln1.call(&x);
            let (q, k, v) = (
                heads(block.q.call(&h)),
                heads(block.k.call(&h)),
                heads(block.v.call(&h)),
            );
            let y = tch_dist::nn::scaled_dot_product_attention(&q, &k, &v, None, 0.0, true, None);
            x = &x
                + block
                    .proj
                    .call(&y.transpose(1, 2).contiguous().view([b, t, T_DIM]));
            let h = block.fc1.call(&block.ln2.call(&x)).gelu("none");
            x = &x + block.fc2.call(&h);
        }
        self.head.call(&self.ln_f.call(&x))
    }
}

/// Trains the model on one sequence, whole (1 rank) or split (N ranks), and prints the
/// rank's `BENCH` line.
pub(crate) fn cp(args: &Args, pg: &ProcessGroup) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let seq_len = args.seq_len;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = CpModel::new(&vs.root(), seq_len);
    if world > 1 {
        replicate::apply(&model, replicate::Options::default())?;
    }
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    // The same sequence on every rank (each takes its part of it).
    let ids = Tensor::randint(T_VOCAB, [1, seq_len], (Kind::Int64, Device::Cpu));
    let targets = ids.roll([-1], [1]);
    let positions = Tensor::arange(seq_len, (Kind::Int64, Device::Cpu)).view([1, seq_len]);

    let (mut steps, mut fwd, mut bwd, mut kept) = (vec![], vec![], vec![], vec![]);
    pg.barrier()?;
    let (mut cpu0, mut busy0, mut wall0) = (0.0, 0.0, Instant::now());
    for i in 0..args.warmup + args.steps {
        if i == args.warmup {
            (cpu0, busy0, wall0) = (cpu_ms(), machine_busy_ms(), Instant::now());
        }
        let t0 = Instant::now();
        opt.zero_grad();
        let region = if world > 1 {
            let buffers = [&ids, &targets, &positions];
            Some(context_parallel(
                pg,
                &buffers,
                &[1, 1, 1],
                &[],
                CpOptions::default(),
            )?)
        } else {
            None
        };
        let before = malloc_in_use();
        let logits = model.call_with([&ids, &positions], |m, [ids, positions]| {
            m.forward(ids, positions)
        });
        let loss = logits
            .view([-1, T_VOCAB])
            .cross_entropy_for_logits(&targets.view([-1]));
        let f = ms(t0);
        let kept_bytes = malloc_in_use() - before;
        let t1 = Instant::now();
        loss.f_backward()?;
        drop(region);
        let b = ms(t1);
        opt.step();
        if i >= args.warmup {
            steps.push(ms(t0));
            fwd.push(f);
            bwd.push(b);
            kept.push(kept_bytes);
        }
    }
    let window = Window {
        wall_ms: ms(wall0),
        cpu_ms: cpu_ms() - cpu0,
        machine_busy_ms: machine_busy_ms() - busy0,
    };
    let (peak, current) = rss_mib();
    let out = serde_json::json!({
        "cpu_ms": window.cpu_ms / args.steps as f64,
        "window": window.json(),
        "impl": "tch-dist",
        "mode": "cp",
        "model": "transformer_cp",
        "seq_len": seq_len,
        "rank": rank,
        "world": world,
        "threads": tch::get_num_threads(),
        "median_ms": median(&steps),
        "fwd_ms": median(&fwd),
        "bwd_ms": median(&bwd),
        "forward_kept_bytes": median(&kept),
        "peak_rss_mib": peak,
        "rss_mib": current,
        "steps_ms": steps,
    });
    println!("BENCH {out}");
    pg.barrier()?;
    Ok(())
}
