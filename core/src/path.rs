//! Typed paths: the fully qualified names (FQNs) of modules, parameters and buffers, checked
//! by the compiler.
//!
//! `#[derive(Shardable)]` emits, next to `struct Net`, a path type `NetPath` with one method
//! per walked field, and an inherent `Net::path()` returning the root's path. A plan key can
//! then be written
//!
//! ```text
//! Net::path().blocks().at(0).fc1().weight()      // ParamPath "blocks.0.fc1.weight"
//! ```
//!
//! and a misspelt field (`.fc3()`) or a module where a parameter is expected is a compile
//! error. The string form stays: `ParamPath::from("blocks.0.fc1.weight")` for plans read from
//! files (checked against the model when the plan is applied).
//!
//! The pieces:
//!
//! * [`ParamPath`] and [`BufferPath`]: the FQN of one parameter or buffer. They convert from
//!   strings (the unchecked form) but not from each other nor from module paths.
//! * [`ModulePath`]: implemented by every module path (generated ones, [`VecPath`],
//!   [`AnyModulePath`], the layer paths of [`crate::nn`]) and by `str`/`String`, never by
//!   [`ParamPath`]/[`BufferPath`].
//! * [`HasPath`]: a module type's path type and its root path; [`PathNode`] builds a path at a
//!   given FQN (that is how a parent hands its child the child's prefix).
//! * Containers follow the walker's naming: `Vec<T>` and `[T; N]` give a [`VecPath`] whose
//!   elements are `.at(i)` (`"name.i"`), `Option<T>` and `Box<T>` are transparent (they have
//!   `T`'s path), `dyn Shardable` and `PhantomData` have an [`AnyModulePath`].
//!
//! An API that takes keys should accept `impl Into<ParamPath>` for parameters,
//! `impl Into<BufferPath>` for buffers and `impl ModulePath` for modules: each rejects the
//! other kinds at compile time and accepts strings.
//!
//! A hand-written [`Shardable`] impl whose type is a field of a derived
//! struct also needs a [`HasPath`] impl; the one-line form navigates by name:
//!
//! ```standalone_crate
//! # extern crate tch_dist_core as tch_dist;
//! use tch_dist::path::{AnyModulePath, HasPath};
//! # struct MyLayer;
//! impl HasPath for MyLayer {
//!     type Path = AnyModulePath; // MyLayer::path().param("weight"), .child("proj"), …
//! }
//! ```

use std::borrow::Borrow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;

use crate::walk::Shardable;

/// Joins a module's FQN and a local name: `join_fqn("blocks.0", "fc1") == "blocks.0.fc1"`,
/// and the root's FQN `""` adds nothing: `join_fqn("", "fc1") == "fc1"`.
///
/// ```
/// use tch_dist_core::path::join_fqn;
/// assert_eq!(join_fqn("blocks.0", "fc1"), "blocks.0.fc1");
/// assert_eq!(join_fqn("", "fc1"), "fc1");
/// ```
pub fn join_fqn(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        let mut s = String::with_capacity(prefix.len() + 1 + name.len());
        s.push_str(prefix);
        s.push('.');
        s.push_str(name);
        s
    }
}

/// Whether `fqn` is the module `prefix` or inside it (`""`, the root, holds everything):
/// `is_within("blocks.0.fc1.weight", "blocks.0")`, not `is_within("blocks.10", "blocks.1")`.
///
/// ```
/// use tch_dist_core::path::is_within;
/// assert!(is_within("blocks.0.fc1.weight", "blocks.0"));
/// assert!(is_within("head", ""));
/// assert!(!is_within("blocks.10", "blocks.1"));
/// ```
pub fn is_within(fqn: &str, prefix: &str) -> bool {
    prefix.is_empty()
        || fqn == prefix
        || fqn
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
}

macro_rules! tensor_path {
    ($(#[$doc:meta])* $name:ident, $what:literal, $module:literal, $leaf:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name {
            fqn: String,
        }

        impl $name {
            #[doc = concat!("A ", $what, " path from its FQN, unchecked (the string form, for ")]
            /// plans read from files); the module it is applied to validates it.
            ///
            /// ```
            #[doc = concat!(
                "let p = tch_dist_core::path::", stringify!($name), "::new(\"", $module, ".", $leaf, "\");"
            )]
            #[doc = concat!("assert_eq!(p.fqn(), \"", $module, ".", $leaf, "\");")]
            /// ```
            pub fn new(fqn: impl Into<String>) -> Self {
                $name { fqn: fqn.into() }
            }

            #[doc = concat!("The ", $what, " `name` of the module at `module`.")]
            ///
            /// ```
            #[doc = concat!("use tch_dist_core::path::", stringify!($name), ";")]
            #[doc = concat!(
                "let p = ", stringify!($name), "::in_module(\"", $module, "\", \"", $leaf, "\");"
            )]
            #[doc = concat!("assert_eq!(p, \"", $module, ".", $leaf, "\");")]
            /// ```
            pub fn in_module(module: &(impl ModulePath + ?Sized), name: &str) -> Self {
                $name::new(join_fqn(module.fqn(), name))
            }

            #[doc = concat!("The fully qualified name of the ", $what, ".")]
            ///
            /// ```
            #[doc = concat!(
                "let p = tch_dist_core::path::", stringify!($name), "::from(\"", $module, ".", $leaf, "\");"
            )]
            #[doc = concat!("assert_eq!(p.fqn(), \"", $module, ".", $leaf, "\");")]
            /// ```
            pub fn fqn(&self) -> &str {
                &self.fqn
            }

            /// The FQN as an owned string.
            ///
            /// ```
            #[doc = concat!(
                "let p = tch_dist_core::path::", stringify!($name), "::from(\"", $module, ".", $leaf, "\");"
            )]
            #[doc = concat!("let key: String = p.into_string(); // \"", $module, ".", $leaf, "\"")]
            /// ```
            pub fn into_string(self) -> String {
                self.fqn
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.fqn)
            }
        }

        impl From<$name> for String {
            fn from(path: $name) -> String {
                path.fqn
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.fqn
            }
        }

        /// Maps keyed by paths can be looked up with `&str`.
        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.fqn
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.fqn == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.fqn == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &self.fqn == other
            }
        }
    };
}

/// The unchecked string forms of a tensor path: `&str`, `String`, `&String`, and a reference
/// to a path (one line per type, so that compile errors quote short lines).
macro_rules! from_strings {
    ($name:ident) => {
        impl From<&str> for $name {
            fn from(fqn: &str) -> Self {
                $name::new(fqn)
            }
        }

        impl From<String> for $name {
            fn from(fqn: String) -> Self {
                $name::new(fqn)
            }
        }

        impl From<&String> for $name {
            fn from(fqn: &String) -> Self {
                $name::new(fqn.as_str())
            }
        }

        impl From<&$name> for $name {
            fn from(path: &$name) -> Self {
                path.clone()
            }
        }
    };
}

tensor_path!(
    /// The fully qualified name of a parameter, `"blocks.0.fc1.weight"`.
    ///
    /// Typed: `Net::path().blocks().at(0).fc1().weight()`; from a string (unchecked):
    /// `ParamPath::from("blocks.0.fc1.weight")`. It does not implement [`ModulePath`], and
    /// module paths do not convert into it, so an API taking `impl Into<ParamPath>` rejects a
    /// module path at compile time.
    ///
    /// ```standalone_crate
    /// # extern crate tch_dist_core as tch_dist;
    /// use tch::nn;
    /// use tch_dist::path::ParamPath;
    /// #[derive(tch_dist::Shardable)]
    /// struct Net { blocks: Vec<nn::Linear> }
    /// assert_eq!(Net::path().blocks().at(0).weight(), ParamPath::from("blocks.0.weight"));
    /// ```
    ParamPath,
    "parameter",
    "blocks.0.fc1",
    "weight"
);

tensor_path!(
    /// The fully qualified name of a buffer, `"norm.running_mean"`.
    ///
    /// Like [`ParamPath`], for buffers (`#[shardable(buffer)]` fields, running statistics).
    /// Parameter paths, buffer paths and module paths do not convert into each other.
    ///
    /// ```standalone_crate
    /// # extern crate tch_dist_core as tch_dist;
    /// use tch::nn;
    /// use tch_dist::path::BufferPath;
    /// #[derive(tch_dist::Shardable)]
    /// struct Net { norm: nn::BatchNorm }
    /// assert_eq!(Net::path().norm().running_mean(), BufferPath::from("norm.running_mean"));
    /// ```
    BufferPath,
    "buffer",
    "norm",
    "running_mean"
);

from_strings!(ParamPath);
from_strings!(BufferPath);

impl ParamPath {
    /// The parameter in `module`, if `module` reports one under this FQN.
    ///
    /// ```
    /// use tch_dist_core::path::ParamPath;
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let fc = tch::nn::linear(vs.root() / "fc", 4, 2, Default::default());
    /// assert_eq!(ParamPath::from("weight").find(&fc).map(|w| w.size()), Some(vec![2, 4]));
    /// assert!(ParamPath::from("fc.weight").find(&fc).is_none()); // FQNs within `fc`
    /// ```
    pub fn find<'a>(&self, module: &'a dyn Shardable) -> Option<&'a tch::Tensor> {
        module
            .named_parameters()
            .into_iter()
            .find_map(|(n, t)| (n == self.fqn).then_some(t))
    }
}

impl BufferPath {
    /// The buffer in `module`, if `module` reports one under this FQN.
    ///
    /// ```
    /// use tch_dist_core::path::BufferPath;
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let bn = tch::nn::batch_norm1d(vs.root() / "bn", 8, Default::default());
    /// assert!(BufferPath::from("running_mean").find(&bn).is_some());
    /// ```
    pub fn find<'a>(&self, module: &'a dyn Shardable) -> Option<&'a tch::Tensor> {
        module
            .named_buffers()
            .into_iter()
            .find_map(|(n, t)| (n == self.fqn).then_some(t))
    }
}

/// The path of a module: its fully qualified name (`""` for the root).
///
/// Implemented by every generated path type (`NetPath`), [`VecPath`], [`AnyModulePath`], the
/// layer paths of [`crate::nn`], and by `str`/`String` (the unchecked string form) and
/// references to any of them. Not implemented by [`ParamPath`] or [`BufferPath`], so an API
/// taking `impl ModulePath` rejects a tensor path at compile time.
///
/// ```
/// use tch_dist_core::path::ModulePath;
/// fn hook_name(module: impl ModulePath) -> String {
///     format!("hook of {:?}", module.fqn())
/// }
/// assert_eq!(hook_name("blocks.0"), "hook of \"blocks.0\"");
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a module path",
    label = "expected a module path",
    note = "module keys are typed module paths (`Net::path().blocks()`) or strings; \
            `ParamPath` and `BufferPath` name tensors, not modules"
)]
pub trait ModulePath {
    /// The module's fully qualified name (`""` for the root).
    ///
    /// ```
    /// use tch_dist_core::path::{HasPath, ModulePath};
    /// assert_eq!(ModulePath::fqn("blocks.0"), "blocks.0");
    /// assert_eq!(ModulePath::fqn(&tch::nn::Linear::path()), ""); // the root
    /// ```
    fn fqn(&self) -> &str;

    /// The same module as an [`AnyModulePath`], navigated by name from there.
    ///
    /// ```
    /// use tch_dist_core::path::ModulePath;
    /// let extra = "blocks.0".to_untyped().param("scale"); // a parameter the type does not name
    /// assert_eq!(extra, "blocks.0.scale");
    /// ```
    fn to_untyped(&self) -> AnyModulePath {
        AnyModulePath::at_prefix(self.fqn().to_owned())
    }
}

impl ModulePath for str {
    fn fqn(&self) -> &str {
        self
    }
}

impl ModulePath for String {
    fn fqn(&self) -> &str {
        self
    }
}

impl<T: ModulePath + ?Sized> ModulePath for &T {
    fn fqn(&self) -> &str {
        (**self).fqn()
    }
}

/// A typed module path that can be built at any FQN: how a parent's path hands a child its
/// prefix (`PathNode::at_prefix(join_fqn(parent, "fc1"))`), and how a model's paths are
/// mounted under another module (`NetPath::at_prefix("encoder".into())`).
///
/// ```
/// use tch_dist_core::nn::LinearPath;
/// use tch_dist_core::path::PathNode;
/// let head = LinearPath::at_prefix("decoder.head".into()); // a Linear mounted there
/// assert_eq!(head.weight(), "decoder.head.weight");
/// ```
pub trait PathNode: ModulePath + Sized {
    /// The path of the module whose FQN is `fqn` (`""` for the root).
    ///
    /// ```
    /// use tch_dist_core::path::{AnyModulePath, PathNode};
    /// assert_eq!(AnyModulePath::at_prefix("encoder".into()).child("fc1").fqn(), "encoder.fc1");
    /// ```
    fn at_prefix(fqn: String) -> Self;
}

/// A module type with typed paths: [`HasPath::Path`] names its children, parameters and
/// buffers, [`HasPath::path`] is the path of the type used as the root module.
///
/// `#[derive(Shardable)]` implements it (and adds the inherent `Net::path()`); core
/// implements it for tch's layers, containers and `dyn Shardable`. A hand-written
/// `Shardable` impl can use `type Path = AnyModulePath;`.
///
/// ```
/// use tch_dist_core::path::HasPath;
/// // tch's layers have paths; so do `#[derive(Shardable)]` types (`Net::path()`).
/// assert_eq!(<tch::nn::Embedding as HasPath>::path().weight(), "weight");
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no typed path",
    label = "`{Self}` does not implement `HasPath`",
    note = "a module field of a `#[derive(Shardable)]` type needs `Shardable` and `HasPath`, \
            which the derive implements together; next to a hand-written `Shardable` impl, add \
            `impl HasPath for {Self} {{ type Path = AnyModulePath; }}` \
            (`tch_dist::path::{{HasPath, AnyModulePath}}`)"
)]
pub trait HasPath {
    /// The type's path: a method per child module, parameter and buffer.
    type Path: PathNode;

    /// The path of this type used as the root module (FQN `""`).
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let keys: Vec<_> = <Vec<tch::nn::Linear>>::path().elements(2).map(|l| l.bias()).collect();
    /// assert_eq!(keys, ["0.bias", "1.bias"]);
    /// ```
    fn path() -> Self::Path {
        Self::Path::at_prefix(String::new())
    }
}

/// Defines a module path struct (`fqn` field, `fqn()`, `ModulePath`, `PathNode`, `Display`,
/// `Clone`, `Debug`, `PartialEq`, `Eq`, `Hash`) with extra inherent methods.
macro_rules! module_path_struct {
    ($(#[$doc:meta])* $name:ident { $($body:tt)* }) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        pub struct $name {
            fqn: String,
        }

        impl $name {
            /// The fully qualified name of this module.
            ///
            /// ```
            /// use tch_dist_core::path::PathNode;
            #[doc = concat!(
                "let p = ", module_path!(), "::", stringify!($name), "::at_prefix(\"blocks.0\".into());"
            )]
            /// assert_eq!(p.fqn(), "blocks.0");
            /// ```
            pub fn fqn(&self) -> &str {
                &self.fqn
            }

            $($body)*
        }

        impl $crate::path::ModulePath for $name {
            fn fqn(&self) -> &str {
                &self.fqn
            }
        }

        impl $crate::path::PathNode for $name {
            fn at_prefix(fqn: String) -> Self {
                $name { fqn }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(&self.fqn)
            }
        }
    };
}
pub(crate) use module_path_struct;

module_path_struct!(
    /// A module path navigated by name, without checks: the path type of hand-written
    /// [`Shardable`] impls, `dyn Shardable` and `PhantomData`, and an escape hatch from any
    /// typed path ([`ModulePath::to_untyped`]).
    ///
    /// ```
    /// use tch_dist_core::path::{AnyModulePath, HasPath};
    /// let root = <dyn tch_dist_core::Shardable>::path(); // a trait object's: by name
    /// assert_eq!(root.child("blocks").at(0).param("weight"), "blocks.0.weight");
    /// # let _: AnyModulePath = root;
    /// ```
    AnyModulePath {
        /// The child module `name`.
        ///
        /// ```
        /// use tch_dist_core::path::ModulePath;
        /// assert_eq!("encoder".to_untyped().child("fc1").fqn(), "encoder.fc1");
        /// ```
        pub fn child(&self, name: &str) -> AnyModulePath {
            AnyModulePath { fqn: join_fqn(&self.fqn, name) }
        }

        /// The child module `i` (an element of a `Vec` or an array).
        ///
        /// ```
        /// use tch_dist_core::path::ModulePath;
        /// assert_eq!("blocks".to_untyped().at(3).fqn(), "blocks.3");
        /// ```
        pub fn at(&self, i: usize) -> AnyModulePath {
            self.child(&i.to_string())
        }

        /// The parameter `name` of this module.
        ///
        /// ```
        /// use tch_dist_core::path::ModulePath;
        /// assert_eq!("blocks.0".to_untyped().param("weight"), "blocks.0.weight");
        /// ```
        pub fn param(&self, name: &str) -> ParamPath {
            ParamPath::in_module(self, name)
        }

        /// The buffer `name` of this module.
        ///
        /// ```
        /// use tch_dist_core::path::ModulePath;
        /// assert_eq!("norm".to_untyped().buffer("running_var"), "norm.running_var");
        /// ```
        pub fn buffer(&self, name: &str) -> BufferPath {
            BufferPath::in_module(self, name)
        }
    }
);

/// The path of a `Vec<T>` or `[T; N]` field, a module like PyTorch's `nn.ModuleList`:
/// element `i` is the child `"i"` (`.at(i)`), with `T`'s path type `P`.
///
/// ```standalone_crate
/// # extern crate tch_dist_core as tch_dist;
/// #[derive(tch_dist::Shardable)]
/// struct Net { blocks: Vec<tch::nn::Linear> }
/// let blocks: tch_dist::path::VecPath<_> = Net::path().blocks();
/// assert_eq!(blocks.at(1).weight(), "blocks.1.weight");
/// ```
pub struct VecPath<P> {
    fqn: String,
    elem: PhantomData<fn() -> P>,
}

impl<P> VecPath<P> {
    /// The fully qualified name of the list module.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// assert_eq!(<Vec<tch::nn::Linear>>::path().fqn(), ""); // a list at the root
    /// ```
    pub fn fqn(&self) -> &str {
        &self.fqn
    }
}

impl<P: PathNode> VecPath<P> {
    /// The path of element `i`: FQN `"<list>.i"`.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// assert_eq!(<Vec<tch::nn::Linear>>::path().at(2).weight(), "2.weight");
    /// ```
    pub fn at(&self, i: usize) -> P {
        P::at_prefix(join_fqn(&self.fqn, &i.to_string()))
    }

    /// The paths of elements `0..len`, for keys that repeat over every block.
    ///
    /// ```
    /// use tch_dist_core::path::HasPath;
    /// let blocks = <[tch::nn::Linear; 3]>::path();
    /// assert_eq!(blocks.elements(3).map(|b| b.weight()).last().unwrap(), "2.weight");
    /// ```
    pub fn elements(&self, len: usize) -> impl Iterator<Item = P> + '_ {
        (0..len).map(move |i| self.at(i))
    }
}

impl<P> ModulePath for VecPath<P> {
    fn fqn(&self) -> &str {
        &self.fqn
    }
}

impl<P> PathNode for VecPath<P> {
    fn at_prefix(fqn: String) -> Self {
        VecPath {
            fqn,
            elem: PhantomData,
        }
    }
}

impl<P> Clone for VecPath<P> {
    fn clone(&self) -> Self {
        VecPath::at_prefix(self.fqn.clone())
    }
}

impl<P> fmt::Debug for VecPath<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("VecPath").field(&self.fqn).finish()
    }
}

impl<P> fmt::Display for VecPath<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.fqn)
    }
}

impl<P> PartialEq for VecPath<P> {
    fn eq(&self, other: &Self) -> bool {
        self.fqn == other.fqn
    }
}

impl<P> Eq for VecPath<P> {}

impl<P> Hash for VecPath<P> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.fqn.hash(state)
    }
}

// ---- containers, mirroring the walker (walk.rs) -------------------------------------------

/// `Box<T>` is transparent: the boxed module's path, under the field's own name.
impl<T: HasPath + ?Sized> HasPath for Box<T> {
    type Path = T::Path;
}

/// `Option<T>` is transparent: `T`'s path (absent at run time when `None`).
impl<T: HasPath> HasPath for Option<T> {
    type Path = T::Path;
}

/// `Vec<T>` is a module list: elements `.at(i)`.
impl<T: HasPath> HasPath for Vec<T> {
    type Path = VecPath<T::Path>;
}

/// `[T; N]` is a module list: elements `.at(i)`.
impl<T: HasPath, const N: usize> HasPath for [T; N] {
    type Path = VecPath<T::Path>;
}

/// `PhantomData` reports nothing; the derive gives `PhantomData` fields no path method, and
/// this impl only lets aliased ones compile.
impl<T: ?Sized> HasPath for PhantomData<T> {
    type Path = AnyModulePath;
}

/// A trait object's children are not known statically: navigate by name.
impl HasPath for dyn Shardable + '_ {
    type Path = AnyModulePath;
}

/// A trait object's children are not known statically: navigate by name.
impl HasPath for dyn Shardable + Send + '_ {
    type Path = AnyModulePath;
}

/// A trait object's children are not known statically: navigate by name.
impl HasPath for dyn Shardable + Send + Sync + '_ {
    type Path = AnyModulePath;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_key(p: impl Into<ParamPath>) -> String {
        p.into().into_string()
    }

    fn module_key(m: impl ModulePath) -> String {
        m.fqn().to_owned()
    }

    #[test]
    fn join() {
        assert_eq!(join_fqn("", "fc1"), "fc1");
        assert_eq!(join_fqn("blocks.0", "fc1"), "blocks.0.fc1");
    }

    #[test]
    fn string_forms() {
        assert_eq!(param_key("a.weight"), "a.weight");
        assert_eq!(param_key(String::from("a.bias")), "a.bias");
        let p = ParamPath::from("x.weight");
        assert_eq!(param_key(&p), "x.weight");
        assert_eq!(p, "x.weight");
        assert_eq!(p.to_string(), "x.weight");
        assert_eq!(module_key("blocks.0"), "blocks.0");
        assert_eq!(module_key(String::from("")), "");
        let a = String::from("a");
        assert_eq!(module_key(&a), "a");
        let mut set = std::collections::HashSet::new();
        set.insert(p.clone());
        assert!(set.contains("x.weight"));
    }

    #[test]
    fn containers() {
        type Layers = Vec<Option<Box<dyn Shardable>>>;
        let layers = <Layers as HasPath>::path();
        assert_eq!(layers.fqn(), "");
        let l = VecPath::<AnyModulePath>::at_prefix("layers".into());
        assert_eq!(l.at(3).fqn(), "layers.3");
        assert_eq!(
            l.at(3).child("proj").param("weight"),
            "layers.3.proj.weight"
        );
        assert_eq!(
            l.at(0).buffer("running_mean").fqn(),
            "layers.0.running_mean"
        );
        let all: Vec<String> = l.elements(2).map(|p| p.fqn().to_owned()).collect();
        assert_eq!(all, ["layers.0", "layers.1"]);
        assert_eq!(format!("{l:?}"), "VecPath(\"layers\")");
        assert_eq!(l.clone(), l);
        assert_eq!("a.b".to_untyped().at(1).fqn(), "a.b.1");
    }
}
