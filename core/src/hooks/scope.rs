//! Call scopes: one forward pre-hook and one forward hook that bracket every hooked call of a
//! module instance, with a value carried from the start of the call to its end.
//!
//! A composable API that must see what happens *during* a module's call registers a
//! [`CallScope`]: [`enter`](CallScope::enter) runs as a pre-hook and returns a mark (for
//! example autograd's sequence number at that moment), [`exit`](CallScope::exit) runs as a
//! forward hook and gets the mark back with the output. `shard_module` uses this to tell the
//! autograd nodes a sharded layer made inside its hooked call from uses of its parameters
//! elsewhere; `fully_shard` can do the same for its units.
//!
//! Marks are kept per thread, in a stack: a module that calls itself recursively gets each
//! call's own mark, and the mark of a call that unwound (a failing hook) is never handed to
//! another call; it is dropped when the next outermost hooked call on the thread starts.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tch::Tensor;

use super::{
    register_fallible_forward_hook_n, register_fallible_forward_pre_hook_n, ForwardError,
    HookError, RemovableHandle,
};
use crate::walk::Shardable;

/// What runs around each hooked call of a module ([`register_call_scope`]):
/// [`enter`](CallScope::enter) as a pre-hook, returning a mark, and
/// [`exit`](CallScope::exit) as a forward hook, with the mark and the output. An API that
/// must see what happens *during* a call uses one: `shard_module` tells the autograd nodes a
/// sharded layer made inside its hooked call from uses of its parameters elsewhere.
///
/// Marks are per thread and per call: a module that calls itself recursively gets each
/// call's own mark, and the mark of a call that unwound (a failing hook) is never handed to
/// another call.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{register_call_scope, Call, CallScope, ForwardError};
/// use tch_dist_core::Shardable;
///
/// /// Records how many elements each call produced, and in which call.
/// #[derive(Default)]
/// struct Count(Mutex<(u64, Vec<(u64, i64)>)>);
/// impl CallScope for Count {
///     fn enter(&self, _m: &dyn Shardable, _inputs: &[Tensor]) -> Result<u64, ForwardError> {
///         let mut s = self.0.lock().unwrap();
///         s.0 += 1;
///         Ok(s.0)
///     }
///     fn exit(&self, _m: &dyn Shardable, outs: &[Tensor], mark: u64) -> Result<(), ForwardError> {
///         self.0.lock().unwrap().1.push((mark, outs[0].numel() as i64));
///         Ok(())
///     }
/// }
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 3, 2, Default::default());
/// let count = Arc::new(Count::default());
/// let handles = register_call_scope(&fc, count.clone()).unwrap();
/// let _ = fc.call(&Tensor::ones([4, 3], tch::kind::FLOAT_CPU));
/// let _ = fc.call(&Tensor::ones([1, 3], tch::kind::FLOAT_CPU));
/// assert_eq!(count.0.lock().unwrap().1, [(1, 8), (2, 2)]);
/// handles.iter().for_each(|h| { h.remove(); });
/// ```
pub trait CallScope: Send + Sync + 'static {
    /// At the start of a hooked call of `module` (a pre-hook: after the pre-hooks
    /// registered before the scope, with every input they produced, one for
    /// [`Call::call`](super::Call::call), as many as the call has for
    /// [`CallWith::call_with`](super::CallWith::call_with)); returns the mark
    /// [`exit`](CallScope::exit) gets. An error ends the call before `forward`.
    fn enter(&self, module: &dyn Shardable, inputs: &[Tensor]) -> Result<u64, ForwardError>;

    /// At the end of the call (a forward hook: after `forward` and the forward hooks
    /// registered before the scope, with every output they produced, in order), with
    /// `enter`'s mark. An error ends the call: `f_call` returns it.
    fn exit(
        &self,
        module: &dyn Shardable,
        outputs: &[Tensor],
        mark: u64,
    ) -> Result<(), ForwardError>;
}

/// A process-unique number per registration, which keys its marks.
static NEXT_SCOPE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The marks of the calls running on this thread: (registration, mark), innermost last.
    static MARKS: RefCell<Vec<(u64, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Registers `scope` around every hooked call of the instance `module`: a forward pre-hook
/// that calls [`CallScope::enter`] and a forward hook that calls [`CallScope::exit`] with its
/// mark. Returns the two handles (pre-hook, forward hook); remove both to remove the scope.
///
/// A call whose pre-hook ran but which unwound before its forward hook (a failing hook, a
/// panic) leaves its mark behind until the next outermost hooked call on that thread starts
/// (or an outer `exit` of the same thread drops the marks above its own).
pub fn register_call_scope<M: Shardable + ?Sized>(
    module: &M,
    scope: Arc<dyn CallScope>,
) -> Result<[RemovableHandle; 2], HookError> {
    let id = NEXT_SCOPE.fetch_add(1, Ordering::Relaxed);
    let entering = Arc::clone(&scope);
    let pre = register_fallible_forward_pre_hook_n(module, move |m, xs| {
        let mark = entering.enter(m, xs)?;
        MARKS.with(|marks| {
            let mut marks = marks.borrow_mut();
            if super::outermost::hooked_depth() == 1 {
                marks.clear(); // no call encloses this one: what is left was unwound
            }
            marks.push((id, mark));
        });
        Ok(None)
    })?;
    let post = register_fallible_forward_hook_n(module, move |m, _inputs, out| {
        let Some(mark) = take_mark(id) else {
            return Ok(None); // the scope was registered during this call
        };
        scope.exit(m, out, mark)?;
        Ok(None)
    });
    match post {
        Ok(post) => Ok([pre, post]),
        Err(e) => {
            pre.remove();
            Err(e)
        }
    }
}

/// The innermost mark of registration `id` on this thread, dropping it and every mark
/// pushed after it (calls that never reached their `exit`).
fn take_mark(id: u64) -> Option<u64> {
    MARKS.with(|marks| {
        let mut marks = marks.borrow_mut();
        let pos = marks.iter().rposition(|&(scope, _)| scope == id)?;
        let mark = marks[pos].1;
        marks.truncate(pos);
        Some(mark)
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tch::nn::{self, Module};
    use tch::Device;

    use super::*;
    use crate::hooks::{num_forward_hooks, register_fallible_forward_pre_hook, Call};

    /// Numbers the calls; records (mark, output width) at each exit, and fails exits that
    /// get mark `fail_at`.
    #[derive(Default)]
    struct Recorder {
        state: Mutex<(u64, Vec<(u64, i64)>)>,
        fail_at: Option<u64>,
    }

    impl CallScope for Recorder {
        fn enter(&self, _m: &dyn Shardable, _xs: &[Tensor]) -> Result<u64, ForwardError> {
            let mut s = self.state.lock().unwrap();
            s.0 += 1;
            Ok(s.0)
        }
        fn exit(&self, _m: &dyn Shardable, out: &[Tensor], mark: u64) -> Result<(), ForwardError> {
            if self.fail_at == Some(mark) {
                return Err(ForwardError::new(format!("exit {mark} refused")));
            }
            let width = out[0].size().last().copied().unwrap_or(0);
            self.state.lock().unwrap().1.push((mark, width));
            Ok(())
        }
    }

    fn exits(r: &Recorder) -> Vec<(u64, i64)> {
        r.state.lock().unwrap().1.clone()
    }

    #[test]
    fn each_call_gets_its_own_mark_even_when_nested() {
        let vs = nn::VarStore::new(Device::Cpu);
        let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
        let inner = Arc::new(Mutex::new(nn::linear(
            vs.root() / "inner",
            2,
            3,
            Default::default(),
        )));
        let r = Arc::new(Recorder::default());
        let handles = register_call_scope(&fc, r.clone()).unwrap();
        assert_eq!(num_forward_hooks(&fc), (1, 1));
        // Another registration's calls inside this one's (a hook that calls a child).
        let r2 = Arc::new(Recorder::default());
        register_call_scope(&*inner.lock().unwrap(), r2.clone()).unwrap();
        register_fallible_forward_pre_hook(&fc, move |_m, xs| {
            let _ = inner.lock().unwrap().call(xs);
            Ok(None)
        })
        .unwrap();
        let x = Tensor::ones([1, 2], tch::kind::FLOAT_CPU);
        let _ = fc.call(&x);
        let _ = fc.call(&x);
        assert_eq!(exits(&r), [(1, 2), (2, 2)]);
        assert_eq!(exits(&r2), [(1, 3), (2, 3)]);
        // `forward` bypasses the scope.
        let _ = fc.forward(&x);
        assert_eq!(exits(&r).len(), 2);
        for h in handles {
            assert!(h.remove());
        }
        assert_eq!(num_forward_hooks(&fc), (1, 0));
    }

    #[test]
    fn a_failed_exit_is_the_call_error_and_leaves_no_mark() {
        let vs = nn::VarStore::new(Device::Cpu);
        let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
        let r = Arc::new(Recorder {
            fail_at: Some(1),
            ..Default::default()
        });
        register_call_scope(&fc, r.clone()).unwrap();
        let x = Tensor::ones([1, 2], tch::kind::FLOAT_CPU);
        assert_eq!(fc.f_call(&x).unwrap_err().message(), "exit 1 refused");
        assert!(fc.f_call(&x).is_ok());
        assert_eq!(exits(&r), [(2, 2)]);
        MARKS.with(|m| assert!(m.borrow().is_empty()));
    }

    #[test]
    fn a_call_that_unwound_leaves_no_mark_for_the_next() {
        let vs = nn::VarStore::new(Device::Cpu);
        let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
        let r = Arc::new(Recorder::default());
        register_call_scope(&fc, r.clone()).unwrap();
        // A pre-hook registered after the scope fails the first call after `enter` ran.
        let failed = Arc::new(Mutex::new(false));
        let once = failed.clone();
        register_fallible_forward_pre_hook(&fc, move |_m, _xs| {
            let mut f = once.lock().unwrap();
            if *f {
                return Ok(None);
            }
            *f = true;
            Err(ForwardError::new("first call refused"))
        })
        .unwrap();
        let x = Tensor::ones([1, 2], tch::kind::FLOAT_CPU);
        assert!(fc.f_call(&x).is_err());
        MARKS.with(|m| assert_eq!(m.borrow().len(), 1)); // the unwound call's mark
        let _ = fc.call(&x);
        assert_eq!(exits(&r), [(2, 2)]); // not the first call's mark
        MARKS.with(|m| assert!(m.borrow().is_empty()));
    }

    #[test]
    fn a_module_without_tensors_cannot_have_a_scope() {
        #[derive(Debug)]
        struct Empty;
        impl Shardable for Empty {
            fn visit<'a>(&'a self, _v: &mut dyn crate::ModuleVisitor<'a>) {}
            fn visit_mut<'a>(&'a mut self, _v: &mut dyn crate::ModuleVisitorMut<'a>) {}
        }
        let err = register_call_scope(&Empty, Arc::new(Recorder::default())).unwrap_err();
        assert!(matches!(err, HookError::NoIdentity { .. }));
    }
}
