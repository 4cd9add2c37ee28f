//! Proc-macros of tch-dist: `#[derive(Shardable)]` and `#[contract]`.
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

#[doc = include_str!("../doc/contract.md")]
#[proc_macro_attribute]
pub fn contract(args: TokenStream, item: TokenStream) -> TokenStream {
    contract::contract(args.into(), item.into()).into()
}
