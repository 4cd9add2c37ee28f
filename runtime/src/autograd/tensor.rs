//! Tensor primitives the engines need beyond tch: releasing and restoring a storage's memory
//! (a full parameter between uses), `set_data` that keeps the gradient accumulator, a
//! tensor's identity and version counter, and which dtypes mixed precision casts.

use tch::{Kind, Tensor};

use crate::ffi::{self, ShimError};

/// Whether mixed precision casts tensors of `kind` (the floating-point dtypes); the facade's
/// input and output casts use it too.
pub fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Half | Kind::Float | Kind::Double | Kind::BFloat16
    )
}

/// Frees the memory of `t`'s storage (its elements must not be read until
/// [`restore_storage`]).
pub(crate) fn release_storage(t: &Tensor) -> std::result::Result<(), ShimError> {
    // SAFETY: a live tensor.
    ffi::check(unsafe { ffi::tdr_storage_release(t.as_ptr() as *mut _) })
}

/// Gives `t`'s storage memory for `t` again (uninitialized).
pub(crate) fn restore_storage(t: &Tensor) -> std::result::Result<(), ShimError> {
    // SAFETY: a live tensor.
    ffi::check(unsafe { ffi::tdr_storage_restore(t.as_ptr() as *mut _) })
}

/// Points `param` at `data` (`Tensor::set_data`), keeping its gradient accumulator, and so
/// the hooks on it, also when the dtype changes (mixed precision).
pub(crate) fn set_data(param: &Tensor, data: &Tensor) -> std::result::Result<(), ShimError> {
    // SAFETY: live tensors; the shim checks the types are compatible.
    ffi::check(unsafe {
        ffi::tdr_set_data_keep_accumulator(param.as_ptr() as *mut _, data.as_ptr() as *mut _)
    })
}

/// Bytes `t`'s storage holds now (0 once released).
pub fn storage_nbytes(t: &Tensor) -> usize {
    // SAFETY: a live tensor; the shim catches everything.
    unsafe { ffi::tdr_storage_nbytes(t.as_ptr() as *mut _) }
}

/// The identity of the tensor object behind `t` (shared by its shallow clones, kept by
/// `set_data`): two parameters with one identity are one parameter, tied.
pub fn tensor_identity(t: &Tensor) -> u64 {
    // SAFETY: a live tensor; reads a pointer.
    unsafe { ffi::tdr_tensor_identity(t.as_ptr() as *mut _) }
}

/// How many handles hold the tensor object behind `t`, `t` included (its shallow clones,
/// the autograd graph's saved references): 1 when `t` is the last.
///
/// ```
/// let t = tch::Tensor::zeros([2], tch::kind::FLOAT_CPU);
/// let n = tch_dist_runtime::fsdp::tensor_use_count(&t);
/// let alias = t.shallow_clone();
/// assert_eq!(tch_dist_runtime::fsdp::tensor_use_count(&t), n + 1);
/// # drop(alias);
/// ```
pub fn tensor_use_count(t: &Tensor) -> usize {
    // SAFETY: a live tensor; reads a reference count.
    unsafe { ffi::tdr_tensor_use_count(t.as_ptr() as *mut _) }
}

/// The version counter of the tensor behind `t` (every in-place change through it bumps it).
pub(crate) fn tensor_version(t: &Tensor) -> u64 {
    // SAFETY: a live tensor; the shim catches everything.
    unsafe { ffi::tdr_tensor_version(t.as_ptr() as *mut _) }
}
