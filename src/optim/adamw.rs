//! [`AdamW`]: torch.optim.AdamW's settings, and its step with libtorch's `_fused_adamw_`.

use std::collections::BTreeMap;

use tch::{Kind, Tensor};
use tch_dist_runtime::kernels::{self as fused, AdamWHyper};

use super::{OptimError, Optimizer, ParamState};

/// AdamW (decoupled weight decay): torch.optim.AdamW's settings and defaults
/// (`betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False`; lr 1e-3 is given to
/// `build`), built in tch's style. Its state per parameter is `step` (a float32 scalar
/// tensor, as PyTorch's), `exp_avg`, `exp_avg_sq` and, with amsgrad, `max_exp_avg_sq`.
///
/// ```no_run
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let opt = tch_dist::optim::AdamW::default().build(&vs, 1e-3)?;
/// # let _ = opt;
/// # Ok::<(), tch_dist::optim::OptimError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// The moments' decay rates.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Keep the running maximum of the second moment.
    pub amsgrad: bool,
    /// Maximize the objective: the moments are taken of `-grad` (the update then moves the
    /// parameters along +grad; the decoupled weight decay still shrinks them), as
    /// torch.optim.AdamW's `maximize=True`; `.grad` itself is left as it is.
    ///
    /// ```no_run
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let opt = tch_dist::optim::AdamW { maximize: true, ..Default::default() }.build(&vs, 1e-3)?;
    /// # let _ = opt;
    /// # Ok::<(), tch_dist::optim::OptimError>(())
    /// ```
    pub maximize: bool,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
            amsgrad: false,
            maximize: false,
        }
    }
}

impl AdamW {
    /// An optimizer over `vs`'s trainable variables (those that require grad now) with
    /// learning rate `lr`, after PyTorch's checks of the settings.
    ///
    /// ```no_run
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let bad = tch_dist::optim::AdamW { betas: (0.9, 1.0), ..Default::default() };
    /// assert_eq!(bad.build(&vs, 1e-3).unwrap_err().to_string(), "Invalid beta parameter at index 1: 1");
    /// ```
    pub fn build(self, vs: &tch::nn::VarStore, lr: f64) -> Result<Optimizer, OptimError> {
        self.check()?;
        Optimizer::new(vs, lr, super::Algorithm::AdamW(self))
    }

    pub(super) fn check(&self) -> Result<(), OptimError> {
        // PyTorch's `not 0.0 <= x` checks, which refuse NaN too.
        if self.eps.is_nan() || self.eps < 0.0 {
            return Err(OptimError::InvalidEps { eps: self.eps });
        }
        for (index, beta) in [(0, self.betas.0), (1, self.betas.1)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(OptimError::InvalidBeta { index, beta });
            }
        }
        if self.weight_decay.is_nan() || self.weight_decay < 0.0 {
            return Err(OptimError::InvalidWeightDecay {
                weight_decay: self.weight_decay,
            });
        }
        Ok(())
    }

    /// The state names of one parameter.
    pub(super) fn state_names(&self) -> &'static [&'static str] {
        if self.amsgrad {
            &["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
        } else {
            &["exp_avg", "exp_avg_sq", "step"]
        }
    }

    /// One step of the parameters that have a gradient (`ready`: FQN, parameter, gradient);
    /// a parameter's state starts at its first gradient, as in torch.optim.AdamW.
    pub(super) fn step(
        &self,
        lr: f64,
        ready: &[(&str, &Tensor, Tensor)],
        state: &mut BTreeMap<String, ParamState>,
    ) -> Result<(), OptimError> {
        let mut fresh = Vec::new();
        let mut states = Vec::with_capacity(ready.len());
        for (fqn, p, _) in ready {
            let s = match state.get(*fqn) {
                Some(s) => {
                    for name in self.state_names() {
                        let t = s.get(name).ok_or_else(|| OptimError::Mismatch {
                            fqn: fqn.to_string(),
                            what: format!("state `{name}`"),
                            expected: "present".into(),
                            found: "missing".into(),
                        })?;
                        if *name != "step" {
                            super::check_fits(fqn, name, p, t)?;
                        }
                    }
                    s.clone_handles()
                }
                None => {
                    // torch.optim's fused path keeps `step` as a float32 scalar on the
                    // parameter's device.
                    let mut entries = vec![
                        ("exp_avg", p.zeros_like()),
                        ("exp_avg_sq", p.zeros_like()),
                        ("step", Tensor::zeros([], (Kind::Float, p.device()))),
                    ];
                    if self.amsgrad {
                        entries.push(("max_exp_avg_sq", p.zeros_like()));
                    }
                    let s = ParamState::from_entries(entries);
                    fresh.push((fqn.to_string(), s.clone_handles()));
                    s
                }
            };
            states.push(s);
        }
        let list = |name: &str| -> Vec<&Tensor> {
            states
                .iter()
                .filter_map(|s| s.get(name)) // all there (checked or created above)
                .collect()
        };
        let params: Vec<&Tensor> = ready.iter().map(|r| r.1).collect();
        let grads: Vec<&Tensor> = ready.iter().map(|r| &r.2).collect();
        let max = self.amsgrad.then(|| list("max_exp_avg_sq"));
        fused::adamw(
            &params,
            &grads,
            &list("exp_avg"),
            &list("exp_avg_sq"),
            max.as_deref(),
            &list("step"),
            &AdamWHyper {
                lr,
                beta1: self.betas.0,
                beta2: self.betas.1,
                weight_decay: self.weight_decay,
                eps: self.eps,
                amsgrad: self.amsgrad,
                maximize: self.maximize,
            },
        )?;
        // Only a step that ran keeps the new parameters' state.
        state.extend(fresh);
        Ok(())
    }
}
