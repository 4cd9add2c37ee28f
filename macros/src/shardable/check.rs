//! Checks of the internal AST that parsing cannot express: FQN components must be usable
//! names, and unique within a module.

use syn::ext::IdentExt;

use super::ast::{Container, Data, Field, Variant};
use super::attr::Kind;
use crate::ctxt::Ctxt;

pub(crate) fn check(cx: &Ctxt, cont: &Container) {
    match &cont.data {
        Data::Struct(fields) => check_fields(cx, fields),
        Data::Enum(variants) => {
            for v in variants {
                check_fields(cx, &v.fields);
            }
            check_variant_methods(cx, variants);
        }
    }
}

/// Two variants whose names give the same typed-path method (`HttpGet` and `HTTPGet` are both
/// `http_get`) cannot both have one.
fn check_variant_methods(cx: &Ctxt, variants: &[Variant]) {
    let with_path: Vec<&Variant> = variants.iter().filter(|v| v.has_path()).collect();
    for (i, v) in with_path.iter().enumerate() {
        let method = v.method.unraw().to_string();
        if let Some(prev) = with_path[..i].iter().find(|w| w.method.unraw() == method) {
            cx.error_spanned_by(
                v.ident,
                format!(
                    "variants `{}` and `{}` would both get the typed-path method `{method}`; \
                     rename one of them",
                    prev.ident, v.ident
                ),
            );
        }
    }
}

fn check_fields(cx: &Ctxt, fields: &[Field]) {
    for f in fields {
        if let Some(lit) = &f.attrs.rename {
            let name = lit.value();
            if name.contains('.') {
                cx.error_spanned_by(
                    lit,
                    format!(
                        "invalid rename `{name}`: `.` separates the components of fully \
                         qualified names, so a name cannot contain it"
                    ),
                );
            } else if name.is_empty() {
                cx.error_spanned_by(lit, "invalid rename: a name cannot be empty");
            }
        }
    }
    let walked: Vec<&Field> = fields
        .iter()
        .filter(|f| f.attrs.kind != Kind::Skip)
        .collect();
    for (i, f) in walked.iter().enumerate() {
        if walked[..i].iter().any(|g| g.name == f.name) {
            cx.error_spanned_by(
                &f.name_tokens,
                format!(
                    "duplicate name `{}`: two fields would have the same fully qualified name",
                    f.name
                ),
            );
        }
    }
}
