//! Refusals (on every rank, before any activation moves, changing nothing), a stage whose
//! output changes shape, and a stage killed mid-step.

use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use tch::nn::{self, Module};
use tch::{Device, Tensor};
use tch_dist::pipelining::{
    OnOp, OnStage, PipelineError, PipelineProblem, PipelineStage, Schedule1F1B, ScheduleGPipe,
    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, StageProblem,
    Transfer,
};
use tch_dist::testing::{describe, run_ranks, run_ranks_with, worker, Launch};
use tch_dist::Backend;

use super::{batch, mse, part, sgd, stages, Part, BATCH, MODEL};

const CUTS: [usize; 3] = [0, 2, 6];

/// The problem of an `OnOp` error from `op` on this rank, and its message.
fn problem(rank: usize, op: &str, e: PipelineError) -> (PipelineProblem, String) {
    let text = e.to_string();
    match e {
        PipelineError::OnOp(OnOp {
            rank: r,
            op: o,
            problem,
        }) if r == rank && o == op => (problem, text),
        e => panic!("{e:?}"),
    }
}

#[test]
fn schedules_refuse_on_every_rank_before_any_work() {
    run_ranks(
        "errors::schedules_refuse_on_every_rank_before_any_work",
        2,
        |pg| {
            let rank = pg.rank();
            let vs = nn::VarStore::new(Device::Cpu);

            // 1F1B needs a microbatch per stage at least: every rank, the same error.
            let e =
                Schedule1F1B::new(stages(&pg, &vs, &MODEL, &CUTS).remove(0), 1, mse).unwrap_err();
            let (p, text) = problem(rank, "Schedule1F1B::new", e);
            assert_eq!(
                p,
                PipelineProblem::FewerMicrobatchesThanStages {
                    n_microbatches: 1,
                    num_stages: 2
                }
            );
            assert_eq!(
                text,
                format!(
                    "rank {rank}: Schedule1F1B::new: 1 microbatches are fewer than the 2 stages \
                 (1F1B needs at least one per stage)"
                )
            );

            // Zero microbatches.
            let e =
                ScheduleGPipe::new(stages(&pg, &vs, &MODEL, &CUTS).remove(0), 0, mse).unwrap_err();
            assert_eq!(
                problem(rank, "ScheduleGPipe::new", e).1,
                format!("rank {rank}: ScheduleGPipe::new: n_microbatches must be at least 1")
            );

            // Three stages over two ranks of one stage each: every rank.
            let three =
                |s: usize| PipelineStage::new(part(&vs, &MODEL, 0..1), s, 3, Device::Cpu, &pg);
            let e = ScheduleGPipe::new(three(rank), 4, mse).unwrap_err();
            let (p, text) = problem(rank, "ScheduleGPipe::new", e);
            assert_eq!(
                p,
                PipelineProblem::NumStages {
                    num_stages: 3,
                    group_size: 2,
                    local_stages: 1
                }
            );
            assert_eq!(
                text,
                format!(
                    "rank {rank}: ScheduleGPipe::new: 3 stages do not fit 2 ranks holding 1 \
                 stage(s) each (num_stages must be 2)"
                )
            );

            // Only rank 1 is wrong (3 stages): it says why, rank 0 that rank 1 refused.
            let stage = if rank == 1 {
                three(1)
            } else {
                stages(&pg, &vs, &MODEL, &CUTS).remove(0)
            };
            let (p, text) = problem(
                rank,
                "Schedule1F1B::new",
                Schedule1F1B::new(stage, 4, mse).unwrap_err(),
            );
            if rank == 1 {
                assert!(
                    matches!(p, PipelineProblem::NumStages { num_stages: 3, .. }),
                    "{p:?}"
                );
            } else {
                assert_eq!(p, PipelineProblem::PeerRefused { peer: 1 });
                assert_eq!(
                    text,
                    "rank 0: Schedule1F1B::new: rank 1 refused the pipeline (its error says why)"
                );
            }

            // A stage on the wrong rank (rank 0 holding stage 1 and rank 1 stage 0).
            let swapped =
                PipelineStage::new(part(&vs, &MODEL, 0..1), 1 - rank, 2, Device::Cpu, &pg);
            let (p, _) = problem(
                rank,
                "ScheduleGPipe::new",
                ScheduleGPipe::new(swapped, 4, mse).unwrap_err(),
            );
            assert_eq!(
                p,
                PipelineProblem::Placement {
                    stage_index: 1 - rank,
                    rank,
                    group_size: 2
                }
            );

            // The ranks disagree on the microbatch count.
            let n = 4 + 4 * rank;
            let stage = stages(&pg, &vs, &MODEL, &CUTS).remove(0);
            let (p, text) = problem(
                rank,
                "ScheduleGPipe::new",
                ScheduleGPipe::new(stage, n, mse).unwrap_err(),
            );
            assert_eq!(
                p,
                PipelineProblem::Disagree {
                    setting: "n_microbatches",
                    this: n as i64,
                    other_rank: 1 - rank,
                    other: (8 - 4 * rank) as i64
                }
            );
            assert_eq!(
                text,
                format!(
                "rank {rank}: ScheduleGPipe::new: this rank was given n_microbatches {n}, rank \
                 {} was given {} (every rank of the pipeline must agree)",
                1 - rank,
                8 - 4 * rank
            )
            );

            // Interleaved: 2 ranks x 2 stages need 4 stages, not 3 (stages 0, 2 and 1).
            let mine: Vec<_> = if rank == 0 {
                vec![three(0), three(2)]
            } else {
                vec![three(1)]
            };
            let (p, _) = problem(
                rank,
                "ScheduleInterleaved1F1B::new",
                ScheduleInterleaved1F1B::new(mine, 4, mse).unwrap_err(),
            );
            let expected_local = if rank == 0 { 2 } else { 1 };
            assert_eq!(
                p,
                PipelineProblem::NumStages {
                    num_stages: 3,
                    group_size: 2,
                    local_stages: expected_local
                }
            );

            // Zero bubble (as interleaved 1F1B and PyTorch's): 5 microbatches on 2 ranks are
            // not a multiple of its max(1, 5 / 2) = 2 rounds.
            let stage = stages(&pg, &vs, &MODEL, &CUTS).remove(0);
            let (p, text) = problem(
                rank,
                "ScheduleInterleavedZeroBubble::new",
                ScheduleInterleavedZeroBubble::new(vec![stage], 5, mse).unwrap_err(),
            );
            assert_eq!(
                p,
                PipelineProblem::Rounds {
                    n_microbatches: 5,
                    rounds: 2
                }
            );
            assert_eq!(
                text,
                format!(
                    "rank {rank}: ScheduleInterleavedZeroBubble::new: 5 microbatches are not a \
                     multiple of the schedule's 2 rounds"
                )
            );

            // ZB-V: stages in the loop placement (rank 0: 0 and 2, rank 1: 1 and 3) are on the
            // wrong ranks for the V (rank 0: 0 and 3, rank 1: 1 and 2).
            let four =
                |s: usize| PipelineStage::new(part(&vs, &MODEL, 0..1), s, 4, Device::Cpu, &pg);
            let (p, text) = problem(
                rank,
                "ScheduleZBVZeroBubble::new",
                ScheduleZBVZeroBubble::new(vec![four(rank), four(rank + 2)], 4, mse).unwrap_err(),
            );
            let wrong = if rank == 0 { 2 } else { 3 };
            assert_eq!(
                p,
                PipelineProblem::VPlacement {
                    stage_index: wrong,
                    rank,
                    group_size: 2
                }
            );
            assert_eq!(
                text,
                format!(
                    "rank {rank}: ScheduleZBVZeroBubble::new: stage {wrong} belongs on rank {} of \
                     the 2-rank group, not on rank {rank} (the V placement: rank r holds stages r \
                     and 3-r)",
                    1 - rank
                )
            );

            // ZB-V: one stage per rank.
            let stage = stages(&pg, &vs, &MODEL, &CUTS).remove(0);
            let (p, text) = problem(
                rank,
                "ScheduleZBVZeroBubble::new",
                ScheduleZBVZeroBubble::new(vec![stage], 4, mse).unwrap_err(),
            );
            assert_eq!(p, PipelineProblem::TwoStagesPerRank { local_stages: 1 });
            assert_eq!(
                text,
                format!(
                    "rank {rank}: ScheduleZBVZeroBubble::new: the V placement needs exactly 2 \
                     stages on every rank, this rank holds 1"
                )
            );
        },
    );
}

#[test]
fn a_step_whose_batch_does_not_fit_is_refused_on_every_rank_and_changes_nothing() {
    run_ranks(
        "errors::a_step_whose_batch_does_not_fit_is_refused_on_every_rank_and_changes_nothing",
        2,
        |pg| {
            let rank = pg.rank();
            let vs = nn::VarStore::new(Device::Cpu);
            let mine = stages(&pg, &vs, &MODEL, &CUTS);
            let mut schedule = Schedule1F1B::new(mine.into_iter().next().unwrap(), 4, mse).unwrap();
            let first = rank == 0;
            let no_grads =
                |vs: &nn::VarStore| vs.trainable_variables().iter().all(|t| !t.grad().defined());
            let mut losses = Vec::new();

            // 6 rows do not split into 4 microbatches: the last rank learns it too.
            let (x, y) = batch(0, 6);
            let e = schedule
                .step(first.then_some(&x), (!first).then_some(&y), &mut losses)
                .unwrap_err();
            let (p, text) = problem(rank, "Schedule1F1B::step", e);
            assert_eq!(
                p,
                PipelineProblem::BatchNotDivisible {
                    batch: 6,
                    n_microbatches: 4
                }
            );
            assert_eq!(
                text,
                format!(
                    "rank {rank}: Schedule1F1B::step: a batch of 6 does not split into 4 equal \
                     microbatches"
                )
            );
            assert!(losses.is_empty() && no_grads(&vs));

            // Input and target of different batches.
            let (x, _) = batch(0, 8);
            let (_, y) = batch(0, 12);
            let e = schedule
                .step(first.then_some(&x), (!first).then_some(&y), &mut losses)
                .unwrap_err();
            assert_eq!(
                problem(rank, "Schedule1F1B::step", e).0,
                PipelineProblem::TargetBatch {
                    input: 8,
                    target: 12
                }
            );

            // The last stage without a target: it says so, the first that it refused.
            let (x, y) = batch(0, BATCH);
            let e = schedule
                .step(first.then_some(&x), None, &mut losses)
                .unwrap_err();
            let (p, text) = problem(rank, "Schedule1F1B::step", e);
            if first {
                assert_eq!(p, PipelineProblem::PeerRefused { peer: 1 });
            } else {
                assert_eq!(p, PipelineProblem::MissingTarget);
                assert_eq!(
                    text,
                    "rank 1: Schedule1F1B::step: the last stage needs a target"
                );
            }
            assert!(losses.is_empty() && no_grads(&vs));

            // A step inside no_grad (issue 41, item 10: one rank failed in libtorch's backward
            // while the other waited out the timeout): refused before any work, on every
            // rank, naming grad mode; on one rank only, the other learns that it refused.
            let grad_off = format!(
                "rank {rank}: Schedule1F1B::step: a training step needs grad mode, but it is \
                 off on this thread (the step is inside `tch::no_grad`); call step outside it"
            );
            let e = tch::no_grad(|| {
                schedule.step(first.then_some(&x), (!first).then_some(&y), &mut losses)
            })
            .unwrap_err();
            let (p, text) = problem(rank, "Schedule1F1B::step", e);
            assert_eq!((p, text), (PipelineProblem::GradDisabled, grad_off.clone()));
            let step = |s: &mut Schedule1F1B<_>, losses: &mut Vec<Tensor>| {
                s.step(first.then_some(&x), (!first).then_some(&y), losses)
            };
            let e = if rank == 1 {
                tch::no_grad(|| step(&mut schedule, &mut losses))
            } else {
                step(&mut schedule, &mut losses)
            }
            .unwrap_err();
            let (p, text) = problem(rank, "Schedule1F1B::step", e);
            if rank == 1 {
                assert_eq!((p, text), (PipelineProblem::GradDisabled, grad_off));
            } else {
                assert_eq!(p, PipelineProblem::PeerRefused { peer: 1 });
            }
            assert!(losses.is_empty() && no_grads(&vs));

            // The same schedule still trains.
            schedule
                .step(first.then_some(&x), (!first).then_some(&y), &mut losses)
                .unwrap();
            assert_eq!(losses.len(), if first { 0 } else { 4 });
            assert!(vs.trainable_variables().iter().all(|t| t.grad().defined()));
            let _ = sgd(&vs);
        },
    );
}

/// Stage 0's output loses a column from step 2 on: stage 0 refuses to send it, naming both
/// stages and both shapes; stage 1, waiting for it, fails once rank 0 has gone.
#[test]
fn an_output_that_changes_shape_is_an_error_naming_both_stages() {
    const TEST: &str = "errors::an_output_that_changes_shape_is_an_error_naming_both_stages";
    let launch = Launch::new(TEST, 2).env("TCH_DIST_TIMEOUT_SECS", "10");
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let calls = Rc::new(Cell::new(0usize));
        let seen = calls.clone();
        let range = if rank == 0 { 0..2 } else { 2..6 };
        let stage = PipelineStage::with_forward(
            part(&vs, &MODEL, range),
            move |m: &Part, x: &Tensor, _train| {
                seen.set(seen.get() + 1);
                let y = m.forward(x);
                Ok(if rank == 0 && seen.get() > 4 {
                    y.narrow(1, 0, 11)
                } else {
                    y
                })
            },
            rank,
            2,
            Device::Cpu,
            &pg,
        );
        let mut schedule = ScheduleGPipe::new(stage, 4, mse).unwrap();
        let first = rank == 0;
        let (x, y) = batch(0, 8);
        let mut losses = Vec::new();
        schedule
            .step(first.then_some(&x), (!first).then_some(&y), &mut losses)
            .unwrap();
        let e = schedule
            .step(first.then_some(&x), (!first).then_some(&y), &mut losses)
            .unwrap_err();
        if first {
            assert_eq!(
                e.to_string(),
                "rank 0: stage 0: the output of microbatch 0 is float32[2, 11], but stage 1 was \
                 told float32[2, 12] (the first microbatch's): every microbatch must have the \
                 same shape and dtype"
            );
        } else {
            match &e {
                PipelineError::OnStage(OnStage {
                    rank: 1,
                    stage: 1,
                    problem:
                        StageProblem::Transfer {
                            transfer: Transfer::RecvActivation,
                            microbatch: 0,
                            peer_stage: 0,
                            peer_rank: 0,
                            ..
                        },
                }) => {}
                e => panic!("{e:?}"),
            }
            assert_eq!(
                e.to_string(),
                "rank 1: stage 1: receiving the activation of microbatch 0 from stage 0 (rank \
                 0) failed"
            );
            assert!(std::error::Error::source(&e).is_some());
        }
    });
}

/// A loss of more than one number (`Reduction::None`) is an error on the last stage, not a
/// backward from its sum; stage 0, waiting for the gradient, fails once rank 1 has gone.
#[test]
fn a_loss_that_is_not_one_number_is_an_error() {
    const TEST: &str = "errors::a_loss_that_is_not_one_number_is_an_error";
    let launch = Launch::new(TEST, 2).env("TCH_DIST_TIMEOUT_SECS", "10");
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let mine = stages(&pg, &vs, &MODEL, &[0, 2, 6]).remove(0);
        let per_element = |out: &Tensor, y: &Tensor| out.mse_loss(y, tch::Reduction::None);
        let mut schedule = Schedule1F1B::new(mine, 4, per_element).unwrap();
        let first = pg.rank() == 0;
        let (x, y) = batch(0, 8);
        let e = schedule
            .step(first.then_some(&x), (!first).then_some(&y), &mut Vec::new())
            .unwrap_err();
        if first {
            assert!(
                matches!(
                    (e.stage(), e.stage_problem()),
                    (Some(0), Some(StageProblem::Transfer { .. }))
                ),
                "{e:?}"
            );
        } else {
            assert_eq!(
                e.to_string(),
                "rank 1: stage 1: the loss of microbatch 0 failed: the loss must be one number \
                 (a mean), not of shape [2, 3]"
            );
        }
    });
}

const KILLED: &str = "errors::a_stage_killed_mid_step_fails_every_other_rank_within_the_timeout";
const KILLED_TIMEOUT_SECS: u64 = 5;

/// 4 stages, 1F1B: stage 2 dies during its third forward of the second step. Every other
/// rank's step fails within the group's timeout + 1.5 s with one line naming its stage, and
/// every process ends.
#[test]
fn a_stage_killed_mid_step_fails_every_other_rank_within_the_timeout() {
    if worker().is_some() {
        return run_ranks(KILLED, 4, |pg| {
            let rank = pg.rank();
            let vs = nn::VarStore::new(Device::Cpu);
            let cuts = [0, 1, 3, 4, 6];
            let calls = Rc::new(Cell::new(0usize));
            let seen = calls.clone();
            let stage = PipelineStage::with_forward(
                part(&vs, &MODEL, cuts[rank]..cuts[rank + 1]),
                move |m: &Part, x: &Tensor, _train| {
                    seen.set(seen.get() + 1);
                    if rank == 2 && seen.get() == 8 + 3 {
                        // No destructor, no goodbye: a rank that dies.
                        std::process::abort();
                    }
                    Ok(m.forward(x))
                },
                rank,
                4,
                Device::Cpu,
                &pg,
            );
            let mut schedule = Schedule1F1B::new(stage, 8, mse).unwrap();
            let (x, y) = batch(0, BATCH);
            let (first, last) = (rank == 0, rank == 3);
            let mut losses = Vec::new();
            schedule
                .step(first.then_some(&x), last.then_some(&y), &mut losses)
                .unwrap();
            let started = Instant::now();
            let e = schedule
                .step(first.then_some(&x), last.then_some(&y), &mut losses)
                .unwrap_err();
            let took = started.elapsed();
            let limit = Duration::from_secs(KILLED_TIMEOUT_SECS) + Duration::from_millis(1500);
            assert!(took < limit, "rank {rank}: failed after {took:?}: {e}");
            let line = e.to_string();
            assert!(
                line.starts_with(&format!("rank {rank}: stage {rank}: ")) && !line.contains('\n'),
                "{line}"
            );
            assert!(
                matches!(e.stage_problem(), Some(StageProblem::Transfer { .. })),
                "{e:?}"
            );
            println!("pipeline-error: {line}");
            // The group is unusable with rank 2 gone: end here.
            println!("tch-dist-test: rank body finished: {KILLED} {rank}");
            std::process::exit(0);
        });
    }
    let started = Instant::now();
    let out = Launch::new(KILLED, 4)
        .env("TCH_DIST_TIMEOUT_SECS", KILLED_TIMEOUT_SECS.to_string())
        .timeout(Duration::from_secs(90))
        .run();
    // Every process ended by itself (none killed at the deadline).
    assert!(out.iter().all(|o| o.status.is_some()), "{}", describe(&out));
    assert!(!out[2].success(), "{}", describe(&out));
    for r in [0, 1, 3] {
        assert!(out[r].success(), "{}", describe(&out));
        assert!(
            out[r]
                .stdout
                .contains(&format!("pipeline-error: rank {r}: stage {r}: ")),
            "{}",
            describe(&out)
        );
    }
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// Stage 0's forward fails at the first microbatch of the second step, before it sends or
/// posts anything, and its program carries on, neither exiting nor sending: stage 1, waiting
/// for the activation, fails within seconds naming rank 0 and its error, where it waited out
/// the group's timeout (issue 41, section 4); both ranks' next steps are refused at once
/// (their groups stopped).
#[test]
fn a_stage_that_fails_and_carries_on_fails_its_peer_within_seconds() {
    const TEST: &str = "errors::a_stage_that_fails_and_carries_on_fails_its_peer_within_seconds";
    let launch = Launch::new(TEST, 2).env("TCH_DIST_TIMEOUT_SECS", "60");
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let calls = Rc::new(Cell::new(0usize));
        let seen = calls.clone();
        let range = if rank == 0 { 0..2 } else { 2..6 };
        let stage = PipelineStage::with_forward(
            part(&vs, &MODEL, range),
            move |m: &Part, x: &Tensor, _train| {
                seen.set(seen.get() + 1);
                if rank == 0 && seen.get() > 4 {
                    return Err(tch_dist::ForwardError::new("the data went away"));
                }
                Ok(m.forward(x))
            },
            rank,
            2,
            Device::Cpu,
            &pg,
        );
        let mut schedule = Schedule1F1B::new(stage, 4, mse).unwrap();
        let first = rank == 0;
        let (x, y) = batch(0, 8);
        let mut losses = Vec::new();
        let mut step = || schedule.step(first.then_some(&x), (!first).then_some(&y), &mut losses);
        step().unwrap();
        let started = Instant::now();
        let e = step().unwrap_err();
        let took = started.elapsed();
        let own = tch_dist::report(&e);
        if first {
            assert!(own.contains("the data went away"), "{own}");
            // The program carries on: it neither exits nor sends.
            std::thread::sleep(Duration::from_secs(4));
        } else {
            assert!(
                took < Duration::from_secs(5),
                "rank 1 failed after {took:?}: {own}"
            );
            assert!(
                own.contains(
                    "rank 1: recv: rank 0 failed and stopped taking part: rank 0: stage 0: the \
                     forward of microbatch 0 failed"
                ),
                "{own}"
            );
            assert!(own.contains("the data went away"), "{own}");
        }
        // Both groups stopped: the next step is refused at once, naming the failure.
        let started = Instant::now();
        let again = tch_dist::report(&step().unwrap_err());
        assert!(started.elapsed() < Duration::from_secs(2), "{again}");
        assert!(
            again.contains("the group stopped after this rank's failure"),
            "{again}"
        );
    });
}
