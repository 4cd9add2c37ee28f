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
//! | [`all_to_all_single`] | rows exchanged by split sizes | the reverse exchange |
//! | [`all_to_all_single_known`] | the same, the peers' splits known | the reverse exchange |
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
    AllToAll = ffi::TDR_PARALLEL_ALL_TO_ALL as isize,
}

impl Mode {
    /// The collective its forward runs, if any (the step check's name for it).
    fn forward_collective(self) -> Option<&'static str> {
        match self {
            Mode::Reduce => Some("all_reduce (tensor-parallel forward)"),
            Mode::Gather => Some("all_gather (tensor-parallel forward)"),
            Mode::ReduceScatter => Some("reduce_scatter (tensor-parallel forward)"),
            Mode::AllToAll => Some("all_to_all (differentiable forward)"),
            Mode::Copy | Mode::Split => None,
        }
    }

    /// The collective its backward runs, if any.
    fn backward_collective(self) -> Option<&'static str> {
        match self {
            Mode::Copy => Some("all_reduce (tensor-parallel backward)"),
            Mode::Split | Mode::ReduceScatter => Some("all_gather (tensor-parallel backward)"),
            Mode::AllToAll => Some("all_to_all (differentiable backward)"),
            Mode::Reduce | Mode::Gather => None,
        }
    }
}

/// The whole tensor a collective of `mode` on `x` moves (the ranks compare it): `x` itself,
/// but for an all-gather, whose slices may differ, the gathered tensor, and for an
/// all-to-all, whose row counts differ by design, its rows as -1.
fn whole_shape(x: &Tensor, mode: Mode, dim: i64, sizes: &[i64]) -> Vec<i64> {
    let mut shape = x.size();
    match mode {
        Mode::Gather => {
            let ndim = shape.len() as i64;
            if (-ndim..ndim).contains(&dim) {
                shape[dim.rem_euclid(ndim) as usize] = sizes.iter().sum();
            }
        }
        Mode::AllToAll => {
            if let Some(rows) = shape.first_mut() {
                *rows = -1;
            }
        }
        Mode::Reduce | Mode::Copy | Mode::Split | Mode::ReduceScatter => {}
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

/// What a rank tells each other rank before an all-to-all's rows: how many rows it sends
/// that rank, the width of a row, and whether it refused its own arguments.
const EXCHANGE_HEADER: usize = 3;

/// Exchanges rows with every rank (`all_to_all_single` with split sizes, differentiable):
/// this rank sends its first `input_splits[0]` rows to rank 0, the next `input_splits[1]`
/// to rank 1, and so on, and receives every rank's rows for it, in rank order. Returns them
/// with the row count from each rank (PyTorch's `output_split_sizes`), which the ranks
/// exchange first, so that no rank has to know them. Backward sends each row's gradient
/// back where the row came from (the splits swapped).
///
/// Every rank calls it, in the same order; splits that are not one per rank, negative or do
/// not add up to this rank's rows, or rows of another width than a peer's, are an error on
/// every rank before any row moves (empty splits are fine). Mixture-of-experts dispatch and
/// combine, and Ulysses-style context parallelism, are made of it.
///
/// ```no_run
/// # let pg = tch_dist_runtime::default_group()?;
/// use tch_dist_runtime::sharding::functional;
/// // 2 ranks: rank 0 keeps 1 row and sends 2 to rank 1; rank 1 sends 1 row to each.
/// let splits: &[i64] = if pg.rank() == 0 { &[1, 2] } else { &[1, 1] };
/// let rows = splits.iter().sum::<i64>();
/// let x = tch::Tensor::ones([rows, 4], (tch::Kind::Float, tch::Device::Cpu));
/// let (received, from_each) = functional::all_to_all_single(&x, splits, &pg)?;
/// assert_eq!(from_each, if pg.rank() == 0 { vec![1, 1] } else { vec![2, 1] });
/// assert_eq!(received.size()[0], from_each.iter().sum::<i64>());
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn all_to_all_single(
    x: &Tensor,
    input_splits: &[i64],
    group: &ProcessGroup,
) -> Result<(Tensor, Vec<i64>)> {
    const OP: &str = "all_to_all_single (differentiable)";
    let (rank, world) = (group.rank(), group.world_size());
    let problem = input_problem(x, input_splits, world);
    let width = if problem.is_none() {
        x.size()[1..].iter().product::<i64>()
    } else {
        0
    };
    let header: Vec<i64> = (0..world)
        .flat_map(|j| {
            let rows = if problem.is_none() {
                input_splits[j]
            } else {
                0
            };
            [rows, width, i64::from(problem.is_some())]
        })
        .collect();
    let device = if x.defined() {
        x.device()
    } else {
        tch::Device::Cpu
    };
    let sent = Tensor::from_slice(&header).to_device(device);
    let got = sent.zeros_like();
    group.all_to_all_single(&got, &sent)?;
    let got: Vec<i64> = (0..(EXCHANGE_HEADER * world) as i64)
        .map(|i| got.int64_value(&[i]))
        .collect();
    let refusal = |cause: String| DistError::Collective {
        rank,
        op: OP,
        cause,
    };
    if let Some(cause) = problem {
        return Err(refusal(cause));
    }
    let from = |i: usize, field: usize| got[EXCHANGE_HEADER * i + field];
    let refused: Vec<usize> = (0..world).filter(|&i| from(i, 2) != 0).collect();
    if !refused.is_empty() {
        return Err(refusal(format!(
            "ranks {refused:?} refused their arguments"
        )));
    }
    if let Some(i) = (0..world).find(|&i| from(i, 1) != width) {
        return Err(refusal(format!(
            "rows of {width} elements here and of {} on rank {i}",
            from(i, 1)
        )));
    }
    let output_splits: Vec<i64> = (0..world).map(|i| from(i, 0)).collect();
    let sizes: Vec<i64> = input_splits.iter().chain(&output_splits).copied().collect();
    let received = run(group, OP, x, Mode::AllToAll, 0, &sizes)?;
    Ok((received, output_splits))
}

/// [`all_to_all_single`] when this rank already knows what each peer sends it
/// (`output_splits`, from an exchange the ranks made before: a mixture of experts' counts):
/// the rows move at once, without the header exchange that learns the splits and checks the
/// row widths. This rank's own arguments are checked (splits for every rank, adding up to
/// its rows); the caller vouches that its peers send what `output_splits` says, with rows of
/// this rank's width. Differentiable as [`all_to_all_single`].
///
/// ```no_run
/// # let pg = tch_dist_runtime::default_group()?;
/// use tch_dist_runtime::sharding::functional;
/// // 2 ranks that told each other before: 1 row to every rank from every rank.
/// let x = tch::Tensor::ones([2, 4], (tch::Kind::Float, tch::Device::Cpu));
/// let received = functional::all_to_all_single_known(&x, &[1, 1], &[1, 1], &pg)?;
/// assert_eq!(received.size(), [2, 4]);
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn all_to_all_single_known(
    x: &Tensor,
    input_splits: &[i64],
    output_splits: &[i64],
    group: &ProcessGroup,
) -> Result<Tensor> {
    const OP: &str = "all_to_all_single (differentiable, known splits)";
    let world = group.world_size();
    let problem = input_problem(x, input_splits, world).or_else(|| {
        if output_splits.len() != world {
            Some(format!(
                "{} output splits for {world} ranks",
                output_splits.len()
            ))
        } else if output_splits.iter().any(|&s| s < 0) {
            Some(format!("negative output splits {output_splits:?}"))
        } else {
            None
        }
    });
    if let Some(cause) = problem {
        return Err(DistError::Collective {
            rank: group.rank(),
            op: OP,
            cause,
        });
    }
    let sizes: Vec<i64> = input_splits.iter().chain(output_splits).copied().collect();
    run(group, OP, x, Mode::AllToAll, 0, &sizes)
}

/// What is wrong with this rank's own arguments of an all-to-all, if anything: `x` must have
/// rows, and `input_splits` one count per rank, none negative, adding up to them.
fn input_problem(x: &Tensor, input_splits: &[i64], world: usize) -> Option<String> {
    if !x.defined() {
        Some("the input tensor is undefined".to_string())
    } else if x.dim() == 0 {
        Some("a scalar has no rows to exchange".to_string())
    } else if input_splits.len() != world {
        Some(format!(
            "{} input splits for {world} ranks",
            input_splits.len()
        ))
    } else if input_splits.iter().any(|&s| s < 0) {
        Some(format!("negative input splits {input_splits:?}"))
    } else if input_splits.iter().sum::<i64>() != x.size()[0] {
        Some(format!(
            "input splits {input_splits:?} add up to {} rows; the input has {}",
            input_splits.iter().sum::<i64>(),
            x.size()[0]
        ))
    } else {
        None
    }
}
