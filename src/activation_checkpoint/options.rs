//! [`CheckpointOptions`]: PyTorch's keyword arguments of `checkpoint(module, ...)`.

/// What the recomputation is checked against (PyTorch's `determinism_check`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeterminismCheck {
    /// Each recomputed output's shape, dtype and device equal the first run's (PyTorch's
    /// `"default"`); a difference fails the backward pass naming the module.
    #[default]
    Default,
    /// No check (PyTorch's `"none"`).
    None,
}

/// Options of [`checkpoint_activations`](super::checkpoint_activations), with PyTorch's
/// defaults.
///
/// ```
/// use tch_dist::activation_checkpoint::{CheckpointOptions, DeterminismCheck};
/// let opts = CheckpointOptions::default();
/// assert!(opts.preserve_rng_state);
/// assert_eq!(opts.determinism_check, DeterminismCheck::Default);
/// assert!(!opts.debug);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointOptions {
    /// The recomputation draws the random numbers the first run drew (dropout masks equal),
    /// from the CPU's generator and those of the inputs' CUDA devices. Default `true`.
    pub preserve_rng_state: bool,
    /// What the recomputation is checked against. Default [`DeterminismCheck::Default`].
    pub determinism_check: DeterminismCheck,
    /// Prints one line per recomputation to standard error (rank, module, inputs'
    /// shapes). Default `false`.
    pub debug: bool,
}

impl Default for CheckpointOptions {
    fn default() -> Self {
        CheckpointOptions {
            preserve_rng_state: true,
            determinism_check: DeterminismCheck::Default,
            debug: false,
        }
    }
}
