//! Forward hooks and [`Call`]/[`CallT`]: the Rust analogue of calling `module(x)` in PyTorch.
//!
//! `model.call(&xs)` runs the forward pre-hooks registered for that module instance (each may
//! replace the input), then `forward`, then the forward hooks (each may replace the output).
//! Calling `forward` directly bypasses the hooks, as calling `module.forward(x)` does in
//! PyTorch. Inside a model's own `forward`, call children with `self.fc1.call(&x)` so that
//! composable APIs can hook them.
//!
//! A block whose forward takes several tensors (`forward(x, mask)`) and returns one or a
//! tuple is called with [`CallWith::call_with`]
//! (`block.call_with([&x, &mask], |b, [x, mask]| b.forward(x, mask))`); its hooks see every
//! input and output ([`register_forward_pre_hook_n`], [`register_forward_hook_n`]), and a
//! one-tensor hook refuses such a call rather than see part of it ([`CallError`]).
//!
//! Hooks may fail ([`register_fallible_forward_pre_hook`], [`register_fallible_forward_hook`]):
//! [`Call::f_call`] returns the [`ForwardError`] (also one raised by a child's hook inside
//! `forward`), [`Call::call`] panics with its message, as PyTorch's `module(x)` raises.
//!
//! A [`CallScope`] ([`register_call_scope`]) brackets every hooked call of a module with a
//! pre-hook and a forward hook that share a per-call mark, for APIs that must see what a
//! call did between its start and its end.
//!
//! Hooks are stored per module instance (by [`ModuleKey`]) in the same store as composable
//! API state, so they follow the instance when it moves. When no hook is registered anywhere
//! in the program, `call` is `forward` plus one atomic load.
//!
//! ```
//! use tch::{nn, nn::Module, Device, Tensor};
//! use tch_dist_core::hooks::{register_forward_hook, register_forward_pre_hook, Call};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let fc = nn::linear(vs.root() / "fc", 3, 2, Default::default());
//! // Feed zeros instead of the input; then double the output.
//! let pre = register_forward_pre_hook(&fc, |_m, xs| Some(xs.zeros_like())).unwrap();
//! let post = register_forward_hook(&fc, |_m, _input, out| Some(out * 2.0)).unwrap();
//! let xs = Tensor::ones([1, 3], tch::kind::FLOAT_CPU);
//! let ys = fc.call(&xs);
//! assert!(ys.allclose(&(fc.bs.as_ref().unwrap() * 2.0), 1e-6, 1e-6, false));
//! pre.remove();
//! post.remove();
//! assert!(fc.call(&xs).allclose(&fc.forward(&xs), 1e-6, 1e-6, false));
//! ```

use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tch::nn::{Module, ModuleT};
use tch::Tensor;

mod call_with;
mod guard;
mod scope;
pub(crate) mod wrap;

pub use call_with::{CallError, CallOutput, CallWith};
pub use guard::{register_call_guard, CallGuard};
pub use scope::{register_call_scope, CallScope};
pub use wrap::{register_forward_wrapper, FirstRun, Forward, ForwardWrapper, Recompute};

use crate::instances::{any_hooks, InstanceTable, PostHook, PreHook};
use crate::key::{identify, ModuleKey};
use crate::trace;
use crate::walk::Shardable;

/// Why a hook could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HookError {
    /// The module has no parameters and no buffers, so it has no [`ModuleKey`].
    #[error(
        "cannot register a hook on a `{module}`: it has no parameters or buffers, so the \
         module instance cannot be identified"
    )]
    NoIdentity {
        /// The module's type name.
        module: &'static str,
    },
    /// The module has a forward wrapper already ([`register_forward_wrapper`]): two APIs
    /// cannot both run its forward.
    #[error("cannot wrap the forward of a `{module}`: another API wraps it already")]
    WrapperTaken {
        /// The module's type name.
        module: &'static str,
    },
}

/// Why a forward with hooks failed: a fallible hook's error (for example replicate's
/// unfinished-reduction error, or a collective of a sharded layer). [`Call::f_call`] returns
/// it; [`Call::call`] panics with its message, as PyTorch raises from `module(x)`.
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

/// Removes the hook it was returned for (PyTorch's `RemovableHandle`). Dropping the handle
/// does not remove the hook.
#[derive(Debug, Clone)]
pub struct RemovableHandle {
    key: ModuleKey,
    id: u64,
}

impl RemovableHandle {
    /// Removes the hook; returns whether it was still registered.
    pub fn remove(&self) -> bool {
        InstanceTable::lock().remove_hook(&self.key, self.id)
    }

    /// A process-unique id of the hook.
    pub fn id(&self) -> u64 {
        self.id
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn resolve<M: Shardable + ?Sized>(module: &M) -> Result<(ModuleKey, &Tensor), HookError> {
    identify(module.as_dyn_shardable()).ok_or(HookError::NoIdentity {
        module: module.type_name(),
    })
}

/// Registers a forward pre-hook on the instance `module`: `hook(module, input)` runs before
/// `forward` in [`Call::call`]/[`CallT::call_t`]; returning `Some(t)` replaces the input.
/// Hooks run in registration order (PyTorch's `register_forward_pre_hook`).
///
/// A one-tensor hook sees calls of one input only: on a [`CallWith::call_with`] of another
/// arity it fails the call with [`CallError::OneTensorPreHook`] (it would otherwise miss
/// inputs); [`register_forward_pre_hook_n`] registers a hook that sees every input.
pub fn register_forward_pre_hook<M, F>(module: &M, hook: F) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &Tensor) -> Option<Tensor> + Send + Sync + 'static,
{
    register_fallible_forward_pre_hook(module, move |m, xs| Ok(hook(m, xs)))
}

/// A forward pre-hook that may fail: an `Err` stops the call before `forward` runs, and
/// [`Call::f_call`] returns it (PyTorch: an exception raised in a pre-hook).
///
/// ```
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{register_fallible_forward_pre_hook, Call, ForwardError};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 3, 2, Default::default());
/// register_fallible_forward_pre_hook(&fc, |_m, xs| match xs.size()[..] {
///     [_, 3] => Ok(None),
///     _ => Err(ForwardError::new(format!("fc: expected 3 features, got {:?}", xs.size()))),
/// })
/// .unwrap();
/// assert!(fc.f_call(&Tensor::ones([1, 3], tch::kind::FLOAT_CPU)).is_ok());
/// let err = fc.f_call(&Tensor::ones([1, 4], tch::kind::FLOAT_CPU)).unwrap_err();
/// assert_eq!(err.to_string(), "fc: expected 3 features, got [1, 4]");
/// ```
pub fn register_fallible_forward_pre_hook<M, F>(
    module: &M,
    hook: F,
) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &Tensor) -> Result<Option<Tensor>, ForwardError> + Send + Sync + 'static,
{
    register_fallible_forward_pre_hook_n(module, move |m, inputs| match inputs {
        [xs] => Ok(hook(m, xs)?.map(|t| vec![t])),
        _ => Err(ForwardError::from_error(CallError::OneTensorPreHook {
            module: m.type_name(),
            inputs: inputs.len(),
        })),
    })
}

/// Registers a forward pre-hook that sees every input of a call (PyTorch's pre-hooks get the
/// `args` tuple): `hook(module, inputs)` runs before `forward` in [`Call::call`] (one input)
/// and [`CallWith::call_with`] (any number); returning `Some(v)` replaces the inputs, with as
/// many tensors.
///
/// ```
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{register_forward_pre_hook_n, CallWith};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
/// // Doubles every input.
/// register_forward_pre_hook_n(&fc, |_m, xs| Some(xs.iter().map(|x| x * 2.0).collect())).unwrap();
/// let (x, y) = (Tensor::ones([1, 2], tch::kind::FLOAT_CPU), Tensor::ones([1, 2], tch::kind::FLOAT_CPU));
/// let sum = fc.call_with([&x, &y], |fc, [x, y]| (x + y).apply(fc));
/// assert!(sum.allclose(&(&x * 4.0).apply(&fc), 1e-6, 1e-6, false));
/// ```
pub fn register_forward_pre_hook_n<M, F>(module: &M, hook: F) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &[Tensor]) -> Option<Vec<Tensor>> + Send + Sync + 'static,
{
    register_fallible_forward_pre_hook_n(module, move |m, xs| Ok(hook(m, xs)))
}

/// [`register_forward_pre_hook_n`]'s hook that may fail: an `Err` stops the call before
/// `forward` runs, and [`CallWith::f_call_with`] (or [`Call::f_call`]) returns it.
///
/// ```
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{register_fallible_forward_pre_hook_n, CallWith, ForwardError};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
/// register_fallible_forward_pre_hook_n(&fc, |_m, xs| match xs {
///     [x, mask] if x.size() == mask.size() => Ok(None),
///     _ => Err(ForwardError::new("fc: the mask must have the input's shape")),
/// })
/// .unwrap();
/// let x = Tensor::ones([1, 2], tch::kind::FLOAT_CPU);
/// let mask = Tensor::zeros([1, 1], tch::kind::FLOAT_CPU);
/// let err = fc.f_call_with([&x, &mask], |fc, [x, m]| (x + m).apply(fc)).unwrap_err();
/// assert_eq!(err.message(), "fc: the mask must have the input's shape");
/// ```
pub fn register_fallible_forward_pre_hook_n<M, F>(
    module: &M,
    hook: F,
) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &[Tensor]) -> Result<Option<Vec<Tensor>>, ForwardError>
        + Send
        + Sync
        + 'static,
{
    let (key, first) = resolve(module)?;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    InstanceTable::lock().add_pre_hook(&key, first, id, Arc::new(hook) as PreHook);
    Ok(RemovableHandle { key, id })
}

/// Registers a forward hook on the instance `module`: `hook(module, input, output)` runs
/// after `forward`; returning `Some(t)` replaces the output. Hooks run in registration order
/// (PyTorch's `register_forward_hook`).
///
/// A one-tensor hook sees calls of one input and one output only: on a
/// [`CallWith::call_with`] of another arity it fails the call with
/// [`CallError::OneTensorHook`]; [`register_forward_hook_n`] registers a hook that sees
/// every input and output.
pub fn register_forward_hook<M, F>(module: &M, hook: F) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &Tensor, &Tensor) -> Option<Tensor> + Send + Sync + 'static,
{
    register_fallible_forward_hook(module, move |m, xs, out| Ok(hook(m, xs, out)))
}

/// A forward hook that may fail: an `Err` ends the call, and [`Call::f_call`] returns it.
pub fn register_fallible_forward_hook<M, F>(
    module: &M,
    hook: F,
) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &Tensor, &Tensor) -> Result<Option<Tensor>, ForwardError>
        + Send
        + Sync
        + 'static,
{
    register_fallible_forward_hook_n(module, move |m, inputs, outputs| match (inputs, outputs) {
        ([xs], [out]) => Ok(hook(m, xs, out)?.map(|t| vec![t])),
        _ => Err(ForwardError::from_error(CallError::OneTensorHook {
            module: m.type_name(),
            inputs: inputs.len(),
            outputs: outputs.len(),
        })),
    })
}

/// Registers a forward hook that sees every input and every output of a call:
/// `hook(module, inputs, outputs)` runs after `forward`; returning `Some(v)` replaces the
/// outputs, with as many tensors.
///
/// ```
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{register_forward_hook_n, CallWith};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
/// // Negates every output.
/// register_forward_hook_n(&fc, |_m, _xs, outs| Some(outs.iter().map(|o| -o).collect()))
///     .unwrap();
/// let x = Tensor::ones([1, 2], tch::kind::FLOAT_CPU);
/// let (y, z) = fc.call_with([&x], |fc, [x]| (x.apply(fc), x * 1.0));
/// assert!(y.allclose(&-x.apply(&fc), 1e-6, 1e-6, false));
/// assert!(z.allclose(&-&x, 1e-6, 1e-6, false));
/// ```
pub fn register_forward_hook_n<M, F>(module: &M, hook: F) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &[Tensor], &[Tensor]) -> Option<Vec<Tensor>> + Send + Sync + 'static,
{
    register_fallible_forward_hook_n(module, move |m, xs, outs| Ok(hook(m, xs, outs)))
}

/// [`register_forward_hook_n`]'s hook that may fail: an `Err` ends the call, and
/// [`CallWith::f_call_with`] (or [`Call::f_call`]) returns it.
///
/// ```
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{register_fallible_forward_hook_n, CallWith, ForwardError};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
/// register_fallible_forward_hook_n(&fc, |_m, _xs, outs| {
///     Err(ForwardError::new(format!("fc: {} outputs refused", outs.len())))
/// })
/// .unwrap();
/// let x = Tensor::ones([1, 2], tch::kind::FLOAT_CPU);
/// let err = fc.f_call_with([&x], |fc, [x]| (x.apply(fc), x * 1.0)).unwrap_err();
/// assert_eq!(err.message(), "fc: 2 outputs refused");
/// ```
pub fn register_fallible_forward_hook_n<M, F>(
    module: &M,
    hook: F,
) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>, ForwardError>
        + Send
        + Sync
        + 'static,
{
    let (key, first) = resolve(module)?;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    InstanceTable::lock().add_post_hook(&key, first, id, Arc::new(hook) as PostHook);
    Ok(RemovableHandle { key, id })
}

/// How many forward pre-hooks and forward hooks are registered on the instance `module`.
pub fn num_forward_hooks<M: Shardable + ?Sized>(module: &M) -> (usize, usize) {
    if !any_hooks() {
        return (0, 0);
    }
    let Some((key, first)) = identify(module.as_dyn_shardable()) else {
        return (0, 0);
    };
    let mut store = InstanceTable::lock();
    store
        .get(&key, first)
        .map_or((0, 0), |e| (e.pre_hooks.len(), e.post_hooks.len()))
}

/// The pre-hooks and forward hooks of the instance `(key, first)`, copied out so
/// that none runs under the store's lock.
fn hooks_of(key: &ModuleKey, first: &Tensor) -> (Vec<PreHook>, Vec<PostHook>) {
    let mut store = InstanceTable::lock();
    match store.get(key, first) {
        Some(e) => (
            e.pre_hooks.iter().map(|(_, h)| Arc::clone(h)).collect(),
            e.post_hooks.iter().map(|(_, h)| Arc::clone(h)).collect(),
        ),
        None => (Vec::new(), Vec::new()),
    }
}

/// The forward wrapper of the instance `(key, first)`, if any.
fn wrapper_of(key: &ModuleKey, first: &Tensor) -> Option<wrap::StoredWrapper> {
    let mut store = InstanceTable::lock();
    let e = store.get(key, first)?;
    e.wrapper.as_ref().map(|(_, w)| Arc::clone(w))
}

/// A hooked call of `module` with `inputs`: the pre-hooks (each may replace the inputs),
/// `forward`, then the forward hooks (each may replace the outputs). One implementation for
/// every arity, so that [`Call::call`] and [`CallWith::call_with`] run hooks alike.
///
/// `this` is the module as `Any` and `again` makes the forward's [`Recompute`], for a
/// [`ForwardWrapper`] (only called when the instance has one).
fn run_hooked<const N: usize, O: CallOutput>(
    module: &dyn Shardable,
    this: &dyn std::any::Any,
    inputs: [&Tensor; N],
    forward: impl FnOnce([&Tensor; N]) -> O,
    again: impl FnOnce() -> Recompute,
) -> Result<O, ForwardError> {
    if !any_hooks() {
        return Ok(forward(inputs));
    }
    let Some((key, first)) = identify(module) else {
        return Ok(forward(inputs));
    };
    let _depth = CallDepth::enter(module);
    let (pre, _) = hooks_of(&key, first);
    // Hooks see (and may replace) the inputs as owned handles on the caller's tensors.
    let mut args: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
    for h in &pre {
        if let Some(replaced) = h(module, &args)? {
            if replaced.len() != N {
                return Err(ForwardError::from_error(CallError::ReplacedInputs {
                    module: module.type_name(),
                    expected: N,
                    got: replaced.len(),
                }));
            }
            args = replaced;
        }
    }
    let input: [&Tensor; N] = std::array::from_fn(|i| &args[i]);
    // The module's own forward, after its pre-hooks (an FSDP group's gather) and before its
    // forward hooks.
    let span = if trace::enabled() {
        let type_name = module.type_name();
        let short = type_name.rsplit("::").next().unwrap_or(type_name);
        trace::span(format!("forward {short}"), "forward")
    } else {
        None
    };
    let mut outs = match wrapper_of(&key, first) {
        None => forward_or_refusal(|| forward(input))?.into_tensors(),
        Some(w) => {
            let mut once = Some(forward);
            let mut first_pass = |xs: &[Tensor]| -> Vec<Tensor> {
                let forward = once
                    .take()
                    .expect("a forward wrapper ran the call's forward twice");
                let xs: [&Tensor; N] = std::array::from_fn(|i| &xs[i]);
                forward(xs).into_tensors()
            };
            let forward = wrap::Forward {
                inputs: &args,
                this,
                first: &mut first_pass,
                again: again(),
            };
            forward_or_refusal(|| w.run(module, forward))??
        }
    };
    drop(span);
    let expected = outs.len();
    // Looked up again, as PyTorch does: hooks registered by the pre-hooks or by `forward`
    // run too.
    let (_, post) = hooks_of(&key, first);
    for h in &post {
        if let Some(replaced) = h(module, &args, &outs)? {
            if replaced.len() != expected {
                return Err(ForwardError::from_error(CallError::ReplacedOutputs {
                    module: module.type_name(),
                    expected,
                    got: replaced.len(),
                }));
            }
            outs = replaced;
        }
    }
    // Unreachable for the sealed `CallOutput` types: each takes back as many tensors as it
    // gave, and the hooks' replacements were checked to be as many.
    O::from_tensors(outs).ok_or_else(|| {
        ForwardError::from_error(CallError::ReplacedOutputs {
            module: module.type_name(),
            expected,
            got: expected,
        })
    })
}

/// Runs a hooked call's `forward`: a panic inside it that a [`CallGuard`] caused (an op
/// refused inside a child run without its hooks) becomes that guard's error, which `call`
/// raises and `f_call` returns as a failing hook's; any other panic goes on.
fn forward_or_refusal<T>(forward: impl FnOnce() -> T) -> Result<T, ForwardError> {
    // Unwind safety: as in `catching_hook_errors`.
    match std::panic::catch_unwind(AssertUnwindSafe(forward)) {
        Ok(out) => Ok(out),
        Err(payload) => {
            if !payload.is::<ForwardError>() {
                if let Some(e) = guard::refusal() {
                    return Err(e);
                }
            }
            std::panic::resume_unwind(payload)
        }
    }
}

thread_local! {
    /// How many `f_call`/`f_call_t` are running on this thread.
    static F_CALL_DEPTH: Cell<usize> = const { Cell::new(0) };
    /// How many calls of hooked modules are running on this thread.
    static HOOKED_DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// One running call of a hooked module, counted in [`HOOKED_DEPTH`] until it returns or
/// unwinds.
struct CallDepth;

/// The module of the outermost hooked call running on this thread, as a pointer with its
/// lifetime erased: set when that call starts and cleared when it returns or unwinds (by
/// [`CallDepth`]), so it is only read while the call, and so the borrow, is live.
type Outermost = *const (dyn Shardable + 'static);

thread_local! {
    static OUTERMOST: Cell<Option<Outermost>> = const { Cell::new(None) };
}

impl CallDepth {
    fn enter(module: &dyn Shardable) -> CallDepth {
        let depth = HOOKED_DEPTH.with(|d| {
            d.set(d.get() + 1);
            d.get()
        });
        if depth == 1 {
            let ptr: *const (dyn Shardable + '_) = module;
            // SAFETY: only the lifetime of the trait object changes (same layout); the
            // pointer is cleared before the borrow ends (this guard's drop) and read only
            // while it is set, on this thread.
            let ptr: Outermost = unsafe { std::mem::transmute(ptr) };
            OUTERMOST.with(|o| o.set(Some(ptr)));
        }
        CallDepth
    }
}

impl Drop for CallDepth {
    fn drop(&mut self) {
        let depth = HOOKED_DEPTH.with(|d| {
            d.set(d.get() - 1);
            d.get()
        });
        if depth == 0 {
            OUTERMOST.with(|o| o.set(None));
            guard::outermost_call_ended();
        }
    }
}

/// The FQN of `module` within the module of the outermost hooked call running on this
/// thread (`""` for that module itself), or `None` outside hooked calls or when `module`
/// is not under it. For errors that must name a module by its full FQN when all an API
/// holds is the module (activation checkpointing).
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{fqn_in_outermost_call, register_forward_pre_hook, Call};
/// use tch_dist_core::Shardable;
///
/// #[derive(Debug, Shardable)]
/// #[shardable(crate = "tch_dist_core")]
/// struct Net {
///     body: Vec<nn::Linear>,
/// }
/// impl nn::Module for Net {
///     fn forward(&self, x: &Tensor) -> Tensor {
///         self.body[1].call(&self.body[0].call(x))
///     }
/// }
/// let vs = nn::VarStore::new(Device::Cpu);
/// let net = Net {
///     body: (0..2).map(|i| nn::linear(vs.root() / i, 2, 2, Default::default())).collect(),
/// };
/// let seen = Arc::new(Mutex::new(None));
/// let put = Arc::clone(&seen);
/// register_forward_pre_hook(&net.body[1], move |m, _| {
///     *put.lock().unwrap() = fqn_in_outermost_call(m);
///     None
/// })
/// .unwrap();
/// net.call(&Tensor::ones([1, 2], tch::kind::FLOAT_CPU));
/// assert_eq!(seen.lock().unwrap().as_deref(), Some("body.1"));
/// ```
pub fn fqn_in_outermost_call(module: &dyn Shardable) -> Option<String> {
    let outermost = OUTERMOST.with(Cell::get)?;
    // SAFETY: set by the outermost running call on this thread, whose borrow of the module
    // lasts until it is cleared (see `Outermost`); we are inside that call.
    let outermost: &dyn Shardable = unsafe { &*outermost };
    let key = crate::ModuleKey::of(module)?;
    outermost
        .named_modules()
        .into_iter()
        .find(|(_, m)| crate::ModuleKey::of(*m).as_ref() == Some(&key))
        .map(|(fqn, _)| fqn)
}

/// How many calls of hooked modules are running on this thread (1 inside the hooks of an
/// outermost one).
pub(crate) fn hooked_depth() -> usize {
    HOOKED_DEPTH.with(Cell::get)
}

/// The end of a call whose hook failed: inside an `f_call` (a child called from its
/// module's `forward`), the error unwinds to that `f_call` without the panic hook's report;
/// at the top, a panic with the message, as PyTorch's `module(x)` raises.
/// Whether an `f_call` (or [`catch_forward_errors`]) runs on this thread: a hook's failure
/// or a guard's refusal then becomes its `Err` rather than a panic that reaches the caller.
fn inside_f_call() -> bool {
    F_CALL_DEPTH.with(Cell::get) > 0
}

fn fail(e: ForwardError) -> ! {
    if inside_f_call() {
        std::panic::resume_unwind(Box::new(e))
    }
    panic!("{e}")
}

/// Runs `f` as an `f_call`: a hook failing in a child called by `forward` (which cannot
/// return an error) comes back as the `Err` of this call, and so does a panic that a
/// [`CallGuard`]'s refusal caused (an op refused inside a layer's `forward`); any other
/// panic goes on.
fn catching_hook_errors<T>(f: impl FnOnce() -> Result<T, ForwardError>) -> Result<T, ForwardError> {
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

/// Runs `f`, a forward that does hook-like work outside [`Call`], as [`Call::f_call`] runs
/// one: a hook failing in a child that `f` calls with `call` comes back as the `Err` (not as
/// a panic), any other panic goes on. For wrappers (`tch_dist::replicate::Replicated`) whose
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

/// Ends a forward that cannot return its error (`Module::forward`) as [`Call::call`] does:
/// inside an `f_call` or [`catch_forward_errors`] the error unwinds to it and is returned
/// there; at the top, a panic with its message (as PyTorch's `module(x)` raises).
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

/// `module(x)`: forward with hooks, for any [`Module`] that is [`Shardable`] (a block of
/// several inputs or outputs: [`CallWith`]).
pub trait Call {
    /// Runs the pre-hooks, `forward`, then the forward hooks of this instance.
    ///
    /// # Panics
    ///
    /// With the message of a fallible hook's [`ForwardError`], as PyTorch's `module(x)`
    /// raises; [`f_call`](Call::f_call) returns it instead.
    fn call(&self, xs: &Tensor) -> Tensor;

    /// [`call`](Call::call), with a failing hook's error as a value (tch's `f_` convention),
    /// including the hooks of children that `forward` calls with `call`.
    ///
    /// ```
    /// use tch::{nn, Device, Tensor};
    /// use tch_dist_core::hooks::{register_fallible_forward_hook, Call, ForwardError};
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let fc = nn::linear(vs.root() / "fc", 3, 2, Default::default());
    /// register_fallible_forward_hook(&fc, |_m, _x, out| {
    ///     Err(ForwardError::new(format!("rank 0: fc: output {:?} refused", out.size())))
    /// })
    /// .unwrap();
    /// let err = fc.f_call(&Tensor::ones([1, 3], tch::kind::FLOAT_CPU)).unwrap_err();
    /// assert_eq!(err.message(), "rank 0: fc: output [1, 2] refused");
    /// ```
    fn f_call(&self, xs: &Tensor) -> Result<Tensor, ForwardError>;
}

/// The [`Recompute`] of `forward` on an `M`, for the calls of one input.
fn recompute_one<M: 'static>(
    forward: impl Fn(&M, &Tensor) -> Tensor + Send + 'static,
) -> impl FnOnce() -> Recompute {
    move || {
        Box::new(move |m: &dyn std::any::Any, xs: &[Tensor]| {
            let m = m.downcast_ref::<M>()?;
            match xs {
                [x] => Some(vec![forward(m, x)]),
                _ => None,
            }
        })
    }
}

impl<M: Module + Shardable + 'static> Call for M {
    fn call(&self, xs: &Tensor) -> Tensor {
        let again = recompute_one(|m: &M, x| m.forward(x));
        run_hooked(self, self, [xs], |[x]| self.forward(x), again).unwrap_or_else(|e| fail(e))
    }

    fn f_call(&self, xs: &Tensor) -> Result<Tensor, ForwardError> {
        let again = recompute_one(|m: &M, x| m.forward(x));
        catching_hook_errors(|| run_hooked(self, self, [xs], |[x]| self.forward(x), again))
    }
}

/// `module(x)` with a train flag: forward with hooks, for any [`ModuleT`] that is
/// [`Shardable`].
pub trait CallT {
    /// Runs the pre-hooks, `forward_t(xs, train)`, then the forward hooks of this instance.
    ///
    /// # Panics
    ///
    /// As [`Call::call`]; [`f_call_t`](CallT::f_call_t) returns the error instead.
    fn call_t(&self, xs: &Tensor, train: bool) -> Tensor;

    /// [`call_t`](CallT::call_t), with a failing hook's error as a value, as
    /// [`Call::f_call`].
    fn f_call_t(&self, xs: &Tensor, train: bool) -> Result<Tensor, ForwardError>;
}

impl<M: ModuleT + Shardable + 'static> CallT for M {
    fn call_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let again = recompute_one(move |m: &M, x| m.forward_t(x, train));
        run_hooked(self, self, [xs], |[x]| self.forward_t(x, train), again)
            .unwrap_or_else(|e| fail(e))
    }

    fn f_call_t(&self, xs: &Tensor, train: bool) -> Result<Tensor, ForwardError> {
        let again = recompute_one(move |m: &M, x| m.forward_t(x, train));
        catching_hook_errors(|| run_hooked(self, self, [xs], |[x]| self.forward_t(x, train), again))
    }
}
