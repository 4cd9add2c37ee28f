//! Differentiable collectives for tensor parallelism (Megatron-LM's conjugate pairs).
//!
//! Tensor-parallel code computes the same loss on every rank from replicated activations,
//! so the gradient of a replicated tensor is replicated too. Each function here is a
//! collective in forward and its conjugate in backward under that convention:
//!
//! | function           | forward                          | backward             |
//! |--------------------|----------------------------------|----------------------|
//! | [`all_reduce`]     | sum of the ranks' partial results | identity            |
//! | [`copy_to_ranks`]  | identity                         | sum over ranks       |
//! | [`all_gather`]     | concatenation of the ranks' slices | own slice          |
//! | [`split`]          | own slice                        | concatenation        |
//! | [`reduce_scatter`] | own slice of the sum             | concatenation        |
//!
//! Slices follow `sizes` (one entry per rank, uneven and empty slices allowed, as
//! `torch.chunk` produces). Every rank must call the same functions in the same order, in
//! forward and therefore in backward. The backward pass holds on to the group, so a graph
//! may outlive the [`ProcessGroup`] handle it was built with. Second derivatives through
//! these functions are not supported.

use std::ffi::c_int;

use tch::Tensor;

use crate::error::{DistError, Result};
use crate::ffi;
use crate::process_group::ProcessGroup;

#[derive(Clone, Copy)]
enum Mode {
    Reduce = ffi::TDR_PARALLEL_REDUCE as isize,
    Copy = ffi::TDR_PARALLEL_COPY as isize,
    Gather = ffi::TDR_PARALLEL_GATHER as isize,
    Split = ffi::TDR_PARALLEL_SPLIT as isize,
    ReduceScatter = ffi::TDR_PARALLEL_REDUCE_SCATTER as isize,
}

fn run(
    group: &ProcessGroup,
    op: &'static str,
    x: &Tensor,
    mode: Mode,
    dim: i64,
    sizes: &[i64],
) -> Result<Tensor> {
    let mut out = std::ptr::null_mut();
    // SAFETY: a live group and tensor; `sizes` outlives the call; the shim catches every C++
    // exception and hands back a new tensor that we own.
    ffi::check(unsafe {
        ffi::tdr_parallel_op(
            group.raw(),
            x.as_ptr() as *mut _,
            mode as c_int,
            dim,
            sizes.as_ptr(),
            sizes.len(),
            &mut out,
        )
    })
    .map_err(|e| group.op_context(op).failure(e))?;
    if out.is_null() {
        return Err(DistError::Internal {
            rank: group.rank(),
            op,
            what: "the engine returned no tensor",
        });
    }
    // SAFETY: `out` is a fresh `new at::Tensor` from the shim, owned by the returned Tensor.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Sums partial results over the ranks; backward passes the gradient through unchanged.
/// (Megatron's `reduce_from_tensor_model_parallel_region`; the output of a row-parallel
/// linear layer.)
///
/// ```no_run
/// # let pg = tch_dist_runtime::default_group()?;
/// use tch_dist_runtime::sharding::functional;
/// let partial = tch::Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu));
/// let total = functional::all_reduce(&partial, &pg)?; // world_size everywhere
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn all_reduce(x: &Tensor, group: &ProcessGroup) -> Result<Tensor> {
    run(
        group,
        "all_reduce (differentiable)",
        x,
        Mode::Reduce,
        0,
        &[],
    )
}

/// Identity in forward; backward sums the gradient over the ranks. (Megatron's
/// `copy_to_tensor_model_parallel_region`; the input of a column-parallel linear layer.)
///
/// ```no_run
/// # let pg = tch_dist_runtime::default_group()?;
/// # let x = tch::Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu));
/// let x = tch_dist_runtime::sharding::functional::copy_to_ranks(&x, &pg)?;
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn copy_to_ranks(x: &Tensor, group: &ProcessGroup) -> Result<Tensor> {
    run(
        group,
        "copy_to_ranks (differentiable)",
        x,
        Mode::Copy,
        0,
        &[],
    )
}

/// Concatenates every rank's slice along `dim` (rank `r`'s has `sizes[r]` entries);
/// backward keeps this rank's slice of the gradient.
///
/// ```no_run
/// # let pg = tch_dist_runtime::default_group()?;
/// // Two ranks holding 2 and 1 columns of a [4, 3] activation.
/// let cols = if pg.rank() == 0 { 2 } else { 1 };
/// let local = tch::Tensor::ones([4, cols], (tch::Kind::Float, tch::Device::Cpu));
/// let full = tch_dist_runtime::sharding::functional::all_gather(&local, 1, &[2, 1], &pg)?;
/// assert_eq!(full.size(), [4, 3]);
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn all_gather(x: &Tensor, dim: i64, sizes: &[i64], group: &ProcessGroup) -> Result<Tensor> {
    run(
        group,
        "all_gather (differentiable)",
        x,
        Mode::Gather,
        dim,
        sizes,
    )
}

/// This rank's slice along `dim` of a replicated tensor; backward concatenates the ranks'
/// gradients.
///
/// ```no_run
/// # let pg = tch_dist_runtime::default_group()?;
/// let x = tch::Tensor::ones([4, 3], (tch::Kind::Float, tch::Device::Cpu));
/// let mine = tch_dist_runtime::sharding::functional::split(&x, 1, &[2, 1], &pg)?;
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn split(x: &Tensor, dim: i64, sizes: &[i64], group: &ProcessGroup) -> Result<Tensor> {
    run(group, "split (differentiable)", x, Mode::Split, dim, sizes)
}

/// This rank's slice along `dim` of the sum of every rank's `x`; backward concatenates the
/// ranks' gradients.
///
/// ```no_run
/// # let pg = tch_dist_runtime::default_group()?;
/// let partial = tch::Tensor::ones([4, 3], (tch::Kind::Float, tch::Device::Cpu));
/// let rows = tch_dist_runtime::sharding::functional::reduce_scatter(&partial, 0, &[2, 2], &pg)?;
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn reduce_scatter(x: &Tensor, dim: i64, sizes: &[i64], group: &ProcessGroup) -> Result<Tensor> {
    run(
        group,
        "reduce_scatter (differentiable)",
        x,
        Mode::ReduceScatter,
        dim,
        sizes,
    )
}
