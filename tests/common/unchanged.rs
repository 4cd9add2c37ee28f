//! "Nothing changed": a copy of a `VarStore`'s trainable values before a refused call, and the
//! check afterwards that every value is the same and no `.grad` appeared. Included with
//! `#[path]` by the bypass tests (tests/bypass_root.rs, tests/fully_shard/errors.rs), and
//! for [`named_values`] by tests/activation_checkpoint.rs and tests/multi_input.rs.

#![allow(dead_code)] // each includer uses part of it

use tch::{nn, Tensor};

/// Copies of every variable's value (buffers too), by name, sorted.
pub fn named_values(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(k, t)| (k, t.detach().copy()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Copies of every trainable variable's value.
pub fn values(vs: &nn::VarStore) -> Vec<Tensor> {
    vs.trainable_variables().iter().map(|t| t.copy()).collect()
}

/// Whether every trainable variable still equals `before` and has no `.grad`.
pub fn unchanged(vs: &nn::VarStore, before: &[Tensor]) -> bool {
    before
        .iter()
        .zip(vs.trainable_variables())
        .all(|(a, b)| a.equal(&b) && !b.grad().defined())
}
