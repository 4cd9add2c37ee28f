//! [`ChunkShardingSpec`] and [`EnumerableShardingSpec`].

use serde::{Deserialize, Serialize};

use super::chunk::{chunk_bounds, normalize_dim};
use super::error::ShardingError;
use super::metadata::{check_cover, check_shape, validate_shards, ShardMetadata};
use super::placement::Placement;

/// Splits a tensor along one dim into `placements.len()` chunks, as `torch.chunk` does
/// (PyTorch's `ChunkShardingSpec`).
///
/// With `n` placements and `len` rows along `dim`, every chunk has
/// `split = ceil(len / n)` rows except the last non-empty one, which has what is left;
/// chunk `i` goes to `placements[i]`. When there are more placements than chunks of data
/// (more ranks than rows), the placements past the data get *empty* shards: size 0 along
/// `dim`.
///
/// A negative `dim` counts from the end (`-1` is the last dim).
///
/// Offsets differ from PyTorch in one case: PyTorch's `build_metadata` gives chunk `i` the
/// offset `split * i` even when that lies past the end (2 rows over 4 ranks: offsets
/// `[0, 1, 2, 3]`), which `torch.narrow` refuses; here the offset is clamped to `len`
/// (`[0, 1, 2, 2]`), so every shard lies inside the tensor and the shards pass the same
/// checks as an enumerable spec. Sizes are PyTorch's. (The arithmetic is
/// [`chunk`](super::chunk)'s.)
///
/// # Examples
///
/// ```
/// use tch_dist_core::sharding::{ChunkShardingSpec, Placement};
///
/// let placements: Vec<Placement> = (0..4).map(|r| format!("rank:{r}/cpu").parse()).collect::<Result<_, _>>()?;
/// let spec = ChunkShardingSpec::new(0, placements);
///
/// // 10 rows over 4 ranks: chunks of 3, the last one short.
/// let shards = spec.shards_metadata(&[10, 5])?;
/// let sizes: Vec<i64> = shards.iter().map(|s| s.shard_sizes[0]).collect();
/// let offsets: Vec<i64> = shards.iter().map(|s| s.shard_offsets[0]).collect();
/// assert_eq!((sizes, offsets), (vec![3, 3, 3, 1], vec![0, 3, 6, 9]));
/// assert_eq!(shards[3].shard_sizes, vec![1, 5]);
///
/// // 2 rows over 4 ranks: ranks 2 and 3 get empty shards.
/// let shards = spec.shards_metadata(&[2, 5])?;
/// let sizes: Vec<i64> = shards.iter().map(|s| s.shard_sizes[0]).collect();
/// let offsets: Vec<i64> = shards.iter().map(|s| s.shard_offsets[0]).collect();
/// assert_eq!((sizes, offsets), (vec![1, 1, 0, 0], vec![0, 1, 2, 2]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkShardingSpec {
    /// The dim to split; negative counts from the end.
    pub dim: i64,
    /// One placement per chunk, in chunk order.
    pub placements: Vec<Placement>,
}

impl ChunkShardingSpec {
    /// A spec splitting `dim` over `placements`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::ChunkShardingSpec;
    ///
    /// let spec = ChunkShardingSpec::new(-1, vec!["rank:0/cuda:0".parse()?, "rank:1/cuda:1".parse()?]);
    /// assert_eq!(spec.placements.len(), 2);
    /// # Ok::<(), tch_dist_core::sharding::ParsePlacementError>(())
    /// ```
    pub fn new(dim: i64, placements: Vec<Placement>) -> Self {
        ChunkShardingSpec { dim, placements }
    }

    /// The dim as an index into a shape of `ndim` dims (a negative dim counts from the end).
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{ChunkShardingSpec, ShardingError};
    ///
    /// let spec = ChunkShardingSpec::new(-1, vec!["rank:0/cpu".parse()?]);
    /// assert_eq!(spec.normalized_dim(3)?, 2);
    /// assert_eq!(
    ///     spec.normalized_dim(0).unwrap_err(),
    ///     ShardingError::DimOutOfRange { dim: -1, ndim: 0 }
    /// );
    /// # Ok::<(), ShardingError>(())
    /// ```
    pub fn normalized_dim(&self, ndim: usize) -> Result<usize, ShardingError> {
        normalize_dim(self.dim, ndim).ok_or(ShardingError::DimOutOfRange {
            dim: self.dim,
            ndim,
        })
    }

    /// The shard of every placement for a tensor of shape `global_shape`, in placement order
    /// (PyTorch's `build_metadata`, with offsets clamped as described on the type).
    ///
    /// Errors: no placement, a negative size in `global_shape`, `dim` out of range.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::ChunkShardingSpec;
    ///
    /// let spec = ChunkShardingSpec::new(1, vec!["rank:0/cpu".parse()?, "rank:1/cpu".parse()?]);
    /// let shards = spec.shards_metadata(&[4, 7])?;
    /// assert_eq!(shards[0].shard_offsets, vec![0, 0]);
    /// assert_eq!(shards[0].shard_sizes, vec![4, 4]);
    /// assert_eq!(shards[1].shard_offsets, vec![0, 4]);
    /// assert_eq!(shards[1].shard_sizes, vec![4, 3]);
    /// assert_eq!(shards[1].placement.rank(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shards_metadata(
        &self,
        global_shape: &[i64],
    ) -> Result<Vec<ShardMetadata>, ShardingError> {
        check_shape(global_shape)?;
        let dim = self.normalized_dim(global_shape.len())?;
        if self.placements.is_empty() {
            return Err(ShardingError::NoPlacements);
        }
        let len = global_shape[dim];
        let parts = self.placements.len();
        Ok(self
            .placements
            .iter()
            .enumerate()
            .map(|(idx, placement)| {
                let (offset, size) = chunk_bounds(len, parts, idx);
                let mut shard_offsets = vec![0; global_shape.len()];
                let mut shard_sizes = global_shape.to_vec();
                shard_offsets[dim] = offset;
                shard_sizes[dim] = size;
                ShardMetadata {
                    shard_offsets,
                    shard_sizes,
                    placement: *placement,
                }
            })
            .collect())
    }

    /// The shard that `rank` holds for `global_shape`, `None` when no placement names it.
    ///
    /// Errors as [`shards_metadata`](Self::shards_metadata), and
    /// [`ShardingError::DuplicateRank`] when two placements name `rank`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::ChunkShardingSpec;
    ///
    /// let spec = ChunkShardingSpec::new(0, vec!["rank:0/cpu".parse()?, "rank:1/cpu".parse()?]);
    /// let mine = spec.local_shard_for_rank(&[5, 2], 1)?.expect("rank 1 holds a chunk");
    /// assert_eq!((mine.shard_offsets, mine.shard_sizes), (vec![3, 0], vec![2, 2]));
    /// assert_eq!(spec.local_shard_for_rank(&[5, 2], 2)?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn local_shard_for_rank(
        &self,
        global_shape: &[i64],
        rank: usize,
    ) -> Result<Option<ShardMetadata>, ShardingError> {
        let mut found = self
            .placements
            .iter()
            .enumerate()
            .filter(|(_, p)| p.rank() == rank)
            .map(|(i, _)| i);
        let Some(first) = found.next() else {
            // Still report a bad shape or dim.
            self.shards_metadata(global_shape)?;
            return Ok(None);
        };
        if let Some(second) = found.next() {
            return Err(ShardingError::DuplicateRank {
                rank,
                first,
                second,
            });
        }
        Ok(Some(self.shards_metadata(global_shape)?.swap_remove(first)))
    }

    /// Checks the placements against a world of `world_size` ranks: at least one placement,
    /// every rank `< world_size`, no rank named twice (PyTorch's `ChunkShardingSpec.shard`
    /// gives each rank a single local shard, so a repeated rank would lose a chunk).
    ///
    /// Ranks without a placement are fine; they hold no shard.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::ChunkShardingSpec;
    ///
    /// let spec = ChunkShardingSpec::new(0, vec!["rank:0/cpu".parse()?, "rank:2/cpu".parse()?]);
    /// assert!(spec.validate_for_world(3).is_ok());
    /// assert_eq!(
    ///     spec.validate_for_world(2).unwrap_err().to_string(),
    ///     "placement `rank:2/cpu`: rank 2 is out of range for a world of 2 ranks"
    /// );
    /// # Ok::<(), tch_dist_core::sharding::ParsePlacementError>(())
    /// ```
    pub fn validate_for_world(&self, world_size: usize) -> Result<(), ShardingError> {
        if self.placements.is_empty() {
            return Err(ShardingError::NoPlacements);
        }
        check_ranks(self.placements.iter(), world_size)?;
        let mut seen: Vec<Option<usize>> = vec![None; world_size];
        for (i, p) in self.placements.iter().enumerate() {
            if let Some(first) = seen[p.rank()] {
                return Err(ShardingError::DuplicateRank {
                    rank: p.rank(),
                    first,
                    second: i,
                });
            }
            seen[p.rank()] = Some(i);
        }
        Ok(())
    }
}

/// Every placement's rank is `< world_size`.
pub(crate) fn check_ranks<'a>(
    placements: impl IntoIterator<Item = &'a Placement>,
    world_size: usize,
) -> Result<(), ShardingError> {
    match placements.into_iter().find(|p| p.rank() >= world_size) {
        Some(p) => Err(ShardingError::RankOutOfRange {
            placement: *p,
            world_size,
        }),
        None => Ok(()),
    }
}

/// An explicit list of shards (PyTorch's `EnumerableShardingSpec`).
///
/// [`new`](Self::new) (and deserialization) checks the list on its own, as PyTorch does on
/// construction: at least one shard, every shard valid, all with the same number of dims,
/// no two overlapping (a shard without elements overlaps nothing). Whether the shards tile a
/// given global shape exactly (nothing out of bounds, no gap) is checked by
/// [`shards_metadata`](Self::shards_metadata), as PyTorch's `build_metadata` does with
/// `check_tensor`. A rank may hold several shards.
///
/// # Examples
///
/// ```
/// use tch_dist_core::sharding::{EnumerableShardingSpec, ShardMetadata};
///
/// // A 4x6 tensor cut into four 2x3 blocks.
/// let block = |r: i64, c: i64, rank: usize| {
///     ShardMetadata::new(vec![r, c], vec![2, 3], format!("rank:{rank}/cpu").parse()?)
/// };
/// let spec = EnumerableShardingSpec::new(vec![
///     block(0, 0, 0)?, block(0, 3, 1)?, block(2, 0, 2)?, block(2, 3, 3)?,
/// ])?;
/// assert_eq!(spec.shards_metadata(&[4, 6])?.len(), 4);
///
/// // Overlaps are refused on construction...
/// let err = EnumerableShardingSpec::new(vec![block(0, 0, 0)?, block(1, 2, 1)?]).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "shards 0 and 1 overlap: offsets [0, 0], sizes [2, 3] on rank:0/cpu \
///      and offsets [1, 2], sizes [2, 3] on rank:1/cpu"
/// );
/// // ...gaps when the global shape is known.
/// let three = EnumerableShardingSpec::new(vec![block(0, 0, 0)?, block(0, 3, 1)?, block(2, 0, 2)?])?;
/// assert_eq!(
///     three.shards_metadata(&[4, 6]).unwrap_err().to_string(),
///     "shards do not cover [4, 6]: they hold 18 of 24 elements; \
///      not covered: offsets [2, 3], sizes [2, 3]"
/// );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawEnumerableShardingSpec")]
pub struct EnumerableShardingSpec {
    shards: Vec<ShardMetadata>,
}

/// `EnumerableShardingSpec` as written, before [`EnumerableShardingSpec::new`]'s checks.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEnumerableShardingSpec {
    shards: Vec<ShardMetadata>,
}

impl TryFrom<RawEnumerableShardingSpec> for EnumerableShardingSpec {
    type Error = ShardingError;

    fn try_from(raw: RawEnumerableShardingSpec) -> Result<Self, ShardingError> {
        EnumerableShardingSpec::new(raw.shards)
    }
}

impl EnumerableShardingSpec {
    /// A spec of `shards`, checked as described on the type.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{EnumerableShardingSpec, ShardMetadata, ShardingError};
    ///
    /// let a = ShardMetadata::new(vec![0, 0], vec![2, 2], "rank:0/cpu".parse()?)?;
    /// let b = ShardMetadata::new(vec![2, 0, 0], vec![2, 2, 1], "rank:1/cpu".parse()?)?;
    /// assert_eq!(
    ///     EnumerableShardingSpec::new(vec![a, b]).unwrap_err().to_string(),
    ///     "shards 0 and 1 differ in rank: 2 dims vs 3 dims"
    /// );
    /// assert_eq!(EnumerableShardingSpec::new(vec![]).unwrap_err(), ShardingError::NoShards);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(shards: Vec<ShardMetadata>) -> Result<Self, ShardingError> {
        validate_shards(&shards)?;
        Ok(EnumerableShardingSpec { shards })
    }

    /// The shards, in the order given.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{EnumerableShardingSpec, ShardMetadata};
    ///
    /// let a = ShardMetadata::new(vec![0], vec![3], "rank:0/cpu".parse()?)?;
    /// let spec = EnumerableShardingSpec::new(vec![a.clone()])?;
    /// assert_eq!(spec.shards(), &[a]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shards(&self) -> &[ShardMetadata] {
        &self.shards
    }

    /// Consumes the spec, returning its shards.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{EnumerableShardingSpec, ShardMetadata};
    ///
    /// let a = ShardMetadata::new(vec![0], vec![3], "rank:0/cpu".parse()?)?;
    /// let spec = EnumerableShardingSpec::new(vec![a.clone()])?;
    /// assert_eq!(spec.into_shards(), vec![a]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn into_shards(self) -> Vec<ShardMetadata> {
        self.shards
    }

    /// The shards, after checking that they tile `global_shape` exactly: the same number of
    /// dims, every shard inside it, no gap (PyTorch's `check_tensor`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{EnumerableShardingSpec, ShardMetadata};
    ///
    /// let spec = EnumerableShardingSpec::new(vec![
    ///     ShardMetadata::new(vec![0], vec![3], "rank:0/cpu".parse()?)?,
    ///     ShardMetadata::new(vec![3], vec![3], "rank:1/cpu".parse()?)?,
    /// ])?;
    /// assert_eq!(spec.shards_metadata(&[6])?.len(), 2);
    /// assert_eq!(
    ///     spec.shards_metadata(&[5]).unwrap_err().to_string(),
    ///     "shard 1 (offsets [3], sizes [3] on rank:1/cpu) is out of bounds of [5]: \
    ///      along dim 0 it ends at 6, past 5"
    /// );
    /// assert_eq!(
    ///     spec.shards_metadata(&[6, 1]).unwrap_err().to_string(),
    ///     "shards have 1 dims but the tensor [6, 1] has 2"
    /// );
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shards_metadata(
        &self,
        global_shape: &[i64],
    ) -> Result<Vec<ShardMetadata>, ShardingError> {
        check_cover(&self.shards, global_shape)?;
        Ok(self.shards.clone())
    }

    /// The shards held by `rank` (several are allowed), in list order.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{EnumerableShardingSpec, ShardMetadata};
    ///
    /// let spec = EnumerableShardingSpec::new(vec![
    ///     ShardMetadata::new(vec![0], vec![2], "rank:0/cpu".parse()?)?,
    ///     ShardMetadata::new(vec![2], vec![2], "rank:1/cpu".parse()?)?,
    ///     ShardMetadata::new(vec![4], vec![2], "rank:0/cpu".parse()?)?,
    /// ])?;
    /// let offsets: Vec<i64> = spec.shards_for_rank(0).iter().map(|s| s.shard_offsets[0]).collect();
    /// assert_eq!(offsets, vec![0, 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shards_for_rank(&self, rank: usize) -> Vec<&ShardMetadata> {
        self.shards
            .iter()
            .filter(|s| s.placement.rank() == rank)
            .collect()
    }

    /// Checks that every shard's rank is `< world_size`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{EnumerableShardingSpec, ShardMetadata};
    ///
    /// let spec = EnumerableShardingSpec::new(vec![
    ///     ShardMetadata::new(vec![0], vec![2], "rank:0/cpu".parse()?)?,
    ///     ShardMetadata::new(vec![2], vec![2], "rank:4/cpu".parse()?)?,
    /// ])?;
    /// assert!(spec.validate_for_world(5).is_ok());
    /// assert!(spec.validate_for_world(4).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn validate_for_world(&self, world_size: usize) -> Result<(), ShardingError> {
        check_ranks(self.shards.iter().map(|s| &s.placement), world_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn ranks(n: usize) -> Vec<Placement> {
        (0..n).map(|r| Placement::new(r, Device::Cpu)).collect()
    }

    /// `(offsets along dim, sizes along dim)`.
    fn along(shards: &[ShardMetadata], dim: usize) -> (Vec<i64>, Vec<i64>) {
        shards
            .iter()
            .map(|s| (s.shard_offsets[dim], s.shard_sizes[dim]))
            .unzip()
    }

    fn shard(offsets: &[i64], sizes: &[i64], rank: usize) -> ShardMetadata {
        ShardMetadata::new(
            offsets.to_vec(),
            sizes.to_vec(),
            Placement::new(rank, Device::Cpu),
        )
        .unwrap()
    }

    #[test]
    fn chunk_10_rows_over_4_ranks() {
        let shards = ChunkShardingSpec::new(0, ranks(4))
            .shards_metadata(&[10, 3])
            .unwrap();
        assert_eq!(along(&shards, 0), (vec![0, 3, 6, 9], vec![3, 3, 3, 1]));
        for (r, s) in shards.iter().enumerate() {
            assert_eq!(s.shard_offsets[1], 0);
            assert_eq!(s.shard_sizes[1], 3);
            assert_eq!(s.placement.rank(), r);
        }
        check_cover(&shards, &[10, 3]).unwrap();
    }

    #[test]
    fn chunk_more_ranks_than_rows_gives_empty_shards() {
        let shards = ChunkShardingSpec::new(0, ranks(4))
            .shards_metadata(&[2, 5])
            .unwrap();
        assert_eq!(along(&shards, 0), (vec![0, 1, 2, 2], vec![1, 1, 0, 0]));
        assert!(shards[2].is_empty() && shards[3].is_empty());
        assert_eq!(shards[3].shard_sizes, vec![0, 5]);
        // 5 rows over 4 ranks: split 2, so the fourth rank is empty (PyTorch's offset would be 6).
        let shards = ChunkShardingSpec::new(0, ranks(4))
            .shards_metadata(&[5])
            .unwrap();
        assert_eq!(along(&shards, 0), (vec![0, 2, 4, 5], vec![2, 2, 1, 0]));
        // The clamped shards are a valid enumerable spec of the same tensor.
        EnumerableShardingSpec::new(shards)
            .unwrap()
            .shards_metadata(&[5])
            .unwrap();
    }

    #[test]
    fn chunk_even_and_single_and_zero_length() {
        let shards = ChunkShardingSpec::new(0, ranks(2))
            .shards_metadata(&[8])
            .unwrap();
        assert_eq!(along(&shards, 0), (vec![0, 4], vec![4, 4]));
        let shards = ChunkShardingSpec::new(0, ranks(1))
            .shards_metadata(&[7, 2])
            .unwrap();
        assert_eq!(along(&shards, 0), (vec![0], vec![7]));
        let shards = ChunkShardingSpec::new(1, ranks(3))
            .shards_metadata(&[4, 0])
            .unwrap();
        assert_eq!(along(&shards, 1), (vec![0, 0, 0], vec![0, 0, 0]));
    }

    #[test]
    fn chunk_dim_1_and_negative_dims() {
        let spec = ChunkShardingSpec::new(1, ranks(3));
        let shards = spec.shards_metadata(&[4, 7, 2]).unwrap();
        assert_eq!(along(&shards, 1), (vec![0, 3, 6], vec![3, 3, 1]));
        assert_eq!(shards[2].shard_offsets, vec![0, 6, 0]);
        assert_eq!(shards[2].shard_sizes, vec![4, 1, 2]);

        let neg = ChunkShardingSpec::new(-2, ranks(3))
            .shards_metadata(&[4, 7, 2])
            .unwrap();
        assert_eq!(neg, shards);
        let last = ChunkShardingSpec::new(-1, ranks(2))
            .shards_metadata(&[4, 7, 3])
            .unwrap();
        assert_eq!(along(&last, 2), (vec![0, 2], vec![2, 1]));
        let first = ChunkShardingSpec::new(-3, ranks(2))
            .shards_metadata(&[4, 7, 3])
            .unwrap();
        assert_eq!(along(&first, 0), (vec![0, 2], vec![2, 2]));
    }

    #[test]
    fn chunk_errors() {
        let e = ChunkShardingSpec::new(3, ranks(2))
            .shards_metadata(&[4, 6])
            .unwrap_err();
        assert_eq!(e, ShardingError::DimOutOfRange { dim: 3, ndim: 2 });
        assert_eq!(
            e.to_string(),
            "dim 3 out of range for a tensor of 2 dims (expected a dim in -2..=1)"
        );
        let e = ChunkShardingSpec::new(2, ranks(2))
            .shards_metadata(&[4, 6])
            .unwrap_err();
        assert!(e
            .to_string()
            .starts_with("dim 2 out of range for a tensor of 2 dims"));
        let e = ChunkShardingSpec::new(-3, ranks(2))
            .shards_metadata(&[4, 6])
            .unwrap_err();
        assert_eq!(e, ShardingError::DimOutOfRange { dim: -3, ndim: 2 });
        let e = ChunkShardingSpec::new(0, ranks(2))
            .shards_metadata(&[])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "dim 0 out of range for a tensor of 0 dims (a scalar has no dim to shard)"
        );
        let e = ChunkShardingSpec::new(0, vec![])
            .shards_metadata(&[4])
            .unwrap_err();
        assert_eq!(e, ShardingError::NoPlacements);
        let e = ChunkShardingSpec::new(0, ranks(2))
            .shards_metadata(&[4, -1])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid tensor shape [4, -1]: sizes must be >= 0"
        );
    }

    #[test]
    fn chunk_local_shard_and_world() {
        let spec = ChunkShardingSpec::new(
            0,
            vec![
                Placement::new(2, Device::Cpu),
                Placement::new(0, Device::Cuda(0)),
                Placement::new(1, Device::Cpu),
            ],
        );
        let s = spec.local_shard_for_rank(&[7, 1], 0).unwrap().unwrap();
        assert_eq!((s.shard_offsets, s.shard_sizes), (vec![3, 0], vec![3, 1]));
        assert_eq!(s.placement.device(), Device::Cuda(0));
        assert_eq!(spec.local_shard_for_rank(&[7, 1], 3).unwrap(), None);
        assert!(spec.local_shard_for_rank(&[7, 1, 1, 1], 3).is_ok());
        assert!(spec.local_shard_for_rank(&[-7], 3).is_err());
        spec.validate_for_world(3).unwrap();
        let e = spec.validate_for_world(2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "placement `rank:2/cpu`: rank 2 is out of range for a world of 2 ranks"
        );

        let dup = ChunkShardingSpec::new(
            0,
            vec![
                Placement::new(0, Device::Cpu),
                Placement::new(1, Device::Cpu),
                Placement::new(1, Device::Cuda(1)),
            ],
        );
        let e = dup.validate_for_world(2).unwrap_err();
        assert_eq!(
            e,
            ShardingError::DuplicateRank {
                rank: 1,
                first: 1,
                second: 2
            }
        );
        assert_eq!(
            e.to_string(),
            "placements 1 and 2 both name rank 1: a ChunkShardingSpec holds at most one chunk per rank"
        );
        assert_eq!(dup.local_shard_for_rank(&[3], 1).unwrap_err(), e);
        assert_eq!(
            ChunkShardingSpec::new(0, vec![])
                .validate_for_world(1)
                .unwrap_err(),
            ShardingError::NoPlacements
        );
    }

    #[test]
    fn enumerable_overlap() {
        let e = EnumerableShardingSpec::new(vec![
            shard(&[0, 0], &[2, 3], 0),
            shard(&[0, 3], &[2, 3], 1),
            shard(&[1, 2], &[2, 2], 2),
        ])
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "shards 0 and 2 overlap: offsets [0, 0], sizes [2, 3] on rank:0/cpu \
             and offsets [1, 2], sizes [2, 2] on rank:2/cpu"
        );
        // Identical shards overlap.
        let e = EnumerableShardingSpec::new(vec![shard(&[0], &[4], 0), shard(&[0], &[4], 1)])
            .unwrap_err();
        assert!(
            matches!(
                e,
                ShardingError::Overlap {
                    first: 0,
                    second: 1,
                    ..
                }
            ),
            "{e}"
        );
        // Inconsistent dims and bad shards name the index.
        let e = EnumerableShardingSpec::new(vec![shard(&[0], &[4], 0), shard(&[4, 0], &[4, 1], 1)])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "shards 0 and 1 differ in rank: 1 dims vs 2 dims"
        );
        let bad = ShardMetadata {
            shard_offsets: vec![4],
            shard_sizes: vec![-4],
            placement: Placement::new(1, Device::Cpu),
        };
        let e = EnumerableShardingSpec::new(vec![shard(&[0], &[4], 0), bad]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "shard 1 (offsets [4], sizes [-4]): shard_sizes must be >= 0"
        );
    }

    #[test]
    fn enumerable_gap_and_out_of_bounds() {
        let spec = EnumerableShardingSpec::new(vec![
            shard(&[0, 0], &[4, 2], 0),
            shard(&[0, 2], &[4, 2], 1),
            shard(&[0, 5], &[4, 1], 2),
        ])
        .unwrap();
        let e = spec.shards_metadata(&[4, 6]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "shards do not cover [4, 6]: they hold 20 of 24 elements; \
             not covered: offsets [0, 4], sizes [4, 1]"
        );
        let e = spec.shards_metadata(&[4, 5]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "shard 2 (offsets [0, 5], sizes [4, 1] on rank:2/cpu) is out of bounds of [4, 5]: \
             along dim 1 it ends at 6, past 5"
        );
        let e = spec.shards_metadata(&[3, 6]).unwrap_err();
        assert!(
            matches!(
                e,
                ShardingError::OutOfBounds {
                    index: 0,
                    dim: 0,
                    end: 4,
                    ..
                }
            ),
            "{e}"
        );
        let e = spec.shards_metadata(&[4]).unwrap_err();
        assert_eq!(
            e,
            ShardingError::ShapeRankMismatch {
                shape: vec![4],
                shards_ndim: 2
            }
        );

        let full = EnumerableShardingSpec::new(vec![
            shard(&[0, 0], &[4, 2], 0),
            shard(&[0, 2], &[4, 3], 1),
            shard(&[0, 5], &[4, 1], 0),
        ])
        .unwrap();
        assert_eq!(full.shards_metadata(&[4, 6]).unwrap(), full.shards());
        assert_eq!(full.shards_for_rank(0).len(), 2);
        full.validate_for_world(2).unwrap();
        let e = full.validate_for_world(1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "placement `rank:1/cpu`: rank 1 is out of range for a world of 1 ranks"
        );
    }
}
