//! `replicate::apply` end to end, ranks as real processes over 127.0.0.1: equivalence with
//! single-process training, no_sync, ignored modules, broadcast at apply, and the errors.

use tch::nn;
use tch::Device;
use tch_dist::testing::{run_ranks, run_ranks_with, Launch};
use tch_dist::{replicate, Backend, Call, ProcessGroup};

#[path = "common/replicate_net.rs"]
mod replicate_net;
use replicate_net::{
    batch, each_case_against_plain, local_loss, net, no_sync_vs_one_step, option_cases,
    BUCKETS_ONE_PER_PARAM, PARAM_FQNS,
};

/// [`replicate_net::train_both`] on CPU.
fn train_both(pg: &ProcessGroup, opts: replicate::Options, with_head: bool, steps: usize) -> f64 {
    replicate_net::train_both(pg, Device::Cpu, opts, with_head, steps)
}

#[test]
fn replicate_matches_single_process_training() {
    run_ranks("replicate_matches_single_process_training", 3, |pg| {
        let d = train_both(&pg, replicate::Options::default(), false, 5);
        assert!(d < 1e-5, "defaults: {d}");
        let one_bucket = replicate::Options {
            bucket_cap_mb: 1e6,
            ..Default::default()
        };
        let d = train_both(&pg, one_bucket, false, 3);
        assert!(d < 1e-5, "one bucket: {d}");
        let per_param = replicate::Options {
            bucket_cap_mb: 1e-9,
            ..Default::default()
        };
        let d = train_both(&pg, per_param, false, 3);
        assert!(d < 1e-5, "a bucket per parameter: {d}");
        let views = replicate::Options {
            gradient_as_bucket_view: true,
            ..Default::default()
        };
        let d = train_both(&pg, views, false, 3);
        assert!(d < 1e-5, "gradient_as_bucket_view: {d}");
        let unused = replicate::Options {
            find_unused_parameters: true,
            ..Default::default()
        };
        let d = train_both(&pg, unused, true, 3);
        assert!(d < 1e-5, "find_unused_parameters: {d}");
        let static_graph = replicate::Options {
            static_graph: true,
            ..Default::default()
        };
        let d = train_both(&pg, static_graph, true, 3);
        assert!(d < 1e-5, "static_graph: {d}");
    });
}

/// `device_mesh`: a 1-D mesh (a dim of a 3x1 mesh) averages over its group, equal to one
/// process; a 2-D mesh, or a mesh with a process group, is refused on every rank.
#[test]
fn replicate_over_a_mesh_dim() {
    run_ranks("replicate_over_a_mesh_dim", 3, |pg| {
        use tch_dist::device_mesh::init_device_mesh;
        let rank = pg.rank();
        let mesh = init_device_mesh("cpu", &[3, 1], &["dp", "tp"]).unwrap();
        let over_dp = replicate::Options {
            device_mesh: Some(mesh.dim("dp").unwrap()),
            ..Default::default()
        };
        let d = train_both(&pg, over_dp, false, 3);
        assert!(d < 1e-5, "over mesh[\"dp\"]: {d}");
        let vs = nn::VarStore::new(Device::Cpu);
        let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
        let whole = replicate::Options {
            device_mesh: Some(mesh.clone()),
            ..Default::default()
        };
        let e = replicate::apply(&fc, whole).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "rank {rank}: replicate: the device_mesh has 2 dims; replicate averages over a \
                 1-D mesh (one dim of it: `mesh.dim(\"dp\")`)"
            )
        );
        let both = replicate::Options {
            device_mesh: Some(mesh.dim("dp").unwrap()),
            process_group: Some(pg.clone()),
            ..Default::default()
        };
        let e = replicate::apply(&fc, both).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "rank {rank}: replicate: both `device_mesh` and `process_group` were given; \
                 give one"
            )
        );
        assert!(replicate::state(&fc).is_none());
    });
}

#[test]
fn state_reports_fqns_and_buckets() {
    run_ranks("state_reports_fqns_and_buckets", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8, false);
        let opts = replicate::Options {
            bucket_cap_mb: 1e-9,
            process_group: Some(pg),
            ..Default::default()
        };
        replicate::apply(&model, opts).unwrap();
        let s = replicate::state(&model).unwrap();
        assert_eq!(s.param_fqns(), PARAM_FQNS);
        assert_eq!(s.buckets(), BUCKETS_ONE_PER_PARAM.map(|b| vec![b]));
        assert_eq!(tch_dist::registry(&model), vec!["replicate"]);
        assert!(replicate::state(&model.fc1).is_none());
    });
}

/// k micro-steps under no_sync, then one synchronised step, equal one step on k× the batch.
#[test]
fn no_sync_accumulates_then_averages() {
    run_ranks("no_sync_accumulates_then_averages", 2, |pg| {
        let d = no_sync_vs_one_step(&pg, Device::Cpu, 3);
        assert!(d < 1e-5, "no_sync: {d}");
    });
}

/// Parameters of ignored modules keep each rank's own gradient.
#[test]
fn ignored_modules_are_not_synchronised() {
    run_ranks("ignored_modules_are_not_synchronised", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8, false);
        let opts = replicate::Options::default().ignore(&model.fc1).unwrap();
        replicate::apply(&model, opts).unwrap();
        assert_eq!(
            replicate::state(&model).unwrap().param_fqns(),
            ["fc2.weight", "fc2.bias"]
        );
        let xy = batch(0, Device::Cpu);
        local_loss(&model, &xy, &pg).backward();
        let g1 = model.fc1.ws.grad();
        let g2 = model.fc2.ws.grad();
        let (a1, a2) = (g1.copy(), g2.copy());
        pg.all_reduce(&a1, tch_dist::ReduceOp::Avg).unwrap();
        pg.all_reduce(&a2, tch_dist::ReduceOp::Avg).unwrap();
        assert!(g2.allclose(&a2, 1e-6, 1e-7, false), "fc2 is synchronised");
        assert!(
            !g1.allclose(&a1, 1e-6, 1e-7, false),
            "fc1 (ignored) keeps the local gradient"
        );
    });
}

#[test]
fn shape_mismatch_fails_on_every_rank() {
    run_ranks("shape_mismatch_fails_on_every_rank", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8 + pg.rank() as i64, false);
        let err = replicate::apply(&model, replicate::Options::default())
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "rank {}: replicate: parameters differ across ranks: `fc1.weight` has shape [8, 4] (Float) on rank 0 but shape [9, 4] (Float) on rank 1",
                pg.rank()
            )
        );
        // Nothing was registered: the module can still be replicated once fixed.
        assert!(tch_dist::registry(&model).is_empty());
    });
}

/// Options that differ across ranks are an error on every rank naming the option and each
/// rank's value (before: a different `bucket_cap_mb` aborted Gloo, a different
/// `find_unused_parameters` hung until the timeout); a check that fails on one rank fails
/// every rank; nothing is changed.
#[test]
fn options_and_local_checks_agree_across_ranks() {
    run_ranks("options_and_local_checks_agree_across_ranks", 2, |pg| {
        let r = pg.rank();
        tch::manual_seed(r as i64);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8, false);
        let before = nn::VarStore::new(Device::Cpu);
        let _ = net(&before, 8, false);
        let mut before = before;
        before.copy(&vs).unwrap();
        let apply =
            |opts: replicate::Options| replicate::apply(&model, opts).unwrap_err().to_string();

        let err = apply(replicate::Options {
            bucket_cap_mb: if r == 0 { 25.0 } else { 10.0 },
            ..Default::default()
        });
        assert_eq!(
            err,
            format!(
                "rank {r}: replicate: option `bucket_cap_mb` differs across ranks: rank 0 has 25, \
                 rank 1 has 10"
            )
        );
        let err = apply(replicate::Options {
            find_unused_parameters: r == 1,
            ..Default::default()
        });
        assert_eq!(
            err,
            format!(
                "rank {r}: replicate: option `find_unused_parameters` differs across ranks: rank \
                 0 has false, rank 1 has true"
            )
        );
        let err = apply(replicate::Options {
            bucket_cap_mb: if r == 1 { -1.0 } else { 25.0 },
            ..Default::default()
        });
        let expected = if r == 1 {
            "rank 1: invalid argument to replicate: bucket_cap_mb must be positive, got -1"
        } else {
            "rank 0: replicate: rank 1 failed its own check (see its error); nothing was changed"
        };
        assert_eq!(err, expected);
        // Nothing was registered or broadcast: each rank keeps its own weights.
        assert!(tch_dist::registry(&model).is_empty());
        assert_eq!(replicate_net::max_diff(&before, &vs), 0.0);
    });
}

/// PyTorch: "DistributedDataParallel is not needed when a module doesn't have any parameter
/// that requires a gradient".
#[test]
fn an_all_frozen_model_is_an_error_on_every_rank() {
    run_ranks("an_all_frozen_model_is_an_error_on_every_rank", 2, |pg| {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8, false);
        vs.freeze();
        let err = replicate::apply(&model, replicate::Options::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "rank {}: replicate: the module has no parameter that requires a gradient (all \
                 are frozen, ignored or sharded), so there is nothing to replicate",
                pg.rank()
            )
        );
    });
}

#[test]
fn unused_parameter_fails_the_next_iteration() {
    run_ranks("unused_parameter_fails_the_next_iteration", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, 8, true);
        replicate::apply(&model, replicate::Options::default()).unwrap();
        let xy = batch(0, Device::Cpu);
        local_loss(&model, &xy, &pg).backward();
        let err = replicate::prepare_forward(&model).unwrap_err().to_string();
        assert!(
            err.contains("Expected to have finished reduction in the prior iteration"),
            "{err}"
        );
        assert!(
            err.ends_with(&format!(
                "did not receive grad for rank {}: head.weight, head.bias",
                pg.rank()
            )),
            "{err}"
        );
        // The forward hook raises the same error, as PyTorch's forward does: as a value
        // from `f_call`, as a panic from `call`.
        let err = model.f_call(&xy.0).unwrap_err();
        assert!(
            err.message()
                .contains("Expected to have finished reduction in the prior iteration"),
            "{err}"
        );
        let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.call(&xy.0)))
            .unwrap_err();
        let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("Expected to have finished reduction"), "{msg}");
    });
}

#[test]
fn apply_twice_and_conflicts_are_refused() {
    run_ranks_with(
        &Launch::new("apply_twice_and_conflicts_are_refused", 2),
        Backend::Gloo,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let model = net(&vs, 8, false);
            let opts = || replicate::Options {
                process_group: Some(pg.clone()),
                ..Default::default()
            };
            replicate::apply(&model, opts()).unwrap();
            let err = replicate::apply(&model, opts()).unwrap_err().to_string();
            assert!(
                err.contains("can only be applied to a module once")
                    && err.contains("replicate has already been applied"),
                "{err}"
            );

            let vs2 = nn::VarStore::new(Device::Cpu);
            let sharded = net(&vs2, 8, false);
            tch_dist::fully_shard(&sharded, Default::default()).unwrap();
            let err = replicate::apply(&sharded, opts()).unwrap_err().to_string();
            assert!(
                err.contains("fully_shard") && err.contains("replicate"),
                "{err}"
            );

            // A child managed by fully_shard is skipped by replicate.
            let vs3 = nn::VarStore::new(Device::Cpu);
            let partly = net(&vs3, 8, false);
            tch_dist::fully_shard(&partly.fc2, Default::default()).unwrap();
            replicate::apply(&partly, opts()).unwrap();
            assert_eq!(
                replicate::state(&partly).unwrap().param_fqns(),
                ["fc1.weight", "fc1.bias"]
            );
        },
    );
}

/// Trains `steps` replicated steps at world size 1 with `opts` and returns how many
/// collectives each step after the first launched.
fn collectives_per_step(pg: &ProcessGroup, opts: replicate::Options, steps: usize) -> Vec<u64> {
    use tch::nn::OptimizerConfig;
    let vs = nn::VarStore::new(Device::Cpu);
    let model = net(&vs, 8, false);
    replicate::apply(&model, opts).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut launched = Vec::new();
    for step in 0..steps {
        let before = pg.launched_collectives();
        opt.backward_step(&local_loss(&model, &batch(step, Device::Cpu), pg));
        if step > 0 {
            launched.push(pg.launched_collectives() - before);
        }
    }
    launched
}

/// At world size 1 replicate trains as one process and, by default, communicates nothing.
#[test]
fn world_size_one_takes_the_shortcuts() {
    run_ranks("world_size_one_takes_the_shortcuts", 1, |pg| {
        assert!(pg.skips_communication());
        let d = train_both(&pg, replicate::Options::default(), false, 3);
        assert!(d < 1e-6, "{d}");
        assert_eq!(
            collectives_per_step(&pg, replicate::Options::default(), 3),
            vec![0, 0]
        );
    });
}

/// The test switch TCH_DIST_NO_SHORTCUTS=1: at world size 1 every replicate case runs its
/// bucket collectives (one per bucket and step here) and still equals one process.
#[test]
fn world_size_one_without_shortcuts_communicates_and_matches() {
    let launch = Launch::new(
        "world_size_one_without_shortcuts_communicates_and_matches",
        1,
    )
    .env(tch_dist::NO_SHORTCUTS_ENV, "1");
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        assert!(!pg.skips_communication());
        let per_param = || replicate::Options {
            bucket_cap_mb: 1e-9,
            ..Default::default()
        };
        if let Err(e) = each_case_against_plain(&pg, Device::Cpu, option_cases(), 3, 1e-6) {
            panic!("{e}");
        }
        assert_eq!(
            collectives_per_step(&pg, replicate::Options::default(), 3),
            vec![1, 1]
        );
        assert_eq!(collectives_per_step(&pg, per_param(), 3), vec![4, 4]);
    });
}

/// `init_sync`: with false each rank keeps its own initial parameters and buffers (seeded
/// per rank here, so they differ); with true (the default) every rank holds rank 0's.
#[test]
fn init_sync_broadcasts_rank_0s_values_or_keeps_each_ranks() {
    run_ranks(
        "init_sync_broadcasts_rank_0s_values_or_keeps_each_ranks",
        2,
        |pg| {
            use tch::Tensor;
            let r = pg.rank();
            // The model as rank `seed` builds it: a linear layer and a batch norm whose running
            // mean is the rank's own.
            let build = |vs: &nn::VarStore, seed: usize| {
                tch::manual_seed(seed as i64);
                let net = nn::seq_t()
                    .add(nn::linear(vs.root() / "fc", 3, 2, Default::default()))
                    .add(nn::batch_norm1d(vs.root() / "bn", 2, Default::default()));
                tch::no_grad(|| {
                    let _ = vs.variables()["bn.running_mean"]
                        .shallow_clone()
                        .fill_(seed as f64 + 1.0);
                });
                net
            };
            let values = |vs: &nn::VarStore| -> Vec<(String, Tensor)> {
                let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
                v.sort_by(|a, b| a.0.cmp(&b.0));
                v.into_iter().map(|(n, t)| (n, t.detach().copy())).collect()
            };
            let rank_0s = {
                let vs = nn::VarStore::new(Device::Cpu);
                let _ = build(&vs, 0);
                values(&vs)
            };
            for init_sync in [false, true] {
                let vs = nn::VarStore::new(Device::Cpu);
                let net = build(&vs, r);
                let own = values(&vs);
                let opts = replicate::Options {
                    init_sync,
                    ..Default::default()
                };
                let model = replicate::wrap_t(net, &vs, opts).unwrap();
                let expected = if init_sync { &rank_0s } else { &own };
                for ((name, now), (_, want)) in values(&vs).iter().zip(expected) {
                    assert!(now.equal(want), "init_sync {init_sync}: {name}");
                }
                // The ranks' values differ without the broadcast and are equal with it.
                for name in ["fc.weight", "bn.running_mean"] {
                    let t = vs.variables()[name].detach().copy();
                    let sum = t.copy();
                    pg.all_reduce(&sum, tch_dist::ReduceOp::Sum).unwrap();
                    let same = sum.allclose(&(&t * 2.0), 0.0, 0.0, false);
                    assert_eq!(same, init_sync, "init_sync {init_sync}: {name}");
                }
                drop(model);
            }
            // The ranks must agree on it.
            let vs = nn::VarStore::new(Device::Cpu);
            let net = build(&vs, r);
            let opts = replicate::Options {
                init_sync: r == 0,
                ..Default::default()
            };
            let err = replicate::wrap_t(net, &vs, opts).unwrap_err().to_string();
            assert_eq!(
                err,
                format!(
                "rank {r}: replicate: option `init_sync` differs across ranks: rank 0 has true, \
                 rank 1 has false"
            )
            );
        },
    );
}

/// `skip_all_reduce_unused_params` with `find_unused_parameters`, a bucket per parameter:
/// `a` is used on both ranks, `b` on rank 0 only, `c` on neither (until the fourth pass,
/// where rank 1 uses it). The gradients are DDP's every pass (`a`: the mean of the ranks'
/// inputs; `b`: rank 0's gradient halved; `c`: none until it is used); with the option,
/// the passes after the first do not communicate `c`'s bucket, and the pass in which `c`
/// is used after all still averages it.
#[test]
fn skip_all_reduce_unused_params_skips_buckets_no_rank_used() {
    // The step check's headers stay on the backend, so that every pass launches its
    // exchange (through shared memory only the group's first two would).
    let launch = Launch::new(
        "skip_all_reduce_unused_params_skips_buckets_no_rank_used",
        2,
    )
    .env(tch_dist::COLLECTIVE_STEP_CHECK_ENV, "1");
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use tch::{Kind, Tensor};
        let r = pg.rank();
        // Collectives launched per pass, without and with the option.
        let mut launched_per_pass: Vec<Vec<u64>> = Vec::new();
        for skip in [false, true] {
            let vs = nn::VarStore::new(Device::Cpu);
            let root = vs.root();
            let a = root.var("a", &[3], nn::Init::Const(0.5));
            let b = root.var("b", &[3], nn::Init::Const(0.5));
            let c = root.var("c", &[3], nn::Init::Const(0.5));
            let use_c = Arc::new(AtomicBool::new(false));
            let (fa, fb, fc, flag) = (
                a.shallow_clone(),
                b.shallow_clone(),
                c.shallow_clone(),
                use_c.clone(),
            );
            // Rank r's input is all r + 1; rank 0 also uses b (times 2); rank 1 uses c
            // (times 4) when the flag is set.
            let net = nn::func(move |x| {
                let mut loss = (x * &fa).sum(Kind::Float);
                if r == 0 {
                    loss += (x * &fb * 2.0).sum(Kind::Float);
                }
                if r == 1 && flag.load(Ordering::SeqCst) {
                    loss += (x * &fc * 4.0).sum(Kind::Float);
                }
                loss
            });
            let opts = replicate::Options {
                bucket_cap_mb: 1e-9,
                find_unused_parameters: true,
                skip_all_reduce_unused_params: skip,
                ..Default::default()
            };
            let model = replicate::wrap(net, &vs, opts).unwrap();
            assert_eq!(model.state().buckets().len(), 3);
            let x = Tensor::full([3], (r + 1) as f64, (Kind::Float, Device::Cpu));
            let mut launched_here = Vec::new();
            for pass in 0..5 {
                use_c.store(pass == 3, Ordering::SeqCst);
                for t in [&a, &b, &c] {
                    let g = t.grad();
                    if g.defined() {
                        let _ = g.shallow_clone().zero_();
                    }
                }
                let before = pg.launched_collectives();
                model.f_forward(&x).unwrap().backward();
                launched_here.push(pg.launched_collectives() - before);
                let what = format!("skip {skip}, pass {pass}");
                let full = |v: f64| Tensor::full([3], v, (Kind::Float, Device::Cpu));
                // a: mean of 1 and 2; b: rank 0's 2 * 1, halved.
                assert!(
                    a.grad().allclose(&full(1.5), 1e-6, 1e-6, false),
                    "{what}: a"
                );
                assert!(
                    b.grad().allclose(&full(1.0), 1e-6, 1e-6, false),
                    "{what}: b"
                );
                if pass < 3 {
                    assert!(!c.grad().defined(), "{what}: c has a gradient");
                } else if pass == 3 {
                    // rank 1's 4 * 2, halved, on both ranks.
                    assert!(
                        c.grad().allclose(&full(4.0), 1e-6, 1e-6, false),
                        "{what}: c"
                    );
                } else {
                    // Unused everywhere again: `.grad` left as it was (zeroed above).
                    assert!(c.grad().allclose(&full(0.0), 0.0, 0.0, false), "{what}: c");
                }
                let stats = model.state().stats();
                // Skipped: c's bucket, after the first pass, except in the pass that used it
                // (all-reduced at the end of backward then). Pass 4 follows a pass that used
                // c, so it skips nothing.
                let skipped = skip && matches!(pass, 1 | 2);
                let reduced = if skipped { 2 } else { 3 };
                assert_eq!(stats.buckets_reduced, reduced, "{what}: buckets reduced");
            }
            launched_per_pass.push(launched_here);
        }
        // The skipped bucket's all-reduce is the one collective saved.
        let (without, with) = (&launched_per_pass[0], &launched_per_pass[1]);
        let saved: Vec<u64> = without.iter().zip(with).map(|(a, b)| a - b).collect();
        assert_eq!(saved, [0, 1, 1, 0, 0], "launched {without:?} and {with:?}");
    });
}

/// `bucket_cap_mb_list`: the k-th bucket (in launch order) closes at the k-th cap, the last
/// cap repeating, at construction and after the rebuild; the gradients are still the
/// average; an entry that is not positive is refused on every rank.
#[test]
fn bucket_cap_mb_list_sets_each_buckets_cap() {
    run_ranks("bucket_cap_mb_list_sets_each_buckets_cap", 2, |pg| {
        use tch::{Kind, Tensor};
        let r = pg.rank();
        const KIB: f64 = 1.0 / 1024.0;
        // float32: w0, w1, w3 1 KiB each, w2 2 KiB.
        let sizes = [("w0", 256), ("w1", 256), ("w2", 512), ("w3", 256)];
        let build = |opts: replicate::Options| {
            let vs = nn::VarStore::new(Device::Cpu);
            let vars: Vec<Tensor> = sizes
                .iter()
                .map(|(n, k)| vs.root().var(n, &[*k], nn::Init::Const(1.0)))
                .collect();
            let used = vars.iter().map(|v| v.shallow_clone()).collect::<Vec<_>>();
            // A chain, so that gradients become ready w3, w2, w1, w0.
            let net = nn::func(move |x| {
                let mut h = x.shallow_clone();
                for v in &used {
                    h = (&h * v.sum(Kind::Float)).tanh();
                }
                h.sum(Kind::Float)
            });
            let model = replicate::wrap(net, &vs, opts).unwrap();
            (vs, vars, model)
        };
        let caps = vec![KIB, 3.0 * KIB];
        let opts = replicate::Options {
            bucket_cap_mb_list: caps.clone(),
            ..Default::default()
        };
        let (_vs, vars, model) = build(opts);
        // Reverse registration order: w3 (1 KiB >= 1 KiB) closes the first bucket; w2 + w1
        // (3 KiB >= 3 KiB) the second; w0 is the rest.
        let expected = vec![vec!["w3"], vec!["w2", "w1"], vec!["w0"]];
        assert_eq!(model.state().buckets(), expected);
        // Without the list: one bucket (4 KiB, under the 1 MiB first cap).
        let (_, _, plain) = build(replicate::Options::default());
        assert_eq!(plain.state().buckets(), vec![vec!["w3", "w2", "w1", "w0"]]);
        // Two steps (the first rebuilds from the gradient-ready order): averaged gradients,
        // and the rebuilt layout follows the list too.
        for step in 0..2 {
            for v in &vars {
                let g = v.grad();
                if g.defined() {
                    let _ = g.shallow_clone().zero_();
                }
            }
            let x = Tensor::full([2], 0.1 * (r + 1) as f64, (Kind::Float, Device::Cpu));
            model.f_forward(&x).unwrap().backward();
            for v in &vars {
                let g = v.grad();
                let sum = g.copy();
                pg.all_reduce(&sum, tch_dist::ReduceOp::Sum).unwrap();
                assert!(
                    sum.allclose(&(&g * 2.0), 1e-6, 1e-7, false),
                    "step {step}: not averaged"
                );
            }
        }
        assert!(model.state().stats().rebuilt);
        assert_eq!(model.state().buckets(), expected);
        // A cap that is not positive, on one rank: refused on both.
        let bad = replicate::Options {
            bucket_cap_mb_list: if r == 1 { vec![1.0, 0.0] } else { vec![1.0] },
            ..Default::default()
        };
        let vs = nn::VarStore::new(Device::Cpu);
        let _ = vs.root().var("w", &[2], nn::Init::Const(1.0));
        let err = replicate::wrap(nn::func(|x| x.shallow_clone()), &vs, bad)
            .unwrap_err()
            .to_string();
        let expected = if r == 1 {
            "rank 1: invalid argument to replicate: bucket_cap_mb_list must be positive, got 0"
        } else {
            "rank 0: replicate: rank 1 failed its own check (see its error); nothing was changed"
        };
        assert_eq!(err, expected);
    });
}
