//! Registering forward pre-hooks and forward hooks on a module instance (of one tensor or
//! of every input and output, infallible or fallible), the [`RemovableHandle`] that removes
//! one, and how many an instance has.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tch::Tensor;

use super::{CallError, ForwardError};
use crate::instances::{any_hooks, InstanceTable, PostHook, PreHook};
use crate::key::{identify, ModuleKey};
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
    /// The module has a forward wrapper already
    /// ([`register_forward_wrapper`](super::register_forward_wrapper)): two APIs cannot both run
    /// its forward.
    #[error("cannot wrap the forward of a `{module}`: another API wraps it already")]
    WrapperTaken {
        /// The module's type name.
        module: &'static str,
    },
}

/// Removes the hook it was returned for (PyTorch's `RemovableHandle`). Dropping the handle
/// does not remove the hook.
#[derive(Debug, Clone)]
pub struct RemovableHandle {
    pub(super) key: ModuleKey,
    pub(super) id: u64,
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

/// The next hook's (or forward wrapper's) id.
pub(super) static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The key of `module` and its first tensor (what the store pins to detect reuse), or why it
/// has none.
pub(super) fn resolve<M: Shardable + ?Sized>(
    module: &M,
) -> Result<(ModuleKey, &Tensor), HookError> {
    identify(module.as_dyn_shardable()).ok_or(HookError::NoIdentity {
        module: module.type_name(),
    })
}

/// Registers a forward pre-hook on the instance `module`: `hook(module, input)` runs before
/// `forward` in [`Call::call`](super::Call::call)/[`CallT::call_t`](super::CallT::call_t);
/// returning `Some(t)` replaces the input. Hooks run in registration order (PyTorch's
/// `register_forward_pre_hook`).
///
/// A one-tensor hook sees calls of one input only: on a
/// [`CallWith::call_with`](super::CallWith::call_with) of another arity it fails the call with
/// [`CallError::OneTensorPreHook`] (it would otherwise miss inputs);
/// [`register_forward_pre_hook_n`] registers a hook that sees every input.
pub fn register_forward_pre_hook<M, F>(module: &M, hook: F) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &Tensor) -> Option<Tensor> + Send + Sync + 'static,
{
    register_fallible_forward_pre_hook(module, move |m, xs| Ok(hook(m, xs)))
}

/// A forward pre-hook that may fail: an `Err` stops the call before `forward` runs, and
/// [`Call::f_call`](super::Call::f_call) returns it (PyTorch: an exception raised in a pre-hook).
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

/// Registers a forward pre-hook that sees every input of a call (PyTorch's pre-hooks get the `args`
/// tuple): `hook(module, inputs)` runs before `forward` in [`Call::call`](super::Call::call) (one
/// input) and [`CallWith::call_with`](super::CallWith::call_with) (any number); returning `Some(v)`
/// replaces the inputs, with as many tensors.
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

/// [`register_forward_pre_hook_n`]'s hook that may fail: an `Err` stops the call before `forward`
/// runs, and [`CallWith::f_call_with`](super::CallWith::f_call_with) (or
/// [`Call::f_call`](super::Call::f_call)) returns it.
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
/// [`CallWith::call_with`](super::CallWith::call_with) of another arity it fails the call with
/// [`CallError::OneTensorHook`]; [`register_forward_hook_n`]
/// registers a hook that sees every input and output.
pub fn register_forward_hook<M, F>(module: &M, hook: F) -> Result<RemovableHandle, HookError>
where
    M: Shardable + ?Sized,
    F: Fn(&dyn Shardable, &Tensor, &Tensor) -> Option<Tensor> + Send + Sync + 'static,
{
    register_fallible_forward_hook(module, move |m, xs, out| Ok(hook(m, xs, out)))
}

/// A forward hook that may fail: an `Err` ends the call, and [`Call::f_call`](super::Call::f_call)
/// returns it.
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
/// [`CallWith::f_call_with`](super::CallWith::f_call_with) (or
/// [`Call::f_call`](super::Call::f_call)) returns it.
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
