//! The model of Linear blocks the fully_shard tests shard one group per block
//! (`fully_shard.rs`, `steps.rs`), included with `#[path]`: `blocks.i` → tanh, chained, then
//! `head`.

#![allow(dead_code)] // each includer uses part of it

use tch::nn::{self, Module};
use tch::Tensor;
use tch_dist::{Call, Shardable};

#[derive(Debug, Shardable)]
pub struct Blocks {
    pub blocks: Vec<nn::Linear>,
    pub head: nn::Linear,
}

impl Module for Blocks {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self
            .blocks
            .iter()
            .fold(xs.shallow_clone(), |h, b| b.call(&h).tanh());
        self.head.call(&h)
    }
}

/// Layers of widths `dims` under `root`: blocks `dims[i]` → `dims[i + 1]` for all but the
/// last pair, which is the head's.
pub fn blocks(root: &nn::Path, dims: &[i64]) -> Blocks {
    let n = dims.len();
    Blocks {
        blocks: (0..n - 2)
            .map(|i| {
                nn::linear(
                    root / "blocks" / i,
                    dims[i],
                    dims[i + 1],
                    Default::default(),
                )
            })
            .collect(),
        head: nn::linear(root / "head", dims[n - 2], dims[n - 1], Default::default()),
    }
}
