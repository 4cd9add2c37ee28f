//! The step check over tensor parallelism's collectives (issue 41, items 1, 3, 6 and 9): a
//! rank that skips a backward or a whole step, activation checkpointing on one rank only,
//! inputs of other shapes on one rank, each an error on every rank before any pass-sized
//! collective is sent (before: Ok with the replicated parameters diverged, a wrong input
//! gradient then SIGABRT, SIGABRT); a DETAIL mismatch inside a backward in words.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_dist::activation_checkpoint::{checkpoint_activations, CheckpointOptions};
use tch_dist::sharding::{functional, shard_module, ColwiseLinear, RowwiseLinear, ShardingPlan};
use tch_dist::testing::{run_ranks, run_ranks_with, Launch};
use tch_dist::{Backend, Call, ProcessGroup, ShallowClone, Shardable};

use super::{chain, step_error};

/// A Megatron MLP (column- then row-parallel) with a residual and a norm that no style
/// names, replicated on every rank.
#[derive(Debug, Shardable, ShallowClone)]
struct Block {
    fc1: nn::Linear,
    fc2: nn::Linear,
    norm: nn::LayerNorm,
}

impl Module for Block {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self.fc1.call(xs).gelu("none");
        (xs + self.fc2.call(&h)).apply(&self.norm)
    }
}

#[derive(Debug, Shardable)]
struct Net {
    block: Block,
    head: nn::Linear,
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.head.call(&self.block.call(xs))
    }
}

const D: i64 = 8;

/// The model, sharded over `pg` (values of rank 0).
fn tensor_parallel(vs: &nn::VarStore, pg: &ProcessGroup) -> Net {
    let p = vs.root();
    let mut m = Net {
        block: Block {
            fc1: nn::linear(&p / "block" / "fc1", D, 2 * D, Default::default()),
            fc2: nn::linear(&p / "block" / "fc2", 2 * D, D, Default::default()),
            norm: nn::layer_norm(&p / "block" / "norm", vec![D], Default::default()),
        },
        head: nn::linear(&p / "head", D, 3, Default::default()),
    };
    let plan = ShardingPlan::builder()
        .shard_module(Net::path().block().fc1(), ColwiseLinear::default())
        .shard_module(Net::path().block().fc2(), RowwiseLinear)
        .return_local_tensor(Net::path().block().fc1())
        .build();
    shard_module(&mut m, &plan, 0, pg).unwrap();
    m
}

/// The same batch on every rank (tensor parallelism computes one loss), `seq` tokens long.
fn batch(step: usize, seq: i64) -> Tensor {
    tch::manual_seed(70 + step as i64);
    Tensor::randn([2, seq, D], (Kind::Float, Device::Cpu))
}

#[test]
fn tensor_parallel_skipped_backward_fails_on_every_rank() {
    run_ranks(
        "tensor_parallel::tensor_parallel_skipped_backward_fails_on_every_rank",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let m = tensor_parallel(&vs, &pg);
            let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
            let rank = pg.rank();
            let mut failure = None;
            for step in 0..3 {
                let out = match m.f_call(&batch(step, 4)) {
                    Ok(out) => out,
                    Err(e) => {
                        failure = Some((step, "forward", chain(&e)));
                        break;
                    }
                };
                if rank == 1 && step == 1 {
                    continue; // rank 1 leaves out this step's backward
                }
                opt.zero_grad();
                if let Err(e) = out.sum(Kind::Float).f_backward() {
                    failure = Some((step, "backward", e.to_string()));
                    break;
                }
                opt.step();
            }
            // The backward communicates nothing here (the input needs no gradient), but it
            // counts: the next forward's check finds one backward pass fewer on rank 1.
            let (step, pass, text) = failure.expect("the skipped backward was not noticed");
            let rank0 = "in the forward of step 3 (3 forward and 2 backward passes)";
            let rank1 = "in the forward of step 3 (3 forward and 1 backward passes)";
            let (theirs, mine) = if rank == 0 {
                (rank1, rank0)
            } else {
                (rank0, rank1)
            };
            assert_eq!((step, pass), (2, "forward"), "{text}");
            assert!(
                text.contains(&step_error(rank, "tensor parallelism", theirs, mine)),
                "{text}"
            );
        },
    );
}

#[test]
fn tensor_parallel_skipped_step_fails_on_every_rank_with_set_step() {
    run_ranks(
        "tensor_parallel::tensor_parallel_skipped_step_fails_on_every_rank_with_set_step",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let m = tensor_parallel(&vs, &pg);
            let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
            let rank = pg.rank();
            let mut failure = None;
            for step in 0..3 {
                tch_dist::set_step(step as u64);
                if rank == 1 && step == 1 {
                    continue; // rank 1 leaves out this whole step
                }
                match m.f_call(&batch(step, 4)) {
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
                text.contains(&step_error(rank, "tensor parallelism", theirs, mine)),
                "{text}"
            );
        },
    );
}

/// The block checkpointed on rank 1 only: its first run records no backward collective,
/// and its backward recomputes the forward's all-reduce where rank 0 runs its backward's
/// (the same shape: the gradients were mixed, then Gloo aborted rank 1). Both fail at the
/// backward's check, naming the recorded counts; nothing is accumulated.
#[test]
fn checkpointing_on_one_rank_fails_on_every_rank() {
    run_ranks(
        "tensor_parallel::checkpointing_on_one_rank_fails_on_every_rank",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let m = tensor_parallel(&vs, &pg);
            let rank = pg.rank();
            if rank == 1 {
                checkpoint_activations(&m.block, CheckpointOptions::default()).unwrap();
            }
            let x = batch(0, 4).set_requires_grad(true);
            let out = m.f_call(&x).unwrap();
            let text = out.sum(Kind::Float).f_backward().unwrap_err().to_string();
            let (theirs, mine) = if rank == 0 { (0, 1) } else { (1, 0) };
            let expected = format!(
                "rank {rank}: tensor parallelism: rank {}'s forward recorded {theirs} \
                 tensor-parallel collectives for its backward while this rank's recorded \
                 {mine}, in the backward of step 1 (1 forward and 1 backward passes) \
                 (activation checkpointing, no_grad or another model on some ranks only: the \
                 backward passes would run different collectives)",
                1 - rank
            );
            assert!(text.contains(&expected), "{text}");
            assert!(!x.grad().defined(), "an input gradient was computed");
        },
    );
}

/// Rank 1's sequences are shorter: the forward's first all-reduce would have sent 96 values
/// against rank 0's 128 (Gloo aborted rank 1). Both fail at the forward's check, naming both
/// shapes.
#[test]
fn inputs_of_other_shapes_fail_on_every_rank() {
    run_ranks(
        "tensor_parallel::inputs_of_other_shapes_fail_on_every_rank",
        2,
        |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let m = tensor_parallel(&vs, &pg);
            let rank = pg.rank();
            let seq = if rank == 0 { 8 } else { 6 };
            let text = chain(&m.f_call(&batch(0, seq)).unwrap_err());
            let shape = |r: usize| if r == 0 { "[2, 8, 8]" } else { "[2, 6, 8]" };
            let expected = format!(
                "rank {rank}: tensor parallelism: rank {} starts this pass with all_reduce \
                 (tensor-parallel forward) of {} (Float) while this rank starts it with \
                 all_reduce (tensor-parallel forward) of {} (Float), in the forward of step 1 \
                 (1 forward and 0 backward passes) (the ranks' inputs differ: every rank of a \
                 tensor-parallel group must get inputs of the same shapes, and run the same \
                 layers)",
                1 - rank,
                shape(1 - rank),
                shape(rank)
            );
            assert!(text.contains(&expected), "{text}");
        },
    );
}

/// Under DETAIL, two collectives in one backward whose second differs in shape (the step
/// check compares a pass's first collective only): the error names the op and both ranks'
/// calls in words, as every other desync error does, not the engine's wire text.
#[test]
fn a_detail_mismatch_inside_a_backward_is_in_words() {
    let launch = Launch::new(
        "tensor_parallel::a_detail_mismatch_inside_a_backward_is_in_words",
        2,
    )
    .env("TCH_DIST_DEBUG", "DETAIL");
    run_ranks_with(&launch, Backend::Gloo, |pg| {
        let rank = pg.rank();
        let width = if rank == 0 { 4 } else { 3 };
        let b = Tensor::ones([2, width], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let a = Tensor::ones([2, 5], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        // Created second, so its backward runs first: the same shape everywhere.
        let yb = functional::copy_to_ranks(&b, &pg).unwrap();
        let ya = functional::copy_to_ranks(&a, &pg).unwrap();
        let loss = ya.sum(Kind::Float) + yb.sum(Kind::Float);
        let text = loss.f_backward().unwrap_err().to_string();
        assert!(!text.contains("tdr-desync"), "wire text: {text}");
        assert!(
            text.contains(&format!(
                "rank {rank}: all_reduce (tensor-parallel backward): the ranks called different \
                 collectives"
            )),
            "{text}"
        );
    });
}
