//! [`ModuleKey`]: the identity of a module instance, which survives moving the struct.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use tch::Tensor;

use crate::walk::{all_tensors, Shardable};

/// The identity of a module instance: its type name and the handles of all its parameter
/// and buffer tensors (walk order).
///
/// A Rust struct has no stable address (it moves), but each `tch::Tensor` owns a heap
/// allocated libtorch handle whose address ([`Tensor::as_ptr`]) stays put when the struct
/// holding the tensor moves, including into or out of a `Box`. So:
///
/// * a moved or boxed module keeps its key (`Box<T>` and `Option<T>` report `T`'s type name);
/// * two instances never share a key: each tensor has its own handle (even a
///   `shallow_clone` does);
/// * a parent whose only child holds all its tensors still differs from that child, by the
///   type name.
///
/// A module with no parameters and no buffers has no key ([`ModuleKey::of`] returns `None`):
/// nothing would tell two instances of its type apart, so no composable API state and no
/// hook can be attached to it. Attach them to a parent that has tensors instead.
///
/// Handles are freed when a module is dropped and may be reused by a later module; the
/// per-instance store guards against that by pinning a shallow clone of each keyed module's
/// first tensor and checking that it still shares storage with the module's first tensor
/// (stale entries are dropped). Assigning a new `Tensor` to a field gives the module a new
/// key; [`Tensor::set_data`] keeps it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ModuleKey {
    type_name: &'static str,
    tensors: Arc<[usize]>,
}

impl ModuleKey {
    /// The key of `module`, or `None` when it has no parameters and no buffers.
    pub fn of<M: Shardable + ?Sized>(module: &M) -> Option<ModuleKey> {
        identify(module.as_dyn_shardable()).map(|(key, _)| key)
    }

    /// The module's type name.
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }

    /// How many tensors (parameters and buffers) the key is made of.
    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }
}

impl fmt::Debug for ModuleKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ModuleKey({}, {} tensors",
            self.type_name,
            self.tensors.len()
        )?;
        if let Some(first) = self.tensors.first() {
            write!(f, ", first at {first:#x}")?;
        }
        f.write_str(")")
    }
}

/// The key of `module` and its first tensor (what the store pins to detect reuse).
pub(crate) fn identify(module: &dyn Shardable) -> Option<(ModuleKey, &Tensor)> {
    let tensors = all_tensors(module);
    let first = *tensors.first()?;
    let ptrs: Arc<[usize]> = tensors
        .iter()
        .map(|t| resolve(t.as_ptr() as usize))
        .collect();
    Some((
        ModuleKey {
            type_name: module.type_name(),
            tensors: ptrs,
        },
        first,
    ))
}

thread_local! {
    /// While an [`InstanceAlias`] lives on this thread: each twin tensor handle's address,
    /// to the original's.
    static ALIASES: RefCell<HashMap<usize, usize>> = RefCell::new(HashMap::new());
}

/// The handle address a module's key is made of: the original's for a twin's handle.
fn resolve(handle: usize) -> usize {
    ALIASES.with(|a| {
        let a = a.borrow();
        if a.is_empty() {
            handle
        } else {
            a.get(&handle).copied().unwrap_or(handle)
        }
    })
}

/// The tensor handles a module instance's key is made of, in walk order: taken while the
/// module is borrowed, they name the instance after the borrow ends (for an
/// [`InstanceAlias`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceHandles(Arc<[usize]>);

impl InstanceHandles {
    /// The handles of `module` now (a twin's resolve to its original's).
    pub fn of(module: &dyn Shardable) -> InstanceHandles {
        InstanceHandles(
            all_tensors(module)
                .iter()
                .map(|t| resolve(t.as_ptr() as usize))
                .collect(),
        )
    }

    /// The handles of `module` itself, not resolved.
    fn own(module: &dyn Shardable) -> Vec<usize> {
        all_tensors(module)
            .iter()
            .map(|t| t.as_ptr() as usize)
            .collect()
    }
}

/// While it lives, on this thread, a twin of a module (its
/// [`ShallowClone`](crate::ShallowClone), whose tensors are other handles on the same
/// tensors) and the twin's submodules are the original instances: their hooks, their
/// composable API state and their keys are the original's. Activation checkpointing runs the
/// recomputation on a twin so, and the hooks of the block's submodules (a tensor-parallel
/// layer's collectives) run again as in the first run.
///
/// ```
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{register_forward_hook, Call};
/// use tch_dist_core::{InstanceAlias, InstanceHandles, ModuleKey, ShallowClone};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
/// register_forward_hook(&fc, |_m, _x, out| Some(out * 0.0)).unwrap();
/// let original = InstanceHandles::of(&fc);
/// let twin = fc.shallow_clone();
/// let x = Tensor::ones([1, 2], tch::kind::FLOAT_CPU);
/// assert_ne!(ModuleKey::of(&twin), ModuleKey::of(&fc)); // another instance: no hooks
/// assert!(twin.call(&x).abs().sum(tch::Kind::Float).double_value(&[]) > 0.0);
/// let alias = InstanceAlias::new(&twin, &original);
/// assert_eq!(ModuleKey::of(&twin), ModuleKey::of(&fc));
/// assert_eq!(twin.call(&x).abs().sum(tch::Kind::Float).double_value(&[]), 0.0);
/// drop(alias);
/// ```
#[derive(Debug)]
pub struct InstanceAlias {
    /// The twin handles this alias added (not those an enclosing alias had).
    added: Vec<usize>,
    // Thread-bound: the map it edits is this thread's.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl InstanceAlias {
    /// Makes `twin` (of the same type as the instance `original` names) that instance on
    /// this thread until the alias is dropped. Handles beyond the shorter of the two lists
    /// are left alone (the types differ: nothing is aliased).
    pub fn new(twin: &dyn Shardable, original: &InstanceHandles) -> InstanceAlias {
        let own = InstanceHandles::own(twin);
        let mut added = Vec::new();
        if own.len() == original.0.len() {
            ALIASES.with(|a| {
                let mut a = a.borrow_mut();
                for (&t, &o) in own.iter().zip(original.0.iter()) {
                    if t != o && !a.contains_key(&t) {
                        a.insert(t, o);
                        added.push(t);
                    }
                }
            });
        }
        InstanceAlias {
            added,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for InstanceAlias {
    fn drop(&mut self) {
        ALIASES.with(|a| {
            let mut a = a.borrow_mut();
            for t in &self.added {
                a.remove(t);
            }
        });
    }
}
