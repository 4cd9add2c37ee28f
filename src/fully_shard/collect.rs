//! What one `fully_shard` call manages: the parameters of its module that no nested
//! `fully_shard` call took and that `ignored_params` does not name, less those `shard_module`
//! sharded over the same ranks (tensor parallelism beside data parallelism on one group);
//! one it sharded over an orthogonal group (a mesh's `tp` dim beside fully_shard's `dp`) is
//! managed as the piece it is (FSDP x TP); and what makes the call refuse (found here,
//! reported on every rank together).

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

/// How a parameter `shard_module` sharded over `tp_ranks` stands to a fully_shard call over
/// `ranks` (global ranks, this rank `me` in both).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum TensorParallel {
    /// The same ranks: each holds its piece's whole gradient; left to shard_module.
    SameRanks,
    /// Only this rank in common (a mesh's `tp` dim beside fully_shard's `dp`): the piece is
    /// sharded further (FSDP x TP).
    Orthogonal,
    /// Anything else: no layout both APIs can keep.
    Overlapping,
}

pub(super) fn tensor_parallel(tp_ranks: &[usize], ranks: &[usize], me: usize) -> TensorParallel {
    if tp_ranks == ranks {
        TensorParallel::SameRanks
    } else if tp_ranks.iter().all(|r| *r == me || !ranks.contains(r)) {
        TensorParallel::Orthogonal
    } else {
        TensorParallel::Overlapping
    }
}

/// The parameters `module` would manage with `ignored_params` over the global ranks `ranks`
/// (where rank 0's values come from and what the gradients are averaged over), on `rank`
/// (within those ranks; `global` in the world).
pub(super) fn collect(
    module: &dyn Shardable,
    ignored_params: &[String],
    ranks: &[usize],
    (rank, global): (usize, usize),
) -> Collected {
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
            || ignored_params.iter().any(|i| is_within(&fqn, i))
        {
            continue;
        }
        if let Some(tp) = sharded.get(&fqn) {
            let tp_ranks = tp.state.group().global_ranks();
            match tensor_parallel(tp_ranks, ranks, global) {
                TensorParallel::SameRanks => continue,
                TensorParallel::Orthogonal => {}
                TensorParallel::Overlapping => {
                    problem.get_or_insert(FsdpError::TensorParallelRanks {
                        rank,
                        fqn: fqn.clone(),
                        tp_ranks: tp_ranks.to_vec(),
                        ranks: ranks.to_vec(),
                    });
                    continue;
                }
            }
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
