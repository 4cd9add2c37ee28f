//! [`ModuleKey`]: the identity of a module instance, which survives moving the struct.

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
    let ptrs: Arc<[usize]> = tensors.iter().map(|t| t.as_ptr() as usize).collect();
    Some((
        ModuleKey {
            type_name: module.type_name(),
            tensors: ptrs,
        },
        first,
    ))
}
