//! A hooked call's failure: [`ForwardError`], and where it surfaces. A failing hook (or a
//! guard's refusal) ends the call; inside an `f_call` (or [`catch_forward_errors`]) the
//! error unwinds to it and is returned there, also from a child called by a `forward` that
//! cannot return it; at the top, `call` panics with its message, as PyTorch's `module(x)`
//! raises.

use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use tch::Tensor;

use super::guard;

/// Why a forward with hooks failed: a fallible hook's error (for example replicate's
/// unfinished-reduction error, or a collective of a sharded layer).
/// [`Call::f_call`](super::Call::f_call) returns it; [`Call::call`](super::Call::call) panics
/// with its message, as PyTorch raises from `module(x)`.
///
/// A hook that fails with a typed error hands it over whole ([`ForwardError::from_error`]):
/// the caller gets it back with [`ForwardError::downcast_ref`] (or as the
/// [`source`](std::error::Error::source)).
///
/// ```
/// use tch_dist_core::hooks::ForwardError;
/// #[derive(Debug, thiserror::Error)]
/// #[error("rank 0: all_reduce failed")]
/// struct Failed;
/// let e = ForwardError::from_error(Failed);
/// assert_eq!(e.to_string(), "rank 0: all_reduce failed");
/// assert!(e.downcast_ref::<Failed>().is_some());
/// ```
#[derive(Debug, Clone)]
pub struct ForwardError {
    message: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl ForwardError {
    /// An error with `message` (which should name the rank, the operation and the module).
    pub fn new(message: impl Into<String>) -> Self {
        ForwardError {
            message: message.into(),
            source: None,
        }
    }

    /// The typed error `error`, with its composed message: its Display and each
    /// [`source`](std::error::Error::source)'s, joined with `": "` (the text `call` panics
    /// with). The message holds the causes, so this error has no `source()` of its own;
    /// [`downcast_ref`](Self::downcast_ref) gives the typed error.
    pub fn from_error(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        let mut message = error.to_string();
        let mut cause = error.source();
        while let Some(e) = cause {
            message.push_str(": ");
            message.push_str(&e.to_string());
            cause = e.source();
        }
        ForwardError {
            message,
            source: Some(Arc::new(error)),
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The typed error the hook failed with, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.source.as_deref()?.downcast_ref::<E>()
    }
}

impl std::fmt::Display for ForwardError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// No `source()`: the message already holds the typed error's text and its causes', so a
/// report of this error (anyhow's `{:#}`, `tch_dist::report`) prints them once.
impl std::error::Error for ForwardError {}

/// Two forward errors are equal when their messages are.
impl PartialEq for ForwardError {
    fn eq(&self, other: &Self) -> bool {
        self.message == other.message
    }
}

impl Eq for ForwardError {}

thread_local! {
    /// How many `f_call`/`f_call_t` are running on this thread.
    static F_CALL_DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Whether an `f_call` (or [`catch_forward_errors`]) runs on this thread: a hook's failure
/// or a guard's refusal then becomes its `Err` rather than a panic that reaches the caller.
pub(super) fn inside_f_call() -> bool {
    F_CALL_DEPTH.with(Cell::get) > 0
}

/// The end of a call whose hook failed: inside an `f_call` (a child called from its
/// module's `forward`), the error unwinds to that `f_call` without the panic hook's report;
/// at the top, a panic with the message, as PyTorch's `module(x)` raises.
pub(super) fn fail(e: ForwardError) -> ! {
    if inside_f_call() {
        std::panic::resume_unwind(Box::new(e))
    }
    panic!("{e}")
}

/// Runs `f` as an `f_call`: a hook failing in a child called by `forward` (which cannot
/// return an error) comes back as the `Err` of this call, and so does a panic that a
/// [`CallGuard`](super::CallGuard)'s refusal caused (an op refused inside a layer's
/// `forward`); any other panic goes on.
pub(super) fn catching_hook_errors<T>(
    f: impl FnOnce() -> Result<T, ForwardError>,
) -> Result<T, ForwardError> {
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            F_CALL_DEPTH.with(|d| d.set(d.get() - 1));
        }
    }
    F_CALL_DEPTH.with(|d| d.set(d.get() + 1));
    let _depth = Depth;
    // Unwind safety: what a failed forward leaves behind (a partial autograd graph) is
    // dropped with the unwinding frames; the module is only borrowed.
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => match payload.downcast::<ForwardError>() {
            Ok(e) => Err(*e),
            Err(other) => match guard::refusal() {
                Some(e) => Err(e),
                None => std::panic::resume_unwind(other),
            },
        },
    }
}

/// Runs `f`, a forward that does hook-like work outside [`Call`](super::Call), as
/// [`Call::f_call`](super::Call::f_call) runs one: a hook failing in a child that `f` calls
/// with `call` comes back as the `Err` (not as a panic), any other panic goes on. For wrappers (`tch_dist::replicate::Replicated`) whose
/// fallible forward must behave as `f_call`.
///
/// ```
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{catch_forward_errors, register_fallible_forward_pre_hook};
/// use tch_dist_core::hooks::{Call, ForwardError};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 3, 2, Default::default());
/// register_fallible_forward_pre_hook(&fc, |_m, _xs| Err(ForwardError::new("refused"))).unwrap();
/// // `call` inside would panic; inside `catch_forward_errors` the error is a value.
/// let err = catch_forward_errors(|| Ok(fc.call(&Tensor::ones([1, 3], tch::kind::FLOAT_CPU))));
/// assert_eq!(err.unwrap_err().message(), "refused");
/// ```
pub fn catch_forward_errors(
    f: impl FnOnce() -> Result<Tensor, ForwardError>,
) -> Result<Tensor, ForwardError> {
    catching_hook_errors(f)
}

/// Ends a forward that cannot return its error (`Module::forward`) as
/// [`Call::call`](super::Call::call) does: inside an `f_call` or [`catch_forward_errors`] the
/// error unwinds to it and is returned there; at the top, a panic with its message (as
/// PyTorch's `module(x)` raises).
///
/// ```
/// use tch_dist_core::hooks::{catch_forward_errors, raise_forward_error, ForwardError};
///
/// let r = catch_forward_errors(|| raise_forward_error(ForwardError::new("rank 0: failed")));
/// assert_eq!(r.unwrap_err().message(), "rank 0: failed");
/// ```
pub fn raise_forward_error(e: ForwardError) -> ! {
    fail(e)
}
