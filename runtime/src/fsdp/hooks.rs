//! fully_shard's callbacks on libtorch's autograd (registered through `crate::autograd`):
//! the gradient interceptor on each managed parameter's accumulator and the pre-backward
//! hook on a managed module's output, each calling into its group.
//!
//! Each hook holds a strong reference to its group (an `Arc` handed to the shim with a
//! release function), so a hook that outlives the model's state (a graph kept alive by a
//! saved tensor) still calls into a live group. A hook's typed error is kept by the group
//! ([`ParamGroup::note_failure`]) for the next forward; the engine gets its text.

use std::sync::Arc;

use tch::Tensor;

use super::group::ParamGroup;
use crate::autograd::{self, Callback, Interceptor, Reply};
use crate::ffi::ShimError;

/// Called by libtorch with each gradient of managed parameter `index`.
struct GradIntercepted;

impl Callback for GradIntercepted {
    type Context = ParamGroup;
    const PANIC: &'static str = "fully_shard: internal panic in the gradient hook";

    fn run(inner: &ParamGroup, index: usize, grad: Option<Tensor>) -> Reply {
        let Some(grad) = grad else { return Ok(()) };
        inner.on_grad(index, grad).map_err(|e| {
            inner.note_failure(&e);
            e.to_string()
        })
    }
}

/// Called by libtorch when a managed module's output gradient is ready.
struct PreBackward;

impl Callback for PreBackward {
    type Context = ParamGroup;
    const PANIC: &'static str = "fully_shard: internal panic in the pre-backward hook";

    fn run(inner: &ParamGroup, _index: usize, _grad: Option<Tensor>) -> Reply {
        inner.pre_backward().map_err(|e| {
            inner.note_failure(&e);
            e.to_string()
        })
    }
}

/// Hands every gradient of `param` to `inner.on_grad(index, grad)` instead of `.grad`.
/// `param` must have its full shape now (its accumulator is made here).
pub(crate) fn intercept_grads(
    param: &Tensor,
    inner: &Arc<ParamGroup>,
    index: usize,
) -> std::result::Result<Interceptor, ShimError> {
    Interceptor::add::<GradIntercepted>(param, inner, index)
}

/// Runs `inner.pre_backward()` when the gradient of `output` has been computed, before the
/// backward of the module that made it.
pub(crate) fn add_pre_backward_hook(
    output: &Tensor,
    inner: &Arc<ParamGroup>,
) -> std::result::Result<(), ShimError> {
    autograd::add_output_grad_hook::<PreBackward>(output, inner)
}
