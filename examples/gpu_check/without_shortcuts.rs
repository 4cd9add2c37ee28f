//! Parts 2 and 7, a group of one without shortcuts: every replicate case communicates, against
//! plain training (tests/common/replicate_net.rs's cases and this run's own), bucket counts,
//! in-place thresholds, `no_sync`, `fully_shard`, the state and the unused-parameter error.

use super::*;

/// The shared option cases (tests/common/replicate_net.rs) and this run's own (one bucket,
/// PowerSGD, `device_id`), all on `pg`.
pub(crate) fn replicate_cases(pg: &ProcessGroup) -> Vec<Case> {
    let full_rank = PowerSgdOptions {
        matrix_approximation_rank: 8,
        start_powersgd_iter: 2,
        min_compression_rate: 0.0,
        ..Default::default()
    };
    let mut cases = option_cases();
    // After "defaults", as the run has always listed it.
    cases.insert(
        1,
        Case {
            name: "one bucket",
            options: replicate::Options {
                bucket_cap_mb: 1e6,
                ..Default::default()
            },
            head: false,
        },
    );
    cases.extend([
        Case {
            name: "PowerSGD (full rank: exact)",
            options: replicate::Options {
                comm_hook: CommHook::PowerSgd(full_rank),
                ..Default::default()
            },
            head: false,
        },
        Case {
            name: "device_id moves the input",
            options: replicate::Options {
                device_id: Some(dev().into()),
                ..Default::default()
            },
            head: false,
        },
    ]);
    for case in &mut cases {
        case.options.process_group = Some(pg.clone());
    }
    cases
}

pub(crate) fn check_replicate_case(
    pg: &ProcessGroup,
    opts: replicate::Options,
    head: bool,
) -> Outcome {
    assert!(!pg.skips_communication());
    let before = pg.launched_collectives();
    let d = replicate_net::train_both(pg, dev(), opts, head, 4);
    assert!(d < 1e-5, "max |replicate - plain| = {d}");
    // apply's checks and broadcast, the rebuild, and every step's buckets.
    assert!(
        pg.launched_collectives() - before >= 4 + 4,
        "it communicated"
    );
    Outcome::Pass
}

pub(crate) fn check_bucket_counts(pg: &ProcessGroup) -> Outcome {
    let one = replicate_per_step(pg, replicate::Options::default());
    assert_eq!(one, vec![1, 1], "defaults: one bucket per step");
    let per_param = replicate::Options {
        bucket_cap_mb: 1e-9,
        ..Default::default()
    };
    assert_eq!(
        replicate_per_step(pg, per_param),
        vec![4, 4],
        "one collective per bucket"
    );
    Outcome::Pass
}

pub(crate) fn check_in_place_thresholds(pg: &ProcessGroup) -> Outcome {
    // Threshold 0: every gradient all-reduced in place, one collective each.
    let all = ReducerOptions {
        in_place_min_bytes: 0,
        ..Default::default()
    };
    let (d, launched) = reducer_vs_plain(pg, all);
    assert!(d < 1e-6, "in-place threshold 0: {d}");
    assert_eq!(launched, vec![2; 3], "in-place threshold 0");
    // Unlimited: nothing in place, every gradient through its flat bucket.
    let none = ReducerOptions {
        in_place_min_bytes: usize::MAX,
        bucket_cap_mb: 1e-9,
        first_bucket_bytes: 1,
        ..Default::default()
    };
    let (d, launched) = reducer_vs_plain(pg, none);
    assert!(d < 1e-6, "in-place threshold unlimited: {d}");
    assert_eq!(launched, vec![2; 3], "in-place threshold unlimited");
    for (hook, tol) in [
        (CommHook::Fp16Compress, 2e-3),
        (CommHook::Bf16Compress, 2e-2),
    ] {
        let opts = ReducerOptions {
            comm_hook: hook,
            ..Default::default()
        };
        let (d, _) = reducer_vs_plain(pg, opts);
        assert!(d < tol, "{hook:?}: {d}");
    }
    Outcome::Pass
}

pub(crate) fn check_no_sync(pg: &ProcessGroup) -> Outcome {
    // no_sync_vs_one_step applies replicate with the default group; this group is passed
    // explicitly through a one-case copy of it.
    let ((ref_vs, reference), (vs, model)) = {
        tch::manual_seed(3);
        let ref_vs = nn::VarStore::new(dev());
        let reference = net(&ref_vs, 8, false);
        tch::manual_seed(3);
        let vs = nn::VarStore::new(dev());
        let model = net(&vs, 8, false);
        let opts = replicate::Options {
            process_group: Some(pg.clone()),
            ..Default::default()
        };
        replicate::apply(&model, opts).unwrap();
        ((ref_vs, reference), (vs, model))
    };
    let k = 3;
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut ref_opt = nn::Sgd::default().build(&ref_vs, 0.1).unwrap();
    let mut total = Tensor::zeros([], (Kind::Float, dev()));
    for step in 0..k {
        let (x, y) = batch(step, dev());
        total +=
            tch::nn::Module::forward(&reference, &x).mse_loss(&y, tch::Reduction::Mean) / k as f64;
    }
    ref_opt.backward_step(&total);
    opt.zero_grad();
    let before = pg.launched_collectives();
    replicate::no_sync(&model, || {
        for step in 0..k - 1 {
            (local_loss(&model, &batch(step, dev()), pg) / k as f64).backward();
        }
    })
    .unwrap();
    assert_eq!(
        pg.launched_collectives(),
        before,
        "no_sync communicates nothing"
    );
    (local_loss(&model, &batch(k - 1, dev()), pg) / k as f64).backward();
    opt.step();
    let d = replicate_net::max_diff(&vs, &ref_vs);
    assert!(d < 1e-5, "no_sync: {d}");
    Outcome::Pass
}

/// `fully_shard` over `pg` (one rank): per-layer groups and the root against plain training
/// (AdamW, 1e-5), and with mixed precision (SGD, within bf16's precision).
pub(crate) fn check_fully_shard(pg: &ProcessGroup) -> Outcome {
    use tch_dist::fully_shard::{full_state_dict, MixedPrecisionPolicy};
    use tch_dist::{fully_shard, FsdpOptions};
    for mixed in [false, true] {
        tch::manual_seed(3);
        let ref_vs = nn::VarStore::new(dev());
        let reference = net(&ref_vs, 8, false);
        tch::manual_seed(3);
        let vs = nn::VarStore::new(dev());
        let model = net(&vs, 8, false);
        let mp = MixedPrecisionPolicy {
            param_dtype: mixed.then_some(Kind::BFloat16),
            reduce_dtype: mixed.then_some(Kind::Float),
            ..Default::default()
        };
        let opts = |output: Option<Kind>| FsdpOptions {
            process_group: Some(pg.clone()),
            mp_policy: MixedPrecisionPolicy {
                output_dtype: output,
                ..mp
            },
            ..Default::default()
        };
        fully_shard(&model.fc1, opts(None)).unwrap();
        fully_shard(&model, opts(mixed.then_some(Kind::Float))).unwrap();
        let (mut opt, mut ref_opt) = if mixed {
            (
                nn::Sgd::default().build(&vs, 0.2).unwrap(),
                nn::Sgd::default().build(&ref_vs, 0.2).unwrap(),
            )
        } else {
            (
                nn::AdamW::default().build(&vs, 1e-2).unwrap(),
                nn::AdamW::default().build(&ref_vs, 1e-2).unwrap(),
            )
        };
        let before = pg.launched_collectives();
        for step in 0..3 {
            let (x, y) = batch(step, dev());
            ref_opt.backward_step(
                &tch::nn::Module::forward(&reference, &x).mse_loss(&y, tch::Reduction::Mean),
            );
            opt.backward_step(&model.call(&x).mse_loss(&y, tch::Reduction::Mean));
        }
        assert!(
            pg.launched_collectives() > before,
            "fully_shard communicates"
        );
        let vars = ref_vs.variables();
        let d = full_state_dict(&model)
            .unwrap()
            .iter()
            .map(|(k, t)| (t - &vars[k]).abs().max().double_value(&[]))
            .fold(0.0, f64::max);
        let tol = if mixed { 5e-3 } else { 1e-5 };
        assert!(d < tol, "fully_shard (mixed precision: {mixed}): {d}");
        if mixed {
            assert!(d > 0.0, "computed in bf16");
        }
    }
    Outcome::Pass
}

pub(crate) fn check_state_and_unused_error(pg: &ProcessGroup) -> Outcome {
    let vs = nn::VarStore::new(dev());
    let model = net(&vs, 8, false);
    let opts = replicate::Options {
        bucket_cap_mb: 1e-9,
        process_group: Some(pg.clone()),
        ..Default::default()
    };
    replicate::apply(&model, opts).unwrap();
    let s = replicate::state(&model).unwrap();
    assert_eq!(s.param_fqns(), PARAM_FQNS);
    assert_eq!(s.buckets(), BUCKETS_ONE_PER_PARAM.map(|b| vec![b]));
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    for step in 0..2 {
        let (x, y) = batch(step, dev());
        opt.backward_step(&model.call(&x).mse_loss(&y, tch::Reduction::Mean));
    }
    let st = s.stats();
    assert_eq!(st.steps, 2, "{st:?}");
    assert!(st.rebuilt, "{st:?}");
    assert_eq!(st.bytes, (8 * 4 + 8 + 3 * 8 + 3) * 4, "{st:?}");

    let vs = nn::VarStore::new(dev());
    let model = net(&vs, 8, true);
    let opts = replicate::Options {
        process_group: Some(pg.clone()),
        ..Default::default()
    };
    replicate::apply(&model, opts).unwrap();
    let (x, y) = batch(0, dev());
    model.call(&x).mse_loss(&y, tch::Reduction::Mean).backward();
    let err = replicate::prepare_forward(&model).unwrap_err().to_string();
    assert!(
        err.contains("Expected to have finished reduction in the prior iteration")
            && err.ends_with("did not receive grad for rank 0: head.weight, head.bias"),
        "{err}"
    );
    Outcome::Pass
}
