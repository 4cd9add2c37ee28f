//! Pipelining's backward (csrc/split_backward.cpp): a microbatch's backward in two passes,
//! the input's gradient first ([`backward_input`]) and the parameters' gradients later
//! ([`WeightBackward::run`]), so that a pipeline stage sends the gradient back to the
//! previous stage before it computes its weights' (PyTorch's `stage_backward_input` and
//! `stage_backward_weight` in `torch/distributed/pipelining/_backward.py`), or in one pass.
//!
//! The weight pass starts from the gradients the input pass kept at the nodes where a
//! parameter's branch leaves the input's path, so no part of the input pass runs twice.
//! Where the caller allows no split, the outputs do not depend on the input (a first stage),
//! or an activation-checkpointed function is on the input's path (its recomputation would run
//! twice), the input pass is the whole backward and there is no weight pass.

use std::ptr::NonNull;

use tch::Tensor;

use crate::error::AutogradError;
use crate::ffi;

/// The parameters' gradients still to compute after a [`backward_input`]. Dropping it
/// without running it leaves them uncomputed (a failed step).
#[derive(Debug)]
pub struct WeightBackward {
    state: NonNull<ffi::TdrSplitBackward>,
}

impl WeightBackward {
    /// Accumulates the parameters' gradients into their `.grad`, as a backward would
    /// have.
    pub fn run(self) -> Result<(), AutogradError> {
        // SAFETY: a live state the shim made, used once (self is consumed; Drop frees it).
        ffi::check(unsafe { ffi::tdr_backward_weight(self.state.as_ptr()) })?;
        Ok(())
    }
}

impl Drop for WeightBackward {
    fn drop(&mut self) {
        // SAFETY: the shim's state, freed once.
        unsafe { ffi::tdr_split_backward_free(self.state.as_ptr()) };
    }
}

/// The input pass of `roots`' backward, each with its gradient in `grads`: the gradient of
/// `input` (a leaf that requires grad; `None` on a first stage), `None` where the outputs do
/// not depend on it, and the weight pass still to run. Without `may_split` there is none: the
/// whole backward runs, as where the graph does not split. Without a weight pass the
/// parameters' gradients are accumulated already.
///
/// ```
/// use tch::{Kind, Tensor};
/// use tch_dist_runtime::backward_input;
/// let w = Tensor::from_slice(&[2.0f32]).set_requires_grad(true);
/// let x = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
/// let y = (&x * &w).sum(Kind::Float);
/// let (dx, weights) = backward_input(&[y.shallow_clone()], &[y.ones_like()], Some(&x), true)?;
/// assert_eq!(dx.map(|g| g.double_value(&[0])), Some(2.0));
/// assert!(!w.grad().defined()); // not yet
/// weights.expect("the product splits").run()?;
/// assert_eq!(w.grad().double_value(&[0]), 3.0);
/// # Ok::<(), tch_dist_runtime::AutogradError>(())
/// ```
pub fn backward_input(
    roots: &[Tensor],
    grads: &[Tensor],
    input: Option<&Tensor>,
    may_split: bool,
) -> Result<(Option<Tensor>, Option<WeightBackward>), AutogradError> {
    if roots.len() != grads.len() {
        return Err(AutogradError::GradientCount {
            outputs: roots.len(),
            grads: grads.len(),
        });
    }
    let mut root_ptrs: Vec<*mut torch_sys::C_tensor> =
        roots.iter().map(|t| t.as_ptr() as *mut _).collect();
    let mut grad_ptrs: Vec<*mut torch_sys::C_tensor> =
        grads.iter().map(|t| t.as_ptr() as *mut _).collect();
    let input_ptr = input.map_or(std::ptr::null_mut(), |t| t.as_ptr() as *mut _);
    let mut input_grad = std::ptr::null_mut();
    let mut state = std::ptr::null_mut();
    // SAFETY: live tensors for the call (arrays of `roots.len()` each, input null or live)
    // and out-pointers; what comes back is ours to own.
    let status = ffi::check(unsafe {
        ffi::tdr_backward_input(
            root_ptrs.as_mut_ptr(),
            grad_ptrs.as_mut_ptr(),
            roots.len(),
            input_ptr,
            may_split,
            &mut input_grad,
            &mut state,
        )
    });
    // SAFETY: a new handle from the shim, or null.
    let input_grad = (!input_grad.is_null()).then(|| unsafe { Tensor::from_ptr(input_grad) });
    let weights = NonNull::new(state).map(|state| WeightBackward { state });
    status?;
    Ok((input_grad, weights))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{nn, nn::Module, Device, Kind};

    /// A two-layer MLP's gradients, split, equal a whole backward's.
    #[test]
    fn split_gradients_equal_a_whole_backward() {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::seq()
            .add(nn::linear(vs.root() / "a", 4, 8, Default::default()))
            .add(nn::layer_norm(vs.root() / "n", vec![8], Default::default()))
            .add_fn(|x| x.gelu("none"))
            .add(nn::linear(vs.root() / "b", 8, 3, Default::default()));
        let x0 = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
        let g = Tensor::randn([5, 3], (Kind::Float, Device::Cpu));
        let whole = {
            let x = x0.copy().set_requires_grad(true);
            (net.forward(&x) * &g).sum(Kind::Float).backward();
            let grads: Vec<Tensor> = vs
                .trainable_variables()
                .iter()
                .map(|p| p.grad().copy())
                .collect();
            vs.trainable_variables().iter().for_each(|p| {
                let _ = p.grad().zero_();
            });
            (x.grad(), grads)
        };
        let x = x0.copy().set_requires_grad(true);
        let y = net.forward(&x);
        let (dx, weights) = backward_input(&[y], &[g], Some(&x), true).unwrap();
        assert!(dx.unwrap().allclose(&whole.0, 1e-6, 1e-6, false));
        for p in vs.trainable_variables() {
            assert_eq!(p.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
        }
        weights.expect("an MLP splits").run().unwrap();
        for (p, want) in vs.trainable_variables().iter().zip(&whole.1) {
            assert!(p.grad().allclose(want, 1e-6, 1e-6, false));
        }
    }

    /// One weight used twice along the input's path: each use's share once (no gradient
    /// flows from one split node into the other in the weight pass).
    #[test]
    fn a_weight_used_twice_gets_each_share_once() {
        let w = Tensor::from_slice(&[2.0f32]).set_requires_grad(true);
        let x = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let y = (&x * &w * &w).sum(Kind::Float);
        let (dx, weights) =
            backward_input(&[y.shallow_clone()], &[y.ones_like()], Some(&x), true).unwrap();
        assert_eq!(dx.unwrap().double_value(&[0]), 4.0);
        assert!(!w.grad().defined());
        weights.expect("split").run().unwrap();
        assert_eq!(w.grad().double_value(&[0]), 12.0); // d(x w^2)/dw = 2 x w
    }

    /// One linear layer applied twice (`lin(lin(x))`, a weight shared along the input's
    /// path): the weights' gradients equal a whole backward's. PyTorch 2.11's
    /// `stage_backward_weight` runs its passes from intermediates that reach one another and
    /// is off by up to 1.09 on this very case (its weight gets 18 for 12 on `x * w * w`).
    #[test]
    fn a_linear_layer_applied_twice_equals_a_whole_backward() {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let lin = nn::linear(vs.root() / "lin", 3, 3, Default::default());
        let x0 = Tensor::randn([2, 3], (Kind::Float, Device::Cpu));
        let x = x0.copy().set_requires_grad(true);
        lin.forward(&lin.forward(&x)).sum(Kind::Float).backward();
        let whole: Vec<Tensor> = vs
            .trainable_variables()
            .iter()
            .map(|p| p.grad().copy())
            .collect();
        let whole_dx = x.grad();
        vs.trainable_variables().iter().for_each(|p| {
            let _ = p.grad().zero_();
        });
        let x = x0.copy().set_requires_grad(true);
        let y = lin.forward(&lin.forward(&x)).sum(Kind::Float);
        let (dx, weights) =
            backward_input(&[y.shallow_clone()], &[y.ones_like()], Some(&x), true).unwrap();
        assert!(dx.unwrap().allclose(&whole_dx, 1e-6, 1e-6, false));
        weights.expect("split").run().unwrap();
        for (p, want) in vs.trainable_variables().iter().zip(&whole) {
            assert!(p.grad().allclose(want, 1e-6, 1e-6, false));
        }
    }

    /// An output that does not depend on the input: its parameters' gradients come in the
    /// weight pass, from its own gradient.
    #[test]
    fn an_output_without_the_input_is_differentiated_in_the_weight_pass() {
        let w = Tensor::from_slice(&[2.0f32]).set_requires_grad(true);
        let v = Tensor::from_slice(&[5.0f32]).set_requires_grad(true);
        let x = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let a = (&x * &w).sum(Kind::Float);
        let b = (&v * &v).sum(Kind::Float);
        let roots = [a.shallow_clone(), b.shallow_clone()];
        let (dx, weights) =
            backward_input(&roots, &[a.ones_like(), b.ones_like()], Some(&x), true).unwrap();
        assert_eq!(dx.unwrap().double_value(&[0]), 2.0);
        assert!(!w.grad().defined() && !v.grad().defined());
        weights.expect("split").run().unwrap();
        assert_eq!(w.grad().double_value(&[0]), 3.0);
        assert_eq!(v.grad().double_value(&[0]), 10.0);
    }

    /// Without `may_split`: the whole backward at once, the input's gradient returned.
    #[test]
    fn without_may_split_the_whole_backward_runs() {
        let w = Tensor::from_slice(&[2.0f32]).set_requires_grad(true);
        let x = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let y = (&x * &w).sum(Kind::Float);
        let (dx, weights) =
            backward_input(&[y.shallow_clone()], &[y.ones_like()], Some(&x), false).unwrap();
        assert!(weights.is_none());
        assert_eq!(dx.unwrap().double_value(&[0]), 2.0);
        assert_eq!(w.grad().double_value(&[0]), 3.0);
    }

    /// Without an input (a first stage): the whole backward.
    #[test]
    fn without_an_input_the_whole_backward_runs() {
        let w = Tensor::from_slice(&[2.0f32]).set_requires_grad(true);
        let y = (&w * 5.0).sum(Kind::Float);
        let (dx, weights) =
            backward_input(&[y.shallow_clone()], &[y.ones_like()], None, true).unwrap();
        assert!(dx.is_none() && weights.is_none());
        assert_eq!(w.grad().double_value(&[0]), 5.0);
    }

    /// An activation-checkpointed function on the input's path: the whole backward (the
    /// split would run its recomputation twice), the right gradients.
    #[test]
    fn a_checkpointed_function_on_the_path_runs_whole() {
        let w = Tensor::from_slice(&[2.0f32]).set_requires_grad(true);
        let x = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let (w1, w2) = (w.shallow_clone(), w.shallow_clone());
        let mut first = move |xs: &[Tensor]| vec![&xs[0] * &w1];
        let again: crate::autograd::Recomputation =
            Box::new(move |xs: &[Tensor]| Ok(vec![&xs[0] * &w2]));
        let out = crate::autograd::recomputed(
            &[x.shallow_clone()],
            &[w.shallow_clone()],
            &[],
            false,
            &mut first,
            again,
        )
        .unwrap();
        let y = (&out[0] * 5.0).sum(Kind::Float);
        let (dx, weights) =
            backward_input(&[y.shallow_clone()], &[y.ones_like()], Some(&x), true).unwrap();
        assert!(weights.is_none());
        assert_eq!(dx.unwrap().double_value(&[0]), 10.0);
        assert_eq!(w.grad().double_value(&[0]), 15.0);
    }
}
