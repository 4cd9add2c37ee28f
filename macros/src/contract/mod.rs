//! `#[contract]`: parse (arguments, function) → validate → expand.
//!
//! | file | what it does | PyTorch's counterpart |
//! | --- | --- | --- |
//! | `mod.rs` | the entry: parse, then expand or report every error | `torch/distributed/_composable/contract.py` (`contract`) |
//! | `parse.rs` | `#[contract(...)]`'s arguments and the function, validated into `ContractFn` | the checks `contract` runs when decorating |
//! | `expand.rs` | the generated function: the registry and state around the body | `contract`'s `wrapper` |

mod expand;
mod parse;

use proc_macro2::TokenStream;

use crate::ctxt::Ctxt;

/// The expansion, or the errors followed by the unchanged item (so that its uses do not
/// add errors of their own).
pub(crate) fn contract(args: TokenStream, item: TokenStream) -> TokenStream {
    match expand_or_errors(args, item.clone()) {
        Ok(tokens) => tokens,
        Err(e) => {
            let mut tokens = e.into_compile_error();
            tokens.extend(item);
            tokens
        }
    }
}

fn expand_or_errors(args: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let cx = Ctxt::new();
    let parsed_args = parse::parse_args(&cx, args);
    let func: syn::ItemFn = match syn::parse2(item) {
        Ok(f) => f,
        Err(e) => {
            cx.syn_error(syn::Error::new(
                e.span(),
                "#[contract] applies to a function `fn apply<M: Shardable + ?Sized>(module: &M, ...) -> Result<State, E>`",
            ));
            return cx.check().map(|()| TokenStream::new());
        }
    };
    let cf = parse::parse_fn(&cx, func);
    cx.check()?;
    match cf {
        Some(cf) => Ok(expand::expand(&parsed_args, cf)),
        None => Ok(TokenStream::new()),
    }
}
