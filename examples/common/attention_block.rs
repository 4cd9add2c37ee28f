//! The pre-LayerNorm transformer block (GPT-2's) of `train_fsdp` (bidirectional, over an
//! image's rows) and `bench_ddp`'s transformer (causal), included by both with `#[path]`;
//! bench/pytorch_ddp.py's `Block` is the same block in PyTorch.

use tch::nn;
use tch::{Kind, Tensor};
use tch_dist::{Call, ShallowClone, Shardable};

/// `x + proj(attn(ln1(x)))`, then `x + fc2(gelu(fc1(ln2(x))))`, with fused q/k/v.
/// `ShallowClone`: activation checkpointing runs it again during backward.
#[derive(Debug, Shardable, ShallowClone)]
pub struct Block {
    pub ln1: nn::LayerNorm,
    pub qkv: nn::Linear,
    pub proj: nn::Linear,
    pub ln2: nn::LayerNorm,
    pub fc1: nn::Linear,
    pub fc2: nn::Linear,
    /// Attention heads (`dim` divided among them).
    #[shardable(skip)]
    pub heads: i64,
}

impl Block {
    /// A block of width `dim` under `p` (its MLP 4 * `dim` wide).
    pub fn new(p: nn::Path, dim: i64, heads: i64) -> Block {
        let d = dim;
        Block {
            ln1: nn::layer_norm(&p / "ln1", vec![d], Default::default()),
            qkv: nn::linear(&p / "qkv", d, 3 * d, Default::default()),
            proj: nn::linear(&p / "proj", d, d, Default::default()),
            ln2: nn::layer_norm(&p / "ln2", vec![d], Default::default()),
            fc1: nn::linear(&p / "fc1", d, 4 * d, Default::default()),
            fc2: nn::linear(&p / "fc2", 4 * d, d, Default::default()),
            heads,
        }
    }

    /// `x` `[batch, seq, dim]` to `[batch, seq, dim]`. `mask` `[seq, seq]` is true where a
    /// position must not attend (a causal mask: true above the diagonal); without it, every
    /// position sees every other. Its children run through `.call`, so that fully_shard's
    /// and replicate's hooks see them.
    pub fn forward(&self, x: &Tensor, mask: Option<&Tensor>) -> Tensor {
        let d = x.size()[2];
        let qkv = self.qkv.call(&self.ln1.call(x)).split(d, 2);
        let y = attention(&qkv[0], &qkv[1], &qkv[2], d / self.heads, mask);
        let x = x + self.proj.call(&y);
        let h = self.fc1.call(&self.ln2.call(&x)).gelu("none");
        &x + self.fc2.call(&h)
    }
}

/// Scaled dot-product attention of `q`, `k`, `v` (each `[batch, seq, width]`) over heads of
/// `head_dim` features (`width / head_dim` of them: all of a layer's, or a tensor-parallel
/// rank's), `mask` `[seq, seq]` true where a position must not attend; `[batch, seq,
/// width]`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    head_dim: i64,
    mask: Option<&Tensor>,
) -> Tensor {
    let (b, t, width) = q.size3().expect("[batch, seq, width]");
    let heads = |z: &Tensor| z.view([b, t, width / head_dim, head_dim]).transpose(1, 2);
    let (q, k, v) = (heads(q), heads(k), heads(v));
    let att = q.matmul(&k.transpose(-2, -1)) * (1.0 / (head_dim as f64).sqrt());
    let att = match mask {
        Some(mask) => att.masked_fill(mask, f64::NEG_INFINITY),
        None => att,
    }
    .softmax(-1, Kind::Float);
    att.matmul(&v)
        .transpose(1, 2)
        .contiguous()
        .view([b, t, width])
}
