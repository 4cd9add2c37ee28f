//! `replicate::wrap` / `wrap_t` (replicate's wrapper form, PyTorch's
//! `DistributedDataParallel(module)`) end to end, ranks as real processes over 127.0.0.1:
//! `nn::seq()` and `nn::func` models equal single-process training, unused variables with
//! and without `find_unused_parameters`, batch-norm buffers broadcast from rank 0, the
//! wrapper and the derive form agree, and the errors.

use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::replicate::{self, ReplicateError, ReplicateProblem};
use tch_dist::testing::run_ranks;
use tch_dist::{Call, CommHook, DistError, ProcessGroup, ReduceOp};

#[path = "common/replicate_net.rs"]
mod replicate_net;
use replicate_net::{batch, local_loss, max_diff, net, option_cases, slice, Case};

/// `fc2(tanh(fc1(x)))`, as `replicate_net::Net`, as an `nn::seq()`; with `head`, the store
/// also holds a layer the model never uses.
fn seq_net(vs: &nn::VarStore, hidden: i64, with_head: bool) -> nn::Sequential {
    let root = vs.root();
    let seq = nn::seq()
        .add(nn::linear(&root / "fc1", 4, hidden, Default::default()))
        .add_fn(|xs| xs.tanh())
        .add(nn::linear(&root / "fc2", hidden, 3, Default::default()));
    if with_head {
        let _unused = nn::linear(&root / "head", 3, 3, Default::default());
    }
    seq
}

/// The same model as an `impl Module` closure under a prefix: FQNs `body.fc1.weight`, ...
fn closure_net(p: nn::Path) -> impl Module + use<> {
    let fc1 = nn::linear(&p / "fc1", 4, 8, Default::default());
    let fc2 = nn::linear(&p / "fc2", 8, 3, Default::default());
    nn::func(move |xs| xs.apply(&fc1).tanh().apply(&fc2))
}

/// The loss of the wrapped `model` on this rank's rows of `(x, y)`.
fn wrapped_loss(model: &impl Module, (x, y): &(Tensor, Tensor), pg: &ProcessGroup) -> Tensor {
    model
        .forward(&slice(x, pg))
        .mse_loss(&slice(y, pg), tch::Reduction::Mean)
}

/// A copy of the store `build` made (its values now).
fn snapshot<M>(vs: &nn::VarStore, build: &impl Fn(&nn::VarStore) -> M) -> nn::VarStore {
    let mut copy = nn::VarStore::new(Device::Cpu);
    let _ = build(&copy);
    copy.copy(vs).unwrap();
    copy
}

/// Trains `steps` SGD steps with the wrapped model (each rank on its rows) and with a
/// reference as one process on the whole (concatenated) batch, both from rank 0's initial
/// values (every rank starts from other ones: `wrap` must broadcast rank 0's). Returns the
/// largest difference between the two, and how far training moved the reference.
fn train_wrapped<M: Module>(
    pg: &ProcessGroup,
    build: impl Fn(&nn::VarStore) -> M,
    opts: replicate::Options,
    steps: usize,
) -> (f64, f64) {
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = build(&ref_vs);
    let initial = snapshot(&ref_vs, &build);
    tch::manual_seed(3 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = replicate::wrap(build(&vs), &vs, opts).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.1).unwrap();
    for step in 0..steps {
        let (x, y) = batch(step, Device::Cpu);
        ref_opt.backward_step(&reference.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        opt.backward_step(&wrapped_loss(&model, &(x, y), pg));
    }
    (max_diff(&vs, &ref_vs), max_diff(&initial, &ref_vs))
}

/// `k` backward passes of the wrapped closure model, all but the last inside `no_sync`, then
/// one step, against one step on the mean loss of the `k` whole batches.
fn no_sync_vs_one_step(pg: &ProcessGroup, k: usize) -> f64 {
    let build = |vs: &nn::VarStore| closure_net(vs.root() / "body");
    tch::manual_seed(3);
    let ref_vs = nn::VarStore::new(Device::Cpu);
    let reference = build(&ref_vs);
    tch::manual_seed(3 + pg.rank() as i64 * 1000);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = replicate::wrap(build(&vs), &vs, replicate::Options::default()).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.1).unwrap();
    let mut total = Tensor::zeros([], (Kind::Float, Device::Cpu));
    for step in 0..k {
        let (x, y) = batch(step, Device::Cpu);
        total += reference.forward(&x).mse_loss(&y, tch::Reduction::Mean) / k as f64;
    }
    ref_opt.backward_step(&total);
    opt.zero_grad();
    model.no_sync(|| {
        for step in 0..k - 1 {
            (wrapped_loss(&model, &batch(step, Device::Cpu), pg) / k as f64).backward();
        }
    });
    (wrapped_loss(&model, &batch(k - 1, Device::Cpu), pg) / k as f64).backward();
    opt.step();
    max_diff(&vs, &ref_vs)
}

/// The seq model with several options equals one process; returns nothing, asserts.
fn seq_cases(pg: &ProcessGroup) {
    let per_param = || replicate::Options {
        bucket_cap_mb: 1e-9,
        ..Default::default()
    };
    let cases = [
        ("defaults", replicate::Options::default()),
        ("a bucket per parameter", per_param()),
        (
            "gradient_as_bucket_view",
            replicate::Options {
                gradient_as_bucket_view: true,
                ..per_param()
            },
        ),
        (
            "static_graph",
            replicate::Options {
                static_graph: true,
                ..Default::default()
            },
        ),
    ];
    for (what, opts) in cases {
        let (d, moved) = train_wrapped(pg, |vs| seq_net(vs, 8, false), opts, 4);
        assert!(d < 1e-5, "{what}: {d}");
        assert!(
            moved > 1e-3,
            "{what}: training moved the weights by {moved}"
        );
    }
}

#[test]
fn seq_model_matches_single_process_training_on_2_ranks() {
    run_ranks(
        "seq_model_matches_single_process_training_on_2_ranks",
        2,
        |pg| seq_cases(&pg),
    );
}

#[test]
fn seq_model_matches_single_process_training_on_3_ranks() {
    run_ranks(
        "seq_model_matches_single_process_training_on_3_ranks",
        3,
        |pg| seq_cases(&pg),
    );
}

fn closure_cases(pg: &ProcessGroup) {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = replicate::wrap(
        closure_net(vs.root() / "body"),
        &vs,
        replicate::Options::default(),
    )
    .unwrap();
    // The store's names: PyTorch's FQNs of the same model.
    assert_eq!(
        model.state().param_fqns(),
        [
            "body.fc1.weight",
            "body.fc1.bias",
            "body.fc2.weight",
            "body.fc2.bias"
        ]
    );
    assert!(model.state().buffer_fqns().is_empty());
    let (d, moved) = train_wrapped(
        pg,
        |vs| closure_net(vs.root() / "body"),
        replicate::Options::default(),
        5,
    );
    assert!(d < 1e-5, "closure: {d}");
    assert!(
        moved > 1e-3,
        "closure: training moved the weights by {moved}"
    );
    let d = no_sync_vs_one_step(pg, 3);
    assert!(d < 1e-5, "no_sync: {d}");
}

#[test]
fn closure_model_matches_single_process_training_on_2_ranks() {
    run_ranks(
        "closure_model_matches_single_process_training_on_2_ranks",
        2,
        |pg| closure_cases(&pg),
    );
}

#[test]
fn closure_model_matches_single_process_training_on_3_ranks() {
    run_ranks(
        "closure_model_matches_single_process_training_on_3_ranks",
        3,
        |pg| closure_cases(&pg),
    );
}

/// A store variable the model never uses is an unused parameter: without
/// `find_unused_parameters` the next forward fails with the derive form's error, word for
/// word (as a value from `prepare_forward`/`f_forward`, as a panic from `forward`).
#[test]
fn unused_variables_fail_the_next_forward_as_in_the_derive_form() {
    run_ranks(
        "unused_variables_fail_the_next_forward_as_in_the_derive_form",
        2,
        |pg| {
            let xy = batch(0, Device::Cpu);
            let vs = nn::VarStore::new(Device::Cpu);
            let model =
                replicate::wrap(seq_net(&vs, 8, true), &vs, replicate::Options::default()).unwrap();
            wrapped_loss(&model, &xy, &pg).backward();
            let err = model.prepare_forward().unwrap_err().to_string();

            let dvs = nn::VarStore::new(Device::Cpu);
            let derived = net(&dvs, 8, true);
            replicate::apply(&derived, replicate::Options::default()).unwrap();
            local_loss(&derived, &xy, &pg).backward();
            let derive_err = replicate::prepare_forward(&derived)
                .unwrap_err()
                .to_string();
            assert_eq!(err, derive_err);
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
            // f_forward: the same error as a value, with the engine's typed error inside, as
            // `f_call` returns it for the derive form.
            let fe = model.f_forward(&xy.0).unwrap_err();
            assert_eq!(fe, derived.f_call(&xy.0).unwrap_err());
            assert_eq!(fe.message(), err);
            assert!(matches!(
                fe.downcast_ref::<DistError>(),
                Some(DistError::Reducer(r))
                    if matches!(**r, tch_dist::ReducerError::UnfinishedReduction { .. })
            ));
            // forward panics with it, as `call` does.
            let panic =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.forward(&xy.0)))
                    .unwrap_err();
            let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
            assert_eq!(msg, err);
        },
    );
}

/// With `find_unused_parameters` the same model trains and equals one process; the unused
/// variables keep their values (no gradient on any rank).
#[test]
fn unused_variables_train_with_find_unused_parameters() {
    run_ranks(
        "unused_variables_train_with_find_unused_parameters",
        3,
        |pg| {
            let opts = || replicate::Options {
                find_unused_parameters: true,
                ..Default::default()
            };
            let (d, moved) = train_wrapped(&pg, |vs| seq_net(vs, 8, true), opts(), 4);
            assert!(d < 1e-5, "find_unused_parameters: {d}");
            assert!(moved > 1e-3, "training moved the weights by {moved}");
            let vs = nn::VarStore::new(Device::Cpu);
            let model = replicate::wrap(seq_net(&vs, 8, true), &vs, opts()).unwrap();
            let head = vs.variables()["head.weight"].copy();
            let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
            for step in 0..2 {
                opt.backward_step(&wrapped_loss(&model, &batch(step, Device::Cpu), &pg));
            }
            assert_eq!(
                (&vs.variables()["head.weight"] - head)
                    .abs()
                    .max()
                    .double_value(&[]),
                0.0
            );
        },
    );
}

/// `linear -> batch_norm1d` as an `nn::seq_t()`.
fn bn_net(vs: &nn::VarStore) -> nn::SequentialT {
    let root = vs.root();
    nn::seq_t()
        .add(nn::linear(&root / "fc", 4, 4, Default::default()))
        .add(nn::batch_norm1d(&root / "bn", 4, Default::default()))
}

/// Each rank's `bn.running_mean` set to `rank + 1`, then the model wrapped with `opts`.
fn wrapped_bn(
    pg: &ProcessGroup,
    vs: &nn::VarStore,
    opts: replicate::Options,
) -> replicate::ReplicatedT<nn::SequentialT> {
    tch::manual_seed(3 + pg.rank() as i64 * 1000);
    let net = bn_net(vs);
    let mut rm = vs.variables()["bn.running_mean"].shallow_clone();
    let _ = rm.fill_(pg.rank() as f64 + 1.0);
    replicate::wrap_t(net, vs, opts).unwrap()
}

/// The running mean after one training forward on `x` from 1.0 (momentum 0.1).
fn running_mean_after(vs: &nn::VarStore, x: &Tensor) -> Tensor {
    let v = vs.variables();
    let h = x.linear(&v["fc.weight"], Some(&v["fc.bias"]));
    h.mean_dim(0, false, Kind::Float) * 0.1 + 0.9
}

fn assert_close(a: &Tensor, b: &Tensor, what: &str) {
    let d = (a - b).abs().max().double_value(&[]);
    assert!(d < 1e-6, "{what}: {a:?} vs {b:?} ({d})");
}

/// The buffers of a `seq_t()` model with batch norm (its running statistics) are rank 0's
/// after `wrap_t`, and again before every forward (`broadcast_buffers`, the default).
#[test]
fn batch_norm_buffers_are_broadcast_from_rank_0() {
    run_ranks("batch_norm_buffers_are_broadcast_from_rank_0", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = wrapped_bn(&pg, &vs, replicate::Options::default());
        assert_eq!(
            model.state().param_fqns(),
            ["fc.weight", "fc.bias", "bn.weight", "bn.bias"]
        );
        assert_eq!(
            model.state().buffer_fqns(),
            ["bn.running_mean", "bn.running_var"]
        );
        let rm = || vs.variables()["bn.running_mean"].shallow_clone();
        assert_close(
            &rm(),
            &Tensor::ones([4], tch::kind::FLOAT_CPU),
            "after wrap_t",
        );
        // A training forward on this rank's rows moves the statistics locally...
        let (x, _) = batch(0, Device::Cpu);
        let _ = model.forward_t(&slice(&x, &pg), true);
        assert_close(&rm(), &running_mean_after(&vs, &slice(&x, &pg)), "own rows");
        // ...and the next forward starts from rank 0's (an eval forward leaves them).
        let rank0_rows = x.narrow(0, 0, x.size()[0] / pg.world_size() as i64);
        let _ = model.f_forward_t(&x, false).unwrap();
        assert_close(&rm(), &running_mean_after(&vs, &rank0_rows), "rank 0's");
        if pg.rank() == 1 {
            let own = running_mean_after(&vs, &slice(&x, &pg));
            assert!(
                !rm().allclose(&own, 1e-6, 1e-6, false),
                "rank 1 took rank 0's"
            );
        }
    });
}

/// Without `broadcast_buffers` only `wrap_t` broadcasts them (as DDP syncs module states at
/// construction); then each rank keeps its own statistics.
#[test]
fn without_broadcast_buffers_statistics_stay_local() {
    run_ranks("without_broadcast_buffers_statistics_stay_local", 3, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let opts = replicate::Options {
            broadcast_buffers: false,
            ..Default::default()
        };
        let model = wrapped_bn(&pg, &vs, opts);
        let rm = || vs.variables()["bn.running_mean"].shallow_clone();
        assert_close(
            &rm(),
            &Tensor::ones([4], tch::kind::FLOAT_CPU),
            "after wrap_t",
        );
        let (x, _) = batch(0, Device::Cpu);
        let _ = model.forward_t(&slice(&x, &pg), true);
        let _ = model.forward_t(&x, false);
        assert_close(&rm(), &running_mean_after(&vs, &slice(&x, &pg)), "own rows");
    });
}

/// The same derive model, replicated with `apply` and with `wrap`: the same FQNs and
/// buckets, and bit-identical training, under several options.
#[test]
fn wrapper_and_derive_form_agree() {
    run_ranks("wrapper_and_derive_form_agree", 3, |pg| {
        let mut cases = option_cases();
        cases.push(Case {
            name: "fp16 compression",
            options: replicate::Options {
                comm_hook: CommHook::Fp16Compress,
                ..Default::default()
            },
            head: false,
        });
        for Case {
            name: what,
            options: opts,
            head,
        } in cases
        {
            tch::manual_seed(3 + pg.rank() as i64 * 1000);
            let dvs = nn::VarStore::new(Device::Cpu);
            let derived = net(&dvs, 8, head);
            let derived_state = replicate::apply(&derived, opts.clone()).unwrap();
            tch::manual_seed(3 + pg.rank() as i64 * 7); // rank 0: the same values
            let wvs = nn::VarStore::new(Device::Cpu);
            let wrapped = replicate::wrap(net(&wvs, 8, head), &wvs, opts).unwrap();
            assert_eq!(max_diff(&dvs, &wvs), 0.0, "{what}: rank 0's initial values");
            assert_eq!(wrapped.state().param_fqns(), derived_state.param_fqns());
            let mut dopt = nn::Sgd::default().build(&dvs, 0.1).unwrap();
            let mut wopt = nn::Sgd::default().build(&wvs, 0.1).unwrap();
            for step in 0..3 {
                let xy = batch(step, Device::Cpu);
                dopt.backward_step(&local_loss(&derived, &xy, &pg));
                wopt.backward_step(&wrapped_loss(&wrapped, &xy, &pg));
            }
            assert_eq!(max_diff(&dvs, &wvs), 0.0, "{what}");
            assert_eq!(wrapped.state().buckets(), derived_state.buckets(), "{what}");
        }
    });
}

/// Stores that differ across ranks: every rank fails with the derive form's error naming
/// the variable (parameters, then buffers), before anything is changed.
#[test]
fn mismatched_stores_name_the_variable() {
    run_ranks("mismatched_stores_name_the_variable", 2, |pg| {
        let r = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let err = replicate::wrap(
            seq_net(&vs, 8 + r as i64, false),
            &vs,
            replicate::Options::default(),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            format!(
                "rank {r}: replicate: parameters differ across ranks: `fc1.weight` has shape \
                 [8, 4] (Float) on rank 0 but shape [9, 4] (Float) on rank 1"
            )
        );
        let dvs = nn::VarStore::new(Device::Cpu);
        let derive_err = replicate::apply(&net(&dvs, 8 + r as i64, false), Default::default())
            .unwrap_err()
            .to_string();
        assert_eq!(err, derive_err);

        // A variable only rank 1 has.
        let vs = nn::VarStore::new(Device::Cpu);
        let err = replicate::wrap(seq_net(&vs, 8, r == 1), &vs, Default::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!(
                "rank {r}: replicate: parameters differ across ranks: rank 0 has 4 parameters \
                 and rank 1 has 6; entry 4 is missing on rank 0 but "
            )) && err.contains("head.weight"),
            "{err}"
        );

        // A buffer only rank 0 has.
        let vs = nn::VarStore::new(Device::Cpu);
        let model = seq_net(&vs, 8, false);
        if r == 0 {
            let _ = vs.root().zeros_no_train("steps", &[1]);
        }
        let err = replicate::wrap(model, &vs, Default::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!(
                "rank {r}: replicate: buffers differ across ranks: rank 0 has 1 buffers and \
                 rank 1 has 0; entry 0 is "
            )) && err.contains("steps"),
            "{err}"
        );
    });
}

/// `ignored_params` (both forms): by FQN or module prefix, ignored gradients stay local; an
/// entry naming nothing and `ignored_modules` with `wrap` are errors on every rank; a frozen
/// store leaves nothing to replicate.
#[test]
fn ignored_params_and_refusals() {
    run_ranks("ignored_params_and_refusals", 2, |pg| {
        let r = pg.rank();
        tch::manual_seed(r as i64);
        let vs = nn::VarStore::new(Device::Cpu);
        let opts = replicate::Options {
            ignored_params: vec!["fc1".into()],
            ..Default::default()
        };
        let model = replicate::wrap(seq_net(&vs, 8, false), &vs, opts).unwrap();
        assert_eq!(model.state().param_fqns(), ["fc2.weight", "fc2.bias"]);
        wrapped_loss(&model, &batch(0, Device::Cpu), &pg).backward();
        let v = vs.variables();
        let (g1, g2) = (v["fc1.weight"].grad(), v["fc2.weight"].grad());
        let (a1, a2) = (g1.copy(), g2.copy());
        pg.all_reduce(&a1, ReduceOp::Avg).unwrap();
        pg.all_reduce(&a2, ReduceOp::Avg).unwrap();
        assert!(g2.allclose(&a2, 1e-6, 1e-7, false), "fc2 is synchronised");
        assert!(
            !g1.allclose(&a1, 1e-6, 1e-7, false),
            "fc1 keeps its gradient"
        );

        // The derive form takes the same option, here one FQN.
        let dvs = nn::VarStore::new(Device::Cpu);
        let derived = net(&dvs, 8, false);
        let opts = replicate::Options {
            ignored_params: vec!["fc1.weight".into()],
            ..Default::default()
        };
        let s = replicate::apply(&derived, opts).unwrap();
        assert_eq!(s.param_fqns(), ["fc1.bias", "fc2.weight", "fc2.bias"]);

        // "fc" is no module prefix of "fc1.weight".
        let vs = nn::VarStore::new(Device::Cpu);
        let opts = replicate::Options {
            ignored_params: vec!["fc".into()],
            ..Default::default()
        };
        let err = replicate::wrap(seq_net(&vs, 8, false), &vs, opts).unwrap_err();
        assert!(
            matches!(err.problem(), Some(ReplicateProblem::UnknownIgnoredParam { name }) if name == "fc")
                && err.rank() == Some(r),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "rank {r}: replicate: ignored_params names `fc`, which is neither a parameter \
                 or buffer of the module nor a module prefix of one"
            )
        );

        // ignored_modules needs a walk.
        let other = nn::VarStore::new(Device::Cpu);
        let layer = nn::linear(other.root() / "x", 2, 2, Default::default());
        let opts = replicate::Options::default().ignore(&layer).unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let err = replicate::wrap(seq_net(&vs, 8, false), &vs, opts).unwrap_err();
        assert!(
            matches!(err.problem(), Some(ReplicateProblem::IgnoredModulesInWrap { modules }) if modules.len() == 1),
            "{err:?}"
        );
        assert!(err
            .to_string()
            .contains("name their variables in ignored_params"));

        let mut vs = nn::VarStore::new(Device::Cpu);
        let model = seq_net(&vs, 8, false);
        vs.freeze();
        let err = replicate::wrap(model, &vs, Default::default()).unwrap_err();
        assert!(
            matches!(err.problem(), Some(ReplicateProblem::NothingToReplicate))
                && err.rank() == Some(r),
            "{err:?}"
        );
    });
}

/// A parameter is managed by one replicate at a time: the derive form and then the wrapper
/// over the same store, or two wrappers over one store, would run two reducers over the same
/// gradients. The second is an error on every rank; once the first is gone, replicating the
/// variables again works.
#[test]
fn the_same_variables_are_replicated_once() {
    run_ranks("the_same_variables_are_replicated_once", 2, |pg| {
        let r = pg.rank();
        let taken = |err: &ReplicateError| {
            assert!(
                matches!(err.problem(), Some(ReplicateProblem::AlreadyReplicated { fqn }) if fqn == "fc1.weight")
                    && err.rank() == Some(r),
                "{err:?}"
            );
            assert_eq!(
                err.to_string(),
                format!(
                    "rank {r}: replicate: parameter `fc1.weight` is already managed by \
                     replicate (apply or wrap of the same variables); replicate a model once"
                )
            );
        };
        let vs = nn::VarStore::new(Device::Cpu);
        let derived = net(&vs, 8, false);
        replicate::apply(&derived, Default::default()).unwrap();
        taken(&replicate::wrap(derived, &vs, Default::default()).unwrap_err());

        // Two wrappers over one store (the second model adds fc1__1, ... beside fc1, ...).
        let vs = nn::VarStore::new(Device::Cpu);
        let first = replicate::wrap(seq_net(&vs, 8, false), &vs, Default::default()).unwrap();
        taken(&replicate::wrap(seq_net(&vs, 8, false), &vs, Default::default()).unwrap_err());
        // The refused wrapper changed nothing: the first still trains, and averages.
        wrapped_loss(&first, &batch(0, Device::Cpu), &pg).backward();
        let g = vs.variables()["fc1.weight"].grad();
        let avg = g.copy();
        pg.all_reduce(&avg, ReduceOp::Avg).unwrap();
        assert!(g.allclose(&avg, 1e-6, 1e-7, false), "fc1 is synchronised");

        // Once the first wrapper is gone, its variables can be replicated again.
        let net = first.into_inner();
        let again = replicate::wrap(net, &vs, Default::default()).unwrap();
        assert_eq!(again.state().param_fqns()[0], "fc1.weight");
    });
}
