//! `#[derive(Shardable)]`: parse (attr, ast) → validate (check) → expand (the walker impl in
//! expand, the typed paths in typed_path).
//!
//! | file | what it does | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `mod.rs` | the entry: parse, check, then expand or report every error | (none: PyTorch's modules register their children at run time) |
//! | `attr.rs` | `#[shardable(...)]` attributes into plain values | (none) |
//! | `ast.rs` | the internal AST: the input, its attributes, every field's FQN component | `nn.Module.named_parameters`'s names |
//! | `check.rs` | what parsing cannot express: usable, unique FQN components | `Module.register_parameter`'s name checks |
//! | `expand.rs` | the walker impl (`Shardable`) | `Module.named_parameters`, `named_buffers`, `named_modules` |
//! | `typed_path.rs` | the typed paths (`NetPath`) | (none: FQN strings) |

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
