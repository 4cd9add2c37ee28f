//! [`context_parallel`]: a step's buffers split along their sequence dimension over a
//! context-parallel group, and the model's attention (called through
//! [`crate::nn::scaled_dot_product_attention`]) routed through ring or all-to-all attention
//! over that group, while the returned [`ContextParallel`] lives (PyTorch's
//! `context_parallel` context manager); [`context_parallel_unshard`] puts a split result
//! back together.

use std::cell::RefCell;
use std::marker::PhantomData;

use tch::Tensor;
use tch_dist_runtime::ProcessGroup;

use tch_dist_runtime::fsdp::{tensor_identity, tensor_use_count};

use super::{CpError, CpProblem, SeqLayout};

/// How attention runs over the split sequence.
///
/// ```
/// assert_eq!(tch_dist::context_parallel::CpStrategy::default(), tch_dist::context_parallel::CpStrategy::Ring);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CpStrategy {
    /// Keys and values passed around the ranks ([`ring_attention`](super::ring_attention)): any head count.
    #[default]
    Ring,
    /// Heads exchanged for the sequence ([`ulysses_attention`](super::ulysses_attention)): heads the ranks divide.
    AllToAll,
}

/// [`context_parallel`]'s options (PyTorch's `_cp_options` and `set_rotate_method`).
///
/// ```
/// use tch_dist::context_parallel::{CpOptions, SeqLayout};
/// assert_eq!(CpOptions::default().layout, SeqLayout::HeadTail); // PyTorch's load balancing
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpOptions {
    /// Ring or all-to-all.
    pub strategy: CpStrategy,
    /// How the buffers are split (PyTorch's `enable_load_balance`: head-tail).
    pub layout: SeqLayout,
}

impl Default for CpOptions {
    fn default() -> Self {
        CpOptions {
            strategy: CpStrategy::Ring,
            layout: SeqLayout::HeadTail,
        }
    }
}

/// The context this thread's attention runs in.
#[derive(Clone)]
pub(crate) struct Active {
    pub(crate) group: ProcessGroup,
    pub(crate) options: CpOptions,
}

/// A buffer a region left split (`no_restore_buffers`), on the rank `rank`.
struct LeftSplit {
    buffer: Tensor,
    dim: usize,
    part: i64,
    rank: usize,
}

thread_local! {
    /// The region this thread is in (regions do not nest: see [`context_parallel`]).
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
    /// The buffers the last region on this thread left split.
    static LEFT_SPLIT: RefCell<Vec<LeftSplit>> = const { RefCell::new(Vec::new()) };
}

/// The region this thread is in, if any.
pub(crate) fn active() -> Option<Active> {
    ACTIVE.with(|a| a.borrow().clone())
}

/// Outside every region: the refusal of attention while a buffer a region left split is
/// still held by its caller at its part's length (a model run on it would attend within this
/// rank's part only). Buffers dropped since, or put back, are forgotten.
pub(crate) fn check_no_split_buffer() -> Result<(), CpError> {
    LEFT_SPLIT.with(|left| {
        let mut left = left.borrow_mut();
        // Ours is one handle: a count of 1 means the caller dropped it.
        left.retain(|l| {
            tensor_use_count(&l.buffer) > 1 && l.buffer.size().get(l.dim) == Some(&l.part)
        });
        match left.first() {
            Some(l) => Err(CpProblem::SplitOutsideRegion {
                shape: l.buffer.size(),
            }
            .on(l.rank)
            .into()),
            None => Ok(()),
        }
    })
}

/// A live context-parallel region: its buffers hold this rank's part of their sequence, and
/// [`crate::nn::scaled_dot_product_attention`] runs over the group. Dropping it puts back
/// every buffer not listed in `no_restore_buffers` and ends the routing (on this thread; it
/// cannot move to another).
#[must_use = "the buffers are put back when this is dropped"]
pub struct ContextParallel {
    /// Each buffer to put back, and its whole tensor.
    restore: Vec<(Tensor, Tensor)>,
    /// The buffers left split, their sequence dims and part lengths.
    left: Vec<(Tensor, usize, i64)>,
    rank: usize,
    /// A context belongs to the thread whose attention it routes.
    _thread: PhantomData<*const ()>,
}

impl Drop for ContextParallel {
    fn drop(&mut self) {
        let _no_grad = tch::no_grad_guard();
        for (buffer, whole) in &mut self.restore {
            // Cannot fail: the buffer held this very tensor's storage before.
            let _ = buffer.f_set_source_tensor_(whole);
        }
        ACTIVE.with(|a| a.borrow_mut().take());
        let rank = self.rank;
        LEFT_SPLIT.with(|l| {
            l.borrow_mut()
                .extend(self.left.drain(..).map(|(buffer, dim, part)| LeftSplit {
                    buffer,
                    dim,
                    part,
                    rank,
                }))
        });
    }
}

/// Splits each of `buffers` along its `buffer_seq_dims` entry, in place (every holder of the
/// tensor sees this rank's part), as `options.layout` says, and routes attention through
/// `options.strategy` over `group` until the returned guard is dropped, which puts back every
/// buffer but those in `no_restore_buffers` (PyTorch's `context_parallel(mesh, buffers=...,
/// buffer_seq_dims=..., no_restore_buffers=...)`). Pass every tensor indexed by position
/// (token ids, labels, a RoPE table): they must be split alike.
///
/// Refused on every rank, nothing split, when a sequence length does not divide by the
/// layout's [`divisor`](SeqLayout::divisor), a dim is out of range, a buffer requires grad
/// (parameters are not buffers), a no-restore buffer is not among `buffers`, the ranks
/// pass other lengths or options, or this thread is already in a region (regions do not
/// nest: the buffers' parts would be split again).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tch_dist::context_parallel::{context_parallel, CpOptions};
/// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
/// let ids = tch::Tensor::arange(8, tch::kind::INT64_CPU).view([1, 8]);
/// {
///     let _cp = context_parallel(&pg, &[&ids], &[1], &[], CpOptions::default())?;
///     assert_eq!(ids.size(), [1, 4]); // rank 0: positions 0, 1, 6, 7
///     // model forward and backward here: its attention runs the ring
/// }
/// assert_eq!(ids.size(), [1, 8]);
/// # Ok(()) }
/// ```
pub fn context_parallel(
    group: &ProcessGroup,
    buffers: &[&Tensor],
    buffer_seq_dims: &[i64],
    no_restore_buffers: &[&Tensor],
    options: CpOptions,
) -> Result<ContextParallel, CpError> {
    let (rank, ranks) = (group.rank(), group.world_size());
    let divisor = options.layout.divisor(ranks);
    // A region inside a region would split its buffers' parts again: refused.
    let own = match active() {
        Some(_) => Some(CpProblem::Nested),
        None => check_buffers(buffers, buffer_seq_dims, no_restore_buffers, divisor),
    };
    let lengths: Vec<i64> = match &own {
        None => buffers
            .iter()
            .zip(buffer_seq_dims)
            .map(|(b, &d)| b.size()[d as usize])
            .collect(),
        Some(_) => Vec::new(),
    };
    let settings = [
        ("buffers", buffers.len() as i64),
        ("sequence lengths", fingerprint(&lengths)),
        ("strategy", options.strategy as i64),
        ("layout", options.layout.code()),
    ];
    group
        .agree_on_values("context_parallel", own, &settings)
        .map_err(|refusal| CpError::refused(rank, refusal))?;
    // A new region splits its buffers anew: what an earlier one left split is its caller's.
    LEFT_SPLIT.with(|l| l.borrow_mut().clear());
    let _no_grad = tch::no_grad_guard();
    let (mut restore, mut left) = (Vec::new(), Vec::new());
    for (buffer, &dim) in buffers.iter().zip(buffer_seq_dims) {
        let dim = dim as usize;
        let part = options.layout.shard(buffer, dim as i64, ranks, rank);
        let whole = buffer.detach();
        let mut handle = buffer.shallow_clone();
        let _same_handle = handle.f_set_source_tensor_(&part).map_err(|e| {
            CpError::from(
                CpProblem::Kernel {
                    message: e.to_string(),
                }
                .on(rank),
            )
        })?;
        if no_restore_buffers.iter().any(|n| same(n, buffer)) {
            let part = handle.size()[dim];
            left.push((handle, dim, part));
        } else {
            restore.push((handle, whole));
        }
    }
    ACTIVE.with(|a| {
        *a.borrow_mut() = Some(Active {
            group: group.clone(),
            options,
        })
    });
    Ok(ContextParallel {
        restore,
        left,
        rank,
        _thread: PhantomData,
    })
}

/// Whether `a` and `b` are one tensor (one `TensorImpl`).
fn same(a: &Tensor, b: &Tensor) -> bool {
    tensor_identity(a) == tensor_identity(b)
}

/// This rank's own problem with the buffers, if any.
fn check_buffers(
    buffers: &[&Tensor],
    dims: &[i64],
    no_restore: &[&Tensor],
    divisor: i64,
) -> Option<CpProblem> {
    if buffers.len() != dims.len() {
        return Some(CpProblem::BufferDims {
            buffers: buffers.len(),
            dims: dims.len(),
        });
    }
    for (index, (buffer, &dim)) in buffers.iter().zip(dims).enumerate() {
        let ndim = buffer.dim() as i64;
        if !(0..ndim).contains(&dim) {
            return Some(CpProblem::BufferDim { index, dim, ndim });
        }
        if buffer.requires_grad() {
            return Some(CpProblem::BufferRequiresGrad { index });
        }
        let length = buffer.size()[dim as usize];
        if length % divisor != 0 {
            return Some(CpProblem::SeqLen {
                index,
                length,
                divisor,
            });
        }
        if buffers[..index].iter().any(|b| same(b, buffer)) {
            return Some(CpProblem::BufferTwice { index });
        }
    }
    if let Some(index) = no_restore
        .iter()
        .position(|n| !buffers.iter().any(|b| same(b, n)))
    {
        return Some(CpProblem::NoRestoreNotABuffer { index });
    }
    None
}

/// FNV-1a over the lengths, for the ranks' agreement in one value.
fn fingerprint(values: &[i64]) -> i64 {
    use std::hash::Hasher;
    let mut h = tch_dist_runtime::Fingerprint::default();
    for v in values {
        h.write_i64(*v);
    }
    h.finish() as i64
}

/// Every rank's parts of `buffers` put back together along `seq_dims`, in the sequence's
/// order (PyTorch's `context_parallel_unshard`): each rank passes its part of the same
/// tensors (a model's outputs inside the context, for example), split as `layout` says.
/// Parts of other shapes on other ranks are refused on every rank.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tch_dist::context_parallel::{context_parallel_unshard, SeqLayout};
/// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
/// let part = tch::Tensor::ones([1, 4], tch::kind::FLOAT_CPU);
/// let whole = context_parallel_unshard(&pg, &[&part], &[1], SeqLayout::HeadTail)?;
/// assert_eq!(whole[0].size(), [1, 8]);
/// # Ok(()) }
/// ```
pub fn context_parallel_unshard(
    group: &ProcessGroup,
    buffers: &[&Tensor],
    seq_dims: &[i64],
    layout: SeqLayout,
) -> Result<Vec<Tensor>, CpError> {
    let (rank, ranks) = (group.rank(), group.world_size());
    if buffers.len() != seq_dims.len() {
        let problem = CpProblem::BufferDims {
            buffers: buffers.len(),
            dims: seq_dims.len(),
        };
        return Err(problem.on(rank).into());
    }
    let named: Vec<(String, &Tensor)> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| (format!("buffer {i}"), *b))
        .collect();
    let named: Vec<(&str, &Tensor)> = named.iter().map(|(n, b)| (n.as_str(), *b)).collect();
    group.verify_same_tensors("context_parallel_unshard", "parts", 0, &named)?;
    let mut wholes = Vec::with_capacity(buffers.len());
    for (index, (buffer, &dim)) in buffers.iter().zip(seq_dims).enumerate() {
        let ndim = buffer.dim() as i64;
        if !(0..ndim).contains(&dim) {
            // Every rank passes the same shapes (checked above): every rank refuses alike.
            return Err(CpProblem::BufferDim { index, dim, ndim }.on(rank).into());
        }
        let part = buffer.contiguous();
        let gathered: Vec<Tensor> = (0..ranks).map(|_| part.empty_like()).collect();
        group.all_gather(&gathered, &part)?;
        let chunks = Tensor::cat(&gathered, dim);
        let len = chunks.size()[dim as usize];
        let restore = layout.restore_order(len, ranks).to_device(part.device());
        wholes.push(chunks.index_select(dim, &restore));
    }
    Ok(wholes)
}
