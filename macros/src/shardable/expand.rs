//! Code generation of `#[derive(Shardable)]` from the checked internal AST.
//!
//! Everything is emitted inside `const _: () = { ... };` with absolute paths rooted at the
//! container's crate path (`::tch_dist` by default). Each walked field becomes one call whose
//! tokens carry the span of the field's type, so a field whose type is not `Shardable` fails
//! with the trait-bound error pointing at that type.

use std::collections::HashSet;

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::{Ident, Type};

use super::ast::{Container, Data, Field, Variant};
use super::attr::Kind;

pub(crate) fn expand(cont: &Container) -> TokenStream {
    let krate = &cont.krate;
    let ident = cont.ident;
    let generics = with_bounds(cont);
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();

    let (visit, visit_mut, extra) = match &cont.data {
        Data::Struct(fields) => {
            let pat = pattern(quote!(Self), fields);
            let stmts = fields_stmts(krate, fields, false);
            let stmts_mut = fields_stmts(krate, fields, true);
            (
                quote! { let #pat = self; #(#stmts)* },
                quote! { let #pat = self; #(#stmts_mut)* },
                TokenStream::new(),
            )
        }
        Data::Enum(variants) => expand_enum(krate, variants),
    };

    quote! {
        const _: () = {
            #[automatically_derived]
            impl #impl_generics #krate::Shardable for #ident #ty_generics #where_clause {
                fn visit<'__a>(&'__a self, __visitor: &mut dyn #krate::ModuleVisitor<'__a>) {
                    #visit
                }
                fn visit_mut<'__a>(&'__a mut self, __visitor: &mut dyn #krate::ModuleVisitorMut<'__a>) {
                    #visit_mut
                }
                #extra
            }
        };
    }
}

/// The binding of the `i`-th field in destructuring patterns, spanned on its type.
fn binding(i: usize, field: &Field) -> Ident {
    format_ident!("__f{}", i, span = field.ty.span())
}

/// `Path { member: __f0, .., }` binding every walked field by reference.
fn pattern(path: TokenStream, fields: &[Field]) -> TokenStream {
    let binds = fields
        .iter()
        .enumerate()
        .filter(|(_, f)| f.attrs.kind != Kind::Skip)
        .map(|(i, f)| {
            let member = &f.member;
            let b = binding(i, f);
            quote!(#member: #b)
        });
    quote!(#path { #(#binds,)* .. })
}

fn fields_stmts(krate: &syn::Path, fields: &[Field], mutable: bool) -> Vec<TokenStream> {
    fields
        .iter()
        .enumerate()
        .map(|(i, f)| field_stmt(krate, i, f, mutable))
        .collect()
}

fn field_stmt(krate: &syn::Path, i: usize, f: &Field, mutable: bool) -> TokenStream {
    let b = binding(i, f);
    let name = &f.name;
    let span = f.ty.span();
    let tensor_kind = match f.attrs.kind {
        Kind::Skip => return TokenStream::new(),
        Kind::Module => {
            return if mutable {
                quote_spanned!(span=> #krate::Shardable::visit_child_mut(#b, #name, __visitor);)
            } else {
                quote_spanned!(span=> #krate::Shardable::visit_child(#b, #name, __visitor);)
            };
        }
        Kind::Param => quote!(#krate::TensorKind::Parameter),
        Kind::Buffer => quote!(#krate::TensorKind::Buffer),
    };
    if mutable {
        quote_spanned!(span=> #krate::TensorField::visit_field_mut(#b, #name, #tensor_kind, __visitor);)
    } else {
        quote_spanned!(span=> #krate::TensorField::visit_field(#b, #name, #tensor_kind, __visitor);)
    }
}

fn expand_enum(krate: &syn::Path, variants: &[Variant]) -> (TokenStream, TokenStream, TokenStream) {
    if variants.is_empty() {
        return (
            quote!(match *self {}),
            quote!(match *self {}),
            TokenStream::new(),
        );
    }
    let mut arms = Vec::new();
    let mut arms_mut = Vec::new();
    for v in variants {
        let vident = v.ident;
        let pat = pattern(quote!(Self::#vident), &v.fields);
        if v.is_transparent() {
            let b = binding(0, &v.fields[0]);
            let span = v.fields[0].ty.span();
            arms.push(quote_spanned!(span=> #pat => #krate::Shardable::visit(#b, __visitor),));
            arms_mut
                .push(quote_spanned!(span=> #pat => #krate::Shardable::visit_mut(#b, __visitor),));
        } else {
            let stmts = fields_stmts(krate, &v.fields, false);
            let stmts_mut = fields_stmts(krate, &v.fields, true);
            arms.push(quote!(#pat => { #(#stmts)* }));
            arms_mut.push(quote!(#pat => { #(#stmts_mut)* }));
        }
    }
    let visit = quote!(match self { #(#arms)* });
    let visit_mut = quote!(match self { #(#arms_mut)* });

    // Transparent variants also forward their name, type and module boundary.
    let transparent: Vec<&Variant> = variants.iter().filter(|v| v.is_transparent()).collect();
    if transparent.is_empty() {
        return (visit, visit_mut, TokenStream::new());
    }
    let pats: Vec<TokenStream> = transparent
        .iter()
        .map(|v| {
            let vident = v.ident;
            pattern(quote!(Self::#vident), &v.fields)
        })
        .collect();
    let bs: Vec<Ident> = transparent
        .iter()
        .map(|v| binding(0, &v.fields[0]))
        .collect();
    let fallback = (transparent.len() < variants.len()).then(|| quote!(_));
    let name = Ident::new("__name", Span::mixed_site());
    let type_name_fallback = fallback
        .as_ref()
        .map(|w| quote!(#w => ::core::any::type_name::<Self>(),));
    let child_fallback = fallback.as_ref().map(|w| {
        quote!(#w => {
            __visitor.enter_module(#name, self);
            #krate::Shardable::visit(self, __visitor);
            __visitor.exit_module(#name);
        })
    });
    let child_mut_fallback = fallback.as_ref().map(|w| {
        quote!(#w => {
            __visitor.enter_module(#name, #krate::Shardable::type_name(self));
            #krate::Shardable::visit_mut(self, __visitor);
            __visitor.exit_module(#name);
        })
    });
    let extra = quote! {
        fn type_name(&self) -> &'static str {
            match self {
                #(#pats => #krate::Shardable::type_name(#bs),)*
                #type_name_fallback
            }
        }
        fn visit_child<'__a>(&'__a self, #name: &str, __visitor: &mut dyn #krate::ModuleVisitor<'__a>) {
            match self {
                #(#pats => #krate::Shardable::visit_child(#bs, #name, __visitor),)*
                #child_fallback
            }
        }
        fn visit_child_mut<'__a>(&'__a mut self, #name: &str, __visitor: &mut dyn #krate::ModuleVisitorMut<'__a>) {
            match self {
                #(#pats => #krate::Shardable::visit_child_mut(#bs, #name, __visitor),)*
                #child_mut_fallback
            }
        }
    };
    (visit, visit_mut, extra)
}

/// The input's generics plus, for each walked field whose type mentions a type parameter,
/// `FieldType: Shardable` (or `FieldType: TensorField` for tensor fields). Fields with
/// concrete types get no bound, so their errors point at the field, not the impl.
fn with_bounds(cont: &Container) -> syn::Generics {
    let mut generics = cont.generics.clone();
    let params: HashSet<Ident> = generics.type_params().map(|p| p.ident.clone()).collect();
    if params.is_empty() {
        return generics;
    }
    let fields: Vec<&Field> = match &cont.data {
        Data::Struct(fields) => fields.iter().collect(),
        Data::Enum(variants) => variants.iter().flat_map(|v| &v.fields).collect(),
    };
    let krate = &cont.krate;
    let mut seen: Vec<&Type> = Vec::new();
    let where_clause = generics.make_where_clause();
    for f in fields {
        if f.attrs.kind == Kind::Skip || !mentions_any(f.ty, &params) || seen.contains(&f.ty) {
            continue;
        }
        seen.push(f.ty);
        let ty = f.ty;
        let bound = match f.attrs.kind {
            Kind::Module => quote!(#krate::Shardable),
            _ => quote!(#krate::TensorField),
        };
        where_clause.predicates.push(syn::parse_quote!(#ty: #bound));
    }
    generics
}

fn mentions_any(ty: &Type, params: &HashSet<Ident>) -> bool {
    struct Finder<'p> {
        params: &'p HashSet<Ident>,
        found: bool,
    }
    impl<'ast> Visit<'ast> for Finder<'_> {
        fn visit_path(&mut self, path: &'ast syn::Path) {
            if path.leading_colon.is_none() {
                if let Some(first) = path.segments.first() {
                    if self.params.contains(&first.ident) {
                        self.found = true;
                    }
                }
            }
            syn::visit::visit_path(self, path);
        }
    }
    let mut finder = Finder {
        params,
        found: false,
    };
    finder.visit_type(ty);
    finder.found
}
