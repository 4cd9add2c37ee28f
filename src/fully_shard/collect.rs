//! What one `fully_shard` call manages: the parameters of its module that no nested
//! `fully_shard` call took and that `ignored_params` does not name, less those `shard_module`
//! sharded over the same ranks (tensor parallelism beside data parallelism on one group);
//! one it sharded over an orthogonal group (a mesh's `tp` dim beside fully_shard's `dp`) is
//! managed as the piece it is (FSDP x TP); and what makes the call refuse (found here,
//! reported on every rank together).

use std::collections::HashMap;
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::path::is_within;
use tch_dist_core::{registry, Shardable};
use tch_dist_runtime::fsdp::tensor_identity;

use super::{fully_shard_state as state, FsdpError, FsdpProblem, FsdpState};
use crate::state_dict::managed::{managed_by, ManagingApi};
use crate::{Api, Composition, OnRank};

/// What [`collect`] found.
pub(super) struct Collected {
    /// The parameters this call manages, in walk order, tied ones once.
    pub params: Vec<(String, Tensor)>,
    /// The states of the nearest nested `fully_shard` modules, with their FQNs.
    pub nested: Vec<(String, Arc<FsdpState>)>,
    /// The first problem, if any.
    pub problem: Option<FsdpError>,
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

/// Where one fully_shard call runs: the global ranks it averages over (where rank 0's
/// values come from), this rank within them and in the world, and the world's size.
pub(super) struct Ranks<'a> {
    pub ranks: &'a [usize],
    pub rank: usize,
    pub global: usize,
    pub world: usize,
}

/// The parameters `module` would manage with `ignored_params` over `at`'s ranks.
pub(super) fn collect(module: &dyn Shardable, ignored_params: &[String], at: Ranks) -> Collected {
    let Ranks {
        ranks,
        rank,
        global,
        world,
    } = at;
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
            problem = Some(FsdpError::from(OnRank::new(
                rank,
                Composition::ReplicatedInside {
                    api: Api::FullyShard,
                    module: prefix,
                },
            )));
        }
    }
    let all = module.named_parameters();
    if problem.is_none()
        && let Some(name) = ignored_params
            .iter()
            .find(|i| !all.iter().any(|(f, _)| is_within(f, i)))
    {
        problem = Some(FsdpProblem::UnknownIgnoredParam { name: name.clone() }.on(rank));
    }
    let mut seen: HashMap<u64, String> = HashMap::new();
    let mut params = Vec::new();
    for (fqn, t) in all {
        if nested.iter().any(|(p, _)| is_within(&fqn, p))
            || ignored_params.iter().any(|i| is_within(&fqn, i))
        {
            continue;
        }
        let id = tensor_identity(t);
        // Split by a MoE layer's expert parallelism, or by a shard_module call on this
        // module or one enclosing it, or both (expert x tensor parallelism): each split
        // over the same ranks or overlapping ones decides, an orthogonal one lets the
        // parameter be sharded further.
        let splits = [
            (ManagingApi::ExpertParallel, true),
            (ManagingApi::ShardModule, false),
        ]
        .into_iter()
        .filter_map(|(api, experts)| managed_by(id, api).map(|m| (m, experts)));
        let mut left = false;
        for (tp, experts) in splits {
            let tp_ranks = &*tp.ranks;
            match tensor_parallel(tp_ranks, ranks, global) {
                // Beside tensor parallelism on one group of every rank, or experts split
                // over these very ranks (each rank's own experts, trained on every rank's
                // tokens): left to it.
                TensorParallel::SameRanks if experts || ranks.len() == world => {}
                TensorParallel::SameRanks => {
                    problem.get_or_insert(FsdpError::from(OnRank::new(
                        rank,
                        Composition::TensorParallelDim {
                            api: Api::FullyShard,
                            fqn: fqn.clone(),
                            ranks: ranks.to_vec(),
                        },
                    )));
                }
                TensorParallel::Orthogonal => continue,
                TensorParallel::Overlapping => {
                    problem.get_or_insert(FsdpError::from(OnRank::new(
                        rank,
                        Composition::TensorParallelRanks {
                            api: Api::FullyShard,
                            fqn: fqn.clone(),
                            tp_ranks: tp_ranks.to_vec(),
                            ranks: ranks.to_vec(),
                        },
                    )));
                }
            }
            left = true;
            break;
        }
        if left {
            continue;
        }
        if let Some(other) = managed_by(id, ManagingApi::FullyShard) {
            problem.get_or_insert(
                FsdpProblem::TiedParameter {
                    fqn: fqn.clone(),
                    other: other.fqn,
                }
                .on(rank),
            );
            continue;
        }
        if seen.contains_key(&id) {
            // Tied within this call: managed once, under its first name.
            continue;
        }
        if !t.is_contiguous() {
            problem.get_or_insert(FsdpProblem::NonContiguous { fqn: fqn.clone() }.on(rank));
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
