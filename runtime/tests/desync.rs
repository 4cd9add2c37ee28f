//! `TCH_DIST_DEBUG=DETAIL`: mismatched collectives are an error value on every rank, naming
//! what each rank called, before anything is sent; 2 ranks over 127.0.0.1 each.
//!
//! Without DETAIL these return garbage with Ok (float32 against int32), abort a rank with
//! SIGABRT (an uncaught gloo::EnforceNotMet: [4] against [8], float against double), or end
//! in a bare timeout (all_reduce against broadcast, broadcasts from different roots, a rank
//! that skips a step). Every test
//! here also checks that no tensor changed and that the group still works afterwards (every
//! rank failed the same check, so the ranks are still in step). `run_ranks_with` fails the
//! test if a rank exited non-zero, died by a signal or was still running at the deadline.

use std::time::Duration;

use tch::{Kind, Tensor};
use tch_dist_runtime::testing::{run_ranks_with, Launch};
use tch_dist_runtime::{
    Backend, DebugLevel, Desync, DistError, ProcessGroup, ReduceOp, Reducer, ReducerOptions,
};

#[path = "common/model.rs"]
mod model;

/// Two ranks with DETAIL on and a 5 s group timeout.
fn detail(test: &str) -> Launch {
    Launch::new(test, 2)
        .env("TCH_DIST_DEBUG", "DETAIL")
        .env("TCH_DIST_TIMEOUT_SECS", "5")
        .timeout(Duration::from_secs(60))
}

/// After a desync the ranks are still in step: a collective that matches works.
fn still_works(pg: &ProcessGroup) {
    let x = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
    pg.all_reduce(&x, ReduceOp::Sum).unwrap();
    assert_eq!(x.double_value(&[0]), 3.0);
}

/// Rank 0 all-reduces `a`, rank 1 `b`: every rank fails with `calls` (the text after
/// "rank R: all_reduce: "), and neither tensor changes.
fn mismatched_all_reduce(pg: ProcessGroup, a: Tensor, b: Tensor, calls: &str) {
    assert_eq!(pg.debug_level(), DebugLevel::Detail);
    let t = if pg.rank() == 0 { a } else { b };
    let before = t.copy();
    let err = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "rank {}: all_reduce: the ranks called different collectives (TCH_DIST_DEBUG=DETAIL \
             checks each one before it runs): {calls}; nothing was sent",
            pg.rank()
        )
    );
    assert!(
        matches!(&err, DistError::Desync { desync, .. } if matches!(**desync, Desync::Differ { .. }))
    );
    assert!(t.equal(&before), "the tensor changed");
    still_works(&pg);
}

#[test]
fn float32_against_int32_of_the_same_bytes() {
    run_ranks_with(
        &detail("float32_against_int32_of_the_same_bytes"),
        Backend::Gloo,
        |pg| {
            mismatched_all_reduce(
                pg,
                Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]),
                Tensor::from_slice(&[1i32, 2, 3, 4]),
                "rank 0 called all_reduce of [4] (Float) on Cpu as its collective 0, rank 1 \
                 called all_reduce of [4] (Int) on Cpu as its collective 0",
            )
        },
    );
}

#[test]
fn shape_4_against_8() {
    run_ranks_with(&detail("shape_4_against_8"), Backend::Gloo, |pg| {
        mismatched_all_reduce(
            pg,
            Tensor::ones([4], (Kind::Float, tch::Device::Cpu)),
            Tensor::ones([8], (Kind::Float, tch::Device::Cpu)),
            "rank 0 called all_reduce of [4] (Float) on Cpu as its collective 0, rank 1 called \
             all_reduce of [8] (Float) on Cpu as its collective 0",
        )
    });
}

#[test]
fn float_against_double() {
    run_ranks_with(&detail("float_against_double"), Backend::Gloo, |pg| {
        mismatched_all_reduce(
            pg,
            Tensor::ones([4], (Kind::Float, tch::Device::Cpu)),
            Tensor::ones([4], (Kind::Double, tch::Device::Cpu)),
            "rank 0 called all_reduce of [4] (Float) on Cpu as its collective 0, rank 1 called \
             all_reduce of [4] (Double) on Cpu as its collective 0",
        )
    });
}

#[test]
fn all_reduce_against_broadcast() {
    run_ranks_with(
        &detail("all_reduce_against_broadcast"),
        Backend::Gloo,
        |pg| {
            let t = Tensor::from_slice(&[pg.rank() as f32 + 1.0; 4]);
            let before = t.copy();
            let (op, err) = if pg.rank() == 0 {
                ("all_reduce", pg.all_reduce(&t, ReduceOp::Sum).unwrap_err())
            } else {
                ("broadcast", pg.broadcast(&t, 1).unwrap_err())
            };
            assert_eq!(
                err.to_string(),
                format!(
                    "rank {}: {op}: the ranks called different collectives (TCH_DIST_DEBUG=DETAIL \
                 checks each one before it runs): rank 0 called all_reduce of [4] (Float) on Cpu \
                 as its collective 0, rank 1 called broadcast from rank 1 of [4] (Float) on Cpu \
                 as its collective 0; nothing was sent",
                    pg.rank()
                )
            );
            assert!(t.equal(&before), "the tensor changed");
            still_works(&pg);
        },
    );
}

/// Broadcasts from different roots (without DETAIL: both ranks send, and both wait out the
/// timeout). c10d's fingerprint has no root; the shim compares the roots once it passed.
#[test]
fn broadcasts_from_different_roots() {
    run_ranks_with(
        &detail("broadcasts_from_different_roots"),
        Backend::Gloo,
        |pg| {
            let t = Tensor::from_slice(&[pg.rank() as f32 + 1.0; 4]);
            let err = pg.broadcast(&t, pg.rank()).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "rank {}: broadcast: the ranks called different collectives \
                 (TCH_DIST_DEBUG=DETAIL checks each one before it runs): rank 0 called broadcast \
                 from rank 0 of [4] (Float) on Cpu as its collective 0, rank 1 called broadcast \
                 from rank 1 of [4] (Float) on Cpu as its collective 0; nothing was sent",
                    pg.rank()
                )
            );
            assert_eq!(
                Vec::<f32>::try_from(&t).unwrap(),
                [pg.rank() as f32 + 1.0; 4]
            );
            still_works(&pg);
            // The same root on both: the broadcast runs.
            pg.broadcast(&t, 1).unwrap();
            assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [2.0; 4]);
        },
    );
}

/// Training with the gradient reducer, rank 1 skips step 1: the ranks' collectives line up
/// step against step until rank 1 has finished and waits in a barrier while rank 0's last
/// backward starts with its step check (the header exchange, `step_check.rs`: a whole
/// skipped step leaves no trace in the counts). Both fail there, naming both calls; rank 0's
/// backward fails with the message and the reducer returns the typed error before the next
/// forward.
#[test]
fn a_rank_that_skips_a_training_step() {
    run_ranks_with(
        &detail("a_rank_that_skips_a_training_step"),
        Backend::Gloo,
        |pg| {
            let m = model::Model::new(model::Shape::default(), 7);
            let reducer = Reducer::new(m.handles(), pg.clone(), ReducerOptions::default()).unwrap();
            let steps: Vec<usize> = match pg.rank() {
                0 => vec![0, 1, 2, 3],
                _ => vec![0, 2, 3],
            };
            let mut failed = None;
            for step in steps {
                reducer.prepare_for_forward().unwrap();
                let (x, y) = model::data(step);
                let loss = m.loss(&model::slice(&x, &pg), &model::slice(&y, &pg));
                if let Err(e) = loss.f_backward() {
                    failed = Some((step, e.to_string()));
                    break;
                }
                m.sgd_step(false);
            }
            let err = if pg.rank() == 0 {
                let (step, backward) = failed.expect("rank 0's last backward fails");
                assert_eq!(step, 3);
                let err = reducer.prepare_for_forward().unwrap_err();
                assert!(backward.contains(&err.to_string()), "{backward}\n{err}");
                err
            } else {
                assert!(failed.is_none());
                pg.barrier().unwrap_err()
            };
            let DistError::Desync { desync, .. } = &err else {
                panic!("{err}");
            };
            let Desync::Differ { calls } = &**desync else {
                panic!("{err}");
            };
            // Both ranks are at the same collective: rank 1 ran one step's worth fewer.
            let n = calls[0].seq;
            assert_eq!(calls[1].seq, n);
            // Rank 0's collective is its step check's header exchange (an all_to_all, whose
            // tensors DETAIL's fingerprint leaves out).
            let op = if pg.rank() == 0 {
                "all_to_all"
            } else {
                "barrier"
            };
            assert_eq!(
                err.to_string(),
                format!(
                    "rank {}: {op}: the ranks called different collectives (TCH_DIST_DEBUG=DETAIL \
                     checks each one before it runs): rank 0 called all_to_all as its \
                     collective {n}, rank 1 called barrier as its collective {n}; nothing was \
                     sent",
                    pg.rank()
                )
            );
        },
    );
}

/// A rank that leaves instead of calling the collective: rank 0 names it at once, rather
/// than waiting out the timeout or reporting a bare connection error.
#[test]
fn a_rank_that_leaves_before_a_collective() {
    run_ranks_with(
        &detail("a_rank_that_leaves_before_a_collective"),
        Backend::Gloo,
        |pg| {
            if pg.rank() == 1 {
                return;
            }
            let t = Tensor::from_slice(&[1.0f32, 2.0]);
            let start = std::time::Instant::now();
            let err = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
            assert!(start.elapsed() < Duration::from_secs(5), "{err}");
            assert_eq!(
                err.to_string(),
                "rank 0: all_reduce: rank 1 left (closed the connection) without reaching this \
                 collective (rank 0 called all_reduce of [2] (Float) on Cpu as its collective 0; \
                 TCH_DIST_DEBUG=DETAIL checks that every rank calls each collective before it \
                 runs)"
            );
            assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [1.0, 2.0]);
        },
    );
}

/// PyTorch's variable turns DETAIL on too; without either, a group checks nothing.
#[test]
fn torch_distributed_debug_turns_it_on() {
    run_ranks_with(
        &Launch::new("torch_distributed_debug_turns_it_on", 2)
            .env("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
            .env("TCH_DIST_TIMEOUT_SECS", "5")
            .timeout(Duration::from_secs(60)),
        Backend::Gloo,
        |pg| {
            assert_eq!(pg.debug_level(), DebugLevel::Detail);
            let t = if pg.rank() == 0 {
                Tensor::ones([2], (Kind::Float, tch::Device::Cpu))
            } else {
                Tensor::ones([3], (Kind::Float, tch::Device::Cpu))
            };
            let err = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
            assert!(matches!(err, DistError::Desync { .. }), "{err}");
            still_works(&pg);
            // A subgroup inherits the level.
            let sub = pg.new_group(&[0, 1], Backend::Gloo).unwrap().unwrap();
            assert_eq!(sub.debug_level(), DebugLevel::Detail);
            still_works(&sub);
        },
    );
}
