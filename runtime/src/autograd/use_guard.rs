//! Use guards: the parameters of a module an API hooked may only be used, in the autograd
//! graph, by operations made inside a call of that module through its hooks.
//!
//! A sharded layer computes the unsharded layer's result only through its hooks; run
//! without them (`x.apply(&layer)`, `layer.forward(&x)`) it computes with this rank's shard
//! alone. A [`UseGuard`] over the layer's parameters makes that an error: the API takes an
//! [`autograd_mark`] when a hooked call starts and [`claims`](UseGuard::claim) the call's
//! uses from its output when it ends; a backward pass through any other use of a guarded
//! parameter fails, before any guarded gradient is accumulated, with the guard's message,
//! and [`UseGuard::first_unclaimed`] finds such a use in an output's graph during forward.
//!
//! Only uses recorded by autograd are seen: parameters that do not require grad cannot be
//! guarded, and nothing is checked under `no_grad`; inside hooked calls the
//! [shard fences](crate::ShardFence) see those uses too, at the dispatcher.

use std::ffi::c_void;
use std::ptr::NonNull;

use tch::Tensor;

use super::callback::{trampoline, Callback, Reply};
use crate::error::{DistError, Result};
use crate::ffi;

/// Autograd's sequence number on this thread: every autograd node made on this thread after
/// this call is at or after the mark.
pub fn autograd_mark() -> u64 {
    // SAFETY: reads a thread-local counter; no arguments.
    unsafe { ffi::tdr_autograd_mark() }
}

/// What a guard's backward check says about parameter `index`.
struct GuardInner {
    message: Box<dyn Fn(usize) -> String + Send + Sync>,
}

/// A guard over the parameters of one module; removed on drop.
///
/// Drop guards outside of backward passes (like any autograd hook).
pub struct UseGuard {
    ptr: NonNull<ffi::TdrGuard>,
    // The callback's context: boxed, so its address stays put while the guard lives; only
    // the shim reads it (through the pointer it was given).
    _context: Box<GuardInner>,
    rank: usize,
    op: &'static str,
}

// SAFETY: the shim touches a guard only under its own mutex, from any thread; the context is
// Send + Sync.
unsafe impl Send for UseGuard {}
unsafe impl Sync for UseGuard {}

impl std::fmt::Debug for UseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UseGuard").field("op", &self.op).finish()
    }
}

impl Drop for UseGuard {
    fn drop(&mut self) {
        // SAFETY: created by tdr_guard_new, freed exactly once; the context is dropped after
        // this (fields drop after `drop`), once the shim can no longer call into it.
        unsafe { ffi::tdr_guard_free(self.ptr.as_ptr()) }
    }
}

impl UseGuard {
    /// Guards `params` (leaf tensors that require grad). A backward pass through a use of
    /// `params[i]` that no [`claim`](Self::claim) covered fails with `message(i)` (which
    /// should name the rank, the operation, the module, the parameter and the fix); `rank`
    /// and `op` name this process and the API in the errors of the guard's own calls.
    pub fn new(
        rank: usize,
        op: &'static str,
        params: &[&Tensor],
        message: impl Fn(usize) -> String + Send + Sync + 'static,
    ) -> Result<UseGuard> {
        let inner = Box::new(GuardInner {
            message: Box::new(message),
        });
        let mut raw: Vec<*mut torch_sys::C_tensor> =
            params.iter().map(|p| p.as_ptr() as *mut _).collect();
        let mut out = std::ptr::null_mut();
        // SAFETY: live tensors and out-pointer; `inner` is boxed and lives as long as the
        // guard (it is freed after the guard in Drop); exceptions are caught in the shim.
        ffi::check(unsafe {
            ffi::tdr_guard_new(
                raw.as_mut_ptr(),
                raw.len(),
                trampoline::<GuardMessage>,
                &*inner as *const GuardInner as *mut c_void,
                &mut out,
            )
        })
        .map_err(|e| failure(rank, op, e.message))?;
        let ptr = NonNull::new(out).ok_or(DistError::Internal {
            rank,
            op,
            what: "the engine returned no guard",
        })?;
        Ok(UseGuard {
            ptr,
            _context: inner,
            rank,
            op,
        })
    }

    /// Claims the uses of this guard's parameters that `output` depends on and that this
    /// thread made since `mark` (the call's [`autograd_mark`]).
    pub fn claim(&self, output: &Tensor, mark: u64) -> Result<()> {
        // SAFETY: a live guard and tensor.
        ffi::check(unsafe {
            ffi::tdr_guard_claim(self.ptr.as_ptr(), output.as_ptr() as *mut _, mark)
        })
        .map_err(|e| failure(self.rank, self.op, e.message))
    }

    /// Claims the uses of every guard's parameters that `output` depends on and that this
    /// thread made since `mark`: a deliberate direct use (a regularizer over this rank's
    /// shards).
    pub fn claim_any(rank: usize, op: &'static str, output: &Tensor, mark: u64) -> Result<()> {
        // SAFETY: a live tensor; a null guard means every guard.
        ffi::check(unsafe {
            ffi::tdr_guard_claim(std::ptr::null_mut(), output.as_ptr() as *mut _, mark)
        })
        .map_err(|e| failure(rank, op, e.message))
    }

    /// The first unclaimed use of the parameters of `guards` in the graph of `output` made
    /// on this thread since `mark`: `(i, j)` for parameter `j` of `guards[i]` (the guard
    /// first created and its first parameter when there are several), `None` when every
    /// use is claimed. Errors name `guards[0]`'s rank and operation.
    pub fn first_unclaimed(
        guards: &[&UseGuard],
        output: &Tensor,
        mark: u64,
    ) -> Result<Option<(usize, usize)>> {
        let Some(first) = guards.first() else {
            return Ok(None);
        };
        let mut raw: Vec<*mut ffi::TdrGuard> = guards.iter().map(|g| g.ptr.as_ptr()).collect();
        let (mut guard, mut index) = (0usize, 0usize);
        // SAFETY: live guards and tensor; out-pointers to locals.
        ffi::check(unsafe {
            ffi::tdr_guard_first_unclaimed(
                raw.as_mut_ptr(),
                raw.len(),
                output.as_ptr() as *mut _,
                mark,
                &mut guard,
                &mut index,
            )
        })
        .map_err(|e| failure(first.rank, first.op, e.message))?;
        Ok((guard != usize::MAX).then_some((guard, index)))
    }
}

fn failure(rank: usize, op: &'static str, cause: String) -> DistError {
    DistError::Collective { rank, op, cause }
}

/// Called by libtorch when a backward pass goes through an unclaimed use of parameter
/// `index`: the message the pass fails with.
struct GuardMessage;

impl Callback for GuardMessage {
    type Context = GuardInner;
    const PANIC: &'static str = "a guarded parameter was used outside its module's hooked call \
                                 (and its message panicked)";

    fn run(inner: &GuardInner, index: usize, _grad: Option<Tensor>) -> Reply {
        Err((inner.message)(index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    fn leaf(n: i64) -> Tensor {
        Tensor::ones([n, n], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true)
    }

    #[test]
    fn claimed_uses_train_and_others_fail_backward() {
        let w = leaf(2);
        let guard = UseGuard::new(0, "test", &[&w], |i| format!("param {i} used outside")).unwrap();
        let x = Tensor::ones([1, 2], (Kind::Float, tch::Device::Cpu));
        // A claimed use.
        let mark = autograd_mark();
        let y = x.matmul(&w);
        guard.claim(&y, mark).unwrap();
        assert_eq!(
            UseGuard::first_unclaimed(&[&guard], &y, mark).unwrap(),
            None
        );
        y.sum(Kind::Float).backward();
        assert_eq!(w.grad().sum(Kind::Float).double_value(&[]), 4.0);
        // An unclaimed one next to a claimed one.
        let mark = autograd_mark();
        let claimed = x.matmul(&w);
        guard.claim(&claimed, mark).unwrap();
        let unclaimed = x.matmul(&w) * 2.0;
        let total = (&claimed + &unclaimed).sum(Kind::Float);
        assert_eq!(
            UseGuard::first_unclaimed(&[&guard], &total, mark).unwrap(),
            Some((0, 0))
        );
        let before = w.grad().copy();
        let err = total.f_backward().unwrap_err().to_string();
        assert!(err.contains("param 0 used outside"), "{err}");
        assert!(w.grad().equal(&before), "nothing accumulated");
        // A use that does not reach the loss is no use; a removed guard checks nothing.
        let mark = autograd_mark();
        let used = x.matmul(&w);
        guard.claim(&used, mark).unwrap();
        let _unused = x.matmul(&w);
        used.sum(Kind::Float).backward();
        drop(guard);
        x.matmul(&w).sum(Kind::Float).backward();
    }

    #[test]
    fn claim_any_covers_every_guard() {
        let (a, b) = (leaf(2), leaf(2));
        let ga = UseGuard::new(0, "test", &[&a], |_| "a".into()).unwrap();
        let gb = UseGuard::new(0, "test", &[&b], |_| "b".into()).unwrap();
        let mark = autograd_mark();
        let reg = (a.pow_tensor_scalar(2).sum(Kind::Float) + b.sum(Kind::Float)) * 0.1;
        assert_eq!(
            UseGuard::first_unclaimed(&[&gb, &ga], &reg, mark).unwrap(),
            Some((1, 0)),
            "the guard made first is reported"
        );
        UseGuard::claim_any(0, "test", &reg, mark).unwrap();
        assert_eq!(
            UseGuard::first_unclaimed(&[&ga, &gb], &reg, mark).unwrap(),
            None
        );
        reg.backward();
        assert!(a.grad().defined() && b.grad().defined());
    }
}
