//! [`AutogradError`]: what the autograd layer's own calls fail with (the split backward,
//! activation recomputation), before the facade names the rank and the API around it.

use crate::ffi::ShimError;

/// A failure of a backward or a forward the autograd layer runs through libtorch's engine
/// ([`backward_input`](crate::backward_input), [`WeightBackward::run`](crate::WeightBackward::run),
/// [`recomputed`](crate::recomputed)). The text is only what went wrong: the caller
/// names the rank, the API and the module.
///
/// ```
/// use tch_dist_runtime::AutogradError;
/// let e = AutogradError::GradientCount { outputs: 2, grads: 1 };
/// assert_eq!(e.to_string(), "2 outputs but 1 gradients for them");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AutogradError {
    /// libtorch's engine failed the call: its message, which is also the text a callback
    /// failed the pass with (a hook, a recomputation that returned an error or panicked).
    #[error("{message}")]
    Engine {
        /// What the engine said.
        message: String,
    },
    /// A backward got another number of gradients than of outputs to differentiate.
    #[error("{outputs} outputs but {grads} gradients for them")]
    GradientCount {
        /// The outputs (the backward's roots).
        outputs: usize,
        /// The gradients given for them.
        grads: usize,
    },
}

impl From<ShimError> for AutogradError {
    fn from(e: ShimError) -> AutogradError {
        AutogradError::Engine { message: e.message }
    }
}
