//! The one way a libtorch callback comes back into Rust: [`trampoline`] (and
//! [`grad_trampoline`], for the callbacks the shim lends a gradient) turns the shim's opaque
//! context into the registered Rust value, runs the callback's body under `catch_unwind`, and
//! hands the engine what it understands: null to go on, or a malloc'ed message that fails
//! the backward pass (or the op) with that text.
//!
//! Each callback is a type implementing [`Callback`], so the engines (the reducer, fully_shard,
//! the use guard, the shard fence) write only what their hooks do; the unwinding and the text
//! live here. The forwards the shim runs (activation recomputation) are [`Forward`]s, through
//! [`forward_trampoline`]: lent inputs in, outputs pushed onto the shim's list, the same
//! reply.

use std::any::Any;
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::ForwardError;

use crate::ffi::{self, ShimError};

/// What a callback tells the engine: `Ok` to go on, `Err(text)` to fail with `text` (the
/// engine carries only text; an engine keeps the typed error itself where it needs it).
pub(crate) type Reply = std::result::Result<(), String>;

/// One kind of libtorch callback: the Rust value registered as its context, and what it does.
pub(crate) trait Callback {
    /// The value the shim hands back on every call.
    type Context: Send + Sync;
    /// What the engine fails with when the body panics (the API and the hook).
    const PANIC: &'static str;
    /// The body: `index` is the one given at registration (a parameter's position), `grad`
    /// the tensor the shim lends (a handle of our own) for the callbacks that get one.
    fn run(ctx: &Self::Context, index: usize, grad: Option<Tensor>) -> Reply;
}

/// The engine's reply for `body`'s outcome.
fn reply(panic: &'static str, body: impl FnOnce() -> Reply) -> *mut c_char {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(text)) => ffi::malloc_message(&text),
        Err(_) => ffi::malloc_message(panic),
    }
}

/// The shim's [`TdrCallback`](ffi::TdrCallback) for callback `C`.
///
/// # Safety
/// `ctx` must point to a live `C::Context` for the whole call (the registration's promise).
pub(crate) unsafe extern "C" fn trampoline<C: Callback>(
    ctx: *mut c_void,
    index: usize,
) -> *mut c_char {
    // SAFETY: the caller's promise.
    let ctx = unsafe { &*(ctx as *const C::Context) };
    reply(C::PANIC, || C::run(ctx, index, None))
}

/// The shim's [`TdrGradCallback`](ffi::TdrGradCallback) for callback `C`.
///
/// # Safety
/// As [`trampoline`]; `grad` is a live tensor lent for the call.
pub(crate) unsafe extern "C" fn grad_trampoline<C: Callback>(
    ctx: *mut c_void,
    index: usize,
    grad: *mut torch_sys::C_tensor,
) -> *mut c_char {
    // SAFETY: the caller's promise; the clone is a handle of our own.
    let (ctx, grad) = unsafe { (&*(ctx as *const C::Context), Tensor::clone_from_ptr(grad)) };
    reply(C::PANIC, || C::run(ctx, index, Some(grad)))
}

/// A callback whose engine also hands back the failures it catches around its own work (a
/// tensor-parallel backward's collective), for the text the backward pass fails with: the
/// failure written as every other collective's failure is, in Rust.
pub(crate) trait DescribeFailure: Callback {
    /// The text of `failure`, caught by the engine inside the callback's node.
    fn describe(ctx: &Self::Context, failure: ShimError) -> String;
}

/// The shim's [`TdrDescribe`](ffi::TdrDescribe) for callback `C`.
///
/// # Safety
/// As [`trampoline`]; `message` is a message the shim's error check made on this thread
/// just now (its kind is this thread's last), not yet freed: taken here.
pub(crate) unsafe extern "C" fn describe_trampoline<C: DescribeFailure>(
    ctx: *mut c_void,
    message: *mut c_char,
) -> *mut c_char {
    // SAFETY: the caller's promises.
    let (ctx, failure) = unsafe { (&*(ctx as *const C::Context), ffi::take_failure(message)) };
    let text = catch_unwind(AssertUnwindSafe(|| C::describe(ctx, failure)))
        .unwrap_or_else(|_| C::PANIC.to_string());
    ffi::malloc_message(&text)
}

/// A forward the shim runs and takes the outputs of (activation recomputation: the first
/// run, during the call that applies the function, and the run again during backward). The
/// context is the forward itself: each has one body, unlike a [`Callback`]'s context, which
/// several hooks of an engine share.
pub(crate) trait Forward {
    /// The outputs of `inputs` (handles of our own on the tensors the shim lends), or the
    /// text the engine fails with.
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>, String>;

    /// The text the engine fails with when [`run`](Self::run) panicked with `payload`; the
    /// forward may keep the payload, to resume the panic where it was called.
    fn panicked(&self, payload: Box<dyn Any + Send>) -> String {
        panic_text(&*payload)
    }
}

/// The text of a forward's panic: a hooked call's [`ForwardError`] (what `call` panics with)
/// by its message, a panic's own text, or a general sentence.
pub(crate) fn panic_text(payload: &(dyn Any + Send)) -> String {
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

/// The shim's [`TdrForwardCallback`](ffi::TdrForwardCallback) for forward `F`: null once the
/// outputs are on `out`, or a malloc'ed message (the forward's error or panic, or a failed
/// push).
///
/// # Safety
/// `ctx` must point to a live `F` for the whole call, `inputs` to `n` live tensors lent for
/// it, and `out` to a live list lent for it.
pub(crate) unsafe extern "C" fn forward_trampoline<F: Forward>(
    ctx: *mut c_void,
    inputs: *mut *mut torch_sys::C_tensor,
    n: usize,
    out: *mut ffi::TdrTensorList,
) -> *mut c_char {
    // SAFETY: the caller's promises; each clone is a handle of our own.
    let (forward, inputs) = unsafe {
        let inputs = (0..n)
            .map(|i| Tensor::clone_from_ptr(*inputs.add(i)))
            .collect::<Vec<_>>();
        (&*(ctx as *const F), inputs)
    };
    match catch_unwind(AssertUnwindSafe(|| forward.run(&inputs))) {
        Ok(Ok(outputs)) => push(out, &outputs),
        Ok(Err(text)) => ffi::malloc_message(&text),
        Err(payload) => ffi::malloc_message(&forward.panicked(payload)),
    }
}

/// Pushes `outputs` onto the shim's list `out`; the message of a failure.
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

/// A strong reference to `ctx`, as a context the shim releases through [`release::<T>`].
pub(crate) fn share<T>(ctx: &Arc<T>) -> *mut c_void {
    Arc::into_raw(Arc::clone(ctx)) as *mut c_void
}

/// Gives back a reference [`share`] made (the shim calls it once per context).
///
/// # Safety
/// `ctx` must come from [`share::<T>`] and be released once.
pub(crate) unsafe extern "C" fn release<T>(ctx: *mut c_void) {
    // SAFETY: the caller's promise.
    drop(unsafe { Arc::from_raw(ctx as *const T) });
}
