//! Helpers shared by the attribute parsers of both macros.

use proc_macro2::TokenStream;
use syn::meta::ParseNestedMeta;

/// Consumes the value of an attribute we reject (`key = expr` or `key(...)`), so that parsing
/// can go on after it and report every mistake in one compile.
pub(crate) fn skip_meta_value(meta: &ParseNestedMeta) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        meta.value()?.parse::<syn::Expr>()?;
    } else if meta.input.peek(syn::token::Paren) {
        let content;
        syn::parenthesized!(content in meta.input);
        content.parse::<TokenStream>()?;
    }
    Ok(())
}
