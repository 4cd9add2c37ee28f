//! [`ShardingError`]: everything that can be wrong with a sharding spec, a shard or a shape.

use super::metadata::{fmt_list, ShardMetadata};
use super::placement::{ParsePlacementError, Placement};

/// Why a sharding spec, a shard list or a global shape was refused.
///
/// Every message names the offending values (dims, shard indices, offsets, sizes, ranks), so
/// it can be shown to a user as is.
///
/// # Examples
///
/// ```
/// use tch_dist_core::sharding::{ChunkShardingSpec, ShardingError};
///
/// let spec = ChunkShardingSpec::new(3, vec!["rank:0/cpu".parse()?, "rank:1/cpu".parse()?]);
/// let err = spec.shards_metadata(&[4, 6]).unwrap_err();
/// assert!(matches!(err, ShardingError::DimOutOfRange { dim: 3, ndim: 2 }));
/// assert_eq!(
///     err.to_string(),
///     "dim 3 out of range for a tensor of 2 dims (expected a dim in -2..=1)"
/// );
/// # Ok::<(), ShardingError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShardingError {
    /// A placement string could not be parsed.
    #[error(transparent)]
    Placement(#[from] ParsePlacementError),

    /// A dtype name could not be parsed.
    #[error("unknown dtype `{name}` (expected a PyTorch dtype name such as `float32` or `torch.bfloat16`)")]
    UnknownDtype {
        /// The name as given.
        name: String,
    },

    /// The sharding dim is not a dim of the tensor (valid dims are `-ndim..ndim`).
    #[error("{}", dim_out_of_range(*.dim, *.ndim))]
    DimOutOfRange {
        /// The dim as given (possibly negative).
        dim: i64,
        /// The number of dims of the tensor.
        ndim: usize,
    },

    /// A global shape has a negative size.
    #[error("invalid tensor shape {}: sizes must be >= 0", fmt_list(.shape))]
    InvalidShape {
        /// The shape as given.
        shape: Vec<i64>,
    },

    /// A [`ChunkShardingSpec`](super::ChunkShardingSpec) without placements.
    #[error("a ChunkShardingSpec needs at least one placement")]
    NoPlacements,

    /// An [`EnumerableShardingSpec`](super::EnumerableShardingSpec) without shards.
    #[error("an EnumerableShardingSpec needs at least one shard")]
    NoShards,

    /// A shard's `shard_offsets` and `shard_sizes` differ in length, or hold a negative
    /// value.
    #[error("{}: {reason}", invalid_shard_subject(*.index, .shard_offsets, .shard_sizes))]
    InvalidShard {
        /// The shard's index in its list, when it is part of one.
        index: Option<usize>,
        /// Its offsets.
        shard_offsets: Vec<i64>,
        /// Its sizes.
        shard_sizes: Vec<i64>,
        /// What is wrong.
        reason: &'static str,
    },

    /// Two shards of one spec have a different number of dims.
    #[error("shards {first} and {second} differ in rank: {first_ndim} dims vs {second_ndim} dims")]
    InconsistentShardRank {
        /// Index of the first shard.
        first: usize,
        /// Its number of dims.
        first_ndim: usize,
        /// Index of the shard that differs from it.
        second: usize,
        /// Its number of dims.
        second_ndim: usize,
    },

    /// Two shards share at least one element.
    #[error("shards {first} and {second} overlap: {first_shard} and {second_shard}")]
    Overlap {
        /// Index of the first shard (the smaller index).
        first: usize,
        /// Index of the second shard.
        second: usize,
        /// The first shard.
        first_shard: Box<ShardMetadata>,
        /// The second shard.
        second_shard: Box<ShardMetadata>,
    },

    /// The shards have a different number of dims than the global shape.
    #[error("shards have {shards_ndim} dims but the tensor {} has {}", fmt_list(.shape), .shape.len())]
    ShapeRankMismatch {
        /// The global shape.
        shape: Vec<i64>,
        /// The shards' number of dims.
        shards_ndim: usize,
    },

    /// A shard reaches past the global shape.
    #[error(
        "shard {index} ({shard}) is out of bounds of {}: along dim {dim} it ends at {end}, past {}",
        fmt_list(.shape),
        .shape[*.dim]
    )]
    OutOfBounds {
        /// The shard's index.
        index: usize,
        /// The shard.
        shard: Box<ShardMetadata>,
        /// The global shape.
        shape: Vec<i64>,
        /// The first dim along which it is out of bounds.
        dim: usize,
        /// Where it ends along that dim (offset + size).
        end: i64,
    },

    /// The (non-overlapping, in-bounds) shards leave part of the global shape uncovered.
    #[error(
        "shards do not cover {}: they hold {covered} of {total} elements{}",
        fmt_list(.shape),
        gap_suffix(.gap)
    )]
    NotCovered {
        /// The global shape.
        shape: Vec<i64>,
        /// Elements held by the shards.
        covered: i128,
        /// Elements of the global shape.
        total: i128,
        /// One uncovered block as `(offsets, sizes)`, when it was cheap to find.
        gap: Option<(Vec<i64>, Vec<i64>)>,
    },

    /// A placement's rank is not below the world size.
    #[error("placement `{placement}`: rank {} is out of range for a world of {world_size} ranks", .placement.rank())]
    RankOutOfRange {
        /// The placement.
        placement: Placement,
        /// The world size it was checked against.
        world_size: usize,
    },

    /// A [`ChunkShardingSpec`](super::ChunkShardingSpec) places two chunks on one rank.
    #[error(
        "placements {first} and {second} both name rank {rank}: a ChunkShardingSpec holds at most one chunk per rank"
    )]
    DuplicateRank {
        /// The rank.
        rank: usize,
        /// Index of the first placement naming it.
        first: usize,
        /// Index of the second.
        second: usize,
    },

    /// [`local_shard_for_rank`](super::ShardingSpec::local_shard_for_rank) found several
    /// shards for one rank (an enumerable spec may hold several per rank; use
    /// [`shards_for_rank`](super::ShardingSpec::shards_for_rank)).
    #[error("rank {rank} holds {count} shards, expected at most one")]
    MultipleShardsForRank {
        /// The rank.
        rank: usize,
        /// How many shards it holds.
        count: usize,
    },
}

fn dim_out_of_range(dim: i64, ndim: usize) -> String {
    if ndim == 0 {
        format!("dim {dim} out of range for a tensor of 0 dims (a scalar has no dim to shard)")
    } else {
        format!(
            "dim {dim} out of range for a tensor of {ndim} dims (expected a dim in -{ndim}..={})",
            ndim - 1
        )
    }
}

fn invalid_shard_subject(index: Option<usize>, offsets: &[i64], sizes: &[i64]) -> String {
    let shard = ShardMetadata::describe(offsets, sizes, None);
    match index {
        Some(i) => format!("shard {i} ({shard})"),
        None => format!("shard ({shard})"),
    }
}

fn gap_suffix(gap: &Option<(Vec<i64>, Vec<i64>)>) -> String {
    match gap {
        Some((offsets, sizes)) => format!(
            "; not covered: {}",
            ShardMetadata::describe(offsets, sizes, None)
        ),
        None => String::new(),
    }
}
