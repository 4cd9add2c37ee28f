//! The backward pass across every fully_shard group: which groups a pass involves, and the
//! one end-of-backward callback that finishes them all (PyTorch's root post-backward final
//! callback).
//!
//! A group joins the coming pass when a forward through it records a graph; the first hook
//! of the pass that fires (a pre-backward hook or an interceptor) queues the callback, which
//! finishes the joined groups in the order they joined (forward order, the same on every
//! rank), so the collectives of groups autograd never reached are issued alike everywhere.
//!
//! The pass is process-wide (one `static`), not PyTorch's per-root `_state_ctx`: groups
//! with no enclosing call (fully_shard on blocks under a `replicate`d root) share one
//! backward pass here, and a per-root context would queue one callback per root (in the
//! order their first hooks fire, not forward order), never queue one for a root autograd
//! did not reach (so its groups would not issue their zero reduce-scatters), and begin the
//! step check's backward pass once per root. Moving to per-root contexts needs those cases
//! decided first.

use std::sync::{Arc, Mutex};

use tch::Tensor;

use super::group::GroupInner;
use super::steps;
use crate::autograd::{self, Callback, Reply};
use crate::error::{DistError, Result};

struct Pass {
    /// The end-of-backward callback is queued for the running pass.
    queued: bool,
    groups: Vec<Arc<GroupInner>>,
    /// Groups with a prefetch started; those still unused at the end of the pass drop it.
    prefetching: Vec<Arc<GroupInner>>,
}

static PASS: Mutex<Pass> = Mutex::new(Pass {
    queued: false,
    groups: Vec::new(),
    prefetching: Vec::new(),
});

fn pass() -> std::sync::MutexGuard<'static, Pass> {
    PASS.lock().unwrap_or_else(|e| e.into_inner())
}

/// `inner` takes part in the next backward pass.
pub(crate) fn join(inner: &Arc<GroupInner>) {
    let mut p = pass();
    if !p.groups.iter().any(|g| Arc::ptr_eq(g, inner)) {
        p.groups.push(Arc::clone(inner));
    }
}

/// The group that joined the pass just before `inner` (whose forward ran just before its
/// own, so whose backward comes next).
pub(crate) fn joined_before(inner: &GroupInner) -> Option<Arc<GroupInner>> {
    let p = pass();
    let i = p.groups.iter().position(|g| std::ptr::eq(&**g, inner))?;
    i.checked_sub(1).map(|j| Arc::clone(&p.groups[j]))
}

/// `inner` started a prefetch.
pub(crate) fn note_prefetch(inner: &Arc<GroupInner>) {
    let mut p = pass();
    if !p.prefetching.iter().any(|g| Arc::ptr_eq(g, inner)) {
        p.prefetching.push(Arc::clone(inner));
    }
}

/// Queues the end-of-backward callback once per pass (called from the pass's hooks).
pub(crate) fn queue_finish(rank: usize) -> Result<()> {
    let mut p = pass();
    if p.queued {
        return Ok(());
    }
    // SAFETY: called from a hook of the running pass; the context is a 'static unit (the
    // callback finds its groups in `PASS`).
    unsafe { autograd::queue_end_of_backward::<FinishAll>(&()) }.map_err(|e| {
        DistError::Collective {
            rank,
            op: "fully_shard",
            cause: e.message,
        }
    })?;
    p.queued = true;
    steps::backward_begins();
    Ok(())
}

/// Finishes every joined group; the first error fails the backward pass.
fn finish_all() -> Result<()> {
    let (groups, prefetching) = {
        let mut p = pass();
        p.queued = false;
        (
            std::mem::take(&mut p.groups),
            std::mem::take(&mut p.prefetching),
        )
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

/// Called by libtorch at the end of the backward pass.
struct FinishAll;

impl Callback for FinishAll {
    type Context = ();
    const PANIC: &'static str = "fully_shard: internal panic at the end of backward";

    fn run(_: &(), _index: usize, _grad: Option<Tensor>) -> Reply {
        finish_all().map_err(|e| e.to_string())
    }
}
