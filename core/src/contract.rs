//! Composable APIs: the catalogue of APIs declared with `#[contract]`, the per-instance
//! registry of applied APIs and their states, and [`ContractError`].
//!
//! This is the Rust side of `torch.distributed._composable.contract`:
//!
//! * [`registry`] is PyTorch's `_get_registry(module)`: the names of the composable APIs
//!   applied to a module instance, in order.
//! * [`contract_state`] is `api.state(module)`; `#[contract]` generates a typed accessor
//!   (`replicate::state(&model)`) that calls it.
//! * [`catalogue`] lists every API declared with `#[contract]` in any crate linked into the
//!   program (an [`inventory`] collection), so an API from a third-party crate can declare
//!   conflicts and have them honoured by APIs that never heard of it.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::instances::InstanceTable;
use crate::key::{identify, ModuleKey};
use crate::walk::{FqnSnapshot, Shardable};

/// A composable API declared with `#[contract]`: an entry of the [`catalogue`].
///
/// ```standalone_crate
/// # extern crate tch_dist_core as tch_dist;
/// # mod ddp {
/// #     use tch_dist::{contract, ContractError, Shardable};
/// #     #[contract(conflicts(fsdp))]
/// #     pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
/// #         Ok(())
/// #     }
/// # }
/// // `ddp::apply` is declared with `#[contract(conflicts(fsdp))]` in module `ddp`.
/// let api = tch_dist::contract::find_api("ddp")[0];
/// assert_eq!((api.name, api.conflicts), ("ddp", &["fsdp"][..]));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContractApi {
    /// The API's name: the last segment of its function's module path (`replicate` for
    /// `tch_dist::replicate::apply`) unless `#[contract(name = "...")]` says otherwise.
    pub name: &'static str,
    /// Names of the APIs it cannot be combined with on one module (`conflicts(...)`).
    /// A conflict declared by either side is enforced.
    pub conflicts: &'static [&'static str],
    /// `module_path!()` of the function.
    pub module_path: &'static str,
}

impl ContractApi {
    /// Whether this API declares a conflict with `other`.
    ///
    /// ```standalone_crate
    /// # extern crate tch_dist_core as tch_dist;
    /// # mod ddp {
    /// #     use tch_dist::{contract, ContractError, Shardable};
    /// #     #[contract(conflicts(fsdp))]
    /// #     pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
    /// #         Ok(())
    /// #     }
    /// # }
    /// let ddp = tch_dist::contract::find_api("ddp")[0]; // #[contract(conflicts(fsdp))]
    /// assert!(ddp.conflicts_with("fsdp") && !ddp.conflicts_with("checkpoint"));
    /// ```
    pub fn conflicts_with(&self, other: &str) -> bool {
        self.conflicts.contains(&other)
    }
}

inventory::collect!(ContractApi);

/// Every composable API declared with `#[contract]` in the program, sorted by name.
///
/// ```standalone_crate
/// # extern crate tch_dist_core as tch_dist;
/// for api in tch_dist::contract::catalogue() {
///     println!("{} ({}): conflicts with {:?}", api.name, api.module_path, api.conflicts);
/// }
/// ```
pub fn catalogue() -> Vec<&'static ContractApi> {
    let mut all: Vec<&'static ContractApi> = inventory::iter::<ContractApi>.into_iter().collect();
    all.sort_by(|a, b| (a.name, a.module_path).cmp(&(b.name, b.module_path)));
    all
}

/// The catalogue entries called `name` (normally at most one).
///
/// ```standalone_crate
/// # extern crate tch_dist_core as tch_dist;
/// # mod ddp {
/// #     use tch_dist::{contract, ContractError, Shardable};
/// #     #[contract(conflicts(fsdp))]
/// #     pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
/// #         Ok(())
/// #     }
/// # }
/// use tch_dist::contract::find_api;
/// assert_eq!(find_api("ddp").len(), 1);
/// assert!(find_api("no_such_api").is_empty());
/// ```
pub fn find_api(name: &str) -> Vec<&'static ContractApi> {
    inventory::iter::<ContractApi>
        .into_iter()
        .filter(|a| a.name == name)
        .collect()
}

/// Whether the APIs `a` and `b` conflict: either declares the other in its catalogue entry.
///
/// ```standalone_crate
/// # extern crate tch_dist_core as tch_dist;
/// # mod ddp {
/// #     use tch_dist::{contract, ContractError, Shardable};
/// #     #[contract(conflicts(fsdp))]
/// #     pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
/// #         Ok(())
/// #     }
/// # }
/// use tch_dist::contract::apis_conflict;
/// // `ddp` declares conflicts(fsdp); `fsdp` need not even exist.
/// assert!(apis_conflict("ddp", "fsdp") && apis_conflict("fsdp", "ddp"));
/// ```
pub fn apis_conflict(a: &str, b: &str) -> bool {
    find_api(a).iter().any(|api| api.conflicts_with(b))
        || find_api(b).iter().any(|api| api.conflicts_with(a))
}

/// The names of the composable APIs applied to `module`, in the order they were applied
/// (PyTorch's `_get_registry(module)`). Empty for a module with no parameters or buffers.
///
/// ```standalone_crate
/// # extern crate tch_dist_core as tch_dist;
/// # mod ddp {
/// #     use tch_dist::{contract, ContractError, Shardable};
/// #     #[contract(conflicts(fsdp))]
/// #     pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
/// #         Ok(())
/// #     }
/// # }
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let fc = tch::nn::linear(vs.root() / "fc", 2, 2, Default::default());
/// assert!(tch_dist::registry(&fc).is_empty());
/// ddp::apply(&fc)?;
/// assert_eq!(tch_dist::registry(&fc), ["ddp"]);
/// # Ok::<(), tch_dist::ContractError>(())
/// ```
pub fn registry<M: Shardable + ?Sized>(module: &M) -> Vec<&'static str> {
    let Some((key, first)) = identify(module.as_dyn_shardable()) else {
        return Vec::new();
    };
    let mut store = InstanceTable::lock();
    store
        .get(&key, first)
        .map(|e| e.applied.clone())
        .unwrap_or_default()
}

/// The state that API `api` stored for `module`, if it was applied to it and its state
/// has type `S`. `#[contract]` generates a typed accessor around it.
///
/// ```standalone_crate
/// # extern crate tch_dist_core as tch_dist;
/// # mod ddp {
/// #     use tch_dist::{contract, ContractError, Shardable};
/// #     #[contract(conflicts(fsdp))]
/// #     pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
/// #         Ok(())
/// #     }
/// # }
/// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// # let fc = tch::nn::linear(vs.root() / "fc", 2, 2, Default::default());
/// ddp::apply(&fc)?;
/// let state: Option<std::sync::Arc<()>> = tch_dist::contract::contract_state("ddp", &fc);
/// assert!(state.is_some()); // as `ddp::state(&fc)`
/// # Ok::<(), tch_dist::ContractError>(())
/// ```
pub fn contract_state<S, M>(api: &str, module: &M) -> Option<Arc<S>>
where
    S: Any + Send + Sync,
    M: Shardable + ?Sized,
{
    let (key, first) = identify(module.as_dyn_shardable())?;
    let state = {
        let mut store = InstanceTable::lock();
        let entry = store.get(&key, first)?;
        entry
            .states
            .iter()
            .find(|(name, _)| *name == api)
            .map(|(_, s)| Arc::clone(s))?
    };
    state.downcast::<S>().ok()
}

/// Drops everything attached to `module` itself (applied APIs, their states, hooks; not
/// those of its children). Returns whether there was anything. Useful before dropping a
/// module in a long-running process: entries of dropped modules are otherwise only
/// reclaimed lazily.
///
/// ```standalone_crate
/// # extern crate tch_dist_core as tch_dist;
/// # mod ddp {
/// #     use tch_dist::{contract, ContractError, Shardable};
/// #     #[contract(conflicts(fsdp))]
/// #     pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
/// #         Ok(())
/// #     }
/// # }
/// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// # let fc = tch::nn::linear(vs.root() / "fc", 2, 2, Default::default());
/// ddp::apply(&fc)?;
/// assert!(tch_dist::contract::release(&fc)); // its registry, states and hooks dropped
/// assert!(tch_dist::registry(&fc).is_empty());
/// # Ok::<(), tch_dist::ContractError>(())
/// ```
pub fn release<M: Shardable + ?Sized>(module: &M) -> bool {
    match identify(module.as_dyn_shardable()) {
        Some((key, first)) => InstanceTable::lock().release(&key, first),
        None => false,
    }
}

/// Which FQN list a contract check is about.
///
/// ```
/// use tch_dist_core::contract::FqnKind;
/// assert_eq!(FqnKind::Parameters.to_string(), "Check parameters, "); // PyTorch's prefix
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FqnKind {
    /// `named_parameters()`.
    Parameters,
    /// `named_buffers()`.
    Buffers,
    /// `named_modules()`.
    Modules,
}

impl fmt::Display for FqnKind {
    /// PyTorch's prefix of the FQN errors ("Check parameters, ").
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FqnKind::Parameters => "Check parameters, ",
            FqnKind::Buffers => "Check buffer, ",
            FqnKind::Modules => "Check modules, ",
        })
    }
}

/// Why a composable API refused to apply. The messages are PyTorch's.
///
/// An API's own error type converts from it (`impl From<ContractError> for MyError`);
/// `#[contract]` uses that conversion.
///
/// ```standalone_crate
/// # extern crate tch_dist_core as tch_dist;
/// # mod ddp {
/// #     use tch_dist::{contract, ContractError, Shardable};
/// #     #[contract(conflicts(fsdp))]
/// #     pub fn apply<M: Shardable + ?Sized>(module: &M) -> Result<(), ContractError> {
/// #         Ok(())
/// #     }
/// # }
/// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// # let fc = tch::nn::linear(vs.root() / "fc", 2, 2, Default::default());
/// ddp::apply(&fc)?;
/// let err = ddp::apply(&fc).unwrap_err();
/// assert!(matches!(err, tch_dist::ContractError::AlreadyApplied { api: "ddp", .. }));
/// # Ok::<(), tch_dist::ContractError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    /// The API was already applied to this module instance.
    #[error(
        "Each distinct composable distributed API can only be applied to a module once. \
         {api} has already been applied to the following module: {module}"
    )]
    AlreadyApplied {
        /// The API.
        api: &'static str,
        /// The module's type name.
        module: &'static str,
    },
    /// The module is already managed by an API that conflicts with this one.
    #[error(
        "Cannot apply `{api}` to a module already managed by `{existing}`: \
         `{declared_by}` declares the two composable APIs as conflicting"
    )]
    Conflict {
        /// The API being applied.
        api: &'static str,
        /// The API already applied to the module.
        existing: &'static str,
        /// Which of the two declared the conflict.
        declared_by: &'static str,
    },
    /// The API added or removed parameters, buffers or modules.
    #[error(
        "{kind}Composable distributed API implementations cannot modify FQNs.\n\
         Only in original FQNs: {only_in_original:?},\nOnly in new FQNs: {only_in_new:?}"
    )]
    FqnsChanged {
        /// Which list changed.
        kind: FqnKind,
        /// Names that disappeared.
        only_in_original: Vec<String>,
        /// Names that appeared.
        only_in_new: Vec<String>,
    },
    /// The API reordered parameters, buffers or modules.
    #[error(
        "{kind}Composable distributed API implementations cannot modify the order of FQNs.\n\
         Original FQNs: {original:?}\nNew FQNs: {new:?}"
    )]
    FqnOrderChanged {
        /// Which list changed.
        kind: FqnKind,
        /// The names before, in order.
        original: Vec<String>,
        /// The names after, in order.
        new: Vec<String>,
    },
    /// The module has no parameters and no buffers, so it has no [`ModuleKey`].
    #[error(
        "`{api}` cannot be applied to a `{module}`: it has no parameters or buffers, so the \
         module instance cannot be identified"
    )]
    NoIdentity {
        /// The API.
        api: &'static str,
        /// The module's type name.
        module: &'static str,
    },
}

/// PyTorch's `check_fqn`.
fn check_fqns(kind: FqnKind, original: &[String], new: &[String]) -> Result<(), ContractError> {
    if original == new {
        return Ok(());
    }
    let only_in_original: Vec<String> = original
        .iter()
        .filter(|n| !new.contains(n))
        .cloned()
        .collect();
    let only_in_new: Vec<String> = new
        .iter()
        .filter(|n| !original.contains(n))
        .cloned()
        .collect();
    if only_in_original.is_empty() && only_in_new.is_empty() {
        Err(ContractError::FqnOrderChanged {
            kind,
            original: original.to_vec(),
            new: new.to_vec(),
        })
    } else {
        Err(ContractError::FqnsChanged {
            kind,
            only_in_original,
            only_in_new,
        })
    }
}

/// Refuses `api` on the instance if it was applied already or conflicts with an applied API.
fn check_applicable(
    api: &'static ContractApi,
    applied: &[&'static str],
    module: &'static str,
) -> Result<(), ContractError> {
    if applied.contains(&api.name) {
        return Err(ContractError::AlreadyApplied {
            api: api.name,
            module,
        });
    }
    for &existing in applied {
        if api.conflicts_with(existing) {
            return Err(ContractError::Conflict {
                api: api.name,
                existing,
                declared_by: api.name,
            });
        }
        if find_api(existing)
            .iter()
            .any(|other| other.conflicts_with(api.name))
        {
            return Err(ContractError::Conflict {
                api: api.name,
                existing,
                declared_by: existing,
            });
        }
    }
    Ok(())
}

/// The keys of every module of a tree, parallel to `FqnSnapshot::modules`.
fn module_keys(modules: &[&dyn Shardable]) -> Vec<Option<ModuleKey>> {
    modules
        .iter()
        .map(|m| identify(*m).map(|(k, _)| k))
        .collect()
}

/// Runs the checks around a `#[contract]` function's body. Used by generated code only.
#[doc(hidden)]
pub struct ContractGuard {
    api: &'static ContractApi,
    before: FqnSnapshot,
    keys: Vec<Option<ModuleKey>>,
}

#[doc(hidden)]
impl ContractGuard {
    /// Before the body: the module must have an identity, must not have this API applied
    /// yet and must not be managed by a conflicting API. Snapshots the FQNs.
    pub fn begin(
        api: &'static ContractApi,
        module: &dyn Shardable,
    ) -> Result<ContractGuard, ContractError> {
        let (key, first) = identify(module).ok_or(ContractError::NoIdentity {
            api: api.name,
            module: module.type_name(),
        })?;
        let (before, modules) = FqnSnapshot::of(module);
        {
            let mut store = InstanceTable::lock();
            let applied = store
                .get(&key, first)
                .map(|e| e.applied.clone())
                .unwrap_or_default();
            check_applicable(api, &applied, module.type_name())?;
            // Drop stale entries now, while the old tensors can still be checked, so that
            // `finish` only migrates live state.
            for m in &modules {
                if let Some((k, f)) = identify(*m) {
                    let _ = store.get(&k, f);
                }
            }
        }
        let keys = module_keys(&modules);
        Ok(ContractGuard { api, before, keys })
    }

    /// After a successful body: the FQNs must be unchanged (PyTorch's two errors); state
    /// attached to modules whose tensors the body replaced moves to their new keys; the
    /// API is recorded in the module's registry and `state` stored.
    pub fn finish<S: Any + Send + Sync>(
        self,
        module: &dyn Shardable,
        state: S,
    ) -> Result<Arc<S>, ContractError> {
        let (after, modules) = FqnSnapshot::of(module);
        check_fqns(FqnKind::Parameters, &self.before.params, &after.params)?;
        check_fqns(FqnKind::Buffers, &self.before.buffers, &after.buffers)?;
        check_fqns(FqnKind::Modules, &self.before.modules, &after.modules)?;
        let (key, first) = identify(module).ok_or(ContractError::NoIdentity {
            api: self.api.name,
            module: module.type_name(),
        })?;
        let mut store = InstanceTable::lock();
        for (old, m) in self.keys.iter().zip(&modules) {
            if let (Some(old), Some((new, new_first))) = (old, identify(*m)) {
                store.rekey(old, &new, new_first);
            }
        }
        let entry = store.get_or_insert(&key, first);
        // Checked again under the lock: the body ran unlocked.
        if let Err(e) = check_applicable(self.api, &entry.applied, module.type_name()) {
            store.remove_if_empty(&key);
            return Err(e);
        }
        let entry = store.get_or_insert(&key, first);
        let state = Arc::new(state);
        entry.applied.push(self.api.name);
        entry.states.push((
            self.api.name,
            Arc::clone(&state) as Arc<dyn Any + Send + Sync>,
        ));
        Ok(state)
    }
}
