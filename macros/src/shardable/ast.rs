//! The internal AST of `#[derive(Shardable)]`: the input with its attributes parsed and the
//! FQN component of every field worked out. Built from `syn`'s AST by [`Container::from_ast`].

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::{DeriveInput, Generics, Ident, Member, Type};

use super::attr;
use crate::ctxt::Ctxt;

pub(crate) struct Container<'a> {
    pub ident: &'a Ident,
    pub generics: &'a Generics,
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
        Some(Container {
            ident: &input.ident,
            generics: &input.generics,
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
            let (member, default_name) = match &field.ident {
                Some(ident) => (Member::Named(ident.clone()), ident.unraw().to_string()),
                None => (Member::Unnamed(i.into()), i.to_string()),
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
            }
        })
        .collect()
}
