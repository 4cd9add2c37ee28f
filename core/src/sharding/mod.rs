//! Sharding specs as plain data: PyTorch's `torch.distributed._shard.sharding_spec` and
//! `metadata`, without process groups or tensors.
//!
//! * [`Placement`] — a rank and a device, written `rank:<rank>/<device>` (PyTorch's
//!   `_remote_device`).
//! * [`ShardMetadata`] — one shard: offsets, sizes, placement.
//! * [`ChunkShardingSpec`] — split one dim `torch.chunk`-style over a list of placements.
//! * [`EnumerableShardingSpec`] — an explicit, non-overlapping list of shards.
//! * [`ShardingSpec`] — either of the two, with serde (`{"type": "chunk", ...}`).
//! * [`ShardedTensorMetadata`] — every shard of a tensor, its size and [`Dtype`].
//! * [`ShardingError`] — what can be wrong, naming the offending values.
//! * [`chunk`] — `torch.chunk`'s split sizes and offsets, and negative-dim normalisation,
//!   which everything that splits a dim uses.
//!
//! Everything here is checked arithmetic on shapes; the runtime uses it to decide which
//! slice of a tensor each rank holds.
//!
//! | file | what it does | PyTorch's counterpart (`torch/distributed/_shard/`) |
//! | --- | --- | --- |
//! | `mod.rs` | [`ShardingSpec`] (either spec, with serde), the re-exports | `sharding_spec/api.py` (`ShardingSpec`) |
//! | `placement.rs` | [`Placement`] | `torch/distributed/remote_device.py` (`_remote_device`) |
//! | `metadata.rs` | [`ShardMetadata`], [`ShardedTensorMetadata`], [`Dtype`], the shard-list checks | `metadata.py`, `sharded_tensor/metadata.py`, `_utils.py` (`validate_non_overlapping_shards_metadata`) |
//! | `spec.rs` | [`ChunkShardingSpec`], [`EnumerableShardingSpec`] | `sharding_spec/chunk_sharding_spec.py`, `sharding_spec/api.py` (`EnumerableShardingSpec`) |
//! | `chunk.rs` | `torch.chunk`'s split sizes and offsets, dim normalisation | `torch.chunk`, `_shard/sharding_spec/_internals.py` (`get_split_size`, `get_chunked_dim_size`) |
//! | `error.rs` | [`ShardingError`] | the `ValueError`s of the same files |
//!
//! # Examples
//!
//! ```
//! use tch_dist_core::sharding::ShardingSpec;
//!
//! let spec: ShardingSpec = serde_json::from_str(
//!     r#"{"type": "chunk", "dim": 0, "placements": ["rank:0/cpu", "rank:1/cpu"]}"#,
//! )?;
//! spec.validate_for_world(2)?;
//! let mine = spec.local_shard_for_rank(&[5, 4], 1)?.expect("rank 1 holds a chunk");
//! assert_eq!((mine.shard_offsets, mine.shard_sizes), (vec![3, 0], vec![2, 4]));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod chunk;
mod error;
mod metadata;
mod placement;
mod spec;

pub use error::ShardingError;
pub use metadata::{Dtype, ShardMetadata, ShardedTensorMetadata};
pub use placement::{ParsePlacementError, Placement};
pub use spec::{ChunkShardingSpec, EnumerableShardingSpec};

use serde::{Deserialize, Serialize};

/// How a tensor is sharded: by chunks along one dim or by an explicit shard list (PyTorch's
/// `ShardingSpec` subclasses).
///
/// Serde is internally tagged by `type` (`"chunk"` or `"enumerable"`), so a spec reads
/// naturally in JSON and TOML:
///
/// ```json
/// {"type": "chunk", "dim": 0, "placements": ["rank:0/cpu", "rank:1/cpu"]}
/// ```
///
/// ```toml
/// type = "enumerable"
///
/// [[shards]]
/// shard_offsets = [0, 0]
/// shard_sizes = [2, 4]
/// placement = "rank:0/cuda:0"
/// ```
///
/// Unknown fields are refused, and an enumerable spec is checked as it is read.
///
/// # Examples
///
/// ```
/// use tch_dist_core::sharding::{ChunkShardingSpec, ShardingSpec};
///
/// let spec = ShardingSpec::Chunk(ChunkShardingSpec::new(0, vec!["rank:0/cpu".parse()?, "rank:1/cpu".parse()?]));
/// let json = serde_json::to_string(&spec)?;
/// assert_eq!(json, r#"{"type":"chunk","dim":0,"placements":["rank:0/cpu","rank:1/cpu"]}"#);
/// assert_eq!(serde_json::from_str::<ShardingSpec>(&json)?, spec);
///
/// let text = toml::to_string(&spec)?;
/// assert_eq!(toml::from_str::<ShardingSpec>(&text)?, spec);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ShardingSpec {
    /// Chunks along one dim ([`ChunkShardingSpec`]).
    Chunk(ChunkShardingSpec),
    /// An explicit shard list ([`EnumerableShardingSpec`]).
    Enumerable(EnumerableShardingSpec),
}

impl From<ChunkShardingSpec> for ShardingSpec {
    fn from(spec: ChunkShardingSpec) -> Self {
        ShardingSpec::Chunk(spec)
    }
}

impl From<EnumerableShardingSpec> for ShardingSpec {
    fn from(spec: EnumerableShardingSpec) -> Self {
        ShardingSpec::Enumerable(spec)
    }
}

impl ShardingSpec {
    /// Every shard of a tensor of shape `global_shape`, checked: for a chunk spec, the dim is
    /// in range; for an enumerable spec, the shards tile the shape exactly.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{ChunkShardingSpec, ShardingSpec};
    ///
    /// let spec: ShardingSpec = ChunkShardingSpec::new(-1, vec!["rank:0/cpu".parse()?, "rank:1/cpu".parse()?]).into();
    /// let shards = spec.shards_metadata(&[2, 3])?;
    /// assert_eq!(shards[0].shard_sizes, vec![2, 2]);
    /// assert_eq!(shards[1].shard_sizes, vec![2, 1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shards_metadata(
        &self,
        global_shape: &[i64],
    ) -> Result<Vec<ShardMetadata>, ShardingError> {
        match self {
            ShardingSpec::Chunk(spec) => spec.shards_metadata(global_shape),
            ShardingSpec::Enumerable(spec) => spec.shards_metadata(global_shape),
        }
    }

    /// The [`ShardedTensorMetadata`] of a tensor of size `size` and element type `dtype`
    /// (PyTorch's `build_metadata`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tch::Kind;
    /// use tch_dist_core::sharding::{ChunkShardingSpec, Dtype, ShardingSpec};
    ///
    /// let spec: ShardingSpec = ChunkShardingSpec::new(0, vec!["rank:0/cpu".parse()?]).into();
    /// let meta = spec.build_metadata(&[4], Dtype(Kind::Half))?;
    /// assert_eq!(meta.size, vec![4]);
    /// assert_eq!(meta.dtype.to_string(), "float16");
    /// assert_eq!(meta.shards_metadata.len(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn build_metadata(
        &self,
        size: &[i64],
        dtype: Dtype,
    ) -> Result<ShardedTensorMetadata, ShardingError> {
        Ok(ShardedTensorMetadata {
            shards_metadata: self.shards_metadata(size)?,
            size: size.to_vec(),
            dtype,
        })
    }

    /// The placements, one per shard, in shard order.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{ChunkShardingSpec, ShardingSpec};
    ///
    /// let spec: ShardingSpec = ChunkShardingSpec::new(0, vec!["rank:1/cpu".parse()?, "rank:0/cpu".parse()?]).into();
    /// let ranks: Vec<usize> = spec.placements().iter().map(|p| p.rank()).collect();
    /// assert_eq!(ranks, vec![1, 0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn placements(&self) -> Vec<&Placement> {
        match self {
            ShardingSpec::Chunk(spec) => spec.placements.iter().collect(),
            ShardingSpec::Enumerable(spec) => spec.shards().iter().map(|s| &s.placement).collect(),
        }
    }

    /// The shards `rank` holds for `global_shape`, in shard order (empty when it holds
    /// none; an enumerable spec may give a rank several). Errors as
    /// [`shards_metadata`](Self::shards_metadata).
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{EnumerableShardingSpec, ShardMetadata, ShardingSpec};
    ///
    /// let spec: ShardingSpec = EnumerableShardingSpec::new(vec![
    ///     ShardMetadata::new(vec![0], vec![1], "rank:0/cpu".parse()?)?,
    ///     ShardMetadata::new(vec![1], vec![1], "rank:1/cpu".parse()?)?,
    ///     ShardMetadata::new(vec![2], vec![1], "rank:0/cpu".parse()?)?,
    /// ])?.into();
    /// assert_eq!(spec.shards_for_rank(&[3], 0)?.len(), 2);
    /// assert!(spec.shards_for_rank(&[3], 2)?.is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shards_for_rank(
        &self,
        global_shape: &[i64],
        rank: usize,
    ) -> Result<Vec<ShardMetadata>, ShardingError> {
        Ok(self
            .shards_metadata(global_shape)?
            .into_iter()
            .filter(|s| s.placement.rank() == rank)
            .collect())
    }

    /// The single shard `rank` holds for `global_shape`, `None` when it holds none.
    ///
    /// Errors as [`shards_metadata`](Self::shards_metadata), and when `rank` holds several
    /// shards ([`ShardingError::DuplicateRank`] for a chunk spec,
    /// [`ShardingError::MultipleShardsForRank`] for an enumerable one).
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{ChunkShardingSpec, ShardingSpec};
    ///
    /// let spec: ShardingSpec = ChunkShardingSpec::new(0, (0..4).map(|r| format!("rank:{r}/cpu").parse()).collect::<Result<_, _>>()?).into();
    /// let shard = spec.local_shard_for_rank(&[2, 3], 3)?.expect("rank 3 has a placement");
    /// assert!(shard.is_empty());
    /// assert_eq!((shard.shard_offsets, shard.shard_sizes), (vec![2, 0], vec![0, 3]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn local_shard_for_rank(
        &self,
        global_shape: &[i64],
        rank: usize,
    ) -> Result<Option<ShardMetadata>, ShardingError> {
        match self {
            ShardingSpec::Chunk(spec) => spec.local_shard_for_rank(global_shape, rank),
            ShardingSpec::Enumerable(_) => {
                let mut shards = self.shards_for_rank(global_shape, rank)?;
                match shards.len() {
                    0 | 1 => Ok(shards.pop()),
                    count => Err(ShardingError::MultipleShardsForRank { rank, count }),
                }
            }
        }
    }

    /// Checks the placements against a world of `world_size` ranks: every rank
    /// `< world_size`; a chunk spec also needs a placement and names each rank at most once.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{ChunkShardingSpec, ShardingError, ShardingSpec};
    ///
    /// let spec: ShardingSpec = ChunkShardingSpec::new(0, vec!["rank:0/cpu".parse()?, "rank:3/cpu".parse()?]).into();
    /// assert!(spec.validate_for_world(4).is_ok());
    /// assert!(matches!(spec.validate_for_world(2), Err(ShardingError::RankOutOfRange { world_size: 2, .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn validate_for_world(&self, world_size: usize) -> Result<(), ShardingError> {
        match self {
            ShardingSpec::Chunk(spec) => spec.validate_for_world(world_size),
            ShardingSpec::Enumerable(spec) => spec.validate_for_world(world_size),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn chunk() -> ShardingSpec {
        ChunkShardingSpec::new(
            -1,
            vec![
                Placement::new(0, Device::Cpu),
                Placement::new(1, Device::Cuda(1)),
                Placement::current_cuda(2),
            ],
        )
        .into()
    }

    fn enumerable() -> ShardingSpec {
        let s = |o: &[i64], z: &[i64], p: &str| {
            ShardMetadata::new(o.to_vec(), z.to_vec(), p.parse().unwrap()).unwrap()
        };
        EnumerableShardingSpec::new(vec![
            s(&[0, 0], &[2, 4], "rank:0/cuda:0"),
            s(&[2, 0], &[2, 4], "rank:1/cuda"),
        ])
        .unwrap()
        .into()
    }

    #[test]
    fn json_round_trip() {
        let c = chunk();
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(
            json,
            r#"{"type":"chunk","dim":-1,"placements":["rank:0/cpu","rank:1/cuda:1","rank:2/cuda"]}"#
        );
        assert_eq!(serde_json::from_str::<ShardingSpec>(&json).unwrap(), c);

        let e = enumerable();
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(
            json,
            r#"{"type":"enumerable","shards":[{"shard_offsets":[0,0],"shard_sizes":[2,4],"placement":"rank:0/cuda:0"},{"shard_offsets":[2,0],"shard_sizes":[2,4],"placement":"rank:1/cuda"}]}"#
        );
        assert_eq!(serde_json::from_str::<ShardingSpec>(&json).unwrap(), e);
    }

    #[test]
    fn toml_round_trip() {
        for spec in [chunk(), enumerable()] {
            let text = toml::to_string(&spec).unwrap();
            assert_eq!(
                toml::from_str::<ShardingSpec>(&text).unwrap(),
                spec,
                "{text}"
            );
        }
        let hand = r#"
            type = "enumerable"

            [[shards]]
            shard_offsets = [0, 0]
            shard_sizes = [2, 4]
            placement = "rank:0/cuda:0"

            [[shards]]
            shard_offsets = [2, 0]
            shard_sizes = [2, 4]
            placement = "rank:1/cuda"
        "#;
        assert_eq!(toml::from_str::<ShardingSpec>(hand).unwrap(), enumerable());
        let hand = r#"
            type = "chunk"
            dim = -1
            placements = ["rank:0/cpu", "rank:1/cuda:1", "rank:2/cuda"]
        "#;
        assert_eq!(toml::from_str::<ShardingSpec>(hand).unwrap(), chunk());
    }

    #[test]
    fn deserialization_refuses_bad_specs() {
        let err = |json: &str| {
            serde_json::from_str::<ShardingSpec>(json)
                .unwrap_err()
                .to_string()
        };
        let e = err(r#"{"type":"chunk","dim":0,"placements":["rank:0/gpu"]}"#);
        assert!(
            e.contains("placement `rank:0/gpu`: unknown device `gpu`"),
            "{e}"
        );
        let e = err(r#"{"type":"chunk","dim":0,"placement":["rank:0/cpu"]}"#);
        assert!(e.contains("unknown field `placement`"), "{e}");
        let e = err(r#"{"type":"tiled","dim":0}"#);
        assert!(e.contains("unknown variant `tiled`"), "{e}");
        let e = err(r#"{"type":"enumerable","shards":[
                {"shard_offsets":[0],"shard_sizes":[3],"placement":"rank:0/cpu"},
                {"shard_offsets":[2],"shard_sizes":[3],"placement":"rank:1/cpu"}]}"#);
        assert!(e.contains("shards 0 and 1 overlap"), "{e}");
        let e = err(r#"{"type":"enumerable","shards":[]}"#);
        assert!(e.contains("needs at least one shard"), "{e}");
        let e = err(r#"{"type":"enumerable","shards":[],"extra":1}"#);
        assert!(e.contains("unknown field `extra`"), "{e}");
    }

    #[test]
    fn spec_helpers() {
        let c = chunk();
        let ranks: Vec<usize> = c.placements().iter().map(|p| p.rank()).collect();
        assert_eq!(ranks, vec![0, 1, 2]);
        let shards = c.shards_metadata(&[3, 8]).unwrap();
        let sizes: Vec<i64> = shards.iter().map(|s| s.shard_sizes[1]).collect();
        assert_eq!(sizes, vec![3, 3, 2]);
        let mine = c.local_shard_for_rank(&[3, 8], 2).unwrap().unwrap();
        assert_eq!(
            (mine.shard_offsets, mine.shard_sizes),
            (vec![0, 6], vec![3, 2])
        );
        assert_eq!(c.local_shard_for_rank(&[3, 8], 5).unwrap(), None);
        c.validate_for_world(3).unwrap();
        assert!(c.validate_for_world(2).is_err());

        let e = enumerable();
        assert_eq!(e.placements().len(), 2);
        assert_eq!(e.shards_for_rank(&[4, 4], 1).unwrap().len(), 1);
        assert!(e.local_shard_for_rank(&[4, 4], 1).unwrap().is_some());
        assert!(e.local_shard_for_rank(&[4, 5], 1).is_err());
        let meta = e.build_metadata(&[4, 4], Dtype(tch::Kind::Float)).unwrap();
        meta.validate().unwrap();

        let two_on_zero: ShardingSpec = EnumerableShardingSpec::new(vec![
            ShardMetadata::new(vec![0], vec![1], Placement::new(0, Device::Cpu)).unwrap(),
            ShardMetadata::new(vec![1], vec![1], Placement::new(0, Device::Cpu)).unwrap(),
        ])
        .unwrap()
        .into();
        assert_eq!(
            two_on_zero
                .local_shard_for_rank(&[2], 0)
                .unwrap_err()
                .to_string(),
            "rank 0 holds 2 shards, expected at most one"
        );
    }

    #[test]
    fn chunk_metadata_validates_like_an_enumerable_spec() {
        // Every chunk layout, empty shards included, tiles its tensor.
        for rows in 0..12 {
            for n in 1..7 {
                let spec = ChunkShardingSpec::new(
                    0,
                    (0..n).map(|r| Placement::new(r, Device::Cpu)).collect(),
                );
                let meta = ShardingSpec::from(spec)
                    .build_metadata(&[rows, 3], Dtype(tch::Kind::Float))
                    .unwrap();
                meta.validate()
                    .unwrap_or_else(|e| panic!("{rows} rows over {n}: {e}"));
            }
        }
    }
}
