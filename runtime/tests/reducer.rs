//! The reducer against single-process training: N SGD steps where each rank trains on its
//! slice of the batch end with the same parameters as one process on the whole batch.

use tch::Tensor;
use tch_dist_runtime::testing::{run_ranks, run_ranks_with, Launch};
use tch_dist_runtime::{
    Backend, CommHook, PowerSgdOptions, ProcessGroup, Reducer, ReducerOptions, NO_SHORTCUTS_ENV,
};

#[path = "common/model.rs"]
mod model;
use model::{data, slice, Model, Shape, STEPS};

/// The test model (fc1, fc2, optionally `aux` and `unused`), seed 7.
fn new_model(with_aux: bool, with_unused: bool) -> Model {
    let shape = Shape {
        aux: with_aux,
        unused: with_unused,
        ..Default::default()
    };
    Model::new(shape, 7)
}

/// Trains a replicated copy on this rank's slice and a reference on the whole batch, then
/// compares every parameter. Returns how many collectives the group launched in each step
/// after the first (which also rebuilds the buckets).
fn check_equivalence(
    pg: ProcessGroup,
    opts: ReducerOptions,
    with_aux: bool,
    with_unused: bool,
    tol: f64,
) -> Vec<u64> {
    let reference = new_model(with_aux, with_unused);
    let model = new_model(with_aux, with_unused);
    let reducer = Reducer::new(model.handles(), pg.clone(), opts).unwrap();
    let mut launched = Vec::new();
    for step in 0..STEPS {
        let (x, y) = data(step);
        reference.loss(&x, &y).backward();
        reference.sgd_step(false);

        let before = pg.launched_collectives();
        reducer.prepare_for_forward().unwrap();
        model.loss(&slice(&x, &pg), &slice(&y, &pg)).backward();
        model.sgd_step(false);
        if step > 0 {
            launched.push(pg.launched_collectives() - before);
        }
    }
    let (diff, name) = model.max_diff(&reference);
    assert!(diff <= tol, "{name}: max |ddp - single| = {diff} > {tol}");
    if with_unused {
        assert!(
            !model.get("unused.weight").grad().defined(),
            "an unused parameter's grad stays None"
        );
    }
    let stats = reducer.stats();
    assert_eq!(stats.steps, STEPS as u64);
    assert!(stats.rebuilt);
    launched
}

#[test]
fn default_buckets_match_single_process() {
    run_ranks("default_buckets_match_single_process", 2, |pg| {
        check_equivalence(pg, ReducerOptions::default(), false, false, 1e-5);
    });
}

#[test]
fn one_bucket_per_parameter_matches_single_process() {
    run_ranks("one_bucket_per_parameter_matches_single_process", 3, |pg| {
        let opts = ReducerOptions {
            bucket_cap_mb: 1e-9,
            first_bucket_bytes: 1,
            ..Default::default()
        };
        let reducer_layout = {
            let m = new_model(false, false);
            Reducer::new(m.handles(), pg.clone(), opts.clone())
                .unwrap()
                .bucket_fqns()
        };
        assert_eq!(reducer_layout.len(), 4);
        assert_eq!(reducer_layout[0], vec!["fc2.bias".to_string()]);
        check_equivalence(pg, opts, false, false, 1e-5);
    });
}

#[test]
fn one_bucket_for_all_and_bucket_views_match_single_process() {
    run_ranks(
        "one_bucket_for_all_and_bucket_views_match_single_process",
        2,
        |pg| {
            let opts = ReducerOptions {
                bucket_cap_mb: 1e6,
                first_bucket_bytes: usize::MAX,
                ..Default::default()
            };
            let m = new_model(false, false);
            let layout = Reducer::new(m.handles(), pg.clone(), opts.clone())
                .unwrap()
                .bucket_fqns();
            assert_eq!(
                layout,
                vec![vec!["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]]
            );
            check_equivalence(pg.clone(), opts.clone(), false, false, 1e-5);
            check_equivalence(
                pg,
                ReducerOptions {
                    gradient_as_bucket_view: true,
                    ..opts
                },
                false,
                false,
                1e-5,
            );
        },
    );
}

#[test]
fn mixed_dtypes_and_unused_parameters_match_single_process() {
    run_ranks(
        "mixed_dtypes_and_unused_parameters_match_single_process",
        2,
        |pg| {
            check_equivalence(pg.clone(), ReducerOptions::default(), true, false, 1e-5);
            let opts = ReducerOptions {
                find_unused_parameters: true,
                ..Default::default()
            };
            check_equivalence(pg.clone(), opts, true, true, 1e-5);
            let opts = ReducerOptions {
                find_unused_parameters: true,
                gradient_as_bucket_view: true,
                ..Default::default()
            };
            check_equivalence(pg, opts, false, true, 1e-5);
        },
    );
}

#[test]
fn compression_hooks_stay_within_their_precision() {
    run_ranks("compression_hooks_stay_within_their_precision", 2, |pg| {
        check_equivalence(
            pg.clone(),
            ReducerOptions {
                comm_hook: CommHook::Fp16Compress,
                ..Default::default()
            },
            false,
            false,
            2e-3,
        );
        check_equivalence(
            pg,
            ReducerOptions {
                comm_hook: CommHook::Bf16Compress,
                ..Default::default()
            },
            false,
            false,
            2e-2,
        );
    });
}

#[test]
fn powersgd_is_exact_at_full_rank_and_consistent_at_rank_one() {
    run_ranks(
        "powersgd_is_exact_at_full_rank_and_consistent_at_rank_one",
        2,
        |pg| {
            // A rank-r approximation of an n x m matrix with r >= min(n, m) is the matrix itself:
            // steps 0-1 use the exact all-reduce, steps 2-3 go through P, Q and error feedback.
            let full_rank = PowerSgdOptions {
                matrix_approximation_rank: 8,
                start_powersgd_iter: 2,
                min_compression_rate: 0.0,
                ..Default::default()
            };
            check_equivalence(
                pg.clone(),
                ReducerOptions {
                    comm_hook: CommHook::PowerSgd(full_rank),
                    ..Default::default()
                },
                false,
                false,
                1e-5,
            );

            // Rank 1 is lossy, but every rank must hold the same parameters afterwards.
            let rank_one = PowerSgdOptions {
                start_powersgd_iter: 2,
                min_compression_rate: 0.0,
                ..Default::default()
            };
            let model = new_model(false, false);
            let reducer = Reducer::new(
                model.handles(),
                pg.clone(),
                ReducerOptions {
                    comm_hook: CommHook::PowerSgd(rank_one),
                    ..Default::default()
                },
            )
            .unwrap();
            for step in 0..STEPS {
                let (x, y) = data(step);
                reducer.prepare_for_forward().unwrap();
                model.loss(&slice(&x, &pg), &slice(&y, &pg)).backward();
                // The compressed gradient of fc1.weight (8 x 4) has rank 1.
                if step >= 2 {
                    let g = model.get("fc1.weight").grad();
                    let (_, s, _) = g.svd(true, false);
                    let s: Vec<f32> = Vec::try_from(&s).unwrap();
                    assert!(s[1] < 1e-5 * s[0].max(1.0), "rank-1 gradient: {s:?}");
                }
                model.sgd_step(false);
            }
            for (name, p) in &model.params {
                let mine = p.detach();
                let gathered = [Tensor::zeros_like(p), Tensor::zeros_like(p)];
                pg.all_gather(&gathered, &mine).unwrap();
                let diff = (&gathered[0] - &gathered[1]).abs().max().double_value(&[]);
                assert!(diff == 0.0, "{name} differs across ranks by {diff}");
            }

            let bad = PowerSgdOptions {
                start_powersgd_iter: 0,
                ..Default::default()
            };
            let err = Reducer::new(
                new_model(false, false).handles(),
                pg,
                ReducerOptions {
                    comm_hook: CommHook::PowerSgd(bad),
                    ..Default::default()
                },
            )
            .unwrap_err();
            assert!(err.to_string().contains("start_powersgd_iter > 1"), "{err}");
        },
    );
}

#[test]
fn unused_parameter_without_detection_fails_next_iteration() {
    run_ranks(
        "unused_parameter_without_detection_fails_next_iteration",
        2,
        |pg| {
            let model = new_model(false, true);
            let reducer =
                Reducer::new(model.handles(), pg.clone(), ReducerOptions::default()).unwrap();
            let (x, y) = data(0);
            reducer.prepare_for_forward().unwrap();
            model.loss(&x, &y).backward();
            // The pass could not finish (its first bucket holds the unused parameter, so no
            // bucket was launched): every gradient comes back as this rank's own, as the
            // same model computes it without a reducer.
            let alone = new_model(false, true);
            alone.loss(&x, &y).backward();
            for (fqn, p) in &model.params {
                let (got, want) = (p.grad(), alone.get(fqn).grad());
                assert_eq!(got.defined(), want.defined(), "{fqn}");
                if want.defined() {
                    assert!(got.equal(&want), "{fqn}: {got} against {want}");
                }
            }
            let err = reducer.prepare_for_forward().unwrap_err().to_string();
            assert!(err.starts_with(&format!("rank {}: replicate failed: Expected to have finished reduction in the prior iteration", pg.rank())), "{err}");
            assert!(
                err.ends_with(&format!(
                    "Parameters which did not receive grad for rank {}: unused.weight",
                    pg.rank()
                )),
                "{err}"
            );
            assert!(err.contains("find_unused_parameters: true"), "{err}");
            // Typed, with the indices filled in (no "see names" placeholder).
            let typed = reducer.prepare_for_forward().unwrap_err();
            assert_eq!(
                typed,
                tch_dist_runtime::DistError::from(
                    tch_dist_runtime::ReducerError::UnfinishedReduction {
                        rank: pg.rank(),
                        op: "replicate",
                        indices: vec![4],
                        fqns: vec!["unused.weight".into()]
                    }
                )
            );
            assert!(
                err.contains("Parameter indices which did not receive grad: 4."),
                "{err}"
            );
        },
    );
}

/// At world size 1 the average is the gradient: by default the reducer communicates nothing.
#[test]
fn world_size_one_takes_the_shortcuts() {
    run_ranks("world_size_one_takes_the_shortcuts", 1, |pg| {
        assert!(pg.skips_communication());
        let per_step = check_equivalence(pg, ReducerOptions::default(), true, false, 1e-6);
        assert_eq!(per_step, vec![0; STEPS - 1]);
    });
}

/// The test switch TCH_DIST_NO_SHORTCUTS=1: at world size 1 every bucket path communicates —
/// flat buffers through each hook, in-place gradients one collective each, the used-map of
/// unused parameters — and training still equals single-process training.
#[test]
fn world_size_one_without_shortcuts_runs_every_bucket_path() {
    let launch = Launch::new("world_size_one_without_shortcuts_runs_every_bucket_path", 1)
        .env(NO_SHORTCUTS_ENV, "1");
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        assert!(!pg.skips_communication());
        let per_param = ReducerOptions {
            bucket_cap_mb: 1e-9,
            first_bucket_bytes: 1,
            ..Default::default()
        };
        let powersgd = PowerSgdOptions {
            matrix_approximation_rank: 8,
            start_powersgd_iter: 2,
            min_compression_rate: 0.0,
            ..Default::default()
        };
        // (what, options, unused parameter, tolerance, collectives per step)
        let cases: Vec<(&str, ReducerOptions, bool, f64, Option<u64>)> = vec![
            (
                "one flat bucket",
                ReducerOptions::default(),
                false,
                1e-6,
                Some(1),
            ),
            (
                "a bucket per parameter",
                per_param.clone(),
                false,
                1e-6,
                Some(4),
            ),
            (
                "bucket views",
                ReducerOptions {
                    gradient_as_bucket_view: true,
                    ..per_param.clone()
                },
                false,
                1e-6,
                Some(4),
            ),
            (
                "everything in place",
                ReducerOptions {
                    in_place_min_bytes: 0,
                    ..Default::default()
                },
                false,
                1e-6,
                Some(4),
            ),
            (
                "nothing in place",
                ReducerOptions {
                    in_place_min_bytes: usize::MAX,
                    ..per_param
                },
                false,
                1e-6,
                Some(4),
            ),
            (
                "find_unused_parameters: a bucket and the used-map",
                ReducerOptions {
                    find_unused_parameters: true,
                    ..Default::default()
                },
                true,
                1e-6,
                Some(2),
            ),
            (
                "static_graph: the used-map only in the first step",
                ReducerOptions {
                    static_graph: true,
                    ..Default::default()
                },
                true,
                1e-6,
                Some(1),
            ),
            (
                "fp16 compression",
                ReducerOptions {
                    comm_hook: CommHook::Fp16Compress,
                    ..Default::default()
                },
                false,
                2e-3,
                Some(1),
            ),
            (
                "bf16 compression",
                ReducerOptions {
                    comm_hook: CommHook::Bf16Compress,
                    ..Default::default()
                },
                false,
                2e-2,
                Some(1),
            ),
            (
                "PowerSGD at full rank",
                ReducerOptions {
                    comm_hook: CommHook::PowerSgd(powersgd),
                    ..Default::default()
                },
                false,
                1e-5,
                None,
            ),
        ];
        for (what, opts, unused, tol, expected) in cases {
            let per_step = check_equivalence(pg.clone(), opts, false, unused, tol);
            match expected {
                Some(n) => assert_eq!(per_step, vec![n; STEPS - 1], "{what}"),
                None => assert!(per_step.iter().all(|&n| n > 0), "{what}: {per_step:?}"),
            }
        }
    });
}
