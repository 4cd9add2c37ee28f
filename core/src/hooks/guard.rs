//! Call guards: an API's per-thread check of what runs inside hooked calls (the bypass
//! checks of `fully_shard` and `shard_module`), asked, when a hooked call's `forward`
//! panicked, whether the panic was its refusal, and told when the outermost hooked call on a
//! thread ends.
//!
//! A check made inside an op (libtorch refusing an op on a sharded parameter used without
//! its module's hooks) cannot return an error through `Module::forward`: the op fails, tch
//! panics inside the layer's `forward`, and the panic unwinds to the innermost hooked call.
//! The guard that refused recorded why; [`CallGuard::refusal`] hands that over as the typed
//! error that call fails with, as if a hook had failed (`f_call` returns it, `call` panics
//! with its message). Every outermost call's end resets the guards' per-thread state, also
//! when the call failed or unwound, so that nothing a failed forward started outlives it.

use std::sync::RwLock;

use super::ForwardError;

/// An API's check of hooked calls ([`register_call_guard`]).
pub trait CallGuard: Send + Sync + 'static {
    /// A hooked call's `forward` (or the closure of
    /// [`catch_forward_errors`](super::catch_forward_errors)) panicked: the typed error this
    /// guard's refusal on this thread recorded, taken; `None` when it refused nothing (the
    /// panic goes on).
    fn refusal(&self) -> Option<ForwardError>;

    /// The outermost hooked call on this thread ended: returned, failed or unwound.
    fn outermost_call_ended(&self);
}

/// The registered guards (few: one per API, registered once).
static GUARDS: RwLock<Vec<&'static dyn CallGuard>> = RwLock::new(Vec::new());

/// Registers `guard` for every hooked call in the process (a second registration of the
/// same guard does nothing).
///
/// ```
/// use tch_dist_core::hooks::{register_call_guard, CallGuard, ForwardError};
///
/// struct Quiet;
/// impl CallGuard for Quiet {
///     fn refusal(&self) -> Option<ForwardError> { None }
///     fn outermost_call_ended(&self) {}
/// }
/// static QUIET: Quiet = Quiet;
/// register_call_guard(&QUIET);
/// register_call_guard(&QUIET); // once is enough
/// ```
pub fn register_call_guard(guard: &'static dyn CallGuard) {
    let mut guards = GUARDS.write().unwrap_or_else(|e| e.into_inner());
    let same = |g: &&'static dyn CallGuard| {
        std::ptr::addr_eq(*g as *const dyn CallGuard, guard as *const dyn CallGuard)
    };
    if !guards.iter().any(same) {
        guards.push(guard);
    }
}

/// The first registered guard's refusal on this thread.
pub(super) fn refusal() -> Option<ForwardError> {
    let guards = GUARDS.read().unwrap_or_else(|e| e.into_inner());
    guards.iter().find_map(|g| g.refusal())
}

/// Tells every guard that the outermost hooked call on this thread ended.
pub(super) fn outermost_call_ended() {
    let guards = GUARDS.read().unwrap_or_else(|e| e.into_inner());
    for g in guards.iter() {
        g.outermost_call_ended();
    }
}
