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

use std::any::{Any, TypeId};
use std::sync::RwLock;

use super::ForwardError;

/// An API's check of hooked calls ([`register_call_guard`]).
pub trait CallGuard: Any + Send + Sync {
    /// A hooked call's `forward` (or the closure of
    /// [`catch_forward_errors`](super::catch_forward_errors)) panicked: the typed error this
    /// guard's refusal on this thread recorded, taken; `None` when it refused nothing (the
    /// panic goes on).
    fn refusal(&self) -> Option<ForwardError>;

    /// Whether this guard holds a refusal on this thread that [`refusal`](Self::refusal)
    /// would hand over, without taking it (a panic starting now is that refusal's). Default:
    /// never.
    fn refusal_pending(&self) -> bool {
        false
    }

    /// The outermost hooked call on this thread ended: returned, failed or unwound.
    fn outermost_call_ended(&self);
}

/// The registered guards (few: one per API, registered once).
static GUARDS: RwLock<Vec<&'static dyn CallGuard>> = RwLock::new(Vec::new());

/// Registers `guard` for every hooked call in the process (a second registration of a guard
/// of the same type does nothing).
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
    // By type, not by address: guards are zero-sized statics, and two of those may share an
    // address (fully_shard's and shard_module's did in one build, and fully_shard's was then
    // never registered: a forward that failed left its groups unsharded).
    let id = guard_type(guard);
    if !guards.iter().any(|g| guard_type(*g) == id) {
        guards.push(guard);
    }
    quiet_refusals();
}

/// Installs, once, a panic hook in front of the program's: a panic that a guard's refusal
/// caused inside an `f_call` (tch unwrapping the refused op's error in a layer's `forward`)
/// becomes that call's `Err`, so printing it, as the default hook does ("thread 'main'
/// panicked at ..."), would report a crash that did not happen. Every other panic goes to
/// the hook that was there before.
fn quiet_refusals() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !(super::forward_error::inside_f_call() && refusal_pending()) {
                previous(info);
            }
        }));
    });
}

/// Whether a registered guard holds a refusal on this thread. Never blocks: a panic hook
/// calls it, and a panic may start while the registry is being written.
fn refusal_pending() -> bool {
    GUARDS
        .try_read()
        .is_ok_and(|guards| guards.iter().any(|g| g.refusal_pending()))
}

/// The concrete type of `guard` (through `dyn Any`, whose `type_id` is the value's).
fn guard_type(guard: &'static dyn CallGuard) -> TypeId {
    let any: &'static dyn Any = guard;
    any.type_id()
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

#[cfg(test)]
mod tests {
    use super::*;

    struct First;
    struct Second;
    impl CallGuard for First {
        fn refusal(&self) -> Option<ForwardError> {
            None
        }
        fn outermost_call_ended(&self) {}
    }
    impl CallGuard for Second {
        fn refusal(&self) -> Option<ForwardError> {
            None
        }
        fn outermost_call_ended(&self) {}
    }
    static FIRST: First = First;
    static SECOND: Second = Second;

    fn registered(id: TypeId) -> usize {
        let guards = GUARDS.read().unwrap_or_else(|e| e.into_inner());
        guards.iter().filter(|g| guard_type(**g) == id).count()
    }

    /// Two zero-sized guards (which may share an address) both register, each once.
    #[test]
    fn guards_of_two_types_register_each_once() {
        for _ in 0..2 {
            register_call_guard(&FIRST);
            register_call_guard(&SECOND);
        }
        assert_eq!(registered(TypeId::of::<First>()), 1);
        assert_eq!(registered(TypeId::of::<Second>()), 1);
        assert_ne!(TypeId::of::<First>(), TypeId::of::<Second>());
    }
}
