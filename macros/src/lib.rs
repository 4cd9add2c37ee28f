//! Proc-macros of tch-dist: `#[derive(Shardable)]`, `#[derive(ShallowClone)]` and `#[contract]`.
//!
//! Use them through the `tch_dist` facade (`tch_dist::Shardable`, `tch_dist::contract`).
//! Each macro is layered like serde_derive: **parse** the input and its attributes into an
//! internal AST (unknown and duplicate attributes are errors collected along the way),
//! **validate** what parsing cannot express, then **expand** from the validated AST. All
//! errors are `syn::Error`s spanned on the offending tokens and reported together.
//! Generated code uses absolute paths rooted at `::tch_dist`; `crate = "path"` changes that
//! root (the core crate uses `crate = "crate"`).

#![warn(missing_docs)]

mod contract;
mod ctxt;
mod meta;
mod shallow_clone;
mod shardable;

use proc_macro::TokenStream;

#[doc = include_str!("../doc/derive_shardable.md")]
#[proc_macro_derive(Shardable, attributes(shardable))]
pub fn derive_shardable(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    shardable::derive(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// `#[derive(ShallowClone)]`: a second handle on a module sharing every tensor with it
/// (`tch_dist::ShallowClone`), which activation checkpointing needs to run the module's
/// forward again during backward. Every field must implement `ShallowClone` (tensors, tch's
/// layers, `Vec`/`Option`/`Box`/arrays of them, plain data); type parameters get the bound.
/// `#[shallow_clone(crate = "path")]` names the crate that exports the trait
/// (`::tch_dist` by default).
///
/// ```ignore
/// #[derive(Debug, tch_dist::Shardable, tch_dist::ShallowClone)]
/// struct Block {
///     fc1: tch::nn::Linear,
///     fc2: tch::nn::Linear,
///     scale: f64,
/// }
/// ```
#[proc_macro_derive(ShallowClone, attributes(shallow_clone))]
pub fn derive_shallow_clone(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    shallow_clone::derive(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

#[doc = include_str!("../doc/contract.md")]
#[proc_macro_attribute]
pub fn contract(args: TokenStream, item: TokenStream) -> TokenStream {
    contract::contract(args.into(), item.into()).into()
}
