//! The pipeline tests' model, included with `#[path]` by tests/pipelining/composition.rs and
//! gpu_check's pipeline check (so that the GPU run checks the model CPU CI checks): linear
//! layers `layers.<i>`, tanh after each but the last. A stage's part holds its own layers and
//! `None` for the others' (torchtitan's deleted layers), so that its FQNs are the whole
//! model's (`layers.2.weight` on the stage that holds layer 2).

use tch::nn::{self, Module};
use tch::Tensor;
use tch_dist::{Call, Shardable};

/// The whole model's layers, or a stage's part of them.
#[derive(Debug, Shardable)]
pub struct Chain {
    layers: Vec<Option<nn::Linear>>,
}

impl Chain {
    /// The layers `holds(i)` keeps of a chain of widths `dims` (layer `i` maps `dims[i]`
    /// features to `dims[i + 1]`), built in `vs` under the whole model's paths.
    pub fn new(vs: &nn::VarStore, dims: &[i64], holds: impl Fn(usize) -> bool) -> Chain {
        let root = vs.root() / "layers";
        Chain {
            layers: (0..dims.len() - 1)
                .map(|i| {
                    holds(i)
                        .then(|| nn::linear(&root / i, dims[i], dims[i + 1], Default::default()))
                })
                .collect(),
        }
    }
}

impl Module for Chain {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let last = self.layers.len() - 1;
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.as_ref().map(|l| (i, l)))
            .fold(xs.shallow_clone(), |h, (i, l)| {
                let y = l.call(&h);
                if i == last {
                    y
                } else {
                    y.tanh()
                }
            })
    }
}
