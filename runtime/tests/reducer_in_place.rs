//! The reducer's in-place path (gradients of at least `in_place_min_bytes` are all-reduced in
//! `.grad` itself, not copied through a bucket) against single-process training, with every
//! option it meets: bucket views, unused parameters, mixed dtypes, non-contiguous gradients,
//! gradients set to None or zeroed between steps, no_sync, and a group of one.

use tch::{Kind, Tensor};
use tch_dist_runtime::testing::run_ranks;
use tch_dist_runtime::{ProcessGroup, Reducer, ReducerOptions};

#[path = "common/model.rs"]
mod model;
use model::{data, slice, Model, Shape, STEPS};

/// fc1 (4->8), fc2 (8->3, stored transposed: a non-contiguous leaf), an f64 branch `aux`,
/// and `unused` when asked for; seed 7.
fn new_model(with_unused: bool) -> Model {
    let shape = Shape {
        aux: true,
        unused: with_unused,
        fc2_transposed: true,
    };
    Model::new(shape, 7)
}

/// Replicated training on this rank's slice against one process on the whole batch.
fn check(pg: &ProcessGroup, opts: ReducerOptions, with_unused: bool, to_none: bool) {
    let reference = new_model(with_unused);
    let model = new_model(with_unused);
    let reducer = Reducer::new(model.handles(), pg.clone(), opts.clone()).unwrap();
    for step in 0..STEPS {
        let (x, y) = data(step);
        reference.loss(&x, &y).backward();
        reference.sgd_step(to_none);
        reducer.prepare_for_forward().unwrap();
        let held: Vec<Tensor> = model.params.iter().map(|(_, t)| t.grad()).collect();
        model.loss(&slice(&x, pg), &slice(&y, pg)).backward();
        // A `.grad` that existed before backward is averaged in place: handles stay valid.
        for ((name, t), h) in model.params.iter().zip(&held) {
            if h.defined() && !opts.gradient_as_bucket_view {
                assert_eq!(h.data_ptr(), t.grad().data_ptr(), "{name}");
            }
        }
        model.sgd_step(to_none);
    }
    let (diff, name) = model.max_diff(&reference);
    assert!(
        diff <= 1e-5,
        "{opts:?}: {name}: max |ddp - single| = {diff}"
    );
    if with_unused {
        assert!(!model.get("unused.weight").grad().defined());
    }
    let stats = reducer.stats();
    assert_eq!(stats.steps, STEPS as u64);
    let total: usize = model
        .params
        .iter()
        .map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes())
        .sum();
    assert_eq!(stats.bytes, total, "every gradient counts, in place or not");
}

fn in_place_all() -> ReducerOptions {
    ReducerOptions {
        in_place_min_bytes: 0,
        ..Default::default()
    }
}

#[test]
fn in_place_gradients_match_single_process() {
    // Three ranks: the average is not a power-of-two division.
    run_ranks("in_place_gradients_match_single_process", 3, |pg| {
        for to_none in [false, true] {
            check(&pg, in_place_all(), false, to_none);
            // fc1.weight (128 B) and aux.weight (96 B) in place, the rest through buckets.
            let mixed = ReducerOptions {
                in_place_min_bytes: 96,
                ..Default::default()
            };
            check(&pg, mixed.clone(), false, to_none);
            let views = ReducerOptions {
                gradient_as_bucket_view: true,
                ..mixed
            };
            check(&pg, views, false, to_none);
            let one_bucket = ReducerOptions {
                bucket_cap_mb: 1e6,
                first_bucket_bytes: usize::MAX,
                ..in_place_all()
            };
            check(&pg, one_bucket, false, to_none);
        }
    });
}

#[test]
fn in_place_unused_parameters_and_bucket_views() {
    run_ranks("in_place_unused_parameters_and_bucket_views", 2, |pg| {
        let unused = ReducerOptions {
            find_unused_parameters: true,
            ..in_place_all()
        };
        check(&pg, unused.clone(), true, false);
        check(&pg, unused, true, true);
        let views = ReducerOptions {
            find_unused_parameters: true,
            gradient_as_bucket_view: true,
            in_place_min_bytes: 100,
            ..Default::default()
        };
        check(&pg, views, true, true);
        // The defaults copy these small gradients; the same holds with copying forced.
        assert_eq!(ReducerOptions::default().in_place_min_bytes, 1024 * 1024);
        let copy_all = ReducerOptions {
            in_place_min_bytes: usize::MAX,
            ..Default::default()
        };
        check(&pg, copy_all, false, true);
    });
}

/// A parameter used only on rank 0 is averaged with rank 1's zeros, in place.
#[test]
fn in_place_parameter_used_on_one_rank_only() {
    run_ranks("in_place_parameter_used_on_one_rank_only", 2, |pg| {
        let w = Tensor::ones([64], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let v = Tensor::ones([64], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        // In place, then copied through a bucket (the used-map all-reduce comes after every
        // bucket on every rank either way).
        for in_place_min_bytes in [0, usize::MAX] {
            let opts = ReducerOptions {
                find_unused_parameters: true,
                in_place_min_bytes,
                ..Default::default()
            };
            let reducer = Reducer::new(
                vec![
                    ("w".into(), w.shallow_clone()),
                    ("v".into(), v.shallow_clone()),
                ],
                pg.clone(),
                opts,
            )
            .unwrap();
            used_on_rank0_only(&pg, &reducer, &w, &v);
        }
    });
}

/// static_graph: the first pass finds the unused parameters; later passes reuse it (the same
/// averages as find_unused_parameters) and refuse a graph that changed.
#[test]
fn static_graph_reuses_the_first_pass_and_refuses_a_changed_graph() {
    run_ranks(
        "static_graph_reuses_the_first_pass_and_refuses_a_changed_graph",
        2,
        |pg| {
            for in_place_min_bytes in [0, usize::MAX] {
                let opts = ReducerOptions {
                    static_graph: true,
                    in_place_min_bytes,
                    ..Default::default()
                };
                check(&pg, opts.clone(), true, false);
                check(&pg, opts.clone(), true, true);

                // Used on rank 0 only, in every pass: the second pass averages with the
                // first pass's map.
                let w = Tensor::ones([64], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
                let v = Tensor::ones([64], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
                let handles = vec![
                    ("w".into(), w.shallow_clone()),
                    ("v".into(), v.shallow_clone()),
                ];
                let reducer = Reducer::new(handles, pg.clone(), opts.clone()).unwrap();
                used_on_rank0_only(&pg, &reducer, &w, &v);

                // A parameter that stops being used is an error, on every rank where it
                // changed, after the pass's collectives.
                let a = Tensor::ones([8], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
                let b = Tensor::ones([8], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
                let handles = vec![
                    ("a".into(), a.shallow_clone()),
                    ("b".into(), b.shallow_clone()),
                ];
                let opts_again = opts.clone();
                let reducer = Reducer::new(handles, pg.clone(), opts).unwrap();
                reducer.prepare_for_forward().unwrap();
                (&a + &b).sum(Kind::Float).backward();
                reducer.prepare_for_forward().unwrap();
                let err = a.sum(Kind::Float).f_backward().unwrap_err().to_string();
                assert!(
                    err.contains(&format!(
                        "rank {}: replicate: the training graph changed in this iteration: `b` \
                         got a gradient in the first iteration but none in this one, which \
                         static_graph=true does not allow",
                        pg.rank()
                    )),
                    "{err}"
                );

                // A parameter that starts being used fails its backward at its gradient
                // (its bucket may already be on the wire), and every later pass says so.
                drop(reducer); // its hooks go with it
                let handles = vec![
                    ("a".into(), a.shallow_clone()),
                    ("b".into(), b.shallow_clone()),
                ];
                let reducer = Reducer::new(handles, pg.clone(), opts_again.clone()).unwrap();
                reducer.prepare_for_forward().unwrap();
                a.sum(Kind::Float).backward();
                reducer.prepare_for_forward().unwrap();
                let err = (&a + &b)
                    .sum(Kind::Float)
                    .f_backward()
                    .unwrap_err()
                    .to_string();
                let expected = format!(
                    "rank {}: replicate: the training graph changed in this iteration: `b` got no \
                     gradient in the first iteration but one in this one, which \
                     static_graph=true does not allow",
                    pg.rank()
                );
                assert!(err.contains(&expected), "{err}");
                let again = reducer.prepare_for_forward().unwrap_err();
                assert!(again.to_string().contains(&expected), "{again}");
                // The typed value, with the rank and the op said once (not "rank R: replicate
                // failed: rank R: replicate: ...").
                assert_eq!(again.to_string(), expected);
                assert_eq!(
                    again,
                    tch_dist_runtime::DistError::from(
                        tch_dist_runtime::ReducerError::GraphChanged {
                            rank: pg.rank(),
                            op: "replicate",
                            fqn: "b".into(),
                            used_in_first_pass: false
                        }
                    )
                );
            }
        },
    );
}

fn used_on_rank0_only(pg: &ProcessGroup, reducer: &Reducer, w: &Tensor, v: &Tensor) {
    {
        for _ in 0..2 {
            reducer.prepare_for_forward().unwrap();
            let loss = if pg.rank() == 0 {
                (w * 2.0).sum(Kind::Float) + v.sum(Kind::Float)
            } else {
                v.sum(Kind::Float) * 3.0
            };
            loss.backward();
            // w: (2 + 0) / 2 on both ranks, even where it got no gradient; v: (1 + 3) / 2.
            assert!(w.grad().allclose(&w.ones_like(), 1e-6, 1e-6, false));
            assert!(v.grad().allclose(&(v.ones_like() * 2.0), 1e-6, 1e-6, false));
            w.shallow_clone().zero_grad();
            v.shallow_clone().zero_grad();
        }
    }
}

/// Gradients accumulate locally while sync is off; the next synchronised pass averages them.
#[test]
fn in_place_no_sync_accumulates_then_averages() {
    run_ranks("in_place_no_sync_accumulates_then_averages", 2, |pg| {
        let w = Tensor::zeros([300_000], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        // 1.2 MB: in place with the default threshold.
        let reducer = Reducer::new(
            vec![("w".into(), w.shallow_clone())],
            pg.clone(),
            Default::default(),
        )
        .unwrap();
        let r = pg.rank() as f64;
        reducer.set_require_sync(false);
        ((&w * (r + 1.0)).sum(Kind::Float)).backward();
        reducer.set_require_sync(true);
        ((&w * (r + 1.0)).sum(Kind::Float)).backward();
        // Rank 0 holds 2, rank 1 holds 4: the average is 3 everywhere.
        let g = w.grad();
        assert!(g.allclose(&(g.ones_like() * 3.0), 1e-6, 1e-6, false));
        assert_eq!(reducer.stats().bytes, 1_200_000);
    });
}

/// In a group of one nothing is copied: `.grad` stays the tensor autograd produced.
#[test]
fn group_of_one_leaves_gradients_alone() {
    run_ranks("group_of_one_leaves_gradients_alone", 1, |pg| {
        check(&pg, ReducerOptions::default(), false, true);
        check(
            &pg,
            ReducerOptions {
                find_unused_parameters: true,
                gradient_as_bucket_view: true,
                ..Default::default()
            },
            true,
            false,
        );
        let w = Tensor::ones([8], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let reducer = Reducer::new(
            vec![("w".into(), w.shallow_clone())],
            pg,
            Default::default(),
        )
        .unwrap();
        (&w * 2.0).sum(Kind::Float).backward();
        let first = w.grad();
        (&w * 2.0).sum(Kind::Float).backward();
        assert_eq!(first.data_ptr(), w.grad().data_ptr());
        assert!(w.grad().allclose(&(w.ones_like() * 4.0), 1e-6, 1e-6, false));
        assert_eq!(reducer.stats().steps, 2);
        assert_eq!(reducer.stats().comm_time, std::time::Duration::ZERO);
    });
}
