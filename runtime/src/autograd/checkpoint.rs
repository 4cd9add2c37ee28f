//! Activation checkpointing's engine: [`checkpointed`] runs a forward with grad disabled
//! inside a custom autograd function of the shim (csrc/checkpoint.cpp), which keeps only the
//! inputs, and whose backward runs the forward again with grad enabled (and the first run's
//! RNG states) and differentiates it (the reentrant style of `torch.utils.checkpoint`).
//!
//! Both forwards are Rust closures the shim calls back: the first during this call (it may
//! borrow), the second during a later backward pass (it owns what it needs). Neither lets a
//! panic cross the boundary: a panic in the first run is carried over the shim and resumed
//! here, as if the forward had run here (so a hooked call's guard sees it); a panic or error
//! in the recomputation becomes the text the backward pass fails with.

use std::any::Any;
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use tch::Tensor;
use tch_dist_core::hooks::ForwardError;

use crate::error::AutogradError;
use crate::ffi;

/// The forward run again during backward: `Ok(outputs)`, or the text the backward pass
/// fails with (naming the module).
pub type Recomputation = Box<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>, String> + Send>;

/// The first run's context: the borrowed forward and what it left behind.
struct FirstRun<'a> {
    forward: &'a mut dyn FnMut(&[Tensor]) -> Vec<Tensor>,
    /// The first run's panic, resumed once the shim has returned.
    panic: Option<Box<dyn Any + Send>>,
}

/// The recomputation's context, shared with the shim until the graph is gone.
struct Again {
    forward: Mutex<Recomputation>,
}

/// Runs `forward(inputs)` without keeping its activations; during backward the outputs'
/// gradients run `again` on detached copies of the inputs and return the gradients of the
/// inputs and of `params` (leaves that require grad: the module's trainable parameters).
/// With `preserve_rng`, the recomputation draws the same random numbers (dropout) as the
/// first run. `buffers` (the module's: a BatchNorm's running statistics) are put back as
/// they were before the recomputation once its backward is done: only the first run
/// updates them, as a forward without checkpointing would.
///
/// A panic inside `forward` unwinds from here, as from `forward` itself; the caller names the
/// rank and the module around an engine error.
pub fn checkpointed(
    inputs: &[Tensor],
    params: &[Tensor],
    buffers: &[Tensor],
    preserve_rng: bool,
    forward: &mut dyn FnMut(&[Tensor]) -> Vec<Tensor>,
    again: Recomputation,
) -> Result<Vec<Tensor>, AutogradError> {
    let mut first = FirstRun {
        forward,
        panic: None,
    };
    let again = Box::into_raw(Box::new(Again {
        forward: Mutex::new(again),
    }));
    let mut input_ptrs: Vec<*mut torch_sys::C_tensor> =
        inputs.iter().map(|t| t.as_ptr() as *mut _).collect();
    let mut param_ptrs: Vec<*mut torch_sys::C_tensor> =
        params.iter().map(|t| t.as_ptr() as *mut _).collect();
    let mut buffer_ptrs: Vec<*mut torch_sys::C_tensor> =
        buffers.iter().map(|t| t.as_ptr() as *mut _).collect();
    let mut out = std::ptr::null_mut();
    // SAFETY: live tensors and out-pointer; `first` outlives the call (the shim calls it only
    // during it); `again` is a box the shim releases through `release_again`, once, also on
    // failure.
    let status = ffi::check(unsafe {
        ffi::tdr_checkpoint_apply(
            input_ptrs.as_mut_ptr(),
            input_ptrs.len(),
            param_ptrs.as_mut_ptr(),
            param_ptrs.len(),
            buffer_ptrs.as_mut_ptr(),
            buffer_ptrs.len(),
            preserve_rng,
            first_trampoline,
            &mut first as *mut FirstRun as *mut c_void,
            again_trampoline,
            again as *mut c_void,
            release_again,
            &mut out,
        )
    });
    if let Some(payload) = first.panic.take() {
        if !out.is_null() {
            // SAFETY: the list the shim made, freed once.
            unsafe { ffi::tdr_tensor_list_free(out) };
        }
        resume_unwind(payload);
    }
    status?;
    Ok(take_list(out))
}

/// The tensors of a list the shim made, which is freed.
fn take_list(list: *mut ffi::TdrTensorList) -> Vec<Tensor> {
    if list.is_null() {
        return Vec::new();
    }
    // SAFETY: a live list the shim made; each taken handle is a new one we own; freed once.
    unsafe {
        let n = ffi::tdr_tensor_list_len(list);
        let tensors = (0..n)
            .filter_map(|i| {
                let p = ffi::tdr_tensor_list_take(list, i);
                (!p.is_null()).then(|| Tensor::from_ptr(p))
            })
            .collect();
        ffi::tdr_tensor_list_free(list);
        tensors
    }
}

/// Handles of our own on the `n` tensors the shim lends.
///
/// # Safety
/// `inputs` points to `n` live tensors.
unsafe fn lent(inputs: *mut *mut torch_sys::C_tensor, n: usize) -> Vec<Tensor> {
    // SAFETY: the caller's promise; each clone is a new handle.
    (0..n)
        .map(|i| unsafe { Tensor::clone_from_ptr(*inputs.add(i)) })
        .collect()
}

/// Pushes `outputs` onto the shim's list; the message of a failure.
fn push(out: *mut ffi::TdrTensorList, outputs: &[Tensor]) -> *mut c_char {
    for t in outputs {
        // SAFETY: a live list lent for the call and a live tensor (copied as a handle).
        if let Err(e) = ffi::check(unsafe { ffi::tdr_tensor_list_push(out, t.as_ptr() as *mut _) })
        {
            return ffi::malloc_message(&e.message);
        }
    }
    std::ptr::null_mut()
}

/// The text of a panic's payload.
fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(e) = payload.downcast_ref::<ForwardError>() {
        e.message().to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else {
        "the forward panicked".to_string()
    }
}

unsafe extern "C" fn first_trampoline(
    ctx: *mut c_void,
    inputs: *mut *mut torch_sys::C_tensor,
    n: usize,
    out: *mut ffi::TdrTensorList,
) -> *mut c_char {
    // SAFETY: `checkpointed`'s `FirstRun`, live for the whole shim call; the shim lends `n`
    // live inputs.
    let (first, inputs) = unsafe { (&mut *(ctx as *mut FirstRun), lent(inputs, n)) };
    match catch_unwind(AssertUnwindSafe(|| (first.forward)(&inputs))) {
        Ok(outputs) => push(out, &outputs),
        Err(payload) => {
            let text = panic_text(&*payload);
            first.panic = Some(payload);
            ffi::malloc_message(&text)
        }
    }
}

unsafe extern "C" fn again_trampoline(
    ctx: *mut c_void,
    inputs: *mut *mut torch_sys::C_tensor,
    n: usize,
    out: *mut ffi::TdrTensorList,
) -> *mut c_char {
    // SAFETY: the `Again` box, live until the shim releases it (after every call); the shim
    // lends `n` live inputs.
    let (again, inputs) = unsafe { (&*(ctx as *const Again), lent(inputs, n)) };
    let run = catch_unwind(AssertUnwindSafe(|| {
        let forward = again
            .forward
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        forward(&inputs)
    }));
    match run {
        Ok(Ok(outputs)) => push(out, &outputs),
        Ok(Err(text)) => ffi::malloc_message(&text),
        Err(payload) => ffi::malloc_message(&panic_text(&*payload)),
    }
}

unsafe extern "C" fn release_again(ctx: *mut c_void) {
    // SAFETY: the box `checkpointed` leaked, released once by the shim.
    drop(unsafe { Box::from_raw(ctx as *mut Again) });
}
