//! Gradient utilities for distributed models (PyTorch's `torch.nn.utils`, over replicated
//! and sharded parameters alike).

use std::collections::HashMap;

use tch::{Kind, Tensor};
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::tensor_identity;
use tch_dist_runtime::{DistError, ProcessGroup, ReduceOp};

/// Why [`clip_grad_norm`] refused or failed. Nothing was scaled.
///
/// ```
/// use tch_dist::utils::ClipGradError;
/// let e = ClipGradError::InvalidMaxNorm { max_norm: -1.0 };
/// assert_eq!(e.to_string(), "clip_grad_norm: max_norm must be a non-negative number, got -1");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClipGradError {
    /// `max_norm` is negative or NaN.
    #[error("clip_grad_norm: max_norm must be a non-negative number, got {max_norm}")]
    InvalidMaxNorm {
        /// The value given.
        max_norm: f64,
    },
    /// `norm_type` is not positive (or NaN): PyTorch's p-norms need p > 0 (`f64::INFINITY`
    /// for the largest entry).
    #[error("clip_grad_norm: norm_type must be positive (or f64::INFINITY), got {norm_type}")]
    InvalidNormType {
        /// The value given.
        norm_type: f64,
    },
    /// The all-reduce of the sharded parameters' partial norms failed.
    #[error(transparent)]
    Dist(#[from] DistError),
}

/// Scales the gradients of `module`'s parameters so that their total `norm_type`-norm is at
/// most `max_norm`, and returns the total norm before scaling (PyTorch's
/// `torch.nn.utils.clip_grad_norm_`, with its rule: each gradient is multiplied by
/// `min(1, max_norm / (total + 1e-6))`; parameters without a gradient are left out).
///
/// The total is the norm of the whole model, the same on every rank: a parameter sharded by
/// [`shard_module`](crate::sharding::shard_module) (anywhere in `module`) contributes its
/// shard on each rank, summed over the shard's group (one all-reduce per group); a
/// replicated parameter (plain, or averaged by `replicate`) counts once, from this rank.
/// Call it after backward (and after `replicate`'s gradients are averaged, which they are
/// when backward returns), before the optimizer step. A non-finite norm is returned as is
/// and makes the gradients non-finite, as in PyTorch with `error_if_nonfinite=False`.
///
/// ```no_run
/// use tch::nn::{self, Module};
/// use tch_dist::{optim, replicate, utils::clip_grad_norm, Call, Shardable};
///
/// #[derive(Debug, Shardable)]
/// struct Net { fc: nn::Linear }
/// impl Module for Net {
///     fn forward(&self, xs: &tch::Tensor) -> tch::Tensor { self.fc.call(xs) }
/// }
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let model = Net { fc: nn::linear(vs.root() / "fc", 4, 2, Default::default()) };
/// replicate::apply(&model, replicate::Options::default())?;
/// let mut opt = optim::Sgd::default().build(&vs, 0.1)?;
/// let x = tch::Tensor::randn([8, 4], tch::kind::FLOAT_CPU);
/// opt.zero_grad();
/// model.call(&x).square().mean(None).backward();
/// let norm = clip_grad_norm(&model, 1.0, 2.0)?;
/// opt.step()?;
/// # let _ = norm;
/// # Ok(()) }
/// ```
pub fn clip_grad_norm<M: Shardable + ?Sized>(
    module: &M,
    max_norm: f64,
    norm_type: f64,
) -> Result<f64, ClipGradError> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(ClipGradError::InvalidMaxNorm { max_norm });
    }
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(ClipGradError::InvalidNormType { norm_type });
    }
    // Which parameters are shards, and over which groups (the placement record's `Shard`
    // dims: replicas of HSDP hold the same shards, so each replica's sum is the whole; a
    // piece of a 2-D layout is summed over both of its dims).
    let placements = crate::state_dict::placements(module);
    let sharded: HashMap<String, Vec<ProcessGroup>> = module
        .named_parameters()
        .into_iter()
        .filter_map(|(fqn, t)| {
            placements
                .get(t)
                .map(|p| (fqn, p.shard_groups().cloned().collect()))
        })
        .collect();
    let inf = norm_type.is_infinite();
    // Each gradient's contribution: |g|^p summed (p finite) or max |g|, in f64 and kept on
    // the gradient's device (one host read at the end).
    let part = |g: &Tensor| -> Tensor {
        let a = g.to_kind(Kind::Double).abs();
        if inf {
            a.max()
        } else {
            a.pow_tensor_scalar(norm_type).sum(Kind::Double)
        }
    };
    let combine = |acc: Option<Tensor>, t: Tensor| -> Option<Tensor> {
        Some(match acc {
            None => t,
            Some(a) if inf => a.maximum(&t.to_device(a.device())),
            Some(a) => {
                let t = t.to_device(a.device());
                a + t
            }
        })
    };
    // One partial per list of shard groups, by their members (the same on every rank: the
    // plan is, so every rank runs the same all-reduces whatever its gradients hold).
    let members = |gs: &[ProcessGroup]| -> Vec<Vec<usize>> {
        gs.iter().map(|g| g.global_ranks().to_vec()).collect()
    };
    let mut groups: Vec<(Vec<Vec<usize>>, Vec<ProcessGroup>)> = Vec::new();
    let mut fqns: Vec<&String> = sharded.keys().collect();
    fqns.sort();
    for fqn in fqns {
        let gs = &sharded[fqn];
        let ranks = members(gs);
        if !groups.iter().any(|(r, _)| *r == ranks) {
            groups.push((ranks, gs.clone()));
        }
    }
    let mut partials: Vec<Option<Tensor>> = groups.iter().map(|_| None).collect();
    let mut grads: Vec<Tensor> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut local: Option<Tensor> = None;
    for (fqn, p) in module.named_parameters() {
        let g = p.grad();
        // Parameters without a gradient are left out; tensors shared between two fields
        // count once (PyTorch's `parameters()`); an empty shard adds nothing.
        if !g.defined() || !seen.insert(tensor_identity(p)) {
            continue;
        }
        grads.push(g.shallow_clone());
        if g.numel() == 0 {
            continue;
        }
        let t = tch::no_grad(|| part(&g));
        match sharded.get(&fqn) {
            Some(gs) => {
                let ranks = members(gs);
                let i = groups
                    .iter()
                    .position(|(r, _)| *r == ranks)
                    .unwrap_or_default();
                partials[i] = combine(partials[i].take(), t);
            }
            None => local = combine(local.take(), t),
        }
    }
    for ((_, gs), partial) in groups.iter().zip(partials) {
        // On the groups' device (NCCL's for a CUDA group), zero where this rank has no
        // gradient among the shards; summed over each shard dim's group in turn.
        let device = gs
            .first()
            .and_then(ProcessGroup::bound_device)
            .unwrap_or(tch::Device::Cpu);
        let t = match partial {
            Some(t) => t.to_device(device),
            None => Tensor::zeros([], (Kind::Double, device)),
        };
        let op = if inf { ReduceOp::Max } else { ReduceOp::Sum };
        for group in gs {
            group.all_reduce(&t, op)?;
        }
        local = combine(local.take(), t);
    }
    let Some(total) = local else {
        return Ok(0.0);
    };
    let total = if inf {
        total.double_value(&[])
    } else {
        total.double_value(&[]).powf(1.0 / norm_type)
    };
    let coef = (max_norm / (total + 1e-6)).min(1.0);
    tch::no_grad(|| {
        for g in &grads {
            let _ = g.shallow_clone().f_mul_scalar_(coef);
        }
    });
    Ok(total)
}
