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
use std::sync::Arc;

use tch::Tensor;

use crate::autograd::{self, Callback, DescribeFailure, Reply};
use crate::c10d::group::ProcessGroup;
use crate::c10d::step_check::passes::{self, Api};
use crate::error::{CollectiveSignature, DistError, Result};
use crate::ffi::{self, ShimError};

#[derive(Clone, Copy)]
enum Mode {
    Reduce = ffi::TDR_PARALLEL_REDUCE as isize,
    Copy = ffi::TDR_PARALLEL_COPY as isize,
    Gather = ffi::TDR_PARALLEL_GATHER as isize,
    Split = ffi::TDR_PARALLEL_SPLIT as isize,
    ReduceScatter = ffi::TDR_PARALLEL_REDUCE_SCATTER as isize,
}

impl Mode {
    /// The collective its forward runs, if any (the step check's name for it).
    fn forward_collective(self) -> Option<&'static str> {
        match self {
            Mode::Reduce => Some("all_reduce (tensor-parallel forward)"),
            Mode::Gather => Some("all_gather (tensor-parallel forward)"),
            Mode::ReduceScatter => Some("reduce_scatter (tensor-parallel forward)"),
            Mode::Copy | Mode::Split => None,
        }
    }

    /// The collective its backward runs, if any.
    fn backward_collective(self) -> Option<&'static str> {
        match self {
            Mode::Copy => Some("all_reduce (tensor-parallel backward)"),
            Mode::Split | Mode::ReduceScatter => Some("all_gather (tensor-parallel backward)"),
            Mode::Reduce | Mode::Gather => None,
        }
    }
}

/// The whole tensor a collective of `mode` on `x` moves (the ranks compare it): `x` itself,
/// but for an all-gather, whose slices may differ, the gathered tensor.
fn whole_shape(x: &Tensor, mode: Mode, dim: i64, sizes: &[i64]) -> Vec<i64> {
    let mut shape = x.size();
    if let Mode::Gather = mode {
        let ndim = shape.len() as i64;
        if (-ndim..ndim).contains(&dim) {
            shape[dim.rem_euclid(ndim) as usize] = sizes.iter().sum();
        }
    }
    shape
}

/// What a backward node of ours needs from Rust: the group, its collective's name and
/// signature, for the step check before it and the text of its failure.
struct BackwardCollective {
    group: ProcessGroup,
    signature: Option<CollectiveSignature>,
}

impl Callback for BackwardCollective {
    type Context = BackwardCollective;
    const PANIC: &'static str = "tensor parallelism: internal panic before a backward collective";

    /// The backward reached the node: its collective is checked (the first of the pass over
    /// the group), or, without one, the pass is counted for the group.
    fn run(ctx: &BackwardCollective, _index: usize, _grad: Option<Tensor>) -> Reply {
        match &ctx.signature {
            Some(signature) => {
                passes::before_collective(&ctx.group, Api::TensorParallel, Some(signature.clone()))
            }
            None => passes::note_pass(&ctx.group, Api::TensorParallel),
        }
        .map_err(|e| e.to_string())
    }
}

impl DescribeFailure for BackwardCollective {
    fn describe(ctx: &BackwardCollective, failure: ShimError) -> String {
        let op = ctx
            .signature
            .as_ref()
            .map_or("tensor-parallel backward", |s| s.op);
        ctx.group.op_context(op).failure(failure).to_string()
    }
}

fn run(
    group: &ProcessGroup,
    op: &'static str,
    x: &Tensor,
    mode: Mode,
    dim: i64,
    sizes: &[i64],
) -> Result<Tensor> {
    if !x.defined() {
        return Err(DistError::Collective {
            rank: group.rank(),
            op,
            cause: "the input tensor is undefined".into(),
        });
    }
    let whole = whole_shape(x, mode, dim, sizes);
    let signature = |op| CollectiveSignature::new(op, whole.clone(), x.kind());
    match mode.forward_collective() {
        Some(forward) => {
            passes::before_collective(group, Api::TensorParallel, Some(signature(forward)))?
        }
        None => passes::note_pass(group, Api::TensorParallel)?,
    }
    let backward = Arc::new(BackwardCollective {
        group: group.clone(),
        signature: mode.backward_collective().map(signature),
    });
    let mut out = std::ptr::null_mut();
    // SAFETY: a live group and tensor; `sizes` outlives the call; the shim catches every C++
    // exception and hands back a new tensor that we own; it releases the shared context once
    // (with the backward node, or at once), and calls the callbacks only while it lives.
    ffi::check(unsafe {
        ffi::tdr_parallel_op(
            group.raw(),
            x.as_ptr() as *mut _,
            mode as c_int,
            dim,
            sizes.as_ptr(),
            sizes.len(),
            autograd::trampoline::<BackwardCollective>,
            autograd::describe_trampoline::<BackwardCollective>,
            autograd::share(&backward),
            autograd::release::<BackwardCollective>,
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
    let out = unsafe { Tensor::from_ptr(out) };
    // A node whose backward communicates: the next backward's step check counts it.
    if out.requires_grad() && mode.backward_collective().is_some() {
        passes::note_recorded(group);
    }
    Ok(out)
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
