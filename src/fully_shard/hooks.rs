//! fully_shard's forward hooks: one call scope per managed module, which gathers the
//! parameters before the call, and after it claims the call's uses of them (the bypass
//! check), hooks the output for backward, and frees them where `reshard_after_forward`.

use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::{CallScope, ForwardError};
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::FsdpGroup;
use tch_dist_runtime::{autograd_mark, DistError, UseGuard};

use super::FsdpError;

/// The scope of one managed module's calls.
pub(super) struct Scope {
    pub group: Arc<FsdpGroup>,
    /// Over the managed parameters that require a gradient (`None`: there are none).
    pub guard: Option<Arc<UseGuard>>,
    pub rank: usize,
    /// The managed module, for errors.
    pub module: String,
    /// The guards of every nested call, checked over the output of each call of this
    /// module: a nested module run without its hooks fails the forward.
    pub nested: Vec<NestedGuard>,
}

/// A nested call's guard, with the names its errors give.
#[derive(Clone)]
pub(super) struct NestedGuard {
    pub guard: Arc<UseGuard>,
    pub module: String,
    pub params: Vec<String>,
}

impl Scope {
    fn failed(&self, source: DistError) -> ForwardError {
        ForwardError::from_error(FsdpError::Hooked {
            rank: self.rank,
            module: self.module.clone(),
            source,
        })
    }
}

impl CallScope for Scope {
    fn enter(&self, _module: &dyn Shardable, _inputs: &[Tensor]) -> Result<u64, ForwardError> {
        self.group.pre_forward().map_err(|e| self.failed(e))?;
        Ok(autograd_mark())
    }

    /// Over every output of the call (a block returning a tuple has each hooked for
    /// backward and checked for bypassed nested calls).
    fn exit(
        &self,
        _module: &dyn Shardable,
        outputs: &[Tensor],
        mark: u64,
    ) -> Result<(), ForwardError> {
        if let Some(guard) = &self.guard {
            for output in outputs {
                guard.claim(output, mark).map_err(|e| self.failed(e))?;
            }
        }
        if !self.nested.is_empty() {
            let guards: Vec<&UseGuard> = self.nested.iter().map(|n| &*n.guard).collect();
            for output in outputs {
                let found =
                    UseGuard::first_unclaimed(&guards, output, mark).map_err(|e| self.failed(e))?;
                if let Some((i, j)) = found {
                    // Gathered parameters go back to their shards before the error returns.
                    let detached: Vec<Tensor> = outputs.iter().map(Tensor::detach).collect();
                    let _ = self
                        .group
                        .post_forward_outputs(&detached.iter().collect::<Vec<_>>());
                    return Err(ForwardError::from_error(FsdpError::HooksBypassed {
                        rank: self.rank,
                        module: self.nested[i].module.clone(),
                        param: self.nested[i].params[j].clone(),
                    }));
                }
            }
        }
        let outputs: Vec<&Tensor> = outputs.iter().collect();
        self.group
            .post_forward_outputs(&outputs)
            .map_err(|e| self.failed(e))
    }
}
