//! Plan validation: every check [`shard_module`](super::shard_module) makes before it changes
//! anything, so that a refused plan leaves the model as it was.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::HookError;
use tch_dist_core::sharding::ShardingSpec;
use tch_dist_core::{ModuleKey, Shardable};
use tch_dist_runtime::{ArgumentError, ProcessGroup};

use super::error::{PlanProblem, ShardError, ShardProblem};
use super::plan::{PlanEntry, ShardingPlan};
use super::sharder::{sharder_for_weight_spec, ChunkedLinear, Sharder};

/// What one plan key shards.
pub(super) enum Target {
    /// A linear layer whose weight has a spec.
    Linear(ChunkedLinear),
    /// A module with a sharder.
    Sharder(Arc<dyn Sharder>),
}

impl Target {
    /// Whether the module's output is split across ranks (by output features).
    fn splits_output(&self) -> bool {
        match self {
            Target::Linear(c) => c.colwise,
            Target::Sharder(s) => s.splits_output(),
        }
    }

    /// Whether the pieces train on every rank's inputs ([`Sharder::trained_on_every_rank`]).
    pub fn trained_on_every_rank(&self) -> bool {
        match self {
            Target::Linear(_) => false,
            Target::Sharder(s) => s.trained_on_every_rank(),
        }
    }

    /// Whether the module must be called through its hooks ([`Sharder::needs_hooks`]).
    pub fn needs_hooks(&self) -> bool {
        match self {
            Target::Linear(_) => true,
            Target::Sharder(s) => s.needs_hooks(),
        }
    }

    /// Whether the target lays out the module's inputs or outputs only, leaving its
    /// submodules to other entries ([`Sharder::owns_subtree`] false).
    pub fn prepares(&self) -> bool {
        match self {
            Target::Linear(_) => false,
            Target::Sharder(s) => !s.owns_subtree(),
        }
    }
}

/// Checks the whole plan against `module` and `group`; returns the module FQN → target
/// list, in plan order.
pub(super) fn validate<M: Shardable + ?Sized>(
    module: &M,
    plan: &ShardingPlan,
    src_rank: usize,
    group: &ProcessGroup,
) -> Result<Vec<(String, Target)>, ShardError> {
    let world = group.world_size();
    let err = |fqn: &str, problem: PlanProblem| ShardError::plan(group, fqn, problem);
    if src_rank >= world {
        let problem = Box::new(ArgumentError::RankNotInGroup {
            what: "src_rank",
            rank: src_rank,
            world_size: world,
        });
        return Err(ShardProblem::InvalidArgument { problem }.on(group.rank()));
    }
    let modules: BTreeMap<String, &dyn Shardable> = module.named_modules().into_iter().collect();
    let params: BTreeMap<String, &Tensor> = module.named_parameters().into_iter().collect();
    let mut targets: Vec<(String, Target)> = Vec::new();
    for (key, entry) in &plan.plan {
        let target = match entry {
            PlanEntry::Spec(spec) => {
                let Some(param) = params.get(key) else {
                    return Err(err(
                        key,
                        if modules.contains_key(key) {
                            PlanProblem::SpecOnModule
                        } else {
                            PlanProblem::NotAParameter
                        },
                    ));
                };
                spec.validate_for_world(world)
                    .map_err(|e| err(key, PlanProblem::Placements { source: e.into() }))?;
                let shape = param.size();
                spec.shards_metadata(&shape).map_err(|e| {
                    err(
                        key,
                        PlanProblem::SpecShape {
                            shape,
                            source: e.into(),
                        },
                    )
                })?;
                let (parent, leaf) = key.rsplit_once('.').unwrap_or(("", key.as_str()));
                if leaf != "weight" {
                    let name = leaf.to_string();
                    return Err(err(key, PlanProblem::NotAWeight { name }));
                }
                let chunked = sharder_for_weight_spec(spec).map_err(|p| err(key, p))?;
                let Some(layer) = modules.get(parent) else {
                    let module = parent.to_string();
                    return Err(err(key, PlanProblem::NoParentModule { module }));
                };
                chunked.check(*layer, group).map_err(|source| {
                    let module = parent.to_string();
                    err(key, PlanProblem::Layer { module, source })
                })?;
                (parent.to_string(), Target::Linear(chunked))
            }
            PlanEntry::Sharder(sharder) => {
                let Some(m) = modules.get(key) else {
                    return Err(err(
                        key,
                        if params.contains_key(key) {
                            PlanProblem::SharderOnParameter
                        } else {
                            PlanProblem::NotAModule
                        },
                    ));
                };
                sharder.check(key, *m, group).map_err(|source| {
                    let sharder = sharder.name();
                    err(key, PlanProblem::Sharder { sharder, source })
                })?;
                (key.clone(), Target::Sharder(Arc::clone(sharder)))
            }
        };
        targets.push(target);
    }
    // A sharder owns its whole subtree: no other entry may reach into it.
    for (key, entry) in &plan.plan {
        for (owner, owner_entry) in &plan.plan {
            let PlanEntry::Sharder(sharder) = owner_entry else {
                continue;
            };
            if !sharder.owns_subtree() {
                continue; // it lays out the module's inputs or outputs only
            }
            let inside =
                key != owner && (owner.is_empty() || key.starts_with(&format!("{owner}.")));
            if inside {
                let (owner, sharder) = (owner.clone(), sharder.name());
                return Err(err(
                    key,
                    match entry {
                        PlanEntry::Spec(_) => PlanProblem::SpecInsideSharder { owner, sharder },
                        PlanEntry::Sharder(_) => {
                            PlanProblem::SharderInsideSharder { owner, sharder }
                        }
                    },
                ));
            }
        }
    }
    let mut seen = BTreeSet::new();
    for (fqn, _) in &targets {
        if !seen.insert(fqn.as_str()) {
            return Err(err(fqn, PlanProblem::ShardedTwice));
        }
    }
    for (key, spec) in &plan.output_plan {
        if !modules.contains_key(key) {
            return Err(err(key, PlanProblem::OutputNotAModule));
        }
        let ShardingSpec::Chunk(chunk) = spec else {
            return Err(err(key, PlanProblem::OutputNotChunk));
        };
        spec.validate_for_world(world)
            .map_err(|e| err(key, PlanProblem::OutputPlacements { source: e.into() }))?;
        let in_rank_order = chunk.placements.len() == world
            && chunk
                .placements
                .iter()
                .enumerate()
                .all(|(i, p)| p.rank() == i);
        if !in_rank_order {
            let placements = chunk.placements.clone();
            return Err(err(
                key,
                PlanProblem::OutputChunkOrder {
                    placements,
                    world_size: world,
                },
            ));
        }
    }
    for key in &plan.return_local_tensor {
        if !modules.contains_key(key) {
            return Err(err(key, PlanProblem::LocalNotAModule));
        }
        let split = targets
            .iter()
            .any(|(fqn, t)| fqn == key && t.splits_output());
        if !split && !plan.output_plan.contains_key(key) {
            return Err(err(key, PlanProblem::LocalNotSharded));
        }
    }
    // Every module that gets a hook can be told apart from others.
    let hooked = targets
        .iter()
        .map(|(fqn, _)| fqn)
        .chain(&plan.return_local_tensor);
    for fqn in hooked {
        let m = modules[fqn.as_str()];
        if ModuleKey::of(m).is_none() {
            let source = HookError::NoIdentity {
                module: m.type_name(),
            };
            return Err(err(fqn, PlanProblem::Unhookable { source }));
        }
    }
    Ok(targets)
}
