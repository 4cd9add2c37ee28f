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

use tch::Tensor;
use tch_dist_runtime::ProcessGroup;

use super::error::{PipelineError, PipelineProblem};

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
    let rank = group.rank();
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
            Some(Some(n)) => input_rows = n,
        }
    }
    if holds_last && own.is_none() {
        match target.map(rows) {
            None => own = Some(PipelineProblem::MissingTarget),
            Some(None) => own = Some(PipelineProblem::Scalar),
            Some(Some(n)) => target_rows = n,
        }
    }
    // Every rank's input and target rows (0 where it holds neither): one rank holds each.
    let every_rank = group
        .exchange_values(op, own, &[input_rows, target_rows])
        .map_err(|refusal| PipelineError::refused(rank, op, refusal))?;
    let sum = |i: usize| every_rank.iter().map(|values| values[i]).sum::<i64>();
    let refuse = |problem: PipelineProblem| problem.on(rank, op);
    let (batch, target) = (sum(0), sum(1));
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
    use tch::{Device, Kind};

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
