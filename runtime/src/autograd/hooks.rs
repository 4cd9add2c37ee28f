//! The hook registrations both engines make on libtorch's autograd: a post hook on a
//! parameter's gradient accumulator (the reducer's grad-ready hook), a gradient interceptor
//! that takes a parameter's gradients instead of `.grad` (fully_shard's), a hook on an
//! output's gradient (fully_shard's pre-backward hook), the end-of-backward callback, and
//! assigning `.grad`. Each runs a [`Callback`] through the one trampoline.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use tch::Tensor;

use super::callback::{grad_trampoline, release, share, trampoline, Callback};
use crate::error::{DistError, Result};
use crate::ffi::{self, ShimError};

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
    /// Makes libtorch run `C` with `ctx` and `index` right after `param`'s gradient was
    /// accumulated.
    ///
    /// # Safety
    /// `ctx` must stay alive, at the same address, for as long as the returned hook.
    pub unsafe fn add<C: Callback>(
        param: &Tensor,
        ctx: *const C::Context,
        index: usize,
    ) -> std::result::Result<GradReadyHook, ShimError> {
        let mut out = std::ptr::null_mut();
        // SAFETY: a live tensor and out-pointer; the context outlives the hook (the caller's
        // promise); exceptions are caught in the shim.
        ffi::check(unsafe {
            ffi::tdr_add_grad_ready_hook(
                param.as_ptr() as *mut _,
                trampoline::<C>,
                ctx as *mut c_void,
                index,
                &mut out,
            )
        })?;
        NonNull::new(out)
            .map(|ptr| GradReadyHook { ptr })
            .ok_or_else(|| ShimError {
                message: "the engine returned no hook".into(),
                kind: ffi::FailureKind::Engine,
            })
    }
}

/// What [`PostAccumulateGradHooks`] runs: the index of the parameter whose gradient was
/// accumulated.
type OnReady = Box<dyn Fn(usize) + Send + Sync>;

/// Runs a closure with a parameter's index right after its gradient was accumulated, in
/// every backward pass, until dropped (PyTorch's
/// `Tensor.register_post_accumulate_grad_hook`, one closure for a list of parameters).
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
///
/// let w = tch::Tensor::ones([3], tch::kind::FLOAT_CPU).set_requires_grad(true);
/// let seen = Arc::new(AtomicUsize::new(usize::MAX));
/// let noted = seen.clone();
/// let hooks = tch_dist_runtime::PostAccumulateGradHooks::register(
///     &[w.shallow_clone()],
///     0,
///     move |index| noted.store(index, Ordering::SeqCst),
/// )?;
/// (&w * 2.0).sum(tch::Kind::Float).backward();
/// assert_eq!(seen.load(Ordering::SeqCst), 0);
/// drop(hooks);
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub struct PostAccumulateGradHooks {
    // Removed before the closure they point at is freed (fields drop in order).
    _hooks: Vec<GradReadyHook>,
    _on_ready: Box<OnReady>,
}

impl std::fmt::Debug for PostAccumulateGradHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostAccumulateGradHooks")
            .field("params", &self._hooks.len())
            .finish()
    }
}

/// The closure's call from libtorch.
struct RunOnReady;

impl Callback for RunOnReady {
    type Context = OnReady;
    const PANIC: &'static str = "internal panic in a post-accumulate-grad hook";

    fn run(on_ready: &OnReady, index: usize, _grad: Option<Tensor>) -> super::Reply {
        on_ready(index);
        Ok(())
    }
}

impl PostAccumulateGradHooks {
    /// Hooks `on_ready` on every one of `params` (leaves that require grad), called with the
    /// parameter's index in `params`; `rank` is named in an error.
    pub fn register(
        params: &[Tensor],
        rank: usize,
        on_ready: impl Fn(usize) + Send + Sync + 'static,
    ) -> Result<PostAccumulateGradHooks> {
        let on_ready: Box<OnReady> = Box::new(Box::new(on_ready));
        let ctx: *const OnReady = &*on_ready;
        let hooks = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                // SAFETY: the context is boxed (a stable address) and outlives the hooks,
                // which drop first.
                unsafe { GradReadyHook::add::<RunOnReady>(p, ctx, i) }.map_err(|e| {
                    DistError::Collective {
                        rank,
                        op: "register_post_accumulate_grad_hook",
                        cause: format!("parameter {i}: {}", e.message),
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PostAccumulateGradHooks {
            _hooks: hooks,
            _on_ready: on_ready,
        })
    }
}

/// A gradient interceptor on one parameter; removed on drop.
pub(crate) struct Interceptor {
    ptr: NonNull<ffi::TdrInterceptor>,
}

// SAFETY: the registration is only touched to remove it, which libtorch allows from any
// thread while no backward pass runs.
unsafe impl Send for Interceptor {}
unsafe impl Sync for Interceptor {}

impl Drop for Interceptor {
    fn drop(&mut self) {
        // SAFETY: created by tdr_add_grad_interceptor, removed exactly once.
        unsafe { ffi::tdr_interceptor_remove(self.ptr.as_ptr()) }
    }
}

impl Interceptor {
    /// Hands every gradient of `param` to `C` (with `ctx`, `index` and the gradient) instead
    /// of `.grad`. `param` must have its full shape now: its accumulator is made here and
    /// checks gradients against that shape from then on. The hook holds a strong reference
    /// to `ctx`, so a hook that outlives its owner (a graph kept alive by a saved tensor)
    /// still calls into a live value.
    pub fn add<C: Callback>(
        param: &Tensor,
        ctx: &Arc<C::Context>,
        index: usize,
    ) -> std::result::Result<Interceptor, ShimError> {
        let mut out = std::ptr::null_mut();
        // SAFETY: a live tensor and out-pointer; the context is a strong reference that the
        // shim releases through `release` (also when registration fails).
        ffi::check(unsafe {
            ffi::tdr_add_grad_interceptor(
                param.as_ptr() as *mut _,
                grad_trampoline::<C>,
                share(ctx),
                release::<C::Context>,
                index,
                &mut out,
            )
        })?;
        NonNull::new(out)
            .map(|ptr| Interceptor { ptr })
            .ok_or_else(|| ShimError {
                message: "the engine returned no interceptor".into(),
                kind: ffi::FailureKind::Engine,
            })
    }
}

/// Runs `C` with `ctx` when the gradient of `output` has been computed, before the backward
/// of the node that made it. The hook holds a strong reference to `ctx`.
pub(crate) fn add_output_grad_hook<C: Callback>(
    output: &Tensor,
    ctx: &Arc<C::Context>,
) -> std::result::Result<(), ShimError> {
    // SAFETY: a live tensor; the context is released by the shim with the hook.
    ffi::check(unsafe {
        ffi::tdr_add_output_grad_hook(
            output.as_ptr() as *mut _,
            grad_trampoline::<C>,
            share(ctx),
            release::<C::Context>,
            0,
        )
    })
}

/// Queues `C` with `ctx` to run once, at the end of the backward pass that is running on
/// this thread (call it from a hook of that pass).
///
/// # Safety
/// `ctx` must stay alive until the callback has run (or the pass ended without running it).
pub(crate) unsafe fn queue_end_of_backward<C: Callback>(
    ctx: *const C::Context,
) -> std::result::Result<(), ShimError> {
    // SAFETY: called inside a hook of a running backward pass, where queueing is allowed;
    // the context outlives the pass (the caller's promise).
    ffi::check(unsafe { ffi::tdr_queue_end_of_backward(trampoline::<C>, ctx as *mut c_void, 0) })
}

/// Makes `grad` the `.grad` of `param` (`None` clears it), PyTorch's `param.grad = grad`:
/// a grad that is a view of a larger buffer stays one, and backward accumulates into it in
/// place (DDP's `gradient_as_bucket_view`); `rank` and API `op` are named in the error.
///
/// ```
/// let p = tch::Tensor::zeros([2], tch::kind::FLOAT_CPU).set_requires_grad(true);
/// let buffer = tch::Tensor::ones([3], tch::kind::FLOAT_CPU);
/// tch_dist_runtime::set_grad_for(&p, Some(&buffer.narrow(0, 1, 2)), 0, "example")?;
/// assert_eq!(p.grad().sum(tch::Kind::Float).double_value(&[]), 2.0);
/// # Ok::<(), tch_dist_runtime::DistError>(())
/// ```
pub fn set_grad_for(
    param: &Tensor,
    grad: Option<&Tensor>,
    rank: usize,
    op: &'static str,
) -> Result<()> {
    let g = grad.map_or(std::ptr::null_mut(), |g| g.as_ptr() as *mut _);
    // SAFETY: live tensors; the shim assigns the grad under its own error handling.
    ffi::check(unsafe { ffi::tdr_set_grad(param.as_ptr() as *mut _, g) }).map_err(|e| {
        DistError::Collective {
            rank,
            op,
            cause: e.message,
        }
    })
}
