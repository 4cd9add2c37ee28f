//! "Nothing changed": a copy of a `VarStore`'s trainable values before a refused call, and the
//! check afterwards that every value is the same and no `.grad` appeared. Included with
//! `#[path]` by the bypass tests (tests/bypass_root.rs, tests/fully_shard/errors.rs).

use tch::{nn, Tensor};

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
