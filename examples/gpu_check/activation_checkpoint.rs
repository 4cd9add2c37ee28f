//! Check 8, activation checkpointing on the device: a block with dropout, checkpointed,
//! trains as the same block without checkpointing (the device's RNG state restored for the
//! recomputation, so the dropout masks agree), in a one-rank `fully_shard` group (its
//! parameters gathered on the device for the recomputation).

use super::*;
use tch::nn::ModuleT;
use tch_dist::{checkpoint_activations, CallT, CheckpointOptions, ShallowClone, Shardable};

#[derive(Debug, Shardable, ShallowClone)]
struct DropBlock {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl ModuleT for DropBlock {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let h = x.apply(&self.fc1).gelu("none").dropout(0.3, train);
        x + h.apply(&self.fc2)
    }
}

fn block(vs: &nn::VarStore) -> DropBlock {
    DropBlock {
        fc1: nn::linear(vs.root() / "fc1", 64, 256, Default::default()),
        fc2: nn::linear(vs.root() / "fc2", 256, 64, Default::default()),
    }
}

pub(crate) fn check_activation_checkpointing(pg: &ProcessGroup) -> Outcome {
    use tch_dist::{fully_shard, FsdpOptions};
    let mut finals = Vec::new();
    for checkpointed in [false, true] {
        tch::manual_seed(5);
        let vs = nn::VarStore::new(dev());
        let b = block(&vs);
        if checkpointed {
            checkpoint_activations(&b, CheckpointOptions::default()).unwrap();
        }
        let opts = FsdpOptions {
            process_group: Some(pg.clone()),
            ..Default::default()
        };
        fully_shard(&b, opts).unwrap();
        let mut opt = nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        }
        .build(&vs, 0.05)
        .unwrap();
        for step in 0..3 {
            tch::manual_seed(100 + step);
            let x = Tensor::randn([32, 64], (Kind::Float, dev()));
            let loss = b.call_t(&x, true).square().mean(Kind::Float);
            opt.backward_step(&loss);
        }
        let mut values: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.detach().to_device(Device::Cpu)))
            .collect();
        values.sort_by(|a, b| a.0.cmp(&b.0));
        finals.push(values);
    }
    for ((name, a), (_, b)) in finals[0].iter().zip(&finals[1]) {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(
            diff < 1e-5,
            "{name}: checkpointed training differs by {diff}"
        );
    }
    Outcome::Pass
}
