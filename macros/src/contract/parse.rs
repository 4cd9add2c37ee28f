//! Parsing and validation of `#[contract(...)]` and the function it is on, into
//! [`ContractFn`]. Every problem is recorded in the [`Ctxt`] and reported together.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::parse::Parser;
use syn::{FnArg, GenericArgument, Ident, ItemFn, LitStr, Pat, PathArguments, ReturnType, Type};

use crate::ctxt::Ctxt;
use crate::meta::skip_meta_value;

/// The arguments of `#[contract(...)]`.
#[derive(Default)]
pub(crate) struct Args {
    /// `name = "..."`: the API's name (default: last segment of the module path).
    pub name: Option<LitStr>,
    /// `conflicts(a, b)`: names of conflicting APIs.
    pub conflicts: Vec<String>,
    /// `crate = "path"`: where `tch_dist`'s items are (default `::tch_dist`).
    pub krate: Option<syn::Path>,
    /// `state = ident`: the name of the generated state accessor (default `state`).
    pub state: Option<Ident>,
    /// `state_doc = "..."` (or `include_str!(...)`): more documentation for the state
    /// accessor, after the generated sentence (an example, say).
    pub state_doc: Option<syn::Expr>,
}

pub(crate) fn parse_args(cx: &Ctxt, args: TokenStream) -> Args {
    let mut out = Args::default();
    let mut seen: Vec<String> = Vec::new();
    let parser = syn::meta::parser(|meta| {
        let key = meta.path.to_token_stream().to_string().replace(' ', "");
        if seen.contains(&key) {
            cx.error_spanned_by(&meta.path, format!("duplicate contract attribute `{key}`"));
        }
        seen.push(key.clone());
        match key.as_str() {
            "name" => {
                let lit: LitStr = meta.value()?.parse()?;
                let v = lit.value();
                if v.is_empty() || v.contains(|c: char| c.is_whitespace()) {
                    cx.error_spanned_by(&lit, "an API name must be non-empty and without spaces");
                }
                out.name = Some(lit);
            }
            "conflicts" => {
                meta.parse_nested_meta(|inner| {
                    match inner.path.get_ident() {
                        Some(ident) => out.conflicts.push(ident.to_string()),
                        None => cx
                            .error_spanned_by(&inner.path, "expected the name of a composable API"),
                    }
                    Ok(())
                })?;
            }
            "crate" => {
                let lit: LitStr = meta.value()?.parse()?;
                match lit.parse::<syn::Path>() {
                    Ok(p) => out.krate = Some(p),
                    Err(_) => cx.error_spanned_by(&lit, format!("`{}` is not a path", lit.value())),
                }
            }
            "state" => {
                out.state = Some(meta.value()?.parse()?);
            }
            "state_doc" => {
                out.state_doc = Some(meta.value()?.parse()?);
            }
            _ => {
                cx.error_spanned_by(
                    &meta.path,
                    format!(
                        "unknown contract attribute `{key}`; expected one of `name`, `conflicts`, \
                         `crate`, `state`, `state_doc`"
                    ),
                );
                skip_meta_value(&meta)?;
            }
        }
        Ok(())
    });
    if let Err(e) = parser.parse2(args) {
        cx.syn_error(e);
    }
    out
}

/// A validated contract function.
pub(crate) struct ContractFn {
    pub func: ItemFn,
    /// The first argument: the module.
    pub module: Ident,
    /// `State` in `-> Result<State, E>`.
    pub state_ty: Type,
    /// The declared return type, with `State` replaced by `Arc<State>`.
    pub new_ret: Type,
    /// The declared return type.
    pub orig_ret: Type,
}

const MODULE_ARG: &str = "the first argument of a #[contract] function must be the module, \
                          as `module: &M` or `module: &mut M`";

pub(crate) fn parse_fn(cx: &Ctxt, func: ItemFn) -> Option<ContractFn> {
    let sig = &func.sig;
    if let Some(t) = &sig.asyncness {
        cx.error_spanned_by(t, "#[contract] functions cannot be async");
    }
    if let Some(t) = &sig.constness {
        cx.error_spanned_by(t, "#[contract] functions cannot be const");
    }
    if let Some(t) = &sig.unsafety {
        cx.error_spanned_by(t, "#[contract] functions cannot be unsafe");
    }
    if let Some(abi) = &sig.abi {
        cx.error_spanned_by(abi, "#[contract] functions cannot have an ABI");
    }
    if let Some(v) = &sig.variadic {
        cx.error_spanned_by(v, "#[contract] functions cannot be variadic");
    }

    let module = match sig.inputs.first() {
        Some(FnArg::Receiver(r)) => {
            cx.error_spanned_by(r, "#[contract] must be on a free function, not a method");
            None
        }
        Some(FnArg::Typed(pt)) => match (&*pt.pat, &*pt.ty) {
            (Pat::Ident(pi), Type::Reference(_)) if pi.by_ref.is_none() && pi.subpat.is_none() => {
                Some(pi.ident.clone())
            }
            _ => {
                cx.error_spanned_by(pt, MODULE_ARG);
                None
            }
        },
        None => {
            cx.error_spanned_by(&sig.ident, MODULE_ARG);
            None
        }
    };

    let state = match &sig.output {
        ReturnType::Type(_, ty) => {
            state_type(ty).map(|(state, new_ret)| (state, new_ret, (**ty).clone()))
        }
        ReturnType::Default => None,
    };
    if state.is_none() {
        let msg = "a #[contract] function must return `Result<State, E>`: the state is stored \
                   for the module and returned as `Arc<State>`";
        match &sig.output {
            ReturnType::Type(_, ty) => cx.error_spanned_by(ty, msg),
            ReturnType::Default => cx.error_spanned_by(&sig.ident, msg),
        }
    }
    let (module, (state_ty, new_ret, orig_ret)) = (module?, state?);
    Some(ContractFn {
        func,
        module,
        state_ty,
        new_ret,
        orig_ret,
    })
}

/// `Result<State, ..>` (or an alias `Alias<State>`) → `State` and the same type with
/// `State` replaced by `::std::sync::Arc<State>`.
fn state_type(ty: &Type) -> Option<(Type, Type)> {
    let Type::Path(tp) = ty else { return None };
    let mut new_ty = tp.clone();
    let last = new_ty.path.segments.last_mut()?;
    let PathArguments::AngleBracketed(args) = &mut last.arguments else {
        return None;
    };
    let first = args.args.first_mut()?;
    let GenericArgument::Type(state) = first else {
        return None;
    };
    let state = state.clone();
    *first = GenericArgument::Type(syn::parse_quote!(::std::sync::Arc<#state>));
    Some((state, Type::Path(new_ty)))
}
