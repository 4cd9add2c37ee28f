//! Sequence parallelism through `parallelize_module` (PyTorch's `SequenceParallel`,
//! `PrepareModuleInput`/`PrepareModuleOutput`, `RowwiseParallel(output_layouts=Shard(1))`,
//! `ColwiseParallel(input_layouts=Shard(1))`): a small Llama-style model under torchtitan's
//! plan trains like one process; bypassed hooks; the refusals.

use std::collections::BTreeMap;

use super::*;
use tch_dist::device_mesh::{init_device_mesh, DeviceMesh};
use tch_dist::sharding::{
    parallelize_module, ColwiseParallel, Layout, ParallelizePlan, PrepareModuleInput,
    PrepareModuleOutput, RowwiseParallel, SequenceParallel, ShardState,
};
use tch_dist::CallWith;

#[path = "../common/unchanged.rs"]
mod unchanged;

/// Vocabulary (11 rows: 6 and 5 over tp 2), model width (4 heads of 2), MLP width, batch.
const VOCAB: i64 = 11;
const WIDTH: i64 = 8;
const HIDDEN: i64 = 12;
const BATCH: i64 = 2;
/// Each head's width: a rank's columns of the projections hold whole heads.
const HEAD_DIM: i64 = 2;

/// Llama's RMSNorm (no bias, no buffers): `x / rms(x) * weight`.
#[derive(Debug, Shardable)]
struct RmsNorm {
    #[shardable(param)]
    weight: Tensor,
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        let ms = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        x * (ms + 1e-5).rsqrt() * &self.weight
    }
}

#[derive(Debug, Shardable)]
struct Attention {
    wq: nn::Linear,
    wk: nn::Linear,
    wv: nn::Linear,
    wo: nn::Linear,
}

impl Attention {
    /// Causal multi-head attention over `[batch, seq, width]`, `mask` `[seq, seq]` added to
    /// the scores; the projections' local columns hold this rank's heads.
    fn forward(&self, x: &Tensor, mask: &Tensor) -> Tensor {
        let (q, k, v) = (self.wq.call(x), self.wk.call(x), self.wv.call(x));
        let (b, t, w) = q.size3().unwrap();
        let heads = |x: &Tensor| x.view([b, t, w / HEAD_DIM, HEAD_DIM]).transpose(1, 2);
        let (q, k, v) = (heads(&q), heads(&k), heads(&v));
        let scores = q.matmul(&k.transpose(-2, -1)) / (HEAD_DIM as f64).sqrt() + mask;
        let ctx = scores.softmax(-1, Kind::Float).matmul(&v);
        self.wo
            .call(&ctx.transpose(1, 2).contiguous().view([b, t, w]))
    }
}

/// Llama's SwiGLU MLP: `w2(silu(w1(x)) * w3(x))`.
#[derive(Debug, Shardable)]
struct FeedForward {
    w1: nn::Linear,
    w2: nn::Linear,
    w3: nn::Linear,
}

impl Module for FeedForward {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.w2.call(&(self.w1.call(x).silu() * self.w3.call(x)))
    }
}

/// How the model calls a layer: through its hooks, or bypassing them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bypass {
    Nothing,
    /// `attn_norm.forward(x)`: a sequence-parallel norm, which computes the same.
    Norm,
    /// `attn.forward(x, mask)`: a prepared block, whose layers would see the wrong layout.
    Attention,
}

/// One Llama block between a token embedding and an output head.
#[derive(Debug, Shardable)]
struct Llama {
    tok: nn::Embedding,
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: nn::LayerNorm,
    ffn: FeedForward,
    norm: RmsNorm,
    head: nn::Linear,
    #[shardable(skip)]
    bypass: Bypass,
}

impl Module for Llama {
    fn forward(&self, ids: &Tensor) -> Tensor {
        let t = ids.size()[1];
        let mask = Tensor::ones([t, t], (Kind::Float, Device::Cpu)).triu(1) * -1e9;
        let h = self.tok.call(ids);
        let x = match self.bypass {
            Bypass::Norm => self.attn_norm.forward(&h),
            _ => self.attn_norm.call(&h),
        };
        let a = match self.bypass {
            Bypass::Attention => self.attn.forward(&x, &mask),
            _ => self
                .attn
                .call_with([&x, &mask], |a, [x, mask]| a.forward(x, mask)),
        };
        let h = h + a;
        let h = &h + self.ffn.call(&self.ffn_norm.call(&h));
        self.head.call(&self.norm.call(&h))
    }
}

fn llama(vs: &nn::VarStore, bypass: Bypass) -> Llama {
    let p = vs.root();
    let linear = |p: nn::Path, i, o| nn::linear(p, i, o, Default::default());
    // Norm weights away from 1, so that a missing or doubled gradient sum shows.
    let rms = |p: nn::Path| RmsNorm {
        weight: p.var("weight", &[WIDTH], nn::Init::Uniform { lo: 0.5, up: 1.5 }),
    };
    let a = &p / "attn";
    let f = &p / "ffn";
    Llama {
        tok: nn::embedding(&p / "tok", VOCAB, WIDTH, Default::default()),
        attn_norm: rms(&p / "attn_norm"),
        attn: Attention {
            wq: linear(&a / "wq", WIDTH, WIDTH),
            wk: linear(&a / "wk", WIDTH, WIDTH),
            wv: linear(&a / "wv", WIDTH, WIDTH),
            wo: linear(&a / "wo", WIDTH, WIDTH),
        },
        ffn_norm: nn::layer_norm(&p / "ffn_norm", vec![WIDTH], Default::default()),
        ffn: FeedForward {
            w1: linear(&f / "w1", WIDTH, HIDDEN),
            w2: linear(&f / "w2", HIDDEN, WIDTH),
            w3: linear(&f / "w3", WIDTH, HIDDEN),
        },
        norm: rms(&p / "norm"),
        head: linear(&p / "head", WIDTH, VOCAB),
        bypass,
    }
}

const SEQ: Layout = Layout::Shard(1);

/// torchtitan's tensor-parallel plan for Llama with sequence parallelism (loss not
/// parallel: the head's logits gathered). With `output_prepared`, the MLP gathers its
/// input in each column-parallel layer and splits its replicated output with
/// `PrepareModuleOutput` instead.
fn sp_plan(output_prepared: bool) -> ParallelizePlan {
    let plan = ParallelizePlan::new()
        .style(
            Llama::path().tok(),
            RowwiseParallel {
                input_layouts: Layout::Replicate,
                output_layouts: SEQ,
                ..Default::default()
            },
        )
        .style(Llama::path().attn_norm(), SequenceParallel::default())
        .style(
            Llama::path().attn(),
            PrepareModuleInput::new([Some(SEQ), None], [Some(Layout::Replicate), None]),
        )
        .style(Llama::path().attn().wq(), ColwiseParallel::default())
        .style(Llama::path().attn().wk(), ColwiseParallel::default())
        .style(Llama::path().attn().wv(), ColwiseParallel::default())
        .style(
            Llama::path().attn().wo(),
            RowwiseParallel {
                output_layouts: SEQ,
                ..Default::default()
            },
        )
        .style(Llama::path().ffn_norm(), SequenceParallel::default())
        .style(Llama::path().norm(), SequenceParallel::default())
        .style(
            Llama::path().head(),
            ColwiseParallel {
                input_layouts: SEQ,
                output_layouts: Layout::Replicate,
                ..Default::default()
            },
        );
    let ffn = Llama::path().ffn();
    if output_prepared {
        let gathered = ColwiseParallel {
            input_layouts: SEQ,
            ..Default::default()
        };
        plan.style(ffn.w1(), gathered)
            .style(ffn.w3(), gathered)
            .style(ffn.w2(), RowwiseParallel::default())
            .style(
                ffn,
                PrepareModuleOutput::new([Some(Layout::Replicate)], [Some(SEQ)]),
            )
    } else {
        plan.style(
            ffn.clone(),
            PrepareModuleInput::new([Some(SEQ)], [Some(Layout::Replicate)]),
        )
        .style(ffn.w1(), ColwiseParallel::default())
        .style(ffn.w3(), ColwiseParallel::default())
        .style(
            ffn.w2(),
            RowwiseParallel {
                output_layouts: SEQ,
                ..Default::default()
            },
        )
    }
}

/// `tokens` ids per sequence and their next tokens, the same on every rank.
fn batch(step: i64, tokens: i64) -> (Tensor, Tensor) {
    batch_of(BATCH, step, tokens)
}

/// [`batch`] of `rows` sequences.
fn batch_of(rows: i64, step: i64, tokens: i64) -> (Tensor, Tensor) {
    tch::manual_seed(500 + step);
    let ids = Tensor::randint(VOCAB, [rows, tokens + 1], (Kind::Int64, Device::Cpu));
    (ids.narrow(1, 0, tokens), ids.narrow(1, 1, tokens))
}

fn loss(logits: &Tensor, targets: &Tensor) -> Tensor {
    logits
        .view([-1, VOCAB])
        .cross_entropy_for_logits(&targets.reshape([-1]))
}

/// The reference (one process) and this rank's model from the same values (the norms are
/// not broadcast, as PyTorch's `SequenceParallel` does not broadcast them), parallelized.
fn parallelized(
    pg: &ProcessGroup,
    mesh: &DeviceMesh,
    plan: &ParallelizePlan,
    bypass: Bypass,
) -> (nn::VarStore, Llama, nn::VarStore, Llama) {
    let (ref_vs, reference, mut vs, mut model) = twin_models(pg, |vs| llama(vs, bypass));
    vs.copy(&ref_vs).unwrap();
    parallelize_module(&mut model, mesh, plan).unwrap();
    (ref_vs, reference, vs, model)
}

/// Every parameter of `model` (its shards gathered) against the reference's, by FQN.
fn max_param_diffs(model: &Llama, vs: &nn::VarStore, ref_vs: &nn::VarStore) -> Vec<(String, f64)> {
    let state: std::sync::Arc<ShardState> = shard_module_state(model).unwrap();
    let variables: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
    let reference = ref_vs.variables();
    variables
        .iter()
        .map(|(fqn, t)| {
            let whole = if state.metadata(fqn).is_some() {
                state
                    .sharded_tensor(model, fqn)
                    .unwrap()
                    .all_gather()
                    .unwrap()
            } else {
                t.copy()
            };
            (fqn.clone(), max_diff(&whole, &reference[fqn]))
        })
        .collect()
}

/// A Llama block under torchtitan's sequence-parallel plan (and a variant whose MLP uses
/// `PrepareModuleOutput` and column-parallel layers that gather their own inputs) trains
/// like one process: SGD with momentum, 3 steps, every parameter within 1e-5; the norms'
/// weights stay whole and equal on both ranks. The forward under `no_grad` gives the same
/// logits. A sequence-parallel norm called with `forward` computes the same values and its
/// gradient is still summed: it trains the same.
#[test]
fn sequence_parallel_llama_trains_like_one_process() {
    run_ranks(
        "sequence::sequence_parallel_llama_trains_like_one_process",
        2,
        |pg| {
            let mesh = init_device_mesh("cpu", &[2], &["tp"]).unwrap();
            let sgd = nn::Sgd {
                momentum: 0.9,
                ..Default::default()
            };
            let cases = [
                (false, Bypass::Nothing),
                (true, Bypass::Nothing),
                (false, Bypass::Norm),
            ];
            for (output_prepared, bypass) in cases {
                let case = format!("output_prepared {output_prepared}, bypass {bypass:?}");
                let plan = sp_plan(output_prepared);
                let (ref_vs, reference, vs, model) = parallelized(&pg, &mesh, &plan, bypass);
                assert_eq!(model.attn.wq.ws.size(), [WIDTH / 2, WIDTH], "{case}");
                assert_eq!(model.attn_norm.weight.size(), [WIDTH], "{case}: whole");
                let mut opt = sgd.build(&vs, 0.05).unwrap();
                let mut ref_opt = sgd.build(&ref_vs, 0.05).unwrap();
                for step in 0..3 {
                    let (ids, targets) = batch(step, 4);
                    let logits = model.f_call(&ids).unwrap();
                    let expected = reference.forward(&ids);
                    let d = max_diff(&logits, &expected);
                    assert!(
                        d < 1e-5,
                        "rank {}: {case}: step {step}: logits {d}",
                        pg.rank()
                    );
                    opt.backward_step(&loss(&logits, &targets));
                    ref_opt.backward_step(&loss(&expected, &targets));
                }
                for (fqn, d) in max_param_diffs(&model, &vs, &ref_vs) {
                    assert!(d < 1e-5, "rank {}: {case}: {fqn} differs by {d}", pg.rank());
                }
                // Under no_grad: the same logits.
                let (ids, _) = batch(9, 4);
                let logits = tch::no_grad(|| model.f_call(&ids)).unwrap();
                let d = max_diff(&logits, &tch::no_grad(|| reference.forward(&ids)));
                assert!(d < 1e-5, "rank {}: {case}: no_grad logits {d}", pg.rank());
            }
        },
    );
}

/// The refusals, on every rank: a sequence of 5 tokens at tp 2 (the embedding's output
/// cannot be split evenly), a prepared block called with `forward` (with grad and under
/// `no_grad`), a call of another arity than `PrepareModuleInput` lays out; and before any
/// change: `SequenceParallel` on a linear layer, a layout change tch-dist does not build,
/// two styles on one module.
#[test]
fn sequence_parallel_refusals() {
    run_ranks("sequence::sequence_parallel_refusals", 2, |pg| {
        let rank = pg.rank();
        let mesh = init_device_mesh("cpu", &[2], &["tp"]).unwrap();
        let (_rvs, _reference, _vs, model) =
            parallelized(&pg, &mesh, &sp_plan(false), Bypass::Nothing);
        let (ids, _) = batch(0, 5);
        let err = model.f_call(&ids).unwrap_err();
        assert_eq!(
            tch_dist::report(&err),
            format!(
                "shard_module: output of `tok` on rank {rank}: cannot shard dim 1 of length 5 \
                 over 2 ranks: sequence parallelism splits it evenly, so the length must be \
                 divisible by the tensor-parallel size 2"
            )
        );
        assert!(
            matches!(
                err.downcast_ref::<ShardError>(),
                Some(ShardError::Forward(OnHook {
                    problem: ForwardProblem::NotDivisible {
                        len: 5,
                        dim: 1,
                        world: 2
                    },
                    ..
                }))
            ),
            "{err:?}"
        );

        // The attention block called with `forward`: its layers would see this rank's
        // chunk of the sequence instead of the whole one.
        let (_rvs, _reference, _vs, model) =
            parallelized(&pg, &mesh, &sp_plan(false), Bypass::Attention);
        let (ids, _) = batch(0, 4);
        let expected = format!(
            "rank {rank}: shard_module: parameter `attn.wq.weight` of `attn` was used outside \
             a call of the module through its forward hooks, where this rank's shard alone \
             gives a wrong result; call the module as `self.attn.call(&x)`, not \
             `x.apply(&self.attn)` or `self.attn.forward(&x)` (a deliberate direct use goes \
             in ShardState::allow_direct_use)"
        );
        let err = model.f_call(&ids).unwrap_err();
        assert_eq!(tch_dist::report(&err), expected, "with grad");
        let err = tch::no_grad(|| model.f_call(&ids)).unwrap_err();
        assert_eq!(tch_dist::report(&err), expected, "under no_grad");

        // One layout for a block called with two inputs.
        let plan = sp_plan(false).style(
            Llama::path().attn(),
            PrepareModuleInput::new([Some(SEQ)], [Some(Layout::Replicate)]),
        );
        let refused = |plan: &ParallelizePlan| {
            let (_rvs, _reference, vs, mut model) =
                twin_models(&pg, |vs| llama(vs, Bypass::Nothing));
            let before = unchanged::values(&vs);
            let e = tch_dist::report(&parallelize_module(&mut model, &mesh, plan).unwrap_err());
            assert!(
                unchanged::unchanged(&vs, &before),
                "rank {rank}: changed: {e}"
            );
            assert!(shard_module_state(&model).is_none());
            e
        };
        assert_eq!(
            refused(&plan),
            format!(
                "rank {rank}: parallelize_module: `attn`: is given two styles \
                 (PrepareModuleInput and PrepareModuleInput); a module takes one"
            )
        );
        let one_input = ParallelizePlan::new()
            .style(
                "attn",
                PrepareModuleInput::new([Some(SEQ)], [Some(Layout::Replicate)]),
            )
            .style(
                "tok",
                RowwiseParallel {
                    input_layouts: Layout::Replicate,
                    output_layouts: SEQ,
                    ..Default::default()
                },
            );
        let (_rvs, _reference, _vs, mut model) = twin_models(&pg, |vs| llama(vs, Bypass::Nothing));
        parallelize_module(&mut model, &mesh, &one_input).unwrap();
        assert_eq!(
            tch_dist::report(&model.f_call(&ids).unwrap_err()),
            format!(
                "shard_module: input of `attn` on rank {rank}: the plan lays out 1 inputs, the \
                 call passed 2"
            )
        );

        // Before any change.
        let e = refused(&ParallelizePlan::new().style("head", SequenceParallel::default()));
        assert!(
            e.starts_with(&format!(
                "rank {rank}: shard_module: `head`: sequence_parallel(sequence_dim=1): \
                 SequenceParallel needs a norm over each token's features"
            )) && e.ends_with("has a parameter `weight` of shape [11, 8]"),
            "{e}"
        );
        let all_to_all = PrepareModuleInput::new(
            [Some(Layout::Shard(0)), None],
            [Some(Layout::Shard(1)), None],
        );
        assert_eq!(
            refused(&ParallelizePlan::new().style("attn", all_to_all)),
            format!(
                "rank {rank}: parallelize_module: `attn`: PrepareModuleInput: input 0: Shard(0) \
                 to Shard(1) is not supported (a layout to itself, Shard(d) to Replicate, \
                 Replicate to Shard(d), or None to leave the tensor alone)"
            )
        );
        let colwise_seq = ColwiseParallel {
            input_layouts: SEQ,
            ..Default::default()
        };
        let e = refused(&ParallelizePlan::new().style("tok", colwise_seq));
        assert!(
            e.contains("ColwiseParallel with input_layouts = Shard(1)"),
            "{e}"
        );
    });
}

/// A sequence-parallel norm's parameters: their gradients are summed over the ranks, also
/// when the norm is called with `forward` (it computes the same), and are this rank's own
/// again once the hooks are removed.
#[test]
fn sequence_parallel_norm_gradients_are_summed_until_hooks_are_removed() {
    run_ranks(
        "sequence::sequence_parallel_norm_gradients_are_summed_until_hooks_are_removed",
        2,
        |pg| {
            let mesh = init_device_mesh("cpu", &[2], &["tp"]).unwrap();
            let vs = nn::VarStore::new(Device::Cpu);
            let mut model = llama(&vs, Bypass::Nothing);
            let plan =
                ParallelizePlan::new().style(Llama::path().ffn_norm(), SequenceParallel::default());
            let state = parallelize_module(&mut model, &mesh, &plan).unwrap();
            let norm = &model.ffn_norm;
            let (w, b) = (norm.ws.as_ref().unwrap(), norm.bs.as_ref().unwrap());
            // Rank r's chunk of the sequence: (r + 1) * ones, so the sums are 1 + 2.
            let chunk = |r: usize| {
                Tensor::ones([1, 2, WIDTH], (Kind::Float, Device::Cpu)) * (r as f64 + 1.0)
            };
            let grads = |y: Tensor| {
                let (mut w, mut b) = (w.shallow_clone(), b.shallow_clone());
                w.zero_grad();
                b.zero_grad();
                (y * &chunk(pg.rank())).sum(Kind::Float).backward();
                (w.grad().copy(), b.grad().copy())
            };
            let local = |r: usize| {
                let x = chunk(r).set_requires_grad(false);
                let wl = w.detach().set_requires_grad(true);
                let bl = b.detach().set_requires_grad(true);
                let y = x.layer_norm([WIDTH], Some(&wl), Some(&bl), 1e-5, false);
                (y * &chunk(r)).sum(Kind::Float).backward();
                (wl.grad(), bl.grad())
            };
            let (w0, b0) = local(0);
            let (w1, b1) = local(1);
            let (mine_w, mine_b) = local(pg.rank());
            for (how, y) in [
                ("call", norm.call(&chunk(pg.rank()))),
                ("forward", norm.forward(&chunk(pg.rank()))),
            ] {
                let (gw, gb) = grads(y);
                assert!(
                    max_diff(&gw, &(&w0 + &w1)) < 1e-6,
                    "rank {}: {how}: weight",
                    pg.rank()
                );
                assert!(
                    max_diff(&gb, &(&b0 + &b1)) < 1e-6,
                    "rank {}: {how}: bias",
                    pg.rank()
                );
            }
            state.remove_hooks();
            let (gw, gb) = grads(norm.call(&chunk(pg.rank())));
            assert!(
                max_diff(&gw, &mine_w) < 1e-6,
                "rank {}: removed: weight",
                pg.rank()
            );
            assert!(
                max_diff(&gb, &mine_b) < 1e-6,
                "rank {}: removed: bias",
                pg.rank()
            );
        },
    );
}

/// Sequence parallelism over a 2x2 mesh's `tp` dim, then `fully_shard` over its `dp` dim
/// (PyTorch's order): a norm's gradient is summed over tp before fully_shard's gradient
/// interceptor reduce-scatters it over dp. 3 SGD-with-momentum steps on each dp rank's half
/// of the batch equal one process on the whole batch (1e-5 on every parameter).
#[test]
fn sequence_parallel_under_fully_shard_at_4_ranks() {
    run_ranks(
        "sequence::sequence_parallel_under_fully_shard_at_4_ranks",
        4,
        |pg| {
            use tch_dist::{fully_shard, FsdpOptions};
            let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"]).unwrap();
            let (ref_vs, reference, mut vs, mut model) =
                twin_models(&pg, |vs| llama(vs, Bypass::Nothing));
            vs.copy(&ref_vs).unwrap();
            parallelize_module(&mut model, &mesh.dim("tp").unwrap(), &sp_plan(false)).unwrap();
            let dp = FsdpOptions {
                mesh: Some(mesh.dim("dp").unwrap()),
                ..Default::default()
            };
            fully_shard(&model, dp).unwrap();
            let sgd = nn::Sgd {
                momentum: 0.9,
                ..Default::default()
            };
            let mut opt = sgd.build(&vs, 0.05).unwrap();
            let mut ref_opt = sgd.build(&ref_vs, 0.05).unwrap();
            let dp_rank = mesh.get_local_rank("dp").unwrap() as i64;
            for step in 0..3 {
                let (ids, targets) = batch_of(4, step, 4);
                ref_opt.backward_step(&loss(&reference.forward(&ids), &targets));
                let mine = |t: &Tensor| t.narrow(0, 2 * dp_rank, 2);
                opt.backward_step(&loss(&model.f_call(&mine(&ids)).unwrap(), &mine(&targets)));
            }
            let full = tch_dist::fully_shard::full_state_dict(&model).unwrap();
            let reference = ref_vs.variables();
            assert_eq!(full.len(), reference.len());
            for (fqn, t) in full {
                let d = max_diff(&t, &reference[&fqn]);
                assert!(d < 1e-5, "rank {}: {fqn} differs by {d}", pg.rank());
            }
        },
    );
}
