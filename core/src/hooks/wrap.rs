//! Forward wrappers ([`ForwardWrapper`]): an API that runs a module's forward itself.

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tch::Tensor;

use super::register::{resolve, NEXT_ID};
use super::{ForwardError, HookError, RemovableHandle};
use crate::instances::InstanceTable;
use crate::walk::Shardable;

/// The forward of a call, run again: `again(module, inputs)` runs the call's forward on
/// `module`, which must be of the caller's type (`None` otherwise), with `inputs` (as many
/// as the call's). It owns what it captured, so it may run after the call returned, on any
/// thread.
pub type Recompute = Box<dyn Fn(&dyn Any, &[Tensor]) -> Option<Vec<Tensor>> + Send>;

/// The call's forward to run now, over the inputs (borrowing the caller's module).
pub type FirstRun<'a> = &'a mut dyn FnMut(&[Tensor]) -> Vec<Tensor>;

/// What a [`ForwardWrapper`] gets for one call: the inputs after the pre-hooks, the calling
/// module as [`Any`] (for a wrapper that knows its type), the forward to run now and the
/// forward to run again.
pub struct Forward<'a> {
    pub(super) inputs: &'a [Tensor],
    pub(super) this: &'a dyn Any,
    pub(super) first: FirstRun<'a>,
    pub(super) again: Recompute,
}

impl<'a> Forward<'a> {
    /// The inputs, after the pre-hooks.
    pub fn inputs(&self) -> &'a [Tensor] {
        self.inputs
    }

    /// The module being called, as `Any` (its concrete type).
    pub fn this(&self) -> &'a dyn Any {
        self.this
    }

    /// The forward to run now (at most once: it is the caller's, which may be `FnOnce`), and
    /// the [`Recompute`].
    pub fn split(self) -> (FirstRun<'a>, Recompute) {
        (self.first, self.again)
    }
}

/// A forward wrapper: an API that must run a module's forward itself (activation
/// checkpointing runs it without keeping its activations, then again during backward)
/// registers a [`ForwardWrapper`] on the instance. A hooked call then hands the wrapper the
/// forward instead of running it: after the pre-hooks, inside the forward hooks, so that the
/// wrapper sees the inputs the pre-hooks made (fully_shard's gathered parameters are in
/// place) and the forward hooks see what it returns.
///
/// The wrapper gets the forward twice over: once to run now ([`Forward::split`]'s first
/// half, borrowing the caller's module), and once as a [`Recompute`], which owns what it
/// needs and so can run after the call has returned, on a module of the wrapper's own (a
/// [`ShallowClone`](crate::ShallowClone) of the caller's, taken at the call).
///
/// ```
/// use std::sync::Arc;
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{register_forward_wrapper, Call, Forward, ForwardError};
/// use tch_dist_core::hooks::ForwardWrapper;
/// use tch_dist_core::Shardable;
///
/// /// Runs the forward, then runs it again on the same module and checks both agree.
/// struct Twice;
/// impl ForwardWrapper for Twice {
///     fn run(&self, _: &dyn Shardable, f: Forward<'_>) -> Result<Vec<Tensor>, ForwardError> {
///         let inputs: Vec<Tensor> = f.inputs().iter().map(Tensor::shallow_clone).collect();
///         let this = f.this();
///         let (first, again) = f.split();
///         let out = first(&inputs);
///         let twice = again(this, &inputs).expect("same module type");
///         assert!(out[0].equal(&twice[0]));
///         Ok(out)
///     }
/// }
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 3, 2, Default::default());
/// let handle = register_forward_wrapper(&fc, Arc::new(Twice)).unwrap();
/// let x = Tensor::ones([1, 3], tch::kind::FLOAT_CPU);
/// assert!(fc.call(&x).equal(&x.apply(&fc)));
/// handle.remove();
/// ```
///
/// At most one per module instance.
pub trait ForwardWrapper: Send + Sync {
    /// Runs the call's forward (through [`Forward::split`]'s first half, at most once) and
    /// returns its outputs, as many as it gave; `module` is the instance called.
    fn run(
        &self,
        module: &dyn Shardable,
        forward: Forward<'_>,
    ) -> Result<Vec<Tensor>, ForwardError>;
}

/// A stored wrapper.
pub(crate) type StoredWrapper = Arc<dyn ForwardWrapper>;

/// Registers `wrapper` on the instance `module`: its hooked calls hand their forward to it.
/// A module has at most one wrapper ([`HookError::WrapperTaken`]).
pub fn register_forward_wrapper<M: Shardable + ?Sized>(
    module: &M,
    wrapper: Arc<dyn ForwardWrapper>,
) -> Result<RemovableHandle, HookError> {
    let (key, first) = resolve(module)?;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    if !InstanceTable::lock().set_wrapper(&key, first, id, wrapper) {
        return Err(HookError::WrapperTaken {
            module: module.type_name(),
        });
    }
    Ok(RemovableHandle { key, id })
}
