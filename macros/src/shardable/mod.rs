//! `#[derive(Shardable)]`: parse (attr, ast) → validate (check) → expand (the walker impl in
//! expand, the typed paths in typed_path).

mod ast;
mod attr;
mod check;
mod expand;
mod typed_path;

use proc_macro2::TokenStream;
use syn::DeriveInput;

use crate::ctxt::Ctxt;

pub(crate) fn derive(input: &DeriveInput) -> syn::Result<TokenStream> {
    let cx = Ctxt::new();
    let Some(cont) = ast::Container::from_ast(&cx, input) else {
        cx.check()?;
        return Ok(TokenStream::new());
    };
    check::check(&cx, &cont);
    cx.check()?;
    Ok(expand::expand(&cont))
}
