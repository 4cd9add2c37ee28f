//! fully_shard with the others: under `replicate` and beside `shard_module` (2-D), mixed
//! precision, resharding to fewer ranks, the optimizer state's checkpoint resharded 2 → 3,
//! a frozen weight beside a trained bias.

use super::*;
use tch_dist::checkpoint::{LoadOptions, SaveOptions, State};

/// fully_shard on the blocks and `replicate` on the root (which then manages only the
/// head): equal to one process.
fn with_replicate(pg: &ProcessGroup) -> f64 {
    let (ref_vs, reference, vs, m) = twin(pg);
    for b in &m.blocks {
        fully_shard(b, FsdpOptions::default()).unwrap();
    }
    let r = tch_dist::replicate::apply(&m, Default::default()).unwrap();
    assert_eq!(r.param_fqns(), ["head.weight", "head.bias"]);
    let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
    let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
    for step in 0..3 {
        step_both(&reference, &mut ref_opt, &m, &mut opt, step, pg);
    }
    max_diff_full(&m, &ref_vs)
}

/// fully_shard on each block and on the head, with no call enclosing them: each is a root
/// of its own (its own backward pass and end-of-backward callback, as in PyTorch), and
/// training still equals one process.
fn roots_without_a_common_root(pg: &ProcessGroup) -> f64 {
    let (ref_vs, reference, vs, m) = twin(pg);
    for b in &m.blocks {
        fully_shard(b, FsdpOptions::default()).unwrap();
    }
    fully_shard(&m.head, FsdpOptions::default()).unwrap();
    let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
    let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
    for step in 0..3 {
        step_both(&reference, &mut ref_opt, &m, &mut opt, step, pg);
    }
    max_diff_full(&m, &ref_vs)
}

/// Tensor parallelism on blocks 1 and 2 (`shard_module`, column- then row-wise) and
/// fully_shard on the rest, over the same ranks (every rank on the whole batch, as tensor
/// parallelism needs); also `clip_grad_norm` over both kinds of shards: the norm is the
/// unsharded model's.
fn two_d(pg: &ProcessGroup) -> f64 {
    use tch_dist::sharding::{shard_module, ColwiseLinear, RowwiseLinear, ShardingPlan};
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut m = model(&vs);
    let plan = ShardingPlan::builder()
        .shard_module(Model::path().blocks().at(1), ColwiseLinear::default())
        .shard_module(Model::path().blocks().at(2), RowwiseLinear)
        .return_local_tensor(Model::path().blocks().at(1))
        .build();
    shard_module(&mut m, &plan, 0, pg).unwrap();
    fully_shard(&m.blocks[0], FsdpOptions::default()).unwrap();
    fully_shard(&m.head, FsdpOptions::default()).unwrap();
    fully_shard(&m, FsdpOptions::default()).unwrap();
    let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
    let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
    for step in 0..3 {
        let (x, y) = batch(step);
        ref_opt.zero_grad();
        reference
            .forward(&x)
            .mse_loss(&y, tch::Reduction::Mean)
            .backward();
        let ref_norm = tch_dist::utils::clip_grad_norm(&reference, 0.05, 2.0).unwrap();
        ref_opt.step();
        opt.zero_grad();
        m.call(&x).mse_loss(&y, tch::Reduction::Mean).backward();
        let norm = tch_dist::utils::clip_grad_norm(&m, 0.05, 2.0).unwrap();
        assert!(
            (norm - ref_norm).abs() < 1e-5 * ref_norm.max(1.0),
            "step {step}: clip_grad_norm {norm} vs one process {ref_norm}"
        );
        assert!(ref_norm > 0.05, "the clip applies ({ref_norm})");
        opt.step();
    }
    max_diff_full(&m, &ref_vs)
}

fn composition_cases(pg: ProcessGroup) {
    let diff = with_replicate(&pg);
    assert!(
        diff < 1e-5,
        "fully_shard + replicate vs one process: {diff}"
    );
    let diff = roots_without_a_common_root(&pg);
    assert!(
        diff < 1e-5,
        "fully_shard roots without a common root vs one process: {diff}"
    );
    let diff = two_d(&pg);
    assert!(
        diff < 1e-5,
        "shard_module + fully_shard vs one process: {diff}"
    );
}

#[test]
fn composes_with_replicate_and_shard_module_at_2_ranks() {
    run_ranks(
        "composition::composes_with_replicate_and_shard_module_at_2_ranks",
        2,
        composition_cases,
    );
}

#[test]
fn composes_with_replicate_and_shard_module_at_3_ranks() {
    run_ranks(
        "composition::composes_with_replicate_and_shard_module_at_3_ranks",
        3,
        composition_cases,
    );
}

/// Mixed precision (bf16 parameters, f32 reduction, f32 output): shards, `.grad` and the
/// optimizer stay f32, gathered parameters are bf16, and training follows one f32 process
/// within bf16's precision.
fn mixed_precision(pg: &ProcessGroup) -> f64 {
    use tch_dist::fully_shard::MixedPrecisionPolicy;
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = model(&ref_vs);
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs);
    let mp = MixedPrecisionPolicy {
        param_dtype: Some(Kind::BFloat16),
        reduce_dtype: Some(Kind::Float),
        ..Default::default()
    };
    for b in &m.blocks {
        let opts = FsdpOptions {
            mp_policy: mp,
            ..Default::default()
        };
        fully_shard(b, opts).unwrap();
    }
    let root = FsdpOptions {
        mp_policy: MixedPrecisionPolicy {
            output_dtype: Some(Kind::Float),
            ..mp
        },
        ..Default::default()
    };
    fully_shard(&m, root).unwrap();
    let s = fully_shard::state(&m.blocks[1]).unwrap();
    s.unshard().unwrap();
    assert_eq!(m.blocks[1].ws.kind(), Kind::BFloat16, "gathered in bf16");
    s.reshard().unwrap();
    // SGD: the difference scales with bf16's gradient error (AdamW's normalised steps
    // would turn a tiny gradient's rounding into a whole step).
    let mut opt = nn::Sgd::default().build(&vs, 0.2).unwrap();
    let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.2).unwrap();
    for step in 0..3 {
        let (x, y) = batch(step);
        ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        let out = m.call(&slice(&x, pg));
        assert_eq!(out.kind(), Kind::Float, "output_dtype");
        opt.backward_step(&out.mse_loss(&slice(&y, pg), tch::Reduction::Mean));
        for (fqn, t) in vs.variables() {
            assert_eq!(t.kind(), Kind::Float, "{fqn}: the shard stays f32");
            assert_eq!(t.grad().kind(), Kind::Float, "{fqn}: .grad is f32");
        }
        assert_sharded(&m, &vs, pg);
    }
    max_diff_full(&m, &ref_vs)
}

#[test]
fn mixed_precision_at_2_ranks() {
    run_ranks("composition::mixed_precision_at_2_ranks", 2, |pg| {
        let diff = mixed_precision(&pg);
        assert!(diff < 5e-3, "bf16 vs one f32 process: {diff}");
        assert!(diff > 0.0, "computed in bf16 indeed");
    });
}

#[test]
fn reshard_to_fewer_ranks_at_4_ranks() {
    run_ranks("composition::reshard_to_fewer_ranks_at_4_ranks", 4, |pg| {
        let (diff, moved) = train(&pg, Groups::ToRanks(2), 3);
        assert!(moved > 1e-2, "training moved the weights ({moved})");
        assert!(
            diff < 1e-5,
            "reshard_after_forward=2 vs one process: {diff}"
        );
        // Between forward and backward each block keeps its shard over 2 ranks: half of
        // block 1's 17 x 7 + 17 (9 rows, padded) in f32.
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        apply(&m, Groups::ToRanks(2), FsdpOptions::default());
        let (x, y) = batch(0);
        let loss = m
            .call(&slice(&x, &pg))
            .mse_loss(&slice(&y, &pg), tch::Reduction::Mean);
        let b1 = fully_shard::state(&m.blocks[1]).unwrap();
        assert_eq!(b1.gathered_bytes(), 0);
        assert_eq!(b1.post_forward_bytes(), (9 * 7 + 9) * 4);
        loss.backward();
        assert_eq!(b1.post_forward_bytes(), 0);
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        let opts = FsdpOptions {
            reshard_after_forward: Some(3.into()),
            ..Default::default()
        };
        let err = fully_shard(&m.blocks[0], opts).unwrap_err();
        assert!(
            matches!(
                err.problem(),
                Some(FsdpProblem::ReshardRanks { ranks: 3, world: 4 })
            ),
            "{err}"
        );
    });
}

/// fully_shard with `tch_dist::optim::AdamW`: trained 2 steps by ranks 0 and 1, saved with
/// the optimizer's (sharded) state, loaded at 3 ranks and trained 2 more, equals 4 steps in
/// one process.
#[test]
fn optimizer_state_checkpoint_reshards_2_to_3() {
    run_ranks(
        "composition::optimizer_state_checkpoint_reshards_2_to_3",
        3,
        |pg| {
            use tch_dist::{checkpoint, optim};
            let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fsdp_optim");
            if pg.rank() == 0 {
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).unwrap();
            }
            pg.barrier().unwrap();
            let ckpt = dir.join("step-00000002");
            let train = |m: &Model, opt: &mut optim::Optimizer, group: &ProcessGroup, steps| {
                for step in steps {
                    let (x, y) = batch(step);
                    let loss = m
                        .call(&slice(&x, group))
                        .mse_loss(&slice(&y, group), tch::Reduction::Mean);
                    opt.backward_step(&loss).unwrap();
                }
            };
            let sharded = |vs: &nn::VarStore, group: &ProcessGroup| {
                let m = model(vs);
                for b in &m.blocks {
                    let opts = FsdpOptions {
                        process_group: Some(group.clone()),
                        ..Default::default()
                    };
                    fully_shard(b, opts).unwrap();
                }
                let opts = FsdpOptions {
                    process_group: Some(group.clone()),
                    ..Default::default()
                };
                fully_shard(&m, opts).unwrap();
                m
            };
            let pair = pg.new_group(&[0, 1], tch_dist::Backend::Gloo).unwrap();
            if let Some(pair) = &pair {
                tch::manual_seed(3);
                let vs = nn::VarStore::new(Device::Cpu);
                let m = sharded(&vs, pair);
                let mut opt = optim::AdamW::default().build(&vs, 1e-2).unwrap();
                train(&m, &mut opt, pair, 0..2);
                let opts = checkpoint::SaveOptions::default();
                checkpoint::save(&ckpt, &State::new(&m).with_optimizer(&mut opt), pair, &opts)
                    .unwrap();
            }
            pg.barrier().unwrap();
            tch::manual_seed(50 + pg.rank() as i64);
            let vs = nn::VarStore::new(Device::Cpu);
            let m = sharded(&vs, &pg);
            let mut opt = optim::AdamW::default().build(&vs, 1e-2).unwrap();
            checkpoint::load(
                &ckpt,
                &mut State::new(&m).with_optimizer(&mut opt),
                &pg,
                &LoadOptions::default(),
            )
            .unwrap();
            train(&m, &mut opt, &pg, 2..4);
            // The reference: one process, 4 steps.
            tch::manual_seed(3);
            let ref_vs = nn::VarStore::new(Device::Cpu);
            let reference = model(&ref_vs);
            let mut ref_opt = optim::AdamW::default().build(&ref_vs, 1e-2).unwrap();
            for step in 0..4 {
                let (x, y) = batch(step);
                ref_opt
                    .backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean))
                    .unwrap();
            }
            let diff = max_diff_full(&m, &ref_vs);
            assert!(diff < 1e-5, "saved at 2, resumed at 3: {diff}");
        },
    );
}

/// A block whose weight is frozen and whose bias trains, inside a graph whose input needs
/// a gradient: its bias's gradient can arrive before autograd has used the frozen weight
/// for the input's gradient, so the group must not free its weight then. Against one
/// process, per-block groups, both resharding modes.
#[test]
fn frozen_weight_trained_bias_at_2_ranks() {
    run_ranks(
        "composition::frozen_weight_trained_bias_at_2_ranks",
        2,
        |pg| {
            for reshard_after_forward in [true, false] {
                tch::manual_seed(3);
                let ref_vs = nn::VarStore::new(Device::Cpu);
                let reference = model(&ref_vs);
                tch::manual_seed(3);
                let vs = nn::VarStore::new(Device::Cpu);
                let m = model(&vs);
                for w in [
                    &m.blocks[1].ws,
                    &m.blocks[2].ws,
                    &reference.blocks[1].ws,
                    &reference.blocks[2].ws,
                ] {
                    let _ = w.set_requires_grad(false);
                }
                apply(
                    &m,
                    Groups::PerBlock {
                        reshard_after_forward,
                    },
                    FsdpOptions::default(),
                );
                let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
                let mut ref_opt = nn::AdamW::default().build(&ref_vs, 1e-2).unwrap();
                for step in 0..3 {
                    step_both(&reference, &mut ref_opt, &m, &mut opt, step, &pg);
                }
                let diff = max_diff_full(&m, &ref_vs);
                assert!(
                    diff < 1e-5,
                    "frozen weights (reshard {reshard_after_forward}): {diff}"
                );
            }
        },
    );
}

/// HSDP on a 2x2 mesh (`dp_replicate` x `dp_shard`): each parameter sharded over 2 ranks
/// and replicated over the other 2, per-block groups then the root; 3 SGD-with-momentum
/// steps on each rank's quarter of the batch equal one process on the whole batch; each
/// rank holds half of every parameter's rows; `clip_grad_norm` is the unsharded model's; a
/// checkpoint holds each shard once (the second replica writes nothing) and loads into a
/// plain model at 4 ranks with the trained values.
#[test]
fn hsdp_on_a_2x2_mesh_equals_one_process() {
    run_ranks(
        "composition::hsdp_on_a_2x2_mesh_equals_one_process",
        4,
        |pg| {
            use tch_dist::checkpoint;
            use tch_dist::device_mesh::init_device_mesh;
            let mesh = init_device_mesh("cpu", &[2, 2], &["dp_replicate", "dp_shard"]).unwrap();
            let (ref_vs, reference, vs, m) = twin(&pg);
            let opts = || FsdpOptions {
                mesh: Some(mesh.clone()),
                ..Default::default()
            };
            for b in &m.blocks {
                fully_shard(b, opts()).unwrap();
            }
            fully_shard(&m, opts()).unwrap();
            let shard_group = mesh.get_group("dp_shard").unwrap();
            assert_sharded(&m, &vs, shard_group);
            // The placement record: replicated over dim 0, rows sharded over dim 1.
            use tch_dist::state_dict::{placements, Placement};
            let record = placements(&m);
            let w = record
                .get(&m.blocks[0].ws)
                .expect("blocks.0.weight is sharded");
            assert_eq!(w.placements(), [Placement::Replicate, Placement::Shard(0)]);
            assert_eq!(w.fqn, "blocks.0.weight");
            assert_eq!(w.global_shape, reference.blocks[0].ws.size());
            assert_eq!(w.local_shape, m.blocks[0].ws.size());
            assert_eq!(w.is_replica_copy(), pg.rank() >= 2);
            assert_eq!(record.len(), vs.trainable_variables().len());
            let sgd = nn::Sgd {
                momentum: 0.9,
                ..Default::default()
            };
            let mut opt = sgd.build(&vs, 0.05).unwrap();
            let mut ref_opt = sgd.build(&ref_vs, 0.05).unwrap();
            for step in 0..3 {
                let (x, y) = batch(step);
                ref_opt.zero_grad();
                reference
                    .forward(&x)
                    .mse_loss(&y, tch::Reduction::Mean)
                    .backward();
                let ref_norm = tch_dist::utils::clip_grad_norm(&reference, 1e9, 2.0).unwrap();
                ref_opt.step();
                opt.zero_grad();
                m.call(&slice(&x, &pg))
                    .mse_loss(&slice(&y, &pg), tch::Reduction::Mean)
                    .backward();
                let norm = tch_dist::utils::clip_grad_norm(&m, 1e9, 2.0).unwrap();
                assert!(
                    (norm - ref_norm).abs() < 1e-5 * ref_norm.max(1.0),
                    "step {step}: clip_grad_norm {norm} vs one process {ref_norm}"
                );
                opt.step();
            }
            assert_sharded(&m, &vs, shard_group);
            let diff = max_diff_full(&m, &ref_vs);
            assert!(diff < 1e-5, "HSDP 2x2 vs one process: {diff}");
            let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hsdp_2x2");
            if pg.rank() == 0 {
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).unwrap();
            }
            pg.barrier().unwrap();
            let ckpt = dir.join("step-00000003");
            checkpoint::save(&ckpt, &State::new(&m), &pg, &SaveOptions::default()).unwrap();
            // Ranks 2 and 3 (the second replica) hold the same shards as 0 and 1.
            for r in 0..4 {
                assert_eq!(
                    ckpt.join(checkpoint::file_name(r)).exists(),
                    r < 2,
                    "rank {r}'s file"
                );
            }
            let plain_vs = nn::VarStore::new(Device::Cpu);
            let plain = model(&plain_vs);
            checkpoint::load(&ckpt, &mut State::new(&plain), &pg, &LoadOptions::default()).unwrap();
            let vars = ref_vs.variables();
            for (fqn, t) in plain_vs.variables() {
                let d = (&t - &vars[&fqn]).abs().max().double_value(&[]);
                assert!(d < 1e-5, "{fqn} loaded from the HSDP checkpoint: {d}");
            }
        },
    );
}

/// HSDP with fully_shard's other options: bf16 parameters with f32 reduction and output,
/// `reshard_after_forward = false` on the blocks, the head's weight sharded along its
/// columns (`shard_placement_fn`), and gradient accumulation over two halves of each rank's
/// rows with the first backward unsynchronised: 3 SGD steps follow one f32 process within
/// bf16's precision, and the head's weight is sharded by columns over the shard dim.
#[test]
fn hsdp_with_every_option_follows_one_process_at_4_ranks() {
    run_ranks(
        "composition::hsdp_with_every_option_follows_one_process_at_4_ranks",
        4,
        |pg| {
            use tch_dist::device_mesh::init_device_mesh;
            use tch_dist::fully_shard::{MixedPrecisionPolicy, ShardPlacementFn};
            let mesh = init_device_mesh("cpu", &[2, 2], &["dp_replicate", "dp_shard"]).unwrap();
            let (ref_vs, reference, vs, m) = twin(&pg);
            let mp = MixedPrecisionPolicy {
                param_dtype: Some(Kind::BFloat16),
                reduce_dtype: Some(Kind::Float),
                ..Default::default()
            };
            let columns = ShardPlacementFn::new(|fqn, t| {
                (fqn == "head.weight" && t.size()[1] % 2 == 0).then_some(1)
            });
            for b in &m.blocks {
                let opts = FsdpOptions {
                    mesh: Some(mesh.clone()),
                    mp_policy: mp,
                    reshard_after_forward: Some(false.into()),
                    ..Default::default()
                };
                fully_shard(b, opts).unwrap();
            }
            let root = FsdpOptions {
                mesh: Some(mesh.clone()),
                mp_policy: MixedPrecisionPolicy {
                    output_dtype: Some(Kind::Float),
                    ..mp
                },
                shard_placement_fn: Some(columns),
                ..Default::default()
            };
            fully_shard(&m, root).unwrap();
            let head = tch_dist::state_dict::placements(&m);
            let head = head.get(&m.head.ws).expect("head.weight is sharded");
            use tch_dist::state_dict::Placement;
            assert_eq!(
                head.placements(),
                [Placement::Replicate, Placement::Shard(1)]
            );
            assert_eq!(m.head.ws.size(), [2, 8], "the head's columns, halved");
            let state = fully_shard::state(&m).unwrap();
            let mut opt = nn::Sgd::default().build(&vs, 0.2).unwrap();
            let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.2).unwrap();
            for step in 0..3 {
                let (x, y) = batch(step);
                ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
                opt.zero_grad();
                let (x, y) = (slice(&x, &pg), slice(&y, &pg));
                let half = x.size()[0] / 2;
                for (i, (start, len)) in [(0, half), (half, x.size()[0] - half)]
                    .into_iter()
                    .enumerate()
                {
                    state.set_requires_gradient_sync(i == 1);
                    let out = m.call(&x.narrow(0, start, len));
                    assert_eq!(out.kind(), Kind::Float, "output_dtype");
                    // Each half's mean, weighted by its rows: their sum is the rank's mean.
                    let w = len as f64 / x.size()[0] as f64;
                    (out.mse_loss(&y.narrow(0, start, len), tch::Reduction::Mean) * w).backward();
                }
                opt.step();
            }
            let diff = max_diff_full(&m, &ref_vs);
            assert!(
                diff < 5e-3,
                "HSDP with every option vs one f32 process: {diff}"
            );
            assert!(diff > 0.0, "computed in bf16 indeed");
        },
    );
}

/// Two forwards before their backwards, each backward its own pass (a pipeline schedule's
/// microbatches; gradient accumulation that keeps its losses): both microbatches' gradients
/// are reduced and installed, equal to one process on the whole batch. Before the fix the
/// second backward's gradients were left behind (its pass never finished the groups).
#[test]
fn forwards_ahead_of_their_backwards_at_2_ranks() {
    run_ranks(
        "composition::forwards_ahead_of_their_backwards_at_2_ranks",
        2,
        |pg| {
            let (ref_vs, reference, vs, m) = twin(&pg);
            for b in &m.blocks {
                fully_shard(b, FsdpOptions::default()).unwrap();
            }
            fully_shard(&m, FsdpOptions::default()).unwrap();
            let sgd = nn::Sgd {
                momentum: 0.9,
                ..Default::default()
            };
            let mut opt = sgd.build(&vs, 0.05).unwrap();
            let mut ref_opt = sgd.build(&ref_vs, 0.05).unwrap();
            for step in 0..3 {
                let (x, y) = batch(step);
                ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
                let (x, y) = (slice(&x, &pg), slice(&y, &pg));
                let half = x.size()[0] / 2;
                opt.zero_grad();
                let losses: Vec<Tensor> = (0..2)
                    .map(|i| {
                        let (xs, ys) = (x.narrow(0, i * half, half), y.narrow(0, i * half, half));
                        m.call(&xs).mse_loss(&ys, tch::Reduction::Mean) / 2.0
                    })
                    .collect();
                for l in losses.iter().rev() {
                    l.backward();
                }
                opt.step();
            }
            assert_sharded(&m, &vs, &pg);
            let diff = max_diff_full(&m, &ref_vs);
            assert!(diff < 1e-5, "two forwards, then two backwards: {diff}");
        },
    );
}
