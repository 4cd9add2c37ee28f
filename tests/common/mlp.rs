//! The two-layer MLP (`fc1` → activation → `fc2`) the hook tests (`hooks.rs`) and the
//! tensor-parallel tests (`sharding.rs`) build, included with `#[path]`: its children run
//! through `call`, so hooks and sharders on them see every forward.

#![allow(dead_code)] // each includer uses part of it

use tch::nn::{self, Module};
use tch::Tensor;
use tch_dist::{Call, Shardable};

/// What runs between `fc1` and `fc2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Relu,
    /// `gelu("none")`: the exact GELU, PyTorch's default.
    Gelu,
}

#[derive(Debug, Shardable)]
pub struct Mlp {
    pub fc1: nn::Linear,
    pub fc2: nn::Linear,
    #[shardable(skip)]
    pub activation: Activation,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let h = self.fc1.call(xs);
        let h = match self.activation {
            Activation::Relu => h.relu(),
            Activation::Gelu => h.gelu("none"),
        };
        self.fc2.call(&h)
    }
}

/// `in_dim` → `hidden` → `out` under `root` (`root/fc1`, `root/fc2`), tch's default init.
pub fn mlp(root: &nn::Path, in_dim: i64, hidden: i64, out: i64, activation: Activation) -> Mlp {
    Mlp {
        fc1: nn::linear(root / "fc1", in_dim, hidden, Default::default()),
        fc2: nn::linear(root / "fc2", hidden, out, Default::default()),
        activation,
    }
}
