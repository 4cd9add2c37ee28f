//! Sequence parallelism's norms (PyTorch's `SequenceParallel`, Korthikanti et al.'s
//! "Reducing Activation Recomputation in Large Transformer Models"): a norm over each
//! token's features runs on this rank's chunk of the sequence with its parameters whole on
//! every rank, so its output is this rank's chunk of the unsharded norm's, with no
//! communication in forward. Each rank's gradient of a parameter then covers its tokens
//! only; the whole gradient is their sum over the tensor-parallel group, which a
//! [`GradientSum`] on each parameter makes before the gradient is accumulated (and before
//! `fully_shard`'s gradient interceptor takes it, when the norm is fully sharded too).
//!
//! Run without its hooks (`x.apply(&norm)`), the norm computes the same values, and the sum
//! is on the parameters, not in a hook of the call: the gradients stay right. So the norm's
//! parameters are not guarded against such uses ([`Sharder::needs_hooks`] is false). Its
//! one hook checks that the input has the sequence dim, and owns the sums: removing the
//! hooks ([`ShardState::remove_hooks`](super::ShardState::remove_hooks)) ends them.

use std::collections::HashSet;
use std::sync::Arc;

use tch_dist_core::hooks::register_fallible_forward_pre_hook;
use tch_dist_core::path::join_fqn;
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::tensor_identity;
use tch_dist_runtime::sharding::GradientSum;
use tch_dist_runtime::ProcessGroup;

use super::error::{
    EngineFailure, EngineProblem, ForwardProblem, HookSite, ShardError, SharderError,
};
use super::sharder::{first_submodule, hook_error, ShardedModule, Sharder};

/// PyTorch's `SequenceParallel` on a norm: the input is this rank's chunk along
/// `sequence_dim`, and so is the output; the parameters stay whole, their gradients summed
/// over the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SequenceParallelNorm {
    pub sequence_dim: i64,
}

/// Why `module` is not a norm over each token's features (no submodules or buffers, every
/// parameter one-dimensional), if it is not: the text after "this `Kind` ".
pub(super) fn not_a_norm(module: &dyn Shardable) -> Option<String> {
    // GroupNorm's statistics run across the sequence (its spatial dims): a chunk of it
    // gives other values.
    if module.type_name().ends_with("::GroupNorm") {
        return Some("normalizes across the sequence (over groups of channels)".into());
    }
    if let Some(child) = first_submodule(module) {
        return Some(format!("has a submodule `{child}`"));
    }
    if let Some((name, _)) = module.named_buffers().into_iter().next() {
        return Some(format!("has a buffer `{name}` (running statistics?)"));
    }
    module
        .named_parameters()
        .into_iter()
        .find(|(_, t)| t.dim() != 1)
        .map(|(name, t)| format!("has a parameter `{name}` of shape {:?}", t.size()))
}

impl Sharder for SequenceParallelNorm {
    fn name(&self) -> String {
        format!("sequence_parallel(sequence_dim={})", self.sequence_dim)
    }

    fn check(
        &self,
        _fqn: &str,
        module: &dyn Shardable,
        _group: &ProcessGroup,
    ) -> Result<(), SharderError> {
        match not_a_norm(module) {
            None => Ok(()),
            Some(found) => Err(SharderError::NotANorm {
                kind: module.type_name(),
                found,
            }),
        }
    }

    fn needs_hooks(&self) -> bool {
        false
    }

    fn shard(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        _src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedModule, ShardError> {
        let rank = group.rank();
        let mut sums = Vec::new();
        let mut seen = HashSet::new();
        for (name, param) in module.named_parameters() {
            // A tied parameter is summed once; a frozen one has no gradient.
            if !param.requires_grad() || !seen.insert(tensor_identity(param)) {
                continue;
            }
            let param_fqn = join_fqn(fqn, &name);
            let named = param_fqn.clone();
            let sum = GradientSum::new(group.clone(), move |e| {
                let (param, source) = (named.clone(), Box::new(e.clone()));
                let problem = EngineProblem::GradientSum { param, source };
                crate::report(&EngineFailure { rank, problem })
            });
            sum.register(param)
                .map_err(|e| ShardError::dist(group, &param_fqn, e))?;
            sums.push(sum);
        }
        let (g, name, dim) = (group.clone(), fqn.to_string(), self.sequence_dim);
        let sums: Vec<Arc<GradientSum>> = sums;
        let hook = register_fallible_forward_pre_hook(module, move |_m, x| {
            let _owned = &sums; // the sums live as long as this hook
            let ndim = x.dim();
            match tch_dist_core::sharding::chunk::normalize_dim(dim, ndim) {
                Some(_) => Ok(None),
                None => Err(hook_error(
                    &g,
                    &name,
                    HookSite::SequenceParallel,
                    ForwardProblem::LayoutDim { dim, ndim },
                )),
            }
        })
        .map_err(|source| ShardError::unhookable(group, fqn, source))?;
        Ok(ShardedModule::hook_only(hook))
    }
}
