//! [`SharderError`]: why a [`Sharder`](crate::sharding::Sharder) refuses a module.

use std::sync::Arc;

use tch_dist_core::sharding::Placement;

use super::plan::Placements;

/// Why a [`Sharder`](crate::sharding::Sharder) refuses a module: the built-in linear
/// sharders' reasons, and [`Custom`](SharderError::Custom) for third-party sharders.
///
/// ```
/// use tch_dist::sharding::SharderError;
/// #[derive(Debug, thiserror::Error)]
/// #[error("an embedding needs {0} rows per rank")]
/// struct TooFewRows(usize);
/// let e = SharderError::custom(TooFewRows(2));
/// assert_eq!(e.to_string(), "an embedding needs 2 rows per rank");
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum SharderError {
    /// A linear sharder got a module with a submodule.
    #[error(
        "a linear sharder needs a linear layer (`weight` and optional `bias`), but this \
         `{kind}` has a submodule `{child}`"
    )]
    Submodule {
        /// The module's type name.
        kind: &'static str,
        /// The submodule's FQN within it.
        child: String,
    },
    /// A linear sharder got a module with a parameter other than `weight` and `bias`.
    #[error(
        "a linear sharder needs a linear layer (`weight` and optional `bias`), but this \
         `{kind}` has a parameter `{name}`"
    )]
    ExtraParameter {
        /// The module's type name.
        kind: &'static str,
        /// The parameter.
        name: String,
    },
    /// A linear sharder got a module without `weight`.
    #[error("this `{kind}` has no `weight` parameter")]
    NoWeight {
        /// The module's type name.
        kind: &'static str,
    },
    /// `weight` is not a matrix.
    #[error(
        "`weight` has shape {shape:?}; a linear layer's weight is [out_features, in_features]"
    )]
    WeightShape {
        /// Its shape.
        shape: Vec<i64>,
    },
    /// `bias` does not match `weight`'s output features.
    #[error(
        "`bias` has shape {shape:?}; expected [{}] for a weight of shape {weight:?}",
        weight.first().copied().unwrap_or(0)
    )]
    BiasShape {
        /// The bias's shape.
        shape: Vec<i64>,
        /// The weight's shape.
        weight: Vec<i64>,
    },
    /// A linear layer's spec does not put chunk `i` on rank `i` of the group.
    #[error(
        "placements [{}] do not match the group of {world_size} ranks: a linear layer is split \
         into one chunk per rank, chunk i on rank i",
        Placements(placements)
    )]
    Placements {
        /// The spec's placements.
        placements: Vec<Placement>,
        /// The group's size.
        world_size: usize,
    },
    /// An embedding sharder got a module that is not an embedding table (one `weight`
    /// `[num_embeddings, embedding_dim]`, no submodule).
    #[error(
        "an embedding sharder needs an embedding table (one `weight` [num_embeddings, \
         embedding_dim]), but this `{kind}` has {found}"
    )]
    NotAnEmbedding {
        /// The module's type name.
        kind: &'static str,
        /// What it has instead (`a parameter `bias``).
        found: String,
    },
    /// SequenceParallel got a module that is not a norm over each token's features.
    #[error(
        "SequenceParallel needs a norm over each token's features (no submodules or buffers, \
         one-dimensional parameters: LayerNorm, an RMSNorm), but this `{kind}` {found}"
    )]
    NotANorm {
        /// The module's type name.
        kind: &'static str,
        /// What it is or has instead (`has a parameter `weight` of shape [4, 8]`).
        found: String,
    },
    /// `ExpertParallel` on a module that is not grouped experts.
    #[error(
        "ExpertParallel needs grouped experts (3-D `w1` and `w3` [experts, hidden, dim] and \
         `w2` [experts, dim, hidden], nothing else), but this `{kind}` has {found}"
    )]
    NotGroupedExperts {
        /// The module's type.
        kind: &'static str,
        /// What it has instead.
        found: String,
    },
    /// `ExpertParallel` over ranks that do not divide the experts.
    #[error(
        "{experts} experts cannot be split evenly over the {ranks} ranks of expert parallelism"
    )]
    ExpertsNotDivisible {
        /// The experts.
        experts: i64,
        /// The expert-parallel ranks.
        ranks: usize,
    },
    /// `ExpertTensorParallel` over tensor-parallel ranks that do not divide each expert's
    /// hidden width.
    #[error(
        "the experts' hidden width {hidden} cannot be split evenly over the {ranks} ranks of \
         tensor parallelism"
    )]
    ExpertWidthNotDivisible {
        /// Each expert's hidden width.
        hidden: i64,
        /// The tensor-parallel ranks.
        ranks: usize,
    },
    /// `ColwiseLinear { fused: 0 }`.
    #[error("fused must be at least 1")]
    ZeroFused,
    /// A fused layer's output features do not split into its parts.
    #[error("`weight` has {out_features} output features, not divisible into fused={fused} parts")]
    NotDivisible {
        /// The weight's output features.
        out_features: i64,
        /// The number of parts.
        fused: usize,
    },
    /// A third-party sharder's own reason.
    #[error(transparent)]
    Custom(Arc<dyn std::error::Error + Send + Sync>),
}

impl SharderError {
    /// A third-party sharder's reason, kept whole ([`Custom`](SharderError::Custom)).
    pub fn custom(error: impl std::error::Error + Send + Sync + 'static) -> SharderError {
        SharderError::Custom(Arc::new(error))
    }
}
