//! `--mode pipeline`: the transformer as 2 pipeline stages, one per rank (`Schedule1F1B`, or
//! `ScheduleInterleavedZeroBubble` with `--schedule zb`; `--microbatches N`), as
//! bench/pytorch_pipeline.py splits PyTorch's: stage 0 the token and position embeddings and
//! blocks 0-2, stage 1 blocks 3-5, the final LayerNorm and the head. With `--schedule zbv`
//! (`ScheduleZBVZeroBubble`) 4 stages in the V placement, 3 blocks per rank: rank 0 stage 0
//! (the embeddings, blocks 0-1) and stage 3 (block 5, the LayerNorm and the head), rank 1
//! stage 1 (block 2) and stage 2 (blocks 3-4).
//!
//! The measured bubble is each rank's idle share of its step against its busy share:
//! (wall - CPU time) / CPU time over the timed steps (one torch thread per rank, so a rank's
//! CPU time is its compute and its communication's own work), next to the schedule's
//! theoretical (p - 1) / m.

use std::ops::Range;

use super::*;
use tch_dist::pipelining::{
    PipelineError, PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
};

/// One stage's part of the transformer: the other stage's layers `None` (the whole
/// model's FQNs).
#[derive(Debug, Shardable)]
struct TransformerStage {
    tok: Option<nn::Embedding>,
    pos: Option<nn::Embedding>,
    blocks: Vec<Option<Block>>,
    ln_f: Option<nn::LayerNorm>,
    head: Option<nn::Linear>,
    #[shardable(skip)]
    positions: Tensor,
    #[shardable(skip)]
    mask: Tensor,
}

impl TransformerStage {
    /// A stage holding blocks `mine`, the embeddings if `first`, the final LayerNorm and the
    /// head if `last`, built as `Transformer::new` builds the whole (the same paths and
    /// shapes).
    fn new(p: &nn::Path, mine: Range<usize>, first: bool, last: bool) -> TransformerStage {
        let dev = p.device();
        TransformerStage {
            tok: first.then(|| nn::embedding(p / "tok", T_VOCAB, T_DIM, Default::default())),
            pos: first.then(|| nn::embedding(p / "pos", T_SEQ, T_DIM, Default::default())),
            blocks: (0..T_BLOCKS)
                .map(|i| {
                    mine.contains(&i)
                        .then(|| Block::new(p / "blocks" / i, T_DIM, T_HEADS))
                })
                .collect(),
            ln_f: last.then(|| nn::layer_norm(p / "ln_f", vec![T_DIM], Default::default())),
            head: last.then(|| nn::linear(p / "head", T_DIM, T_VOCAB, Default::default())),
            positions: Tensor::arange(T_SEQ, (Kind::Int64, dev)),
            mask: Tensor::ones([T_SEQ, T_SEQ], (Kind::Bool, dev)).triu(1),
        }
    }
}

impl Module for TransformerStage {
    /// Token ids `[batch, seq]` (stage 0) or activations `[batch, seq, dim]` to activations
    /// or logits `[batch, seq, vocab]` (stage 1).
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut x = match (&self.tok, &self.pos) {
            (Some(tok), Some(pos)) => tok.call(xs) + pos.call(&self.positions),
            _ => xs.shallow_clone(),
        };
        for b in self.blocks.iter().flatten() {
            x = b.forward(&x, Some(&self.mask));
        }
        match (&self.ln_f, &self.head) {
            (Some(ln_f), Some(head)) => head.call(&ln_f.call(&x)),
            _ => x,
        }
    }
}

/// Each stage's blocks of `num_stages` (2, or 4 in the V): (stage, blocks, first, last).
fn split(num_stages: usize) -> Vec<(usize, Range<usize>, bool, bool)> {
    let half = T_BLOCKS / 2;
    if num_stages == 2 {
        vec![(0, 0..half, true, false), (1, half..T_BLOCKS, false, true)]
    } else {
        vec![
            (0, 0..2, true, false),
            (1, 2..3, false, false),
            (2, 3..5, false, false),
            (3, 5..T_BLOCKS, false, true),
        ]
    }
}

/// The schedule benchmarked.
enum Schedule {
    OneFOneB(Schedule1F1B<TransformerStage>),
    ZeroBubble(ScheduleInterleavedZeroBubble<TransformerStage>),
    ZeroBubbleV(ScheduleZBVZeroBubble<TransformerStage>),
}

impl Schedule {
    fn step(
        &mut self,
        x: Option<&Tensor>,
        y: Option<&Tensor>,
        losses: &mut Vec<Tensor>,
    ) -> Result<(), PipelineError> {
        match self {
            Schedule::OneFOneB(s) => s.step(x, y, losses),
            Schedule::ZeroBubble(s) => s.step(x, y, losses),
            Schedule::ZeroBubbleV(s) => s.step(x, y, losses),
        }
    }
}

pub(crate) fn pipeline(args: &Args, pg: ProcessGroup) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, world) = (pg.rank(), pg.world_size());
    if world != 2 || args.model != "transformer" {
        return Err("--mode pipeline: the transformer on 2 ranks (one stage each)".into());
    }
    tch::manual_seed(0);
    let vs = nn::VarStore::new(args.device);
    let v = args.schedule == "zbv";
    let num_stages = if v { 4 } else { 2 };
    // This rank's stages: its own (loop), or r and 3 - r (the V).
    let held = if v { vec![rank, 3 - rank] } else { vec![rank] };
    let mut stages: Vec<_> = split(num_stages)
        .into_iter()
        .filter(|(s, ..)| held.contains(s))
        .map(|(s, blocks, first, last)| {
            let part = TransformerStage::new(&vs.root(), blocks, first, last);
            PipelineStage::new(part, s, num_stages, args.device, &pg)
        })
        .collect();
    let n_params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    let mut opt = nn::Sgd::default().build(&vs, if args.lr > 0.0 { args.lr } else { 0.01 })?;
    let m = args.microbatches;
    let loss = |out: &Tensor, y: &Tensor| {
        out.view([-1, T_VOCAB])
            .cross_entropy_for_logits(&y.view([-1]))
    };
    let mut schedule = match args.schedule.as_str() {
        "1f1b" => Schedule::OneFOneB(Schedule1F1B::new(stages.remove(0), m, loss)?),
        "zb" => Schedule::ZeroBubble(ScheduleInterleavedZeroBubble::new(stages, m, loss)?),
        "zbv" => Schedule::ZeroBubbleV(ScheduleZBVZeroBubble::new(stages, m, loss)?),
        other => return Err(format!("--schedule {other:?}: 1f1b, zb or zbv").into()),
    };
    let batch = if args.batch > 0 { args.batch } else { 8 };
    tch::manual_seed(1);
    let (x, target) = Transformer::batch(&args.model, batch, args.device)?;
    // Rank 0 holds the first stage; the last is rank 1's, or rank 0's in the V.
    let (first, last) = (rank == 0, if v { rank == 0 } else { rank == 1 });
    let mut steps = vec![];
    let mut busy = vec![];
    pg.barrier()?;
    let (mut cpu0, mut machine0, mut wall0) = (0.0, 0.0, Instant::now());
    for i in 0..args.warmup + args.steps {
        if i == args.warmup {
            (cpu0, machine0, wall0) = (cpu_ms(), machine_busy_ms(), Instant::now());
        }
        let (t0, c0) = (Instant::now(), cpu_ms());
        opt.zero_grad();
        let mut losses = Vec::new();
        schedule.step(first.then_some(&x), last.then_some(&target), &mut losses)?;
        opt.step();
        if i >= args.warmup {
            steps.push(ms(t0));
            busy.push(cpu_ms() - c0);
        }
    }
    let window = Window {
        wall_ms: ms(wall0),
        cpu_ms: cpu_ms() - cpu0,
        machine_busy_ms: machine_busy_ms() - machine0,
    };
    let (peak, current) = rss_mib();
    let (step, cpu) = (median(&steps), median(&busy));
    let out = serde_json::json!({
        "cpu_ms": window.cpu_ms / args.steps as f64,
        "window": window.json(),
        "impl": "tch-dist",
        "mode": "pipeline",
        "tag": args.tag,
        "model": args.model,
        "params": n_params,
        "batch": batch,
        "microbatches": m,
        "schedule": args.schedule,
        "stages": num_stages,
        "rank": rank,
        "world": world,
        "threads": tch::get_num_threads(),
        "median_ms": step,
        "busy_ms": cpu,
        "bubble": (step - cpu).max(0.0) / cpu,
        "peak_rss_mib": peak,
        "rss_mib": current,
        "steps_ms": steps,
    });
    println!("BENCH {out}");
    pg.barrier()?;
    Ok(())
}
