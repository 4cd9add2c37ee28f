//! PowerSGD gradient compression (PyTorch's `powerSGD_hook`, Vogels et al. 2019), as a
//! [`CommHook`](crate::CommHook) of the [`Reducer`](crate::Reducer).
//!
//! Each gradient of two or more dimensions, viewed as an `n × m` matrix `M`, is replaced by a
//! rank-`r` approximation `P Qᵀ` agreed on by every rank:
//!
//! 1. `P = M Q` (with `Q` from the previous step — warm start — or fresh random and
//!    orthogonalised, identical on every rank), all-reduced (sum);
//! 2. `P` is orthonormalised (Gram–Schmidt);
//! 3. `Q = Mᵀ P`, all-reduced (sum) and divided by the world size;
//! 4. `M ← P Qᵀ`, the average of the ranks' gradients projected onto span(`P`).
//!
//! One- and zero-dimensional gradients, and matrices too small to be worth compressing
//! (`n·m < min_compression_rate · (n + m) · r`), are all-reduced exactly. With error
//! feedback, what the approximation lost on this rank is added back to the next step's
//! gradient. The first `start_powersgd_iter` steps use the exact all-reduce, as in PyTorch.
//!
//! The three collectives of a compressed bucket depend on each other, so they run when the
//! reducer waits for its buckets at the end of backward (in bucket order on every rank),
//! not overlapped with backward like the exact all-reduce.

use std::collections::HashMap;

use tch::{Kind, Tensor};

use super::{BucketHook, GradBucket, InFlight};
use crate::c10d::collectives::ReduceOp;
use crate::c10d::group::ProcessGroup;
use crate::error::{ArgumentError, DistError, Result};

/// PowerSGD's settings, with PyTorch's `PowerSGDState` names and defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerSgdOptions {
    /// The rank `r` of the approximation (default 1).
    pub matrix_approximation_rank: usize,
    /// Synchronised steps that use the exact all-reduce before compression starts
    /// (default 1000; must be above 1 with error feedback or warm start, because the
    /// buckets are rebuilt after the first step).
    pub start_powersgd_iter: u64,
    /// A matrix is compressed only if that divides its size by at least this (default 2).
    pub min_compression_rate: f64,
    /// Add the previous step's local approximation error to the gradient (default true).
    pub use_error_feedback: bool,
    /// Start from the previous step's `Q` instead of a fresh random one (default true).
    pub warm_start: bool,
    /// Added to column norms when orthogonalising, against division by zero (default 0).
    pub orthogonalization_epsilon: f64,
    /// Seed of the random initial `Q`s, the same on every rank (default 0).
    pub random_seed: u64,
}

impl Default for PowerSgdOptions {
    fn default() -> Self {
        Self {
            matrix_approximation_rank: 1,
            start_powersgd_iter: 1_000,
            min_compression_rate: 2.0,
            use_error_feedback: true,
            warm_start: true,
            orthogonalization_epsilon: 0.0,
            random_seed: 0,
        }
    }
}

impl PowerSgdOptions {
    /// Checks the settings, as `PowerSGDState.__init__` does.
    pub fn validate(&self) -> std::result::Result<(), ArgumentError> {
        if self.matrix_approximation_rank == 0 {
            return Err(ArgumentError::PowerSgdRank);
        }
        if (self.use_error_feedback || self.warm_start) && self.start_powersgd_iter <= 1 {
            return Err(ArgumentError::PowerSgdStartIter {
                start_powersgd_iter: self.start_powersgd_iter,
            });
        }
        if !self.min_compression_rate.is_finite() || self.min_compression_rate < 0.0 {
            return Err(ArgumentError::PowerSgdCompressionRate {
                value: self.min_compression_rate,
            });
        }
        Ok(())
    }
}

/// The hook: its settings and what it remembers between steps, per bucket.
pub(crate) struct PowerSgd {
    opts: PowerSgdOptions,
    /// Synchronised steps completed.
    iter: u64,
    errors: HashMap<usize, Tensor>,
    qs: HashMap<usize, Vec<Tensor>>,
    /// Draws of the shared random generator so far (keeps ranks in lockstep).
    draws: u64,
}

impl BucketHook for PowerSgd {
    /// During the exact warm-up steps, an all-reduce overlapped with backward; afterwards
    /// nothing yet: the three collectives depend on each other and run in `complete`.
    fn launch(&mut self, group: &ProcessGroup, bucket: &GradBucket) -> Result<InFlight> {
        if self.compressing() {
            return Ok(InFlight::deferred());
        }
        Ok(InFlight {
            work: Some(group.all_reduce_async(bucket.buffer, ReduceOp::Avg)?),
            result: None,
        })
    }

    fn complete(
        &mut self,
        group: &ProcessGroup,
        bucket: &GradBucket,
        mut in_flight: InFlight,
    ) -> Result<()> {
        if in_flight.work.is_some() {
            return in_flight.wait();
        }
        tch::no_grad(|| self.reduce_bucket(group, bucket.index, bucket.buffer, bucket.gradients))
    }

    fn step_done(&mut self) {
        self.iter += 1;
    }

    /// Forgets per-bucket memory.
    fn buckets_rebuilt(&mut self) {
        self.errors.clear();
        self.qs.clear();
    }
}

impl PowerSgd {
    pub fn new(opts: PowerSgdOptions) -> PowerSgd {
        PowerSgd {
            opts,
            iter: 0,
            errors: HashMap::new(),
            qs: HashMap::new(),
            draws: 0,
        }
    }

    /// Whether this step compresses (false during the exact warm-up steps).
    fn compressing(&self) -> bool {
        self.iter >= self.opts.start_powersgd_iter
    }

    /// Replaces the gradients held in bucket `index` (`flat`, whose per-parameter slices are
    /// `views`) by their PowerSGD average over `group`.
    fn reduce_bucket(
        &mut self,
        group: &ProcessGroup,
        index: usize,
        flat: &Tensor,
        views: &[Tensor],
    ) -> Result<()> {
        let opts = self.opts;
        let world = group.world_size() as f64;
        let input_copy = if opts.use_error_feedback {
            match self.errors.get(&index) {
                Some(e) if e.size() == flat.size() => {
                    let _ = flat.shallow_clone().g_add_(e);
                }
                _ => {}
            }
            Some(flat.copy())
        } else {
            None
        };

        // Which slices are compressed, as (view, n, m, r).
        let mut matrices = Vec::new();
        let mut exact = Vec::new();
        for v in views {
            let shape = v.size();
            if shape.len() < 2 {
                exact.push(v);
                continue;
            }
            let n = shape[0];
            let m = if n == 0 { 0 } else { v.numel() as i64 / n };
            let r = (opts.matrix_approximation_rank as i64).min(n).min(m);
            let worth = r > 0 && (n * m) as f64 >= opts.min_compression_rate * ((n + m) * r) as f64;
            if worth {
                matrices.push((v.view([n, m]), n, m, r));
            } else {
                exact.push(v);
            }
        }

        // The exact part: one all-reduce of the concatenated slices.
        if !exact.is_empty() {
            let cat = Tensor::cat(
                &exact.iter().map(|v| v.reshape([-1])).collect::<Vec<_>>(),
                0,
            );
            group.all_reduce(&cat, ReduceOp::Sum)?;
            let _ = cat.shallow_clone().g_div_scalar_(world);
            let mut off = 0i64;
            for v in &exact {
                let len = v.numel() as i64;
                v.shallow_clone()
                    .copy_(&cat.narrow(0, off, len).view(v.size().as_slice()));
                off += len;
            }
        }
        if matrices.is_empty() {
            self.store_error(index, flat, input_copy);
            return Ok(());
        }

        // Initial Qs: the previous step's (warm start) or fresh, orthogonalised, equal on
        // every rank because every rank draws the same numbers in the same order.
        let kind = flat.kind();
        let device = flat.device();
        let reuse = opts.warm_start
            && self.qs.get(&index).is_some_and(|qs| {
                qs.len() == matrices.len()
                    && qs
                        .iter()
                        .zip(&matrices)
                        .all(|(q, (_, _, m, r))| q.size() == [*m, *r])
            });
        if !reuse {
            let mut qs = Vec::with_capacity(matrices.len());
            for (_, _, m, r) in &matrices {
                let values = self.standard_normal(opts.random_seed, (*m * *r) as usize);
                let q = Tensor::from_slice(&values)
                    .view([*m, *r])
                    .to_kind(kind)
                    .to_device(device);
                orthogonalize(&q, opts.orthogonalization_epsilon);
                qs.push(q);
            }
            self.qs.insert(index, qs);
        }
        let qs = self.qs.get_mut(&index).ok_or_else(|| DistError::Internal {
            rank: group.rank(),
            op: "PowerSGD",
            what: "the warm-start Q memory of this bucket was lost",
        })?;

        // P = M Q, summed over ranks (one all-reduce for the whole bucket).
        let ps: Vec<Tensor> = matrices
            .iter()
            .zip(qs.iter())
            .map(|((mat, ..), q)| mat.matmul(q))
            .collect();
        let p_flat = Tensor::cat(&ps.iter().map(|p| p.reshape([-1])).collect::<Vec<_>>(), 0);
        group.all_reduce(&p_flat, ReduceOp::Sum)?;
        let mut off = 0i64;
        let mut ps_sum = Vec::with_capacity(ps.len());
        for (_, n, _, r) in &matrices {
            let p = p_flat.narrow(0, off, n * r).view([*n, *r]).contiguous();
            orthogonalize(&p, opts.orthogonalization_epsilon);
            ps_sum.push(p);
            off += n * r;
        }

        // Q = Mᵀ P, averaged over ranks.
        let new_qs: Vec<Tensor> = matrices
            .iter()
            .zip(&ps_sum)
            .map(|((mat, ..), p)| mat.tr().matmul(p))
            .collect();
        let q_flat = Tensor::cat(
            &new_qs.iter().map(|q| q.reshape([-1])).collect::<Vec<_>>(),
            0,
        );
        group.all_reduce(&q_flat, ReduceOp::Sum)?;
        let _ = q_flat.shallow_clone().g_div_scalar_(world);
        let mut off = 0i64;
        for (q, (_, _, m, r)) in qs.iter_mut().zip(&matrices) {
            *q = q_flat.narrow(0, off, m * r).view([*m, *r]).contiguous();
            off += m * r;
        }

        // M ← P Qᵀ, written into the bucket.
        for (((mat, ..), p), q) in matrices.iter().zip(&ps_sum).zip(qs.iter()) {
            mat.shallow_clone().copy_(&p.matmul(&q.tr()));
        }
        self.store_error(index, flat, input_copy);
        Ok(())
    }

    fn store_error(&mut self, index: usize, flat: &Tensor, input_copy: Option<Tensor>) {
        if let Some(input) = input_copy {
            self.errors.insert(index, input - flat);
        }
    }

    /// `count` draws of N(0, 1) from a generator seeded by `seed` and the draws so far: the
    /// same sequence on every rank, without touching libtorch's global generator.
    fn standard_normal(&mut self, seed: u64, count: usize) -> Vec<f32> {
        let mut state = seed ^ self.draws.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.draws += 1;
        let mut next_unit = move || {
            // SplitMix64, mapped to (0, 1].
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
        };
        (0..count)
            .map(|_| {
                // Box–Muller.
                let (u1, u2) = (next_unit(), next_unit());
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
            })
            .collect()
    }
}

/// Orthonormalises the columns of `matrix` in place (Gram–Schmidt, as PyTorch's
/// `_orthogonalize_gram_schmidt`).
fn orthogonalize(matrix: &Tensor, epsilon: f64) {
    let cols = matrix.size()[1];
    for i in 0..cols {
        let mut col = matrix.narrow(1, i, 1);
        // On the tensor's device: reading each norm back to the host would stall a GPU.
        let norm = col.norm() + epsilon;
        let _ = col.g_div_(&norm);
        if i + 1 < cols {
            let mut rest = matrix.narrow(1, i + 1, cols - i - 1);
            let proj = (&col * &rest).sum_dim_intlist([0i64].as_slice(), true, None::<Kind>);
            let _ = rest.g_sub_(&(&col * proj));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gram_schmidt_gives_orthonormal_columns() {
        let m = Tensor::from_slice(&[3.0f64, 1.0, 4.0, 1.0, 5.0, 9.0]).view([3, 2]);
        orthogonalize(&m, 0.0);
        let gram = m.tr().matmul(&m);
        let eye = Tensor::eye(2, (Kind::Double, tch::Device::Cpu));
        assert!(gram.allclose(&eye, 1e-12, 1e-12, false));
    }

    #[test]
    fn shared_normals_repeat_for_equal_seeds() {
        let new = || PowerSgd::new(PowerSgdOptions::default());
        let (mut a, mut b) = (new(), new());
        let xs = a.standard_normal(7, 1000);
        assert_eq!(xs, b.standard_normal(7, 1000));
        let mean = xs.iter().sum::<f32>() / 1000.0;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.1 && (var - 1.0).abs() < 0.15, "{mean} {var}");
        assert_ne!(a.standard_normal(7, 4), xs[..4].to_vec());
    }

    #[test]
    fn options_are_validated_as_in_pytorch() {
        assert!(PowerSgdOptions::default().validate().is_ok());
        let bad = PowerSgdOptions {
            start_powersgd_iter: 1,
            ..Default::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("start_powersgd_iter > 1"));
        let rank0 = PowerSgdOptions {
            matrix_approximation_rank: 0,
            ..Default::default()
        };
        assert!(rank0.validate().is_err());
    }
}
