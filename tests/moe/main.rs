//! The mixture-of-experts layer (`tch_dist::nn::moe`) against PyTorch: the same layer written
//! token by token in Python (reference.py, from the `.venv`) gives the same output, auxiliary
//! loss and gradients (float64); ties route to the lower expert; the load-balancing bias
//! moves alike on every rank from the global counts; HF's names round-trip; a configuration
//! that cannot run is refused.
//!
//! | file | what it tests | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `main.rs` | the tests | torchtitan's `tests/unit_tests/test_moe.py`, `test_expert_parallel.py` (one process) |
//! | `reference.py` | the oracle: torchtitan's MoE token by token | torchtitan's `models/common/moe.py` |

#[path = "../common/python.rs"]
mod python;

use std::collections::HashMap;
use std::path::Path;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::nn::moe::{MoE, MoeConfig, MoeError, ScoreFunction};
use tch_dist::testing::run_ranks;

const DIM: i64 = 8;

/// A float64 layer with weights large enough that routing depends on them.
fn layer(config: MoeConfig, seed: i64) -> (nn::VarStore, MoE) {
    tch::manual_seed(seed);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let moe = MoE::new(vs.root() / "moe", config).expect("a valid config");
    vs.double();
    tch::no_grad(|| {
        // In name order: the same values in every process (a HashMap's order is not).
        let mut named: Vec<_> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, mut t) in named {
            let fresh = Tensor::randn(t.size(), (Kind::Double, Device::Cpu)) * 0.5;
            t.copy_(&fresh);
        }
    });
    (vs, moe)
}

/// Two equal layers (8 experts of width 16, top-2, a shared expert of width 12), seed 4:
/// the one-process reference, and the one a test parallelizes.
fn twins() -> ((nn::VarStore, MoE), (nn::VarStore, MoE)) {
    let config = MoeConfig {
        shared_hidden: Some(12),
        ..MoeConfig::new(DIM, 16, 8, 2)
    };
    (layer(config.clone(), 4), layer(config, 4))
}

/// SGD with momentum (lr 0.1) over `vs`: what the equality-with-one-process tests train with.
fn sgd(vs: &nn::VarStore) -> nn::Optimizer {
    nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(vs, 0.1)
    .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// The layer, its input and upstream gradient through reference.py: its results by name.
fn pytorch(moe: &MoE, x: &Tensor, g: &Tensor, dir: &Path) -> HashMap<String, Tensor> {
    let c = moe.config();
    let mut named: Vec<(&str, Tensor)> = vec![
        ("x", x.detach()),
        ("g", g.shallow_clone()),
        ("gate", moe.router.gate.ws.detach()),
        ("bias", moe.router.expert_bias.detach()),
        ("w1", moe.experts.w1.detach()),
        ("w2", moe.experts.w2.detach()),
        ("w3", moe.experts.w3.detach()),
    ];
    if let Some(s) = &moe.shared_experts {
        named.extend([
            ("s1", s.w1.ws.detach()),
            ("s2", s.w2.ws.detach()),
            ("s3", s.w3.ws.detach()),
        ]);
    }
    let (input, output) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    Tensor::write_safetensors(&named, &input).unwrap();
    let config = serde_json::json!({
        "dim": c.dim, "experts": c.experts, "top_k": c.top_k,
        "softmax": c.score_function == ScoreFunction::Softmax, "route_norm": c.route_norm,
        "route_scale": c.route_scale, "load_balance": c.load_balance_coeff.is_some(),
        "aux_alpha": c.aux_loss_alpha,
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/moe/reference.py");
    let status = python::clean(python::python().join("python"))
        .arg(script)
        .arg(&input)
        .arg(&output)
        .arg(config.to_string())
        .status()
        .expect("the .venv's python");
    assert!(status.success(), "reference.py failed");
    Tensor::read_safetensors(&output)
        .unwrap()
        .into_iter()
        .collect()
}

/// One configuration against PyTorch: the output, the auxiliary loss, the counts and every
/// gradient, to 1e-10.
fn equals_pytorch(name: &str, config: MoeConfig) {
    let (_vs, moe) = layer(config, 3);
    // A non-zero bias, so that selecting and weighing differ.
    tch::no_grad(|| {
        let mut b = moe.router.expert_bias.shallow_clone();
        b.copy_(&(Tensor::arange(moe.config().experts, (Kind::Double, Device::Cpu)) * 0.1));
    });
    let x = (Tensor::randn([3, 4, DIM], (Kind::Double, Device::Cpu))).set_requires_grad(true);
    let g = Tensor::randn([3, 4, DIM], (Kind::Double, Device::Cpu));
    let y = moe.forward(&x);
    let aux = moe.take_aux_loss();
    let loss = (&y * &g).sum(Kind::Double);
    let loss = match &aux {
        Some(a) => loss + a,
        None => loss,
    };
    loss.backward();
    let dir = std::env::temp_dir().join(format!("tch-dist-moe-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let want = pytorch(&moe, &x, &g, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(max_diff(&y, &want["out"]) < 1e-10, "{name}: output");
    let aux = aux.map_or(0.0, |a| a.double_value(&[]));
    assert!(
        (aux - want["aux"].double_value(&[0])).abs() < 1e-10,
        "{name}: aux loss"
    );
    assert!(
        max_diff(
            &moe.tokens_per_expert().to_kind(Kind::Double),
            &want["counts"]
        ) == 0.0,
        "{name}: counts"
    );
    let mut grads = vec![
        ("x", x.grad()),
        ("gate", moe.router.gate.ws.grad()),
        ("w1", moe.experts.w1.grad()),
        ("w2", moe.experts.w2.grad()),
        ("w3", moe.experts.w3.grad()),
    ];
    if let Some(s) = &moe.shared_experts {
        grads.extend([
            ("s1", s.w1.ws.grad()),
            ("s2", s.w2.ws.grad()),
            ("s3", s.w3.ws.grad()),
        ]);
    }
    for (n, got) in grads {
        assert!(
            max_diff(&got, &want[&format!("grad_{n}")]) < 1e-10,
            "{name}: the gradient of {n}"
        );
    }
}

#[test]
fn moe_equals_pytorch_token_by_token() {
    // DeepSeek-V3's routing (sigmoid, normalised, scaled, a shared expert, the bias), with
    // more experts than a few tokens fill (empty groups).
    let deepseek = MoeConfig {
        route_norm: true,
        route_scale: 2.5,
        shared_hidden: Some(12),
        aux_loss_alpha: 0.01,
        ..MoeConfig::new(DIM, 16, 16, 3)
    };
    equals_pytorch("deepseek", deepseek);
    // Qwen3-MoE's (softmax, normalised, no shared expert), without the bias.
    let qwen = MoeConfig {
        score_function: ScoreFunction::Softmax,
        route_norm: true,
        load_balance_coeff: None,
        ..MoeConfig::new(DIM, 16, 6, 2)
    };
    equals_pytorch("qwen", qwen);
}

#[test]
fn equal_scores_route_to_the_lower_experts_and_bad_configs_are_refused() {
    let (_vs, moe) = layer(MoeConfig::new(DIM, 16, 5, 2), 1);
    tch::no_grad(|| {
        let _ = moe.router.gate.ws.shallow_clone().zero_();
        let _ = moe.router.expert_bias.shallow_clone().zero_();
    });
    let routes = moe
        .router
        .route(&Tensor::randn([7, DIM], (Kind::Double, Device::Cpu)));
    let expected = Tensor::from_slice(&[0i64, 1]).expand([7, 2], false);
    assert_eq!(routes.experts, expected, "ties go to the lower experts");
    let vs = nn::VarStore::new(Device::Cpu);
    for (config, text) in [
        (
            MoeConfig::new(DIM, 16, 4, 0),
            "moe: top_k 0 must be between 1 and the 4 experts",
        ),
        (
            MoeConfig::new(DIM, 16, 4, 5),
            "moe: top_k 5 must be between 1 and the 4 experts",
        ),
        (
            MoeConfig {
                route_scale: f64::NAN,
                ..MoeConfig::new(DIM, 16, 4, 2)
            },
            "moe: route_scale NaN must be a positive number",
        ),
    ] {
        match MoE::new(vs.root() / "m", config) {
            Err(e @ MoeError::Config(_)) => assert_eq!(e.to_string(), text),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

#[test]
fn hf_names_round_trip_and_a_missing_one_changes_nothing() {
    let config = MoeConfig {
        shared_hidden: Some(12),
        ..MoeConfig::new(DIM, 16, 4, 2)
    };
    let (_a, from) = layer(config.clone(), 5);
    let (_b, to) = layer(config, 6);
    let prefix = "model.layers.3.mlp";
    let tensors: HashMap<String, Tensor> = from
        .hf_state_dict(prefix)
        .into_iter()
        .map(|(n, t)| (n, t.detach().copy()))
        .collect();
    assert_eq!(
        tensors["model.layers.3.mlp.experts.2.down_proj.weight"].size(),
        [DIM, 16]
    );
    assert_eq!(tensors["model.layers.3.mlp.gate.weight"].size(), [4, DIM]);
    assert!(tensors.contains_key("model.layers.3.mlp.shared_experts.up_proj.weight"));
    assert!(tensors.contains_key("model.layers.3.mlp.gate.e_score_correction_bias"));
    let mut partial: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    partial.remove("model.layers.3.mlp.experts.3.up_proj.weight");
    let before = to.experts.w1.copy();
    assert!(matches!(
        to.load_hf_state_dict(prefix, &partial),
        Err(MoeError::Missing(_))
    ));
    assert_eq!(to.experts.w1, before, "a refused load changes nothing");
    to.load_hf_state_dict(prefix, &tensors).unwrap();
    let x = Tensor::randn([5, DIM], (Kind::Double, Device::Cpu));
    assert!(max_diff(&to.forward(&x), &from.forward(&x)) == 0.0);
}

/// Each rank routes its own tokens; the bias moves by the global counts, alike everywhere.
#[test]
fn expert_bias_moves_alike_on_every_rank_from_the_global_counts() {
    run_ranks(
        "expert_bias_moves_alike_on_every_rank_from_the_global_counts",
        2,
        |pg| {
            let (_vs, moe) = layer(MoeConfig::new(DIM, 16, 4, 2), 9);
            tch::manual_seed(100 + pg.rank() as i64);
            let _ = moe.forward(&Tensor::randn([6, DIM], (Kind::Double, Device::Cpu)));
            let mine = moe.tokens_per_expert();
            let global = mine.copy();
            pg.all_reduce(&global, tch_dist::ReduceOp::Sum).unwrap();
            let delta = (global.mean(Kind::Float) - &global).sign() * 1e-3;
            let expected = moe.router.expert_bias.copy()
                + (&delta - delta.mean(Kind::Float)).to_kind(Kind::Double);
            moe.update_expert_bias(Some(&pg)).unwrap();
            assert!(max_diff(&moe.router.expert_bias, &expected) < 1e-12);
            assert_eq!(
                moe.tokens_per_expert().sum(Kind::Float).double_value(&[]),
                0.0
            );
            let other = moe.router.expert_bias.copy();
            pg.broadcast(&other, 0).unwrap();
            assert_eq!(other, moe.router.expert_bias, "the same bias on every rank");
        },
    );
}

/// Expert parallelism at 2 ranks (3 experts each) equals one process running every expert
/// on all the ranks' tokens: each rank's output and input gradient are its slice of the
/// reference's; its experts' gradients are the reference's for those experts over the 2
/// ranks (the gradient of the mean of the ranks' losses, as data parallelism averages the
/// rest), and the router's and shared expert's gradients summed over the ranks the
/// reference's. `replicate` over the same ranks leaves the experts alone (no broadcast of
/// rank 0's), and the full state dict gathers them whole. Experts the ranks do not divide
/// are refused, nothing changed.
#[test]
fn expert_parallel_equals_one_process_at_2_ranks() {
    run_ranks("expert_parallel_equals_one_process_at_2_ranks", 2, |pg| {
        let rank = pg.rank() as i64;
        let config = MoeConfig {
            shared_hidden: Some(12),
            route_norm: true,
            ..MoeConfig::new(DIM, 16, 6, 2)
        };
        let (_r, reference) = layer(config.clone(), 4);
        let (_v, mut moe) = layer(config, 4);
        moe.parallelize_experts(&pg).unwrap();
        assert_eq!(moe.local_experts(), 3 * rank..3 * rank + 3);
        tch::manual_seed(11);
        let all = Tensor::randn([2, 5, DIM], (Kind::Double, Device::Cpu));
        let g = Tensor::randn([2, 5, DIM], (Kind::Double, Device::Cpu));
        let x = all.get(rank).copy().set_requires_grad(true);
        let y = moe.f_forward(&x).unwrap();
        (&y * g.get(rank)).sum(Kind::Double).backward();
        let whole = all.copy().set_requires_grad(true);
        let expected = reference.forward(&whole);
        (&expected * &g).sum(Kind::Double).backward();
        assert!(max_diff(&y, &expected.get(rank)) < 1e-10, "the output");
        assert!(
            max_diff(&x.grad(), &whole.grad().get(rank)) < 1e-10,
            "the input's gradient"
        );
        let mine = moe.local_experts();
        for (w, r) in [
            (&moe.experts.w1, &reference.experts.w1),
            (&moe.experts.w2, &reference.experts.w2),
            (&moe.experts.w3, &reference.experts.w3),
        ] {
            let slice = r.grad().narrow(0, mine.start, mine.end - mine.start) / 2.0;
            assert!(
                max_diff(&w.grad(), &slice) < 1e-10,
                "the local experts' gradients"
            );
        }
        let shared = |m: &MoE| m.shared_experts.as_ref().unwrap().w2.ws.grad();
        for (got, want) in [
            (moe.router.gate.ws.grad(), reference.router.gate.ws.grad()),
            (shared(&moe), shared(&reference)),
        ] {
            pg.all_reduce(&got, tch_dist::ReduceOp::Sum).unwrap();
            assert!(
                max_diff(&got, &want) < 1e-10,
                "the replicated parts' gradients"
            );
        }
        // replicate over the same ranks: rank 0's experts are not broadcast; the state dict
        // gathers every expert.
        let before = moe.experts.w1.copy();
        tch_dist::replicate::apply(&moe, tch_dist::replicate::Options::default()).unwrap();
        assert_eq!(moe.experts.w1, before, "replicate leaves the experts alone");
        let full = tch_dist::state_dict::full_state_dict(&moe).unwrap();
        let whole = full
            .iter()
            .find(|(n, _)| n == "experts.w1")
            .expect("experts.w1");
        assert!(
            max_diff(&whole.1, &reference.experts.w1) == 0.0,
            "the experts gathered whole"
        );
        // 5 experts over 2 ranks: refused on both, the weights whole.
        let (_o, mut odd) = layer(MoeConfig::new(DIM, 16, 5, 2), 4);
        let refused = odd
            .parallelize_experts(&pg)
            .expect_err("5 experts over 2 ranks");
        assert_eq!(
            tch_dist::report(&refused),
            format!(
                "moe: expert parallelism refused: rank {rank}: shard_module: `experts`: \
                 expert_parallel: 5 experts cannot be split evenly over the 2 ranks of expert \
                 parallelism"
            ),
        );
        assert_eq!(odd.experts.w1.size()[0], 5);
        // Rank 0's layer has 4 experts, rank 1's 6: refused on both (the exchanges of every
        // forward rely on alike layers), nothing narrowed.
        let count = if rank == 0 { 4 } else { 6 };
        let (_d, mut differs) = layer(MoeConfig::new(DIM, 16, count, 2), 4);
        let refused = differs.parallelize_experts(&pg).expect_err("unlike layers");
        assert_eq!(
            tch_dist::report(&refused),
            format!(
                "moe: expert parallelism refused: rank {rank}: shard_module: tensors differ \
                 across ranks: `router.gate.weight` has shape [4, 8] (Double) on rank 0 but \
                 shape [6, 8] (Double) on rank 1"
            )
        );
        assert_eq!(differs.experts.w1.size()[0], count);
    });
}

/// A checkpoint of an expert-parallel layer (each rank writes its experts) loads at the same
/// 2 ranks into a plain layer, every rank reading all the experts: equal to the layer the
/// experts were split from.
#[test]
fn an_expert_parallel_checkpoint_loads_into_a_plain_layer_at_2_ranks() {
    use tch_dist::checkpoint::{self, LoadOptions, SaveOptions, State};
    run_ranks(
        "an_expert_parallel_checkpoint_loads_into_a_plain_layer_at_2_ranks",
        2,
        |pg| {
            let config = MoeConfig::new(DIM, 16, 4, 2);
            let (_r, reference) = layer(config.clone(), 8);
            let (_v, mut ep) = layer(config.clone(), 8);
            ep.parallelize_experts(&pg).unwrap();
            // One folder for both ranks: rank 0's pid names it.
            let name = Tensor::from_slice(&[std::process::id() as i64]);
            pg.broadcast(&name, 0).unwrap();
            let dir =
                std::env::temp_dir().join(format!("tch-dist-moe-ckpt-{}", name.int64_value(&[0])));
            checkpoint::save(&dir, &State::new(&ep), &pg, &SaveOptions::default()).unwrap();
            let (_p, plain) = layer(config, 9); // other values, all the experts
            checkpoint::load(&dir, &mut State::new(&plain), &pg, &LoadOptions::default()).unwrap();
            for (got, want) in [
                (&plain.experts.w1, &reference.experts.w1),
                (&plain.experts.w2, &reference.experts.w2),
                (&plain.router.gate.ws, &reference.router.gate.ws),
            ] {
                assert!(
                    max_diff(got, want) == 0.0,
                    "a plain layer loads the experts whole"
                );
            }
            pg.barrier().unwrap();
            if pg.rank() == 0 {
                let _ = std::fs::remove_dir_all(&dir);
            }
        },
    );
}

/// A checkpoint of an expert-parallel layer saved at 2 ranks (4 experts each, ranks 0 and 1
/// over their own group) loads at 4 ranks into a layer split 2 experts each: every rank
/// reads its experts' rows, equal to the layer the experts were split from (the placement
/// record's `Shard(0)` over the expert group, resharded on load).
#[test]
fn an_expert_parallel_checkpoint_saved_at_2_ranks_loads_at_4() {
    use tch_dist::checkpoint::{self, LoadOptions, SaveOptions, State};
    run_ranks(
        "an_expert_parallel_checkpoint_saved_at_2_ranks_loads_at_4",
        4,
        |pg| {
            let config = MoeConfig::new(DIM, 16, 8, 2);
            let name = Tensor::from_slice(&[std::process::id() as i64]);
            pg.broadcast(&name, 0).unwrap();
            let dir =
                std::env::temp_dir().join(format!("tch-dist-moe-ep2-{}", name.int64_value(&[0])));
            let pair = pg.new_group(&[0, 1], tch_dist::Backend::Gloo).unwrap();
            if let Some(pair) = &pair {
                let (_v, mut ep) = layer(config.clone(), 8);
                ep.parallelize_experts(pair).unwrap();
                assert_eq!(ep.experts.w1.size()[0], 4);
                checkpoint::save(&dir, &State::new(&ep), pair, &SaveOptions::default()).unwrap();
            }
            pg.barrier().unwrap();
            let (_r, reference) = layer(config.clone(), 8);
            let (_v, mut ep) = layer(config, 9); // other values
            ep.parallelize_experts(&pg).unwrap();
            let mine = ep.local_experts();
            assert_eq!(mine.end - mine.start, 2);
            checkpoint::load(&dir, &mut State::new(&ep), &pg, &LoadOptions::default()).unwrap();
            for (got, want) in [
                (&ep.experts.w1, &reference.experts.w1),
                (&ep.experts.w2, &reference.experts.w2),
                (&ep.experts.w3, &reference.experts.w3),
            ] {
                let slice = want.narrow(0, mine.start, 2);
                assert!(max_diff(got, &slice) == 0.0, "this rank's experts");
            }
            assert!(max_diff(&ep.router.gate.ws, &reference.router.gate.ws) == 0.0);
            pg.barrier().unwrap();
            if pg.rank() == 0 {
                let _ = std::fs::remove_dir_all(&dir);
            }
        },
    );
}

/// How a test shards the experts over `efsdp` and the rest over `dp`.
#[derive(Clone, Copy)]
enum ExpertFsdp {
    /// torchtitan's `fully_shard(moe.experts, mesh=efsdp)` first, then the layer's.
    OwnCall,
    /// One call on the layer whose `shard_placement_fn` puts the experts on `efsdp`
    /// (pytorch#173509).
    PlacementFn,
}

/// torchtitan's expert data parallelism at 4 ranks: experts split over `ep` (2 ranks, 4
/// experts each), then sharded over the ranks that hold the same ones (`efsdp`, the other
/// mesh dim) and the layer over all 4 (router and shared expert), as `how` says: 2 SGD
/// steps equal one process training on every rank's tokens (the mean of the ranks' losses),
/// the experts gathered whole through both placements.
fn expert_data_parallel_equals_one_process(pg: tch_dist::ProcessGroup, how: ExpertFsdp) {
    use tch_dist::device_mesh::init_device_mesh;
    use tch_dist::fully_shard::{ShardPlacement, ShardPlacementFn};
    use tch_dist::{fully_shard, Call, FsdpOptions};
    let rank = pg.rank() as i64;
    let ((ref_vs, reference), (vs, mut moe)) = twins();
    let mesh = init_device_mesh("cpu", &[2, 2], &["efsdp", "ep"]).unwrap();
    moe.parallelize_experts(mesh.get_group("ep").unwrap())
        .unwrap();
    let efsdp = mesh.dim("efsdp").unwrap();
    let mut world = FsdpOptions {
        mesh: Some(mesh.flatten(Some("dp")).unwrap()),
        ..Default::default()
    };
    match how {
        ExpertFsdp::OwnCall => {
            let on_efsdp = FsdpOptions {
                mesh: Some(efsdp),
                ..Default::default()
            };
            fully_shard(&moe.experts, on_efsdp).unwrap();
        }
        ExpertFsdp::PlacementFn => {
            world.shard_placement_fn = Some(ShardPlacementFn::with_mesh(move |fqn, _| {
                fqn.starts_with("experts.").then(|| ShardPlacement {
                    dim: 0,
                    mesh: Some(efsdp.clone()),
                })
            }));
        }
    }
    fully_shard(&moe, world).unwrap();
    // 8 experts: 4 on each ep rank, sharded over the 2 efsdp ranks.
    assert_eq!(moe.experts.w1.size()[0], 2);
    assert!(tch_dist::fully_shard::state(&moe.experts).is_some());
    let (mut ref_opt, mut opt) = (sgd(&ref_vs), sgd(&vs));
    for step in 0..2 {
        tch::manual_seed(20 + step);
        let all = Tensor::randn([4, 5, DIM], (Kind::Double, Device::Cpu));
        let target = Tensor::randn([4, 5, DIM], (Kind::Double, Device::Cpu));
        let y = moe.f_call(&all.get(rank)).unwrap();
        opt.backward_step(&y.mse_loss(&target.get(rank), tch::Reduction::Mean));
        // The mean over the ranks of each rank's loss.
        let ys = reference.forward(&all.view([-1, DIM])).view([4, 5, DIM]);
        ref_opt.backward_step(&ys.mse_loss(&target, tch::Reduction::Mean));
    }
    let full = tch_dist::state_dict::full_state_dict(&moe).unwrap();
    let want = ref_vs.variables();
    assert_eq!(full.len(), want.len());
    for (name, t) in full {
        let d = max_diff(&t, &want[&format!("moe.{name}")]);
        assert!(d < 1e-10, "{name} differs by {d}");
    }
}

#[test]
fn expert_parallel_with_fully_shard_on_an_expert_mesh_equals_one_process() {
    run_ranks(
        "expert_parallel_with_fully_shard_on_an_expert_mesh_equals_one_process",
        4,
        |pg| expert_data_parallel_equals_one_process(pg, ExpertFsdp::OwnCall),
    );
}

/// As above with one `fully_shard` on the layer, its `shard_placement_fn` putting the
/// experts on `efsdp`; a function that puts part of a module on a mesh of its own (`w1`
/// alone) is refused on every rank, nothing sharded.
#[test]
fn a_shard_placement_fn_with_an_expert_mesh_equals_one_process() {
    use tch_dist::device_mesh::init_device_mesh;
    use tch_dist::fully_shard::{ShardPlacement, ShardPlacementFn};
    use tch_dist::{fully_shard, FsdpOptions};
    run_ranks(
        "a_shard_placement_fn_with_an_expert_mesh_equals_one_process",
        4,
        |pg| {
            let mesh = init_device_mesh("cpu", &[2, 2], &["efsdp", "ep"]).unwrap();
            let efsdp = mesh.dim("efsdp").unwrap();
            let (_v, moe) = layer(MoeConfig::new(DIM, 16, 8, 2), 4);
            let w1_only = FsdpOptions {
                shard_placement_fn: Some(ShardPlacementFn::with_mesh(move |fqn, _| {
                    (fqn == "experts.w1").then(|| ShardPlacement {
                        dim: 0,
                        mesh: Some(efsdp.clone()),
                    })
                })),
                ..Default::default()
            };
            let refused = fully_shard(&moe, w1_only).expect_err("part of the experts");
            assert_eq!(
                tch_dist::report(&refused),
                format!(
                    "rank {}: fully_shard: shard_placement_fn puts `experts.w1` on a mesh of \
                     its own but not `experts.w2` of the same module: a mesh of its own is for \
                     whole submodules (a MoE layer's experts), each sharded by a fully_shard of \
                     its own",
                    pg.rank()
                )
            );
            assert_eq!(moe.experts.w1.size()[0], 8);
            assert!(tch_dist::fully_shard::state(&moe).is_none());
            expert_data_parallel_equals_one_process(pg, ExpertFsdp::PlacementFn);
        },
    );
}

/// torchtitan's way at 4 ranks: `parallelize_module` with the `ExpertParallel` style on the
/// layer's experts over a 4-rank `ep` mesh (2 experts each), `replicate` over the same ranks
/// for the router and the shared expert: 2 SGD steps with momentum equal one process
/// training on every rank's tokens. Then the misuse: rows per expert that do not describe a
/// rank's rows (on rank 1 only) are an error on every rank, no hang, nothing left behind (a
/// forward after it still equals one process); the style on a layer that is not grouped
/// experts is refused on every rank.
#[test]
fn expert_parallel_style_at_4_ranks_trains_as_one_process() {
    use tch_dist::device_mesh::init_device_mesh;
    use tch_dist::sharding::{parallelize_module, ExpertParallel, ParallelizePlan};
    use tch_dist::CallWith;
    run_ranks(
        "expert_parallel_style_at_4_ranks_trains_as_one_process",
        4,
        |pg| {
            let rank = pg.rank() as i64;
            let ((ref_vs, reference), (vs, mut moe)) = twins();
            let mesh = init_device_mesh("cpu", &[4], &["ep"]).unwrap();
            let plan = ParallelizePlan::new().style("", ExpertParallel);
            parallelize_module(&mut moe.experts, &mesh, &plan).unwrap();
            assert_eq!(moe.local_experts(), 2 * rank..2 * rank + 2);
            assert_eq!(moe.experts.w2.size(), [2, DIM, 16]);
            tch_dist::replicate::apply(&moe, tch_dist::replicate::Options::default()).unwrap();
            let (mut ref_opt, mut opt) = (sgd(&ref_vs), sgd(&vs));
            let step =
                |seed: i64, moe: &MoE, opt: &mut nn::Optimizer, ref_opt: &mut nn::Optimizer| {
                    tch::manual_seed(seed);
                    let all = Tensor::randn([4, 5, DIM], (Kind::Double, Device::Cpu));
                    let target = Tensor::randn([4, 5, DIM], (Kind::Double, Device::Cpu));
                    let y = moe.f_forward(&all.get(rank)).unwrap();
                    opt.backward_step(&y.mse_loss(&target.get(rank), tch::Reduction::Mean));
                    let ys = reference.forward(&all.view([-1, DIM])).view([4, 5, DIM]);
                    ref_opt.backward_step(&ys.mse_loss(&target, tch::Reduction::Mean));
                    max_diff(&y, &ys.get(rank))
                };
            for seed in [20, 21] {
                assert!(
                    step(seed, &moe, &mut opt, &mut ref_opt) < 1e-10,
                    "the outputs"
                );
            }
            let full = tch_dist::state_dict::full_state_dict(&moe).unwrap();
            let want = ref_vs.variables();
            assert_eq!(full.len(), want.len());
            for (name, t) in &full {
                let d = max_diff(t, &want[&format!("moe.{name}")]);
                assert!(d < 1e-10, "{name} differs by {d}");
            }

            // Rank 1's counts add up to 9 for its 10 rows: every rank refuses the call.
            let rows = Tensor::randn([10, DIM], (Kind::Double, Device::Cpu));
            let mut counts = vec![1i64, 2, 1, 1, 2, 1, 1, 1];
            if rank == 1 {
                counts[0] = 0;
            }
            let counts = Tensor::from_slice(&counts);
            let refused = moe
                .experts
                .f_call_with([&rows, &counts], |e, [rows, counts]| {
                    let n: Vec<i64> = Vec::try_from(counts).unwrap();
                    e.forward_grouped(rows, &n)
                })
                .expect_err("counts that do not add up");
            let text = if rank == 1 {
                "8 counts adding up to 9 for 10 rows of 8 experts".to_string()
            } else {
                "rank 1's counts of rows per expert do not match its rows".to_string()
            };
            assert_eq!(
                tch_dist::report(&refused),
                format!("shard_module: expert-parallel the root module on rank {rank}: {text}")
            );
            // Nothing left behind: the next step still equals one process.
            assert!(
                step(22, &moe, &mut opt, &mut ref_opt) < 1e-10,
                "after the refusal"
            );

            // The style on a linear layer: refused on every rank, the weight whole.
            let lin_vs = nn::VarStore::new(Device::Cpu);
            let mut lin = nn::linear(lin_vs.root() / "fc", DIM, 4, Default::default());
            let refused = parallelize_module(&mut lin, &mesh, &plan).expect_err("not experts");
            assert_eq!(
                tch_dist::report(&refused),
                format!(
                    "rank {rank}: shard_module: the root module: expert_parallel: \
                     ExpertParallel needs grouped experts (3-D `w1` and `w3` [experts, hidden, \
                     dim] and `w2` [experts, dim, hidden], nothing else), but this \
                     `tch::nn::linear::Linear` has a parameter `weight`"
                )
            );
            assert_eq!(lin.ws.size(), [4, DIM]);
        },
    );
}

/// torchtitan's expert x tensor parallelism at 4 ranks: `ExpertTensorParallel` on a 2-D
/// mesh `["ep", "tp"]` (4 experts per ep rank, each expert's hidden width halved over tp),
/// the tp ranks of an ep rank holding the same tokens, `replicate` over `ep` for the router
/// and the shared expert: 2 SGD steps with momentum equal one process training on both ep
/// ranks' tokens; the placement record says `[Shard(0), Shard(1)]`; a checkpoint of it
/// loads into a plain layer whole; a hidden width the tp ranks do not divide is refused on
/// every rank, nothing changed.
#[test]
fn expert_tensor_parallel_at_2x2_ranks_trains_as_one_process() {
    use tch_dist::checkpoint::{self, LoadOptions, SaveOptions, State};
    use tch_dist::device_mesh::init_device_mesh;
    use tch_dist::sharding::{parallelize_module, ExpertTensorParallel, ParallelizePlan};
    use tch_dist::state_dict::Placement;
    run_ranks(
        "expert_tensor_parallel_at_2x2_ranks_trains_as_one_process",
        4,
        |pg| {
            let ((ref_vs, reference), (vs, mut moe)) = twins();
            let mesh = init_device_mesh("cpu", &[2, 2], &["ep", "tp"]).unwrap();
            let (ep, tp) = (
                mesh.get_local_rank("ep").unwrap() as i64,
                mesh.get_local_rank("tp").unwrap() as i64,
            );
            let plan = ParallelizePlan::new().style("experts", ExpertTensorParallel);
            parallelize_module(&mut moe, &mesh, &plan).unwrap();
            assert_eq!(moe.local_experts(), 4 * ep..4 * ep + 4);
            assert_eq!(moe.experts.w1.size(), [4, 8, DIM]);
            assert_eq!(moe.experts.w2.size(), [4, DIM, 8]);
            let record = tch_dist::state_dict::placements(&moe);
            let w2 = record.get(&moe.experts.w2).expect("a placement");
            assert_eq!(w2.placements(), [Placement::Shard(0), Placement::Shard(2)]);
            assert_eq!(w2.offsets, [4 * ep, 0, 8 * tp]);
            let over_ep = tch_dist::replicate::Options {
                device_mesh: Some(mesh.dim("ep").unwrap()),
                ..Default::default()
            };
            tch_dist::replicate::apply(&moe, over_ep).unwrap();
            let (mut ref_opt, mut opt) = (sgd(&ref_vs), sgd(&vs));
            for seed in [30, 31] {
                tch::manual_seed(seed);
                let all = Tensor::randn([2, 5, DIM], (Kind::Double, Device::Cpu));
                let target = Tensor::randn([2, 5, DIM], (Kind::Double, Device::Cpu));
                let y = moe.f_forward(&all.get(ep)).unwrap();
                opt.backward_step(&y.mse_loss(&target.get(ep), tch::Reduction::Mean));
                let ys = reference.forward(&all.view([-1, DIM])).view([2, 5, DIM]);
                ref_opt.backward_step(&ys.mse_loss(&target, tch::Reduction::Mean));
                assert!(max_diff(&y, &ys.get(ep)) < 1e-10, "the outputs");
            }
            let full = tch_dist::state_dict::full_state_dict(&moe).unwrap();
            let want = ref_vs.variables();
            assert_eq!(full.len(), want.len());
            for (name, t) in &full {
                let d = max_diff(t, &want[&format!("moe.{name}")]);
                assert!(d < 1e-10, "{name} differs by {d}");
            }

            // A checkpoint of it loads into a plain layer: every expert whole.
            let name = Tensor::from_slice(&[std::process::id() as i64]);
            pg.broadcast(&name, 0).unwrap();
            let dir =
                std::env::temp_dir().join(format!("tch-dist-moe-etp-{}", name.int64_value(&[0])));
            checkpoint::save(&dir, &State::new(&moe), &pg, &SaveOptions::default()).unwrap();
            let (_p, plain) = layer(reference.config().clone(), 9);
            checkpoint::load(&dir, &mut State::new(&plain), &pg, &LoadOptions::default()).unwrap();
            for (got, want) in [
                (&plain.experts.w1, &reference.experts.w1),
                (&plain.experts.w2, &reference.experts.w2),
                (&plain.experts.w3, &reference.experts.w3),
            ] {
                assert!(max_diff(got, want) < 1e-10, "the experts loaded whole");
            }
            pg.barrier().unwrap();
            if pg.rank() == 0 {
                let _ = std::fs::remove_dir_all(&dir);
            }

            // Hidden width 5 over 2 tp ranks: refused on every rank, the weights whole.
            let (_o, mut odd) = layer(MoeConfig::new(DIM, 5, 8, 2), 4);
            let refused = parallelize_module(&mut odd, &mesh, &plan).expect_err("width 5");
            // The rank within the ep group, as shard_module's errors name it.
            assert_eq!(
                tch_dist::report(&refused),
                format!(
                    "rank {ep}: shard_module: `experts`: expert_tensor_parallel(tp=2): the \
                     experts' hidden width 5 cannot be split evenly over the 2 ranks of tensor \
                     parallelism"
                )
            );
            assert_eq!(odd.experts.w1.size(), [8, 5, DIM]);
        },
    );
}
