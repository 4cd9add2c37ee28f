//! Context parallelism: a long sequence split across the ranks of a group, attention computed
//! over the whole of it (PyTorch's `torch.distributed.tensor.experimental.context_parallel`,
//! torchtitan's `cp` mesh dimension).
//!
//! | file | what it does | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `mod.rs` | [`AttentionOptions`], the errors ([`CpError`], [`CpProblem`]) | `torch/distributed/tensor/experimental/_context_parallel/_attention.py` (its options) |
//! | `layout.rs` | [`SeqLayout`]: which positions each rank holds, contiguous or head-tail, and the permutations | `_context_parallel/_load_balancer.py` (`_HeadTailLoadBalancer`) |
//! | `block.rs` | one block's attention with its log-sum-exp, its backward, the merge | the SDPA kernels `_templated_ring_attention` calls, and its merge |
//! | `ring.rs` | [`ring_attention`]: keys and values passed around the ranks, the backward replaying the ring | `_attention.py` (`_templated_ring_attention`, `_templated_ring_attention_backward`) |
//! | `ulysses.rs` | [`ulysses_attention`]: heads exchanged for sequence with two all-to-alls | DeepSpeed-Ulysses |
//! | `context.rs` | [`context_parallel`]: a step's buffers split in place and attention routed while a guard lives; [`context_parallel_unshard`] | `_attention.py` (`context_parallel`, `context_parallel_unshard`) |
//!
//! A model's blocks call [`crate::nn::scaled_dot_product_attention`]; inside a
//! [`context_parallel`] region it runs over the region's group. docs/design/context-parallelism.md
//! says how.

mod block;
pub(crate) mod context;
mod layout;
mod ring;
mod ulysses;

use tch::Kind;
use tch_dist_runtime::{AutogradError, DistError, Refusal};

use crate::OnRank;

pub use context::{
    context_parallel, context_parallel_unshard, ContextParallel, CpOptions, CpStrategy,
};
pub use layout::SeqLayout;
pub use ring::ring_attention;
pub use ulysses::ulysses_attention;

/// The attention to compute (PyTorch's `scaled_dot_product_attention` arguments) and how the
/// sequence is split.
///
/// ```
/// let opts = tch_dist::context_parallel::AttentionOptions { causal: true, ..Default::default() };
/// assert_eq!(opts.scale, None);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AttentionOptions {
    /// Causal masking by global position (`is_causal`).
    pub causal: bool,
    /// The softmax scale (`None`: 1 / sqrt(head dim)).
    pub scale: Option<f64>,
    /// Which positions each rank holds.
    pub layout: SeqLayout,
}

/// Why a context-parallel operation refused on this rank (every rank refuses alike: the
/// ranks pass the same shapes).
///
/// ```
/// use tch_dist::context_parallel::CpProblem;
/// let e = CpProblem::Heads { heads: 6, ranks: 4 }.on(2);
/// assert_eq!(
///     e.to_string(),
///     "rank 2: context parallelism: 6 heads cannot be split over 4 ranks (the all-to-all strategy gives each rank heads / ranks of them)"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CpProblem {
    /// `q`, `k` and `v` are not alike `[batch, heads, positions, head dim]`.
    #[error("context parallelism: q, k and v must be alike [batch, heads, positions, head dim], got {q:?}, {k:?} and {v:?}")]
    Shapes {
        /// The queries' shape.
        q: Vec<i64>,
        /// The keys'.
        k: Vec<i64>,
        /// The values'.
        v: Vec<i64>,
    },
    /// The heads do not divide by the ranks.
    #[error("context parallelism: {heads} heads cannot be split over {ranks} ranks (the all-to-all strategy gives each rank heads / ranks of them)")]
    Heads {
        /// The heads.
        heads: i64,
        /// The ranks of the group.
        ranks: i64,
    },
    /// `q`, `k` and `v` are not of one floating kind.
    #[error(
        "context parallelism: q, k and v must be of one floating kind, got {q:?}, {k:?} and {v:?}"
    )]
    Kind {
        /// The queries' kind.
        q: Kind,
        /// The keys'.
        k: Kind,
        /// The values'.
        v: Kind,
    },
    /// This rank holds no positions.
    #[error("context parallelism: this rank holds no positions of the sequence")]
    NoPositions,
    /// Head-tail chunks need an even number of local positions.
    #[error("context parallelism: the head-tail layout holds two equal chunks per rank, but this rank holds {positions} positions")]
    OddHeadTail {
        /// The local positions.
        positions: i64,
    },
    /// A region entered inside another on the same thread.
    #[error("context parallelism: context_parallel inside a context_parallel region: regions do not nest (the buffers' parts would be split again)")]
    Nested,
    /// A mask or dropout inside a context-parallel region.
    #[error("context parallelism: attention inside context_parallel takes no mask and no dropout (as PyTorch's ring)")]
    MaskOrDropout,
    /// `buffers` and `buffer_seq_dims` differ in length.
    #[error("context parallelism: {buffers} buffers but {dims} sequence dims")]
    BufferDims {
        /// The buffers.
        buffers: usize,
        /// The dims given.
        dims: usize,
    },
    /// A buffer's sequence dim is out of range.
    #[error("context parallelism: buffer {index} has {ndim} dims; its sequence dim {dim} is out of range")]
    BufferDim {
        /// The buffer's position in `buffers`.
        index: usize,
        /// Its dim.
        dim: i64,
        /// Its number of dims.
        ndim: i64,
    },
    /// A buffer that requires grad (a parameter, or a tensor of the graph).
    #[error("context parallelism: buffer {index} requires grad: parameters and activations are not buffers")]
    BufferRequiresGrad {
        /// The buffer's position.
        index: usize,
    },
    /// A buffer listed twice.
    #[error("context parallelism: buffer {index} is listed twice")]
    BufferTwice {
        /// Its second position.
        index: usize,
    },
    /// A buffer's sequence length does not split.
    #[error("context parallelism: buffer {index}'s sequence length {length} does not divide by {divisor} (the layout's chunks over the ranks)")]
    SeqLen {
        /// The buffer's position.
        index: usize,
        /// Its sequence length.
        length: i64,
        /// What it must divide by.
        divisor: i64,
    },
    /// A no-restore buffer that is not among the buffers.
    #[error("context parallelism: no-restore buffer {index} is not one of the buffers")]
    NoRestoreNotABuffer {
        /// Its position in `no_restore_buffers`.
        index: usize,
    },
    /// Another rank refused (its own error says why).
    #[error("context parallelism: rank {peer} refused its arguments")]
    PeerRefused {
        /// The lowest such rank.
        peer: usize,
    },
    /// The ranks passed other shapes or options.
    #[error("context parallelism: {setting} is {this} here but {other} on rank {other_rank}")]
    Disagree {
        /// The first setting that differs.
        setting: &'static str,
        /// This rank's value.
        this: i64,
        /// The lowest rank with another value.
        other_rank: usize,
        /// Its value.
        other: i64,
    },
    /// Attention outside every region while a buffer a region left split is still held.
    #[error("context parallelism: attention outside a context_parallel region while a buffer it left split (no_restore_buffers, now {shape:?}) is still held: a model run on it would attend within this rank's part only; run it inside the region, or put the buffer back (context_parallel_unshard) or drop it")]
    SplitOutsideRegion {
        /// The buffer's shape now.
        shape: Vec<i64>,
    },
    /// libtorch's attention kernel failed on a block.
    #[error("context parallelism: the attention kernel failed: {message}")]
    Kernel {
        /// libtorch's message.
        message: String,
    },
}

impl CpProblem {
    /// This problem on `rank`.
    ///
    /// ```
    /// let e = tch_dist::context_parallel::CpProblem::Heads { heads: 6, ranks: 4 }.on(1);
    /// assert_eq!(e.rank, 1);
    /// ```
    pub fn on(self, rank: usize) -> OnRank<CpProblem> {
        OnRank::new(rank, self)
    }
}

/// The errors of context parallelism: a refusal, or a failed exchange.
///
/// ```
/// use tch_dist::context_parallel::{CpError, CpProblem};
/// let e: CpError = CpProblem::Heads { heads: 6, ranks: 4 }.on(0).into();
/// assert!(e.to_string().starts_with("rank 0: context parallelism: 6 heads"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CpError {
    /// This rank's refusal.
    #[error(transparent)]
    OnRank(#[from] OnRank<CpProblem>),
    /// An exchange failed (the [`DistError`] names the rank and the operation; a peer's
    /// chunk of another length is refused there, on every rank).
    #[error(transparent)]
    Collective(#[from] DistError),
    /// The autograd engine failed the ring's function.
    #[error(transparent)]
    Engine(#[from] AutogradError),
    /// Attention outside a context-parallel region failed (libtorch's kernel).
    #[error(transparent)]
    Attention(#[from] tch::TchError),
}

impl CpError {
    /// The error of a check every rank made together (`ProcessGroup::agree_on_values`).
    pub(crate) fn refused(rank: usize, refusal: Refusal<CpProblem>) -> CpError {
        let problem = match refusal {
            Refusal::Own(problem) => problem,
            Refusal::Peer { rank: peer } => CpProblem::PeerRefused { peer },
            Refusal::Differs {
                setting,
                this,
                other_rank,
                other,
            } => CpProblem::Disagree {
                setting,
                this,
                other_rank,
                other,
            },
            Refusal::Exchange(source) => return CpError::Collective(*source),
        };
        problem.on(rank).into()
    }
}
