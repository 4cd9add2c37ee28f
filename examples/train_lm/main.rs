//! A small Llama-style language model (torchtitan's Llama at toy size: model.rs) trained on
//! real English text (scikit-learn's dataset descriptions, byte tokens: data.rs) with
//! FSDP x TP on a 2-D mesh, in PyTorch's (torchtitan's) order:
//!
//! 1. `init_device_mesh("cpu", &[dp, tp], &["dp", "tp"])`;
//! 2. `parallelize_module` over the mesh's `tp` dim with torchtitan's plan (a vocab-parallel
//!    embedding, column-parallel q/k/v and w1/w3, row-parallel wo and w2, a column-parallel
//!    output gathered);
//! 3. `fully_shard` over its `dp` dim on each layer, then on the root.
//!
//! With `--dp-replicate R` (and `--dp-shard S`, which `--dp` also sets), HSDP instead, as
//! torchtitan's `dp_replicate` x `dp_shard`: `init_device_mesh("cpu", &[R, S],
//! &["dp_replicate", "dp_shard"])` and `fully_shard` over both dims (each parameter sharded
//! over the S ranks of a replica, the replicas' gradients all-reduced), no tensor
//! parallelism (`--tp 1`: fully_shard's 2-D mesh is the whole world).
//!
//! **Across hosts**, ranks are numbered host by host and the mesh's last dim varies fastest:
//! `--dp 2 --tp 2` on 2 hosts of 2 ranks keeps each tp group within a host and all-reduces
//! across; `--dp-replicate 2 --dp-shard 2` shards within a host and replicates across, so that
//! only one all-reduce of each shard's gradients per step crosses the network.
//!
//! With `--sequence-parallel`, torchtitan's sequence parallelism too (`SequenceParallel` on
//! the norms, `PrepareModuleInput` on attention and the feed-forward, the embedding and
//! wo/w2 reduce-scattering along the sequence, the output gathering it: model.rs's
//! `tp_plan`): the same values, each tp rank holding its chunk of every sequence between
//! the tensor-parallel regions.
//!
//! With `--moe`, mixture-of-experts blocks in place of the dense feed-forward (8 experts
//! of width 64, top-2, one shared expert: `tch_dist::nn::moe`), the experts split over
//! `--ep N` of the dp ranks (default: all of them; expert parallelism, tokens exchanged
//! with an all-to-all), on torchtitan's mesh `[efsdp, ep, tp]` (dp = efsdp x ep): with ep
//! below dp, `fully_shard` shards each layer's experts over the efsdp ranks that hold the
//! same ones (chosen by the layer's `shard_placement_fn`, torchtitan's per-parameter meshes),
//! and the rest of the model over all dp ranks, as torchtitan does. With `--tp`,
//! attention and the output layer are tensor-parallel as without (`--loss-parallel` too)
//! and every tp rank runs the experts whole, or, with `--expert-tp`, its slice of each
//! expert's hidden width (torchtitan's `ExpertTensorParallel` over `[ep, tp]`). The
//! load-balancing bias moves before each optimizer step, and each epoch line adds the
//! experts' load (the busiest expert's tokens over the mean).
//!
//! With `--cp N`, context parallelism (torchtitan's `cp` dim): each sequence split over N
//! ranks (head-tail, so that causal attention's work is even), attention by ring attention
//! over them (`tch_dist::context_parallel`), the mesh `[dp, cp, tp]` in torchtitan's order,
//! tensor parallelism over `tp` as without, and fully_shard over `dp` and `cp` flattened
//! (`dp_cp`: the cp ranks hold the same weights but see other tokens), as torchtitan's
//! `dp_shard_cp`. The token ids, the targets and the RoPE tables are split alike for each
//! step and put back after it; the same values as without. It needs a `--seq-len` that
//! `2·N` divides, and none of `--dp-replicate`, `--moe`, `--loss-parallel`,
//! `--sequence-parallel`.
//!
//! With `--loss-parallel`, torchtitan's loss under tensor parallelism (PyTorch's
//! `loss_parallel()`): the output layer leaves each tp rank its columns of the logits and
//! `tch_dist::sharding::loss_parallel` computes the cross-entropy from them, so the whole
//! logits `[batch, seq, vocab]` are never gathered; the same values.
//!
//! Each dp rank trains on its `DistributedSampler` share of the sequences (the tp ranks of
//! one dp group see the same batch), with `tch_dist::optim::AdamW` and gradients clipped to
//! norm 1 (`utils::clip_grad_norm`: the norm of the whole model, summed over both mesh
//! dims). Rank 0 shows a progress bar per epoch, then one line per epoch,
//! `epoch E loss=L tokens/s=T peak_mem_mib=M` (the loss averaged over the dp groups, the
//! whole job's tokens per second, the largest peak resident set of any rank), and one line
//! per rank with its own figures. At the end every rank evaluates the test split through
//! the sharded model under `no_grad` and rank 0 prints `test_loss=X.XXXX` (the mean
//! next-token cross-entropy over the test split; the uniform guess scores ln(vocab)).
//!
//! `--metrics PATH` (default `target/train_lm/metrics.jsonl`): rank 0 writes one JSON object
//! per step, `{"step", "epoch", "loss", "tokens_per_s", "peak_mem_mib"}` (JSON lines: no
//! TensorBoard writer in the dependencies; `pandas.read_json(PATH, lines=True)` plots it).
//! `--checkpoint-dir DIR`: at the end the model is saved by `checkpoint::save` into
//! `DIR/step-NNNNNNNN`, every rank its own 2-D pieces, with the model's config and vocabulary
//! in `train_state.json`; PyTorch's `dcp.load(sd, storage_reader=HuggingFaceStorageReader(..))`
//! reads it into a plain PyTorch model (tests/examples/pytorch_load_lm.py; with `--moe`,
//! torchtitan's MoE blocks, the experts' 3-D weights whole whatever `--ep` split them).
//! `--hf-checkpoint FILE`: at the end rank 0 also writes the whole model as one safetensors
//! file under Hugging Face's names (Llama's, and DeepSeek-V3's for MoE blocks: each expert's
//! `gate_proj`, `up_proj`, `down_proj`), as torchtitan's `last_save_in_hf` does; PyTorch
//! loads it into a model of those names (tests/examples/pytorch_load_lm.py `--hf`).
//!
//! ```text
//! target/release/tch-dist-run --nproc-per-node 4 -- target/release/examples/train_lm \
//!     [--dp 2 --tp 2 | --dp-replicate 2 --dp-shard 2 --tp 1] [--epochs N] [--max-steps N] [--local-batch-size N] [--seq-len N] [--lr LR] \
//!     [--data PATH] [--metrics PATH] [--checkpoint-dir DIR] [--hf-checkpoint FILE] [--sequence-parallel] [--cp N]
//! ```
//!
//! `--dp-replicate` x `--dp` x `--tp` must be the number of ranks. A bad argument ends every rank with one
//! line, `error: ...`, and exit status 2 (no rank waits for another); any other failure with
//! one line and exit status 1.

use std::error::Error;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tch::{nn, Device, Kind, Reduction, Tensor};
use tch_dist::checkpoint;
use tch_dist::checkpoint::{SaveOptions, State};
use tch_dist::context_parallel::{context_parallel, CpOptions};
use tch_dist::data::{DistributedSampler, SamplerOptions};
use tch_dist::device_mesh::{init_device_mesh, DeviceMesh};
use tch_dist::fully_shard::{ShardPlacement, ShardPlacementFn};
use tch_dist::optim::AdamW;
use tch_dist::sharding::{
    loss_parallel, parallelize_module, ExpertParallel, ExpertTensorParallel, LossParallelOptions,
    ParallelizePlan,
};
use tch_dist::{
    fully_shard, init_process_group, Backend, Call, FsdpOptions, ProcessGroup, ReduceOp,
};

#[path = "../common/cli.rs"]
mod cli;
#[path = "../common/progress.rs"]
mod progress;
use progress::progress_bar;
mod data;
#[path = "../common/memory.rs"]
#[allow(dead_code)] // malloc_in_use: the peak resident set is the reading here
mod memory;
mod model;

use model::{Config, Transformer};

/// Test sequences per forward.
const EVAL_BATCH: i64 = 32;

struct Args {
    /// HSDP's replicas (torchtitan's `dp_replicate`); 1: FSDP over `dp` alone.
    dp_replicate: usize,
    /// The ranks each parameter is sharded over (torchtitan's `dp_shard`).
    dp: usize,
    tp: usize,
    epochs: usize,
    /// Stop after this many steps in all (0: no limit).
    max_steps: u64,
    /// Sequences per step on each dp rank (torchtitan's `local_batch_size`); a step trains
    /// on dp times as many.
    local_batch: i64,
    seq_len: i64,
    lr: f64,
    data: PathBuf,
    metrics: PathBuf,
    checkpoint_dir: Option<PathBuf>,
    /// A safetensors file of the whole model under Hugging Face's names.
    hf_checkpoint: Option<PathBuf>,
    /// torchtitan's sequence parallelism on top of the tensor parallelism.
    sequence_parallel: bool,
    /// The loss from each tp rank's columns of the logits (`loss_parallel`).
    loss_parallel: bool,
    /// Mixture-of-experts blocks, the experts split over the dp ranks.
    moe: bool,
    /// The ranks that split the experts (`None`: every dp rank).
    ep: Option<usize>,
    /// Each expert's hidden width split over the tp ranks too (`ExpertTensorParallel`).
    expert_tp: bool,
    /// Context-parallel ranks per sequence (torchtitan's `cp`).
    cp: usize,
}

/// A command line that cannot run: exit status 2, as for a flag that does not parse.
#[derive(Debug)]
struct Usage(String);

impl fmt::Display for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for Usage {}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        dp_replicate: 1,
        dp: 2,
        tp: 2,
        epochs: 16,
        max_steps: 0,
        local_batch: 16,
        seq_len: 64,
        lr: 1e-2,
        data: data::default_path(),
        metrics: PathBuf::from("target/train_lm/metrics.jsonl"),
        checkpoint_dir: None,
        hf_checkpoint: None,
        sequence_parallel: false,
        loss_parallel: false,
        moe: false,
        ep: None,
        expert_tp: false,
        cp: 1,
    };
    let mut flags = cli::Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--dp" | "--dp-shard" => a.dp = flags.parsed(&flag)?,
            "--dp-replicate" => a.dp_replicate = flags.parsed(&flag)?,
            "--tp" => a.tp = flags.parsed(&flag)?,
            "--epochs" => a.epochs = flags.parsed(&flag)?,
            "--max-steps" => a.max_steps = flags.parsed(&flag)?,
            "--local-batch-size" => a.local_batch = flags.parsed(&flag)?,
            "--seq-len" => a.seq_len = flags.parsed(&flag)?,
            "--lr" => a.lr = flags.parsed(&flag)?,
            "--data" => a.data = flags.value(&flag)?.into(),
            "--metrics" => a.metrics = flags.value(&flag)?.into(),
            "--checkpoint-dir" => a.checkpoint_dir = Some(flags.value(&flag)?.into()),
            "--hf-checkpoint" => a.hf_checkpoint = Some(flags.value(&flag)?.into()),
            "--sequence-parallel" => a.sequence_parallel = true,
            "--loss-parallel" => a.loss_parallel = true,
            "--moe" => a.moe = true,
            "--ep" => a.ep = Some(flags.parsed(&flag)?),
            "--expert-tp" => a.expert_tp = true,
            "--cp" => a.cp = flags.parsed(&flag)?,
            other => return Err(cli::unknown(other)),
        }
    }
    if a.dp == 0 || a.tp == 0 || a.dp_replicate == 0 || a.cp == 0 {
        return Err("--dp-replicate, --dp, --tp and --cp must be at least 1".into());
    }
    if a.cp > 1 && (a.dp_replicate > 1 || a.moe || a.loss_parallel || a.sequence_parallel) {
        return Err(format!(
            "--cp {} splits each sequence over a mesh of dp x cp x tp: it takes none of \
             --dp-replicate, --moe, --loss-parallel, --sequence-parallel (not there yet)",
            a.cp
        ));
    }
    // fully_shard's HSDP takes a 2-D mesh of the whole world: no third, tensor-parallel dim.
    if a.dp_replicate > 1 && a.tp > 1 {
        return Err(format!(
            "--dp-replicate {} (HSDP) with --tp {}: HSDP here is data parallel only; give \
             --tp 1, or --dp-replicate 1 for FSDP x TP",
            a.dp_replicate, a.tp
        ));
    }
    if a.loss_parallel && a.dp_replicate > 1 {
        return Err(
            "--loss-parallel splits the logits over the tp ranks: it needs FSDP x TP, \
             not --dp-replicate"
                .into(),
        );
    }
    if a.moe && (a.dp_replicate > 1 || a.sequence_parallel) {
        return Err(
            "--moe splits the experts over dp ranks and takes neither --dp-replicate nor \
             --sequence-parallel (HSDP and sequence parallelism with experts are not there yet)"
                .into(),
        );
    }
    if a.expert_tp && !(a.moe && a.tp > 1) {
        return Err(
            "--expert-tp splits the experts over the tp ranks: it needs --moe and --tp".into(),
        );
    }
    match (a.ep, a.moe) {
        (Some(_), false) => return Err("--ep splits the experts: it needs --moe".into()),
        (Some(ep), true) if ep == 0 || !a.dp.is_multiple_of(ep) => {
            return Err(format!(
                "--ep {ep} must divide --dp {} (expert parallelism borrows its ranks from dp)",
                a.dp
            ))
        }
        _ => {}
    }
    if a.epochs == 0 {
        return Err("--epochs must be at least 1".into());
    }
    if a.local_batch <= 0 {
        return Err("--local-batch-size must be at least 1".into());
    }
    if a.seq_len < 1 {
        return Err("--seq-len must be at least 1".into());
    }
    // Each tp rank holds an even chunk of every sequence between the tensor-parallel
    // regions (PyTorch refuses uneven ones too).
    if a.sequence_parallel && a.seq_len % a.tp as i64 != 0 {
        return Err(format!(
            "--sequence-parallel splits each sequence over the {} tp ranks: --seq-len {} \
             must be a multiple of --tp",
            a.tp, a.seq_len
        ));
    }
    // Head-tail load balancing: 2·cp equal chunks per sequence.
    if a.cp > 1 && a.seq_len % (2 * a.cp as i64) != 0 {
        return Err(format!(
            "--cp {} splits each sequence into {} chunks (head-tail): --seq-len {} must be a \
             multiple of {}",
            a.cp,
            2 * a.cp,
            a.seq_len,
            2 * a.cp
        ));
    }
    if !(a.lr.is_finite() && a.lr > 0.0) {
        return Err(format!("--lr {} must be a positive number", a.lr));
    }
    Ok(a)
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let result = run(&args);
    tch_dist::destroy_process_group();
    if let Err(e) = result {
        eprintln!("error: {}", tch_dist::report(&*e));
        std::process::exit(if e.is::<Usage>() { 2 } else { 1 });
    }
}

/// `loss.backward()` with failures as values: a collective that failed during backward (a
/// dead peer) is fully_shard's typed error, naming the module.
fn backward(model: &Transformer, loss: &Tensor) -> Result<(), Box<dyn Error>> {
    if let Err(text) = loss.f_backward() {
        let state = tch_dist::fully_shard::state(model);
        return Err(match state.and_then(|s| s.take_backward_error()) {
            Some(typed) => typed.into(),
            None => text.into(),
        });
    }
    Ok(())
}

/// Where a MoE model's experts live: the ranks that split them, and the ones that hold the
/// same experts and shard them (when ep is below dp).
struct ExpertMeshes {
    /// `ep`, or `[ep, tp]` with `--expert-tp`.
    ep: DeviceMesh,
    /// The style on each layer's experts over it.
    plan: ParallelizePlan,
    efsdp: Option<DeviceMesh>,
}

/// How the loss is computed from the model's logits.
enum Loss {
    /// From the whole logits, on every tp rank.
    Whole,
    /// From this tp rank's columns of the logits (`loss_parallel` over the tp group).
    Parallel(ProcessGroup),
}

impl Loss {
    /// The next-token cross-entropy of `logits` `[batch, seq, vocab or this rank's part]`
    /// against `targets` `[batch, seq]` (`reduction`: mean, or the sum for the test loss's
    /// running total).
    fn of(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        reduction: Reduction,
    ) -> Result<Tensor, Box<dyn Error>> {
        let classes = logits.size()[2];
        let (logits, targets) = (logits.reshape([-1, classes]), targets.reshape([-1]));
        Ok(match self {
            Loss::Whole => {
                logits.cross_entropy_loss::<Tensor>(&targets, None, reduction, -100, 0.0)
            }
            Loss::Parallel(tp_group) => {
                let opts = LossParallelOptions {
                    reduction,
                    ..Default::default()
                };
                loss_parallel(&logits, &targets, tp_group, &opts)?
            }
        })
    }
}

/// A rank's figures for one epoch.
#[derive(Clone, Copy)]
struct EpochFigures {
    /// Its dp group's mean training loss.
    loss: f64,
    /// Tokens its model replica trained on per second.
    tokens_per_s: f64,
    /// Its peak resident set so far (VmHWM).
    peak_mem_mib: f64,
}

fn run(args: &Args) -> Result<(), Box<dyn Error>> {
    cli::one_thread_per_rank();
    let pg = init_process_group(Backend::Gloo)?;
    let (rank, world) = (pg.rank(), pg.world_size());
    // Every rank sees the same sizes and refuses alike, before any collective that a
    // mismatched mesh would leave waiting.
    // The data-parallel ranks: replicas times shards.
    let dp = args.dp_replicate * args.dp;
    if dp * args.tp * args.cp != world && args.cp > 1 {
        return Err(Usage(format!(
            "--dp {} x --cp {} x --tp {} is {} ranks, but this job has {world} (WORLD_SIZE); \
             pick --dp, --cp and --tp whose product is {world}",
            args.dp,
            args.cp,
            args.tp,
            dp * args.cp * args.tp
        ))
        .into());
    }
    if dp * args.tp != world && args.cp == 1 {
        let (replicas, and) = match args.dp_replicate {
            1 => (String::new(), "--dp and --tp"),
            r => (
                format!("--dp-replicate {r} x "),
                "--dp-replicate, --dp and --tp",
            ),
        };
        return Err(Usage(format!(
            "{replicas}--dp {} x --tp {} is {} ranks, but this job has {world} (WORLD_SIZE); \
             pick {and} whose product is {world}",
            args.dp,
            args.tp,
            dp * args.tp
        ))
        .into());
    }

    let corpus = data::load(&args.data)?;
    let config = Config::tiny(corpus.vocab.len() as i64, args.seq_len);
    let config = if args.moe { config.with_moe() } else { config };
    if config.n_heads % args.tp as i64 != 0 {
        return Err(Usage(format!(
            "--tp {} does not divide the model's {} attention heads",
            args.tp, config.n_heads
        ))
        .into());
    }
    let (x_train, y_train) = data::sequences(&corpus.train, args.seq_len);
    let (x_test, y_test) = data::sequences(&corpus.test, args.seq_len);
    let n_train = x_train.size()[0];
    if n_train == 0 || x_test.size()[0] == 0 {
        return Err(Usage(format!(
            "--seq-len {} leaves no whole sequence in the training or the test split",
            args.seq_len
        ))
        .into());
    }

    // fully_shard's mesh (1-D, or HSDP's 2-D), the tensor-parallel one (None for HSDP), and
    // every data-parallel rank as one dim (the sampler's replicas, the loss's mean).
    let mut cp_group = None;
    let mut expert_meshes = None;
    let (fsdp_mesh, tp_mesh, dp_mesh) = if args.cp > 1 {
        // torchtitan's order and its dp_shard_cp: fully_shard over dp and cp, the batch over
        // dp only, heads over tp.
        let mesh = init_device_mesh("cpu", &[args.dp, args.cp, args.tp], &["dp", "cp", "tp"])?;
        cp_group = Some(mesh.dim("cp")?.get_group("cp")?.clone());
        let tp_mesh = if args.tp > 1 {
            Some(mesh.dim("tp")?)
        } else {
            None
        };
        let dp_cp = mesh.slice(&["dp", "cp"])?.flatten(Some("dp_cp"))?;
        (dp_cp, tp_mesh, mesh.dim("dp")?)
    } else if args.moe {
        // torchtitan's expert parallelism borrows its ranks from dp: dp = efsdp x ep.
        let ep = args.ep.unwrap_or(args.dp);
        let shape = [args.dp / ep, ep, args.tp];
        let mesh = init_device_mesh("cpu", &shape, &["efsdp", "ep", "tp"])?;
        expert_meshes = Some(ExpertMeshes {
            ep: if args.expert_tp {
                mesh.slice(&["ep", "tp"])?
            } else {
                mesh.dim("ep")?
            },
            plan: if args.expert_tp {
                ParallelizePlan::new().style("", ExpertTensorParallel)
            } else {
                ParallelizePlan::new().style("", ExpertParallel)
            },
            efsdp: if args.dp > ep {
                Some(mesh.dim("efsdp")?)
            } else {
                None
            },
        });
        let dp_mesh = mesh.slice(&["efsdp", "ep"])?.flatten(Some("dp"))?;
        (dp_mesh.clone(), Some(mesh.dim("tp")?), dp_mesh)
    } else if args.dp_replicate > 1 {
        let dims = ["dp_replicate", "dp_shard"];
        let mesh = init_device_mesh("cpu", &[args.dp_replicate, args.dp], &dims)?;
        let flat = mesh.flatten(Some("dp"))?;
        (mesh, None, flat)
    } else {
        let mesh = init_device_mesh("cpu", &[args.dp, args.tp], &["dp", "tp"])?;
        let dp_mesh = mesh.dim("dp")?;
        (dp_mesh.clone(), Some(mesh.dim("tp")?), dp_mesh)
    };
    let dp_group = dp_mesh.get_group("dp")?.clone();
    // The step's loss is the mean over these ranks (with cp, each holds a part of every
    // sequence; the tp ranks of a dp group hold the same loss).
    let (loss_group, loss_ranks) = match &cp_group {
        Some(_) => (fsdp_mesh.get_group("dp_cp")?.clone(), dp * args.cp),
        None => (dp_group.clone(), dp),
    };
    let dp_rank = dp_mesh.get_local_rank("dp")?;

    // The same seed on every rank: parallelize_module scatters each tp group's rank 0's
    // values and fully_shard keeps each rank's own piece of its values, so every rank must
    // start from the same model.
    tch::manual_seed(42);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut model = Transformer::new(&vs.root(), &config)?;
    tch_dist::check_against_var_store(&model, &vs)?;
    let numel = |vs: &nn::VarStore| -> i64 {
        vs.trainable_variables()
            .iter()
            .map(|t| t.numel() as i64)
            .sum()
    };
    let full_params = numel(&vs);
    let plan = model::tp_plan(&model::PlanFor {
        n_layers: config.n_layers,
        sequence_parallel: args.sequence_parallel,
        loss_parallel: args.loss_parallel,
        moe: args.moe,
    });
    let loss_of = match &tp_mesh {
        Some(tp_mesh) if args.loss_parallel => Loss::Parallel(tp_mesh.get_group("tp")?.clone()),
        _ => Loss::Whole,
    };
    if let (Some(tp_mesh), false) = (&tp_mesh, args.moe && args.tp == 1) {
        parallelize_module(&mut model, tp_mesh, &plan)?;
    }
    if let Some(experts) = &expert_meshes {
        // torchtitan's ExpertParallel (or ExpertTensorParallel) style on each layer's
        // experts: each ep rank keeps its experts (rank 0's values, narrowed).
        for layer in &mut model.layers {
            if let Some(moe) = layer.moe.as_mut() {
                parallelize_module(&mut moe.experts, &experts.ep, &experts.plan)?;
            }
        }
    }
    // Each layer over dp; with ep below dp, its experts over the ranks that hold the same
    // ones (torchtitan's efsdp), chosen by the layer's shard_placement_fn (torchtitan's
    // per-parameter meshes); with ep = dp the layer's call leaves them to expert parallelism.
    let efsdp = expert_meshes.as_ref().and_then(|e| e.efsdp.clone());
    let layer_options = || FsdpOptions {
        mesh: Some(fsdp_mesh.clone()),
        shard_placement_fn: efsdp.clone().map(|efsdp| {
            ShardPlacementFn::with_mesh(move |fqn, _| {
                fqn.starts_with("moe.experts.").then(|| ShardPlacement {
                    dim: 0,
                    mesh: Some(efsdp.clone()),
                })
            })
        }),
        ..Default::default()
    };
    let over_dp = || FsdpOptions {
        mesh: Some(fsdp_mesh.clone()),
        ..Default::default()
    };
    for layer in &model.layers {
        fully_shard(layer, layer_options())?;
    }
    fully_shard(&model, over_dp())?;
    let local_params = numel(&vs);
    // Built after both: the optimizer sees (and keeps its state for) this rank's pieces.
    let adamw = AdamW {
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut opt = adamw.build(&vs, args.lr)?;

    let mut sampler = DistributedSampler::new(
        n_train as usize,
        SamplerOptions {
            num_replicas: Some(dp),
            rank: Some(dp_rank),
            seed: 1000,
            ..Default::default()
        },
    )?;
    let per = args.local_batch;
    let steps_per_epoch = (sampler.len() as i64 + per - 1) / per;
    let total_steps = match args.max_steps {
        0 => steps_per_epoch as u64 * args.epochs as u64,
        n => n.min(steps_per_epoch as u64 * args.epochs as u64),
    };
    let mut metrics = if rank == 0 {
        Some(metrics_file(&args.metrics)?)
    } else {
        None
    };
    if rank == 0 {
        println!(
            "training a Llama-style decoder ({full_params} parameters: dim {}, {} layers, {} \
             heads, ffn {}, vocab {} bytes) on {} byte tokens of scikit-learn's dataset \
             descriptions",
            config.dim,
            config.n_layers,
            config.n_heads,
            config.hidden_dim,
            config.vocab_size,
            corpus.train.size()[0],
        );
        println!(
            "{} x {}{} ({world} ranks), {local_params} parameters on this rank; {n_train} \
             sequences of {} tokens, {per} per dp rank and step ({} per step), \
             {steps_per_epoch} steps per epoch, {total_steps} in all",
            if args.dp_replicate > 1 {
                format!("dp_replicate {} x dp_shard {}", args.dp_replicate, args.dp)
            } else {
                format!("dp {}", args.dp)
            },
            match (args.cp, args.tp) {
                (1, tp) => format!("tp {tp}"),
                (cp, 1) => format!("cp {cp}"),
                (cp, tp) => format!("cp {cp} x tp {tp}"),
            },
            match (args.sequence_parallel, args.loss_parallel, args.moe) {
                (_, lp, true) => format!(
                    " with mixture of experts (8 experts, top-2, one shared; expert-parallel \
                     over ep {}{}{}){}",
                    args.ep.unwrap_or(args.dp),
                    if args.expert_tp {
                        format!(", each expert's width over tp {}", args.tp)
                    } else {
                        String::new()
                    },
                    match args.dp / args.ep.unwrap_or(args.dp) {
                        1 => String::new(),
                        efsdp => format!(", sharded over efsdp {efsdp}"),
                    },
                    if lp { " and loss parallelism" } else { "" }
                ),
                (true, true, _) => " with sequence and loss parallelism".into(),
                (true, false, _) => " with sequence parallelism".into(),
                (false, true, _) => " with loss parallelism".into(),
                (false, false, _) => String::new(),
            },
            args.seq_len,
            per * dp as i64,
        );
    }

    let start = Instant::now();
    let mut global = 0u64;
    let mut epochs_run = 0;
    for epoch in 0..args.epochs {
        if global >= total_steps {
            break;
        }
        epochs_run = epoch + 1;
        sampler.set_epoch(epoch as u64);
        let order = Tensor::from_slice(&sampler.indices()?);
        let steps = (steps_per_epoch as u64).min(total_steps - global);
        let bar =
            (rank == 0).then(|| progress_bar(steps, format!("{}/{}", epoch + 1, args.epochs)));
        let epoch_start = Instant::now();
        let (mut own_loss_sum, mut own_tokens) = (0f64, 0i64);
        // Tokens each expert took this epoch on this rank (all MoE blocks summed).
        let experts = config.moe.as_ref().map_or(1, |m| m.experts);
        let mut expert_tokens = Tensor::zeros([experts], (Kind::Float, Device::Cpu));
        for step in 0..steps as i64 {
            let step_start = Instant::now();
            // The same on every rank: a rank off by a step fails every rank (the step check).
            tch_dist::set_step(global);
            let lo = step * per;
            let mine = order.narrow(0, lo, per.min(sampler.len() as i64 - lo));
            let (inputs, targets) = (
                x_train.index_select(0, &mine),
                y_train.index_select(0, &mine),
            );
            opt.set_lr(args.lr * lr_factor(global, total_steps))?;
            opt.zero_grad();
            // With --cp, this rank's part of each sequence (head-tail) until the end of the
            // backward: the tokens, their targets and the positions' RoPE angles alike.
            let cp_region = match &cp_group {
                Some(cp) => {
                    let mut buffers = vec![&inputs, &targets];
                    buffers.extend(model.rope_tables());
                    // The tokens and targets along dim 1, the tables along dim 0.
                    let dims: Vec<i64> = (0..buffers.len()).map(|i| i64::from(i < 2)).collect();
                    Some(context_parallel(
                        cp,
                        &buffers,
                        &dims,
                        &[],
                        CpOptions::default(),
                    )?)
                }
                None => None,
            };
            let loss = loss_of.of(&model.f_call(&inputs)?, &targets, Reduction::Mean)?;
            backward(&model, &loss)?;
            drop(cp_region);
            tch_dist::utils::clip_grad_norm(&model, 1.0, 2.0)?;
            // torchtitan's optimizer pre-hook: each MoE block's bias from the step's counts,
            // summed over the dp ranks (the load figure keeps this rank's own).
            for moe in model.layers.iter().filter_map(|l| l.moe.as_ref()) {
                expert_tokens += moe.tokens_per_expert();
                moe.update_expert_bias(Some(&dp_group))?;
            }
            opt.step()?;
            // The step's loss over the whole batch: the mean of the dp groups' (Gloo has no
            // average: a sum, divided).
            let own = loss.double_value(&[]);
            let mean = loss.detach().reshape([1]);
            loss_group.all_reduce(&mean, ReduceOp::Sum)?;
            let loss = mean.double_value(&[0]) / loss_ranks as f64;
            global += 1;
            own_loss_sum += own;
            own_tokens += inputs.numel() as i64;
            let step_tokens = (inputs.numel() * dp) as f64;
            let tokens_per_s = step_tokens / step_start.elapsed().as_secs_f64();
            if let Some(file) = &mut metrics {
                let line = serde_json::json!({
                    "step": global,
                    "epoch": epoch + 1,
                    "loss": loss,
                    "tokens_per_s": tokens_per_s,
                    "peak_mem_mib": memory::rss_mib().0,
                });
                // One line per step, flushed: a plot of the file may follow the run.
                writeln!(file, "{line}").and_then(|()| file.flush())?;
            }
            if let Some(b) = &bar {
                b.set_message(format!("loss {loss:.4} {tokens_per_s:.0} tokens/s"));
                b.inc(1);
            }
        }
        if let Some(b) = bar {
            // Dropped here: drawn as lines, its last state is written now, before the
            // epoch's figures.
            b.finish();
        }
        let mine = EpochFigures {
            loss: own_loss_sum / steps as f64,
            tokens_per_s: own_tokens as f64 / epoch_start.elapsed().as_secs_f64(),
            peak_mem_mib: memory::rss_mib().0,
        };
        let all = gather_figures(&pg, mine)?;
        // The experts' load: the busiest expert's tokens over the mean (1: balanced).
        let load = if args.moe {
            dp_group.all_reduce(&expert_tokens, ReduceOp::Sum)?;
            let mean = expert_tokens.mean(Kind::Float).double_value(&[]);
            format!(
                " expert_load={:.3}",
                expert_tokens.max().double_value(&[]) / mean.max(1e-9)
            )
        } else {
            String::new()
        };
        if rank == 0 {
            // The job's figures: every dp group's tokens (the tp ranks of a group share
            // theirs), the mean of the groups' losses, the largest peak.
            // A dp group's ranks (tp or cp) are consecutive; with cp, each holds the loss
            // of its part of the tokens, alike in size: the mean over every rank is the job's.
            let per_dp = args.tp * args.cp;
            let job_tokens: f64 = (0..dp).map(|d| all[d * per_dp].tokens_per_s).sum();
            let loss = all.iter().map(|f| f.loss).sum::<f64>() / all.len() as f64;
            let peak = all.iter().map(|f| f.peak_mem_mib).fold(0.0, f64::max);
            println!(
                "epoch {} loss={loss:.4} tokens/s={job_tokens:.0} peak_mem_mib={peak:.1}{load}",
                epoch + 1
            );
            for (r, f) in all.iter().enumerate() {
                let within = match (args.cp, args.tp) {
                    (1, tp) => format!("tp {}", r % tp),
                    (cp, 1) => format!("cp {}", r % cp),
                    (_, tp) => format!("cp {}, tp {}", r % per_dp / tp, r % tp),
                };
                println!(
                    "  rank {r} (dp {}, {within}): loss={:.4} tokens/s={:.0} peak_mem_mib={:.1}",
                    r / per_dp,
                    f.loss,
                    f.tokens_per_s,
                    f.peak_mem_mib
                );
            }
        }
    }

    // Every rank runs the sharded model over the whole test split (each forward is a
    // collective: layers gathered over dp, partial sums reduced over tp); no_grad: no
    // backward follows.
    let test_loss = {
        let _guard = tch::no_grad_guard();
        let (mut sum, mut count) = (0f64, 0i64);
        let (xs, ys) = (x_test.split(EVAL_BATCH, 0), y_test.split(EVAL_BATCH, 0));
        for (x, y) in xs.iter().zip(&ys) {
            let logits = model.f_call(x)?;
            sum += loss_of.of(&logits, y, Reduction::Sum)?.double_value(&[]);
            count += y.numel() as i64;
        }
        sum / count as f64
    };
    if rank == 0 {
        println!(
            "trained {global} steps in {:.1} s; test tokens {}, uniform guess ln({}) = {:.4}",
            start.elapsed().as_secs_f64(),
            x_test.numel(),
            config.vocab_size,
            (config.vocab_size as f64).ln()
        );
        println!("test_loss={test_loss:.4}");
    }

    if let Some(parent) = &args.checkpoint_dir {
        let dir = parent.join(format!("step-{global:08}"));
        let vocab: Vec<u32> = corpus.vocab.iter().map(|&b| b as u32).collect();
        let state = State::new(&model).with_train_state(serde_json::json!({
            "step": global,
            "epoch": epochs_run,
            "config": config,
            "vocab": vocab,
            "test_loss": test_loss,
        }));
        checkpoint::save(&dir, &state, &pg, &SaveOptions::default())?;
        if rank == 0 {
            println!("saved checkpoint {}", dir.display());
        }
    }
    if let Some(path) = &args.hf_checkpoint {
        // Every rank gathers (a collective); rank 0 writes.
        let full = tch_dist::state_dict::full_state_dict(&model)?;
        if rank == 0 {
            let hf = model::hf_state_dict(&config, &full)?;
            Tensor::write_safetensors(&hf, path)?;
            println!("saved HF checkpoint {}", path.display());
        }
    }
    Ok(())
}

/// torchtitan's schedule (`lr_scheduler.py`: linear warmup, then decay): the learning
/// rate's factor at step `step` (0-based) of `total`: a linear warmup over the first 5% of
/// the steps (at least one), then a cosine decay to a tenth.
fn lr_factor(step: u64, total: u64) -> f64 {
    let warmup = (total / 20).max(1);
    if step < warmup {
        return (step + 1) as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (total - warmup).max(1) as f64;
    0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The metrics file, created (with its folder) or emptied.
fn metrics_file(path: &Path) -> Result<std::io::BufWriter<std::fs::File>, Box<dyn Error>> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("--metrics: cannot create {}: {e}", parent.display()))?;
    }
    let file = std::fs::File::create(path)
        .map_err(|e| format!("--metrics: cannot create {}: {e}", path.display()))?;
    Ok(std::io::BufWriter::new(file))
}

/// Every rank's figures, in rank order (one all-gather over the world).
fn gather_figures(
    pg: &tch_dist::ProcessGroup,
    mine: EpochFigures,
) -> Result<Vec<EpochFigures>, Box<dyn Error>> {
    let world = pg.world_size() as i64;
    let local = Tensor::from_slice(&[mine.loss, mine.tokens_per_s, mine.peak_mem_mib]);
    let all = Tensor::zeros([world * 3], (Kind::Double, Device::Cpu));
    pg.all_gather_into_tensor(&all, &local)?;
    let v: Vec<f64> = Vec::try_from(&all)?;
    Ok(v.chunks(3)
        .map(|c| EpochFigures {
            loss: c[0],
            tokens_per_s: c[1],
            peak_mem_mib: c[2],
        })
        .collect())
}
