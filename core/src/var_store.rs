//! Checking a model's FQNs against the `VarStore` it was built from.

use std::collections::BTreeSet;

use tch::nn::VarStore;

use crate::walk::Shardable;

/// A model and its `VarStore` disagree on tensor names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the model and its VarStore name different tensors: only in the model: {only_in_model:?}; \
     only in the VarStore: {only_in_var_store:?}"
)]
pub struct VarStoreMismatch {
    /// Parameter and buffer FQNs the model reports but the `VarStore` does not hold (sorted).
    pub only_in_model: Vec<String>,
    /// Variables of the `VarStore` the model does not report (sorted).
    pub only_in_var_store: Vec<String>,
}

/// Checks that `model`'s parameters and buffers have the same FQN set as the variables of
/// `vs`: the names a checkpoint saved by one would have in the other. A model whose field
/// `fc1` was built with `vs.root() / "fc1"` passes.
///
/// ```
/// use tch::{nn, Device};
/// use tch_dist_core::check_against_var_store;
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc1 = nn::linear(vs.root() / "fc1", 2, 2, Default::default());
/// let err = check_against_var_store(&fc1, &vs).unwrap_err(); // built under "fc1", walked as root
/// assert_eq!(err.only_in_model, ["bias", "weight"]);
/// assert_eq!(err.only_in_var_store, ["fc1.bias", "fc1.weight"]);
/// ```
pub fn check_against_var_store<M: Shardable + ?Sized>(
    model: &M,
    vs: &VarStore,
) -> Result<(), VarStoreMismatch> {
    let model_names: BTreeSet<String> = model
        .named_parameters()
        .into_iter()
        .chain(model.named_buffers())
        .map(|(n, _)| n)
        .collect();
    let vs_names: BTreeSet<String> = vs.variables().into_keys().collect();
    let only_in_model: Vec<String> = model_names.difference(&vs_names).cloned().collect();
    let only_in_var_store: Vec<String> = vs_names.difference(&model_names).cloned().collect();
    if only_in_model.is_empty() && only_in_var_store.is_empty() {
        Ok(())
    } else {
        Err(VarStoreMismatch {
            only_in_model,
            only_in_var_store,
        })
    }
}
