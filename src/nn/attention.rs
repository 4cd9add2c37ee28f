//! [`scaled_dot_product_attention`]: the one attention function a model's blocks call, so
//! that context parallelism can route it (PyTorch patches `F.scaled_dot_product_attention`
//! inside its `context_parallel`; here the switch is this function, visible and testable).

use tch::Tensor;

use crate::context_parallel::{
    context, ring_attention, ulysses_attention, AttentionOptions, CpError, CpProblem, CpStrategy,
};

/// PyTorch's `F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
/// scale)` on `[batch, heads, positions, head dim]`: outside a
/// [`context_parallel`](crate::context_parallel::context_parallel) region, libtorch's own;
/// inside one, attention over the whole sequence split across the context's group (its
/// strategy and layout), this rank's positions of it. A mask or dropout inside the region is
/// refused (PyTorch's ring refuses them too), and so is attention outside every region while
/// a buffer a region left split (its `no_restore_buffers`) is still held at its part's
/// length: the model would attend within this rank's part only.
///
/// ```
/// let q = tch::Tensor::randn([1, 2, 4, 8], tch::kind::FLOAT_CPU);
/// let out = tch_dist::nn::f_scaled_dot_product_attention(&q, &q, &q, None, 0.0, true, None)?;
/// assert_eq!(out.size(), [1, 2, 4, 8]);
/// # Ok::<(), tch_dist::context_parallel::CpError>(())
/// ```
pub fn f_scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    attn_mask: Option<&Tensor>,
    dropout_p: f64,
    is_causal: bool,
    scale: Option<f64>,
) -> Result<Tensor, CpError> {
    let Some(active) = context::active() else {
        context::check_no_split_buffer()?;
        return Tensor::f_scaled_dot_product_attention(
            q, k, v, attn_mask, dropout_p, is_causal, scale, false,
        )
        .map_err(|e| {
            CpError::from(
                CpProblem::Kernel {
                    message: e.to_string(),
                }
                .on(0),
            )
        });
    };
    let rank = active.group.rank();
    if attn_mask.is_some() || dropout_p != 0.0 {
        return Err(CpProblem::MaskOrDropout.on(rank).into());
    }
    let opts = AttentionOptions {
        causal: is_causal,
        scale,
        layout: active.options.layout,
    };
    match active.options.strategy {
        CpStrategy::Ring => ring_attention(q, k, v, &active.group, &opts),
        CpStrategy::AllToAll => ulysses_attention(q, k, v, &active.group, &opts),
    }
}

/// [`f_scaled_dot_product_attention`], panicking with its error as PyTorch raises (a
/// hooked call's `f_call` returns it).
///
/// ```
/// let q = tch::Tensor::randn([1, 2, 4, 8], tch::kind::FLOAT_CPU);
/// let out = tch_dist::nn::scaled_dot_product_attention(&q, &q, &q, None, 0.0, true, None);
/// assert_eq!(out.size(), [1, 2, 4, 8]);
/// ```
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    attn_mask: Option<&Tensor>,
    dropout_p: f64,
    is_causal: bool,
    scale: Option<f64>,
) -> Tensor {
    f_scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)
        .unwrap_or_else(|e| panic!("{}", crate::report(&e)))
}
