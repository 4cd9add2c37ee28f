//! The FSDP x TP model of tests/fully_shard/two_d.rs and gpu_check's mesh check, included
//! with `#[path]`: a vocab-parallel embedding, Megatron MLP blocks (column- then
//! row-parallel) with residuals, a norm that only fully_shard shards, and a column-parallel
//! head gathered; torchtitan's tensor-parallel plan for it, and PyTorch's order of applying
//! the two (tests/fully_shard/pytorch_load_2d.py is the same model in PyTorch).

#![allow(dead_code)] // each includer uses part of it

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_dist::device_mesh::DeviceMesh;
use tch_dist::sharding::{
    parallelize_module, ColwiseParallel, Layout, ParallelizePlan, RowwiseParallel,
};
use tch_dist::{fully_shard, Call, FsdpOptions, Shardable};

/// Vocabulary (11 rows: 6 and 5 over tp 2), model width, MLP width, tokens per sequence.
pub const VOCAB: i64 = 11;
pub const WIDTH: i64 = 8;
pub const HIDDEN: i64 = 14;
pub const TOKENS: i64 = 5;
/// The whole batch; each dp rank trains on its half.
pub const BATCH: i64 = 4;

#[derive(Debug, Shardable)]
pub struct Mlp {
    pub fc1: nn::Linear,
    pub fc2: nn::Linear,
    /// Runs `fc2` with `forward`, bypassing its hooks (what the refusals test).
    #[shardable(skip)]
    pub bypass_fc2: bool,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self.fc1.call(xs).gelu("none");
        let y = if self.bypass_fc2 {
            self.fc2.forward(&h)
        } else {
            self.fc2.call(&h)
        };
        xs + y
    }
}

#[derive(Debug, Shardable)]
pub struct Lm {
    pub tok: nn::Embedding,
    pub blocks: Vec<Mlp>,
    pub norm: nn::LayerNorm,
    pub head: nn::Linear,
}

impl Module for Lm {
    fn forward(&self, ids: &Tensor) -> Tensor {
        let h = self
            .blocks
            .iter()
            .fold(self.tok.call(ids), |h, b| b.call(&h));
        self.head.call(&self.norm.call(&h))
    }
}

pub fn lm(vs: &nn::VarStore) -> Lm {
    let p = vs.root();
    let linear = |p: nn::Path, i, o| nn::linear(p, i, o, Default::default());
    Lm {
        tok: nn::embedding(&p / "tok", VOCAB, WIDTH, Default::default()),
        blocks: (0..2)
            .map(|i| Mlp {
                fc1: linear(&p / "blocks" / i / "fc1", WIDTH, HIDDEN),
                fc2: linear(&p / "blocks" / i / "fc2", HIDDEN, WIDTH),
                bypass_fc2: false,
            })
            .collect(),
        norm: nn::layer_norm(&p / "norm", vec![WIDTH], Default::default()),
        head: linear(&p / "head", WIDTH, VOCAB),
    }
}

/// The whole batch of `step` (ids and next-token targets) on `device`, the same on every
/// rank.
pub fn batch(step: usize, device: Device) -> (Tensor, Tensor) {
    tch::manual_seed(900 + step as i64);
    let ids = Tensor::randint(VOCAB, [BATCH, TOKENS + 1], (Kind::Int64, Device::Cpu)).to(device);
    (ids.narrow(1, 0, TOKENS), ids.narrow(1, 1, TOKENS))
}

pub fn loss(logits: &Tensor, targets: &Tensor) -> Tensor {
    logits
        .view([-1, VOCAB])
        .cross_entropy_for_logits(&targets.reshape([-1]))
}

/// The tensor-parallel plan of torchtitan's Llama, on this model.
pub fn tp_plan() -> ParallelizePlan {
    let mut plan = ParallelizePlan::new().style(
        "tok",
        RowwiseParallel {
            input_layouts: Layout::Replicate,
            ..Default::default()
        },
    );
    for i in 0..2 {
        plan = plan
            .style(
                format!("blocks.{i}.fc1").as_str(),
                ColwiseParallel::default(),
            )
            .style(
                format!("blocks.{i}.fc2").as_str(),
                RowwiseParallel::default(),
            );
    }
    plan.style(
        "head",
        ColwiseParallel {
            output_layouts: Layout::Replicate,
            ..Default::default()
        },
    )
}

/// TP over the mesh's `tp` dim, then fully_shard per block and on the root over `dp`.
pub fn fsdp_x_tp(m: &mut Lm, mesh: &DeviceMesh) -> Result<(), String> {
    let report = |e: &dyn std::error::Error| e.to_string();
    let tp = mesh.dim("tp").map_err(|e| report(&e))?;
    parallelize_module(m, &tp, &tp_plan()).map_err(|e| tch_dist::report(&e))?;
    let dp = mesh.dim("dp").map_err(|e| report(&e))?;
    let opts = || FsdpOptions {
        mesh: Some(dp.clone()),
        ..Default::default()
    };
    for b in &m.blocks {
        fully_shard(b, opts()).map_err(|e| tch_dist::report(&e))?;
    }
    fully_shard(&*m, opts()).map_err(|e| tch_dist::report(&e))?;
    Ok(())
}

/// `t`'s rows of this dp rank.
pub fn dp_rows(t: &Tensor, mesh: &DeviceMesh) -> Tensor {
    let n = BATCH / mesh.size("dp").unwrap() as i64;
    t.narrow(0, mesh.get_local_rank("dp").unwrap() as i64 * n, n)
}
