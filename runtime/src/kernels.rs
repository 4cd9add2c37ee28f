//! libtorch kernels that tch does not expose, as safe functions: the fused optimizers
//! (`at::_fused_adamw_`, `at::_fused_sgd_`) over lists of tensors, the stepping engine of the
//! facade's `tch_dist::optim` (they run on CPU and CUDA tensors alike: libtorch 2.11 has CPU
//! kernels), and [`randperm`] from a seeded generator, the shuffle of the facade's
//! `tch_dist::data::DistributedSampler`.

use tch::Tensor;

use crate::ffi;

/// Why a kernel did not run: its lists do not line up, or libtorch refused the call.
///
/// ```
/// use tch_dist_runtime::kernels::{sgd, KernelError, SgdHyper};
/// let p = tch::Tensor::zeros([2], tch::kind::FLOAT_CPU);
/// let err = sgd(&[&p], &[], None, &SgdHyper { lr: 0.1, ..Default::default() }, false).unwrap_err();
/// assert!(matches!(err, KernelError::Lengths { kernel: "_fused_sgd_", list: "grads", expected: 1, found: 0 }));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// A list has another length than the parameters'.
    #[error("{kernel}: {found} {list} for {expected} parameters")]
    Lengths {
        /// The kernel (`_fused_adamw_`, `_fused_sgd_`).
        kernel: &'static str,
        /// Which list.
        list: &'static str,
        /// The number of parameters.
        expected: usize,
        /// The list's length.
        found: usize,
    },
    /// libtorch refused the call (its message, without backtrace).
    #[error("{kernel}: {cause}")]
    Engine {
        /// The kernel.
        kernel: &'static str,
        /// What libtorch said.
        cause: String,
    },
}

/// AdamW's hyperparameters for one [`adamw`] call (torch.optim.AdamW's names).
///
/// ```
/// let h = tch_dist_runtime::kernels::AdamWHyper { lr: 1e-3, beta1: 0.9, beta2: 0.999, weight_decay: 1e-2, eps: 1e-8, amsgrad: false, maximize: false };
/// # let _ = h;
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Learning rate.
    pub lr: f64,
    /// First moment's decay.
    pub beta1: f64,
    /// Second moment's decay.
    pub beta2: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Keep the running maximum of the second moment.
    pub amsgrad: bool,
    /// Ascend instead of descend.
    pub maximize: bool,
}

/// SGD's hyperparameters for one [`sgd`] call (torch.optim.SGD's names).
///
/// ```
/// let h = tch_dist_runtime::kernels::SgdHyper { lr: 0.1, momentum: 0.9, ..Default::default() };
/// assert_eq!(h.dampening, 0.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SgdHyper {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: no momentum buffers).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Ascend instead of descend.
    pub maximize: bool,
}

fn check(
    kernel: &'static str,
    n: usize,
    list: &'static str,
    len: usize,
) -> Result<(), KernelError> {
    if len == n {
        Ok(())
    } else {
        Err(KernelError::Lengths {
            kernel,
            list,
            expected: n,
            found: len,
        })
    }
}

fn ptrs(ts: &[&Tensor]) -> Vec<*mut torch_sys::C_tensor> {
    ts.iter().map(|t| t.as_ptr() as *mut _).collect()
}

/// One AdamW step of `params` with libtorch's `_fused_adamw_`: each `steps` entry (a float32
/// scalar tensor) is incremented first, then the parameters, `exp_avgs`, `exp_avg_sqs` (and
/// `max_exp_avg_sqs` with amsgrad) are updated in place, as `torch.optim.AdamW(fused=True)`.
/// The caller makes sure that each parameter's gradient and state have its shape, dtype and
/// device.
///
/// ```
/// use tch::Tensor;
/// use tch_dist_runtime::kernels::{adamw, AdamWHyper};
/// let p = Tensor::ones([2], tch::kind::FLOAT_CPU);
/// let g = Tensor::ones([2], tch::kind::FLOAT_CPU);
/// let (m, v, s) = (p.zeros_like(), p.zeros_like(), Tensor::zeros([], tch::kind::FLOAT_CPU));
/// let h = AdamWHyper { lr: 0.1, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8, amsgrad: false, maximize: false };
/// adamw(&[&p], &[&g], &[&m], &[&v], None, &[&s], &h)?;
/// assert_eq!(s.double_value(&[]), 1.0);
/// assert!((p.double_value(&[0]) - 0.9).abs() < 1e-6); // the first step moves by lr
/// # Ok::<(), tch_dist_runtime::kernels::KernelError>(())
/// ```
pub fn adamw(
    params: &[&Tensor],
    grads: &[&Tensor],
    exp_avgs: &[&Tensor],
    exp_avg_sqs: &[&Tensor],
    max_exp_avg_sqs: Option<&[&Tensor]>,
    steps: &[&Tensor],
    h: &AdamWHyper,
) -> Result<(), KernelError> {
    const K: &str = "_fused_adamw_";
    let n = params.len();
    check(K, n, "grads", grads.len())?;
    check(K, n, "exp_avgs", exp_avgs.len())?;
    check(K, n, "exp_avg_sqs", exp_avg_sqs.len())?;
    check(K, n, "steps", steps.len())?;
    if h.amsgrad {
        check(
            K,
            n,
            "max_exp_avg_sqs",
            max_exp_avg_sqs.map_or(0, <[_]>::len),
        )?;
    }
    let (p, g, m, v, s) = (
        ptrs(params),
        ptrs(grads),
        ptrs(exp_avgs),
        ptrs(exp_avg_sqs),
        ptrs(steps),
    );
    let vmax = max_exp_avg_sqs.filter(|_| h.amsgrad).map(ptrs);
    let vmax_ptr = vmax.as_ref().map_or(std::ptr::null(), |v| v.as_ptr());
    // SAFETY: every array holds `n` pointers to live tensors borrowed for this call (or is
    // null: `max_exp_avg_sqs` without amsgrad); the shim copies the tensor handles into a
    // TensorList and catches every C++ exception.
    ffi::check(unsafe {
        ffi::tdr_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            vmax_ptr,
            s.as_ptr(),
            n,
            h.lr,
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
            h.amsgrad,
            h.maximize,
        )
    })
    .map_err(|e| KernelError::Engine {
        kernel: K,
        cause: e.message,
    })
}

/// One SGD step of `params` with libtorch's `_fused_sgd_`, as `torch.optim.SGD(fused=True)`:
/// `momentum_buffers` is `None` when `h.momentum` is 0; with `is_first_step` the kernel fills
/// the buffers with the (weight-decayed) gradient instead of reading them. The caller makes
/// sure that each parameter's gradient and buffer have its shape, dtype and device.
///
/// ```
/// use tch::Tensor;
/// use tch_dist_runtime::kernels::{sgd, SgdHyper};
/// let p = Tensor::ones([2], tch::kind::FLOAT_CPU);
/// let g = Tensor::ones([2], tch::kind::FLOAT_CPU);
/// sgd(&[&p], &[&g], None, &SgdHyper { lr: 0.5, ..Default::default() }, false)?;
/// assert_eq!(p.double_value(&[0]), 0.5);
/// # Ok::<(), tch_dist_runtime::kernels::KernelError>(())
/// ```
pub fn sgd(
    params: &[&Tensor],
    grads: &[&Tensor],
    momentum_buffers: Option<&[&Tensor]>,
    h: &SgdHyper,
    is_first_step: bool,
) -> Result<(), KernelError> {
    const K: &str = "_fused_sgd_";
    let n = params.len();
    check(K, n, "grads", grads.len())?;
    if let Some(b) = momentum_buffers {
        check(K, n, "momentum_buffers", b.len())?;
    }
    let (p, g) = (ptrs(params), ptrs(grads));
    let b = momentum_buffers.map(ptrs);
    let b_ptr = b.as_ref().map_or(std::ptr::null(), |b| b.as_ptr());
    // SAFETY: as in `adamw`: `n` live tensors per array, or a null buffer list.
    ffi::check(unsafe {
        ffi::tdr_fused_sgd(
            p.as_ptr(),
            g.as_ptr(),
            b_ptr,
            n,
            h.weight_decay,
            h.momentum,
            h.lr,
            h.dampening,
            h.nesterov,
            h.maximize,
            is_first_step,
        )
    })
    .map_err(|e| KernelError::Engine {
        kernel: K,
        cause: e.message,
    })
}

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))`: the permutation of
/// `0..n` that PyTorch's CPU generator (mt19937) seeded with `seed` draws, as an int64 CPU
/// tensor.
///
/// ```
/// let perm = tch_dist_runtime::kernels::randperm(5, 0)?;
/// let mut seen = Vec::<i64>::try_from(&perm).unwrap();
/// seen.sort();
/// assert_eq!(seen, [0, 1, 2, 3, 4]);
/// # Ok::<(), tch_dist_runtime::kernels::KernelError>(())
/// ```
pub fn randperm(n: i64, seed: u64) -> Result<Tensor, KernelError> {
    const K: &str = "randperm";
    let engine = |cause: String| KernelError::Engine { kernel: K, cause };
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` is a valid out-pointer; the shim catches every C++ exception and on
    // success hands back a new tensor that we own.
    ffi::check(unsafe { ffi::tdr_randperm(n, seed, &mut out) }).map_err(|e| engine(e.message))?;
    if out.is_null() {
        return Err(engine("the engine returned no tensor".into()));
    }
    // SAFETY: `out` is a fresh `new at::Tensor` from the shim, owned by the returned Tensor.
    Ok(unsafe { Tensor::from_ptr(out) })
}
