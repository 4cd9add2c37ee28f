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

/// Whether every trainable variable still equals `before` and has no `.grad`; when not,
/// what changed first is printed (to stderr, which the multi-process tests show on failure).
pub fn unchanged(vs: &nn::VarStore, before: &[Tensor]) -> bool {
    let now = vs.trainable_variables();
    if now.len() != before.len() {
        eprintln!(
            "unchanged: {} trainable variables, {} before",
            now.len(),
            before.len()
        );
        return false;
    }
    for (i, (a, b)) in before.iter().zip(now).enumerate() {
        let what = if a.size() != b.size() {
            format!("shape {:?} became {:?}", a.size(), b.size())
        } else if !a.equal(&b) {
            let diff = (a - &b.detach()).abs().max().double_value(&[]);
            format!(
                "values of shape {:?} changed, max |difference| {diff:e}",
                a.size()
            )
        } else if b.grad().defined() {
            "a .grad appeared".to_string()
        } else {
            continue;
        };
        eprintln!("unchanged: trainable variable {i}: {what}");
        return false;
    }
    true
}
