//! Tensor parallelism end to end, ranks as real processes over 127.0.0.1: sharded models
//! compute what the unsharded model computes and their gradients are its gradients'
//! shards; plan validation; plans through serde; shard + replicate trains like one process.
//!
//! | file | what it tests | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `main.rs` | the fixtures; a column/row-sharded MLP and a Megatron-planned transformer block against the unsharded model | `test_tp_examples.py` |
//! | `plans.rs` | plan errors, plans through JSON and TOML, `ShardedTensor` | `test_parallelize_api.py`, `test_sharded_tensor.py` |
//! | `loss.rs` | `loss_parallel` against cross-entropy on the whole logits (value, gradient slices) at 2 and 3 ranks; misuse refused on every rank | `loss_parallel()` with `F.cross_entropy` (DTensor's loss tests) |
//! | `hooks.rs` | the sharders' hooks under `replicate`, removed, bypassed; `clip_grad_norm` over shards | `test_tp_style.py`, `test_2d_parallel.py` |
//! | `sequence.rs` | sequence parallelism: a Llama block under torchtitan's plan against one process, bypasses, refusals | `test_tp_style.py` (`test_sequence_parallel_style`, `test_prepare_module_input`), `test_tp_examples.py` (`test_transformer_training`) |

#[path = "../common/mlp.rs"]
mod mlp;
#[path = "../common/panic_text.rs"]
mod panic_text;
use mlp::{Activation, Mlp};
use panic_text::panic_text;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::hooks::num_forward_hooks;
use tch_dist::sharding::{
    shard_module, shard_module_state, ChunkShardingSpec, ColwiseLinear, EnumerableShardingSpec,
    ForwardProblem, HookSite, MegatronPlanner, OnHook, Placement, PlanProblem, RowwiseLinear,
    ShardError, ShardMetadata, ShardProblem, ShardedTensor, ShardingPlan, ShardingPlanner,
    ShardingSpec,
};
use tch_dist::testing::run_ranks;
use tch_dist::{registry, replicate, Call, Composition, OnRank, ProcessGroup, Shardable};

mod hooks;
mod loss;
mod plans;
mod sequence;

/// `d` -> `hidden` -> `out` with the exact GELU.
fn mlp(vs: &nn::VarStore, d: i64, hidden: i64, out: i64) -> Mlp {
    mlp::mlp(&vs.root(), d, hidden, out, Activation::Gelu)
}

/// torch.chunk's piece `rank` of `t` along `dim` (empty when there are more ranks than rows).
fn chunk(t: &Tensor, dim: i64, world: usize, rank: usize) -> Tensor {
    let len = t.size()[dim as usize];
    let size = (len + world as i64 - 1) / world as i64;
    let start = (rank as i64 * size).min(len);
    t.narrow(dim, start, size.min(len - start))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    if a.numel() == 0 {
        return 0.0;
    }
    (a - b).abs().max().double_value(&[])
}

/// The reference is seeded the same on every rank; the sharded copy differently on every
/// rank but 0, so the values must come from src_rank 0.
fn twin_models<T>(
    pg: &ProcessGroup,
    build: impl Fn(&nn::VarStore) -> T,
) -> (nn::VarStore, T, nn::VarStore, T) {
    tch::manual_seed(11);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = build(&ref_vs);
    tch::manual_seed(11 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = build(&vs);
    (ref_vs, reference, vs, model)
}

fn input(shape: &[i64]) -> Tensor {
    tch::manual_seed(77);
    Tensor::randn(shape, (Kind::Float, Device::Cpu))
}

/// `sharded` (this rank's shard along `dim`, or the whole tensor when `dim` is None) equals
/// the reference's.
/// A check that the sharded model's tensor is this rank's chunk of the reference's along
/// `dim` (the whole of it for `None`), within `tol`: the parameters' values, or with
/// `of_grad` their gradients. Called with a name for the failure message.
fn shard_check(
    pg: &ProcessGroup,
    tol: f64,
    of_grad: bool,
) -> impl Fn(&str, &Tensor, &Tensor, Option<i64>) + '_ {
    move |name, sharded, reference, dim| {
        let (sharded, reference) = if of_grad {
            (sharded.grad(), reference.grad())
        } else {
            (sharded.shallow_clone(), reference.shallow_clone())
        };
        let expected = match dim {
            Some(d) => chunk(&reference, d, pg.world_size(), pg.rank()),
            None => reference,
        };
        let d = max_diff(&sharded, &expected);
        assert!(d < tol, "rank {}: {name}: max diff {d}", pg.rank());
    }
}

#[test]
fn sharded_mlp_matches_the_unsharded_model() {
    run_ranks("sharded_mlp_matches_the_unsharded_model", 2, |pg| {
        let world = pg.world_size() as i64;
        let (values, grads) = (shard_check(&pg, 1e-7, false), shard_check(&pg, 1e-5, true));
        // 1. Sharders, fc1's local columns straight into fc2 (Megatron's MLP).
        let (_rvs, reference, vs, mut model) = twin_models(&pg, |vs| mlp(vs, 6, 8, 5));
        let plan = ShardingPlan::builder()
            .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
            .shard_module(Mlp::path().fc2(), RowwiseLinear)
            .return_local_tensor(Mlp::path().fc1())
            .build();
        let state = shard_module(&mut model, &plan, 0, &pg).unwrap();
        assert_eq!(
            state.sharded_params().collect::<Vec<_>>(),
            ["fc1.bias", "fc1.weight", "fc2.weight"]
        );
        // Each rank holds 1/world of every sharded weight; the VarStore sees the shards.
        assert_eq!(model.fc1.ws.numel() as i64, 8 * 6 / world);
        assert_eq!(model.fc2.ws.numel() as i64, 5 * 8 / world);
        assert_eq!(vs.variables()["fc1.weight"].size(), [8 / world, 6]);
        values("fc1.weight", &model.fc1.ws, &reference.fc1.ws, Some(0));
        values("fc2.weight", &model.fc2.ws, &reference.fc2.ws, Some(1));

        let x = input(&[4, 6]);
        let y = model.call(&x);
        let y_ref = reference.forward(&x);
        assert!(max_diff(&y, &y_ref) < 1e-5, "forward");
        (y.sin().sum(Kind::Float)).backward();
        (y_ref.sin().sum(Kind::Float)).backward();
        grads("fc1.weight", &model.fc1.ws, &reference.fc1.ws, Some(0));
        let (b, b_ref) = (
            model.fc1.bs.as_ref().unwrap(),
            reference.fc1.bs.as_ref().unwrap(),
        );
        grads("fc1.bias", b, b_ref, Some(0));
        grads("fc2.weight", &model.fc2.ws, &reference.fc2.ws, Some(1));
        let (b, b_ref) = (
            model.fc2.bs.as_ref().unwrap(),
            reference.fc2.bs.as_ref().unwrap(),
        );
        grads("fc2.bias", b, b_ref, None);

        // The sharded parameters gather back to the reference.
        let st = state.sharded_tensor(&model, "fc1.weight").unwrap();
        assert!(max_diff(&st.all_gather().unwrap(), &reference.fc1.ws) < 1e-7);

        // An input the row-parallel layer cannot take is an error from `f_call` (a panic
        // from `call`), before any collective.
        let err = model.fc2.f_call(&input(&[4, 5])).unwrap_err();
        assert_eq!(
            err.message(),
            format!(
                "shard_module: row-parallel `fc2` on rank {} expects 8 input features (or its \
                 slice of 4), got 5",
                pg.rank()
            )
        );
        // The hook's error is typed: `f_call` callers get the ShardError back.
        assert!(
            matches!(
                err.downcast_ref::<ShardError>(),
                Some(ShardError::Forward(OnHook {
                    rank,
                    fqn,
                    site: HookSite::RowParallel,
                    problem: ForwardProblem::InputWidth {
                        full: 8,
                        local: 4,
                        width: 5
                    },
                })) if *rank == pg.rank() && fqn == "fc2"
            ),
            "{err:?}"
        );

        // 2. Parameter specs, uneven (7 hidden over 2 ranks: 4 + 3), outputs materialised.
        let (_rvs, reference, _vs, mut model) = twin_models(&pg, |vs| mlp(vs, 6, 7, 5));
        let on_ranks = |dim| {
            ChunkShardingSpec::new(
                dim,
                vec![
                    Placement::new(0, Device::Cpu),
                    Placement::new(1, Device::Cpu),
                ],
            )
        };
        let plan = ShardingPlan::builder()
            .shard_param(Mlp::path().fc1().weight(), on_ranks(0))
            .shard_param(Mlp::path().fc2().weight(), on_ranks(1))
            .build();
        shard_module(&mut model, &plan, 0, &pg).unwrap();
        assert_eq!(model.fc1.ws.size(), [if pg.rank() == 0 { 4 } else { 3 }, 6]);
        let y = model.call(&x);
        let y_ref = reference.forward(&x);
        assert!(max_diff(&y, &y_ref) < 1e-5, "forward, uneven");
        (y * 3.0).sum(Kind::Float).backward();
        (y_ref * 3.0).sum(Kind::Float).backward();
        grads(
            "uneven fc1.weight",
            &model.fc1.ws,
            &reference.fc1.ws,
            Some(0),
        );
        grads(
            "uneven fc2.weight",
            &model.fc2.ws,
            &reference.fc2.ws,
            Some(1),
        );
    });
}

const HEAD: i64 = 2;

#[derive(Debug, Shardable)]
struct Attention {
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    out_proj: nn::Linear,
}

#[derive(Debug, Shardable)]
struct Block {
    ln1: nn::LayerNorm,
    attn: Attention,
    ln2: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

/// Multi-head attention over [batch, seq, width] with as many heads as the width holds:
/// a rank's local columns hold its heads.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let (b, t, w) = q.size3().unwrap();
    let heads = |x: &Tensor| x.view([b, t, w / HEAD, HEAD]).transpose(1, 2);
    let (q, k, v) = (heads(q), heads(k), heads(v));
    let att = (q.matmul(&k.transpose(-2, -1)) / (HEAD as f64).sqrt()).softmax(-1, Kind::Float);
    att.matmul(&v).transpose(1, 2).contiguous().view([b, t, w])
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = self.ln1.call(x);
        let a = &self.attn;
        let ctx = attend(&a.q_proj.call(&h), &a.k_proj.call(&h), &a.v_proj.call(&h));
        let x = x + a.out_proj.call(&ctx);
        let h = self.fc1.call(&self.ln2.call(&x)).gelu("none");
        &x + self.fc2.call(&h)
    }
}

fn block(vs: &nn::VarStore) -> Block {
    let r = vs.root();
    let (d, hidden) = (8, 16);
    let lin = |name: &str, i, o| nn::linear(&r / "attn" / name, i, o, Default::default());
    Block {
        ln1: nn::layer_norm(&r / "ln1", vec![d], Default::default()),
        attn: Attention {
            q_proj: lin("q_proj", d, d),
            k_proj: lin("k_proj", d, d),
            v_proj: lin("v_proj", d, d),
            out_proj: lin("out_proj", d, d),
        },
        ln2: nn::layer_norm(&r / "ln2", vec![d], Default::default()),
        fc1: nn::linear(&r / "fc1", d, hidden, Default::default()),
        fc2: nn::linear(&r / "fc2", hidden, d, Default::default()),
    }
}

#[derive(Debug, Shardable)]
struct FusedBlock {
    qkv: nn::Linear,
    proj: nn::Linear,
}

impl Module for FusedBlock {
    fn forward(&self, x: &Tensor) -> Tensor {
        let qkv = self.qkv.call(x).chunk(3, -1);
        x + self.proj.call(&attend(&qkv[0], &qkv[1], &qkv[2]))
    }
}

#[test]
fn megatron_planned_transformer_block_matches_the_unsharded_block() {
    run_ranks(
        "megatron_planned_transformer_block_matches_the_unsharded_block",
        2,
        |pg| {
            let grads = shard_check(&pg, 1e-4, true);
            let (_rvs, reference, _vs, mut model) = twin_models(&pg, block);
            let plan = MegatronPlanner::default().build_plan(&model).unwrap();
            let keys: Vec<&str> = plan.plan.keys().map(String::as_str).collect();
            assert_eq!(
                keys,
                [
                    "attn.k_proj",
                    "attn.out_proj",
                    "attn.q_proj",
                    "attn.v_proj",
                    "fc1",
                    "fc2"
                ]
            );
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            let x = input(&[2, 3, 8]);
            let y = model.forward(&x);
            let y_ref = reference.forward(&x);
            assert!(
                max_diff(&y, &y_ref) < 1e-5,
                "forward: {}",
                max_diff(&y, &y_ref)
            );
            (&y * &y).sum(Kind::Float).backward();
            (&y_ref * &y_ref).sum(Kind::Float).backward();
            let (a, ar) = (&model.attn, &reference.attn);
            for (name, p, r) in [
                ("q", &a.q_proj, &ar.q_proj),
                ("k", &a.k_proj, &ar.k_proj),
                ("v", &a.v_proj, &ar.v_proj),
            ] {
                assert_eq!(p.ws.numel() * 2, r.ws.numel(), "{name}: half of the weight");
                grads(name, &p.ws, &r.ws, Some(0));
            }
            grads("out_proj", &a.out_proj.ws, &ar.out_proj.ws, Some(1));
            grads("fc1", &model.fc1.ws, &reference.fc1.ws, Some(0));
            grads("fc2", &model.fc2.ws, &reference.fc2.ws, Some(1));
            let (ln, ln_ref) = (
                model.ln1.ws.as_ref().unwrap(),
                reference.ln1.ws.as_ref().unwrap(),
            );
            grads("ln1 (replicated)", ln, ln_ref, None);

            // A fused query-key-value projection is split per query, key and value.
            let fused = |vs: &nn::VarStore| FusedBlock {
                qkv: nn::linear(vs.root() / "qkv", 8, 24, Default::default()),
                proj: nn::linear(vs.root() / "proj", 8, 8, Default::default()),
            };
            let (_rvs, reference, _vs, mut model) = twin_models(&pg, fused);
            let plan = MegatronPlanner::default().build_plan(&model).unwrap();
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            assert_eq!(model.qkv.ws.size(), [12, 8]);
            let y = model.forward(&x);
            let y_ref = reference.forward(&x);
            assert!(max_diff(&y, &y_ref) < 1e-5, "fused forward");
            y.sum(Kind::Float).backward();
            y_ref.sum(Kind::Float).backward();
            let g_ref = reference.qkv.ws.grad();
            let mine: Vec<Tensor> = g_ref
                .chunk(3, 0)
                .iter()
                .map(|p| chunk(p, 0, 2, pg.rank()))
                .collect();
            assert!(
                max_diff(&model.qkv.ws.grad(), &Tensor::cat(&mine, 0)) < 1e-4,
                "fused grad"
            );
        },
    );
}
