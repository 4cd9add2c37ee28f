//! Tensor parallelism end to end, ranks as real processes over 127.0.0.1: sharded models
//! compute what the unsharded model computes and their gradients are its gradients'
//! shards; plan validation; plans through serde; shard + replicate trains like one process.

#[path = "common/mlp.rs"]
mod mlp;
#[path = "common/panic_text.rs"]
mod panic_text;
use mlp::{Activation, Mlp};
use panic_text::panic_text;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::hooks::num_forward_hooks;
use tch_dist::sharding::{
    shard_module, shard_module_state, ChunkShardingSpec, ColwiseLinear, EnumerableShardingSpec,
    ForwardProblem, HookSite, MegatronPlanner, Placement, PlanProblem, RowwiseLinear, ShardError,
    ShardMetadata, ShardedTensor, ShardingPlan, ShardingPlanner, ShardingSpec,
};
use tch_dist::testing::run_ranks;
use tch_dist::{registry, replicate, Call, ProcessGroup, Shardable};

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
                Some(ShardError::Forward {
                    rank,
                    fqn,
                    site: HookSite::RowParallel,
                    problem: ForwardProblem::InputWidth {
                        full: 8,
                        local: 4,
                        width: 5
                    },
                }) if *rank == pg.rank() && fqn == "fc2"
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

#[test]
fn every_plan_error_is_reported_before_anything_changes() {
    run_ranks(
        "every_plan_error_is_reported_before_anything_changes",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let mut model = mlp(&vs, 6, 8, 5);
            let cpu = |r| Placement::new(r, Device::Cpu);
            let ok = ChunkShardingSpec::new(0, vec![cpu(0), cpu(1)]);
            let cases: Vec<(ShardingPlan, &str)> = vec![
                (
                    ShardingPlan::builder()
                        .shard_param("fc3.weight", ok.clone())
                        .build(),
                    "`fc3.weight`: is not a parameter of the model",
                ),
                (
                    ShardingPlan::builder()
                        .shard_param(
                            Mlp::path().fc1().weight(),
                            ChunkShardingSpec::new(2, vec![cpu(0), cpu(1)]),
                        )
                        .build(),
                    "dim 2",
                ),
                (
                    ShardingPlan::builder()
                        .shard_param(
                            Mlp::path().fc1().weight(),
                            ChunkShardingSpec::new(0, vec![cpu(0), cpu(2)]),
                        )
                        .build(),
                    "placements do not match the group",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
                        .shard_param(Mlp::path().fc1().weight(), ok.clone())
                        .build(),
                    "`fc1.weight`: a parameter spec inside `fc1`",
                ),
                (
                    ShardingPlan::builder()
                        .shard_param("fc1", ok.clone())
                        .build(),
                    "`fc1`: names a module",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module("fc2.bias", RowwiseLinear)
                        .build(),
                    "`fc2.bias`: names a parameter",
                ),
                (
                    ShardingPlan::builder()
                        .shard_param(
                            Mlp::path().fc1().bias(),
                            ChunkShardingSpec::new(0, vec![cpu(0), cpu(1)]),
                        )
                        .build(),
                    "only a linear layer's `weight`",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
                        .output("fc9", ok.clone())
                        .build(),
                    "`fc9`: output_plan names a module that is not in the model",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module(Mlp::path().fc2(), RowwiseLinear)
                        .return_local_tensor(Mlp::path().fc2())
                        .build(),
                    "`fc2`: return_local_tensor: this module's output is not split",
                ),
                (
                    ShardingPlan::builder()
                        .shard_module(Mlp::path().fc1(), ColwiseLinear { fused: 3 })
                        .build(),
                    "not divisible into fused=3 parts",
                ),
            ];
            for (plan, expected) in cases {
                let err = shard_module(&mut model, &plan, 0, &pg)
                    .unwrap_err()
                    .to_string();
                assert!(err.contains(expected), "expected `{expected}` in: {err}");
                assert!(
                    err.starts_with(&format!("rank {}: shard_module", pg.rank())),
                    "{err}"
                );
                // Named once: no doubled `rank R:` prefix.
                assert_eq!(
                    err.matches(&format!("rank {}:", pg.rank())).count(),
                    1,
                    "{err}"
                );
                assert_eq!(err.matches("shard_module").count(), 1, "{err}");
            }
            // The errors are typed.
            let plan = ShardingPlan::builder()
                .shard_module("fc2.bias", RowwiseLinear)
                .build();
            let err = shard_module(&mut model, &plan, 0, &pg).unwrap_err();
            assert!(
                matches!(&err, ShardError::Plan { rank, fqn, problem: PlanProblem::SharderOnParameter }
                    if *rank == pg.rank() && fqn == "fc2.bias"),
                "{err:?}"
            );
            let err = shard_module(&mut model, &ShardingPlan::default(), 2, &pg).unwrap_err();
            assert!(err.to_string().contains("src_rank 2"), "{err}");
            assert!(matches!(err, ShardError::InvalidArgument { .. }), "{err:?}");
            // Ranks with different plans fail together, naming the entry and each rank's
            // value (before, each rank sharded its own way and they hung or computed garbage).
            let plan = if pg.rank() == 0 {
                ShardingPlan::builder().shard_module(Mlp::path().fc1(), ColwiseLinear::default())
            } else {
                ShardingPlan::builder().shard_module(Mlp::path().fc1(), RowwiseLinear)
            }
            .build();
            let err = shard_module(&mut model, &plan, 0, &pg).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "rank {}: shard_module: option `plan[\"fc1\"]` differs across ranks: rank 0 \
                     has Sharder(\"colwise_linear\"), rank 1 has Sharder(\"rowwise_linear\")",
                    pg.rank()
                )
            );
            // A different source rank is a difference too.
            let err = shard_module(&mut model, &ShardingPlan::default(), pg.rank(), &pg)
                .unwrap_err()
                .to_string();
            assert!(
                err.ends_with("option `src_rank` differs across ranks: rank 0 has 0, rank 1 has 1"),
                "{err}"
            );
            // Nothing changed: whole parameters, no hooks, no registration.
            assert_eq!(model.fc1.ws.size(), [8, 6]);
            assert_eq!(num_forward_hooks(&model.fc1), (0, 0));
            assert!(registry(&model).is_empty());
            // And the module can still be sharded, once.
            let plan = ShardingPlan::builder()
                .shard_param(Mlp::path().fc1().weight(), ok)
                .build();
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            assert_eq!(registry(&model), ["shard_module"]);
            let again = shard_module(&mut model, &plan, 0, &pg).unwrap_err();
            assert!(
                again
                    .to_string()
                    .contains("can only be applied to a module once"),
                "{again}"
            );
        },
    );
}

#[test]
fn plans_round_trip_through_json_and_toml() {
    let cpu = |r| Placement::new(r, Device::Cpu);
    let plan = ShardingPlan::builder()
        .shard_param(
            Mlp::path().fc1().weight(),
            ChunkShardingSpec::new(0, vec![cpu(0), cpu(1)]),
        )
        .shard_module(Mlp::path().fc2(), RowwiseLinear)
        .shard_module("blocks.0.qkv", ColwiseLinear { fused: 3 })
        .output(
            Mlp::path().fc2(),
            ChunkShardingSpec::new(0, vec![cpu(0), cpu(1)]),
        )
        .return_local_tensor(Mlp::path().fc2())
        .build();
    let json = serde_json::to_string_pretty(&plan).unwrap();
    assert!(json.contains("\"rank:1/cpu\""), "{json}");
    assert_eq!(serde_json::from_str::<ShardingPlan>(&json).unwrap(), plan);
    let text = toml::to_string(&plan).unwrap();
    assert_eq!(toml::from_str::<ShardingPlan>(&text).unwrap(), plan);
    let bad = r#"{"plan": {"fc1": {"sharder": "diagonal_linear"}}}"#;
    let err = serde_json::from_str::<ShardingPlan>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown sharder `diagonal_linear`"), "{err}");
}

#[test]
fn sharded_tensors_scatter_gather_and_reshard() {
    run_ranks("sharded_tensors_scatter_gather_and_reshard", 3, |pg| {
        let cpu = |r| Placement::new(r, Device::Cpu);
        let full = Tensor::arange(20, (Kind::Float, Device::Cpu)).view([10, 2]);
        // Every rank but the source passes other values: the source's win.
        let mine = if pg.rank() == 1 {
            full.copy()
        } else {
            full.zeros_like()
        };
        let rows: ShardingSpec = ChunkShardingSpec::new(0, vec![cpu(0), cpu(1), cpu(2)]).into();
        let st = ShardedTensor::scatter(&mine, &rows, 1, &pg).unwrap();
        let expected_rows = [4, 4, 2][pg.rank()];
        assert_eq!(st.local_tensor().unwrap().size(), [expected_rows, 2]);
        assert!(st
            .local_tensor()
            .unwrap()
            .equal(&chunk(&full, 0, 3, pg.rank())));
        assert!(st.all_gather().unwrap().equal(&full));
        let gathered = st.gather(2).unwrap();
        assert_eq!(gathered.is_some(), pg.rank() == 2);
        if let Some(g) = gathered {
            assert!(g.equal(&full));
        }
        // More ranks than rows: empty shards.
        let two = Tensor::from_slice(&[1.0f32, 2.0]).view([2, 1]);
        let st2 = ShardedTensor::scatter(&two, &rows, 0, &pg).unwrap();
        assert_eq!(st2.local_tensor().unwrap().size()[0], [1, 1, 0][pg.rank()]);
        assert!(st2.all_gather().unwrap().equal(&two));
        // Reshard rows -> columns, and to an explicit layout with two shards on rank 0.
        let cols: ShardingSpec = ChunkShardingSpec::new(1, vec![cpu(2), cpu(0), cpu(1)]).into();
        let by_col = st.reshard(&cols).unwrap();
        let col_of = |r: usize| [1, 2, 0][r]; // rank 2 holds chunk 0
        let expect = chunk(&full, 1, 3, col_of(pg.rank()));
        assert!(by_col.local_tensor().unwrap().equal(&expect));
        let shard = |off: i64, rows: i64, rank| ShardMetadata {
            shard_offsets: vec![off, 0],
            shard_sizes: vec![rows, 2],
            placement: cpu(rank),
        };
        let explicit: ShardingSpec =
            EnumerableShardingSpec::new(vec![shard(0, 3, 0), shard(3, 5, 1), shard(8, 2, 0)])
                .unwrap()
                .into();
        let ex = by_col.reshard(&explicit).unwrap();
        assert_eq!(ex.local_shards().len(), [2, 1, 0][pg.rank()]);
        if pg.rank() == 0 {
            assert!(
                ex.local_tensor().is_err(),
                "two shards: no single local tensor"
            );
            assert!(ex.local_shards()[1].tensor.equal(&full.narrow(0, 8, 2)));
        }
        assert!(ex.all_gather().unwrap().equal(&full));
        // A shape mismatch fails on every rank, naming both shapes.
        let wrong = if pg.rank() == 2 {
            Tensor::zeros([9, 2], (Kind::Float, Device::Cpu))
        } else {
            full.copy()
        };
        let err = ShardedTensor::scatter(&wrong, &rows, 0, &pg)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("[10, 2]") && err.contains("rank 2 passed [9, 2]"),
            "{err}"
        );
    });
}

/// An MLP of 4 -> 8 -> 6 under `mlp` and a head 6 -> 3: a sharded part and a plain one.
#[derive(Debug, Shardable)]
struct Net {
    mlp: Mlp,
    head: nn::Linear,
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.head.call(&self.mlp.call(xs).relu())
    }
}

fn net(vs: &nn::VarStore) -> Net {
    Net {
        mlp: mlp::mlp(&(vs.root() / "mlp"), 4, 8, 6, Activation::Gelu),
        head: nn::linear(vs.root() / "head", 6, 3, Default::default()),
    }
}

#[test]
fn shard_then_replicate_trains_like_one_process() {
    run_ranks(
        "shard_then_replicate_trains_like_one_process",
        2,
        move |pg| {
            let (ref_vs, reference, vs, mut model) = twin_models(&pg, net);
            let cpu = |r| Placement::new(r, Device::Cpu);
            // The seed's composition: fc1 column-parallel into fc2 row-parallel, fc2's output
            // back to data parallel as rows of the batch, the head replicated.
            let p = Net::path().mlp();
            let plan = ShardingPlan::builder()
                .shard_module(p.fc1(), ColwiseLinear::default())
                .shard_module(p.fc2(), RowwiseLinear)
                .return_local_tensor(p.fc1())
                .output(p.fc2(), ChunkShardingSpec::new(0, vec![cpu(0), cpu(1)]))
                .return_local_tensor(p.fc2())
                .build();
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            let state = replicate::apply(&model, replicate::Options::default()).unwrap();
            assert_eq!(
                state.param_fqns(),
                ["mlp.fc2.bias", "head.weight", "head.bias"]
            );
            assert_eq!(registry(&model), ["shard_module", "replicate"]);
            let mut opt = nn::Sgd::default().build(&vs, 0.05).unwrap();
            let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.05).unwrap();
            for step in 0..4 {
                tch::manual_seed(900 + step);
                let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
                let y = Tensor::randn([8, 3], (Kind::Float, Device::Cpu));
                ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
                let out = model.call(&x); // this rank's 4 rows
                assert_eq!(out.size(), [4, 3]);
                opt.backward_step(&out.mse_loss(&chunk(&y, 0, 2, pg.rank()), tch::Reduction::Mean));
            }
            let state = shard_module_state(&model).unwrap();
            let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
            variables.sort_by(|a, b| a.0.cmp(&b.0)); // every rank gathers in the same order
            for (fqn, t) in variables {
                let reference = &ref_vs.variables()[&fqn];
                let whole = if state.metadata(&fqn).is_some() {
                    state
                        .sharded_tensor(&model, &fqn)
                        .unwrap()
                        .all_gather()
                        .unwrap()
                } else {
                    t.copy()
                };
                let d = max_diff(&whole, reference);
                assert!(d < 1e-5, "rank {}: {fqn} differs by {d}", pg.rank());
            }
        },
    );
}

#[test]
fn removed_hooks_leave_local_layers_that_do_not_communicate() {
    run_ranks(
        "removed_hooks_leave_local_layers_that_do_not_communicate",
        2,
        |pg| {
            let (_rvs, reference, _vs, mut model) = twin_models(&pg, |vs| mlp(vs, 6, 8, 5));
            let plan = ShardingPlan::builder()
                .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
                .shard_module(Mlp::path().fc2(), RowwiseLinear)
                .return_local_tensor(Mlp::path().fc1())
                .build();
            let state = shard_module(&mut model, &plan, 0, &pg).unwrap();
            let x = input(&[4, 6]);
            assert!(max_diff(&model.call(&x), &reference.forward(&x)) < 1e-5);
            assert_ne!(num_forward_hooks(&model.fc2), (0, 0));
            state.remove_hooks();
            for layer in [&model.fc1, &model.fc2] {
                assert_eq!(num_forward_hooks(layer), (0, 0));
            }
            // Only rank 1 calls the model now: a collective would wait for rank 0 forever
            // (and fail when rank 0 exits). Without hooks each layer is its local shard.
            if pg.rank() == 1 {
                let h = model.fc1.call(&x);
                assert_eq!(h.size(), [4, 4]); // this rank's 4 of the 8 hidden features
                assert!(h.equal(&model.fc1.forward(&x)));
                let y = model.call(&x);
                assert!(y.equal(&model.fc2.forward(&model.fc1.forward(&x).gelu("none"))));
                // A partial sum: not the unsharded output.
                assert!(max_diff(&y, &reference.forward(&x)) > 1e-3);
            }
            // The parameters stay sharded.
            assert_eq!(model.fc2.ws.size(), [5, 4]);
        },
    );
}

/// The MLP a user wrote with `apply`, which calls `Module::forward` and skips the hooks.
#[derive(Debug, Shardable)]
struct ApplyMlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Module for ApplyMlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.apply(&self.fc1).gelu("none").apply(&self.fc2)
    }
}

#[test]
fn hooked_layers_used_without_their_hooks_fail_on_every_rank() {
    run_ranks(
        "hooked_layers_used_without_their_hooks_fail_on_every_rank",
        2,
        |pg| {
            let x = input(&[4, 6]);
            let expected = format!(
                "rank {}: shard_module: parameter `fc1.weight` of `fc1` was used outside a call \
                 of the module through its forward hooks, where this rank's shard alone gives a \
                 wrong result; call the module as `self.fc1.call(&x)`, not \
                 `x.apply(&self.fc1)` or `self.fc1.forward(&x)` (a deliberate direct use goes \
                 in ShardState::allow_direct_use)",
                pg.rank()
            );
            // 1. The user's model, Megatron-planned, called with `call`: the forward fails.
            let vs = nn::VarStore::new(Device::Cpu);
            let r = vs.root();
            let mut model = ApplyMlp {
                fc1: nn::linear(&r / "fc1", 6, 8, Default::default()),
                fc2: nn::linear(&r / "fc2", 8, 5, Default::default()),
            };
            let plan = MegatronPlanner::default().build_plan(&model).unwrap();
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            let err = model.f_call(&x).unwrap_err();
            assert_eq!(err.message(), expected);
            assert!(
                matches!(
                    err.downcast_ref::<ShardError>(),
                    Some(ShardError::HooksBypassed { rank, module, param })
                        if *rank == pg.rank() && module == "fc1" && param == "fc1.weight"
                ),
                "{err:?}"
            );
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = model.call(&x);
            }));
            assert_eq!(panic_text(panicked.unwrap_err()), expected);

            // 2. Called with `forward`, past that check: backward fails before any gradient
            // of a guarded parameter, so the optimizer never steps.
            let mut opt = nn::Sgd::default().build(&vs, 0.5).unwrap();
            let mut names: Vec<String> = vs.variables().into_keys().collect();
            names.sort();
            let before: Vec<Tensor> = names.iter().map(|n| vs.variables()[n].copy()).collect();
            let loss = model.forward(&x).square().mean(Kind::Float);
            let failed =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| opt.backward_step(&loss)));
            let text = panic_text(failed.unwrap_err());
            assert!(text.contains(&expected), "{text}");
            for (name, old) in names.iter().zip(&before) {
                let now = &vs.variables()[name];
                assert!(now.equal(old), "rank {}: {name} changed", pg.rank());
                assert!(
                    !now.grad().defined(),
                    "rank {}: {name} has a gradient",
                    pg.rank()
                );
            }

            // 3. A deliberate direct use (a regularizer on the shards) passes when declared.
            let state = shard_module_state(&model).unwrap();
            let l2 = || model.fc1.ws.square().sum(Kind::Float);
            let err = l2().f_backward().unwrap_err().to_string();
            assert!(err.contains(&expected), "{err}");
            state.allow_direct_use(l2).unwrap().backward();
            assert!(model.fc1.ws.grad().equal(&(&model.fc1.ws * 2.0)));
        },
    );
}

#[test]
fn called_layers_train_exactly_and_unused_ones_are_fine() {
    #[derive(Debug, Shardable)]
    struct WithSpare {
        fc1: nn::Linear,
        fc2: nn::Linear,
        spare: nn::Linear,
    }
    impl Module for WithSpare {
        fn forward(&self, xs: &Tensor) -> Tensor {
            self.fc2.call(&self.fc1.call(xs).gelu("none")) // `spare` is not used
        }
    }
    let build = |vs: &nn::VarStore| WithSpare {
        fc1: nn::linear(vs.root() / "fc1", 6, 8, Default::default()),
        fc2: nn::linear(vs.root() / "fc2", 8, 5, Default::default()),
        spare: nn::linear(vs.root() / "spare", 6, 4, Default::default()),
    };
    run_ranks(
        "called_layers_train_exactly_and_unused_ones_are_fine",
        2,
        move |pg| {
            let values = shard_check(&pg, 1e-5, false);
            let (ref_vs, reference, vs, mut model) = twin_models(&pg, build);
            let mut plan = MegatronPlanner::default().build_plan(&model).unwrap();
            plan.plan.insert(
                "spare".into(),
                tch_dist::sharding::PlanEntry::Sharder(std::sync::Arc::new(
                    ColwiseLinear::default(),
                )),
            );
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
            let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.1).unwrap();
            for step in 0..3 {
                let x = input(&[4 + step, 6]);
                let y = model.f_call(&x).unwrap();
                let y_ref = reference.forward(&x);
                assert!(max_diff(&y, &y_ref) < 1e-5, "step {step}: forward");
                opt.backward_step(&y.square().mean(Kind::Float));
                ref_opt.backward_step(&y_ref.square().mean(Kind::Float));
            }
            values("fc1.weight", &model.fc1.ws, &reference.fc1.ws, Some(0));
            values("fc2.weight", &model.fc2.ws, &reference.fc2.ws, Some(1));
            assert!(
                !model.spare.ws.grad().defined(),
                "the unused layer has no gradient"
            );
            values(
                "spare.weight",
                &model.spare.ws,
                &reference.spare.ws,
                Some(0),
            );
        },
    );
}

/// `clip_grad_norm` over a model with a tensor-parallel submodule (3 ranks: uneven shards
/// of 3, 3 and 2 rows) and a plain head: the total norm is the unsharded model's, on every
/// rank, for the 2-norm and the largest entry, and every gradient (shard) is the unsharded
/// one scaled as PyTorch's `clip_grad_norm_` scales it.
#[test]
fn clip_grad_norm_over_shards_is_the_unsharded_models() {
    use tch_dist::utils::{clip_grad_norm, ClipGradError};
    run_ranks(
        "clip_grad_norm_over_shards_is_the_unsharded_models",
        3,
        move |pg| {
            let world = pg.world_size();
            for (norm_type, max_norm) in [(2.0, 0.05), (f64::INFINITY, 0.01), (2.0, 1e9)] {
                let (_rvs, reference, _vs, mut model) = twin_models(&pg, net);
                let plan = ShardingPlan::builder()
                    .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
                    .shard_module(Mlp::path().fc2(), RowwiseLinear)
                    .return_local_tensor(Mlp::path().fc1())
                    .build();
                shard_module(&mut model.mlp, &plan, 0, &pg).unwrap();
                // The head is not sharded: the same values as the reference's on every rank
                // (as replicate's start-up broadcast would make them).
                tch::no_grad(|| {
                    model.head.ws.copy_(&reference.head.ws);
                    model
                        .head
                        .bs
                        .as_mut()
                        .unwrap()
                        .copy_(reference.head.bs.as_ref().unwrap());
                });
                let x = input(&[5, 4]);
                model.call(&x).sin().sum(Kind::Float).backward();
                reference.forward(&x).sin().sum(Kind::Float).backward();
                // The unsharded model's norm and scale, by hand.
                let grads: Vec<Tensor> = reference
                    .named_parameters()
                    .iter()
                    .map(|(_, p)| p.grad().to_kind(Kind::Double))
                    .collect();
                let expected = if norm_type.is_infinite() {
                    grads
                        .iter()
                        .map(|g| g.abs().max().double_value(&[]))
                        .fold(0.0, f64::max)
                } else {
                    grads
                        .iter()
                        .map(|g| g.square().sum(Kind::Double).double_value(&[]))
                        .sum::<f64>()
                        .sqrt()
                };
                let norm = clip_grad_norm(&model, max_norm, norm_type).unwrap();
                assert!(
                    (norm - expected).abs() <= 1e-6 * expected,
                    "rank {}: norm {norm}, unsharded {expected}",
                    pg.rank()
                );
                let coef = (max_norm / (expected + 1e-6)).min(1.0);
                for (fqn, p) in model.named_parameters() {
                    let r = &reference
                        .named_parameters()
                        .into_iter()
                        .find(|(n, _)| *n == fqn)
                        .unwrap()
                        .1;
                    let whole = r.grad() * coef;
                    let dim = match fqn.as_str() {
                        "mlp.fc1.weight" | "mlp.fc1.bias" => Some(0),
                        "mlp.fc2.weight" => Some(1),
                        _ => None,
                    };
                    let expected = match dim {
                        Some(d) => chunk(&whole, d, world, pg.rank()),
                        None => whole,
                    };
                    let d = max_diff(&p.grad(), &expected);
                    assert!(d < 1e-6, "rank {}: {fqn}: {d}", pg.rank());
                }
            }
            // Bad arguments change nothing and need no collective.
            let (_rvs, _reference, _vs, model) = twin_models(&pg, net);
            assert!(matches!(
                clip_grad_norm(&model, f64::NAN, 2.0),
                Err(ClipGradError::InvalidMaxNorm { .. })
            ));
            let err = clip_grad_norm(&model, 1.0, 0.0).unwrap_err();
            assert_eq!(
                err.to_string(),
                "clip_grad_norm: norm_type must be positive (or f64::INFINITY), got 0"
            );
            // No gradient yet: a norm of 0.
            assert_eq!(clip_grad_norm(&model, 1.0, 2.0).unwrap(), 0.0);
        },
    );
}

/// A Megatron MLP whose forward runs its row-parallel layer with `forward`.
#[derive(Debug, Shardable)]
struct BypassFc2 {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Module for BypassFc2 {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.fc2.forward(&self.fc1.call(xs).gelu("none"))
    }
}

#[test]
fn bypassed_layers_fail_under_no_grad_on_every_rank() {
    run_ranks(
        "bypassed_layers_fail_under_no_grad_on_every_rank",
        2,
        |pg| {
            let x = input(&[4, 6]);
            let expected = |layer: &str| {
                format!(
                    "rank {}: shard_module: parameter `{layer}.weight` of `{layer}` was used \
                     outside a call of the module through its forward hooks, where this rank's \
                     shard alone gives a wrong result; call the module as \
                     `self.{layer}.call(&x)`, not `x.apply(&self.{layer})` or \
                     `self.{layer}.forward(&x)` (a deliberate direct use goes in \
                     ShardState::allow_direct_use)",
                    pg.rank()
                )
            };
            let typed = |err: &tch_dist::ForwardError, layer: &str| {
                matches!(
                    err.downcast_ref::<ShardError>(),
                    Some(ShardError::HooksBypassed { rank, module, param })
                        if *rank == pg.rank() && module == layer
                            && *param == format!("{layer}.weight")
                )
            };
            // A row-parallel layer run with `forward` (it returned partial sums before).
            let vs = nn::VarStore::new(Device::Cpu);
            let r = vs.root();
            let mut model = BypassFc2 {
                fc1: nn::linear(&r / "fc1", 6, 8, Default::default()),
                fc2: nn::linear(&r / "fc2", 8, 5, Default::default()),
            };
            let plan = MegatronPlanner::default().build_plan(&model).unwrap();
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            let err = tch::no_grad(|| model.f_call(&x)).unwrap_err();
            assert_eq!(err.message(), expected("fc2"));
            assert!(typed(&err, "fc2"), "{err:?}");

            // `apply` on a column-parallel layer, frozen parameters, no_grad.
            let mut vs = nn::VarStore::new(Device::Cpu);
            let r = vs.root();
            let mut model = ApplyMlp {
                fc1: nn::linear(&r / "fc1", 6, 8, Default::default()),
                fc2: nn::linear(&r / "fc2", 8, 5, Default::default()),
            };
            let plan = MegatronPlanner::default().build_plan(&model).unwrap();
            shard_module(&mut model, &plan, 0, &pg).unwrap();
            vs.freeze();
            let err = tch::no_grad(|| model.f_call(&x)).unwrap_err();
            assert_eq!(err.message(), expected("fc1"));
            assert!(typed(&err, "fc1"), "{err:?}");
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tch::no_grad(|| model.call(&x))
            }));
            assert_eq!(panic_text(panicked.unwrap_err()), expected("fc1"));
            // Outside a call, the shards are free (an optimizer step, a checkpoint).
            assert_eq!(
                tch::no_grad(|| model.fc1.ws.sum(Kind::Float)).size(),
                Vec::<i64>::new()
            );
        },
    );
}
