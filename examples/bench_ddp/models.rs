//! The benchmark's three models (and the GPU one), each as bench/pytorch_ddp.py defines it,
//! and what each benchmark needs of a model ([`BenchModel`]).

use super::*;

#[derive(Debug, Shardable)]
pub(crate) struct Mlp {
    pub(crate) layers: Vec<nn::Linear>,
    /// Whether a ReLU follows layer i (false for the last layer).
    #[shardable(skip)]
    pub(crate) relu_after: Vec<bool>,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut h = xs.shallow_clone();
        for (l, relu) in self.layers.iter().zip(&self.relu_after) {
            h = l.call(&h);
            if *relu {
                h = h.relu();
            }
        }
        h
    }
}

/// Layer widths and where ReLUs go for the two MLPs.
pub(crate) fn widths(model: &str) -> Result<(Vec<i64>, Vec<bool>), String> {
    match model {
        // 1024-2048-2048-1024-10: ReLU after every layer but the last.
        "mlp" => Ok((
            vec![1024, 2048, 2048, 1024, 10],
            vec![true, true, true, false],
        )),
        // 12 blocks 2048-8192-2048: ReLU inside each block (after the 8192-wide layer).
        "gpu" => {
            let mut w = vec![2048];
            let mut relu = Vec::new();
            for _ in 0..12 {
                w.extend([8192, 2048]);
                relu.extend([true, false]);
            }
            Ok((w, relu))
        }
        other => Err(format!("{other} is not an MLP")),
    }
}

pub(crate) fn build_mlp(vs: &nn::Path, model: &str) -> Result<Mlp, String> {
    let (w, relu_after) = widths(model)?;
    let layers = w
        .windows(2)
        .enumerate()
        .map(|(i, io)| nn::linear(vs / "layers" / i, io[0], io[1], Default::default()))
        .collect();
    Ok(Mlp { layers, relu_after })
}

// ---- transformer ------------------------------------------------------------------------

/// The transformer's shape: width, blocks, heads, vocabulary, sequence length.
pub(crate) const T_DIM: i64 = 256;
pub(crate) const T_BLOCKS: usize = 6;
pub(crate) const T_HEADS: i64 = 4;
pub(crate) const T_VOCAB: i64 = 128;
pub(crate) const T_SEQ: i64 = 64;

#[derive(Debug, Shardable)]
pub(crate) struct Transformer {
    pub(crate) tok: nn::Embedding,
    pub(crate) pos: nn::Embedding,
    pub(crate) blocks: Vec<Block>,
    pub(crate) ln_f: nn::LayerNorm,
    pub(crate) head: nn::Linear,
    /// Positions 0..seq.
    #[shardable(skip)]
    pub(crate) positions: Tensor,
    /// The causal mask `[seq, seq]`, true above the diagonal (future positions).
    #[shardable(skip)]
    pub(crate) mask: Tensor,
}

impl Transformer {
    fn new(p: &nn::Path) -> Transformer {
        let d = T_DIM;
        let dev = p.device();
        Transformer {
            tok: nn::embedding(p / "tok", T_VOCAB, d, Default::default()),
            pos: nn::embedding(p / "pos", T_SEQ, d, Default::default()),
            blocks: (0..T_BLOCKS)
                .map(|i| Block::new(p / "blocks" / i, T_DIM, T_HEADS))
                .collect(),
            ln_f: nn::layer_norm(p / "ln_f", vec![d], Default::default()),
            head: nn::linear(p / "head", d, T_VOCAB, Default::default()),
            positions: Tensor::arange(T_SEQ, (Kind::Int64, dev)),
            // Not a buffer (nothing to broadcast); each block takes it as its second input.
            mask: Tensor::ones([T_SEQ, T_SEQ], (Kind::Bool, dev)).triu(1),
        }
    }
}

impl Module for Transformer {
    /// Token ids `[batch, seq]` to logits `[batch, seq, vocab]`.
    fn forward(&self, idx: &Tensor) -> Tensor {
        let mut x = self.tok.call(idx) + self.pos.call(&self.positions);
        for b in &self.blocks {
            // Two inputs through `call_with`: the block's hooks (fully_shard's, replicate's)
            // run as for `call`.
            x = b.call_with([&x, &self.mask], |b, [x, mask]| b.forward(x, Some(mask)));
        }
        self.head.call(&self.ln_f.call(&x))
    }
}

// ---- convnet ----------------------------------------------------------------------------

/// Output channels and stride of the convnet's nine blocks (3x3 convolutions, padding 1).
pub(crate) const CONV: [(i64, i64); 9] = [
    (32, 1),
    (32, 1),
    (32, 1),
    (64, 2),
    (64, 1),
    (64, 1),
    (128, 2),
    (128, 1),
    (128, 1),
];

/// conv (no bias) + BatchNorm2d; a ReLU follows.
#[derive(Debug, Shardable)]
pub(crate) struct ConvBlock {
    pub(crate) conv: nn::Conv2D,
    pub(crate) bn: nn::BatchNorm,
}

#[derive(Debug, Shardable)]
pub(crate) struct Convnet {
    pub(crate) blocks: Vec<ConvBlock>,
    pub(crate) head: nn::Linear,
}

impl Convnet {
    fn new(p: &nn::Path) -> Convnet {
        let mut cin = 3;
        let mut blocks = Vec::new();
        for (i, &(cout, stride)) in CONV.iter().enumerate() {
            let q = p / "blocks" / i;
            let cfg = nn::ConvConfig {
                stride,
                padding: 1,
                bias: false,
                ..Default::default()
            };
            blocks.push(ConvBlock {
                conv: nn::conv2d(&q / "conv", cin, cout, 3, cfg),
                bn: nn::batch_norm2d(&q / "bn", cout, Default::default()),
            });
            cin = cout;
        }
        let head = nn::linear(p / "head", cin, 10, Default::default());
        Convnet { blocks, head }
    }
}

impl ModuleT for Convnet {
    /// Images `[batch, 3, 32, 32]` to logits `[batch, 10]`.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut h = xs.shallow_clone();
        for b in &self.blocks {
            h = b.bn.call_t(&b.conv.call(&h), train).relu();
        }
        let pooled = h.mean_dim(&[2i64, 3][..], false, Kind::Float);
        self.head.call(&pooled)
    }
}

// ---- what each benchmark needs of a model ------------------------------------------------

/// A benchmark model: built into a `VarStore` path, with one fixed batch of inputs and
/// targets per rank and its loss.
pub(crate) trait BenchModel: ModuleT + Shardable + Sized + 'static {
    fn build(vs: &nn::Path, name: &str) -> Result<Self, String>;
    /// The model's default batch size (per rank).
    fn default_batch() -> i64;
    /// One batch of inputs and targets.
    fn batch(name: &str, batch: i64, device: Device) -> Result<(Tensor, Tensor), String>;
    fn loss(name: &str, out: &Tensor, target: &Tensor) -> Tensor;
    /// `fully_shard` on each block (bottom-up; the `--mode fully_shard` groups); the root's
    /// call follows. Returns how many blocks.
    fn shard_blocks(&self) -> Result<usize, tch_dist::fully_shard::FsdpError>;
    /// `checkpoint_activations` on each block (`--activation-checkpointing`, before
    /// `shard_blocks`, as torchtitan applies them); the transformer's only.
    fn checkpoint_blocks(&self) -> Result<usize, String> {
        Err("--activation-checkpointing: the transformer's blocks only".into())
    }
}

/// `fully_shard` with the defaults on each of `blocks`.
pub(crate) fn shard_each<B: Shardable>(
    blocks: &[B],
) -> Result<usize, tch_dist::fully_shard::FsdpError> {
    for b in blocks {
        fully_shard(b, FsdpOptions::default())?;
    }
    Ok(blocks.len())
}

impl BenchModel for Mlp {
    fn build(vs: &nn::Path, name: &str) -> Result<Self, String> {
        build_mlp(vs, name)
    }
    fn default_batch() -> i64 {
        64
    }
    fn batch(name: &str, batch: i64, device: Device) -> Result<(Tensor, Tensor), String> {
        let w = widths(name)?.0;
        let x = Tensor::randn([batch, w[0]], (Kind::Float, device));
        // Drawn in this order on both sides (the class targets, then the regression ones).
        let y_class = Tensor::randint(10, [batch], (Kind::Int64, device));
        let y_reg = Tensor::randn([batch, w[w.len() - 1]], (Kind::Float, device));
        Ok((x, if name == "mlp" { y_class } else { y_reg }))
    }
    fn loss(name: &str, out: &Tensor, target: &Tensor) -> Tensor {
        if name == "mlp" {
            out.cross_entropy_for_logits(target)
        } else {
            out.mse_loss(target, tch::Reduction::Mean)
        }
    }
    fn shard_blocks(&self) -> Result<usize, tch_dist::fully_shard::FsdpError> {
        // Each layer a group; the root then manages nothing, which is fine.
        shard_each(&self.layers)
    }
}

impl BenchModel for Transformer {
    fn build(vs: &nn::Path, _name: &str) -> Result<Self, String> {
        Ok(Transformer::new(vs))
    }
    fn default_batch() -> i64 {
        2
    }
    fn batch(_name: &str, batch: i64, device: Device) -> Result<(Tensor, Tensor), String> {
        let idx = Tensor::randint(T_VOCAB, [batch, T_SEQ], (Kind::Int64, device));
        let next = Tensor::randint(T_VOCAB, [batch, T_SEQ], (Kind::Int64, device));
        Ok((idx, next))
    }
    fn loss(_name: &str, out: &Tensor, target: &Tensor) -> Tensor {
        out.view([-1, T_VOCAB])
            .cross_entropy_for_logits(&target.view([-1]))
    }
    fn shard_blocks(&self) -> Result<usize, tch_dist::fully_shard::FsdpError> {
        // The root manages the embeddings, the final LayerNorm and the head.
        shard_each(&self.blocks)
    }
    fn checkpoint_blocks(&self) -> Result<usize, String> {
        for b in &self.blocks {
            tch_dist::checkpoint_activations(b, tch_dist::CheckpointOptions::default())
                .map_err(|e| tch_dist::report(&e))?;
        }
        Ok(self.blocks.len())
    }
}

impl BenchModel for Convnet {
    fn build(vs: &nn::Path, _name: &str) -> Result<Self, String> {
        Ok(Convnet::new(vs))
    }
    fn default_batch() -> i64 {
        8
    }
    fn batch(_name: &str, batch: i64, device: Device) -> Result<(Tensor, Tensor), String> {
        let x = Tensor::randn([batch, 3, 32, 32], (Kind::Float, device));
        let y = Tensor::randint(10, [batch], (Kind::Int64, device));
        Ok((x, y))
    }
    fn loss(_name: &str, out: &Tensor, target: &Tensor) -> Tensor {
        out.cross_entropy_for_logits(target)
    }
    fn shard_blocks(&self) -> Result<usize, tch_dist::fully_shard::FsdpError> {
        shard_each(&self.blocks)
    }
}
