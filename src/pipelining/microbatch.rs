//! Splitting a step's batch into microbatches, and the check that every rank of the pipeline
//! agrees the batch splits before any work (PyTorch's `microbatch.py`,
//! `split_args_kwargs_into_chunks` with the default `TensorChunkSpec(0)`).
//!
//! Only the first stage sees the input and only the last the target, so a batch that does
//! not split would otherwise fail on those ranks alone while the others wait for activations
//! until the group's timeout. One small all-reduce per step tells every rank the batch's
//! size and whether some rank lacks its input or target, so that every rank refuses the same
//! step with the same problem. PyTorch's `tensor_split` lets uneven microbatches through
//! (which changes each microbatch's weight in the mean); here they are refused.

use tch::{Device, Kind, Tensor};
use tch_dist_runtime::{ProcessGroup, ReduceOp};

use super::error::{PipelineError, PipelineProblem};

/// `values` summed over every rank of `group` (each rank fills its own slots, so the sum is
/// every rank's values): the pipeline's checks before any work, one small all-reduce.
pub(super) fn sum_over(
    group: &ProcessGroup,
    op: &'static str,
    values: &[i64],
) -> Result<Vec<i64>, PipelineError> {
    let rank = group.rank();
    let failed = |e| PipelineError::Check {
        rank,
        op,
        source: Box::new(e),
    };
    let t = Tensor::from_slice(values).to_device(Device::Cpu);
    group.all_reduce(&t, ReduceOp::Sum).map_err(failed)?;
    Vec::<i64>::try_from(&t.to_kind(Kind::Int64)).map_err(|_| {
        failed(tch_dist_runtime::DistError::Internal {
            rank,
            op,
            what: "the check's sums could not be read back",
        })
    })
}

/// What one rank found wrong with its own part of a step's inputs (a code per problem, so
/// that it travels in an integer tensor).
fn code(problem: &PipelineProblem) -> i64 {
    match problem {
        PipelineProblem::MissingInput => 1,
        PipelineProblem::MissingTarget => 2,
        PipelineProblem::GradDisabled => 4,
        _ => 3,
    }
}

/// Checks a step's inputs on every rank together: `input` on the rank holding stage 0,
/// `target` on the one holding the last stage. Returns the batch's size, or the same error on
/// every rank.
pub(crate) fn check_step(
    group: &ProcessGroup,
    op: &'static str,
    n_microbatches: usize,
    holds_first: bool,
    holds_last: bool,
    input: Option<&Tensor>,
    target: Option<&Tensor>,
) -> Result<i64, PipelineError> {
    let (rank, world) = (group.rank(), group.world_size());
    let rows = |t: &Tensor| t.size().first().copied();
    let mut own: Option<PipelineProblem> = None;
    let (mut input_rows, mut target_rows) = (0i64, 0i64);
    // A step's backward needs the forward's graph: under no_grad one rank would fail in its
    // backward while its peers waited for it, so it is refused here, before any work.
    if !tch_dist_runtime::grad_enabled() {
        own = Some(PipelineProblem::GradDisabled);
    }
    if holds_first && own.is_none() {
        match input.map(rows) {
            None => own = Some(PipelineProblem::MissingInput),
            Some(None) => own = Some(PipelineProblem::Scalar),
            Some(Some(n)) => input_rows = n + 1,
        }
    }
    if holds_last && own.is_none() {
        match target.map(rows) {
            None => own = Some(PipelineProblem::MissingTarget),
            Some(None) => own = Some(PipelineProblem::Scalar),
            Some(Some(n)) => target_rows = n + 1,
        }
    }
    // Each rank's problem code at its slot, then the input's and target's rows (+1, so that
    // 0 means "not this rank's"), summed: one contributor each.
    let mut values = vec![0i64; world + 2];
    values[rank] = own.as_ref().map_or(0, code);
    values[world] = input_rows;
    values[world + 1] = target_rows;
    let all = sum_over(group, op, &values)?;
    let refuse = |problem| PipelineError::Invalid { rank, op, problem };
    if let Some(problem) = own {
        return Err(refuse(problem));
    }
    if let Some(peer) = all[..world].iter().position(|&c| c != 0) {
        return Err(refuse(PipelineProblem::PeerRefused { peer }));
    }
    let (batch, target) = (all[world] - 1, all[world + 1] - 1);
    if batch <= 0 || batch % n_microbatches as i64 != 0 {
        return Err(refuse(PipelineProblem::BatchNotDivisible {
            batch: batch.max(0),
            n_microbatches,
        }));
    }
    if target != batch {
        return Err(refuse(PipelineProblem::TargetBatch {
            input: batch,
            target,
        }));
    }
    Ok(batch)
}

/// `x` as `n` equal microbatches along dim 0 (views; the caller checked that they are equal).
pub(crate) fn split(x: &Tensor, n: usize) -> Vec<Tensor> {
    x.chunk(n as i64, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_gives_equal_views_in_order() {
        let x = Tensor::arange(8, (Kind::Int64, Device::Cpu)).reshape([4, 2]);
        let parts = split(&x, 2);
        assert_eq!(parts.len(), 2);
        assert_eq!(
            Vec::<i64>::try_from(&parts[1].reshape([-1])).unwrap(),
            [4, 5, 6, 7]
        );
    }
}
