//! Custom autograd functions with both passes in Rust: PyTorch's `torch.autograd.Function`,
//! for an operation whose backward is not the graph of its forward. Ring attention (the
//! facade's context parallelism) is one: its backward replays the ring with the merged
//! output and log-sum-exp instead of keeping every block's activations.
//!
//! [`apply_function`] runs the forward inside a custom function of the shim
//! (csrc/function.cpp) with grad disabled, as `Function.apply` runs it; the forward returns
//! its outputs and a [`Backward`]: a closure that owns what it saved (`ctx.save_for_backward`)
//! and maps the outputs' gradients to the inputs'. Save outputs as `detach()`ed handles: a
//! closure holding an output with its `grad_fn` would hold the node that holds the closure
//! (PyTorch's `SavedVariable` breaks the same cycle). As in the recomputation, no panic
//! crosses the boundary: the forward's panic unwinds from [`apply_function`], the
//! backward's becomes the text the backward pass fails with.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::panic::resume_unwind;
use std::sync::{Arc, Mutex, PoisonError};

use tch::Tensor;

use super::callback::{self, forward_trampoline, panic_text, release, Forward};
use super::recompute::take_list;
use crate::error::AutogradError;
use crate::ffi;

/// A function's backward: the gradients of its outputs (one each, zeros where an output got
/// none) to the gradients of its inputs (one each, `None` for an input without one), or the
/// text the backward pass fails with. It may run on any of autograd's threads.
pub type Backward = Box<dyn Fn(&[Tensor]) -> Result<Vec<Option<Tensor>>, String> + Send>;

/// A forward: the inputs (handles of their own, grad disabled) to the outputs and the
/// backward, or this caller's error.
pub type FunctionForward<'a, E> =
    &'a mut dyn FnMut(&[Tensor]) -> Result<(Vec<Tensor>, Backward), E>;

/// The first (and only) run of the forward, during [`apply_function`], on this thread.
struct FirstRun<'a, E> {
    forward: RefCell<FunctionForward<'a, E>>,
    /// Where the forward's backward goes, for the shim's backward callback.
    slot: Arc<BackwardSlot>,
    /// The forward's error or panic, handed back once the shim has returned.
    error: Cell<Option<E>>,
    panic: Cell<Option<Box<dyn Any + Send>>>,
}

impl<E: std::fmt::Display> Forward for FirstRun<'_, E> {
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>, String> {
        let mut forward = self.forward.borrow_mut();
        match (*forward)(inputs) {
            Ok((outputs, backward)) => {
                *self
                    .slot
                    .backward
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(backward);
                Ok(outputs)
            }
            Err(e) => {
                let text = e.to_string();
                self.error.set(Some(e));
                Err(text)
            }
        }
    }

    fn panicked(&self, payload: Box<dyn Any + Send>) -> String {
        let text = panic_text(&*payload);
        self.panic.set(Some(payload));
        text
    }
}

/// The backward, shared with the shim until the function's graph is gone.
struct BackwardSlot {
    backward: Mutex<Option<Backward>>,
}

impl Forward for BackwardSlot {
    fn run(&self, grads: &[Tensor]) -> Result<Vec<Tensor>, String> {
        let backward = self.backward.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(backward) = backward.as_ref() else {
            return Err("a custom function's backward ran without its forward".to_string());
        };
        let grads = backward(grads)?;
        Ok(grads
            .into_iter()
            .map(|g| g.unwrap_or_else(Tensor::new))
            .collect())
    }
}

/// Runs `forward(inputs)` with grad disabled inside a custom autograd function whose
/// backward is the [`Backward`] the forward returned: the outputs, with a `grad_fn` when an
/// input requires grad (integral outputs are not differentiable). The forward's error comes
/// back as it is; the engine's (a forward that returned an undefined tensor) as `E` from
/// [`AutogradError`]; a panic in the forward unwinds from here.
///
/// ```
/// use tch::{Kind, Tensor};
/// use tch_dist_runtime::{apply_function, Backward};
/// let x = Tensor::from_slice(&[1.0f64, 2.0]).set_requires_grad(true);
/// // y = 3x, with its backward written by hand.
/// let y = apply_function::<tch_dist_runtime::AutogradError>(&[x.shallow_clone()], &mut |inputs| {
///     let backward: Backward = Box::new(|grads| Ok(vec![Some(&grads[0] * 3.0)]));
///     Ok((vec![&inputs[0] * 3.0], backward))
/// })?;
/// y[0].sum(Kind::Double).backward();
/// assert_eq!(Vec::<f64>::try_from(&x.grad()).unwrap(), [3.0, 3.0]);
/// # Ok::<(), tch_dist_runtime::AutogradError>(())
/// ```
pub fn apply_function<E>(
    inputs: &[Tensor],
    forward: FunctionForward<'_, E>,
) -> Result<Vec<Tensor>, E>
where
    E: std::fmt::Display + From<AutogradError>,
{
    let slot = Arc::new(BackwardSlot {
        backward: Mutex::new(None),
    });
    let first = FirstRun {
        forward: RefCell::new(forward),
        slot: Arc::clone(&slot),
        error: Cell::new(None),
        panic: Cell::new(None),
    };
    let mut input_ptrs: Vec<*mut torch_sys::C_tensor> =
        inputs.iter().map(|t| t.as_ptr() as *mut _).collect();
    let mut out = std::ptr::null_mut();
    // SAFETY: live tensors and out-pointer; `first` outlives the call (the shim calls it only
    // during it); the shim holds its own reference to `slot` (`share`), which it releases
    // through `release::<BackwardSlot>` once, when the function's graph is gone or at once on
    // failure.
    let status = ffi::check(unsafe {
        ffi::tdr_function_apply(
            input_ptrs.as_mut_ptr(),
            input_ptrs.len(),
            forward_trampoline::<FirstRun<E>>,
            &first as *const FirstRun<E> as *mut c_void,
            forward_trampoline::<BackwardSlot>,
            callback::share(&slot),
            release::<BackwardSlot>,
            &mut out,
        )
    });
    let outputs = take_list(out);
    if let Some(payload) = first.panic.take() {
        resume_unwind(payload);
    }
    if let Some(e) = first.error.take() {
        return Err(e);
    }
    status.map_err(|e| E::from(AutogradError::from(e)))?;
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn x() -> Tensor {
        Tensor::from_slice(&[1.0f64, 2.0]).set_requires_grad(true)
    }

    /// The forward's own error comes back as it is, and nothing is left behind.
    #[test]
    fn a_forward_error_is_returned_whole() {
        let got = apply_function::<AutogradError>(&[x()], &mut |_| {
            Err(AutogradError::GradientCount {
                outputs: 7,
                grads: 8,
            })
        });
        assert_eq!(
            got.unwrap_err(),
            AutogradError::GradientCount {
                outputs: 7,
                grads: 8
            }
        );
    }

    /// A backward's error, and a backward that returns another number of gradients than
    /// of inputs, fail the backward pass with their text; a backward's panic too.
    #[test]
    fn a_failing_backward_fails_the_pass_with_its_text() {
        let run = |backward: Backward| {
            let mut backward = Some(backward);
            let y = apply_function::<AutogradError>(&[x()], &mut |inputs| {
                Ok((vec![&inputs[0] * 2.0], backward.take().unwrap()))
            })
            .unwrap();
            y[0].sum(Kind::Double).f_backward().unwrap_err().to_string()
        };
        let text = run(Box::new(|_| Err("the ring lost rank 3".to_string())));
        assert!(text.contains("the ring lost rank 3"), "{text}");
        let text = run(Box::new(|_| Ok(vec![])));
        assert!(
            text.contains("the backward returned 0 gradients for 1 inputs"),
            "{text}"
        );
        let text = run(Box::new(|_| panic!("a bug in a backward")));
        assert!(text.contains("a bug in a backward"), "{text}");
    }

    /// An input without a gradient (`None`) and an integral output are allowed; the
    /// gradient reaches only the inputs that require it.
    #[test]
    fn inputs_without_gradients_and_integral_outputs() {
        let (a, b) = (x(), Tensor::from_slice(&[5.0f64, 6.0]));
        let outs = apply_function::<AutogradError>(
            &[a.shallow_clone(), b.shallow_clone()],
            &mut |inputs| {
                let backward: Backward = Box::new(|grads| Ok(vec![Some(grads[0].copy()), None]));
                let sum = &inputs[0] + &inputs[1];
                Ok((vec![sum, Tensor::from_slice(&[1i64])], backward))
            },
        )
        .unwrap();
        assert!(outs[0].requires_grad() && !outs[1].requires_grad());
        outs[0].sum(Kind::Double).backward();
        assert_eq!(Vec::<f64>::try_from(&a.grad()).unwrap(), [1.0, 1.0]);
        assert!(!b.grad().defined());
    }
}
