//! Hooked calls of any arity: [`CallWith::call_with`] runs a block whose forward takes several
//! tensors (`forward(x, mask)`) and returns one tensor or a tuple of them ([`CallOutput`]),
//! with the same hooks as [`Call::call`](super::Call::call), which stays the one-input form.
//!
//! tch's [`Module`](tch::nn::Module) fixes one input, so a block with several has its own
//! inherent `forward`; `call_with` keeps that signature: it takes the inputs as an array
//! (its length is the arity, checked when compiling) and the block's forward as a closure
//! that gets them back after the pre-hooks (which may replace them, as PyTorch's pre-hooks
//! replace `args`). The hooks see every input and every output as slices
//! ([`register_forward_pre_hook_n`](super::register_forward_pre_hook_n),
//! [`register_forward_hook_n`](super::register_forward_hook_n),
//! [`CallScope`](super::CallScope)).

use std::sync::{Arc, Mutex, PoisonError};

use tch::Tensor;

use super::forward_error::{catching_hook_errors, fail};
use super::run::run_hooked;
use super::{ForwardError, Recompute};
use crate::instances::any_hooks;
use crate::walk::Shardable;

/// Why a hooked call of several inputs or outputs failed in the call machinery itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// A one-tensor forward pre-hook ([`register_forward_pre_hook`](super::register_forward_pre_hook))
    /// on a call of another number of inputs: it could not see them all.
    #[error(
        "a one-tensor forward pre-hook of `{module}` cannot see a call with {inputs} inputs; \
         register it with `register_forward_pre_hook_n`"
    )]
    OneTensorPreHook {
        /// The module's type name.
        module: &'static str,
        /// How many inputs the call has.
        inputs: usize,
    },
    /// A one-tensor forward hook ([`register_forward_hook`](super::register_forward_hook)) on
    /// a call of another number of inputs or outputs.
    #[error(
        "a one-tensor forward hook of `{module}` cannot see a call with {inputs} inputs and \
         {outputs} outputs; register it with `register_forward_hook_n`"
    )]
    OneTensorHook {
        /// The module's type name.
        module: &'static str,
        /// How many inputs the call has.
        inputs: usize,
        /// How many outputs the call has.
        outputs: usize,
    },
    /// A forward pre-hook replaced the inputs with another number of tensors.
    #[error("a forward pre-hook of `{module}` replaced its {expected} inputs with {got}")]
    ReplacedInputs {
        /// The module's type name.
        module: &'static str,
        /// How many inputs the call has.
        expected: usize,
        /// How many the hook returned.
        got: usize,
    },
    /// A forward hook replaced the outputs with another number of tensors.
    #[error("a forward hook of `{module}` replaced its {expected} outputs with {got}")]
    ReplacedOutputs {
        /// The module's type name.
        module: &'static str,
        /// How many outputs the call has.
        expected: usize,
        /// How many the hook returned.
        got: usize,
    },
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for tch::Tensor {}
    impl Sealed for (tch::Tensor, tch::Tensor) {}
    impl Sealed for (tch::Tensor, tch::Tensor, tch::Tensor) {}
    impl Sealed for (tch::Tensor, tch::Tensor, tch::Tensor, tch::Tensor) {}
    impl Sealed for Vec<tch::Tensor> {}
}

/// What a hooked call's forward returns: one tensor, a tuple of two to four, or a `Vec`.
/// Forward hooks see it as a slice of tensors (one per output, in order) and may replace
/// it with as many.
///
/// ```
/// use tch::Tensor;
/// use tch_dist_core::hooks::CallOutput;
///
/// let pair = (Tensor::from(1.0f32), Tensor::from(2.0f32));
/// let tensors = pair.into_tensors();
/// assert_eq!(tensors.len(), 2);
/// let (a, b) = <(Tensor, Tensor)>::from_tensors(tensors).unwrap();
/// assert_eq!((a.double_value(&[]), b.double_value(&[])), (1.0, 2.0));
/// ```
pub trait CallOutput: sealed::Sealed + Sized {
    /// The outputs, in order.
    fn into_tensors(self) -> Vec<Tensor>;

    /// The value back from as many tensors as [`into_tensors`](Self::into_tensors) gave
    /// (`None` for another number).
    fn from_tensors(tensors: Vec<Tensor>) -> Option<Self>;
}

impl CallOutput for Tensor {
    fn into_tensors(self) -> Vec<Tensor> {
        vec![self]
    }
    fn from_tensors(tensors: Vec<Tensor>) -> Option<Self> {
        let [a]: [Tensor; 1] = tensors.try_into().ok()?;
        Some(a)
    }
}

impl CallOutput for (Tensor, Tensor) {
    fn into_tensors(self) -> Vec<Tensor> {
        vec![self.0, self.1]
    }
    fn from_tensors(tensors: Vec<Tensor>) -> Option<Self> {
        let [a, b]: [Tensor; 2] = tensors.try_into().ok()?;
        Some((a, b))
    }
}

impl CallOutput for (Tensor, Tensor, Tensor) {
    fn into_tensors(self) -> Vec<Tensor> {
        vec![self.0, self.1, self.2]
    }
    fn from_tensors(tensors: Vec<Tensor>) -> Option<Self> {
        let [a, b, c]: [Tensor; 3] = tensors.try_into().ok()?;
        Some((a, b, c))
    }
}

impl CallOutput for (Tensor, Tensor, Tensor, Tensor) {
    fn into_tensors(self) -> Vec<Tensor> {
        vec![self.0, self.1, self.2, self.3]
    }
    fn from_tensors(tensors: Vec<Tensor>) -> Option<Self> {
        let [a, b, c, d]: [Tensor; 4] = tensors.try_into().ok()?;
        Some((a, b, c, d))
    }
}

impl CallOutput for Vec<Tensor> {
    fn into_tensors(self) -> Vec<Tensor> {
        self
    }
    fn from_tensors(tensors: Vec<Tensor>) -> Option<Self> {
        Some(tensors)
    }
}

/// `module(x, mask, ...)`: a hooked call with any number of input tensors, for any
/// [`Shardable`] module, returning one tensor or several ([`CallOutput`]).
///
/// `forward` gets the module and the inputs after the pre-hooks: call the block's own
/// forward there with them (not with the caller's tensors, which a pre-hook, for example
/// mixed precision's cast, may have replaced). Running the block's forward without
/// `call_with` bypasses its hooks, as `forward` does for [`Call`](super::Call).
///
/// `forward` owns what it captures (`'static`): activation checkpointing runs it again
/// during backward, after the call returned. Pass tensors it needs as inputs (or move
/// handles of them into it).
///
/// ```
/// use tch::{nn, Device, Tensor};
/// use tch_dist_core::hooks::{register_forward_pre_hook_n, CallWith};
/// use tch_dist_core::Shardable;
///
/// /// Attention scores with an additive mask: a forward of two inputs.
/// #[derive(Debug, Shardable)]
/// #[shardable(crate = "tch_dist_core")]
/// struct Scores {
///     q: nn::Linear,
/// }
/// impl Scores {
///     fn forward(&self, x: &Tensor, mask: &Tensor) -> Tensor {
///         (x.apply(&self.q).matmul(&x.transpose(-2, -1)) + mask).softmax(-1, None)
///     }
/// }
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let s = Scores { q: nn::linear(vs.root() / "q", 4, 4, Default::default()) };
/// let x = Tensor::randn([3, 4], tch::kind::FLOAT_CPU);
/// let mask = Tensor::zeros([3, 3], tch::kind::FLOAT_CPU);
/// let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
/// let count = seen.clone();
/// register_forward_pre_hook_n(&s, move |_m, inputs| {
///     count.store(inputs.len(), std::sync::atomic::Ordering::Relaxed);
///     None
/// })
/// .unwrap();
/// let y = s.call_with([&x, &mask], |s, [x, mask]| s.forward(x, mask));
/// assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 2);
/// assert!(y.allclose(&s.forward(&x, &mask), 1e-6, 1e-6, false));
/// ```
pub trait CallWith: Shardable {
    /// Runs the pre-hooks over `inputs`, `forward(self, inputs)`, then the forward hooks
    /// over its outputs.
    ///
    /// # Panics
    ///
    /// With the message of a failing hook's [`ForwardError`], as
    /// [`Call::call`](super::Call::call); [`f_call_with`](CallWith::f_call_with) returns it.
    fn call_with<const N: usize, O: CallOutput>(
        &self,
        inputs: [&Tensor; N],
        forward: impl Fn(&Self, [&Tensor; N]) -> O + Send + 'static,
    ) -> O
    where
        Self: Sized + 'static,
    {
        hooked_with(self, inputs, forward).unwrap_or_else(|e| fail(e))
    }

    /// [`call_with`](CallWith::call_with), with a failing hook's error as a value, including
    /// the hooks of children that `forward` calls, as [`Call::f_call`](super::Call::f_call).
    ///
    /// ```
    /// use tch::{nn, Device, Tensor};
    /// use tch_dist_core::hooks::{register_fallible_forward_pre_hook_n, CallWith, ForwardError};
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let fc = nn::linear(vs.root() / "fc", 2, 2, Default::default());
    /// register_fallible_forward_pre_hook_n(&fc, |_m, xs| {
    ///     Err(ForwardError::new(format!("rank 0: fc: {} inputs refused", xs.len())))
    /// })
    /// .unwrap();
    /// let x = Tensor::ones([1, 2], tch::kind::FLOAT_CPU);
    /// let err = fc.f_call_with([&x, &x], |fc, [a, b]| (a + b).apply(fc)).unwrap_err();
    /// assert_eq!(err.message(), "rank 0: fc: 2 inputs refused");
    /// ```
    fn f_call_with<const N: usize, O: CallOutput>(
        &self,
        inputs: [&Tensor; N],
        forward: impl Fn(&Self, [&Tensor; N]) -> O + Send + 'static,
    ) -> Result<O, ForwardError>
    where
        Self: Sized + 'static,
    {
        catching_hook_errors(|| hooked_with(self, inputs, forward))
    }
}

/// A hooked call of `module` whose forward is `forward`, kept (behind a lock: it need not be
/// `Sync`) for the [`Recompute`] of a forward wrapper.
fn hooked_with<M, const N: usize, O>(
    module: &M,
    inputs: [&Tensor; N],
    forward: impl Fn(&M, [&Tensor; N]) -> O + Send + 'static,
) -> Result<O, ForwardError>
where
    M: Shardable + 'static,
    O: CallOutput,
{
    if !any_hooks() {
        return Ok(forward(module, inputs));
    }
    let forward = Arc::new(Mutex::new(forward));
    let kept = Arc::clone(&forward);
    let again = move || -> Recompute {
        Box::new(move |m: &dyn std::any::Any, xs: &[Tensor]| {
            let m = m.downcast_ref::<M>()?;
            let xs: [&Tensor; N] = xs.iter().collect::<Vec<_>>().try_into().ok()?;
            let f = kept.lock().unwrap_or_else(PoisonError::into_inner);
            Some(f(m, xs).into_tensors())
        })
    };
    run_hooked(
        module.as_dyn_shardable(),
        module,
        inputs,
        |xs| (forward.lock().unwrap_or_else(PoisonError::into_inner))(module, xs),
        again,
    )
}

impl<M: Shardable + ?Sized> CallWith for M {}
