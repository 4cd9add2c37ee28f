//! `loss_parallel` against `F.cross_entropy` on the whole logits: the value and each rank's
//! slice of the gradient, at 2 and 3 ranks (uneven and empty slices of the vocabulary), every
//! reduction, class weights and `ignore_index`; and misuse refused on every rank.

use super::{chunk, max_diff};
use tch::{Device, Kind, Reduction, Tensor};
use tch_dist::sharding::{loss_parallel, LossParallelError, LossParallelOptions, LossProblem};
use tch_dist::testing::run_ranks;
use tch_dist::{OnRank, ProcessGroup};

/// The same logits and targets on every rank (a seed shared by all).
fn inputs(rows: i64, vocab: i64) -> (Tensor, Tensor) {
    tch::manual_seed(7);
    let logits = Tensor::randn([rows, vocab], (Kind::Double, Device::Cpu)) * 3.0;
    let targets = Tensor::randint(vocab, [rows], (Kind::Int64, Device::Cpu));
    let _ = targets.narrow(0, 1, 1).fill_(-100); // one ignored row
    (logits, targets)
}

/// loss_parallel on this rank's slice equals cross_entropy on the whole logits, in value and
/// in this rank's slice of the gradient.
fn equals_cross_entropy(pg: &ProcessGroup, vocab: i64, reduction: Reduction, weighted: bool) {
    let (world, rank) = (pg.world_size(), pg.rank());
    let (logits, targets) = inputs(6, vocab);
    let weight = weighted.then(|| Tensor::arange(vocab, (Kind::Double, Device::Cpu)) * 0.25 + 0.5);
    let whole = logits.copy().set_requires_grad(true);
    let expected = whole.cross_entropy_loss(&targets, weight.as_ref(), reduction, -100, 0.0);
    expected.sum(Kind::Double).backward();
    let local = chunk(&logits, 1, world, rank)
        .copy()
        .set_requires_grad(true);
    let opts = LossParallelOptions {
        reduction,
        weight,
        ..Default::default()
    };
    let got = loss_parallel(&local, &targets, pg, &opts).expect("loss_parallel");
    let what = format!("vocab {vocab}, {reduction:?}, weighted {weighted}, rank {rank}");
    assert!(
        max_diff(&got, &expected) < 1e-12,
        "{what}: {got} against {expected}"
    );
    got.sum(Kind::Double).backward();
    let expected_grad = chunk(&whole.grad(), 1, world, rank);
    assert!(
        max_diff(&local.grad(), &expected_grad) < 1e-12,
        "{what}: the gradient"
    );
    // Under no_grad: the same value, no graph.
    let plain = tch::no_grad(|| loss_parallel(&local, &targets, pg, &opts)).expect("no_grad");
    assert!(
        max_diff(&plain, &expected) < 1e-12 && !plain.requires_grad(),
        "{what}: no_grad"
    );
}

fn every_case(pg: &ProcessGroup) {
    // 7 classes: slices 4+3 at 2 ranks, 3+3+1 at 3; 2 classes at 3 ranks: 1+1+0 (empty).
    for vocab in [7, 2] {
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            equals_cross_entropy(pg, vocab, reduction, false);
        }
        equals_cross_entropy(pg, vocab, Reduction::Mean, true);
    }
}

#[test]
fn loss_parallel_equals_cross_entropy_at_3_ranks() {
    run_ranks(
        "loss::loss_parallel_equals_cross_entropy_at_3_ranks",
        3,
        |pg| every_case(&pg),
    );
}

/// The problem every rank reports.
fn refused(r: Result<Tensor, LossParallelError>) -> LossProblem {
    match r {
        Err(LossParallelError::OnRank(OnRank { problem, .. })) => problem,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn loss_parallel_equals_cross_entropy_and_refuses_misuse_on_every_rank_at_2_ranks() {
    run_ranks(
        "loss::loss_parallel_equals_cross_entropy_and_refuses_misuse_on_every_rank_at_2_ranks",
        2,
        |pg| {
            every_case(&pg);
            let rank = pg.rank();
            let (logits, targets) = inputs(6, 7);
            let local = chunk(&logits, 1, 2, rank);
            let opts = LossParallelOptions::default();
            // Rank 1's targets differ.
            let mine = if rank == 1 {
                targets.flip([0])
            } else {
                targets.shallow_clone()
            };
            let e = refused(loss_parallel(&local, &mine, &pg, &opts));
            assert_eq!(e, LossProblem::TargetsDiffer);
            // Rank 1's logits are not [rows, classes].
            let bad = if rank == 1 {
                local.reshape([-1])
            } else {
                local.shallow_clone()
            };
            let e = refused(loss_parallel(&bad, &targets, &pg, &opts));
            match rank {
                0 => assert_eq!(e, LossProblem::PeerRefused { peer: 1 }),
                _ => assert!(matches!(e, LossProblem::Shapes { .. }), "{e}"),
            }
            // Rank 1 has fewer rows (and targets).
            let (rows, tail) = if rank == 1 {
                (local.narrow(0, 0, 5), targets.narrow(0, 0, 5))
            } else {
                (local.shallow_clone(), targets.shallow_clone())
            };
            assert_eq!(
                refused(loss_parallel(&rows, &tail, &pg, &opts)),
                LossProblem::RowsDiffer(vec![6, 5])
            );
            // A target past the vocabulary, on every rank.
            let past = targets.copy();
            let _ = past.narrow(0, 2, 1).fill_(7);
            let e = refused(loss_parallel(&local, &past, &pg, &opts));
            assert_eq!(
                e,
                LossProblem::TargetOutOfBounds {
                    row: 2,
                    target: 7,
                    classes: 7
                }
            );
            // Class weights on rank 0 only.
            let weight = (rank == 0).then(|| Tensor::ones([7], (Kind::Double, Device::Cpu)));
            let weighted = LossParallelOptions {
                weight,
                ..Default::default()
            };
            let e = refused(loss_parallel(&local, &targets, &pg, &weighted));
            assert_eq!(
                e,
                LossProblem::Weight {
                    classes: 7,
                    lengths: vec![Some(7), None]
                }
            );
            // Class weights that are not 1-D, on every rank: refused, not taken as none.
            let flat = Tensor::ones([1, 7], (Kind::Double, Device::Cpu));
            let not_1d = LossParallelOptions {
                weight: Some(flat),
                ..Default::default()
            };
            let e = refused(loss_parallel(&local, &targets, &pg, &not_1d));
            assert_eq!(
                e,
                LossProblem::Weight {
                    classes: 7,
                    lengths: vec![Some(-1), Some(-1)]
                }
            );
            // The ranks are still in step: a good call after the refusals.
            equals_cross_entropy(&pg, 7, Reduction::Mean, false);
        },
    );
}
