//! `#[derive(ShallowClone)]`: parse (the container and its `#[shallow_clone(crate = "...")]`
//! attribute) → validate (no unions) → expand (one `shallow_clone` call per field, spanned on
//! the field's type so that a field without the trait fails there).

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, LitStr};

use crate::ctxt::Ctxt;
use crate::meta::skip_meta_value;

const ATTR: &str = "shallow_clone";

/// The parsed container: its crate path and what it holds.
struct Container<'a> {
    input: &'a DeriveInput,
    krate: syn::Path,
}

pub(crate) fn derive(input: &DeriveInput) -> syn::Result<TokenStream> {
    let cx = Ctxt::new();
    let cont = parse(&cx, input);
    check(&cx, input);
    cx.check()?;
    Ok(expand(&cont))
}

fn parse<'a>(cx: &Ctxt, input: &'a DeriveInput) -> Container<'a> {
    let mut krate: Option<syn::Path> = None;
    for attr in input.attrs.iter().filter(|a| a.path().is_ident(ATTR)) {
        let parsed = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("crate") {
                let lit: LitStr = meta.value()?.parse()?;
                match lit.parse::<syn::Path>() {
                    Ok(_) if krate.is_some() => {
                        cx.error_spanned_by(&meta.path, "duplicate shallow_clone attribute `crate`")
                    }
                    Ok(p) => krate = Some(p),
                    Err(e) => cx.syn_error(e),
                }
            } else {
                cx.error_spanned_by(&meta.path, "unknown shallow_clone attribute");
                skip_meta_value(&meta)?;
            }
            Ok(())
        });
        if let Err(e) = parsed {
            cx.syn_error(e);
        }
    }
    Container {
        input,
        krate: krate.unwrap_or_else(|| syn::parse_quote!(::tch_dist)),
    }
}

fn check(cx: &Ctxt, input: &DeriveInput) {
    if let Data::Union(u) = &input.data {
        cx.error_spanned_by(u.union_token, "ShallowClone cannot be derived for a union");
    }
}

fn expand(cont: &Container) -> TokenStream {
    let krate = &cont.krate;
    let ident = &cont.input.ident;
    let mut generics = cont.input.generics.clone();
    for param in generics.type_params_mut() {
        param.bounds.push(syn::parse_quote!(#krate::ShallowClone));
    }
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let body = match &cont.input.data {
        Data::Struct(s) => {
            let (pat, value) = fields(krate, quote!(Self), &s.fields);
            quote! { let #pat = self; #value }
        }
        Data::Enum(e) => {
            let arms = e.variants.iter().map(|v| {
                let name = &v.ident;
                let (pat, value) = fields(krate, quote!(Self::#name), &v.fields);
                quote! { #pat => #value, }
            });
            quote! { match self { #(#arms)* } }
        }
        Data::Union(_) => TokenStream::new(),
    };
    quote! {
        impl #impl_generics #krate::ShallowClone for #ident #ty_generics #where_clause {
            fn shallow_clone(&self) -> Self {
                #body
            }
        }
    }
}

/// The pattern binding `path`'s fields and the value rebuilt from their shallow clones.
fn fields(krate: &syn::Path, path: TokenStream, fields: &Fields) -> (TokenStream, TokenStream) {
    let names: Vec<_> = fields
        .iter()
        .enumerate()
        .map(|(i, f)| f.ident.clone().unwrap_or_else(|| format_ident!("__f{i}")))
        .collect();
    let clones = fields.iter().zip(&names).map(|(f, n)| {
        quote_spanned! {f.ty.span()=> #krate::ShallowClone::shallow_clone(#n) }
    });
    match fields {
        Fields::Named(_) => (
            quote! { #path { #(#names),* } },
            quote! { #path { #(#names: #clones),* } },
        ),
        Fields::Unnamed(_) => (
            quote! { #path ( #(#names),* ) },
            quote! { #path ( #(#clones),* ) },
        ),
        Fields::Unit => (path.clone(), path),
    }
}
