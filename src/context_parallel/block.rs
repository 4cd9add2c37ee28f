//! One block of ring attention: the attention of local queries to one block of keys and
//! values, with its log-sum-exp, and the backward of that block given the whole attention's
//! output and log-sum-exp. On the CPU, libtorch's flash kernel
//! (`_scaled_dot_product_flash_attention_for_cpu` and its backward, as PyTorch's ring calls
//! the CUDA ones); elsewhere the same arithmetic in plain ops (the GPU kernels are not
//! among tch's bindings).

use tch::{Device, Kind, Tensor};

/// The kind the merge accumulates in: float32 for half precisions, the inputs' otherwise
/// (PyTorch's `convert_to_f32`).
pub(super) fn accumulation_kind(kind: Kind) -> Kind {
    match kind {
        Kind::Half | Kind::BFloat16 => Kind::Float,
        other => other,
    }
}

/// Which implementation computes a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    /// libtorch's CPU flash kernel and its backward.
    CpuFlash,
    /// Plain ops (any device): the scores, their log-sum-exp, the softmax's backward.
    Math,
}

impl Kernel {
    /// The CPU kernel where it runs (CPU floats), the plain ops elsewhere.
    pub(super) fn of(q: &Tensor) -> Kernel {
        let float = matches!(
            q.kind(),
            Kind::Float | Kind::Double | Kind::BFloat16 | Kind::Half
        );
        if q.device() == Device::Cpu && float {
            Kernel::CpuFlash
        } else {
            Kernel::Math
        }
    }
}

/// `(out, lse)` of `q` `[B, H, Lq, d]` attending to `k`, `v` `[B, H, Lk, d]`: `out` in the
/// accumulation kind, `lse` `[B, H, Lq]` likewise. `causal` needs `Lq == Lk` (the block's
/// own positions, in order).
pub(super) fn forward(
    kernel: Kernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: Option<f64>,
) -> Result<(Tensor, Tensor), tch::TchError> {
    let acc = accumulation_kind(q.kind());
    if kernel == Kernel::CpuFlash {
        let (out, lse) = Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu(
            q,
            k,
            v,
            0.0,
            causal,
            None::<Tensor>,
            scale,
        )?;
        return Ok((out.f_to_kind(acc)?, lse.f_to_kind(acc)?));
    }
    let scores = scores(q, k, causal, scale, acc)?;
    let lse = scores.f_logsumexp([-1].as_slice(), false)?;
    let p = (scores - lse.unsqueeze(-1)).exp();
    let out = p.f_matmul(&v.f_to_kind(acc)?)?;
    Ok((out, lse))
}

/// The scaled scores `q kᵀ`, masked above the diagonal when `causal`.
fn scores(
    q: &Tensor,
    k: &Tensor,
    causal: bool,
    scale: Option<f64>,
    acc: Kind,
) -> Result<Tensor, tch::TchError> {
    let d = q.size()[3];
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let s = q
        .f_to_kind(acc)?
        .f_matmul(&k.f_to_kind(acc)?.transpose(-2, -1))?
        * scale;
    if !causal {
        return Ok(s);
    }
    let (lq, lk) = (q.size()[2], k.size()[2]);
    let above = Tensor::ones([lq, lk], (Kind::Bool, q.device())).triu(1);
    s.f_masked_fill(&above, f64::NEG_INFINITY)
}

/// The gradients `(dq, dk, dv)` of one block, in the accumulation kind, from the gradient of
/// the whole attention's output `grad_out` at these queries and that output `out` and
/// log-sum-exp `lse` (with the whole attention's normaliser each block's probabilities are
/// the true ones, so the contributions add up to the whole attention's gradients).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    kernel: Kernel,
    grad_out: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    causal: bool,
    scale: Option<f64>,
) -> Result<(Tensor, Tensor, Tensor), tch::TchError> {
    let acc = accumulation_kind(q.kind());
    if kernel == Kernel::CpuFlash {
        let kind = q.kind();
        let lse_kind = if kind == Kind::Double {
            Kind::Double
        } else {
            Kind::Float
        };
        let (dq, dk, dv) = Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu_backward(
            &grad_out.f_to_kind(kind)?.contiguous(),
            q,
            k,
            v,
            &out.f_to_kind(kind)?.contiguous(),
            &lse.f_to_kind(lse_kind)?.contiguous(),
            0.0,
            causal,
            None::<Tensor>,
            scale,
        )?;
        return Ok((dq.f_to_kind(acc)?, dk.f_to_kind(acc)?, dv.f_to_kind(acc)?));
    }
    let d = q.size()[3];
    let factor = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let (q, k, v) = (q.f_to_kind(acc)?, k.f_to_kind(acc)?, v.f_to_kind(acc)?);
    let (grad_out, out, lse) = (
        grad_out.f_to_kind(acc)?,
        out.f_to_kind(acc)?,
        lse.f_to_kind(acc)?,
    );
    let p = (scores(&q, &k, causal, scale, acc)? - lse.unsqueeze(-1)).exp();
    let dv = p.transpose(-2, -1).f_matmul(&grad_out)?;
    let dp = grad_out.f_matmul(&v.transpose(-2, -1))?;
    let row = (&grad_out * &out).sum_dim_intlist([-1].as_slice(), true, acc);
    let ds = p * (dp - row);
    let dq = ds.f_matmul(&k)? * factor;
    let dk = ds.transpose(-2, -1).f_matmul(&q)? * factor;
    Ok((dq, dk, dv))
}

/// Merges a block's `(out_blk, lse_blk)` into the running `(out, lse)` (the rows given):
/// `lse' = logaddexp(lse, lse_blk)`, `out' = out·e^(lse − lse') + out_blk·e^(lse_blk − lse')`,
/// a row masked in both (`lse' = −∞`) staying 0.
pub(super) fn merge(
    out: &Tensor,
    lse: &Tensor,
    out_blk: &Tensor,
    lse_blk: &Tensor,
) -> Result<(), tch::TchError> {
    let merged = lse.f_logaddexp(lse_blk)?;
    let weight = |l: &Tensor| -> Result<Tensor, tch::TchError> {
        Ok((l - &merged)
            .exp()
            .f_nan_to_num(0.0, None, None)?
            .unsqueeze(-1))
    };
    let new_out = out * weight(lse)? + out_blk * weight(lse_blk)?;
    out.shallow_clone().f_copy_(&new_out)?;
    lse.shallow_clone().f_copy_(&merged)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain ops (the GPU's path) equal the CPU kernel, forward and backward, causal or
    /// not, on a block of other keys than queries; merging two halves of the keys equals the
    /// whole; a row masked in both merged parts stays 0.
    #[test]
    fn math_equals_the_cpu_kernel_and_merges_equal_the_whole() {
        tch::manual_seed(11);
        let t = |l: i64| Tensor::randn([2, 3, l, 8], (Kind::Double, Device::Cpu));
        let (q, k, v) = (t(6), t(6), t(6));
        let g = t(6);
        for causal in [false, true] {
            let (o1, l1) = forward(Kernel::CpuFlash, &q, &k, &v, causal, Some(0.3)).unwrap();
            let (o2, l2) = forward(Kernel::Math, &q, &k, &v, causal, Some(0.3)).unwrap();
            assert!((&o1 - &o2).abs().max().double_value(&[]) < 1e-12);
            assert!((&l1 - &l2).abs().max().double_value(&[]) < 1e-12);
            let b1 = backward(
                Kernel::CpuFlash,
                &g,
                &q,
                &k,
                &v,
                &o1,
                &l1,
                causal,
                Some(0.3),
            )
            .unwrap();
            let b2 = backward(Kernel::Math, &g, &q, &k, &v, &o1, &l1, causal, Some(0.3)).unwrap();
            for (a, b) in [(&b1.0, &b2.0), (&b1.1, &b2.1), (&b1.2, &b2.2)] {
                assert!((a - b).abs().max().double_value(&[]) < 1e-12);
            }
        }
        let (whole, whole_lse) = forward(Kernel::Math, &q, &k, &v, false, None).unwrap();
        let half = |x: &Tensor, i: i64| x.narrow(2, 3 * i, 3);
        let (out, lse) =
            forward(Kernel::Math, &q, &half(&k, 0), &half(&v, 0), false, None).unwrap();
        let (o, l) = forward(Kernel::Math, &q, &half(&k, 1), &half(&v, 1), false, None).unwrap();
        merge(&out, &lse, &o, &l).unwrap();
        assert!((&out - &whole).abs().max().double_value(&[]) < 1e-12);
        assert!((&lse - &whole_lse).abs().max().double_value(&[]) < 1e-12);
        let masked = Tensor::full([1, 1, 2], f64::NEG_INFINITY, (Kind::Double, Device::Cpu));
        let zeros = Tensor::zeros([1, 1, 2, 4], (Kind::Double, Device::Cpu));
        let (out, lse) = (zeros.copy(), masked.copy());
        merge(&out, &lse, &zeros, &masked).unwrap();
        assert_eq!(out.abs().sum(Kind::Double).double_value(&[]), 0.0);
    }
}
