//! fully_shard's handles on libtorch: the gradient interceptor on each managed parameter's
//! accumulator, the pre-backward hook on a managed module's output, and releasing and
//! restoring the memory of a full parameter between uses.
//!
//! Each hook holds a strong reference to its group (an `Arc` handed to the shim with a
//! release function), so a hook that outlives the model's state (a graph kept alive by a
//! saved tensor) still calls into a live group.

use std::ffi::{c_char, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use tch::Tensor;

use super::group::GroupInner;
use crate::ffi::{self, shim, ShimError};

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

/// A strong reference to `inner`, as the shim's context.
fn context(inner: &Arc<GroupInner>) -> *mut c_void {
    Arc::into_raw(Arc::clone(inner)) as *mut c_void
}

/// Gives back a reference [`context`] made (the shim calls it once per context).
unsafe extern "C" fn release_context(ctx: *mut c_void) {
    // SAFETY: `ctx` came from Arc::into_raw in `context`, and the shim releases it once.
    drop(unsafe { Arc::from_raw(ctx as *const GroupInner) });
}

impl Interceptor {
    /// Hands every gradient of `param` to `inner.on_grad(index, grad)` instead of `.grad`.
    /// `param` must have its full shape now: its accumulator is made here and checks
    /// gradients against that shape from then on.
    pub fn add(
        param: &Tensor,
        inner: &Arc<GroupInner>,
        index: usize,
    ) -> std::result::Result<Interceptor, ShimError> {
        let mut out = std::ptr::null_mut();
        // SAFETY: a live tensor and out-pointer; the context is a strong reference that the
        // shim releases through `release_context` (also when registration fails).
        shim!(tdr_add_grad_interceptor(
            param.as_ptr() as *mut _,
            grad_trampoline,
            context(inner),
            release_context,
            index,
            &mut out,
        ))?;
        NonNull::new(out)
            .map(|ptr| Interceptor { ptr })
            .ok_or_else(|| ShimError {
                message: "the engine returned no interceptor".into(),
                kind: ffi::FailureKind::Engine,
            })
    }
}

/// Runs `inner.pre_backward()` when the gradient of `output` has been computed, before the
/// backward of the module that made it.
pub(crate) fn add_pre_backward_hook(
    output: &Tensor,
    inner: &Arc<GroupInner>,
) -> std::result::Result<(), ShimError> {
    // SAFETY: a live tensor; the context is released by the shim with the hook.
    shim!(tdr_add_output_grad_hook(
        output.as_ptr() as *mut _,
        pre_backward_trampoline,
        context(inner),
        release_context,
        0,
    ))
}

/// Frees the memory of `t`'s storage (its elements must not be read until
/// [`restore_storage`]).
pub(crate) fn release_storage(t: &Tensor) -> std::result::Result<(), ShimError> {
    // SAFETY: a live tensor.
    shim!(tdr_storage_release(t.as_ptr() as *mut _))
}

/// Gives `t`'s storage memory for `t` again (uninitialized).
pub(crate) fn restore_storage(t: &Tensor) -> std::result::Result<(), ShimError> {
    // SAFETY: a live tensor.
    shim!(tdr_storage_restore(t.as_ptr() as *mut _))
}

/// Points `param` at `data` (`Tensor::set_data`), keeping its gradient accumulator, and so
/// the hooks on it, also when the dtype changes (mixed precision).
pub(crate) fn set_data(param: &Tensor, data: &Tensor) -> std::result::Result<(), ShimError> {
    // SAFETY: live tensors; the shim checks the types are compatible.
    shim!(tdr_set_data_keep_accumulator(
        param.as_ptr() as *mut _,
        data.as_ptr() as *mut _
    ))
}

/// Bytes `t`'s storage holds now (0 once released).
pub fn storage_nbytes(t: &Tensor) -> usize {
    // SAFETY: a live tensor; the shim catches everything.
    unsafe { ffi::tdr_storage_nbytes(t.as_ptr() as *mut _) }
}

/// Called by libtorch with each gradient of managed parameter `index`.
unsafe extern "C" fn grad_trampoline(
    ctx: *mut c_void,
    index: usize,
    grad: *mut torch_sys::C_tensor,
) -> *mut c_char {
    // SAFETY: `ctx` is a strong reference held by the hook; `grad` is lent for this call,
    // and the clone is a handle of our own.
    let (inner, grad) = unsafe { (&*(ctx as *const GroupInner), Tensor::clone_from_ptr(grad)) };
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.on_grad(index, grad)));
    match result {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(e)) => {
            inner.note_failure(&e);
            ffi::malloc_message(&e.to_string())
        }
        Err(_) => ffi::malloc_message("fully_shard: internal panic in the gradient hook"),
    }
}

/// Called by libtorch when a managed module's output gradient is ready.
unsafe extern "C" fn pre_backward_trampoline(
    ctx: *mut c_void,
    _index: usize,
    _grad: *mut torch_sys::C_tensor,
) -> *mut c_char {
    // SAFETY: as above.
    let inner = unsafe { &*(ctx as *const GroupInner) };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.pre_backward()));
    match result {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(e)) => {
            inner.note_failure(&e);
            ffi::malloc_message(&e.to_string())
        }
        Err(_) => ffi::malloc_message("fully_shard: internal panic in the pre-backward hook"),
    }
}

/// The identity of the tensor object behind `t` (shared by its shallow clones, kept by
/// `set_data`): two parameters with one identity are one parameter, tied.
pub fn tensor_identity(t: &Tensor) -> u64 {
    // SAFETY: a live tensor; reads a pointer.
    unsafe { ffi::tdr_tensor_identity(t.as_ptr() as *mut _) }
}

/// The version counter of the tensor behind `t` (every in-place change through it bumps it).
pub(crate) fn tensor_version(t: &Tensor) -> u64 {
    // SAFETY: a live tensor; the shim catches everything.
    unsafe { ffi::tdr_tensor_version(t.as_ptr() as *mut _) }
}
