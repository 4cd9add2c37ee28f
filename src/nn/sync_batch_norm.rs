//! [`SyncBatchNorm`]: PyTorch's `torch.nn.SyncBatchNorm` — batch normalisation whose
//! training statistics are those of the whole batch over all ranks, with the matching
//! backward.
//!
//! In training, each forward all-reduces the per-channel sums and counts, then the sums of
//! squared deviations from the global mean (two small all-reduces per layer, of `C + 1` and
//! `C` values), through the runtime's differentiable collectives whose backward all-reduces
//! the gradients again: the gradient each rank gets is the one of the sum of every rank's
//! loss, as PyTorch's SyncBatchNorm gives it. In eval mode, or in a group of one, it is
//! plain batch normalisation with the running statistics. The running statistics are
//! updated with the global mean and the unbiased global variance, the same on every rank.
//!
//! It walks as `tch::nn::BatchNorm` does (`weight`, `bias`, buffers `running_mean`,
//! `running_var`), so FQNs, checkpoints and `replicate` see the same names. tch's types are
//! fixed at compile time, so there is no `convert_sync_batchnorm` that rewrites a model:
//! declare the field as `SyncBatchNorm` and build it with [`sync_batch_norm`] (the same
//! variables as `nn::batch_norm2d`), or turn a built layer into one with
//! [`SyncBatchNorm::from_batch_norm`].

use std::borrow::Borrow;

use tch::nn::{self, ModuleT, Path};
use tch::{Kind, Tensor};
use tch_dist_core::Shardable;
use tch_dist_runtime::sharding::functional;
use tch_dist_runtime::{default_group, DistError, ProcessGroup};

/// Why a [`SyncBatchNorm`] forward failed.
///
/// ```
/// use tch_dist::nn::sync_batch_norm::SyncBatchNormError;
/// let e = SyncBatchNormError::TooFewValues { rank: 0, count: 1 };
/// assert_eq!(e.to_string(), "rank 0: SyncBatchNorm: expected more than 1 value per channel when training, got 1 over all ranks");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SyncBatchNormError {
    /// The input is not `[N, C, ...]` with `C` the layer's number of features.
    #[error("SyncBatchNorm: expected an input [N, {features}, ...], got {shape:?}")]
    BadInput {
        /// The layer's number of features.
        features: i64,
        /// The input's shape.
        shape: Vec<i64>,
    },
    /// One value per channel over all ranks: no variance (PyTorch's error).
    #[error(
        "rank {rank}: SyncBatchNorm: expected more than 1 value per channel when training, \
         got {count} over all ranks"
    )]
    TooFewValues {
        /// This rank.
        rank: usize,
        /// Values per channel over all ranks.
        count: i64,
    },
    /// No group was given and there is no default group, or a collective failed.
    #[error(transparent)]
    Dist(#[from] DistError),
}

/// Batch normalisation over all ranks' batches (see the [module docs](self)).
///
/// ```no_run
/// use tch::nn::{self, ModuleT};
/// use tch_dist::nn::sync_batch_norm::sync_batch_norm;
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let bn = sync_batch_norm(vs.root() / "bn", 16, Default::default());
/// let x = tch::Tensor::randn([4, 16, 8, 8], tch::kind::FLOAT_CPU);
/// let y = bn.f_forward_t(&x, true)?; // statistics of every rank's 4 images
/// # let _ = y;
/// # Ok(()) }
/// ```
///
/// It walks as `tch::nn::BatchNorm` does, through the derive: parameters `weight`, `bias`
/// (absent when not affine), buffers `running_mean`, `running_var`, the names of tch's
/// `BatchNorm` and PyTorch's `SyncBatchNorm`.
#[derive(Debug, Shardable)]
#[shardable(crate = "crate")]
pub struct SyncBatchNorm {
    /// The scale (parameter `weight`; `None` when not affine).
    #[shardable(param, rename = "weight")]
    pub ws: Option<Tensor>,
    /// The shift (parameter `bias`; `None` when not affine).
    #[shardable(param, rename = "bias")]
    pub bs: Option<Tensor>,
    /// The running mean (buffer `running_mean`).
    #[shardable(buffer)]
    pub running_mean: Tensor,
    /// The running (unbiased) variance (buffer `running_var`).
    #[shardable(buffer)]
    pub running_var: Tensor,
    #[shardable(skip)]
    eps: f64,
    #[shardable(skip)]
    momentum: f64,
    #[shardable(skip)]
    group: Option<ProcessGroup>,
}

/// A [`SyncBatchNorm`] of `num_features` channels with the variables `nn::batch_norm2d`
/// creates under `vs` (`weight`, `bias`, `running_mean`, `running_var`), over the default
/// group (looked up at each forward; [`SyncBatchNorm::with_group`] picks another).
///
/// ```no_run
/// use tch::nn::ModuleT;
/// use tch_dist::nn::sync_batch_norm::sync_batch_norm;
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let bn = sync_batch_norm(vs.root() / "bn", 3, Default::default()); // as nn::batch_norm2d
/// let y = bn.forward_t(&tch::Tensor::randn([4, 3, 8, 8], tch::kind::FLOAT_CPU), true);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn sync_batch_norm<'a, T: Borrow<Path<'a>>>(
    vs: T,
    num_features: i64,
    config: nn::BatchNormConfig,
) -> SyncBatchNorm {
    let (eps, momentum) = (config.eps, config.momentum);
    let bn = nn::batch_norm2d(vs, num_features, config);
    SyncBatchNorm::from_batch_norm(bn, eps, momentum)
}

impl SyncBatchNorm {
    /// Turns a built `tch::nn::BatchNorm` into a [`SyncBatchNorm`] over the same tensors
    /// (tch keeps its `eps` and `momentum` private: pass the ones it was built with,
    /// `BatchNormConfig::default()`'s are `1e-5` and `0.1`).
    ///
    /// ```
    /// use tch::nn;
    /// use tch_dist::nn::sync_batch_norm::SyncBatchNorm;
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let bn = nn::batch_norm1d(vs.root() / "bn", 8, Default::default());
    /// let sync = SyncBatchNorm::from_batch_norm(bn, 1e-5, 0.1);
    /// assert_eq!(sync.ws.as_ref().map(|w| w.size()), Some(vec![8]));
    /// ```
    pub fn from_batch_norm(bn: nn::BatchNorm, eps: f64, momentum: f64) -> SyncBatchNorm {
        SyncBatchNorm {
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            ws: bn.ws,
            bs: bn.bs,
            eps,
            momentum,
            group: None,
        }
    }

    /// The same layer synchronising over `group` instead of the default group (PyTorch's
    /// `process_group`).
    ///
    /// ```no_run
    /// use tch_dist::nn::sync_batch_norm::sync_batch_norm;
    /// let mesh = tch_dist::init_device_mesh("cpu", &[2, 2], &["dp", "tp"])?;
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let bn = sync_batch_norm(vs.root() / "bn", 16, Default::default())
    ///     .with_group(mesh.get_group("dp")?.clone()); // the statistics of the `dp` ranks' batches
    /// # Ok::<(), tch_dist::device_mesh::MeshError>(())
    /// ```
    pub fn with_group(mut self, group: ProcessGroup) -> SyncBatchNorm {
        self.group = Some(group);
        self
    }

    fn features(&self) -> i64 {
        self.running_mean.size()[0]
    }

    /// The forward, returning a failed collective or a bad input as an error (`forward_t`
    /// panics with its message instead).
    ///
    /// ```
    /// use tch_dist::nn::sync_batch_norm::{sync_batch_norm, SyncBatchNormError};
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let bn = sync_batch_norm(vs.root() / "bn", 3, Default::default());
    /// let x = tch::Tensor::zeros([4, 5], tch::kind::FLOAT_CPU); // 5 channels, not 3
    /// let err = bn.f_forward_t(&x, true).unwrap_err();
    /// assert!(matches!(err, SyncBatchNormError::BadInput { features: 3, .. }));
    /// ```
    pub fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor, SyncBatchNormError> {
        let c = self.features();
        let shape = xs.size();
        if shape.len() < 2 || shape[1] != c {
            return Err(SyncBatchNormError::BadInput { features: c, shape });
        }
        let group = match (&self.group, train) {
            (Some(g), true) => Some(g.clone()),
            (None, true) => Some(default_group()?),
            (_, false) => None,
        };
        let group = group.filter(|g| g.world_size() > 1);
        let Some(group) = group else {
            // Eval mode, or nobody to synchronise with: batch normalisation as tch's.
            return Ok(Tensor::batch_norm(
                xs,
                self.ws.as_ref(),
                self.bs.as_ref(),
                Some(&self.running_mean),
                Some(&self.running_var),
                train,
                self.momentum,
                self.eps,
                false,
            ));
        };
        let dims: Vec<i64> = (0..shape.len() as i64).filter(|&d| d != 1).collect();
        let mut per_channel = vec![1i64; shape.len()];
        per_channel[1] = c;
        let kind = xs.kind();
        let local_count = xs.numel() as i64 / c.max(1);
        // Sum and count over every rank (backward: the gradients summed over the ranks), in
        // f64 whatever the input's dtype: sums of many f16/bf16 values lose their precision
        // in their own dtype (as PyTorch, which keeps batch statistics in f32 for them).
        let sums = Tensor::cat(
            &[
                xs.sum_dim_intlist(dims.as_slice(), false, Kind::Double),
                Tensor::from_slice(&[local_count as f64]).to_device(xs.device()),
            ],
            0,
        );
        let sums = functional::all_reduce(&functional::copy_to_ranks(&sums, &group)?, &group)?;
        let count = sums.narrow(0, c, 1).detach().double_value(&[0]).round() as i64;
        if count <= 1 {
            return Err(SyncBatchNormError::TooFewValues {
                rank: group.rank(),
                count,
            });
        }
        let mean = sums.narrow(0, 0, c) / count as f64;
        let centred = xs - mean.to_kind(kind).view(per_channel.as_slice());
        let squares = centred
            .square()
            .sum_dim_intlist(dims.as_slice(), false, Kind::Double);
        let squares =
            functional::all_reduce(&functional::copy_to_ranks(&squares, &group)?, &group)?;
        let var = squares / count as f64;
        let invstd = (&var + self.eps).rsqrt().to_kind(kind);
        let mut ys = centred * invstd.view(per_channel.as_slice());
        if let Some(w) = &self.ws {
            ys *= w.view(per_channel.as_slice());
        }
        if let Some(b) = &self.bs {
            ys += b.view(per_channel.as_slice());
        }
        tch::no_grad(|| {
            let m = self.momentum;
            let unbiased = var.detach() * (count as f64 / (count - 1) as f64);
            let _ = self
                .running_mean
                .shallow_clone()
                .f_mul_scalar_(1.0 - m)
                .and_then(|mut r| r.f_add_(&(mean.detach() * m).to_kind(r.kind())));
            let _ = self
                .running_var
                .shallow_clone()
                .f_mul_scalar_(1.0 - m)
                .and_then(|mut r| r.f_add_(&(unbiased * m).to_kind(r.kind())));
        });
        Ok(ys)
    }
}

impl ModuleT for SyncBatchNorm {
    /// Panics with the error's message when [`SyncBatchNorm::f_forward_t`] fails (tch's
    /// `ModuleT` cannot return an error).
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        match self.f_forward_t(xs, train) {
            Ok(ys) => ys,
            Err(e) => panic!("{e}"),
        }
    }
}
