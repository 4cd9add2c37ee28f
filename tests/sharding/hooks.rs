//! The sharders' hooks in use: under `replicate`, removed, bypassed (with and without grad),
//! layers called or unused, `clip_grad_norm` over shards.

use super::*;

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
        "hooks::shard_then_replicate_trains_like_one_process",
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
        "hooks::removed_hooks_leave_local_layers_that_do_not_communicate",
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
        "hooks::hooked_layers_used_without_their_hooks_fail_on_every_rank",
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
                    Some(ShardError::Composition(OnRank {
                        rank,
                        problem: Composition::HooksBypassed { module, param, .. },
                    }))
                        if *rank == pg.rank() && module == "fc1" && param == "fc1.weight"
                ),
                "{err:?}"
            );
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = model.call(&x);
            }));
            assert_eq!(panic_text(panicked.unwrap_err()), expected);

            // 2. Called with `forward` (no hooked call at all): the shard fences' watch refuses
            // its first op that applies a sharded weight, with grad too (before the watch,
            // backward failed before any gradient of a guarded parameter); the optimizer
            // never steps.
            let mut opt = nn::Sgd::default().build(&vs, 0.5).unwrap();
            let mut names: Vec<String> = vs.variables().into_keys().collect();
            names.sort();
            let before: Vec<Tensor> = names.iter().map(|n| vs.variables()[n].copy()).collect();
            let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let loss = model.forward(&x).square().mean(Kind::Float);
                opt.backward_step(&loss)
            }));
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

            // 3. A deliberate direct use (a regularizer on the shards: no op that applies a
            // weight, so the watch lets it through) fails backward unless declared.
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
        "hooks::called_layers_train_exactly_and_unused_ones_are_fine",
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
        "hooks::clip_grad_norm_over_shards_is_the_unsharded_models",
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
        "hooks::bypassed_layers_fail_under_no_grad_on_every_rank",
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
                    Some(ShardError::Composition(OnRank {
                        rank,
                        problem: Composition::HooksBypassed { module, param, .. },
                    }))
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

/// Tensor parallelism over one mesh dim and fully_shard or replicate over all ranks (which
/// overlap the tensor-parallel ranks without being them: neither FSDP x TP nor one group):
/// each refuses on every rank, naming the first parameter in walk order and both sets of
/// ranks, and nothing changes.
#[test]
fn data_parallel_over_other_ranks_than_tensor_parallel_is_refused_at_4_ranks() {
    run_ranks(
        "hooks::data_parallel_over_other_ranks_than_tensor_parallel_is_refused_at_4_ranks",
        4,
        |pg| {
            use tch_dist::device_mesh::init_device_mesh;
            use tch_dist::{fully_shard, FsdpOptions};
            let rank = pg.rank();
            let mesh = init_device_mesh("cpu", &[2, 2], &["dp", "tp"]).unwrap();
            let tp = mesh.get_group("tp").unwrap();
            let vs = nn::VarStore::new(Device::Cpu);
            let mut model = mlp(&vs, 6, 8, 5);
            let plan = ShardingPlan::builder()
                .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
                .build();
            shard_module(&mut model, &plan, 0, tp).unwrap();
            let pair = [rank / 2 * 2, rank / 2 * 2 + 1];
            let before = model.fc2.ws.copy();
            let e = fully_shard(&model, FsdpOptions::default()).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {rank}: fully_shard: parameter `fc1.weight` is tensor-parallel over \
                     ranks {pair:?} and fully_shard averages over ranks [0, 1, 2, 3]: give \
                     fully_shard the same ranks, or the other dim of the mesh (FSDP x TP: \
                     `mesh.dim(\"dp\")` beside `mesh.dim(\"tp\")`)"
                )
            );
            let e = replicate::apply(&model, Default::default()).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {rank}: replicate: parameter `fc1.weight` is tensor-parallel over \
                     ranks {pair:?} and replicate averages over ranks [0, 1, 2, 3]: left out \
                     of its buckets, its gradient would not be averaged; use the same ranks \
                     for both"
                )
            );
            assert!(
                model.fc2.ws.equal(&before),
                "nothing changed on rank {rank}"
            );
            assert!(tch_dist::fully_shard::state(&model).is_none());
            assert!(replicate::state(&model).is_none());
        },
    );
}
