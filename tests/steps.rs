//! The always-on step check (issue 22, items 3 and 4), ranks as real processes over
//! 127.0.0.1, without `TCH_DIST_DEBUG=DETAIL`: a rank that skips a backward, or (numbered
//! with `set_step`) a whole step, under `replicate` and under `fully_shard`, ends with an
//! error value on every rank naming both ranks' positions, before any pass-sized
//! collective is sent (before the check, Gloo aborted the peer: "Received data size doesn't
//! match expected size").

#[path = "common/blocks.rs"]
mod blocks;
#[path = "steps/tensor_parallel.rs"]
mod tensor_parallel;
use blocks::{blocks, Blocks};
use std::time::{Duration, Instant};
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::fully_shard::full_state_dict;
use tch_dist::testing::{run_ranks, run_ranks_with, Launch};
use tch_dist::{
    fully_shard, replicate, Backend, Call, CallT, ForwardError, FsdpOptions, ProcessGroup,
    Shardable,
};

/// A Linear, a BatchNorm (buffers: replicate broadcasts them before every forward, a
/// collective of another size than the backward's buckets) and a head.
#[derive(Debug, Shardable)]
struct Net {
    fc: nn::Linear,
    bn: nn::BatchNorm,
    head: nn::Linear,
}

impl ModuleT for Net {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let h = self.bn.call_t(&self.fc.call(xs), train).relu();
        self.head.call(&h)
    }
}

fn net(vs: &nn::VarStore) -> Net {
    let p = vs.root();
    Net {
        fc: nn::linear(&p / "fc", 6, 8, Default::default()),
        bn: nn::batch_norm1d(&p / "bn", 8, Default::default()),
        head: nn::linear(&p / "head", 8, 3, Default::default()),
    }
}

/// Two blocks of Linear layers (6 -> 6), one `fully_shard` group each, and the root's head.
fn sharded_blocks(vs: &nn::VarStore) -> Blocks {
    let m = blocks(&vs.root(), &[6, 6, 6, 3]);
    for b in &m.blocks {
        fully_shard(b, FsdpOptions::default()).unwrap();
    }
    fully_shard(&m, FsdpOptions::default()).unwrap();
    m
}

fn batch(step: usize, pg: &ProcessGroup) -> Tensor {
    tch::manual_seed(40 + (step * 8 + pg.rank()) as i64);
    Tensor::randn([4, 6], (Kind::Float, Device::Cpu))
}

/// An error's message and every source's, joined.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        text.push_str(" | ");
        text.push_str(&s.to_string());
        next = s.source();
    }
    text
}

const CAUSE: &str = "(a rank skipped or repeated a step, a forward or a backward)";

/// The message of a step check that failed on `rank` (of two), `mine` and `theirs` being
/// where this rank and the other one are.
fn step_error(rank: usize, op: &str, theirs: &str, mine: &str) -> String {
    format!(
        "rank {rank}: {op}: rank {} is {theirs} while this rank is {mine} {CAUSE}",
        1 - rank
    )
}

/// Three training steps of `forward` (then backward and SGD), rank 1 leaving out step 1's
/// backward: the first failure as (step, pass, message), if any.
fn train_skipping_a_backward(
    rank: usize,
    opt: &mut nn::Optimizer,
    forward: impl Fn(usize) -> Result<Tensor, ForwardError>,
) -> Option<(usize, &'static str, String)> {
    for step in 0..3 {
        let out = match forward(step) {
            Ok(out) => out,
            Err(e) => return Some((step, "forward", chain(&e))),
        };
        if rank == 1 && step == 1 {
            continue; // rank 1 leaves out this step's backward
        }
        opt.zero_grad();
        if let Err(e) = out.sum(Kind::Float).f_backward() {
            return Some((step, "backward", e.to_string()));
        }
        opt.step();
    }
    None
}

/// Rank 1 leaves out step 1's backward under replicate: both ranks fail, naming both
/// positions, with the headers traveling as `lane` says.
fn replicate_skipped_backward(pg: ProcessGroup, lane: Lane) {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = net(&vs);
    replicate::apply(&m, Default::default()).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let rank = pg.rank();
    let (step, pass, text) =
        train_skipping_a_backward(rank, &mut opt, |s| m.f_call_t(&batch(s, &pg), true))
            .expect("the skipped backward was not noticed");
    // Step 0's two checks chose the lane: step 1's went through it.
    assert_eq!(pg.step_check_shares_memory(), lane == Lane::SharedMemory);
    // Rank 0's backward of step 2 meets rank 1's forward of step 3.
    let rank0 = "in the backward of step 2 (2 forward and 2 backward passes)";
    let rank1 = "in the forward of step 3 (3 forward and 1 backward passes)";
    if rank == 0 {
        assert_eq!((step, pass), (1, "backward"), "{text}");
        assert!(
            text.contains(&step_error(0, "replicate", rank1, rank0)),
            "{text}"
        );
        // The failure is kept: the next forward reports it and sends nothing.
        let again = m.f_call_t(&batch(2, &pg), true).unwrap_err();
        assert!(
            chain(&again).contains(&step_error(0, "replicate", rank1, rank0)),
            "{again}"
        );
    } else {
        assert_eq!((step, pass), (2, "forward"), "{text}");
        assert!(
            text.contains(&step_error(1, "replicate", rank0, rank1)),
            "{text}"
        );
    }
}

/// Which way a test expects the step check's headers to travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    SharedMemory,
    Backend,
}

#[test]
fn replicate_skipped_backward_fails_on_every_rank() {
    run_ranks("replicate_skipped_backward_fails_on_every_rank", 2, |pg| {
        replicate_skipped_backward(pg, Lane::SharedMemory)
    });
}

/// The same through the backend's all-to-all, as between hosts: the switch on one rank
/// keeps every rank's headers there.
#[test]
fn replicate_skipped_backward_fails_on_every_rank_through_the_backend() {
    let test = "replicate_skipped_backward_fails_on_every_rank_through_the_backend";
    let launch = Launch::new(test, 2).rank_env(1, tch_dist::COLLECTIVE_STEP_CHECK_ENV, "1");
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        replicate_skipped_backward(pg, Lane::Backend)
    });
}

/// Runs `then` on both ranks of `test` (group timeout 20 s) with a fully_shard model whose
/// first two training steps moved the group's step checks into shared memory.
fn after_two_steps_in_shared_memory(test: &str, then: impl FnOnce(&ProcessGroup, &Blocks)) {
    let launch = Launch::new(test, 2)
        .env("TCH_DIST_TIMEOUT_SECS", "20")
        .timeout(Duration::from_secs(60));
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let m = sharded_blocks(&vs);
        let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
        for step in 0..2 {
            let out = m.f_call(&batch(step, &pg)).unwrap();
            opt.zero_grad();
            out.sum(Kind::Float).backward();
            opt.step();
        }
        assert!(pg.step_check_shares_memory());
        then(&pg, &m);
    });
}

/// A peer that exits while this rank waits for its header in shared memory is named at
/// once, not after the group's timeout.
#[test]
fn a_peer_that_exits_is_named_by_a_check_in_shared_memory() {
    let test = "a_peer_that_exits_is_named_by_a_check_in_shared_memory";
    after_two_steps_in_shared_memory(test, |pg, m| {
        if pg.rank() == 1 {
            return; // leaves: its process exits
        }
        let start = Instant::now();
        let e = m.f_call(&batch(2, pg)).unwrap_err();
        let text = chain(&e);
        assert!(start.elapsed() < Duration::from_secs(10), "{text}");
        // The forward's first step is the check: no collective ran before it.
        assert!(
            text.contains("rank 0: fully_shard failed: rank 1 closed the connection"),
            "{text}"
        );
    });
}

/// A peer that calls another collective (a barrier) where this rank's fully_shard forward
/// begins with its step check is named at once as elsewhere, not after the group's
/// timeout; this rank stops the group, and the peer's barrier fails as this rank leaves.
#[test]
fn a_peer_in_another_collective_is_named_by_a_check_in_shared_memory() {
    let test = "a_peer_in_another_collective_is_named_by_a_check_in_shared_memory";
    after_two_steps_in_shared_memory(test, |pg, m| {
        let start = Instant::now();
        if pg.rank() == 1 {
            let e = pg.barrier().unwrap_err();
            assert!(start.elapsed() < Duration::from_secs(10), "{e}");
            return;
        }
        let e = m.f_call(&batch(2, pg)).unwrap_err();
        let text = chain(&e);
        assert!(start.elapsed() < Duration::from_secs(10), "{text}");
        assert!(
            text.contains("rank 0: fully_shard: rank 1 called barrier as its collective ")
                && text.contains(
                    " on the group, where this rank waits for its step-check header after "
                ),
            "{text}"
        );
        // The group is stopped: a later call names the failure rather than waiting.
        let again = pg.barrier().unwrap_err().to_string();
        assert!(again.contains("rank 1 called barrier"), "{again}");
    });
}

#[test]
fn replicate_skipped_step_fails_on_every_rank_with_set_step() {
    run_ranks(
        "replicate_skipped_step_fails_on_every_rank_with_set_step",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let m = net(&vs);
            // No buffer broadcast: the backward's check is the only one.
            let opts = replicate::Options {
                broadcast_buffers: false,
                ..Default::default()
            };
            replicate::apply(&m, opts).unwrap();
            let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
            let rank = pg.rank();
            let mut failure = None;
            for step in 0..3 {
                tch_dist::set_step(step as u64);
                if rank == 1 && step == 1 {
                    continue; // rank 1 leaves out this whole step
                }
                let out = m.f_call_t(&batch(step, &pg), true).unwrap();
                opt.zero_grad();
                if let Err(e) = out.sum(Kind::Float).f_backward() {
                    failure = Some((step, e.to_string()));
                    break;
                }
                opt.step();
            }
            let (step, text) = failure.expect("the skipped step was not noticed");
            let rank0 = "in the backward of step 1 (set_step; 2 forward and 2 backward passes)";
            let rank1 = "in the backward of step 2 (set_step; 2 forward and 2 backward passes)";
            if rank == 0 {
                assert_eq!(step, 1, "{text}");
                assert!(
                    text.contains(&step_error(0, "replicate", rank1, rank0)),
                    "{text}"
                );
            } else {
                assert_eq!(step, 2, "{text}");
                assert!(
                    text.contains(&step_error(1, "replicate", rank0, rank1)),
                    "{text}"
                );
            }
        },
    );
}

#[test]
fn fully_shard_skipped_backward_fails_on_every_rank() {
    run_ranks(
        "fully_shard_skipped_backward_fails_on_every_rank",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let m = sharded_blocks(&vs);
            let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
            let rank = pg.rank();
            let (step, pass, text) =
                train_skipping_a_backward(rank, &mut opt, |s| m.f_call(&batch(s, &pg)))
                    .expect("the skipped backward was not noticed");
            let rank0 = "in the backward of step 2 (2 forward and 2 backward passes)";
            let rank1 = "in the forward of step 3 (3 forward and 1 backward passes)";
            if rank == 0 {
                assert_eq!((step, pass), (1, "backward"), "{text}");
                assert!(
                    text.contains(&step_error(0, "fully_shard", rank1, rank0)),
                    "{text}"
                );
                // Kept: the next forward fails with it and sends nothing.
                let again = m.f_call(&batch(2, &pg)).unwrap_err();
                assert!(
                    chain(&again).contains(&step_error(0, "fully_shard", rank1, rank0)),
                    "{}",
                    chain(&again)
                );
            } else {
                assert_eq!((step, pass), (2, "forward"), "{text}");
                assert!(
                    text.contains(&step_error(1, "fully_shard", rank0, rank1)),
                    "{text}"
                );
            }
        },
    );
}

#[test]
fn fully_shard_skipped_step_fails_on_every_rank() {
    run_ranks("fully_shard_skipped_step_fails_on_every_rank", 2, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let m = sharded_blocks(&vs);
        let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
        let rank = pg.rank();
        // Numbered with set_step: caught at the next forward.
        let mut failure = None;
        for step in 0..3 {
            tch_dist::set_step(step as u64);
            if rank == 1 && step == 1 {
                continue; // rank 1 leaves out this whole step
            }
            match m.f_call(&batch(step, &pg)) {
                Ok(out) => {
                    opt.zero_grad();
                    out.sum(Kind::Float).backward();
                    opt.step();
                }
                Err(e) => {
                    failure = Some((step, chain(&e)));
                    break;
                }
            }
        }
        let (step, text) = failure.expect("the skipped step was not noticed");
        let rank0 = "in the forward of step 1 (set_step; 2 forward and 1 backward passes)";
        let rank1 = "in the forward of step 2 (set_step; 2 forward and 1 backward passes)";
        assert_eq!(step, rank + 1, "{text}");
        let (theirs, mine) = if rank == 0 {
            (rank1, rank0)
        } else {
            (rank0, rank1)
        };
        assert!(
            text.contains(&step_error(rank, "fully_shard", theirs, mine)),
            "{text}"
        );
    });
}

#[test]
fn fully_shard_skipped_step_is_caught_where_the_ranks_part() {
    run_ranks(
        "fully_shard_skipped_step_is_caught_where_the_ranks_part",
        2,
        |pg| {
            // Without set_step a whole step left out leaves no trace on its rank: its steps
            // are averaged with the other's until their passes part — here rank 1's state
            // dict (between passes) meets rank 0's last forward.
            let vs = nn::VarStore::new(Device::Cpu);
            let m = sharded_blocks(&vs);
            let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
            let rank = pg.rank();
            let mut failure = None;
            for step in 0..3 {
                if rank == 1 && step == 1 {
                    continue;
                }
                match m.f_call(&batch(step, &pg)) {
                    Ok(out) => {
                        opt.zero_grad();
                        out.sum(Kind::Float).backward();
                        opt.step();
                    }
                    Err(e) => {
                        failure = Some(chain(&e));
                        break;
                    }
                }
            }
            let rank0 = "in the forward of step 3 (3 forward and 2 backward passes)";
            let rank1 = "between passes after step 2 (2 forward and 2 backward passes)";
            if rank == 0 {
                let text = failure.expect("rank 0's last forward did not fail");
                assert!(
                    text.contains(&step_error(0, "fully_shard", rank1, rank0)),
                    "{text}"
                );
            } else {
                assert_eq!(failure, None);
                let err = full_state_dict(&m).unwrap_err();
                let text = chain(&err);
                assert!(
                    text.contains(&step_error(1, "fully_shard", rank0, rank1)),
                    "{text}"
                );
            }
        },
    );
}
