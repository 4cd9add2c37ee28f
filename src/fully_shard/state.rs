//! [`FsdpState`]: what one `fully_shard` call keeps for its module (PyTorch's `FSDPModule`
//! methods and `FSDPState`): its parameter group, its hooks, the nested calls' states, and
//! the names its errors give.

use std::sync::Arc;

use tch_dist_core::hooks::RemovableHandle;
use tch_dist_core::path::join_fqn;
use tch_dist_runtime::fsdp::{FsdpGroup, ShardInfo};
use tch_dist_runtime::ProcessGroup;

use super::{hooks, FsdpError, ReshardAfterForward};
use crate::state_dict::managed::Registration;

/// What `fully_shard` keeps per managed module (PyTorch's `FSDPModule` methods), returned
/// by [`fully_shard`](super::fully_shard) and by [`state`](super::state).
pub struct FsdpState {
    pub(super) group: Arc<FsdpGroup>,
    pub(super) process_group: ProcessGroup,
    /// HSDP: the ranks holding the same shards (a 2-D mesh's dim 0).
    pub(super) replicate_group: Option<ProcessGroup>,
    /// `reshard_after_forward` as given (`None`: decided by whether a later call encloses
    /// this one).
    pub(super) reshard_after_forward: Option<ReshardAfterForward>,
    /// The module's FQN within the outermost call that encloses it (set by that call) and
    /// the managed parameters' FQNs within the module: what errors name.
    pub(super) names: Arc<hooks::CallNames>,
    /// The states of the nearest nested calls.
    pub(super) nested: Vec<Arc<FsdpState>>,
    pub(super) _hooks: Vec<RemovableHandle>,
    /// The bypass guard over this call's trainable parameters.
    pub(super) guard: Option<hooks::NestedGuard>,
    /// This call's parameters in the registry of managed parameters (its group holds the
    /// tensors, so no other tensor can take one of their identities while they are there).
    pub(super) _registration: Registration,
}

impl std::fmt::Debug for FsdpState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpState")
            .field("group", &self.group)
            .field("nested", &self.nested.len())
            .finish()
    }
}

impl FsdpState {
    /// Gathers the full parameters of this module's group, so that methods other than
    /// `forward` can use them (PyTorch's `unshard()`); [`reshard`](Self::reshard) frees them.
    pub fn unshard(&self) -> Result<(), FsdpError> {
        Ok(self.group.unshard()?)
    }

    /// Frees the gathered parameters: each holds this rank's shard again.
    pub fn reshard(&self) -> Result<(), FsdpError> {
        Ok(self.group.reshard()?)
    }

    /// Whether backward reduce-scatters gradients (the default) or accumulates them locally
    /// for a later synchronised backward (gradient accumulation without communication);
    /// applies to the nested calls too, as PyTorch's `recurse=True`.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.group.set_requires_gradient_sync(sync);
        for n in &self.nested {
            n.set_requires_gradient_sync(sync);
        }
    }

    /// Whether a backward without gradient sync frees the gathered parameters (default
    /// `true`); nested calls too. A synchronised backward always reshards.
    pub fn set_reshard_after_backward(&self, reshard: bool) {
        self.group.set_reshard_after_backward(reshard);
        for n in &self.nested {
            n.set_reshard_after_backward(reshard);
        }
    }

    /// Changes `reshard_after_forward` of this call (not of nested ones).
    pub fn set_reshard_after_forward(&self, reshard: bool) {
        self.group.set_reshard_after_forward(reshard);
    }

    /// The modules whose parameters start gathering when this module's forward starts
    /// (PyTorch's `set_modules_to_forward_prefetch`; default none): the next block's, so
    /// that its all-gather overlaps this block's forward.
    ///
    /// ```no_run
    /// # fn demo(blocks: &[tch::nn::Linear]) -> Result<(), tch_dist::fully_shard::FsdpError> {
    /// use tch_dist::fully_shard::{state, FsdpError};
    /// let states: Vec<_> = blocks.iter().map(|b| state(b).ok_or(FsdpError::NotFullyShard)).collect::<Result<_, _>>()?;
    /// for pair in states.windows(2) {
    ///     pair[0].set_modules_to_forward_prefetch(&[&*pair[1]]);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn set_modules_to_forward_prefetch(&self, modules: &[&FsdpState]) {
        let groups: Vec<&FsdpGroup> = modules.iter().map(|m| &*m.group).collect();
        self.group.set_forward_prefetch(&groups);
    }

    /// The modules whose parameters start gathering when this module's backward starts
    /// (PyTorch's `set_modules_to_backward_prefetch`); default: the module whose forward ran
    /// just before this one's, whose backward comes next.
    pub fn set_modules_to_backward_prefetch(&self, modules: &[&FsdpState]) {
        let groups: Vec<&FsdpGroup> = modules.iter().map(|m| &*m.group).collect();
        self.group.set_backward_prefetch(&groups);
    }

    /// The typed error of a fully_shard hook that failed the last backward pass (in this
    /// call or a nested one), taken: libtorch fails `backward` with its message only (tch's
    /// `f_backward` returns it as text), and the next forward would return it.
    ///
    /// ```no_run
    /// # fn demo<M: tch_dist::Shardable>(model: &M, loss: &tch::Tensor) -> Result<(), Box<dyn std::error::Error>> {
    /// if let Err(text) = loss.f_backward() {
    ///     let state = tch_dist::fully_shard::state(model);
    ///     return Err(match state.and_then(|s| s.take_backward_error()) {
    ///         Some(typed) => typed.into(),
    ///         None => text.into(),
    ///     });
    /// }
    /// # Ok(()) }
    /// ```
    pub fn take_backward_error(&self) -> Option<FsdpError> {
        let mut found = None;
        for s in self.all_ref() {
            if let Some(e) = s.group.take_failure() {
                found.get_or_insert(FsdpError::Hooked {
                    rank: s.process_group.rank(),
                    module: s.names.module(),
                    source: e,
                });
            }
        }
        found
    }

    /// This call and every nested one, outermost first (borrowed).
    fn all_ref(&self) -> Vec<&FsdpState> {
        let mut out = vec![self];
        for n in &self.nested {
            out.extend(n.all_ref());
        }
        out
    }

    /// Whether this module's parameters hold their shards now.
    pub fn is_sharded(&self) -> bool {
        self.group.is_sharded()
    }

    /// Where this call's parameters are sharded: FQN (within the outermost enclosing
    /// call's module), full shape, and this rank's first row and row count.
    pub fn shards(&self) -> Vec<ShardInfo> {
        let prefix = self.prefix();
        self.group
            .params()
            .into_iter()
            .map(|mut s| {
                s.fqn = join_fqn(&prefix, &s.fqn);
                s
            })
            .collect()
    }

    /// Bytes the gathered (full) parameters of this call hold now: 0 while sharded.
    pub fn gathered_bytes(&self) -> usize {
        self.group.full_bytes()
    }

    /// Bytes of the shards kept between forward and backward with
    /// `reshard_after_forward` = n ranks (0 otherwise, and outside that window).
    pub fn post_forward_bytes(&self) -> usize {
        self.group.post_forward_bytes()
    }

    /// The group this call shards over.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.process_group
    }

    /// HSDP: the group of ranks holding the same shards as this one (`None`: plain FSDP).
    pub fn replicate_group(&self) -> Option<&ProcessGroup> {
        self.replicate_group.as_ref()
    }

    /// This call and every nested one, outermost first.
    pub(super) fn all(self: &Arc<Self>) -> Vec<Arc<FsdpState>> {
        let mut out = vec![Arc::clone(self)];
        for n in &self.nested {
            out.extend(n.all());
        }
        out
    }

    /// This module's FQN within the outermost call that encloses it.
    pub(super) fn prefix(&self) -> String {
        self.names.module()
    }

    pub(super) fn set_prefix(&self, prefix: &str) {
        let mut p = self.names.prefix.lock().unwrap_or_else(|e| e.into_inner());
        *p = if p.is_empty() {
            prefix.to_string()
        } else {
            join_fqn(prefix, &p)
        };
        // The engine's own errors (a `.grad` of the wrong shape) name the same FQNs.
        self.group.set_module_fqn(&p);
    }
}
