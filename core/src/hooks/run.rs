//! A hooked call's steps, for every arity: the pre-hooks (each may replace the inputs), the
//! module's forward (or its [`ForwardWrapper`](super::ForwardWrapper)), then the forward hooks
//! (each may replace the outputs); a panic in the forward that a call guard caused becomes that
//! guard's error.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use tch::Tensor;

use super::outermost::CallDepth;
use super::wrap::{self, Recompute};
use super::{guard, CallError, CallOutput, ForwardError};
use crate::instances::{any_hooks, InstanceTable, PostHook, PreHook};
use crate::key::{identify, ModuleKey};
use crate::trace;
use crate::walk::Shardable;

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

/// A hooked call of `module` with `inputs`: the pre-hooks (each may replace the inputs), `forward`,
/// then the forward hooks (each may replace the outputs). One implementation for every arity, so
/// that [`Call::call`](super::Call::call) and [`CallWith::call_with`](super::CallWith::call_with)
/// run hooks alike.
///
/// `this` is the module as `Any` and `again` makes the forward's [`Recompute`],
/// for a [`ForwardWrapper`](super::ForwardWrapper) (only called when the instance has one).
pub(super) fn run_hooked<const N: usize, O: CallOutput>(
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

/// Runs a hooked call's `forward`: a panic inside it that a [`CallGuard`](super::CallGuard) caused
/// (an op refused inside a child run without its hooks) becomes that guard's error, which `call`
/// raises and `f_call` returns as a failing hook's; any other panic goes on.
fn forward_or_refusal<T>(forward: impl FnOnce() -> T) -> Result<T, ForwardError> {
    // Unwind safety: as in `catching_hook_errors`.
    match std::panic::catch_unwind(AssertUnwindSafe(forward)) {
        Ok(out) => Ok(out),
        Err(payload) => {
            if !payload.is::<ForwardError>()
                && let Some(e) = guard::refusal()
            {
                return Err(e);
            }
            std::panic::resume_unwind(payload)
        }
    }
}
