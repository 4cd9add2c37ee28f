//! Parsing of `#[shardable(...)]` attributes into plain values. Unknown and duplicate
//! attributes are recorded in the [`Ctxt`] (and parsing goes on), so that one compile
//! reports every mistake.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::{Attribute, LitStr};

use crate::ctxt::Ctxt;
use crate::meta::skip_meta_value;

const SHARDABLE: &str = "shardable";

/// One attribute value that may be given at most once.
struct Attr<'c, T> {
    cx: &'c Ctxt,
    name: &'static str,
    value: Option<(TokenStream, T)>,
}

impl<'c, T> Attr<'c, T> {
    fn none(cx: &'c Ctxt, name: &'static str) -> Self {
        Attr {
            cx,
            name,
            value: None,
        }
    }

    fn set<A: ToTokens>(&mut self, obj: A, value: T) {
        let tokens = obj.into_token_stream();
        if self.value.is_some() {
            self.cx.error_spanned_by(
                tokens,
                format!("duplicate shardable attribute `{}`", self.name),
            );
        } else {
            self.value = Some((tokens, value));
        }
    }

    fn get(self) -> Option<(TokenStream, T)> {
        self.value
    }
}

fn path_string(path: &syn::Path) -> String {
    path.to_token_stream().to_string().replace(' ', "")
}

/// Container attributes: `#[shardable(crate = "path", path_type = "Name")]`.
pub(crate) struct Container {
    /// The path of the crate that exports `Shardable`; `::tch_dist` when absent.
    pub krate: Option<syn::Path>,
    /// The name of the generated typed-path struct; `<Type>Path` when absent.
    pub path_type: Option<syn::Ident>,
}

impl Container {
    pub(crate) fn from_ast(cx: &Ctxt, attrs: &[Attribute]) -> Container {
        let mut krate = Attr::none(cx, "crate");
        let mut path_type = Attr::none(cx, "path_type");
        for attr in attrs.iter().filter(|a| a.path().is_ident(SHARDABLE)) {
            let res = attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("crate") {
                    let lit: LitStr = meta.value()?.parse()?;
                    match lit.parse::<syn::Path>() {
                        Ok(path) => krate.set(&meta.path, path),
                        Err(_) => {
                            cx.error_spanned_by(&lit, format!("`{}` is not a path", lit.value()))
                        }
                    }
                } else if meta.path.is_ident("path_type") {
                    let lit: LitStr = meta.value()?.parse()?;
                    match lit.parse::<syn::Ident>() {
                        Ok(ident) => path_type.set(&meta.path, ident),
                        Err(_) => cx.error_spanned_by(
                            &lit,
                            format!("`{}` is not a type name", lit.value()),
                        ),
                    }
                } else {
                    cx.error_spanned_by(
                        &meta.path,
                        format!(
                            "unknown shardable container attribute `{}`; expected `crate` or \
                             `path_type`",
                            path_string(&meta.path)
                        ),
                    );
                    skip_meta_value(&meta)?;
                }
                Ok(())
            });
            if let Err(e) = res {
                cx.syn_error(e);
            }
        }
        Container {
            krate: krate.get().map(|(_, p)| p),
            path_type: path_type.get().map(|(_, i)| i),
        }
    }
}

/// How a field takes part in the walk.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    /// A child module (the default): its type must be `Shardable`.
    Module,
    /// `#[shardable(param)]`: a `Tensor` or `Option<Tensor>` parameter.
    Param,
    /// `#[shardable(buffer)]`: a `Tensor` or `Option<Tensor>` buffer.
    Buffer,
    /// `#[shardable(skip)]`: not walked.
    Skip,
}

/// Field attributes: `skip`, `param`, `buffer`, `rename = "..."`.
pub(crate) struct Field {
    pub kind: Kind,
    pub rename: Option<LitStr>,
}

impl Field {
    pub(crate) fn from_ast(cx: &Ctxt, attrs: &[Attribute]) -> Field {
        let mut kind = Attr::none(cx, "skip/param/buffer");
        let mut kinds_seen: Vec<(TokenStream, &'static str)> = Vec::new();
        let mut rename = Attr::none(cx, "rename");
        for attr in attrs.iter().filter(|a| a.path().is_ident(SHARDABLE)) {
            let res = attr.parse_nested_meta(|meta| {
                let k = if meta.path.is_ident("skip") {
                    Some((Kind::Skip, "skip"))
                } else if meta.path.is_ident("param") {
                    Some((Kind::Param, "param"))
                } else if meta.path.is_ident("buffer") {
                    Some((Kind::Buffer, "buffer"))
                } else {
                    None
                };
                if let Some((k, name)) = k {
                    if let Some((_, prev)) = kinds_seen.iter().find(|(_, p)| *p == name) {
                        cx.error_spanned_by(
                            &meta.path,
                            format!("duplicate shardable attribute `{prev}`"),
                        );
                    } else if let Some((_, prev)) = kinds_seen.first() {
                        cx.error_spanned_by(
                            &meta.path,
                            format!("conflicting shardable attributes `{prev}` and `{name}`"),
                        );
                    } else {
                        kind.set(&meta.path, k);
                    }
                    kinds_seen.push((meta.path.to_token_stream(), name));
                } else if meta.path.is_ident("rename") {
                    let lit: LitStr = meta.value()?.parse()?;
                    rename.set(&meta.path, lit);
                } else {
                    cx.error_spanned_by(
                        &meta.path,
                        format!(
                            "unknown shardable field attribute `{}`; expected one of `skip`, \
                             `param`, `buffer`, `rename`",
                            path_string(&meta.path)
                        ),
                    );
                    skip_meta_value(&meta)?;
                }
                Ok(())
            });
            if let Err(e) = res {
                cx.syn_error(e);
            }
        }
        let (kind_tokens, kind) = match kind.get() {
            Some((t, k)) => (Some(t), k),
            None => (None, Kind::Module),
        };
        let rename = rename.get().map(|(_, l)| l);
        if let (Kind::Skip, Some(_), Some(tokens)) = (kind, &rename, &kind_tokens) {
            cx.error_spanned_by(
                tokens,
                "conflicting shardable attributes `skip` and `rename`",
            );
        }
        Field { kind, rename }
    }
}

/// Variants take no attributes: reports any `#[shardable]` on one.
pub(crate) fn reject_on_variant(cx: &Ctxt, attrs: &[Attribute]) {
    for attr in attrs.iter().filter(|a| a.path().is_ident(SHARDABLE)) {
        cx.error_spanned_by(
            attr,
            "#[shardable] attributes are not supported on enum variants; put them on the fields",
        );
    }
}
