//! Shard fences: the parameters an API keeps as this rank's shard may only be used by ops
//! inside the hooked calls that make them whole (or that compute with the shard correctly).
//!
//! A sharded layer run without its hooks (`x.apply(&layer)`, `layer.forward(&x)`) computes
//! with this rank's shard alone: a wrong value or, for a layer between two others, a shape
//! error inside tch. The [`UseGuard`](crate::UseGuard)s see such a use only in the autograd
//! graph; a fence sees it in every mode, `no_grad` included, at libtorch's dispatcher: while
//! a thread runs a [checked call](check_enter), every op on that thread goes through the
//! shim's fallback first (a boxed kernel on one dispatch key, included in the thread's
//! dispatch set only then), which refuses an op whose tensor arguments include an *armed*
//! parameter (one that holds only its shard now) unless its fence is [open](ShardFence::open)
//! on this thread (inside its own module's hooked call). The refusal is a `c10::Error`
//! inside the op, so tch returns `Err` (`f_` methods) or panics inside the layer's `forward`;
//! the fence's [`FenceOwner`] names the parameter in the message and gets the hit
//! ([`take_fence_hit`]), which the API turns into its typed error at `f_call` (through a
//! [`CallGuard`]).
//!
//! Outside checked calls, the thread that created a fence *watches*: the key stays included
//! and only the ops through which layers apply their weights (`linear`, `matmul`, `t`,
//! `embedding`, convolutions, norms, recurrent cells) are refused on an armed parameter, and
//! never inside a backward pass. That catches a root run with no hooked call at all
//! (`model.forward(&x)` under `no_grad`) — tch then panics inside the layer with the fence's
//! message, or an `f_` op returns it — while the optimizer step, checkpoints and
//! `clip_grad_norm` between steps use the shards freely. The cost is the fallback's lookup
//! on every op of that thread while a fence lives.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::{register_call_guard, CallGuard, ForwardError};

use super::callback::{trampoline, Callback, Reply};
use crate::error::{DistError, Result};
use crate::ffi;

/// What a fence's refusals say, and whom the hits belong to (the API's names for the
/// parameters).
pub trait FenceOwner: Any + Send + Sync {
    /// The message of an op refused for using parameter `index` (which should name the
    /// rank, the API, the parameter's and its module's FQNs and the fix).
    fn refusal(&self, index: usize) -> String;
}

/// A refused op: the owner of the fence and the parameter's position in it.
struct FenceHit {
    owner: Arc<dyn Any + Send + Sync>,
    index: usize,
}

thread_local! {
    /// The last op refused on this thread inside a checked call, until taken or until the
    /// outermost hooked call ends.
    static LAST_HIT: RefCell<Option<FenceHit>> = const { RefCell::new(None) };
    /// This thread's checked calls (as the shim counts them): a refusal outside them (the
    /// watch) is not recorded, since no hooked call ends to take or forget it.
    static CHECKED: Cell<usize> = const { Cell::new(0) };
}

/// The last op a fence refused on this thread, taken if the fence's owner is an `O`: the
/// owner and the parameter's position among the fence's parameters.
pub fn take_fence_hit<O: FenceOwner>() -> Option<(Arc<O>, usize)> {
    LAST_HIT.with(|h| {
        let mut h = h.borrow_mut();
        if !h.as_ref()?.owner.is::<O>() {
            return None;
        }
        let hit = h.take()?;
        let owner = hit.owner.downcast::<O>().ok()?;
        Some((owner, hit.index))
    })
}

/// The fence's callback context: the owner, as both views.
struct FenceContext {
    owner: Arc<dyn FenceOwner>,
    any: Arc<dyn Any + Send + Sync>,
}

/// A fence over the parameters of one module; removed on drop (every parameter disarmed).
pub struct ShardFence {
    ptr: NonNull<ffi::TdrFence>,
    // Boxed, so that its address stays put while the fence lives; only the shim reads it.
    _context: Box<FenceContext>,
    rank: usize,
    op: &'static str,
}

// SAFETY: the shim touches a fence's arming under its own lock, and its open/close only on
// the calling thread's list; the context is Send + Sync.
unsafe impl Send for ShardFence {}
unsafe impl Sync for ShardFence {}

impl std::fmt::Debug for ShardFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardFence").field("op", &self.op).finish()
    }
}

impl Drop for ShardFence {
    fn drop(&mut self) {
        // SAFETY: created by tdr_fence_new, freed once; the context is dropped after this,
        // once the shim (which calls it only under the lock tdr_fence_free takes) is done.
        unsafe { ffi::tdr_fence_free(self.ptr.as_ptr()) }
    }
}

/// Resets this thread's checked calls when the outermost hooked call ends (also when it
/// failed or unwound, so that a failed forward leaves no check behind), and forgets a hit
/// that no call took (an `f_` op's error the forward handled itself).
struct ThreadReset;

impl CallGuard for ThreadReset {
    fn refusal(&self) -> Option<ForwardError> {
        None
    }

    /// A fence's refusal recorded on this thread, whichever API's guard will take it.
    fn refusal_pending(&self) -> bool {
        LAST_HIT.with(|h| h.try_borrow().is_ok_and(|h| h.is_some()))
    }

    fn outermost_call_ended(&self) {
        // A failed or unwound call never ended its managed forwards.
        crate::c10d::step_check::passes::outermost_call_ended();
        // SAFETY: touches only this thread's state.
        unsafe { ffi::tdr_fence_reset_thread() };
        CHECKED.with(|c| c.set(0));
        LAST_HIT.with(|h| h.borrow_mut().take());
    }
}

static THREAD_RESET: ThreadReset = ThreadReset;

impl ShardFence {
    /// A fence over `params` (none armed yet) owned by `owner`; `rank` and `op` name this
    /// process and the API in the errors of the fence's own calls.
    pub fn new<O: FenceOwner>(
        rank: usize,
        op: &'static str,
        params: &[&Tensor],
        owner: Arc<O>,
    ) -> Result<ShardFence> {
        register_call_guard(&THREAD_RESET);
        let context = Box::new(FenceContext {
            owner: Arc::clone(&owner) as Arc<dyn FenceOwner>,
            any: owner,
        });
        let mut raw: Vec<*mut torch_sys::C_tensor> =
            params.iter().map(|p| p.as_ptr() as *mut _).collect();
        let mut out = std::ptr::null_mut();
        // SAFETY: live tensors and out-pointer; the context is boxed and outlives the fence
        // (freed after it in Drop); exceptions are caught in the shim.
        ffi::check(unsafe {
            ffi::tdr_fence_new(
                raw.as_mut_ptr(),
                raw.len(),
                trampoline::<FenceRefusal>,
                &*context as *const FenceContext as *mut c_void,
                &mut out,
            )
        })
        .map_err(|e| failure(rank, op, e.message))?;
        let ptr = NonNull::new(out).ok_or(DistError::Internal {
            rank,
            op,
            what: "the engine returned no fence",
        })?;
        Ok(ShardFence {
            ptr,
            _context: context,
            rank,
            op,
        })
    }

    /// Arms parameter `index` (it holds only its shard now: ops of checked calls that use it
    /// outside its module's call are refused) or disarms it (it is whole).
    pub fn set_armed(&self, index: usize, armed: bool) -> Result<()> {
        // SAFETY: a live fence.
        ffi::check(unsafe { ffi::tdr_fence_set_armed(self.ptr.as_ptr(), index, armed) })
            .map_err(|e| failure(self.rank, self.op, e.message))
    }

    /// Lets this thread use the fence's parameters (a hooked call of its module starts);
    /// [`close`](Self::close) ends it.
    pub fn open(&self) {
        // SAFETY: a live fence; only this thread's list changes.
        unsafe { ffi::tdr_fence_open(self.ptr.as_ptr()) }
    }

    /// Ends the innermost [`open`](Self::open) of this fence on this thread (and every
    /// later one: calls that unwound).
    pub fn close(&self) {
        // SAFETY: as in `open`.
        unsafe { ffi::tdr_fence_close(self.ptr.as_ptr()) }
    }
}

/// A checked call starts on this thread (a hooked call of an API that keeps shards):
/// until the matching [`check_exit`] (or the end of the outermost hooked call), ops using an
/// armed parameter outside its fence are refused.
pub fn check_enter() {
    CHECKED.with(|c| c.set(c.get() + 1));
    // SAFETY: touches only this thread's state.
    unsafe { ffi::tdr_fence_check_enter() }
}

/// The checked call [`check_enter`] started ends.
pub fn check_exit() {
    CHECKED.with(|c| c.set(c.get().saturating_sub(1)));
    // SAFETY: touches only this thread's state.
    unsafe { ffi::tdr_fence_check_exit() }
}

/// Runs `f` with the fences' check off on this thread: a deliberate direct use of shards
/// (a regularizer over them) inside a checked call.
pub fn unfenced<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: touches only this thread's state.
            unsafe { ffi::tdr_fence_suspend(self.0) };
        }
    }
    // SAFETY: touches only this thread's state.
    let _restore = Restore(unsafe { ffi::tdr_fence_suspend(true) });
    f()
}

fn failure(rank: usize, op: &'static str, cause: String) -> DistError {
    DistError::Collective { rank, op, cause }
}

/// The shim's fallback calls it, under its lock, when an op uses parameter `index` outside
/// its call: it records the hit and refuses the op with the owner's message.
struct FenceRefusal;

impl Callback for FenceRefusal {
    type Context = FenceContext;
    const PANIC: &'static str = "a sharded parameter was used outside its module's hooked call \
                                 (and its message panicked)";

    fn run(context: &FenceContext, index: usize, _grad: Option<Tensor>) -> Reply {
        if CHECKED.with(Cell::get) > 0 {
            LAST_HIT.with(|h| {
                *h.borrow_mut() = Some(FenceHit {
                    owner: Arc::clone(&context.any),
                    index,
                })
            });
        }
        Err(context.owner.refusal(index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    struct Other;
    impl FenceOwner for Other {
        fn refusal(&self, _index: usize) -> String {
            String::new()
        }
    }

    struct Names;
    impl FenceOwner for Names {
        fn refusal(&self, index: usize) -> String {
            format!("param {index} used outside its call")
        }
    }

    fn fence(params: &[&Tensor]) -> ShardFence {
        ShardFence::new(0, "test", params, Arc::new(Names)).unwrap()
    }

    #[test]
    fn armed_parameters_are_refused_inside_checked_calls_and_watched_outside() {
        let w = Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu));
        let other = Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu));
        let f = fence(&[&w]);
        let x = Tensor::ones([1, 2], (Kind::Float, tch::Device::Cpu));
        // Not armed, or not checked: free.
        check_enter();
        assert!(x.f_matmul(&w).is_ok());
        check_exit();
        f.set_armed(0, true).unwrap();
        // Outside checked calls (the watch): ops that apply weights are refused, with the
        // owner's message and no hit (no hooked call ends to take it); others pass.
        let err = tch::no_grad(|| x.f_matmul(&w)).unwrap_err().to_string();
        assert!(err.contains("param 0 used outside its call"), "{err}");
        assert!(x.f_linear(&w, None::<&Tensor>).is_err());
        assert!(
            take_fence_hit::<Names>().is_none(),
            "the watch records no hit"
        );
        let mut handle = w.shallow_clone(); // the same tensor object
        assert!(
            tch::no_grad(|| handle.f_add_(&other)).is_ok(),
            "an optimizer's update"
        );
        assert!(w.f_mul(&other).is_ok() && w.f_narrow(0, 0, 1).is_ok());
        assert!(unfenced(|| x.f_matmul(&w)).is_ok());
        // Armed and checked: refused (no_grad too), with the owner's message and a hit.
        check_enter();
        let err = tch::no_grad(|| x.f_matmul(&w)).unwrap_err().to_string();
        assert!(err.contains("param 0 used outside its call"), "{err}");
        assert!(
            take_fence_hit::<Other>().is_none(),
            "another owner's hit stays"
        );
        assert_eq!(take_fence_hit::<Names>().map(|h| h.1), Some(0));
        assert!(take_fence_hit::<Names>().is_none(), "taken");
        // Ops that read no elements pass (the instance table's liveness check).
        assert!(w.f_is_set_to(&w).unwrap());
        assert!(take_fence_hit::<Names>().is_none());
        // In a list argument too.
        assert!(Tensor::f_cat(&[&x, &w], 0).is_err());
        take_fence_hit::<Names>();
        // Other tensors pass; an open fence passes; so does an unfenced use.
        assert!(x.f_matmul(&other).is_ok());
        f.open();
        assert!(x.f_matmul(&w).is_ok());
        f.close();
        assert!(x.f_matmul(&w).is_err());
        take_fence_hit::<Names>();
        assert!(unfenced(|| x.f_matmul(&w)).is_ok());
        assert!(x.f_matmul(&w).is_err(), "the check is back after unfenced");
        take_fence_hit::<Names>();
        // Disarmed: free again; a dropped fence checks nothing.
        f.set_armed(0, false).unwrap();
        assert!(x.f_matmul(&w).is_ok());
        f.set_armed(0, true).unwrap();
        drop(f);
        assert!(x.f_matmul(&w).is_ok());
        check_exit();
        assert!(take_fence_hit::<Names>().is_none());
        assert!(x.f_matmul(&w).is_ok(), "no fence left: nothing watched");
    }

    #[test]
    fn the_watch_lets_backward_use_armed_weights() {
        // A tensor-parallel weight is armed always and used as a shard by its layer's
        // backward; the watch leaves graph tasks alone.
        let w = Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let x = Tensor::ones([1, 2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let f = fence(&[&w]);
        check_enter();
        f.open();
        let y = x.matmul(&w).sum(Kind::Float);
        f.close();
        check_exit();
        f.set_armed(0, true).unwrap();
        assert!(y.f_backward().is_ok());
        assert_eq!(
            Vec::<f32>::try_from(x.grad().view(-1)).unwrap(),
            vec![2.0, 2.0]
        );
        assert!(x.f_matmul(&w).is_err(), "refused again after backward");
    }
}
