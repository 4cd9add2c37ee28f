//! torchtitan's Llama (`torchtitan/models/llama3/model/model.py`) at toy size, under its
//! names: `tok_embeddings`, `layers.N.{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm,
//! feed_forward.{w1,w2,w3}}`, `norm`, `output`; RMSNorm, rotary position embeddings,
//! causal attention without biases, a SwiGLU feed-forward. tests/examples/pytorch_load_lm.py
//! is the same model in PyTorch.
//!
//! Every child runs through `.call`: parallelize_module's hooks (the vocab-parallel lookup,
//! the row-parallel all-reduces, the gathered output) and fully_shard's (each layer's
//! parameters gathered around its forward and backward) are on the children, and calling
//! `forward` directly would compute with this rank's shard alone (the library refuses it).

use serde::Serialize;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_dist::nn::moe::{MoE, MoeConfig, MoeError};
use tch_dist::sharding::{
    ColwiseParallel, Layout, ParallelizePlan, PrepareModuleInput, RowwiseParallel, SequenceParallel,
};
use tch_dist::{Call, Shardable};

/// The model's sizes (saved with the checkpoint, so that PyTorch can build the same model).
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    pub vocab_size: i64,
    pub dim: i64,
    pub n_layers: usize,
    pub n_heads: i64,
    /// The feed-forward's hidden width.
    pub hidden_dim: i64,
    /// The longest sequence the rotary tables cover.
    pub max_seq_len: i64,
    pub norm_eps: f64,
    pub rope_theta: f64,
    /// Mixture-of-experts blocks in place of the dense feed-forward (`--moe`).
    pub moe: Option<MoeShape>,
}

/// The experts of a MoE block: each `dim -> expert_hidden -> dim`, `top_k` per token, and
/// one shared expert of the same width (DeepSeek-V3's shape, at toy size).
#[derive(Debug, Clone, Serialize)]
pub struct MoeShape {
    pub experts: i64,
    pub top_k: i64,
    pub expert_hidden: i64,
}

impl Config {
    /// Tiny, for 4 ranks on 2 CPU cores: width 64, 2 layers of 4 heads (2 per tp rank at
    /// tp 2). The hidden width is torchtitan's rule, `4 * dim * 2 / 3` rounded up to a
    /// multiple of 64: 192.
    pub fn tiny(vocab_size: i64, max_seq_len: i64) -> Config {
        let dim = 64;
        let multiple_of = 64;
        let hidden = 4 * dim * 2 / 3;
        Config {
            vocab_size,
            dim,
            n_layers: 2,
            n_heads: 4,
            hidden_dim: (hidden + multiple_of - 1) / multiple_of * multiple_of,
            max_seq_len,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            moe: None,
        }
    }

    /// The same model with MoE blocks: 8 experts of width `dim`, top-2, one shared expert.
    pub fn with_moe(self) -> Config {
        let expert_hidden = self.dim;
        Config {
            moe: Some(MoeShape {
                experts: 8,
                top_k: 2,
                expert_hidden,
            }),
            ..self
        }
    }

    fn head_dim(&self) -> i64 {
        self.dim / self.n_heads
    }
}

/// PyTorch's `nn.RMSNorm(dim, eps)`: `x / sqrt(mean(x^2) + eps) * weight` (tch has the op,
/// `Tensor::rms_norm`, but no layer). Its own module, so that the weight gets its FQN
/// (`norm.weight`) and fully_shard shards it with the block that holds it.
#[derive(Debug, Shardable)]
pub struct RmsNorm {
    #[shardable(param)]
    pub weight: Tensor,
    #[shardable(skip)]
    eps: f64,
}

impl RmsNorm {
    fn new(p: nn::Path, dim: i64, eps: f64) -> RmsNorm {
        RmsNorm {
            weight: p.var("weight", &[dim], nn::Init::Const(1.0)),
            eps,
        }
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        let last = x.size()[x.dim() - 1];
        x.rms_norm([last], Some(&self.weight), self.eps)
    }
}

/// Rotary position embeddings: torchtitan's `precompute_freqs_cis` and
/// `apply_rotary_emb`, in real arithmetic (each pair `(x[2i], x[2i+1])` of a head is the
/// complex number that PyTorch's `view_as_complex` makes, rotated by position * freq_i).
/// Not a parameter or buffer: recomputed from the config, as torchtitan's non-persistent
/// `freqs_cis`.
#[derive(Debug)]
struct Rope {
    /// `[max_seq_len, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn new(head_dim: i64, max_seq_len: i64, theta: f64) -> Rope {
        let float = (Kind::Float, tch::Device::Cpu);
        // 1 / theta^(2i / head_dim), as torchtitan computes it (float32).
        let exponents = Tensor::arange_start_step(0, head_dim, 2, float) / head_dim as f64;
        let freqs = Tensor::from(theta as f32).pow(&exponents).reciprocal();
        let angles = Tensor::arange(max_seq_len, float).outer(&freqs);
        Rope {
            cos: angles.cos(),
            sin: angles.sin(),
        }
    }

    /// `x` `[batch, seq, heads, head_dim]`, each position's heads rotated.
    fn apply(&self, x: &Tensor) -> Tensor {
        let size = x.size();
        let (t, half) = (size[1], size[3] / 2);
        // [seq, 1, head_dim / 2]: broadcast over the batch and the heads.
        let cos = self.cos.narrow(0, 0, t).unsqueeze(1);
        let sin = self.sin.narrow(0, 0, t).unsqueeze(1);
        let pairs = x.view([size[0], t, size[2], half, 2]);
        let (re, im) = (pairs.select(-1, 0), pairs.select(-1, 1));
        Tensor::stack(&[&re * &cos - &im * &sin, &re * &sin + &im * &cos], -1).view(size.as_slice())
    }
}

/// Causal self-attention, no biases. Column-parallel `wq`/`wk`/`wv` leave each tp rank its
/// `n_heads / tp` heads (their rows), so the local head count is read off the projections'
/// width; the row-parallel `wo` sums the ranks' parts.
#[derive(Debug, Shardable)]
pub struct Attention {
    pub wq: nn::Linear,
    pub wk: nn::Linear,
    pub wv: nn::Linear,
    pub wo: nn::Linear,
    #[shardable(skip)]
    head_dim: i64,
    #[shardable(skip)]
    rope: Rope,
}

impl Module for Attention {
    /// `[batch, seq, dim]` to `[batch, seq, dim]`.
    fn forward(&self, x: &Tensor) -> Tensor {
        let size = x.size();
        let (b, t) = (size[0], size[1]);
        // [batch, seq, local heads, head_dim]: this rank's heads (all of them at tp 1).
        let heads = |z: Tensor| z.view([b, t, -1, self.head_dim]);
        let q = self.rope.apply(&heads(self.wq.call(x)));
        let k = self.rope.apply(&heads(self.wk.call(x)));
        let v = heads(self.wv.call(x));
        // PyTorch's F.scaled_dot_product_attention(q, k, v, is_causal=True) over
        // [batch, heads, seq, head_dim], through tch-dist's: inside a context_parallel
        // region (`--cp`), ring attention over the cp ranks' parts of the sequence.
        let y = tch_dist::nn::scaled_dot_product_attention(
            &q.transpose(1, 2),
            &k.transpose(1, 2),
            &v.transpose(1, 2),
            None,
            0.0,
            true,
            None,
        );
        self.wo
            .call(&y.transpose(1, 2).contiguous().view([b, t, -1]))
    }
}

/// SwiGLU: `w2(silu(w1(x)) * w3(x))`; w1 and w3 column-parallel, w2 row-parallel.
#[derive(Debug, Shardable)]
pub struct FeedForward {
    pub w1: nn::Linear,
    pub w2: nn::Linear,
    pub w3: nn::Linear,
}

impl Module for FeedForward {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.w2.call(&(self.w1.call(x).silu() * self.w3.call(x)))
    }
}

/// A pre-norm block: `h = x + attention(attention_norm(x))`, `h + feed_forward(ffn_norm(h))`
/// (torchtitan's names: `feed_forward` in a dense block, `moe` in a MoE block).
#[derive(Debug, Shardable)]
pub struct TransformerBlock {
    pub attention_norm: RmsNorm,
    pub attention: Attention,
    pub ffn_norm: RmsNorm,
    /// The dense feed-forward (`None` in a MoE block).
    pub feed_forward: Option<FeedForward>,
    /// The mixture of experts in place of the feed-forward (`--moe`).
    pub moe: Option<MoE>,
}

impl Module for TransformerBlock {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = x + self.attention.call(&self.attention_norm.call(x));
        let n = self.ffn_norm.call(&h);
        let f = match (&self.moe, &self.feed_forward) {
            (Some(moe), _) => moe.call(&n),
            (None, Some(ffn)) => ffn.call(&n),
            (None, None) => n.zeros_like(),
        };
        &h + f
    }
}

/// The decoder: token ids `[batch, seq]` to next-token logits `[batch, seq, vocab]`.
#[derive(Debug, Shardable)]
pub struct Transformer {
    pub tok_embeddings: nn::Embedding,
    pub layers: Vec<TransformerBlock>,
    pub norm: RmsNorm,
    pub output: nn::Linear,
}

impl Transformer {
    /// Every layer's RoPE tables (`[max_seq_len, head_dim / 2]`, indexed by position):
    /// buffers that context parallelism splits with the tokens, so that each rank rotates
    /// its positions by their own angles (as PyTorch's `freqs_cis` buffer).
    pub fn rope_tables(&self) -> Vec<&Tensor> {
        self.layers
            .iter()
            .flat_map(|l| [&l.attention.rope.cos, &l.attention.rope.sin])
            .collect()
    }

    /// torchtitan's initialization (`init_weights`, depth-scaled): the embedding N(0, 1),
    /// wq/wk/wv/w1 N(0, 0.02), wo/w2/w3 N(0, 0.02 / sqrt(2 * (layer + 1))), the output
    /// N(0, dim^-0.5), norms 1 (normal rather than torchtitan's truncated normal: tch has
    /// no truncated initializer, and at 3 sigma the two barely differ).
    pub fn new(p: &nn::Path, c: &Config) -> Result<Transformer, MoeError> {
        let linear = |p: nn::Path, i: i64, o: i64, std: f64| {
            let config = nn::LinearConfig {
                ws_init: nn::Init::Randn {
                    mean: 0.0,
                    stdev: std,
                },
                bs_init: None,
                bias: false,
            };
            nn::linear(p, i, o, config)
        };
        let layers = (0..c.n_layers)
            .map(|i| -> Result<TransformerBlock, MoeError> {
                let l = p / "layers" / i;
                let deep = 0.02 / (2.0 * (i as f64 + 1.0)).sqrt();
                let (a, f) = (&l / "attention", &l / "feed_forward");
                let (feed_forward, moe) = match &c.moe {
                    None => (
                        Some(FeedForward {
                            w1: linear(&f / "w1", c.dim, c.hidden_dim, 0.02),
                            w2: linear(&f / "w2", c.hidden_dim, c.dim, deep),
                            w3: linear(&f / "w3", c.dim, c.hidden_dim, deep),
                        }),
                        None,
                    ),
                    Some(s) => {
                        let config = MoeConfig {
                            shared_hidden: Some(s.expert_hidden),
                            ..MoeConfig::new(c.dim, s.expert_hidden, s.experts, s.top_k)
                        };
                        (None, Some(MoE::new(&l / "moe", config)?))
                    }
                };
                Ok(TransformerBlock {
                    attention_norm: RmsNorm::new(&l / "attention_norm", c.dim, c.norm_eps),
                    attention: Attention {
                        wq: linear(&a / "wq", c.dim, c.dim, 0.02),
                        wk: linear(&a / "wk", c.dim, c.dim, 0.02),
                        wv: linear(&a / "wv", c.dim, c.dim, 0.02),
                        wo: linear(&a / "wo", c.dim, c.dim, deep),
                        head_dim: c.head_dim(),
                        rope: Rope::new(c.head_dim(), c.max_seq_len, c.rope_theta),
                    },
                    ffn_norm: RmsNorm::new(&l / "ffn_norm", c.dim, c.norm_eps),
                    feed_forward,
                    moe,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let embedding = nn::EmbeddingConfig {
            ws_init: nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
            ..Default::default()
        };
        Ok(Transformer {
            tok_embeddings: nn::embedding(p / "tok_embeddings", c.vocab_size, c.dim, embedding),
            layers,
            norm: RmsNorm::new(p / "norm", c.dim, c.norm_eps),
            output: linear(p / "output", c.dim, c.vocab_size, (c.dim as f64).powf(-0.5)),
        })
    }
}

impl Module for Transformer {
    fn forward(&self, ids: &Tensor) -> Tensor {
        let h = self
            .layers
            .iter()
            .fold(self.tok_embeddings.call(ids), |h, layer| layer.call(&h));
        self.output.call(&self.norm.call(&h))
    }
}

/// What [`tp_plan`] plans for.
#[derive(Debug, Clone, Copy)]
pub struct PlanFor {
    pub n_layers: usize,
    /// torchtitan's sequence parallelism too.
    pub sequence_parallel: bool,
    /// The output layer's logits left local (`loss_parallel`).
    pub loss_parallel: bool,
    /// MoE blocks: their feed-forwards are experts, left out of the plan.
    pub moe: bool,
}

/// torchtitan's tensor-parallel plan for Llama (`parallelize_llama`'s `apply_tp`), keyed by
/// typed paths: the embedding vocab-parallel, q/k/v and w1/w3 column-parallel (each rank its
/// heads and its hidden features, the outputs left local), wo and w2 row-parallel, the
/// output column-parallel and gathered, so that every tp rank holds the whole logits
/// (without `loss_parallel`).
///
/// Without sequence parallelism the activations between the tensor-parallel regions are
/// whole on every tp rank (the row-parallel partial sums all-reduced: two all-reduces per
/// layer in forward). With it (`sequence_parallel`, torchtitan's plan as it is) they are
/// each rank's chunk of the sequence (dim 1): the embedding and wo/w2 reduce-scatter their
/// partial sums along the sequence, the norms run on the chunk (`SequenceParallel`, their
/// weights' gradients summed over tp), attention and the feed-forward all-gather their
/// input first (`PrepareModuleInput`), and the output layer gathers its input: the same
/// values, the activations between the regions and the norms' work divided by tp.
///
/// With `loss_parallel` the output layer leaves its logits local (each tp rank its columns
/// of the vocabulary), for `tch_dist::sharding::loss_parallel`: the whole logits, the
/// largest activation, are never gathered.
pub fn tp_plan(what: &PlanFor) -> ParallelizePlan {
    let PlanFor {
        n_layers,
        sequence_parallel,
        loss_parallel,
        moe,
    } = *what;
    let p = Transformer::path();
    let (local, replicate, seq) = (Layout::Shard(-1), Layout::Replicate, Layout::Shard(1));
    // Where a row-parallel layer's partial sums go: summed whole, or reduce-scattered
    // along the sequence.
    let between = if sequence_parallel { seq } else { replicate };
    let rowwise = |input_layouts| RowwiseParallel {
        input_layouts,
        output_layouts: between,
        ..Default::default()
    };
    let mut plan = ParallelizePlan::new().style(p.tok_embeddings(), rowwise(replicate));
    for i in 0..n_layers {
        let layer = p.layers().at(i);
        let (a, f) = (layer.attention(), layer.feed_forward());
        if sequence_parallel {
            let gather = || PrepareModuleInput::new([Some(seq)], [Some(replicate)]);
            plan = plan
                .style(layer.attention_norm(), SequenceParallel::default())
                .style(a.clone(), gather())
                .style(layer.ffn_norm(), SequenceParallel::default())
                .style(f.clone(), gather());
        }
        plan = plan
            .style(a.wq(), ColwiseParallel::default())
            .style(a.wk(), ColwiseParallel::default())
            .style(a.wv(), ColwiseParallel::default())
            .style(a.wo(), rowwise(local));
        // A MoE block's experts are not tensor-parallel (no expert x tensor parallelism):
        // every tp rank runs them whole on the same tokens.
        if !moe {
            plan = plan
                .style(f.w1(), ColwiseParallel::default())
                .style(f.w2(), rowwise(local))
                .style(f.w3(), ColwiseParallel::default());
        }
    }
    if sequence_parallel {
        plan = plan.style(p.norm(), SequenceParallel::default());
    }
    plan.style(
        p.output(),
        ColwiseParallel {
            input_layouts: between,
            output_layouts: if loss_parallel { local } else { replicate },
            ..Default::default()
        },
    )
}

/// The model's tensors under Hugging Face's names, as torchtitan's state-dict adapters write
/// them (`to_hf`, for `last_save_in_hf`): Llama's for the dense parts
/// (`model.embed_tokens`, `model.layers.N.self_attn.{q,k,v,o}_proj`,
/// `model.layers.N.{input,post_attention}_layernorm`, `model.layers.N.mlp.{gate,up,down}_proj`,
/// `model.norm`, `lm_head`) and DeepSeek-V3's for a MoE block ([`MoE::hf_state_dict`]).
/// `full` is every tensor whole (`state_dict::full_state_dict`), copied into a plain model
/// of `c` first (every one of its variables, or an error). `wq` and `wk` are permuted per
/// head from torchtitan's interleaved rotary pairs to HF's halves (`rotate_half`).
pub fn hf_state_dict(
    c: &Config,
    full: &[(String, Tensor)],
) -> Result<Vec<(String, Tensor)>, String> {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let plain = Transformer::new(&vs.root(), c).map_err(|e| e.to_string())?;
    let mut vars = vs.variables();
    let full: std::collections::HashMap<&str, &Tensor> =
        full.iter().map(|(n, t)| (n.as_str(), t)).collect();
    tch::no_grad(|| {
        for (name, var) in vars.iter_mut() {
            let whole = full
                .get(name.as_str())
                .ok_or_else(|| format!("no `{name}` in the full state dict"))?;
            var.copy_(whole);
        }
        Ok::<(), String>(())
    })?;
    // torchtitan's `_permute`: each head's rows (2i, 2i + 1) become (i, i + head_dim / 2).
    let rotary = |w: &Tensor| {
        let (rows, cols) = (w.size()[0], w.size()[1]);
        w.view([c.n_heads, rows / c.n_heads / 2, 2, cols])
            .transpose(1, 2)
            .reshape([rows, cols])
    };
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        plain.tok_embeddings.ws.shallow_clone(),
    )];
    for (i, layer) in plain.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let a = &layer.attention;
        out.extend([
            (format!("{p}.self_attn.q_proj.weight"), rotary(&a.wq.ws)),
            (format!("{p}.self_attn.k_proj.weight"), rotary(&a.wk.ws)),
            (
                format!("{p}.self_attn.v_proj.weight"),
                a.wv.ws.shallow_clone(),
            ),
            (
                format!("{p}.self_attn.o_proj.weight"),
                a.wo.ws.shallow_clone(),
            ),
            (
                format!("{p}.input_layernorm.weight"),
                layer.attention_norm.weight.shallow_clone(),
            ),
            (
                format!("{p}.post_attention_layernorm.weight"),
                layer.ffn_norm.weight.shallow_clone(),
            ),
        ]);
        if let Some(moe) = &layer.moe {
            out.extend(moe.hf_state_dict(&format!("{p}.mlp")));
        }
        if let Some(f) = &layer.feed_forward {
            out.extend([
                (format!("{p}.mlp.gate_proj.weight"), f.w1.ws.shallow_clone()),
                (format!("{p}.mlp.up_proj.weight"), f.w3.ws.shallow_clone()),
                (format!("{p}.mlp.down_proj.weight"), f.w2.ws.shallow_clone()),
            ]);
        }
    }
    out.push((
        "model.norm.weight".into(),
        plain.norm.weight.shallow_clone(),
    ));
    out.push(("lm_head.weight".into(), plain.output.ws.shallow_clone()));
    // Contiguous copies: an expert's slice of the 3-D weights is a view.
    Ok(out
        .into_iter()
        .map(|(n, t)| (n, t.contiguous().copy()))
        .collect())
}
