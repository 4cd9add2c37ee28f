//! The internal AST of `#[derive(Shardable)]`: the input with its attributes parsed and the
//! FQN component of every field worked out. Built from `syn`'s AST by [`Container::from_ast`].

use proc_macro2::TokenStream;
use quote::{format_ident, ToTokens};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{DeriveInput, Generics, Ident, Member, Type, Visibility};

use super::attr;
use crate::ctxt::Ctxt;

pub(crate) struct Container<'a> {
    pub ident: &'a Ident,
    pub vis: &'a Visibility,
    pub generics: &'a Generics,
    /// The generated typed-path struct: `path_type = "..."` or `<ident>Path`.
    pub path_ident: Ident,
    /// Path of the crate that exports `Shardable` (`::tch_dist` unless overridden).
    pub krate: syn::Path,
    pub data: Data<'a>,
}

pub(crate) enum Data<'a> {
    Struct(Vec<Field<'a>>),
    Enum(Vec<Variant<'a>>),
}

pub(crate) struct Variant<'a> {
    pub ident: &'a Ident,
    /// The typed-path method of the variant: the variant's name in snake case.
    pub method: Ident,
    pub fields: Vec<Field<'a>>,
    pub tuple: bool,
}

impl Variant<'_> {
    /// A tuple variant with one unrenamed module field is transparent, like `Option`: the
    /// enum value *is* that module (`Norm::Layer(nn::LayerNorm)` adds no name).
    pub(crate) fn is_transparent(&self) -> bool {
        self.tuple
            && self.fields.len() == 1
            && self.fields[0].attrs.kind == attr::Kind::Module
            && self.fields[0].attrs.rename.is_none()
    }

    /// Whether the variant gets a typed-path method: it is transparent or has a field with
    /// a path. Unit variants and variants with only skipped fields have nothing to name.
    pub(crate) fn has_path(&self) -> bool {
        self.is_transparent() || self.fields.iter().any(Field::has_path)
    }

    /// The name of the generated path struct of a non-transparent variant:
    /// `<Enum><Variant>Path`.
    pub(crate) fn path_ident(&self, enum_ident: &Ident) -> Ident {
        format_ident!(
            "{}{}Path",
            enum_ident.unraw(),
            self.ident.unraw(),
            span = self.ident.span()
        )
    }
}

pub(crate) struct Field<'a> {
    /// `self.<member>`: a name or a tuple index.
    pub member: Member,
    /// The FQN component: the rename, the field name (raw `r#` removed) or the index.
    pub name: String,
    /// What to point at in errors about the name: the rename literal or the field.
    pub name_tokens: TokenStream,
    pub ty: &'a Type,
    pub attrs: attr::Field,
    /// The typed-path method: the field's name (raw `r#` kept) or `_<index>`.
    pub method: Ident,
}

impl Field<'_> {
    /// Whether the field gets a typed-path method: it is walked and is not a `PhantomData`
    /// (which the walker never reports). A `Tensor` without `param`/`buffer` gets none
    /// either: it fails with "`Tensor: Shardable` is not satisfied", and a second error
    /// about its path would only hide that one.
    pub(crate) fn has_path(&self) -> bool {
        match self.attrs.kind {
            attr::Kind::Skip => false,
            attr::Kind::Module => !is_phantom_data(self.ty) && !is_tensor(self.ty),
            attr::Kind::Param | attr::Kind::Buffer => true,
        }
    }
}

/// `PhantomData<..>` written as such (any path ending in `PhantomData`).
fn is_phantom_data(ty: &Type) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == "PhantomData")
}

/// `Tensor` or `Option<Tensor>` written as such (any path ending in `Tensor`).
fn is_tensor(ty: &Type) -> bool {
    let Some(seg) = last_segment(ty) else {
        return false;
    };
    match &seg.arguments {
        syn::PathArguments::None => seg.ident == "Tensor",
        syn::PathArguments::AngleBracketed(args) if seg.ident == "Option" => {
            matches!(args.args.first(), Some(syn::GenericArgument::Type(t)) if args.args.len() == 1 && is_tensor(t))
        }
        _ => false,
    }
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Group(g) => last_segment(&g.elem),
        Type::Paren(p) => last_segment(&p.elem),
        _ => None,
    }
}

impl<'a> Container<'a> {
    /// `None` when the input cannot be derived at all (a union); the error is in `cx`.
    pub(crate) fn from_ast(cx: &Ctxt, input: &'a DeriveInput) -> Option<Container<'a>> {
        let attrs = attr::Container::from_ast(cx, &input.attrs);
        let data = match &input.data {
            syn::Data::Struct(s) => Data::Struct(fields_from_ast(cx, &s.fields)),
            syn::Data::Enum(e) => Data::Enum(
                e.variants
                    .iter()
                    .map(|v| {
                        attr::reject_on_variant(cx, &v.attrs);
                        Variant {
                            ident: &v.ident,
                            method: variant_method(&v.ident),
                            fields: fields_from_ast(cx, &v.fields),
                            tuple: matches!(v.fields, syn::Fields::Unnamed(_)),
                        }
                    })
                    .collect(),
            ),
            syn::Data::Union(u) => {
                cx.error_spanned_by(
                    u.union_token,
                    "#[derive(Shardable)] does not support unions: a module must be a struct or an enum",
                );
                return None;
            }
        };
        let krate = attrs.krate.unwrap_or_else(|| syn::parse_quote!(::tch_dist));
        let path_ident = attrs.path_type.unwrap_or_else(|| {
            format_ident!("{}Path", input.ident.unraw(), span = input.ident.span())
        });
        Some(Container {
            ident: &input.ident,
            vis: &input.vis,
            generics: &input.generics,
            path_ident,
            krate,
            data,
        })
    }
}

fn fields_from_ast<'a>(cx: &Ctxt, fields: &'a syn::Fields) -> Vec<Field<'a>> {
    fields
        .iter()
        .enumerate()
        .map(|(i, field)| {
            let attrs = attr::Field::from_ast(cx, &field.attrs);
            let (member, default_name, method) = match &field.ident {
                Some(ident) => (
                    Member::Named(ident.clone()),
                    ident.unraw().to_string(),
                    ident.clone(),
                ),
                None => (
                    Member::Unnamed(i.into()),
                    i.to_string(),
                    format_ident!("_{}", i, span = field.ty.span()),
                ),
            };
            let (name, name_tokens) = match &attrs.rename {
                Some(lit) => (lit.value(), lit.to_token_stream()),
                None => (
                    default_name,
                    match &field.ident {
                        Some(ident) => ident.to_token_stream(),
                        None => field.ty.to_token_stream(),
                    },
                ),
            };
            Field {
                member,
                name,
                name_tokens,
                ty: &field.ty,
                attrs,
                method,
            }
        })
        .collect()
}

/// The typed-path method of a variant: its name in snake case (`LayerNorm` → `layer_norm`),
/// raw when that is a keyword (`Type` → `r#type`), with a `_` suffix for `self`, `super` and
/// `crate`, which cannot be raw.
fn variant_method(ident: &Ident) -> Ident {
    let name = snake_case(&ident.unraw().to_string());
    let span = ident.span();
    if matches!(name.as_str(), "self" | "super" | "crate") {
        format_ident!("{}_", name, span = span)
    } else if syn::parse_str::<Ident>(&name).is_ok() {
        Ident::new(&name, span)
    } else {
        Ident::new_raw(&name, span)
    }
}

/// `LayerNorm` → `layer_norm`, `HTTPServer` → `http_server`, `Conv2D` → `conv2_d`.
pub(crate) fn snake_case(name: &str) -> String {
    let chars: Vec<char> = name.chars().collect();
    let mut out = String::with_capacity(name.len() + 4);
    for (i, &c) in chars.iter().enumerate() {
        if c.is_uppercase() {
            let prev = i.checked_sub(1).map(|j| chars[j]);
            let next = chars.get(i + 1).copied();
            let boundary = match prev {
                None | Some('_') => false,
                Some(p) if p.is_lowercase() || p.is_ascii_digit() => true,
                Some(p) => p.is_uppercase() && next.is_some_and(char::is_lowercase),
            };
            if boundary {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snake_case_of_variants() {
        assert_eq!(snake_case("LayerNorm"), "layer_norm");
        assert_eq!(snake_case("HTTPServer"), "http_server");
        assert_eq!(snake_case("Identity"), "identity");
        assert_eq!(snake_case("Conv2D"), "conv2_d");
        assert_eq!(snake_case("Already_Snake"), "already_snake");
    }

    #[test]
    fn variant_methods_avoid_keywords() {
        let m = |s: &str| variant_method(&Ident::new(s, proc_macro2::Span::call_site()));
        assert_eq!(m("Type").to_string(), "r#type");
        assert_eq!(m("Super").to_string(), "super_");
        assert_eq!(m("Fqn").to_string(), "fqn");
    }

    #[test]
    fn tensor_and_phantom_fields_are_recognised() {
        let ty = |s: &str| syn::parse_str::<Type>(s).unwrap();
        assert!(is_tensor(&ty("Tensor")));
        assert!(is_tensor(&ty("tch::Tensor")));
        assert!(is_tensor(&ty("Option<Tensor>")));
        assert!(!is_tensor(&ty("Vec<Tensor>")));
        assert!(!is_tensor(&ty("nn::Linear")));
        assert!(is_phantom_data(&ty("std::marker::PhantomData<T>")));
    }
}
