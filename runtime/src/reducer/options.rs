//! The reducer's settings (`replicate::Options` maps onto these) and their checks.

use crate::error::ArgumentError;
use crate::reducer::comm_hooks::PowerSgdOptions;

/// The first bucket is small so that communication starts early in backward (PyTorch's
/// `dist._DEFAULT_FIRST_BUCKET_BYTES`).
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1024 * 1024;

/// Gradients of at least this many bytes are all-reduced in place rather than copied through
/// a bucket (the default of `ReducerOptions::in_place_min_bytes`): from 1 MiB up, the copy
/// into the bucket and back costs more than the one extra collective saves.
pub const DEFAULT_IN_PLACE_MIN_BYTES: usize = 1024 * 1024;

/// How a bucket's gradients are communicated (PyTorch's DDP communication hooks).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub enum CommHook {
    /// All-reduce and average (DDP's default).
    #[default]
    AllReduceMean,
    /// Divide by the world size, cast to fp16, all-reduce, cast back
    /// (`default_hooks.fp16_compress_hook`).
    Fp16Compress,
    /// The same in bfloat16 (`default_hooks.bf16_compress_hook`).
    Bf16Compress,
    /// Low-rank compression (`powerSGD_hook.powerSGD_hook`); see [`PowerSgdOptions`].
    PowerSgd(PowerSgdOptions),
}

/// Reducer settings; `replicate::Options` maps onto these.
///
/// ```
/// use tch_dist_runtime::{CommHook, ReducerOptions};
/// let opts = ReducerOptions { bucket_cap_mb: 4.0, comm_hook: CommHook::Bf16Compress, ..Default::default() };
/// assert_eq!(opts.first_bucket_bytes, 1024 * 1024);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ReducerOptions {
    /// Cap of every bucket but the first, in MiB (default 25).
    pub bucket_cap_mb: f64,
    /// One cap per bucket, in MiB, in launch order (PyTorch's `bucket_cap_mb_list`): the
    /// k-th bucket of each dtype and device is closed once it holds at least entry k (the
    /// last entry for every bucket after), instead of `first_bucket_bytes` then
    /// `bucket_cap_mb`, at construction and at the rebuild. Empty (the default): not used.
    pub bucket_cap_mb_list: Vec<f64>,
    /// Cap of the first bucket, in bytes (default 1 MiB; never above `bucket_cap_mb`).
    pub first_bucket_bytes: usize,
    /// Parameters without a gradient count as zero instead of stalling their bucket.
    pub find_unused_parameters: bool,
    /// `.grad` of each parameter is a view into its bucket (saves a copy and memory).
    pub gradient_as_bucket_view: bool,
    /// The graph is the same every iteration: the first synchronised pass finds the unused
    /// parameters as `find_unused_parameters` does; later passes reuse what it found (no
    /// used-map all-reduce; this rank's unused parameters count as zero from the pass's first
    /// hook) and fail if a parameter's use on this rank changed.
    pub static_graph: bool,
    /// With `find_unused_parameters` (or `static_graph`), a bucket whose parameters got no
    /// gradient on any rank is not communicated (PyTorch's `skip_all_reduce_unused_params`);
    /// no effect without either. The ranks decide together, from the previous synchronised
    /// pass's used map (all-reduced with MAX): a bucket unused everywhere then is skipped,
    /// and should one of its parameters get a gradient after all, it is all-reduced at the
    /// end of backward, on every rank.
    pub skip_all_reduce_unused_params: bool,
    /// The communication hook.
    pub comm_hook: CommHook,
    /// With the default hook ([`CommHook::AllReduceMean`]), a gradient of at least this many
    /// bytes is all-reduced in place in `.grad` instead of being copied into its bucket and
    /// back (default 1 MiB; `usize::MAX` copies every gradient, as
    /// PyTorch does). The bucket layout is the same either way; with
    /// `gradient_as_bucket_view` only the copied gradients are bucket views.
    pub in_place_min_bytes: usize,
    /// The API that runs the reducer, as its errors name it (default `replicate`).
    pub api: &'static str,
}

impl Default for ReducerOptions {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            bucket_cap_mb_list: Vec::new(),
            first_bucket_bytes: DEFAULT_FIRST_BUCKET_BYTES,
            find_unused_parameters: false,
            gradient_as_bucket_view: false,
            static_graph: false,
            skip_all_reduce_unused_params: false,
            comm_hook: CommHook::AllReduceMean,
            in_place_min_bytes: DEFAULT_IN_PLACE_MIN_BYTES,
            api: "replicate",
        }
    }
}

impl ReducerOptions {
    /// Checks the settings (a positive, finite bucket cap, every entry of
    /// `bucket_cap_mb_list` too; PowerSGD's own checks).
    ///
    /// ```
    /// use tch_dist_runtime::ReducerOptions;
    /// let opts = ReducerOptions { bucket_cap_mb_list: vec![1.0, 0.0], ..Default::default() };
    /// assert_eq!(opts.validate().unwrap_err().to_string(), "bucket_cap_mb_list must be positive, got 0");
    /// ```
    pub fn validate(&self) -> Result<(), ArgumentError> {
        check_bucket_cap("bucket_cap_mb", self.bucket_cap_mb)?;
        for &cap in &self.bucket_cap_mb_list {
            check_bucket_cap("bucket_cap_mb_list", cap)?;
        }
        if let CommHook::PowerSgd(p) = &self.comm_hook {
            p.validate()?;
        }
        Ok(())
    }

    /// The cap of every bucket but the first, in bytes.
    pub(crate) fn cap_bytes(&self) -> usize {
        (self.bucket_cap_mb * 1024.0 * 1024.0) as usize
    }

    /// The cap of the first bucket, in bytes.
    pub(crate) fn first_cap_bytes(&self) -> usize {
        self.first_bucket_bytes.min(self.cap_bytes())
    }

    /// The caps of the buckets of one dtype and device, in launch order (the last repeats):
    /// `bucket_cap_mb_list` when given (as PyTorch's `int(mb * 1024 * 1024)`), else the
    /// first cap, then `bucket_cap_mb`.
    pub(crate) fn bucket_limits(&self) -> Vec<usize> {
        if self.bucket_cap_mb_list.is_empty() {
            vec![self.first_cap_bytes(), self.cap_bytes()]
        } else {
            self.bucket_cap_mb_list
                .iter()
                .map(|mb| (mb * 1024.0 * 1024.0) as usize)
                .collect()
        }
    }

    /// Parameters without a gradient may count as zero (instead of failing the next pass).
    pub(crate) fn tolerates_unused(&self) -> bool {
        self.find_unused_parameters || self.static_graph
    }
}

/// A bucket cap must be a positive number.
fn check_bucket_cap(option: &'static str, bucket_cap_mb: f64) -> Result<(), ArgumentError> {
    if !bucket_cap_mb.is_finite() || bucket_cap_mb <= 0.0 {
        return Err(ArgumentError::NotPositive {
            option,
            value: bucket_cap_mb,
        });
    }
    Ok(())
}
