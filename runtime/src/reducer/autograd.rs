//! The reducer's callbacks on libtorch's autograd engine: `mark_ready` after each
//! parameter's gradient was accumulated, `finalize_backward` at the end of the pass (the
//! registrations and the trampoline are shared, in `crate::autograd`).
//!
//! These are where the reducer's typed errors become text: the engine only carries a
//! message (it fails that `backward()` with it). The reducer keeps the typed value and
//! returns it from the next pass.

use tch::Tensor;

use crate::autograd::{self, Callback, Reply};
use crate::error::Result;
use crate::ffi::ShimError;
use crate::reducer::ReducerInner;

/// The reducer's hook on one parameter's gradient accumulator; removed on drop.
pub(crate) struct GradReadyHook {
    _hook: autograd::GradReadyHook,
}

impl GradReadyHook {
    /// Makes libtorch call `inner.mark_ready(index)` right after `param`'s gradient was
    /// accumulated.
    ///
    /// # Safety
    /// `inner` must stay alive, at the same address, for as long as the returned hook.
    pub unsafe fn add(
        param: &Tensor,
        inner: *const ReducerInner,
        index: usize,
    ) -> std::result::Result<GradReadyHook, ShimError> {
        // SAFETY: the caller's promise.
        unsafe { autograd::GradReadyHook::add::<GradReady>(param, inner, index) }
            .map(|hook| GradReadyHook { _hook: hook })
    }
}

/// Called by libtorch right after parameter `index`'s gradient was accumulated.
struct GradReady;

impl Callback for GradReady {
    type Context = ReducerInner;
    const PANIC: &'static str = "replicate: internal panic in the gradient-ready hook";

    fn run(inner: &ReducerInner, index: usize, _grad: Option<Tensor>) -> Reply {
        inner.mark_ready(index).map_err(|e| e.to_string())
    }
}

/// Called by libtorch at the end of the backward pass.
struct EndOfBackward;

impl Callback for EndOfBackward {
    type Context = ReducerInner;
    const PANIC: &'static str = "replicate: internal panic at the end of backward";

    fn run(inner: &ReducerInner, _index: usize, _grad: Option<Tensor>) -> Reply {
        inner.finalize_backward().map_err(|e| e.to_string())
    }
}

/// Queues `inner.finalize_backward()` to run once, at the end of the backward pass that is
/// running on this thread (call it from a gradient-ready hook).
pub(crate) fn queue_end_of_backward(
    inner: *const ReducerInner,
) -> std::result::Result<(), ShimError> {
    // SAFETY: called inside a hook of a running backward pass; `inner` outlives the pass
    // (its hooks hold it).
    unsafe { autograd::queue_end_of_backward::<EndOfBackward>(inner) }
}

/// Makes `grad` the `.grad` of `param` (`None` clears it).
pub(crate) fn set_grad(param: &Tensor, grad: Option<&Tensor>, rank: usize) -> Result<()> {
    autograd::set_grad_for(param, grad, rank, "replicate")
}
