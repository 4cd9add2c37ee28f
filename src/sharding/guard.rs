//! The bypass check: a module [`shard_module`](super::shard_module) hooked computes the
//! unsharded module's result only through its hooks, so using its parameters outside a call
//! through them (`x.apply(&self.fc1)`, `self.fc1.forward(&x)`) is an error.
//!
//! Each hooked module gets a [`UseGuard`] over its parameters (those of its subtree that no
//! hooked descendant owns) and a [call scope](tch_dist_core::hooks::CallScope) that claims
//! the autograd nodes its hooked calls make. The module passed to `shard_module` gets a
//! second scope that checks, when it is called with `call`, that every use of a guarded
//! parameter in its output's graph was claimed: a bypass fails the forward, as a
//! [`ShardError::HooksBypassed`]. Whatever that check cannot see (the model's root called
//! with `forward`, a use outside it) fails the backward pass with the same message, before
//! any guarded parameter gets a gradient, so no optimizer step applies a wrong gradient.
//!
//! Autograd sees nothing under `no_grad`, so each hooked module's parameters (all of them,
//! frozen ones too) are also behind a [`ShardFence`], armed for good (they always hold
//! their shards) and open on a thread only inside a hooked call of their module: while the
//! sharded root's call runs, an op that uses one elsewhere is refused inside the op, in
//! every grad mode, and [`Guard`] makes that the root's `f_call` error.

use std::collections::BTreeMap;
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::{
    register_call_guard, register_call_scope, CallGuard, CallScope, ForwardError, RemovableHandle,
};
use tch_dist_core::path::join_fqn;
use tch_dist_core::Shardable;
use tch_dist_runtime::{
    autograd_mark, check_enter, check_exit, take_fence_hit, DistError, FenceOwner, ProcessGroup,
    ShardFence, UseGuard,
};

use super::error::{ForwardProblem, HookSite, PlanProblem, ShardError};

/// One hooked module's guard.
#[derive(Clone)]
struct Guarded {
    module: String,
    params: Vec<String>,
    guard: Arc<UseGuard>,
}

/// Guards the parameters of every module in `hooked` (FQNs of `modules`), and checks calls of
/// `root`. Returns the hooks (the scopes) and the guards.
pub(super) fn install(
    root: &dyn Shardable,
    modules: &BTreeMap<String, &dyn Shardable>,
    hooked: &[String],
    group: &ProcessGroup,
) -> Result<(Vec<RemovableHandle>, Vec<Arc<UseGuard>>), ShardError> {
    let rank = group.rank();
    let mut guards: Vec<Guarded> = Vec::new();
    let mut hooks = Vec::new();
    let mut fenced = false;
    register_call_guard(&GUARD);
    for fqn in hooked {
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
        if all_params.is_empty() {
            continue;
        }
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
                move |i: usize| {
                    ShardError::HooksBypassed {
                        rank,
                        module: module.clone(),
                        param: params[i].clone(),
                    }
                    .to_string()
                }
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
        });
        hooks.extend(
            register_call_scope(module, scope).map_err(|source| {
                ShardError::plan(group, fqn, PlanProblem::Unhookable { source })
            })?,
        );
        fenced = true;
        if let Some(guard) = guard {
            guards.push(Guarded {
                module: fqn.clone(),
                params,
                guard,
            });
        }
    }
    if !guards.is_empty() || fenced {
        let check = Arc::new(Check {
            guards: guards.clone(),
            group: group.clone(),
        });
        hooks.extend(
            register_call_scope(root, check).map_err(|source| {
                ShardError::plan(group, "", PlanProblem::Unhookable { source })
            })?,
        );
    }
    Ok((hooks, guards.into_iter().map(|g| g.guard).collect()))
}

/// Whether `fqn` is `ancestor` or inside it.
fn is_within(fqn: &str, ancestor: &str) -> bool {
    ancestor.is_empty()
        || fqn == ancestor
        || fqn
            .strip_prefix(ancestor)
            .is_some_and(|rest| rest.starts_with('.'))
}

/// An engine failure of the check itself (not expected) as a hook error.
fn engine_error(group: &ProcessGroup, fqn: &str, e: DistError) -> ForwardError {
    let problem = ForwardProblem::Collective(e);
    ForwardError::from_error(ShardError::forward(group, fqn, HookSite::Output, problem))
}

/// Opens the module's fence on this thread for each of its hooked calls, and claims the
/// uses the call made (for the guard, when some parameters require grad).
struct Claim {
    guard: Option<Arc<UseGuard>>,
    fence: ShardFence,
    group: ProcessGroup,
    fqn: String,
}

impl CallScope for Claim {
    fn enter(&self, _module: &dyn Shardable, _inputs: &[Tensor]) -> Result<u64, ForwardError> {
        self.fence.open();
        Ok(autograd_mark())
    }

    /// Claims the uses behind every output of the call.
    fn exit(&self, _m: &dyn Shardable, outputs: &[Tensor], mark: u64) -> Result<(), ForwardError> {
        self.fence.close();
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
        // call is refused, in every grad mode.
        check_enter();
        Ok(autograd_mark())
    }

    /// Checks the graph of every output of the call.
    fn exit(&self, _m: &dyn Shardable, outputs: &[Tensor], mark: u64) -> Result<(), ForwardError> {
        check_exit();
        let guards: Vec<&UseGuard> = self.guards.iter().map(|g| &*g.guard).collect();
        for output in outputs {
            let found = UseGuard::first_unclaimed(&guards, output, mark)
                .map_err(|e| engine_error(&self.group, "", e))?;
            if let Some((i, j)) = found {
                return Err(ForwardError::from_error(ShardError::HooksBypassed {
                    rank: self.group.rank(),
                    module: self.guards[i].module.clone(),
                    param: self.guards[i].params[j].clone(),
                }));
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
        ShardError::HooksBypassed {
            rank: self.rank,
            module: self.module.clone(),
            param: self.params.get(index).cloned().unwrap_or_default(),
        }
    }
}

impl FenceOwner for FenceNames {
    fn refusal(&self, index: usize) -> String {
        self.bypassed(index).to_string()
    }
}

/// shard_module's [`CallGuard`]: a fence's refusal (an op of a bypassed sharded module)
/// becomes [`ShardError::HooksBypassed`], the error of the hooked call around it.
struct Guard;

static GUARD: Guard = Guard;

impl CallGuard for Guard {
    fn refusal(&self) -> Option<ForwardError> {
        let (names, index) = take_fence_hit::<FenceNames>()?;
        Some(ForwardError::from_error(names.bypassed(index)))
    }

    fn outermost_call_ended(&self) {}
}
