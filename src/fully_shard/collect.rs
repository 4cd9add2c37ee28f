//! What one `fully_shard` call manages: the parameters of its module that no nested
//! `fully_shard` call took, that `shard_module` did not shard and that `ignored_params` does
//! not name; and what makes the call refuse (found here, reported on every rank together).

use std::collections::HashMap;
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::{registry, Shardable};
use tch_dist_runtime::fsdp::tensor_identity;

use super::{fully_shard_state as state, managed_identities, FsdpError, FsdpState};

/// What [`collect`] found.
pub(super) struct Collected {
    /// The parameters this call manages, in walk order, tied ones once.
    pub params: Vec<(String, Tensor)>,
    /// The states of the nearest nested `fully_shard` modules, with their FQNs.
    pub nested: Vec<(String, Arc<FsdpState>)>,
    /// The first problem, if any.
    pub problem: Option<FsdpError>,
}

/// Whether `fqn` is `prefix` or inside the module at `prefix`.
pub(super) fn is_within(fqn: &str, prefix: &str) -> bool {
    prefix.is_empty()
        || fqn == prefix
        || fqn
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
}

/// The parameters `module` would manage with `ignored_params`, on `rank`.
pub(super) fn collect(module: &dyn Shardable, ignored_params: &[String], rank: usize) -> Collected {
    let mut nested: Vec<(String, Arc<FsdpState>)> = Vec::new();
    let mut problem: Option<FsdpError> = None;
    for (prefix, m) in module.named_modules().into_iter().skip(1) {
        if nested.iter().any(|(p, _)| is_within(&prefix, p)) {
            continue;
        }
        if let Some(s) = state(m) {
            nested.push((prefix, s));
            continue;
        }
        if problem.is_none() && registry(m).contains(&"replicate") {
            problem = Some(FsdpError::ReplicatedInside {
                rank,
                module: prefix,
            });
        }
    }
    let sharded = crate::sharding::sharded_params_in(module);
    let all = module.named_parameters();
    if problem.is_none() {
        if let Some(name) = ignored_params
            .iter()
            .find(|i| !all.iter().any(|(f, _)| is_within(f, i)))
        {
            problem = Some(FsdpError::UnknownIgnoredParam {
                rank,
                name: name.clone(),
            });
        }
    }
    let managed = managed_identities();
    let mut seen: HashMap<u64, String> = HashMap::new();
    let mut params = Vec::new();
    for (fqn, t) in all {
        if nested.iter().any(|(p, _)| is_within(&fqn, p))
            || sharded.contains_key(&fqn)
            || ignored_params.iter().any(|i| is_within(&fqn, i))
        {
            continue;
        }
        let id = tensor_identity(t);
        if let Some(other) = managed.get(&id) {
            problem.get_or_insert(FsdpError::TiedParameter {
                rank,
                fqn: fqn.clone(),
                other: other.clone(),
            });
            continue;
        }
        if seen.contains_key(&id) {
            // Tied within this call: managed once, under its first name.
            continue;
        }
        if !t.is_contiguous() {
            problem.get_or_insert(FsdpError::NonContiguous {
                rank,
                fqn: fqn.clone(),
            });
        }
        seen.insert(id, fqn.clone());
        params.push((fqn, t.shallow_clone()));
    }
    Collected {
        params,
        nested,
        problem,
    }
}
