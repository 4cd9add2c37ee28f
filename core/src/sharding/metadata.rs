//! [`ShardMetadata`], [`ShardedTensorMetadata`] and [`Dtype`], and the checks PyTorch runs on
//! shard lists (`validate_non_overlapping_shards_metadata`, `check_tensor`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tch::Kind;

use super::error::ShardingError;
use super::placement::Placement;

/// One shard of a tensor: where it starts, how large it is, and where it lives (PyTorch's
/// `torch.distributed._shard.metadata.ShardMetadata`, same field names).
///
/// `shard_offsets` and `shard_sizes` have one entry per dim of the global tensor; all are
/// `>= 0`. [`ShardMetadata::new`] checks this; a struct literal does not, but every spec and
/// [`ShardedTensorMetadata::validate`] check it again, and deserialization refuses such a
/// shard.
///
/// [`Display`](fmt::Display) writes `offsets [0, 3], sizes [4, 3] on rank:1/cpu`.
///
/// # Examples
///
/// ```
/// use tch_dist_core::sharding::ShardMetadata;
///
/// let shard = ShardMetadata::new(vec![0, 3], vec![4, 3], "rank:1/cpu".parse()?)?;
/// assert_eq!(shard.placement.rank(), 1);
/// assert_eq!(shard.numel(), 12);
/// assert_eq!(shard.to_string(), "offsets [0, 3], sizes [4, 3] on rank:1/cpu");
///
/// let err = ShardMetadata::new(vec![0, 0], vec![4], "rank:0/cpu".parse()?).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "shard (offsets [0, 0], sizes [4]): shard_offsets and shard_sizes differ in length"
/// );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawShardMetadata")]
pub struct ShardMetadata {
    /// Where the shard starts in the global tensor, one offset per dim.
    pub shard_offsets: Vec<i64>,
    /// The shard's size along each dim.
    pub shard_sizes: Vec<i64>,
    /// The rank and device that hold it.
    pub placement: Placement,
}

/// `ShardMetadata` as written, before [`ShardMetadata::check`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShardMetadata {
    shard_offsets: Vec<i64>,
    shard_sizes: Vec<i64>,
    placement: Placement,
}

impl TryFrom<RawShardMetadata> for ShardMetadata {
    type Error = ShardingError;

    fn try_from(raw: RawShardMetadata) -> Result<Self, ShardingError> {
        ShardMetadata::new(raw.shard_offsets, raw.shard_sizes, raw.placement)
    }
}

impl ShardMetadata {
    /// A shard, checked as PyTorch's constructor does: `shard_offsets` and `shard_sizes` of
    /// one length, no negative value.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::{ShardMetadata, ShardingError};
    ///
    /// let on0 = "rank:0/cpu".parse()?;
    /// assert!(ShardMetadata::new(vec![2, 0], vec![2, 6], on0).is_ok());
    /// let err = ShardMetadata::new(vec![-1, 0], vec![2, 6], on0).unwrap_err();
    /// assert!(matches!(err, ShardingError::InvalidShard { index: None, .. }));
    /// # Ok::<(), ShardingError>(())
    /// ```
    pub fn new(
        shard_offsets: Vec<i64>,
        shard_sizes: Vec<i64>,
        placement: Placement,
    ) -> Result<Self, ShardingError> {
        let shard = ShardMetadata {
            shard_offsets,
            shard_sizes,
            placement,
        };
        shard.check(None)?;
        Ok(shard)
    }

    /// Number of dims (the length of `shard_offsets`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::ShardMetadata;
    ///
    /// let shard = ShardMetadata::new(vec![0, 0, 0], vec![1, 2, 3], "rank:0/cpu".parse()?)?;
    /// assert_eq!(shard.ndim(), 3);
    /// # Ok::<(), tch_dist_core::sharding::ShardingError>(())
    /// ```
    pub fn ndim(&self) -> usize {
        self.shard_offsets.len()
    }

    /// Number of elements (the product of `shard_sizes`; 1 for a 0-dim shard).
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::ShardMetadata;
    ///
    /// let shard = ShardMetadata::new(vec![4, 0], vec![2, 5], "rank:0/cpu".parse()?)?;
    /// assert_eq!(shard.numel(), 10);
    /// # Ok::<(), tch_dist_core::sharding::ShardingError>(())
    /// ```
    pub fn numel(&self) -> i64 {
        self.shard_sizes.iter().product()
    }

    /// `true` when the shard holds no element (a size is 0), like the trailing shards of a
    /// chunk spec with more placements than rows.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch_dist_core::sharding::ShardMetadata;
    ///
    /// let shard = ShardMetadata::new(vec![2, 0], vec![0, 5], "rank:3/cpu".parse()?)?;
    /// assert!(shard.is_empty());
    /// # Ok::<(), tch_dist_core::sharding::ShardingError>(())
    /// ```
    pub fn is_empty(&self) -> bool {
        self.shard_sizes.contains(&0)
    }

    /// PyTorch's constructor checks; `index` is the shard's position for the message.
    pub(crate) fn check(&self, index: Option<usize>) -> Result<(), ShardingError> {
        let reason = if self.shard_offsets.len() != self.shard_sizes.len() {
            "shard_offsets and shard_sizes differ in length"
        } else if self.shard_offsets.iter().any(|&o| o < 0) {
            "shard_offsets must be >= 0"
        } else if self.shard_sizes.iter().any(|&s| s < 0) {
            "shard_sizes must be >= 0"
        } else {
            return Ok(());
        };
        Err(ShardingError::InvalidShard {
            index,
            shard_offsets: self.shard_offsets.clone(),
            shard_sizes: self.shard_sizes.clone(),
            reason,
        })
    }

    /// `offsets [..], sizes [..]` and, with a placement, ` on <placement>`.
    pub(crate) fn describe(
        offsets: &[i64],
        sizes: &[i64],
        placement: Option<&Placement>,
    ) -> String {
        let mut s = format!("offsets {}, sizes {}", fmt_list(offsets), fmt_list(sizes));
        if let Some(p) = placement {
            s.push_str(&format!(" on {p}"));
        }
        s
    }

    /// Whether two non-empty shards share an element (PyTorch's
    /// `_check_shard_metadata_pair_overlap`).
    fn overlaps(&self, other: &ShardMetadata) -> bool {
        (0..self.ndim())
            .all(|d| self.shard_offsets[d] < end(other, d) && other.shard_offsets[d] < end(self, d))
    }
}

impl fmt::Display for ShardMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&ShardMetadata::describe(
            &self.shard_offsets,
            &self.shard_sizes,
            Some(&self.placement),
        ))
    }
}

/// Where `shard` ends along `dim` (saturating: offsets and sizes come from users).
fn end(shard: &ShardMetadata, dim: usize) -> i64 {
    shard.shard_offsets[dim].saturating_add(shard.shard_sizes[dim])
}

/// `[4, 6]`.
pub(crate) fn fmt_list(values: &[i64]) -> String {
    let items: Vec<String> = values.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// Checks a shard list on its own, as PyTorch's `EnumerableShardingSpec.__post_init__`
/// does: not empty, every shard valid, one number of dims, no two shards overlapping.
///
/// Unlike PyTorch, a shard with no element never overlaps anything (PyTorch reports an empty
/// shard whose offset lies inside another shard as overlapping it).
pub(crate) fn validate_shards(shards: &[ShardMetadata]) -> Result<(), ShardingError> {
    let Some(first) = shards.first() else {
        return Err(ShardingError::NoShards);
    };
    for (i, shard) in shards.iter().enumerate() {
        shard.check(Some(i))?;
        if shard.ndim() != first.ndim() {
            return Err(ShardingError::InconsistentShardRank {
                first: 0,
                first_ndim: first.ndim(),
                second: i,
                second_ndim: shard.ndim(),
            });
        }
    }
    if let Some((a, b)) = find_overlap(shards) {
        return Err(ShardingError::Overlap {
            first: a,
            second: b,
            first_shard: Box::new(shards[a].clone()),
            second_shard: Box::new(shards[b].clone()),
        });
    }
    Ok(())
}

/// The first overlapping pair `(smaller index, larger index)` found by a sweep along dim 0.
fn find_overlap(shards: &[ShardMetadata]) -> Option<(usize, usize)> {
    let mut order: Vec<usize> = (0..shards.len())
        .filter(|&i| !shards[i].is_empty())
        .collect();
    let ndim = shards.first()?.ndim();
    if ndim == 0 {
        // Every non-empty 0-dim shard is the whole scalar.
        return (order.len() >= 2).then(|| (order[0], order[1]));
    }
    order.sort_by_key(|&i| (shards[i].shard_offsets[0], i));
    for (k, &a) in order.iter().enumerate() {
        let end = end(&shards[a], 0);
        for &b in &order[k + 1..] {
            if shards[b].shard_offsets[0] >= end {
                break;
            }
            if shards[a].overlaps(&shards[b]) {
                return Some((a.min(b), a.max(b)));
            }
        }
    }
    None
}

/// Checks a global shape: no negative size.
pub(crate) fn check_shape(shape: &[i64]) -> Result<(), ShardingError> {
    if shape.iter().any(|&s| s < 0) {
        return Err(ShardingError::InvalidShape {
            shape: shape.to_vec(),
        });
    }
    Ok(())
}

/// Checks that already validated, non-overlapping shards tile `shape` exactly (PyTorch's
/// `check_tensor`): same number of dims, every shard in bounds, and their volumes adding up
/// to the tensor's. When they do not, one uncovered block is named if it is cheap to find.
pub(crate) fn check_cover(shards: &[ShardMetadata], shape: &[i64]) -> Result<(), ShardingError> {
    check_shape(shape)?;
    let Some(first) = shards.first() else {
        return Err(ShardingError::NoShards);
    };
    if first.ndim() != shape.len() {
        return Err(ShardingError::ShapeRankMismatch {
            shape: shape.to_vec(),
            shards_ndim: first.ndim(),
        });
    }
    let mut covered: i128 = 0;
    for (i, shard) in shards.iter().enumerate() {
        for d in 0..shape.len() {
            let end = end(shard, d);
            if end > shape[d] {
                return Err(ShardingError::OutOfBounds {
                    index: i,
                    shard: Box::new(shard.clone()),
                    shape: shape.to_vec(),
                    dim: d,
                    end,
                });
            }
        }
        covered += volume(&shard.shard_sizes);
    }
    let total = volume(shape);
    if covered != total {
        return Err(ShardingError::NotCovered {
            shape: shape.to_vec(),
            covered,
            total,
            gap: find_gap(shards, shape),
        });
    }
    Ok(())
}

fn volume(sizes: &[i64]) -> i128 {
    sizes
        .iter()
        .fold(1i128, |acc, &s| acc.saturating_mul(i128::from(s)))
}

/// Cells times shards above which no gap is searched for.
const GAP_SEARCH_LIMIT: usize = 1 << 21;

/// One block of `shape` no shard covers: the shards' boundaries cut every dim into
/// intervals, and the first cell (in row-major order) whose corner no shard contains is
/// returned. `None` when every cell is covered or the search would be too large.
fn find_gap(shards: &[ShardMetadata], shape: &[i64]) -> Option<(Vec<i64>, Vec<i64>)> {
    let cuts: Vec<Vec<i64>> = (0..shape.len())
        .map(|d| {
            let mut c = vec![0, shape[d]];
            for s in shards {
                c.push(s.shard_offsets[d]);
                c.push(end(s, d));
            }
            c.sort_unstable();
            c.dedup();
            c
        })
        .collect();
    let mut cells: usize = 1;
    for c in &cuts {
        cells = cells.checked_mul(c.len().checked_sub(1)?)?;
    }
    if cells == 0 || cells.checked_mul(shards.len().max(1))? > GAP_SEARCH_LIMIT {
        return None;
    }
    // An odometer over the cells; `idx[d]` is the interval along dim `d`.
    let mut idx = vec![0usize; shape.len()];
    loop {
        let corner: Vec<i64> = (0..shape.len()).map(|d| cuts[d][idx[d]]).collect();
        let contained = shards.iter().any(|s| {
            (0..shape.len()).all(|d| s.shard_offsets[d] <= corner[d] && corner[d] < end(s, d))
        });
        if !contained {
            let sizes = (0..shape.len())
                .map(|d| cuts[d][idx[d] + 1] - corner[d])
                .collect();
            return Some((corner, sizes));
        }
        let mut d = shape.len();
        loop {
            if d == 0 {
                return None;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] + 1 < cuts[d].len() {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// A tensor element type with PyTorch's names: a serde-friendly wrapper of [`tch::Kind`].
///
/// [`Display`](fmt::Display) and serde write PyTorch's canonical name without the `torch.`
/// prefix (`float32`, `bfloat16`, `int64`); parsing also takes the prefix and PyTorch's
/// aliases (`torch.float`, `long`, `half`, `double`, `cfloat`, ...).
///
/// # Examples
///
/// ```
/// use tch::Kind;
/// use tch_dist_core::sharding::Dtype;
///
/// assert_eq!(Dtype(Kind::Float).to_string(), "float32");
/// assert_eq!("torch.bfloat16".parse::<Dtype>()?, Dtype(Kind::BFloat16));
/// assert_eq!("long".parse::<Dtype>()?.0, Kind::Int64);
/// assert_eq!(Kind::from(Dtype::from(Kind::Half)), Kind::Half);
/// # Ok::<(), tch_dist_core::sharding::ShardingError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dtype(pub Kind);

/// `(kind, canonical name, aliases)`, in the order of `c10::ScalarType`.
const DTYPE_NAMES: &[(Kind, &str, &[&str])] = &[
    (Kind::Uint8, "uint8", &[]),
    (Kind::Int8, "int8", &[]),
    (Kind::Int16, "int16", &["short"]),
    (Kind::Int, "int32", &["int"]),
    (Kind::Int64, "int64", &["long"]),
    (Kind::Half, "float16", &["half"]),
    (Kind::Float, "float32", &["float"]),
    (Kind::Double, "float64", &["double"]),
    (Kind::ComplexHalf, "complex32", &["chalf"]),
    (Kind::ComplexFloat, "complex64", &["cfloat"]),
    (Kind::ComplexDouble, "complex128", &["cdouble"]),
    (Kind::Bool, "bool", &[]),
    (Kind::QInt8, "qint8", &[]),
    (Kind::QUInt8, "quint8", &[]),
    (Kind::QInt32, "qint32", &[]),
    (Kind::BFloat16, "bfloat16", &[]),
    (Kind::Float8e5m2, "float8_e5m2", &[]),
    (Kind::Float8e4m3fn, "float8_e4m3fn", &[]),
    (Kind::Float8e5m2fnuz, "float8_e5m2fnuz", &[]),
    (Kind::Float8e4m3fnuz, "float8_e4m3fnuz", &[]),
];

impl Dtype {
    /// PyTorch's canonical name, without the `torch.` prefix.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch::Kind;
    /// use tch_dist_core::sharding::Dtype;
    ///
    /// assert_eq!(Dtype(Kind::Int64).name(), "int64");
    /// assert_eq!(Dtype(Kind::Float8e4m3fn).name(), "float8_e4m3fn");
    /// ```
    pub fn name(self) -> &'static str {
        DTYPE_NAMES
            .iter()
            .find(|(k, _, _)| *k == self.0)
            .map(|(_, name, _)| *name)
            .expect("every tch::Kind has a name")
    }

    /// A small integer that identifies the dtype across processes (its position in PyTorch's
    /// `c10::ScalarType` list as tch knows it), for metadata that ranks exchange as tensors.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch::Kind;
    /// use tch_dist_core::sharding::Dtype;
    ///
    /// let code = Dtype(Kind::BFloat16).code();
    /// assert_eq!(Dtype::from_code(code), Some(Dtype(Kind::BFloat16)));
    /// assert_eq!(Dtype::from_code(-1), None);
    /// ```
    pub fn code(self) -> i64 {
        DTYPE_NAMES
            .iter()
            .position(|(k, _, _)| *k == self.0)
            .expect("every tch::Kind is in the table") as i64
    }

    /// The dtype of a [`code`](Self::code), if it is one.
    pub fn from_code(code: i64) -> Option<Dtype> {
        usize::try_from(code)
            .ok()
            .and_then(|i| DTYPE_NAMES.get(i))
            .map(|(kind, _, _)| Dtype(*kind))
    }
}

impl From<Kind> for Dtype {
    fn from(kind: Kind) -> Self {
        Dtype(kind)
    }
}

impl From<Dtype> for Kind {
    fn from(dtype: Dtype) -> Self {
        dtype.0
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = ShardingError;

    fn from_str(s: &str) -> Result<Self, ShardingError> {
        let bare = s.strip_prefix("torch.").unwrap_or(s);
        DTYPE_NAMES
            .iter()
            .find(|(_, name, aliases)| *name == bare || aliases.contains(&bare))
            .map(|(kind, _, _)| Dtype(*kind))
            .ok_or_else(|| ShardingError::UnknownDtype {
                name: s.to_string(),
            })
    }
}

impl Serialize for Dtype {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Dtype {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The layout of a sharded tensor: every shard, the global size and the element type
/// (PyTorch's `ShardedTensorMetadata`, same field names; of its `tensor_properties` only the
/// dtype is kept).
///
/// Built by [`ShardingSpec::build_metadata`](super::ShardingSpec::build_metadata) (already
/// checked) or by hand / deserialization (then [`validate`](Self::validate) it).
///
/// # Examples
///
/// ```
/// use tch::Kind;
/// use tch_dist_core::sharding::{ChunkShardingSpec, Dtype, ShardingSpec};
///
/// let spec = ShardingSpec::Chunk(ChunkShardingSpec::new(
///     0,
///     vec!["rank:0/cpu".parse()?, "rank:1/cpu".parse()?],
/// ));
/// let meta = spec.build_metadata(&[3, 4], Dtype(Kind::Float))?;
/// assert_eq!(meta.size, vec![3, 4]);
/// assert_eq!(meta.shards_metadata[1].shard_offsets, vec![2, 0]);
/// assert_eq!(meta.shards_metadata[1].shard_sizes, vec![1, 4]);
/// let json = serde_json::to_string(&meta)?;
/// assert!(json.contains(r#""dtype":"float32""#));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardedTensorMetadata {
    /// Every shard of the tensor, on every rank.
    pub shards_metadata: Vec<ShardMetadata>,
    /// The global size.
    pub size: Vec<i64>,
    /// The element type.
    pub dtype: Dtype,
}

impl ShardedTensorMetadata {
    /// Checks that the shards are valid, do not overlap and tile `size` exactly.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch::Kind;
    /// use tch_dist_core::sharding::{Dtype, ShardMetadata, ShardedTensorMetadata};
    ///
    /// let meta = ShardedTensorMetadata {
    ///     shards_metadata: vec![
    ///         ShardMetadata::new(vec![0], vec![3], "rank:0/cpu".parse()?)?,
    ///         ShardMetadata::new(vec![3], vec![2], "rank:1/cpu".parse()?)?,
    ///     ],
    ///     size: vec![6],
    ///     dtype: Dtype(Kind::Float),
    /// };
    /// assert_eq!(
    ///     meta.validate().unwrap_err().to_string(),
    ///     "shards do not cover [6]: they hold 5 of 6 elements; not covered: offsets [5], sizes [1]"
    /// );
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn validate(&self) -> Result<(), ShardingError> {
        validate_shards(&self.shards_metadata)?;
        check_cover(&self.shards_metadata, &self.size)
    }

    /// The shards held by `rank`, in list order.
    ///
    /// # Examples
    ///
    /// ```
    /// use tch::Kind;
    /// use tch_dist_core::sharding::{ChunkShardingSpec, Dtype, ShardingSpec};
    ///
    /// let spec: ShardingSpec = ChunkShardingSpec::new(
    ///     1,
    ///     vec!["rank:1/cpu".parse()?, "rank:0/cpu".parse()?],
    /// ).into();
    /// let meta = spec.build_metadata(&[2, 8], Dtype(Kind::Float))?;
    /// let mine = meta.shards_for_rank(0);
    /// assert_eq!(mine.len(), 1);
    /// assert_eq!(mine[0].shard_offsets, vec![0, 4]);
    /// assert!(meta.shards_for_rank(2).is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shards_for_rank(&self, rank: usize) -> Vec<&ShardMetadata> {
        self.shards_metadata
            .iter()
            .filter(|s| s.placement.rank() == rank)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(offsets: &[i64], sizes: &[i64], rank: usize) -> ShardMetadata {
        ShardMetadata {
            shard_offsets: offsets.to_vec(),
            shard_sizes: sizes.to_vec(),
            placement: Placement::new(rank, tch::Device::Cpu),
        }
    }

    #[test]
    fn shard_metadata_checks_like_pytorch() {
        let p = Placement::new(0, tch::Device::Cpu);
        assert!(ShardMetadata::new(vec![0, 0], vec![0, 0], p).is_ok());
        let e = ShardMetadata::new(vec![0, -1], vec![1, 1], p).unwrap_err();
        assert_eq!(
            e.to_string(),
            "shard (offsets [0, -1], sizes [1, 1]): shard_offsets must be >= 0"
        );
        let e = ShardMetadata::new(vec![0, 1], vec![1, -2], p).unwrap_err();
        assert_eq!(
            e.to_string(),
            "shard (offsets [0, 1], sizes [1, -2]): shard_sizes must be >= 0"
        );
    }

    #[test]
    fn numel_and_empty() {
        assert_eq!(shard(&[1, 2], &[3, 4], 0).numel(), 12);
        assert_eq!(shard(&[], &[], 0).numel(), 1);
        assert!(!shard(&[], &[], 0).is_empty());
        assert!(shard(&[2, 0], &[0, 4], 0).is_empty());
    }

    #[test]
    fn overlap_found_in_any_order() {
        // 2-D grid with a shard that overlaps the third one only.
        let shards = vec![
            shard(&[0, 0], &[2, 3], 0),
            shard(&[0, 3], &[2, 3], 1),
            shard(&[2, 0], &[2, 6], 2),
            shard(&[3, 5], &[1, 1], 3),
        ];
        match validate_shards(&shards).unwrap_err() {
            ShardingError::Overlap { first, second, .. } => assert_eq!((first, second), (2, 3)),
            e => panic!("{e}"),
        }
        // Touching shards do not overlap.
        assert!(validate_shards(&shards[..3]).is_ok());
    }

    #[test]
    fn empty_shards_never_overlap() {
        let shards = vec![
            shard(&[0], &[4], 0),
            shard(&[2], &[0], 1),
            shard(&[4], &[0], 2),
        ];
        assert!(validate_shards(&shards).is_ok());
        assert!(check_cover(&shards, &[4]).is_ok());
    }

    #[test]
    fn scalar_shards() {
        assert!(validate_shards(&[shard(&[], &[], 0)]).is_ok());
        assert!(check_cover(&[shard(&[], &[], 0)], &[]).is_ok());
        let e = validate_shards(&[shard(&[], &[], 0), shard(&[], &[], 1)]).unwrap_err();
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
    }

    #[test]
    fn gap_is_named() {
        // [4, 6] with the bottom-right 2x3 block missing.
        let shards = vec![
            shard(&[0, 0], &[2, 3], 0),
            shard(&[0, 3], &[2, 3], 1),
            shard(&[2, 0], &[2, 3], 2),
        ];
        let e = check_cover(&shards, &[4, 6]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "shards do not cover [4, 6]: they hold 18 of 24 elements; \
             not covered: offsets [2, 3], sizes [2, 3]"
        );
    }

    #[test]
    fn gap_search_is_bounded() {
        let shards: Vec<ShardMetadata> = (0..3000).map(|i| shard(&[2 * i], &[1], 0)).collect();
        match check_cover(&shards, &[6000]).unwrap_err() {
            ShardingError::NotCovered {
                covered,
                total,
                gap,
                ..
            } => assert_eq!((covered, total, gap), (3000, 6000, None)),
            e => panic!("{e}"),
        }
    }

    #[test]
    fn dtype_names() {
        for (kind, name, aliases) in DTYPE_NAMES {
            let d = Dtype(*kind);
            assert_eq!(d.to_string(), *name);
            assert_eq!(name.parse::<Dtype>().unwrap(), d);
            assert_eq!(format!("torch.{name}").parse::<Dtype>().unwrap(), d);
            for a in *aliases {
                assert_eq!(a.parse::<Dtype>().unwrap(), d);
            }
        }
        assert_eq!("float".parse::<Dtype>().unwrap(), Dtype(Kind::Float));
        let e = "float33".parse::<Dtype>().unwrap_err();
        assert!(e.to_string().starts_with("unknown dtype `float33`"), "{e}");
    }

    #[test]
    fn sharded_tensor_metadata_serde_and_validate() {
        let meta = ShardedTensorMetadata {
            shards_metadata: vec![shard(&[0, 0], &[2, 2], 0), shard(&[2, 0], &[1, 2], 1)],
            size: vec![3, 2],
            dtype: Dtype(Kind::BFloat16),
        };
        meta.validate().unwrap();
        let json = serde_json::to_string(&meta).unwrap();
        assert_eq!(
            json,
            r#"{"shards_metadata":[{"shard_offsets":[0,0],"shard_sizes":[2,2],"placement":"rank:0/cpu"},{"shard_offsets":[2,0],"shard_sizes":[1,2],"placement":"rank:1/cpu"}],"size":[3,2],"dtype":"bfloat16"}"#
        );
        assert_eq!(
            serde_json::from_str::<ShardedTensorMetadata>(&json).unwrap(),
            meta
        );
        let toml_text = toml::to_string(&meta).unwrap();
        assert_eq!(
            toml::from_str::<ShardedTensorMetadata>(&toml_text).unwrap(),
            meta
        );
        assert_eq!(meta.shards_for_rank(1), vec![&meta.shards_metadata[1]]);

        let bad = r#"{"shards_metadata":[{"shard_offsets":[0],"shard_sizes":[1,1],"placement":"rank:0/cpu"}],"size":[1],"dtype":"float32"}"#;
        let e = serde_json::from_str::<ShardedTensorMetadata>(bad).unwrap_err();
        assert!(e.to_string().contains("differ in length"), "{e}");
        let typo = r#"{"shard_offset":[0],"shard_sizes":[1],"placement":"rank:0/cpu"}"#;
        assert!(serde_json::from_str::<ShardMetadata>(typo).is_err());
    }
}
