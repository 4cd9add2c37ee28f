//! Helpers and generic models shared by the walker tests (`shardable.rs`), the typed-path
//! tests (`paths.rs`) and the hook tests (`hooks.rs`), included with `#[path]`.

#![allow(dead_code)] // each includer uses part of it

use std::marker::PhantomData;

use tch::nn;
use tch::Tensor;
use tch_dist::Shardable;

pub fn linear(p: nn::Path, i: i64, o: i64) -> nn::Linear {
    nn::linear(p, i, o, Default::default())
}

/// The names of a `named_*` list.
pub fn names(v: Vec<(String, &Tensor)>) -> Vec<String> {
    v.into_iter().map(|(n, _)| n).collect()
}

pub fn param_names(m: &dyn Shardable) -> Vec<String> {
    names(m.named_parameters())
}

pub fn buffer_names(m: &dyn Shardable) -> Vec<String> {
    names(m.named_buffers())
}

pub fn module_names(m: &dyn Shardable) -> Vec<String> {
    m.named_modules().into_iter().map(|(n, _)| n).collect()
}

/// Type parameters in every container position, and a skipped field of a parameter type.
#[derive(Debug, Shardable)]
pub struct Generic<T, U> {
    pub first: T,
    pub rest: Vec<T>,
    pub other: Option<U>,
    pub marker: PhantomData<U>,
    #[shardable(skip)]
    pub label: U,
}

/// `Generic` over linear layers and an embedding, its variables in `vs` ("unused.weight" is
/// the skipped `label`'s).
pub fn generic(vs: &nn::VarStore) -> Generic<nn::Linear, nn::Embedding> {
    let root = vs.root();
    Generic {
        first: linear(&root / "first", 2, 2),
        rest: vec![linear(&root / "rest" / 0, 2, 2)],
        other: Some(nn::embedding(&root / "other", 5, 2, Default::default())),
        marker: PhantomData,
        label: nn::embedding(&root / "unused", 1, 1, Default::default()),
    }
}

/// A const-generic array of modules and a buffer.
#[derive(Debug, Shardable)]
pub struct Fixed<T, const N: usize> {
    pub layers: [T; N],
    #[shardable(buffer)]
    pub stats: Tensor,
}
