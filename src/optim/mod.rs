//! Optimizers whose state is reachable, so that checkpoints can save it: [`Sgd`] and
//! [`AdamW`], torch.optim's settings, defaults and checks, built in tch's style, stepping
//! with libtorch's own fused kernels (`at::_fused_sgd_`, `at::_fused_adamw_`, through the
//! runtime's [`kernels`](tch_dist_runtime::kernels) functions).
//!
//! An [`Optimizer`] works on whatever tensors its `VarStore` holds: a parameter that
//! [`shard_module`](crate::sharding::shard_module) sharded (its data replaced in place by its
//! shard) gets state of the shard's shape, so optimizer state is sharded like the parameter
//! without anything to configure. Its state is kept by FQN ([`Optimizer::state`]), under
//! PyTorch's names (`exp_avg`, `exp_avg_sq`, `step`, `momentum_buffer`), and
//! [`checkpoint::save`](crate::checkpoint::save) of a
//! [`State::with_optimizer`](crate::checkpoint::State::with_optimizer) saves it beside the
//! parameters.
//!
//! As in PyTorch, a parameter without a gradient is skipped (no update, no state), and a
//! parameter's state starts at its first gradient. One difference: [`Optimizer::zero_grad`]
//! zeroes gradients in place (PyTorch's `zero_grad(set_to_none=False)`, which keeps
//! `replicate`'s gradient buckets valid; PyTorch's default, and libtorch's `zero_grad()`
//! that tch's optimizers call, set them to none), so a parameter that once had a
//! gradient keeps taking part in steps (with a zero gradient: weight decay and momentum
//! still apply). The parameters are the `VarStore`'s variables that require grad when the
//! optimizer is built.
//!
//! | file | what it does | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `mod.rs` | [`Optimizer`]: the parameters by FQN, their state, `step`, `zero_grad`, `backward_step`, the learning rate | `torch/optim/optimizer.py` (`Optimizer`) |
//! | `sgd.rs` | [`Sgd`]: the settings, their checks, the step on `_fused_sgd_` | `torch/optim/sgd.py` |
//! | `adamw.rs` | [`AdamW`]: the settings, their checks, the step on `_fused_adamw_` | `torch/optim/adamw.py` |
//! | `sidecar.rs` | the checkpoint sidecar `optimizer.json`: the class and `param_groups` | `torch/distributed/checkpoint/state_dict.py` (`get_optimizer_state_dict`'s `param_groups`) |
//! | `error.rs` | [`OptimError`] | the `ValueError`s of `torch/optim/*.py` |
//!
//! ```no_run
//! use tch::nn::{self, Module};
//! use tch_dist::optim;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let net = nn::linear(vs.root() / "fc", 4, 2, Default::default());
//! let mut opt = optim::AdamW::default().build(&vs, 1e-3)?;
//! let x = tch::Tensor::randn([8, 4], tch::kind::FLOAT_CPU);
//! opt.backward_step(&net.forward(&x).square().mean(None))?;
//! let state = opt.state("fc.weight").expect("stepped once");
//! assert_eq!(state.get("step").map(|s| s.double_value(&[])), Some(1.0));
//! # Ok(()) }
//! ```

mod adamw;
mod error;
mod sgd;
pub(crate) mod sidecar;

use std::collections::BTreeMap;

use tch::Tensor;

pub use adamw::AdamW;
pub use error::OptimError;
pub use sgd::Sgd;

/// Which algorithm an [`Optimizer`] runs, with its settings.
///
/// ```
/// use tch_dist::optim::{Algorithm, Sgd};
/// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let opt = Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.1)?;
/// assert!(matches!(opt.algorithm(), Algorithm::Sgd(s) if s.momentum == 0.9));
/// # Ok::<(), tch_dist::optim::OptimError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Algorithm {
    /// torch.optim.SGD.
    Sgd(Sgd),
    /// torch.optim.AdamW.
    AdamW(AdamW),
}

impl Algorithm {
    /// PyTorch's class name (`SGD`, `AdamW`).
    ///
    /// ```
    /// assert_eq!(tch_dist::optim::Algorithm::AdamW(Default::default()).name(), "AdamW");
    /// ```
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::Sgd(_) => "SGD",
            Algorithm::AdamW(_) => "AdamW",
        }
    }

    /// The names of one parameter's state tensors (sorted).
    ///
    /// ```
    /// use tch_dist::optim::{Algorithm, Sgd};
    /// assert_eq!(Algorithm::Sgd(Sgd { momentum: 0.9, ..Default::default() }).state_names(), ["momentum_buffer"]);
    /// assert!(Algorithm::Sgd(Sgd::default()).state_names().is_empty());
    /// ```
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            Algorithm::Sgd(s) => s.state_names(),
            Algorithm::AdamW(a) => a.state_names(),
        }
    }

    fn check(&self) -> Result<(), OptimError> {
        match self {
            Algorithm::Sgd(s) => s.check(),
            Algorithm::AdamW(a) => a.check(),
        }
    }
}

/// One parameter's optimizer state: named tensors (`exp_avg`, `exp_avg_sq`, `step`, ... or
/// `momentum_buffer`), each of the parameter's (local) shape, `step` a float32 scalar.
///
/// ```no_run
/// # fn demo(opt: &tch_dist::optim::Optimizer) {
/// if let Some(s) = opt.state("fc.weight") {
///     for (name, t) in s.iter() {
///         println!("{name}: {:?}", t.size());
///     }
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct ParamState {
    entries: BTreeMap<String, Tensor>,
}

impl ParamState {
    pub(crate) fn from_entries<'a>(entries: impl IntoIterator<Item = (&'a str, Tensor)>) -> Self {
        ParamState {
            entries: entries
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        }
    }

    pub(crate) fn from_map(entries: BTreeMap<String, Tensor>) -> Self {
        ParamState { entries }
    }

    /// The state tensor `name` (the optimizer's own tensor: changing it changes the state).
    ///
    /// ```no_run
    /// # fn demo(opt: &tch_dist::optim::Optimizer) {
    /// let exp_avg = opt.state("fc.weight").and_then(|s| s.get("exp_avg")); // AdamW's first moment
    /// # }
    /// ```
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.entries.get(name)
    }

    /// Every state tensor, by name (sorted).
    ///
    /// ```no_run
    /// # fn demo(state: &tch_dist::optim::ParamState) {
    /// let names: Vec<&str> = state.iter().map(|(name, _)| name).collect(); // AdamW: exp_avg, ...
    /// # }
    /// ```
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The same tensors (shallow clones: handles, not copies).
    fn clone_handles(&self) -> Self {
        ParamState {
            entries: self
                .entries
                .iter()
                .map(|(k, v)| (k.clone(), v.shallow_clone()))
                .collect(),
        }
    }
}

/// An optimizer over a `VarStore`'s parameters, built by [`Sgd::build`] or
/// [`AdamW::build`] (see the [module docs](self)).
///
/// ```
/// # use tch::nn::Module;
/// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// # let fc = tch::nn::linear(vs.root() / "fc", 4, 2, Default::default());
/// # let x = tch::Tensor::ones([8, 4], tch::kind::FLOAT_CPU);
/// let mut opt = tch_dist::optim::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.1)?;
/// opt.backward_step(&fc.forward(&x).mean(None))?;
/// # Ok::<(), tch_dist::optim::OptimError>(())
/// ```
#[derive(Debug)]
pub struct Optimizer {
    algorithm: Algorithm,
    lr: f64,
    /// The parameters by FQN (sorted, so that every rank steps them in one order).
    params: Vec<(String, Tensor)>,
    state: BTreeMap<String, ParamState>,
}

fn check_lr(lr: f64) -> Result<(), OptimError> {
    if lr.is_nan() || lr < 0.0 {
        return Err(OptimError::InvalidLr { lr });
    }
    Ok(())
}

/// PyTorch's checks of an algorithm's settings and a learning rate.
pub(crate) fn check_settings(algorithm: &Algorithm, lr: f64) -> Result<(), OptimError> {
    algorithm.check()?;
    check_lr(lr)
}

/// That `t` (a gradient or a state tensor) has `p`'s shape, dtype and device.
pub(crate) fn check_fits(fqn: &str, what: &str, p: &Tensor, t: &Tensor) -> Result<(), OptimError> {
    let mismatch = |expected: String, found: String| OptimError::Mismatch {
        fqn: fqn.to_string(),
        what: what.to_string(),
        expected,
        found,
    };
    if t.size() != p.size() {
        return Err(mismatch(
            format!("{:?}", p.size()),
            format!("{:?}", t.size()),
        ));
    }
    if t.kind() != p.kind() {
        return Err(mismatch(
            format!("{:?}", p.kind()),
            format!("{:?}", t.kind()),
        ));
    }
    if t.device() != p.device() {
        return Err(mismatch(
            format!("{:?}", p.device()),
            format!("{:?}", t.device()),
        ));
    }
    Ok(())
}

impl Optimizer {
    fn new(vs: &tch::nn::VarStore, lr: f64, algorithm: Algorithm) -> Result<Self, OptimError> {
        check_lr(lr)?;
        let mut params: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Optimizer {
            algorithm,
            lr,
            params,
            state: BTreeMap::new(),
        })
    }

    /// The algorithm and its settings.
    ///
    /// ```
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let opt = tch_dist::optim::AdamW::default().build(&vs, 1e-3)?;
    /// assert_eq!(opt.algorithm().name(), "AdamW");
    /// # Ok::<(), tch_dist::optim::OptimError>(())
    /// ```
    pub fn algorithm(&self) -> &Algorithm {
        &self.algorithm
    }

    /// The learning rate.
    ///
    /// ```
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let opt = tch_dist::optim::Sgd::default().build(&vs, 0.1)?;
    /// assert_eq!(opt.lr(), 0.1);
    /// # Ok::<(), tch_dist::optim::OptimError>(())
    /// ```
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Sets the learning rate (a schedule); a negative or NaN one is refused.
    ///
    /// ```no_run
    /// # fn demo(opt: &mut tch_dist::optim::Optimizer) -> Result<(), tch_dist::optim::OptimError> {
    /// opt.set_lr(opt.lr() * 0.5)?;
    /// # Ok(()) }
    /// ```
    pub fn set_lr(&mut self, lr: f64) -> Result<(), OptimError> {
        check_lr(lr)?;
        self.lr = lr;
        Ok(())
    }

    /// The parameters' FQNs (sorted).
    ///
    /// ```
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let fc = tch::nn::linear(vs.root() / "fc", 4, 2, Default::default());
    /// let opt = tch_dist::optim::Sgd::default().build(&vs, 0.1)?;
    /// assert_eq!(opt.param_names().collect::<Vec<_>>(), ["fc.bias", "fc.weight"]);
    /// # Ok::<(), tch_dist::optim::OptimError>(())
    /// ```
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.params.iter().map(|(n, _)| n.as_str())
    }

    /// The state of the parameter `fqn` (`None` before its first gradient, or for SGD
    /// without momentum).
    ///
    /// ```
    /// # use tch::nn::Module;
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let fc = tch::nn::linear(vs.root() / "fc", 4, 2, Default::default());
    /// # let x = tch::Tensor::ones([8, 4], tch::kind::FLOAT_CPU);
    /// let mut opt = tch_dist::optim::AdamW::default().build(&vs, 1e-3)?;
    /// assert!(opt.state("fc.weight").is_none()); // before its first gradient
    /// opt.backward_step(&fc.forward(&x).mean(None))?;
    /// assert!(opt.state("fc.weight").unwrap().get("exp_avg").is_some());
    /// # Ok::<(), tch_dist::optim::OptimError>(())
    /// ```
    pub fn state(&self, fqn: &str) -> Option<&ParamState> {
        self.state.get(fqn)
    }

    /// Every parameter's state, by FQN.
    ///
    /// ```no_run
    /// # fn demo(opt: &tch_dist::optim::Optimizer) {
    /// for (fqn, state) in opt.states() {
    ///     println!("{fqn}: {} tensors", state.iter().count());
    /// }
    /// # }
    /// ```
    pub fn states(&self) -> impl Iterator<Item = (&str, &ParamState)> {
        self.state.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Zeroes every gradient in place (see the module docs).
    ///
    /// ```
    /// # use tch::nn::Module;
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let fc = tch::nn::linear(vs.root() / "fc", 4, 2, Default::default());
    /// # let x = tch::Tensor::ones([8, 4], tch::kind::FLOAT_CPU);
    /// let mut opt = tch_dist::optim::Sgd::default().build(&vs, 0.1)?;
    /// opt.zero_grad();
    /// fc.forward(&x).mean(None).backward();
    /// opt.step()?;
    /// # Ok::<(), tch_dist::optim::OptimError>(())
    /// ```
    pub fn zero_grad(&mut self) {
        for (_, p) in &self.params {
            let mut g = p.grad();
            if g.defined() {
                // Out of any graph first (a grad made with create_graph). A grad that is a
                // view of a bucket (replicate's gradient_as_bucket_view, fault tolerance's
                // average) cannot be detached in place, and needs not be: PyTorch's
                // zero_grad detaches only a grad with a grad_fn.
                let _ = g.f_detach_();
                let _ = g.zero_();
            }
        }
    }

    /// One step over the parameters that have a gradient. On an error nothing changed.
    ///
    /// ```
    /// # use tch::nn::Module;
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let fc = tch::nn::linear(vs.root() / "fc", 4, 2, Default::default());
    /// # let x = tch::Tensor::ones([8, 4], tch::kind::FLOAT_CPU);
    /// # let mut opt = tch_dist::optim::Sgd::default().build(&vs, 0.1)?;
    /// fc.forward(&x).mean(None).backward();
    /// opt.step()?; // then zero_grad before the next backward
    /// # Ok::<(), tch_dist::optim::OptimError>(())
    /// ```
    pub fn step(&mut self) -> Result<(), OptimError> {
        let _span = tch_dist_core::trace::span(self.algorithm.name(), "optimizer");
        let mut ready = Vec::new();
        for (fqn, p) in &self.params {
            let g = p.grad();
            if !g.defined() {
                continue; // no gradient: skipped, as in PyTorch
            }
            check_fits(fqn, "gradient", p, &g)?;
            ready.push((fqn.as_str(), p, g));
        }
        // The fused kernels take one device and dtype per call (torch.optim groups them
        // the same way).
        let mut groups: BTreeMap<String, Vec<(&str, &Tensor, Tensor)>> = BTreeMap::new();
        for r in ready {
            groups
                .entry(format!("{:?}/{:?}", r.1.device(), r.1.kind()))
                .or_default()
                .push(r);
        }
        for ready in groups.values() {
            match &self.algorithm {
                Algorithm::Sgd(s) => s.step(self.lr, ready, &mut self.state)?,
                Algorithm::AdamW(a) => a.step(self.lr, ready, &mut self.state)?,
            }
        }
        Ok(())
    }

    /// `zero_grad`, `loss.backward()`, `step`, with a failing backward pass (a collective of
    /// `replicate` that failed) as an error instead of tch's panic.
    ///
    /// ```
    /// # use tch::nn::Module;
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// # let fc = tch::nn::linear(vs.root() / "fc", 4, 2, Default::default());
    /// # let x = tch::Tensor::ones([8, 4], tch::kind::FLOAT_CPU);
    /// let mut opt = tch_dist::optim::AdamW::default().build(&vs, 1e-3)?;
    /// let loss = fc.forward(&x).mean(None);
    /// opt.backward_step(&loss)?;
    /// # Ok::<(), tch_dist::optim::OptimError>(())
    /// ```
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<(), OptimError> {
        self.zero_grad();
        loss.f_backward().map_err(|e| OptimError::Backward {
            cause: e.to_string(),
        })?;
        self.step()
    }

    /// Replaces the whole state and the settings (a checkpoint's, checked with
    /// [`check_settings`] before).
    pub(crate) fn restore(
        &mut self,
        algorithm: Algorithm,
        lr: f64,
        state: BTreeMap<String, ParamState>,
    ) {
        self.algorithm = algorithm;
        self.lr = lr;
        self.state = state;
    }
}
