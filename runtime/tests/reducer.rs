//! The reducer against single-process training: N SGD steps where each rank trains on its
//! slice of the batch end with the same parameters as one process on the whole batch.

use tch::{Kind, Tensor};
use tch_dist_runtime::testing::run_ranks;
use tch_dist_runtime::{CommHook, PowerSgdOptions, ProcessGroup, Reducer, ReducerOptions};

const BATCH: i64 = 12;
const STEPS: usize = 4;
const LR: f64 = 0.1;

/// fc1 (4->8, f32), fc2 (8->3, f32), an f64 side branch `aux` (4->3, optional), and `unused`
/// (never touched by forward when `with_unused`).
struct Model {
    params: Vec<(String, Tensor)>,
    with_aux: bool,
}

impl Model {
    fn new(with_aux: bool, with_unused: bool, seed: i64) -> Model {
        tch::manual_seed(seed);
        let p = |shape: &[i64], kind: Kind| {
            (Tensor::randn(shape, (kind, tch::Device::Cpu)) * 0.5).set_requires_grad(true)
        };
        let mut params = vec![
            ("fc1.weight".to_string(), p(&[8, 4], Kind::Float)),
            ("fc1.bias".to_string(), p(&[8], Kind::Float)),
            ("fc2.weight".to_string(), p(&[3, 8], Kind::Float)),
            ("fc2.bias".to_string(), p(&[3], Kind::Float)),
        ];
        if with_aux {
            params.push(("aux.weight".to_string(), p(&[3, 4], Kind::Double)));
        }
        if with_unused {
            params.push(("unused.weight".to_string(), p(&[5, 5], Kind::Float)));
        }
        Model { params, with_aux }
    }

    fn handles(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    fn get(&self, name: &str) -> &Tensor {
        &self.params.iter().find(|(n, _)| n == name).unwrap().1
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let h = x
            .linear(self.get("fc1.weight"), Some(self.get("fc1.bias")))
            .tanh();
        let mut y = h.linear(self.get("fc2.weight"), Some(self.get("fc2.bias")));
        if self.with_aux {
            y += x
                .to_kind(Kind::Double)
                .linear::<Tensor>(self.get("aux.weight"), None)
                .to_kind(Kind::Float);
        }
        y
    }

    fn sgd_step(&self) {
        tch::no_grad(|| {
            for (_, p) in &self.params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = p.shallow_clone().f_sub_(&(&g * LR)).unwrap();
                    let _ = g.zero_();
                }
            }
        });
    }
}

fn data(step: usize) -> (Tensor, Tensor) {
    tch::manual_seed(1000 + step as i64);
    let x = Tensor::randn([BATCH, 4], (Kind::Float, tch::Device::Cpu));
    let y = Tensor::randn([BATCH, 3], (Kind::Float, tch::Device::Cpu));
    (x, y)
}

/// Trains a replicated copy on this rank's slice and a reference on the whole batch, then
/// compares every parameter.
fn check_equivalence(
    pg: ProcessGroup,
    opts: ReducerOptions,
    with_aux: bool,
    with_unused: bool,
    tol: f64,
) {
    let reference = Model::new(with_aux, with_unused, 7);
    let model = Model::new(with_aux, with_unused, 7);
    let reducer = Reducer::new(model.handles(), pg.clone(), opts).unwrap();
    let per_rank = BATCH / pg.world_size() as i64;
    for step in 0..STEPS {
        let (x, y) = data(step);
        reference
            .forward(&x)
            .mse_loss(&y, tch::Reduction::Mean)
            .backward();
        reference.sgd_step();

        reducer.prepare_for_forward().unwrap();
        let xs = x.narrow(0, pg.rank() as i64 * per_rank, per_rank);
        let ys = y.narrow(0, pg.rank() as i64 * per_rank, per_rank);
        model
            .forward(&xs)
            .mse_loss(&ys, tch::Reduction::Mean)
            .backward();
        model.sgd_step();
    }
    for ((name, a), (_, b)) in model.params.iter().zip(&reference.params) {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff <= tol, "{name}: max |ddp - single| = {diff} > {tol}");
    }
    if with_unused {
        assert!(
            !model.get("unused.weight").grad().defined(),
            "an unused parameter's grad stays None"
        );
    }
    let stats = reducer.stats();
    assert_eq!(stats.steps, STEPS as u64);
    assert!(stats.rebuilt);
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
            let m = Model::new(false, false, 7);
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
            let m = Model::new(false, false, 7);
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
            let model = Model::new(false, false, 7);
            let reducer = Reducer::new(
                model.handles(),
                pg.clone(),
                ReducerOptions {
                    comm_hook: CommHook::PowerSgd(rank_one),
                    ..Default::default()
                },
            )
            .unwrap();
            let per_rank = BATCH / pg.world_size() as i64;
            for step in 0..STEPS {
                let (x, y) = data(step);
                reducer.prepare_for_forward().unwrap();
                let xs = x.narrow(0, pg.rank() as i64 * per_rank, per_rank);
                let ys = y.narrow(0, pg.rank() as i64 * per_rank, per_rank);
                model
                    .forward(&xs)
                    .mse_loss(&ys, tch::Reduction::Mean)
                    .backward();
                // The compressed gradient of fc1.weight (8 x 4) has rank 1.
                if step >= 2 {
                    let g = model.get("fc1.weight").grad();
                    let (_, s, _) = g.svd(true, false);
                    let s: Vec<f32> = Vec::try_from(&s).unwrap();
                    assert!(s[1] < 1e-5 * s[0].max(1.0), "rank-1 gradient: {s:?}");
                }
                model.sgd_step();
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
                Model::new(false, false, 7).handles(),
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
            let model = Model::new(false, true, 7);
            let reducer =
                Reducer::new(model.handles(), pg.clone(), ReducerOptions::default()).unwrap();
            let (x, y) = data(0);
            reducer.prepare_for_forward().unwrap();
            model
                .forward(&x)
                .mse_loss(&y, tch::Reduction::Mean)
                .backward();
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
        },
    );
}
