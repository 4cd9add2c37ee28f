//! The backward pass of one root's groups (PyTorch's per-root `FSDPState._state_ctx` and
//! its `_root_post_backward_final_callback`): which groups the coming pass involves, which
//! started a prefetch, and the one end-of-backward callback that finishes them all.
//!
//! Every group starts with a context of its own; the call that encloses it (the root: the
//! outermost `fully_shard`, or a `replicate` over fully_shard blocks) hands it the root's
//! ([`FsdpGroup::set_root`](super::FsdpGroup::set_root)), as PyTorch's root shares its
//! `_state_ctx` with every state under it at lazy init. Groups with no enclosing call are
//! roots of their own, each with its own pass and callback, as in PyTorch.
//!
//! A group joins its root's coming pass when a forward through it records a graph; the first
//! hook of the pass that fires (a pre-backward hook or an interceptor) queues the callback,
//! which finishes the joined groups in the order they joined (forward order, the same on
//! every rank), so the collectives of groups autograd never reached are issued alike
//! everywhere.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tch::Tensor;

use super::group::ParamGroup;
use crate::autograd::{self, Callback, Reply};
use crate::c10d::step_check::passes as steps;
use crate::error::{DistError, Result};

#[derive(Default)]
struct Pass {
    /// The end-of-backward callback is queued for the running pass.
    queued: bool,
    groups: Vec<Arc<ParamGroup>>,
    /// Groups with a prefetch started; those still unused at the end of the pass drop it.
    prefetching: Vec<Arc<ParamGroup>>,
}

/// One root's backward pass.
pub(crate) struct PassContext {
    /// Whose settings the step check compares for this root (`is_last_backward`): a number
    /// taken in creation order, the same on every rank that builds the same model.
    pub(crate) settings_owner: u64,
    pass: Mutex<Pass>,
    /// PyTorch's `is_last_backward` (default `true`): the end of a pass that is not the
    /// last keeps the join order (the default backward prefetch's) for the next pass.
    is_last_backward: AtomicBool,
    /// Set when the context first queues its callback: libtorch holds a plain pointer to it
    /// until the callback runs, so from then on the context keeps itself alive (a few bytes
    /// per root that trained; the groups it lists are let go at the end of every pass).
    pinned: OnceLock<Arc<PassContext>>,
}

impl PassContext {
    pub(crate) fn new() -> Arc<PassContext> {
        Arc::new(PassContext {
            settings_owner: super::module::next_settings_owner(),
            pass: Mutex::new(Pass::default()),
            is_last_backward: AtomicBool::new(true),
            pinned: OnceLock::new(),
        })
    }

    pub(crate) fn set_is_last_backward(&self, last: bool) {
        self.is_last_backward.store(last, Ordering::SeqCst);
    }

    fn pass(&self) -> MutexGuard<'_, Pass> {
        self.pass.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `inner` takes part in the next backward pass.
    pub(crate) fn join(&self, inner: &Arc<ParamGroup>) {
        let mut p = self.pass();
        if !p.groups.iter().any(|g| Arc::ptr_eq(g, inner)) {
            p.groups.push(Arc::clone(inner));
        }
    }

    /// The group that joined the pass just before `inner` (whose forward ran just before
    /// its own, so whose backward comes next).
    pub(crate) fn joined_before(&self, inner: &ParamGroup) -> Option<Arc<ParamGroup>> {
        let p = self.pass();
        let i = p.groups.iter().position(|g| std::ptr::eq(&**g, inner))?;
        i.checked_sub(1).map(|j| Arc::clone(&p.groups[j]))
    }

    /// `inner` started a prefetch.
    pub(crate) fn note_prefetch(&self, inner: &Arc<ParamGroup>) {
        let mut p = self.pass();
        if !p.prefetching.iter().any(|g| Arc::ptr_eq(g, inner)) {
            p.prefetching.push(Arc::clone(inner));
        }
    }

    /// Queues the end-of-backward callback once per pass (called from the pass's hooks).
    pub(crate) fn queue_finish(self: &Arc<Self>, rank: usize) -> Result<()> {
        let mut p = self.pass();
        if p.queued {
            return Ok(());
        }
        let pinned = self.pinned.get_or_init(|| Arc::clone(self));
        // SAFETY: called from a hook of the running pass; the context is pinned (never
        // freed) from now on, so it outlives the callback.
        unsafe { autograd::queue_end_of_backward::<FinishAll>(Arc::as_ptr(pinned)) }.map_err(
            |e| DistError::Collective {
                rank,
                op: "fully_shard",
                cause: e.message,
            },
        )?;
        p.queued = true;
        steps::backward_begins();
        Ok(())
    }

    /// Finishes every joined group (each waits for its reductions and installs `.grad`)
    /// and waits out the prefetches nobody used; the first error fails the backward pass.
    /// The last backward pass (PyTorch's `is_last_backward`, the default) also forgets the
    /// join order; another keeps it for the next pass, whose default backward prefetch then
    /// follows the forward order (a later micro-batch's backward after several forwards).
    /// Unused prefetches are not kept (PyTorch keeps them): the shards may change before
    /// a next use (tch's optimizers write through `.data`, which no version check sees).
    fn finish_all(&self) -> Result<()> {
        let last = self.is_last_backward.load(Ordering::SeqCst);
        let (groups, prefetching) = {
            let mut p = self.pass();
            p.queued = false;
            let groups = if last {
                std::mem::take(&mut p.groups)
            } else {
                p.groups.clone()
            };
            (groups, std::mem::take(&mut p.prefetching))
        };
        let mut first = None;
        for g in groups {
            if let Err(e) = g.finish_backward() {
                g.note_failure(&e);
                first.get_or_insert(e);
            }
        }
        for g in prefetching {
            if let Err(e) = g.drop_prefetch() {
                g.note_failure(&e);
                first.get_or_insert(e);
            }
        }
        steps::backward_ends();
        first.map_or(Ok(()), Err)
    }
}

/// Called by libtorch at the end of the backward pass.
struct FinishAll;

impl Callback for FinishAll {
    type Context = PassContext;
    const PANIC: &'static str = "fully_shard: internal panic at the end of backward";

    fn run(ctx: &PassContext, _index: usize, _grad: Option<Tensor>) -> Reply {
        ctx.finish_all().map_err(|e| e.to_string())
    }
}
