//! The one way a libtorch callback comes back into Rust: [`trampoline`] (and
//! [`grad_trampoline`], for the callbacks the shim lends a gradient) turns the shim's opaque
//! context into the registered Rust value, runs the callback's body under `catch_unwind`, and
//! hands the engine what it understands: null to go on, or a malloc'ed message that fails
//! the backward pass (or the op) with that text.
//!
//! Each callback is a type implementing [`Callback`], so the engines (the reducer, fully_shard,
//! the use guard) write only what their hooks do; the unwinding and the text live here.

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use tch::Tensor;

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
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
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
    let text = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| C::describe(ctx, failure)))
        .unwrap_or_else(|_| C::PANIC.to_string());
    ffi::malloc_message(&text)
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
