//! [`ArgumentError`]: what is wrong with an argument (the `problem` of
//! [`DistError::InvalidArgument`](super::DistError::InvalidArgument)).

use tch::Device;

use super::mismatch::TensorSignature;

/// What is wrong with an argument (the `problem` of [`DistError::InvalidArgument`](crate::DistError::InvalidArgument)).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ArgumentError {
    /// A rank argument (`what`: "source rank", "peer rank", "src_rank", "dst", ...) is not in
    /// the group.
    #[error("{what} {rank} is not in a group of size {world_size}")]
    RankNotInGroup {
        /// Which argument.
        what: &'static str,
        /// Its value.
        rank: usize,
        /// The group's size.
        world_size: usize,
    },
    /// A point-to-point operation names this rank as its peer.
    #[error("a rank cannot send to or receive from itself")]
    SelfPeer,
    /// `new_group` got no ranks.
    #[error("the rank list is empty")]
    EmptyRankList,
    /// `new_group` got a rank twice.
    #[error("rank {rank} is listed twice")]
    DuplicateRank {
        /// The repeated rank.
        rank: usize,
    },
    /// A numeric option that must be positive is not.
    #[error("{option} must be positive, got {value}")]
    NotPositive {
        /// The option's name.
        option: &'static str,
        /// Its value.
        value: f64,
    },
    /// PowerSGD's rank is zero.
    #[error("PowerSGD: matrix_approximation_rank must be at least 1")]
    PowerSgdRank,
    /// PowerSGD with error feedback or warm start needs to start after the rebuild.
    #[error(
        "PowerSGD: expected start_powersgd_iter > 1 if use_error_feedback or warm_start is \
         enabled (got {start_powersgd_iter}), because PowerSGD can only be applied after the \
         buckets are rebuilt at the end of the first step"
    )]
    PowerSgdStartIter {
        /// The value given.
        start_powersgd_iter: u64,
    },
    /// PowerSGD's `min_compression_rate` is negative or not a number.
    #[error("PowerSGD: min_compression_rate must be a non-negative number, got {value}")]
    PowerSgdCompressionRate {
        /// The value given.
        value: f64,
    },
    /// A parameter handed to the reducer does not require grad.
    #[error("parameter `{fqn}` does not require grad")]
    NoGrad {
        /// The parameter.
        fqn: String,
    },
    /// The parameters handed to the reducer live on different devices.
    #[error(
        "parameter `{fqn}` is on {device:?} but `{first_fqn}` is on {first_device:?}; a \
         replicated module lives on one device"
    )]
    MixedDevices {
        /// The parameter on another device.
        fqn: String,
        /// Its device.
        device: Device,
        /// The first parameter.
        first_fqn: String,
        /// Its device.
        first_device: Device,
    },
    /// A sharding spec or metadata does not fit (see
    /// [`ShardingError`](tch_dist_core::sharding::ShardingError)).
    #[error(transparent)]
    Sharding(#[from] tch_dist_core::sharding::ShardingError),
    /// A placement names a rank outside the group.
    #[error("placement `{placement}` names rank {}, but the group has {world_size} ranks", placement.rank())]
    PlacementRank {
        /// The placement.
        placement: tch_dist_core::sharding::Placement,
        /// The group's size.
        world_size: usize,
    },
    /// A placement needs CUDA, which this process does not have.
    #[error("placement `{placement}` needs CUDA, which is not available")]
    PlacementNeedsCuda {
        /// The placement.
        placement: tch_dist_core::sharding::Placement,
    },
    /// The local shards handed over are not the ones the metadata places on this rank.
    #[error(
        "the global metadata places {expected} shard(s) on this rank, got {got} that do not \
         match it"
    )]
    LocalShards {
        /// How many the metadata places here.
        expected: usize,
        /// How many were given.
        got: usize,
    },
    /// A local shard's shape or dtype differs from its metadata.
    #[error("a local shard is {actual}, its metadata says {expected}")]
    LocalShardSignature {
        /// What the tensor is.
        actual: TensorSignature,
        /// What the metadata says.
        expected: TensorSignature,
    },
    /// `local_tensor()` needs exactly one local shard.
    #[error("local_tensor() needs exactly one local shard, this rank holds {held}")]
    LocalTensorCount {
        /// How many this rank holds.
        held: usize,
    },
    /// This rank should hold a shard and does not.
    #[error("this rank should hold the shard at offsets {offsets:?} but does not")]
    MissingShard {
        /// The shard's offsets.
        offsets: Vec<i64>,
    },
}
