//! What a replicate call manages: the parameters and buffers the derive form finds by
//! walking the module ([`in_module`]), with what `ignored_modules` and `ignored_params`
//! leave out; the wrapper form finds its own in the `VarStore` (`wrap.rs`). Either way the
//! result is a [`Found`] for [`set_up`](super::state::set_up).

use tch::Tensor;
use tch_dist_core::{registry, ModuleKey, ModuleVisitor, Shardable};
use tch_dist_runtime::fsdp::tensor_identity;
use tch_dist_runtime::{default_group, ProcessGroup};

use super::{Options, ReplicateError, ReplicateProblem};
use crate::state_dict::managed::{managed_by, ManagingApi};
use crate::{Api, Composition, OnRank};

/// Whether `ignored` names `fqn`: the FQN itself, or a module prefix of it.
pub(super) fn is_ignored(fqn: &str, ignored: &[String]) -> bool {
    ignored.iter().any(|i| {
        fqn == i
            || (fqn.len() > i.len()
                && fqn.starts_with(i.as_str())
                && fqn.as_bytes()[i.len()] == b'.')
    })
}

/// The first entry of `ignored` that names none of `fqns`.
pub(super) fn unknown_ignored<'a>(ignored: &'a [String], fqns: &[String]) -> Option<&'a String> {
    ignored
        .iter()
        .find(|i| !fqns.iter().any(|f| is_ignored(f, std::slice::from_ref(*i))))
}

/// The group `opts` names, or the default group.
pub(super) fn group_of(opts: &Options) -> Result<ProcessGroup, ReplicateError> {
    let Some(mesh) = &opts.device_mesh else {
        return Ok(match &opts.process_group {
            Some(g) => g.clone(),
            None => default_group()?,
        });
    };
    match (mesh.get_all_groups().as_slice(), &opts.process_group) {
        ([group], None) => Ok((*group).clone()),
        (_, group) => {
            let problem = match group {
                Some(_) => ReplicateProblem::MeshAndGroup,
                None => ReplicateProblem::MeshDims { ndim: mesh.ndim() },
            };
            Err(problem.on(default_group()?.rank()))
        }
    }
}

/// Collects the parameters replicate manages: requires-grad parameters outside ignored
/// modules, outside submodules managed by `fully_shard`, and not sharded by `shard_module`.
struct ParamCollector<'a> {
    ignored: &'a [ModuleKey],
    /// `Options::ignored_params`.
    ignored_params: &'a [String],
    /// Every parameter and buffer FQN walked (what `ignored_params` may name).
    seen: Vec<String>,
    path: Vec<String>,
    /// Depth at which a skipped subtree started.
    skip_from: Option<usize>,
    params: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
}

impl<'a> ParamCollector<'a> {
    fn fqn(&self, leaf: &str) -> String {
        let mut parts: Vec<&str> = self.path.iter().map(String::as_str).collect();
        parts.push(leaf);
        parts.retain(|p| !p.is_empty());
        parts.join(".")
    }
}

impl<'m> ModuleVisitor<'m> for ParamCollector<'_> {
    fn enter_module(&mut self, name: &str, module: &'m dyn Shardable) {
        self.path.push(name.to_string());
        if self.skip_from.is_none() {
            let ignored = ModuleKey::of(module).is_some_and(|k| self.ignored.contains(&k));
            if ignored || registry(module).contains(&"fully_shard") {
                self.skip_from = Some(self.path.len());
            }
        }
    }

    fn exit_module(&mut self, _name: &str) {
        if self.skip_from == Some(self.path.len()) {
            self.skip_from = None;
        }
        self.path.pop();
    }

    fn visit_param(&mut self, name: &str, tensor: &'m Tensor) {
        let fqn = self.fqn(name);
        self.seen.push(fqn.clone());
        if self.skip_from.is_none()
            && tensor.requires_grad()
            && !tensor_parallel(tensor)
            && !is_ignored(&fqn, self.ignored_params)
        {
            self.params.push((fqn, tensor.shallow_clone()));
        }
    }

    fn visit_buffer(&mut self, name: &str, tensor: &'m Tensor) {
        let fqn = self.fqn(name);
        self.seen.push(fqn.clone());
        if self.skip_from.is_none() && !is_ignored(&fqn, self.ignored_params) {
            self.buffers.push((fqn, tensor.shallow_clone()));
        }
    }
}

/// What a form found in its model, for [`set_up`](super::state::set_up).
pub(super) struct Found {
    /// Requires-grad parameters replicate manages, in registration order.
    pub params: Vec<(String, Tensor)>,
    /// Buffers replicate broadcasts, in an order that is the same on every rank.
    pub buffers: Vec<(String, Tensor)>,
    /// A problem only this form can see (checked with the others, on every rank at once).
    pub problem: Option<ReplicateError>,
}

/// What replicate manages in `module` (the derive form): requires-grad parameters and
/// buffers in walk order, outside `ignored_modules`, outside children registered with
/// `fully_shard`, without `ignored_params` and the parameters `shard_module` sharded; an
/// `ignored_params` entry that names nothing is its problem.
pub(super) fn in_module<M: Shardable + ?Sized>(module: &M, opts: &Options, rank: usize) -> Found {
    // The root itself may be ignored (then nothing is managed), like PyTorch.
    let root_ignored = ModuleKey::of(module).is_some_and(|k| opts.ignored_modules.contains(&k));
    let mut c = ParamCollector {
        ignored: &opts.ignored_modules,
        ignored_params: &opts.ignored_params,
        path: Vec::new(),
        skip_from: root_ignored.then_some(0),
        seen: Vec::new(),
        params: Vec::new(),
        buffers: Vec::new(),
    };
    module.visit(&mut c);
    let problem = unknown_ignored(&opts.ignored_params, &c.seen)
        .map(|name| ReplicateProblem::UnknownIgnoredParam { name: name.clone() }.on(rank));
    Found {
        params: c.params,
        buffers: c.buffers,
        problem,
    }
}

/// Whether a `shard_module` call (on this module or one enclosing it) split `t`: replicate
/// leaves tensor-parallel parameters out of its buckets.
fn tensor_parallel(t: &Tensor) -> bool {
    split_by(t).is_some()
}

/// Who split `t` along a group: a MoE layer's expert parallelism (first: experts also
/// split over a tensor-parallel group are averaged as their expert-parallel ranks say), or
/// tensor parallelism (both leave a piece per rank whose gradient is that rank's own).
fn split_by(t: &Tensor) -> Option<crate::state_dict::managed::Managed> {
    let id = tensor_identity(t);
    managed_by(id, ManagingApi::ExpertParallel).or_else(|| managed_by(id, ManagingApi::ShardModule))
}

/// Refuses a parameter `shard_module` sharded over other ranks than `group`, by its FQN
/// (the first in walk order): left out of replicate's buckets, its gradient would not be
/// averaged over them.
pub(super) fn tensor_parallel_elsewhere<M: Shardable + ?Sized>(
    module: &M,
    group: &ProcessGroup,
) -> Result<(), ReplicateError> {
    let ranks = group.global_ranks();
    for (fqn, t) in module.named_parameters() {
        if let Some(tp) = split_by(t)
            && &*tp.ranks != ranks
        {
            return Err(ReplicateError::from(OnRank::new(
                group.rank(),
                Composition::TensorParallelRanks {
                    api: Api::Replicate,
                    fqn,
                    tp_ranks: tp.ranks.to_vec(),
                    ranks: ranks.to_vec(),
                },
            )));
        }
    }
    Ok(())
}
