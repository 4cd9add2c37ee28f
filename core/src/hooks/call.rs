//! [`Call`] and [`CallT`]: `module(x)` for tch's one-input [`Module`] and [`ModuleT`] (a call
//! of several inputs or outputs: [`CallWith`](super::CallWith)).

use tch::nn::{Module, ModuleT};
use tch::Tensor;

use super::forward_error::{catching_hook_errors, fail};
use super::run::run_hooked;
use super::{ForwardError, Recompute};
use crate::walk::Shardable;

/// `module(x)`: forward with hooks, for any [`Module`] that is [`Shardable`] (a block of
/// several inputs or outputs: [`CallWith`](super::CallWith)).
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
    /// As [`Call::call`]; [`f_call_t`](CallT::f_call_t) returns the error
    /// instead.
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
