//! Context parallelism: a long sequence split across the ranks of a group, attention computed
//! over the whole of it (PyTorch's `torch.distributed.tensor.experimental.context_parallel`,
//! torchtitan's `cp` mesh dimension).
//!
//! | file | what it does | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `mod.rs` | [`AttentionOptions`], the errors ([`CpError`], [`CpProblem`]) | `torch/distributed/tensor/experimental/_attention.py` (its options) |
//! | `ulysses.rs` | [`ulysses_attention`]: heads exchanged for sequence with two all-to-alls | DeepSpeed-Ulysses; torchtitan's all-to-all context parallelism |
//!
//! There so far: the all-to-all strategy (Ulysses), for heads that the ranks divide. Not
//! there yet: ring attention (keys and values passed around the ranks, partial results
//! merged by their log-sum-exp, with head-tail load balancing for causal attention),
//! `context_parallel(mesh, buffers, seq_dims)` splitting a step's buffers, and the `cp` mesh
//! dimension composed with FSDP and tensor parallelism (`train_lm --cp`).

mod ulysses;

use tch_dist_runtime::DistError;

use crate::OnRank;

pub use ulysses::ulysses_attention;

/// The attention to compute (PyTorch's `scaled_dot_product_attention` arguments).
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
}
