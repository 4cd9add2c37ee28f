//! The reducer's handles on libtorch's autograd engine: a post hook on each parameter's
//! gradient accumulator, the end-of-backward callback, and assigning `.grad`.
//!
//! The two trampolines are where the reducer's typed errors become text: the engine only
//! carries a message (it fails that `backward()` with it). The reducer keeps the typed value
//! and returns it from the next pass.

use std::ffi::{c_char, c_void};
use std::ptr::NonNull;

use tch::Tensor;

use crate::error::{DistError, Result};
use crate::ffi::{self, shim, ShimError};
use crate::reducer::ReducerInner;

/// A post hook on one parameter's gradient accumulator; removed on drop.
pub(crate) struct GradReadyHook {
    ptr: NonNull<ffi::TdrHook>,
}

// SAFETY: the registration is only touched to remove it, which libtorch allows from any
// thread while no backward pass runs.
unsafe impl Send for GradReadyHook {}
unsafe impl Sync for GradReadyHook {}

impl Drop for GradReadyHook {
    fn drop(&mut self) {
        // SAFETY: created by tdr_add_grad_ready_hook, removed exactly once.
        unsafe { ffi::tdr_hook_remove(self.ptr.as_ptr()) }
    }
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
        let mut out = std::ptr::null_mut();
        // SAFETY: a live tensor and out-pointer; the context outlives the hook (the caller's
        // promise); exceptions are caught in the shim.
        shim!(tdr_add_grad_ready_hook(
            param.as_ptr() as *mut _,
            grad_ready_trampoline,
            inner as *mut c_void,
            index,
            &mut out,
        ))?;
        NonNull::new(out)
            .map(|ptr| GradReadyHook { ptr })
            .ok_or_else(|| ShimError {
                message: "the engine returned no hook".into(),
                kind: ffi::FailureKind::Engine,
            })
    }
}

/// Queues `inner.finalize_backward()` to run once, at the end of the backward pass that is
/// running on this thread (call it from a gradient-ready hook).
pub(crate) fn queue_end_of_backward(
    inner: *const ReducerInner,
) -> std::result::Result<(), ShimError> {
    // SAFETY: called inside a hook of a running backward pass, where queueing is allowed;
    // `inner` outlives the pass (its hooks hold it).
    shim!(tdr_queue_end_of_backward(
        end_of_backward_trampoline,
        inner as *mut c_void,
        0
    ))
}

/// Makes `grad` the `.grad` of `param` (`None` clears it).
pub(crate) fn set_grad(param: &Tensor, grad: Option<&Tensor>, rank: usize) -> Result<()> {
    set_grad_for(param, grad, rank, "replicate")
}

/// [`set_grad`] for API `op` (named in the error).
pub(crate) fn set_grad_for(
    param: &Tensor,
    grad: Option<&Tensor>,
    rank: usize,
    op: &'static str,
) -> Result<()> {
    let g = grad.map_or(std::ptr::null_mut(), |g| g.as_ptr() as *mut _);
    // SAFETY: live tensors; the shim assigns the grad under its own error handling.
    shim!(tdr_set_grad(param.as_ptr() as *mut _, g)).map_err(|e| DistError::Collective {
        rank,
        op,
        cause: e.message,
    })
}

/// Queues `cb(null, 0)` to run once at the end of the backward pass running on this thread
/// (a callback without a context: fully_shard's, which finds its groups itself).
pub(crate) fn queue_end_of_backward_fn(cb: ffi::TdrCallback) -> std::result::Result<(), ShimError> {
    // SAFETY: called inside a hook of a running backward pass; no context to outlive.
    shim!(tdr_queue_end_of_backward(cb, std::ptr::null_mut(), 0))
}

/// Called by libtorch right after parameter `index`'s gradient was accumulated.
unsafe extern "C" fn grad_ready_trampoline(ctx: *mut c_void, index: usize) -> *mut c_char {
    // SAFETY: `ctx` is the ReducerInner registered with the hook, alive while the hook is.
    let inner = unsafe { &*(ctx as *const ReducerInner) };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.mark_ready(index)));
    match result {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(e)) => ffi::malloc_message(&e.to_string()),
        Err(_) => ffi::malloc_message("replicate: internal panic in the gradient-ready hook"),
    }
}

/// Called by libtorch at the end of the backward pass.
unsafe extern "C" fn end_of_backward_trampoline(ctx: *mut c_void, _index: usize) -> *mut c_char {
    // SAFETY: as above; the callback is queued by a hook of this same ReducerInner.
    let inner = unsafe { &*(ctx as *const ReducerInner) };
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.finalize_backward()));
    match result {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(e)) => ffi::malloc_message(&e.to_string()),
        Err(_) => ffi::malloc_message("replicate: internal panic at the end of backward"),
    }
}
