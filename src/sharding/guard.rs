//! The bypass check: a module [`shard_module`](super::shard_module) hooked computes the
//! unsharded module's result only through its hooks, so using its parameters outside a call
//! through them (`x.apply(&self.fc1)`, `self.fc1.forward(&x)`) is an error.
//!
//! Each hooked module gets a [`UseGuard`] over its parameters (those of its subtree that no
//! hooked descendant owns) and a [call scope](tch_dist_core::hooks::CallScope) that claims
//! the autograd nodes its hooked calls make. The module passed to `shard_module` gets a
//! second scope that checks, when it is called with `call`, that every use of a guarded
//! parameter in its output's graph was claimed: a bypass fails the forward, as a
//! [`Composition::HooksBypassed`](crate::Composition::HooksBypassed). Whatever that check
//! cannot see (the model's root called with `forward`, a use outside it) fails the backward
//! pass with the same message, before any guarded parameter gets a gradient, so no
//! optimizer step applies a wrong gradient.
//!
//! Autograd sees nothing under `no_grad`, so each hooked module's parameters (all of them,
//! frozen ones too) are also behind a [`ShardFence`], armed for good (they always hold
//! their shards) and open on a thread only inside a hooked call of their module: while the
//! sharded root's call runs, an op that uses one elsewhere is refused inside the op, in
//! every grad mode, and [`Guard`] makes that the root's `f_call` error.
//!
//! A module that only lays out its inputs or outputs for its submodules
//! (`PrepareModuleInput`) may own no parameter at all: run without its hooks, its hooked
//! submodules would get the wrong layout. So while the sharded root's call runs, a hooked
//! call of a module inside such a *prepared* module is refused unless a hooked call of the
//! prepared module runs on the thread, in every grad mode. (Outside the root's call, as in
//! a recomputation during backward, it is not checked: only the prepared module's own
//! parameters, if any, are guarded there.)

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::{
    register_call_guard, register_call_scope, CallGuard, CallScope, ForwardError, RemovableHandle,
};
use tch_dist_core::path::{is_within, join_fqn};
use tch_dist_core::Shardable;
use tch_dist_runtime::{
    autograd_mark, check_enter, check_exit, managed_forward_begins, managed_forward_ends,
    take_fence_hit, DistError, FenceOwner, ProcessGroup, ShardFence, UseGuard,
};

use super::error::{ForwardProblem, HookSite, ShardError};

/// One hooked module's guard.
#[derive(Clone)]
struct Guarded {
    module: String,
    params: Vec<String>,
    guard: Arc<UseGuard>,
}

thread_local! {
    /// The sharded roots' checked calls running on this thread.
    static CHECKING: Cell<usize> = const { Cell::new(0) };
    /// The prepared modules (by id) whose hooked calls run on this thread, and how many.
    static OPEN: RefCell<HashMap<u64, usize>> = RefCell::new(HashMap::new());
}

/// Ids of prepared modules, process-wide.
static NEXT_PREPARED: AtomicU64 = AtomicU64::new(1);

/// Guards the parameters of every module in `hooked` (FQNs of `modules`), checks that the
/// hooked modules inside a `prepared` one are called inside its calls, and checks calls of
/// `root`. Returns the hooks (the scopes) and the guards.
pub(super) fn install(
    root: &dyn Shardable,
    modules: &BTreeMap<String, &dyn Shardable>,
    hooked: &[String],
    prepared: &[String],
    group: &ProcessGroup,
) -> Result<(Vec<RemovableHandle>, Vec<Arc<UseGuard>>), ShardError> {
    let rank = group.rank();
    let mut guards: Vec<Guarded> = Vec::new();
    let mut hooks = Vec::new();
    let mut fenced = false;
    register_call_guard(&GUARD);
    let prepared: Vec<(String, u64)> = prepared
        .iter()
        .map(|fqn| (fqn.clone(), NEXT_PREPARED.fetch_add(1, Ordering::Relaxed)))
        .collect();
    for fqn in hooked {
        let opens = prepared.iter().find(|(p, _)| p == fqn).map(|(_, id)| *id);
        let requires: Vec<(String, u64)> = prepared
            .iter()
            .filter(|(p, _)| p != fqn && is_within(fqn, p))
            .cloned()
            .collect();
        let module = modules[fqn.as_str()];
        let inside_other = |name: &str| {
            let full = join_fqn(fqn, name);
            hooked
                .iter()
                .any(|other| other != fqn && is_within(other, fqn) && is_within(&full, other))
        };
        let (all_params, all_tensors): (Vec<String>, Vec<Tensor>) = module
            .named_parameters()
            .into_iter()
            .filter(|(name, _)| !inside_other(name))
            .map(|(name, t)| (join_fqn(fqn, &name), t.shallow_clone()))
            .unzip();
        if all_params.is_empty() && opens.is_none() && requires.is_empty() {
            continue;
        }
        // The parameter a refused call names: the module's first (a descendant's, for a
        // prepared module without parameters of its own).
        let named_param = module
            .named_parameters()
            .first()
            .map_or_else(|| fqn.clone(), |(name, _)| join_fqn(fqn, name));
        let fence = if all_params.is_empty() {
            None
        } else {
            let owner = Arc::new(FenceNames {
                rank,
                module: fqn.clone(),
                params: all_params.clone(),
            });
            let refs: Vec<&Tensor> = all_tensors.iter().collect();
            let fence = ShardFence::new(rank, "shard_module", &refs, owner)
                .map_err(|e| ShardError::dist(group, fqn, e))?;
            for i in 0..refs.len() {
                fence
                    .set_armed(i, true)
                    .map_err(|e| ShardError::dist(group, fqn, e))?;
            }
            fenced = true;
            Some(fence)
        };
        let (params, tensors): (Vec<String>, Vec<Tensor>) = all_params
            .into_iter()
            .zip(all_tensors)
            .filter(|(_, t)| t.requires_grad())
            .unzip();
        let guard = if params.is_empty() {
            None
        } else {
            let message = {
                let (module, params) = (fqn.clone(), params.clone());
                move |i: usize| ShardError::hooks_bypassed(rank, &module, &params[i]).to_string()
            };
            let refs: Vec<&Tensor> = tensors.iter().collect();
            let guard = UseGuard::new(rank, "shard_module", &refs, message)
                .map_err(|e| ShardError::dist(group, fqn, e))?;
            Some(Arc::new(guard))
        };
        // One scope per module: the marks of two scopes on one module would interleave.
        let scope = Arc::new(Claim {
            guard: guard.clone(),
            fence,
            group: group.clone(),
            fqn: fqn.clone(),
            opens,
            requires,
            named_param,
        });
        hooks.extend(
            register_call_scope(module, scope)
                .map_err(|source| ShardError::unhookable(group, fqn, source))?,
        );
        if let Some(guard) = guard {
            guards.push(Guarded {
                module: fqn.clone(),
                params,
                guard,
            });
        }
    }
    if !guards.is_empty() || fenced || !prepared.is_empty() {
        let check = Arc::new(Check {
            guards: guards.clone(),
            group: group.clone(),
        });
        hooks.extend(
            register_call_scope(root, check)
                .map_err(|source| ShardError::unhookable(group, "", source))?,
        );
    }
    Ok((hooks, guards.into_iter().map(|g| g.guard).collect()))
}

/// An engine failure of the check itself (not expected) as a hook error.
fn engine_error(group: &ProcessGroup, fqn: &str, e: DistError) -> ForwardError {
    let problem = ForwardProblem::collective(e);
    ForwardError::from_error(ShardError::forward(group, fqn, HookSite::Output, problem))
}

/// Opens the module's fence on this thread for each of its hooked calls, and claims the
/// uses the call made (for the guard, when some parameters require grad); for a prepared
/// module, counts its calls on the thread; inside prepared modules, checks that a call of
/// each runs.
struct Claim {
    guard: Option<Arc<UseGuard>>,
    fence: Option<ShardFence>,
    group: ProcessGroup,
    fqn: String,
    /// This module's id, when it is a prepared module.
    opens: Option<u64>,
    /// The prepared modules around it (FQN, id).
    requires: Vec<(String, u64)>,
    /// The parameter a refusal names.
    named_param: String,
}

impl CallScope for Claim {
    fn enter(&self, _module: &dyn Shardable, _inputs: &[Tensor]) -> Result<u64, ForwardError> {
        if CHECKING.with(Cell::get) > 0 {
            let closed = self
                .requires
                .iter()
                .find(|(_, id)| OPEN.with(|o| o.borrow().get(id).copied().unwrap_or(0)) == 0);
            if let Some((outer, _)) = closed {
                let (rank, param) = (self.group.rank(), &self.named_param);
                let bypassed = ShardError::hooks_bypassed(rank, outer, param);
                return Err(ForwardError::from_error(bypassed));
            }
        }
        if let Some(id) = self.opens {
            OPEN.with(|o| *o.borrow_mut().entry(id).or_insert(0) += 1);
        }
        if let Some(fence) = &self.fence {
            fence.open();
        }
        // The step check covers the call's collectives as (part of) one forward pass.
        managed_forward_begins();
        Ok(autograd_mark())
    }

    /// Claims the uses behind every output of the call.
    fn exit(&self, _m: &dyn Shardable, outputs: &[Tensor], mark: u64) -> Result<(), ForwardError> {
        managed_forward_ends();
        if let Some(id) = self.opens {
            OPEN.with(|o| {
                let mut open = o.borrow_mut();
                if let Some(n) = open.get_mut(&id) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        open.remove(&id);
                    }
                }
            });
        }
        if let Some(fence) = &self.fence {
            fence.close();
        }
        if let Some(guard) = &self.guard {
            for output in outputs {
                guard
                    .claim(output, mark)
                    .map_err(|e| engine_error(&self.group, &self.fqn, e))?;
            }
        }
        Ok(())
    }
}

/// Checks a call of the sharded root: every use of a guarded parameter in its output's graph
/// was made by a hooked call.
struct Check {
    guards: Vec<Guarded>,
    group: ProcessGroup,
}

impl CallScope for Check {
    fn enter(&self, _module: &dyn Shardable, _inputs: &[Tensor]) -> Result<u64, ForwardError> {
        // From here to `exit`, an op using a sharded parameter outside its module's hooked
        // call is refused, in every grad mode, and so is a call inside a prepared module
        // outside its calls.
        check_enter();
        CHECKING.with(|c| c.set(c.get() + 1));
        // The whole root's call is one forward pass for the step check.
        managed_forward_begins();
        Ok(autograd_mark())
    }

    /// Checks the graph of every output of the call.
    fn exit(&self, _m: &dyn Shardable, outputs: &[Tensor], mark: u64) -> Result<(), ForwardError> {
        managed_forward_ends();
        check_exit();
        CHECKING.with(|c| c.set(c.get().saturating_sub(1)));
        let guards: Vec<&UseGuard> = self.guards.iter().map(|g| &*g.guard).collect();
        for output in outputs {
            let found = UseGuard::first_unclaimed(&guards, output, mark)
                .map_err(|e| engine_error(&self.group, "", e))?;
            if let Some((i, j)) = found {
                let guarded = &self.guards[i];
                let bypassed = ShardError::hooks_bypassed(
                    self.group.rank(),
                    &guarded.module,
                    &guarded.params[j],
                );
                return Err(ForwardError::from_error(bypassed));
            }
        }
        Ok(())
    }
}

/// The names a fence's refusals give: this rank, the hooked module's FQN and its
/// parameters' FQNs (the fence's order).
struct FenceNames {
    rank: usize,
    module: String,
    params: Vec<String>,
}

impl FenceNames {
    fn bypassed(&self, index: usize) -> ShardError {
        let param = self.params.get(index).map_or("", String::as_str);
        ShardError::hooks_bypassed(self.rank, &self.module, param)
    }
}

impl FenceOwner for FenceNames {
    fn refusal(&self, index: usize) -> String {
        self.bypassed(index).to_string()
    }
}

/// shard_module's [`CallGuard`]: a fence's refusal (an op of a bypassed sharded module)
/// becomes [`Composition::HooksBypassed`](crate::Composition::HooksBypassed), the error of
/// the hooked call around it.
struct Guard;

static GUARD: Guard = Guard;

impl CallGuard for Guard {
    fn refusal(&self) -> Option<ForwardError> {
        let (names, index) = take_fence_hit::<FenceNames>()?;
        Some(ForwardError::from_error(names.bypassed(index)))
    }

    /// A failed call may have left its counts behind (its `exit` did not run).
    fn outermost_call_ended(&self) {
        CHECKING.with(|c| c.set(0));
        OPEN.with(|o| o.borrow_mut().clear());
    }
}
