//! The hooked calls running on a thread: how many ([`hooked_depth`]), and the module of the
//! outermost one, from which [`fqn_in_outermost_call`] names a module by its full FQN. The
//! end of the outermost call resets the call guards' per-thread state.

use std::cell::Cell;

use super::guard;
use crate::walk::Shardable;

thread_local! {
    /// How many calls of hooked modules are running on this thread.
    static HOOKED_DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// One running call of a hooked module, counted in [`HOOKED_DEPTH`] until it returns or
/// unwinds.
pub(super) struct CallDepth;

/// The module of the outermost hooked call running on this thread, as a pointer with its
/// lifetime erased: set when that call starts and cleared when it returns or unwinds (by
/// [`CallDepth`]), so it is only read while the call, and so the borrow, is live.
type Outermost = *const (dyn Shardable + 'static);

thread_local! {
    static OUTERMOST: Cell<Option<Outermost>> = const { Cell::new(None) };
}

impl CallDepth {
    /// Counts a call of `module` starting; the outermost one's module is kept.
    pub(super) fn enter(module: &dyn Shardable) -> CallDepth {
        let depth = HOOKED_DEPTH.with(|d| {
            d.set(d.get() + 1);
            d.get()
        });
        if depth == 1 {
            let ptr: *const (dyn Shardable + '_) = module;
            // SAFETY: only the lifetime of the trait object changes (same layout); the
            // pointer is cleared before the borrow ends (this guard's drop) and read only
            // while it is set, on this thread.
            let ptr: Outermost = unsafe { std::mem::transmute(ptr) };
            OUTERMOST.with(|o| o.set(Some(ptr)));
        }
        CallDepth
    }
}

impl Drop for CallDepth {
    fn drop(&mut self) {
        let depth = HOOKED_DEPTH.with(|d| {
            d.set(d.get() - 1);
            d.get()
        });
        if depth == 0 {
            OUTERMOST.with(|o| o.set(None));
            guard::outermost_call_ended();
        }
    }
}

/// The FQN of `module` within the module of the outermost hooked call running on this
/// thread (`""` for that module itself), or `None` outside hooked calls or when `module`
/// is not under it. For errors that must name a module by its full FQN when all an API
/// holds is the module (activation checkpointing).
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{fqn_in_outermost_call, register_forward_pre_hook, Call};
/// use tch_dist_core::Shardable;
///
/// #[derive(Debug, Shardable)]
/// #[shardable(crate = "tch_dist_core")]
/// struct Net {
///     body: Vec<nn::Linear>,
/// }
/// impl nn::Module for Net {
///     fn forward(&self, x: &Tensor) -> Tensor {
///         self.body[1].call(&self.body[0].call(x))
///     }
/// }
/// let vs = nn::VarStore::new(Device::Cpu);
/// let net = Net {
///     body: (0..2).map(|i| nn::linear(vs.root() / i, 2, 2, Default::default())).collect(),
/// };
/// let seen = Arc::new(Mutex::new(None));
/// let put = Arc::clone(&seen);
/// register_forward_pre_hook(&net.body[1], move |m, _| {
///     *put.lock().unwrap() = fqn_in_outermost_call(m);
///     None
/// })
/// .unwrap();
/// net.call(&Tensor::ones([1, 2], tch::kind::FLOAT_CPU));
/// assert_eq!(seen.lock().unwrap().as_deref(), Some("body.1"));
/// ```
pub fn fqn_in_outermost_call(module: &dyn Shardable) -> Option<String> {
    let outermost = OUTERMOST.with(Cell::get)?;
    // SAFETY: set by the outermost running call on this thread, whose borrow of the module
    // lasts until it is cleared (see `Outermost`); we are inside that call.
    let outermost: &dyn Shardable = unsafe { &*outermost };
    let key = crate::ModuleKey::of(module)?;
    outermost
        .named_modules()
        .into_iter()
        .find(|(_, m)| crate::ModuleKey::of(*m).as_ref() == Some(&key))
        .map(|(fqn, _)| fqn)
}

/// How many calls of hooked modules are running on this thread (1 inside the hooks of an
/// outermost one).
pub(super) fn hooked_depth() -> usize {
    HOOKED_DEPTH.with(Cell::get)
}
