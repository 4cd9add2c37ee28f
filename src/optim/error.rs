//! [`OptimError`]: a refused hyperparameter (PyTorch's checks and messages), or a step that
//! could not run, naming the parameter's FQN.

use tch_dist_runtime::kernels::KernelError;

/// Why an optimizer could not be built or could not step. A failed `step` changed no
/// parameter and no state.
///
/// ```
/// use tch_dist::optim::{OptimError, Sgd};
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let err = Sgd { nesterov: true, ..Default::default() }.build(&vs, 0.1).unwrap_err();
/// assert!(matches!(err, OptimError::Nesterov { momentum, dampening } if momentum == 0.0 && dampening == 0.0));
/// assert_eq!(err.to_string(), "Nesterov momentum requires a momentum and zero dampening");
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OptimError {
    /// The learning rate is negative or NaN (PyTorch's message).
    #[error("Invalid learning rate: {lr}")]
    InvalidLr {
        /// The learning rate given.
        lr: f64,
    },
    /// SGD's momentum is negative or NaN.
    #[error("Invalid momentum value: {momentum}")]
    InvalidMomentum {
        /// The momentum given.
        momentum: f64,
    },
    /// SGD's dampening is NaN or infinite (PyTorch does not check it; a NaN would make
    /// every parameter NaN).
    #[error("Invalid dampening value: {dampening}")]
    InvalidDampening {
        /// The dampening given.
        dampening: f64,
    },
    /// The weight decay is negative or NaN.
    #[error("Invalid weight_decay value: {weight_decay}")]
    InvalidWeightDecay {
        /// The weight decay given.
        weight_decay: f64,
    },
    /// Nesterov momentum without momentum, or with dampening.
    #[error("Nesterov momentum requires a momentum and zero dampening")]
    Nesterov {
        /// The momentum given.
        momentum: f64,
        /// The dampening given.
        dampening: f64,
    },
    /// AdamW's epsilon is negative or NaN.
    #[error("Invalid epsilon value: {eps}")]
    InvalidEps {
        /// The epsilon given.
        eps: f64,
    },
    /// A beta outside `[0, 1)`.
    #[error("Invalid beta parameter at index {index}: {beta}")]
    InvalidBeta {
        /// 0 or 1.
        index: usize,
        /// The beta given.
        beta: f64,
    },
    /// A parameter's gradient (or state) does not fit it: another shape, dtype or device.
    #[error("optimizer step: `{fqn}`'s {what} is {found} but the parameter is {expected}")]
    Mismatch {
        /// The parameter's FQN.
        fqn: String,
        /// `gradient`, `exp_avg`, `momentum_buffer`, ...
        what: String,
        /// The parameter's shape, dtype or device.
        expected: String,
        /// The other tensor's.
        found: String,
    },
    /// The backward pass of [`backward_step`](super::Optimizer::backward_step) failed.
    #[error("optimizer backward_step: backward failed: {cause}")]
    Backward {
        /// What libtorch (or a hook) said.
        cause: String,
    },
    /// libtorch's fused kernel refused the step (the [`KernelError`] is the source:
    /// [`report`](crate::report) gives `optimizer step: <the kernel's reason>`).
    #[error("optimizer step")]
    Kernel(#[from] KernelError),
}
