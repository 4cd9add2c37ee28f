//! [`DistributedSampler`]: PyTorch's `torch.utils.data.distributed.DistributedSampler`,
//! which gives each rank its own share of a dataset's indices, the same on every rank for a
//! given seed and epoch.
//!
//! The arithmetic follows PyTorch 2.11 exactly: `num_samples = ceil(len / replicas)` (with
//! `drop_last` and a length that does not divide, `ceil((len - replicas) / replicas)`), the
//! indices shuffled with `torch.randperm(len, generator=Generator().manual_seed(seed +
//! epoch))` (the same mt19937 stream, through the shim), padded by repeating them from the
//! start up to `num_samples * replicas` (or cut to it with `drop_last`), then every
//! `replicas`-th one from `rank`. So a tch-dist rank and a PyTorch rank with the same
//! settings read the same rows.

use std::fmt;

use tch_dist_runtime::kernels::{self, KernelError};
use tch_dist_runtime::{default_group, ProcessGroup};

/// Why a [`DistributedSampler`] could not be made or could not shuffle.
///
/// ```
/// use tch_dist::data::{DistributedSampler, SamplerError, SamplerOptions};
/// let err = DistributedSampler::new(10, SamplerOptions { num_replicas: Some(2), rank: Some(2), ..Default::default() })
///     .unwrap_err();
/// assert!(matches!(err, SamplerError::InvalidRank { rank: 2, num_replicas: 2 }));
/// assert_eq!(err.to_string(), "DistributedSampler: invalid rank 2, rank should be in the interval [0, 1]");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SamplerError {
    /// `rank` is not below `num_replicas` (PyTorch's message).
    #[error("DistributedSampler: invalid rank {rank}, rank should be in the interval [0, {}]", .num_replicas.saturating_sub(1))]
    InvalidRank {
        /// The rank asked for.
        rank: usize,
        /// The number of replicas.
        num_replicas: usize,
    },
    /// `num_replicas` is 0.
    #[error("DistributedSampler: num_replicas must be at least 1")]
    NoReplicas,
    /// `num_replicas` or `rank` was left to the default process group, and there is none.
    #[error(
        "DistributedSampler: num_replicas and rank default to the default process group, \
         which is not initialised (call init_process_group, or set both)"
    )]
    NoDefaultGroup,
    /// The engine failed to shuffle.
    #[error("DistributedSampler: shuffling {len} indices failed: {cause}")]
    Shuffle {
        /// The dataset's length.
        len: usize,
        /// What libtorch said.
        cause: String,
    },
}

/// [`DistributedSampler`]'s settings, PyTorch's keyword arguments with its defaults.
///
/// ```
/// let opts = tch_dist::data::SamplerOptions { shuffle: false, ..Default::default() };
/// assert_eq!((opts.seed, opts.drop_last), (0, false));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SamplerOptions {
    /// How many ranks share the dataset (default: the default group's size).
    pub num_replicas: Option<usize>,
    /// This rank (default: its rank in the default group).
    pub rank: Option<usize>,
    /// Shuffle every epoch (default true), with `seed + epoch`.
    pub shuffle: bool,
    /// The shuffle's seed, the same on every rank (default 0).
    pub seed: u64,
    /// Drop the tail that does not divide among the ranks instead of padding with repeats
    /// (default false).
    pub drop_last: bool,
}

impl Default for SamplerOptions {
    fn default() -> Self {
        SamplerOptions {
            num_replicas: None,
            rank: None,
            shuffle: true,
            seed: 0,
            drop_last: false,
        }
    }
}

/// Each rank's share of a dataset's indices, as PyTorch's `DistributedSampler` (see the
/// module docs for the exact rule). Call [`set_epoch`](Self::set_epoch) at the start of
/// every epoch, or every epoch reads the same order.
///
/// ```no_run
/// use tch::Tensor;
/// use tch_dist::data::{DistributedSampler, SamplerOptions};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let (xs, ys) = (Tensor::randn([1000, 8], tch::kind::FLOAT_CPU), Tensor::zeros([1000], tch::kind::INT64_CPU));
/// let mut sampler = DistributedSampler::new(1000, SamplerOptions::default())?;
/// for epoch in 0..3 {
///     sampler.set_epoch(epoch);
///     let mine = Tensor::from_slice(&sampler.indices()?);
///     for batch in mine.split(32, 0) {
///         let (x, y) = (xs.index_select(0, &batch), ys.index_select(0, &batch));
///         // ... forward, backward, step
/// #       let _ = (x, y);
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
    num_samples: usize,
}

impl fmt::Debug for DistributedSampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedSampler")
            .field("dataset_len", &self.dataset_len)
            .field("num_replicas", &self.num_replicas)
            .field("rank", &self.rank)
            .field("shuffle", &self.shuffle)
            .field("seed", &self.seed)
            .field("drop_last", &self.drop_last)
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl DistributedSampler {
    /// A sampler over `len` rows; `num_replicas` and `rank` left `None` come from the default
    /// process group.
    ///
    /// ```
    /// use tch_dist::data::{DistributedSampler, SamplerOptions};
    /// let s = DistributedSampler::new(10, SamplerOptions { num_replicas: Some(3), rank: Some(0), ..Default::default() })?;
    /// assert_eq!((s.len(), s.total_size()), (4, 12));
    /// # Ok::<(), tch_dist::data::SamplerError>(())
    /// ```
    pub fn new(len: usize, opts: SamplerOptions) -> Result<Self, SamplerError> {
        let group = match (opts.num_replicas, opts.rank) {
            (Some(_), Some(_)) => None,
            _ => Some(default_group().map_err(|_| SamplerError::NoDefaultGroup)?),
        };
        Self::build(len, opts, group.as_ref())
    }

    /// A sampler over `len` rows for the ranks of `group` (`num_replicas` and `rank` left
    /// `None` come from it).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pg = tch_dist::ProcessGroup::from_env(tch_dist::Backend::Gloo)?;
    /// let s = tch_dist::data::DistributedSampler::for_group(100, &pg, Default::default())?;
    /// # let _ = s;
    /// # Ok(()) }
    /// ```
    pub fn for_group(
        len: usize,
        group: &ProcessGroup,
        opts: SamplerOptions,
    ) -> Result<Self, SamplerError> {
        Self::build(len, opts, Some(group))
    }

    fn build(
        len: usize,
        opts: SamplerOptions,
        group: Option<&ProcessGroup>,
    ) -> Result<Self, SamplerError> {
        let num_replicas = opts
            .num_replicas
            .or(group.map(ProcessGroup::world_size))
            .ok_or(SamplerError::NoDefaultGroup)?;
        let rank = opts
            .rank
            .or(group.map(ProcessGroup::rank))
            .ok_or(SamplerError::NoDefaultGroup)?;
        if num_replicas == 0 {
            return Err(SamplerError::NoReplicas);
        }
        if rank >= num_replicas {
            return Err(SamplerError::InvalidRank { rank, num_replicas });
        }
        let num_samples = if opts.drop_last && !len.is_multiple_of(num_replicas) {
            // ceil((len - replicas) / replicas), which is len / replicas rounded down (0 when
            // there are fewer rows than ranks).
            len / num_replicas
        } else {
            len.div_ceil(num_replicas)
        };
        Ok(DistributedSampler {
            dataset_len: len,
            num_replicas,
            rank,
            shuffle: opts.shuffle,
            seed: opts.seed,
            drop_last: opts.drop_last,
            epoch: 0,
            num_samples,
        })
    }

    /// Sets the epoch, which with `seed` decides the shuffle (PyTorch's `set_epoch`).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many indices each rank gets per epoch (PyTorch's `len(sampler)`).
    pub fn len(&self) -> usize {
        self.num_samples
    }

    /// Whether this rank gets no index at all.
    pub fn is_empty(&self) -> bool {
        self.num_samples == 0
    }

    /// The indices of all ranks together per epoch: `len() * num_replicas`.
    pub fn total_size(&self) -> usize {
        self.num_samples * self.num_replicas
    }

    /// This rank's indices for the current epoch, in order (PyTorch's `list(sampler)`).
    ///
    /// ```
    /// use tch_dist::data::{DistributedSampler, SamplerOptions};
    /// // 5 rows over 2 ranks, no shuffle: padded with row 0, rank 1 gets rows 1, 3, 0.
    /// let opts = SamplerOptions { num_replicas: Some(2), rank: Some(1), shuffle: false, ..Default::default() };
    /// assert_eq!(DistributedSampler::new(5, opts)?.indices()?, [1, 3, 0]);
    /// # Ok::<(), tch_dist::data::SamplerError>(())
    /// ```
    pub fn indices(&self) -> Result<Vec<i64>, SamplerError> {
        let all: Vec<i64> = if self.shuffle {
            randperm(self.dataset_len, self.seed.wrapping_add(self.epoch))?
        } else {
            (0..self.dataset_len as i64).collect()
        };
        let total = self.total_size();
        let padded: Vec<i64> = if self.drop_last || all.is_empty() {
            all.into_iter().take(total).collect()
        } else {
            // Repeats from the start, as often as needed (PyTorch's two padding branches
            // give the same list).
            all.iter().copied().cycle().take(total).collect()
        };
        Ok(padded
            .into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect())
    }
}

/// `torch.randperm(len, generator=torch.Generator().manual_seed(seed))`, through the
/// runtime's kernel.
fn randperm(len: usize, seed: u64) -> Result<Vec<i64>, SamplerError> {
    let failed = |cause: String| SamplerError::Shuffle { len, cause };
    let n = i64::try_from(len).map_err(|e| failed(e.to_string()))?;
    let perm = kernels::randperm(n, seed).map_err(|e| match e {
        // The engine's words alone: the variant already names the shuffle.
        KernelError::Engine { cause, .. } => failed(cause),
        other => failed(other.to_string()),
    })?;
    Vec::<i64>::try_from(&perm).map_err(|e| failed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(replicas: usize, rank: usize, shuffle: bool, drop_last: bool) -> SamplerOptions {
        SamplerOptions {
            num_replicas: Some(replicas),
            rank: Some(rank),
            shuffle,
            seed: 0,
            drop_last,
        }
    }

    /// Hand-computed: 10 rows over 3 ranks, without shuffling.
    #[test]
    fn padding_and_dropping() {
        let of = |rank, drop_last| {
            DistributedSampler::new(10, opts(3, rank, false, drop_last))
                .unwrap()
                .indices()
                .unwrap()
        };
        // Padded to 12 with rows 0 and 1.
        assert_eq!(of(0, false), [0, 3, 6, 9]);
        assert_eq!(of(1, false), [1, 4, 7, 0]);
        assert_eq!(of(2, false), [2, 5, 8, 1]);
        // Cut to 9.
        assert_eq!(of(0, true), [0, 3, 6]);
        assert_eq!(of(2, true), [2, 5, 8]);
        // Fewer rows than ranks: repeated, or nothing at all with drop_last.
        let s = DistributedSampler::new(2, opts(5, 4, false, false)).unwrap();
        assert_eq!(s.indices().unwrap(), [0]);
        let s = DistributedSampler::new(2, opts(5, 4, false, true)).unwrap();
        assert!(s.is_empty());
        assert_eq!(s.indices().unwrap(), Vec::<i64>::new());
        let s = DistributedSampler::new(0, opts(2, 1, true, false)).unwrap();
        assert_eq!(s.indices().unwrap(), Vec::<i64>::new());
    }

    /// Every rank's share together is a permutation (padded), the same for every rank.
    #[test]
    fn shuffled_shares_cover_the_rows() {
        for epoch in 0..3 {
            let mut all = Vec::new();
            for rank in 0..4 {
                let mut s = DistributedSampler::new(17, opts(4, rank, true, false)).unwrap();
                s.set_epoch(epoch);
                all.extend(s.indices().unwrap());
            }
            assert_eq!(all.len(), 20);
            let mut distinct = all.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct, (0..17).collect::<Vec<i64>>());
        }
        let at = |epoch| {
            let mut s = DistributedSampler::new(17, opts(4, 0, true, false)).unwrap();
            s.set_epoch(epoch);
            s.indices().unwrap()
        };
        assert_ne!(at(0), at(1), "another epoch, another order");
        assert_eq!(at(1), at(1));
    }

    #[test]
    fn bad_settings() {
        assert_eq!(
            DistributedSampler::new(4, opts(0, 0, true, false)).unwrap_err(),
            SamplerError::NoReplicas
        );
        assert_eq!(
            DistributedSampler::new(4, opts(2, 5, true, false)).unwrap_err(),
            SamplerError::InvalidRank {
                rank: 5,
                num_replicas: 2
            }
        );
        // No default group in this test process.
        let err = DistributedSampler::new(4, SamplerOptions::default()).unwrap_err();
        assert_eq!(err, SamplerError::NoDefaultGroup);
        assert_eq!(
            err.to_string(),
            "DistributedSampler: num_replicas and rank default to the default process group, \
             which is not initialised (call init_process_group, or set both)"
        );
    }
}
