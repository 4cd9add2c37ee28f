//! The small model the reducer tests train, replicated and as one process (included by
//! `reducer.rs` and `reducer_in_place.rs` with `#[path]`).

#![allow(dead_code)] // each includer uses part of it

use tch::{Device, Kind, Tensor};
use tch_dist_runtime::ProcessGroup;

/// The whole batch; each rank trains on its `BATCH / world_size` rows.
pub const BATCH: i64 = 12;
pub const STEPS: usize = 4;
pub const LR: f64 = 0.1;

/// Which parameters [`Model::new`] creates beyond fc1 (4->8) and fc2 (8->3), both f32.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shape {
    /// An f64 side branch `aux.weight` (4->3).
    pub aux: bool,
    /// `unused.weight`, never touched by forward.
    pub unused: bool,
    /// fc2's weight stored transposed: a non-contiguous leaf.
    pub fc2_transposed: bool,
}

pub struct Model {
    pub params: Vec<(String, Tensor)>,
    shape: Shape,
}

impl Model {
    pub fn new(shape: Shape, seed: i64) -> Model {
        tch::manual_seed(seed);
        let p = |shape: &[i64], kind: Kind| {
            (Tensor::randn(shape, (kind, Device::Cpu)) * 0.5).set_requires_grad(true)
        };
        let fc2 = if shape.fc2_transposed {
            let t = (Tensor::randn([8, 3], (Kind::Float, Device::Cpu)) * 0.5)
                .t_()
                .set_requires_grad(true);
            assert!(!t.is_contiguous());
            t
        } else {
            p(&[3, 8], Kind::Float)
        };
        let mut params = vec![
            ("fc1.weight".to_string(), p(&[8, 4], Kind::Float)),
            ("fc1.bias".to_string(), p(&[8], Kind::Float)),
            ("fc2.weight".to_string(), fc2),
            ("fc2.bias".to_string(), p(&[3], Kind::Float)),
        ];
        if shape.aux {
            params.push(("aux.weight".to_string(), p(&[3, 4], Kind::Double)));
        }
        if shape.unused {
            params.push(("unused.weight".to_string(), p(&[5, 5], Kind::Float)));
        }
        Model { params, shape }
    }

    /// Handles on the parameters, for `Reducer::new`.
    pub fn handles(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    pub fn get(&self, name: &str) -> &Tensor {
        &self.params.iter().find(|(n, _)| n == name).unwrap().1
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let h = x
            .linear(self.get("fc1.weight"), Some(self.get("fc1.bias")))
            .tanh();
        let mut y = h.linear(self.get("fc2.weight"), Some(self.get("fc2.bias")));
        if self.shape.aux {
            y += x
                .to_kind(Kind::Double)
                .linear::<Tensor>(self.get("aux.weight"), None)
                .to_kind(Kind::Float);
        }
        y
    }

    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Tensor {
        self.forward(x).mse_loss(y, tch::Reduction::Mean)
    }

    /// SGD; then `.grad` is set to None (`to_none`) or zeroed in place.
    pub fn sgd_step(&self, to_none: bool) {
        tch::no_grad(|| {
            for (_, p) in &self.params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = p.shallow_clone().f_sub_(&(&g * LR)).unwrap();
                    if to_none {
                        p.shallow_clone().zero_grad();
                    } else {
                        let _ = g.zero_();
                    }
                }
            }
        });
    }

    /// The largest difference with `other`, parameter by parameter, and its name.
    pub fn max_diff(&self, other: &Model) -> (f64, &str) {
        self.params
            .iter()
            .zip(&other.params)
            .map(|((name, a), (_, b))| ((a - b).abs().max().double_value(&[]), name.as_str()))
            .fold((0.0, ""), |m, d| if d.0 > m.0 { d } else { m })
    }
}

/// The whole batch of `step` (inputs, targets), the same on every rank.
pub fn data(step: usize) -> (Tensor, Tensor) {
    tch::manual_seed(1000 + step as i64);
    let x = Tensor::randn([BATCH, 4], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([BATCH, 3], (Kind::Float, Device::Cpu));
    (x, y)
}

/// This rank's rows of a whole batch.
pub fn slice(t: &Tensor, pg: &ProcessGroup) -> Tensor {
    let n = BATCH / pg.world_size() as i64;
    t.narrow(0, pg.rank() as i64 * n, n)
}
