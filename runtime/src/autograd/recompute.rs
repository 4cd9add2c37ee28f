//! Activation recomputation, the engine of the facade's `checkpoint_activations`:
//! [`recomputed`] runs a forward with grad disabled inside a custom autograd function of the
//! shim (csrc/checkpoint.cpp, named as PyTorch names the feature), which keeps only the
//! inputs, and whose backward runs the forward again with grad enabled (and the first run's
//! RNG states) and differentiates it (the reentrant style of `torch.utils.checkpoint`).
//! "Checkpoint" in the runtime's Rust names nothing else: the facade's checkpoints are
//! saved states (`tch_dist::checkpoint`).
//!
//! Both forwards are Rust closures the shim calls back: the first during this call (it may
//! borrow), the second during a later backward pass (it owns what it needs). Neither lets a
//! panic cross the boundary: a panic in the first run is carried over the shim and resumed
//! here, as if the forward had run here (so a hooked call's guard sees it); a panic or error
//! in the recomputation becomes the text the backward pass fails with.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::panic::resume_unwind;
use std::sync::{Arc, Mutex, PoisonError};

use tch::Tensor;

use super::callback::{self, forward_trampoline, panic_text, release, Forward};
use crate::error::AutogradError;
use crate::ffi;

/// The forward run again during backward: `Ok(outputs)`, or the text the backward pass
/// fails with (naming the module).
pub type Recomputation = Box<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>, String> + Send>;

/// The caller's forward, borrowed for the first run.
type BorrowedForward<'a> = &'a mut dyn FnMut(&[Tensor]) -> Vec<Tensor>;

/// The first run: the borrowed forward and what it left behind. The shim calls it once,
/// during [`recomputed`], on this thread (hence the cells).
struct FirstRun<'a> {
    forward: RefCell<BorrowedForward<'a>>,
    /// The first run's panic, resumed once the shim has returned.
    panic: Cell<Option<Box<dyn Any + Send>>>,
}

impl Forward for FirstRun<'_> {
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>, String> {
        let mut forward = self.forward.borrow_mut();
        Ok((*forward)(inputs))
    }

    /// Keeps the panic, so that it unwinds from [`recomputed`] as from the forward itself
    /// (a hooked call's guard sees it); the engine fails the apply with its text meanwhile.
    fn panicked(&self, payload: Box<dyn Any + Send>) -> String {
        let text = panic_text(&*payload);
        self.panic.set(Some(payload));
        text
    }
}

/// The recomputation, shared with the shim until the graph is gone (a backward pass may run
/// on any of autograd's threads: hence the lock).
struct Again {
    forward: Mutex<Recomputation>,
}

impl Forward for Again {
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>, String> {
        let forward = self.forward.lock().unwrap_or_else(PoisonError::into_inner);
        forward(inputs)
    }
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
pub fn recomputed(
    inputs: &[Tensor],
    params: &[Tensor],
    buffers: &[Tensor],
    preserve_rng: bool,
    forward: &mut dyn FnMut(&[Tensor]) -> Vec<Tensor>,
    again: Recomputation,
) -> Result<Vec<Tensor>, AutogradError> {
    let first = FirstRun {
        forward: RefCell::new(forward),
        panic: Cell::new(None),
    };
    let again = Arc::new(Again {
        forward: Mutex::new(again),
    });
    let mut input_ptrs: Vec<*mut torch_sys::C_tensor> =
        inputs.iter().map(|t| t.as_ptr() as *mut _).collect();
    let mut param_ptrs: Vec<*mut torch_sys::C_tensor> =
        params.iter().map(|t| t.as_ptr() as *mut _).collect();
    let mut buffer_ptrs: Vec<*mut torch_sys::C_tensor> =
        buffers.iter().map(|t| t.as_ptr() as *mut _).collect();
    let mut out = std::ptr::null_mut();
    // SAFETY: live tensors and out-pointer; `first` outlives the call (the shim calls it only
    // during it); the shim holds its own reference to `again` (`share`), which it releases
    // through `release::<Again>` once, when the function's graph is gone or at once on failure.
    let status = ffi::check(unsafe {
        ffi::tdr_checkpoint_apply(
            input_ptrs.as_mut_ptr(),
            input_ptrs.len(),
            param_ptrs.as_mut_ptr(),
            param_ptrs.len(),
            buffer_ptrs.as_mut_ptr(),
            buffer_ptrs.len(),
            preserve_rng,
            forward_trampoline::<FirstRun>,
            &first as *const FirstRun as *mut c_void,
            forward_trampoline::<Again>,
            callback::share(&again),
            release::<Again>,
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

/// [`recomputed`]'s first name.
#[deprecated(note = "renamed `recomputed`: \"checkpoint\" names the facade's saved states")]
pub fn checkpointed(
    inputs: &[Tensor],
    params: &[Tensor],
    buffers: &[Tensor],
    preserve_rng: bool,
    forward: &mut dyn FnMut(&[Tensor]) -> Vec<Tensor>,
    again: Recomputation,
) -> Result<Vec<Tensor>, AutogradError> {
    recomputed(inputs, params, buffers, preserve_rng, forward, again)
}

/// The tensors of a list the shim made, which is freed.
pub(super) fn take_list(list: *mut ffi::TdrTensorList) -> Vec<Tensor> {
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
