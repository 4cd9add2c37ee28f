//! tch-dist core: the module walker ([`Shardable`]), module identity ([`ModuleKey`]), the
//! composable-API registry behind `#[contract]` ([`contract`](mod@contract)) and forward hooks
//! ([`hooks`]). No FFI of its own: everything goes through `tch`.
//!
//! Most users reach these items through the `tch_dist` facade, which re-exports them and
//! the two macros. Three registries live here, each for one job:
//!
//! * the **catalogue** ([`contract::catalogue`]): every composable API declared with
//!   `#[contract]` in any linked crate, with its declared conflicts (an `inventory`
//!   collection, filled at link time);
//! * the **per-instance registry** ([`registry`], [`contract::contract_state`]): for each
//!   module instance, the APIs applied to it in order and each API's typed state;
//! * the **hooks** ([`hooks`]): forward pre-hooks and forward hooks per module instance,
//!   run by [`hooks::Call::call`].
//!
//! The last two share one store keyed by [`ModuleKey`].

#![warn(missing_docs)]

pub mod contract;
pub mod hooks;
mod instances;
mod key;
pub mod nn;
pub mod path;
mod shallow_clone;
pub mod sharding;
pub mod trace;
mod var_store;
mod walk;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
#[doc(hidden)]
pub mod testing;

pub use contract::{registry, ContractApi, ContractError};
pub use key::{InstanceAlias, InstanceHandles, ModuleKey};
pub use path::{BufferPath, HasPath, ModulePath, ParamPath};
pub use shallow_clone::ShallowClone;
pub use var_store::{check_against_var_store, VarStoreMismatch};
pub use walk::{
    AsDynShardable, FqnPath, ModuleVisitor, ModuleVisitorMut, Shardable, TensorField, TensorKind,
};

/// `#[derive(Shardable)]`; see the macro's documentation in the `tch_dist` facade.
pub use tch_dist_macros::Shardable;

/// `#[derive(ShallowClone)]`; see the macro's documentation in the `tch_dist` facade.
pub use tch_dist_macros::ShallowClone;

/// `#[contract]`; see the macro's documentation in the `tch_dist` facade.
pub use tch_dist_macros::contract;

/// The examples of `#[derive(Shardable)]`'s documentation, run as doctests here (the
/// proc-macro crate does not link libtorch).
#[cfg(doctest)]
#[doc = include_str!("../../macros/doc/derive_shardable.md")]
struct DeriveShardableDoctests;

/// The examples of `#[contract]`'s documentation, run as doctests here.
#[cfg(doctest)]
#[doc = include_str!("../../macros/doc/contract.md")]
struct ContractDoctests;
