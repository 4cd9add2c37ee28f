//! [`Sgd`]: torch.optim.SGD's settings, and its step with libtorch's `_fused_sgd_`.

use std::collections::BTreeMap;

use tch::Tensor;
use tch_dist_runtime::kernels::{self as fused, SgdHyper};

use super::{OptimError, Optimizer, ParamState};

/// SGD with momentum, dampening, Nesterov momentum, weight decay and `maximize`:
/// torch.optim.SGD's settings and defaults (`momentum=0, dampening=0, weight_decay=0,
/// nesterov=False, maximize=False`), built
/// in tch's style. Its state per parameter is `momentum_buffer` (none without momentum).
///
/// ```no_run
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let opt = tch_dist::optim::Sgd { momentum: 0.9, nesterov: true, ..Default::default() }.build(&vs, 0.1)?;
/// # let _ = opt;
/// # Ok::<(), tch_dist::optim::OptimError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sgd {
    /// Momentum factor (0: plain SGD, no state).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs a momentum and no dampening).
    pub nesterov: bool,
    /// Maximize the objective: the gradient is negated for the update (weight decay and
    /// momentum then apply to `-grad`), as torch.optim.SGD's `maximize=True`; `.grad` itself
    /// is left as it is.
    ///
    /// ```no_run
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// // Gradient ascent: each step moves the parameters along +grad.
    /// let opt = tch_dist::optim::Sgd { maximize: true, ..Default::default() }.build(&vs, 0.1)?;
    /// # let _ = opt;
    /// # Ok::<(), tch_dist::optim::OptimError>(())
    /// ```
    pub maximize: bool,
}

impl Sgd {
    /// An optimizer over `vs`'s trainable variables (those that require grad now) with
    /// learning rate `lr`, after PyTorch's checks of the settings.
    ///
    /// ```no_run
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let err = tch_dist::optim::Sgd { momentum: -1.0, ..Default::default() }.build(&vs, 0.1).unwrap_err();
    /// assert_eq!(err.to_string(), "Invalid momentum value: -1");
    /// ```
    pub fn build(self, vs: &tch::nn::VarStore, lr: f64) -> Result<Optimizer, OptimError> {
        self.check()?;
        Optimizer::new(vs, lr, super::Algorithm::Sgd(self))
    }

    pub(super) fn check(&self) -> Result<(), OptimError> {
        // NaN is refused too, which PyTorch's `x < 0` lets through.
        if self.momentum.is_nan() || self.momentum < 0.0 {
            return Err(OptimError::InvalidMomentum {
                momentum: self.momentum,
            });
        }
        if !self.dampening.is_finite() {
            return Err(OptimError::InvalidDampening {
                dampening: self.dampening,
            });
        }
        if self.weight_decay.is_nan() || self.weight_decay < 0.0 {
            return Err(OptimError::InvalidWeightDecay {
                weight_decay: self.weight_decay,
            });
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(OptimError::Nesterov {
                momentum: self.momentum,
                dampening: self.dampening,
            });
        }
        Ok(())
    }

    /// The state names of one parameter.
    pub(super) fn state_names(&self) -> &'static [&'static str] {
        if self.momentum == 0.0 {
            &[]
        } else {
            &["momentum_buffer"]
        }
    }

    /// One step of the parameters that have a gradient (`ready`: FQN, parameter, gradient).
    pub(super) fn step(
        &self,
        lr: f64,
        ready: &[(&str, &Tensor, Tensor)],
        state: &mut BTreeMap<String, ParamState>,
    ) -> Result<(), OptimError> {
        let h = SgdHyper {
            lr,
            momentum: self.momentum,
            dampening: self.dampening,
            weight_decay: self.weight_decay,
            nesterov: self.nesterov,
            maximize: self.maximize,
        };
        let params: Vec<&Tensor> = ready.iter().map(|r| r.1).collect();
        let grads: Vec<&Tensor> = ready.iter().map(|r| &r.2).collect();
        if self.momentum == 0.0 {
            return Ok(fused::sgd(&params, &grads, None, &h, false)?);
        }
        // Parameters with a buffer continue it; the others start one from their gradient
        // (the kernel's first step), as torch.optim.SGD does per parameter. Two calls, since
        // the kernel's `is_first_step` is one flag for the whole list.
        let (mut old, mut new) = (Vec::new(), Vec::new());
        for (i, (fqn, p, g)) in ready.iter().enumerate() {
            match state.get(*fqn).and_then(|s| s.get("momentum_buffer")) {
                Some(b) => {
                    super::check_fits(fqn, "momentum_buffer", p, b)?;
                    old.push((i, b.shallow_clone()));
                }
                None => new.push((i, g.empty_like())),
            }
        }
        for (list, first) in [(&old, false), (&new, true)] {
            let ps: Vec<&Tensor> = list.iter().map(|(i, _)| params[*i]).collect();
            let gs: Vec<&Tensor> = list.iter().map(|(i, _)| grads[*i]).collect();
            let bs: Vec<&Tensor> = list.iter().map(|(_, b)| b).collect();
            fused::sgd(&ps, &gs, Some(&bs), &h, first)?;
        }
        for (i, b) in new {
            state.insert(
                ready[i].0.to_string(),
                ParamState::from_entries([("momentum_buffer", b)]),
            );
        }
        Ok(())
    }
}
