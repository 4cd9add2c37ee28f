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

use std::collections::BTreeMap;
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::{register_call_scope, CallScope, ForwardError, RemovableHandle};
use tch_dist_core::path::join_fqn;
use tch_dist_core::Shardable;
use tch_dist_runtime::{autograd_mark, DistError, ProcessGroup, UseGuard};

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
    for fqn in hooked {
        let module = modules[fqn.as_str()];
        let inside_other = |name: &str| {
            let full = join_fqn(fqn, name);
            hooked
                .iter()
                .any(|other| other != fqn && is_within(other, fqn) && is_within(&full, other))
        };
        let (params, tensors): (Vec<String>, Vec<Tensor>) = module
            .named_parameters()
            .into_iter()
            .filter(|(name, t)| t.requires_grad() && !inside_other(name))
            .map(|(name, t)| (join_fqn(fqn, &name), t.shallow_clone()))
            .unzip();
        if params.is_empty() {
            continue;
        }
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
        let guard = Arc::new(guard);
        let scope = Arc::new(Claim {
            guard: Arc::clone(&guard),
            group: group.clone(),
            fqn: fqn.clone(),
        });
        hooks.extend(
            register_call_scope(module, scope).map_err(|source| {
                ShardError::plan(group, fqn, PlanProblem::Unhookable { source })
            })?,
        );
        guards.push(Guarded {
            module: fqn.clone(),
            params,
            guard,
        });
    }
    if !guards.is_empty() {
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

/// Claims the uses a hooked call of one module made.
struct Claim {
    guard: Arc<UseGuard>,
    group: ProcessGroup,
    fqn: String,
}

impl CallScope for Claim {
    fn enter(&self, _module: &dyn Shardable, _inputs: &[Tensor]) -> Result<u64, ForwardError> {
        Ok(autograd_mark())
    }

    /// Claims the uses behind every output of the call.
    fn exit(&self, _m: &dyn Shardable, outputs: &[Tensor], mark: u64) -> Result<(), ForwardError> {
        for output in outputs {
            self.guard
                .claim(output, mark)
                .map_err(|e| engine_error(&self.group, &self.fqn, e))?;
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
        Ok(autograd_mark())
    }

    /// Checks the graph of every output of the call.
    fn exit(&self, _m: &dyn Shardable, outputs: &[Tensor], mark: u64) -> Result<(), ForwardError> {
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
