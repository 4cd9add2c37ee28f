//! [`ShardState`]: what [`shard_module`](super::shard_module) did to a module.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use tch::Tensor;

use tch_dist_core::hooks::RemovableHandle;
use tch_dist_core::sharding::ShardedTensorMetadata;
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::tensor_identity;
use tch_dist_runtime::sharding::{Shard, ShardedTensor};
use tch_dist_runtime::{autograd_mark, unfenced, DistError, ProcessGroup, UseGuard};

use super::error::{PlanProblem, ShardError};
use crate::state_dict::managed::{register, Layer, ManagingApi, Registration, ShardHolder};
use crate::state_dict::{MeshDimPlacement, Placement};

/// What [`shard_module`](super::shard_module) did to a module:
/// [`shard_module_state`](super::shard_module_state) returns it.
pub struct ShardState {
    pub(super) sharded: BTreeMap<String, ShardedTensorMetadata>,
    pub(super) hooks: Vec<RemovableHandle>,
    /// The bypass check's guards (dropped by `remove_hooks`).
    pub(super) guards: Mutex<Vec<Arc<UseGuard>>>,
    pub(super) group: ProcessGroup,
    /// The sharded parameters in the registry of managed parameters.
    pub(super) _registrations: Vec<Registration>,
}

impl std::fmt::Debug for ShardState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardState")
            .field("sharded", &self.sharded.keys().collect::<Vec<_>>())
            .field("hooks", &self.hooks.len())
            .field("guards", &self.lock_guards().len())
            .finish()
    }
}

impl ShardState {
    /// The FQNs (relative to the sharded module) of the parameters now held as shards.
    pub fn sharded_params(&self) -> impl Iterator<Item = &str> {
        self.sharded.keys().map(String::as_str)
    }

    /// The global layout of sharded parameter `fqn`.
    pub fn metadata(&self, fqn: &str) -> Option<&ShardedTensorMetadata> {
        self.sharded.get(fqn)
    }

    /// The process group the parameters are sharded over.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Sharded parameter `fqn` of `module` (the module passed to
    /// [`shard_module`](super::shard_module)) as a [`ShardedTensor`] over this rank's live
    /// parameter, for example to gather it for a checkpoint.
    pub fn sharded_tensor<M: Shardable + ?Sized>(
        &self,
        module: &M,
        fqn: &str,
    ) -> Result<ShardedTensor, ShardError> {
        let param = module
            .named_parameters()
            .into_iter()
            .find(|(n, _)| n == fqn)
            .map(|(_, t)| t.detach())
            .ok_or_else(|| ShardError::plan(&self.group, fqn, PlanProblem::NotAParameter))?;
        self.sharded_tensor_of(fqn, param)
    }

    /// Sharded parameter `fqn` as a [`ShardedTensor`] over `local`, this rank's piece of it
    /// (the parameter itself, or what `fully_shard` gathers of it under FSDP x TP).
    pub(crate) fn sharded_tensor_of(
        &self,
        fqn: &str,
        local: Tensor,
    ) -> Result<ShardedTensor, ShardError> {
        let meta = self
            .sharded
            .get(fqn)
            .ok_or_else(|| ShardError::plan(&self.group, fqn, PlanProblem::NotSharded))?;
        sharded_tensor(meta, local, &self.group).map_err(|e| ShardError::dist(&self.group, fqn, e))
    }

    /// Runs `f`, whose result may use the sharded modules' parameters directly, outside
    /// their modules' calls (a regularizer over this rank's shards): the uses that the tensor
    /// `f` returns depends on pass the bypass check (see
    /// [`Composition::HooksBypassed`](crate::Composition::HooksBypassed)).
    ///
    /// ```no_run
    /// # fn f(state: &tch_dist::sharding::ShardState, w: &tch::Tensor) -> Result<(), tch_dist::sharding::ShardError> {
    /// let l2 = state.allow_direct_use(|| w.pow_tensor_scalar(2).sum(tch::Kind::Float))?;
    /// # Ok(()) }
    /// ```
    pub fn allow_direct_use(&self, f: impl FnOnce() -> Tensor) -> Result<Tensor, ShardError> {
        let mark = autograd_mark();
        let out = unfenced(f);
        UseGuard::claim_any(self.group.rank(), "shard_module", &out, mark)
            .map_err(|e| ShardError::dist(&self.group, "", e))?;
        Ok(out)
    }

    /// Removes the forward hooks and the bypass check (the parameters stay sharded): a call
    /// then runs each layer's forward on its local shard, without communication.
    pub fn remove_hooks(&self) {
        for h in &self.hooks {
            h.remove();
        }
        self.lock_guards().clear();
    }

    fn lock_guards(&self) -> std::sync::MutexGuard<'_, Vec<Arc<UseGuard>>> {
        self.guards.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The tensor `meta` lays out over `group`, as a [`ShardedTensor`] over `local`, this rank's
/// piece of it: a single shard is the whole piece; several (a fused layer's parts) are
/// concatenated along dim 0 in metadata order.
fn sharded_tensor(
    meta: &ShardedTensorMetadata,
    local: Tensor,
    group: &ProcessGroup,
) -> Result<ShardedTensor, DistError> {
    let mine = meta.shards_for_rank(group.rank());
    let shards = match mine.as_slice() {
        [one] => vec![Shard {
            tensor: local,
            metadata: (*one).clone(),
        }],
        several => {
            let mut off = 0;
            several
                .iter()
                .map(|m| {
                    let rows = m.shard_sizes[0];
                    let tensor = local.narrow(0, off, rows);
                    off += rows;
                    Shard {
                        tensor,
                        metadata: (*m).clone(),
                    }
                })
                .collect()
        }
    };
    ShardedTensor::from_local_shards(shards, meta.clone(), group)
}

/// Enters `module`'s parameters that `sharded` names in the registry of managed parameters,
/// each with how `shard_module` split it over `group` (the placement record's layer: the one
/// dim along which this rank's piece differs from the whole, and how many blocks of the
/// whole it joins): as tensor parallelism's, or, for those in `every_rank` (a sharder's
/// [`trained_on_every_rank`](super::Sharder::trained_on_every_rank)), as expert
/// parallelism's. The state removes them on drop.
pub(super) fn enter_managed<M: Shardable + ?Sized>(
    module: &M,
    sharded: &BTreeMap<String, ShardedTensorMetadata>,
    every_rank: &BTreeSet<String>,
    group: &ProcessGroup,
) -> Vec<Registration> {
    let params: Vec<(String, &Tensor)> = module
        .named_parameters()
        .into_iter()
        .filter(|(fqn, _)| sharded.contains_key(fqn))
        .collect();
    let holder = Arc::new(Holder {
        group: group.clone(),
        metadata: params.iter().map(|(fqn, _)| sharded[fqn].clone()).collect(),
    });
    let (mut tensor_parallel, mut experts) = (Vec::new(), Vec::new());
    for (index, (fqn, t)) in params.into_iter().enumerate() {
        let layer = layer(&holder, index);
        let to = if every_rank.contains(&fqn) {
            &mut experts
        } else {
            &mut tensor_parallel
        };
        to.push((tensor_identity(t), fqn, layer));
    }
    let ranks = group.global_ranks();
    vec![
        register(ManagingApi::ShardModule, ranks, tensor_parallel),
        register(ManagingApi::ExpertParallel, ranks, experts),
    ]
}

/// How `holder`'s tensor `index` lies: `None` when this rank holds no piece of it.
fn layer(holder: &Arc<Holder>, index: usize) -> Option<Layer> {
    let meta = &holder.metadata[index];
    let held = meta.shards_for_rank(holder.group.rank());
    let mine = *held.first()?;
    // The one dim along which the pieces differ from the whole.
    let dim = (0..meta.size.len())
        .find(|&d| mine.shard_sizes[d] != meta.size[d])
        .unwrap_or(0);
    Some(Layer {
        dims: vec![MeshDimPlacement {
            placement: Placement::Shard(dim),
            group: holder.group.clone(),
        }],
        whole: meta.size.clone(),
        offsets: mine.shard_offsets.clone(),
        local: mine.shard_sizes.clone(),
        blocks: held.len(),
        holder: Arc::clone(holder) as Arc<dyn ShardHolder>,
        index,
    })
}

/// shard_module's holder in the state dict's registry: each sharded parameter's layout,
/// by its index; its pieces are gathered from the piece a rank holds.
struct Holder {
    group: ProcessGroup,
    metadata: Vec<ShardedTensorMetadata>,
}

impl ShardHolder for Holder {
    fn gather(&self, index: usize, piece: &Tensor) -> Result<Tensor, DistError> {
        sharded_tensor(&self.metadata[index], piece.shallow_clone(), &self.group)?.all_gather()
    }

    /// A sharded parameter always holds its shard.
    fn reshard(&self) -> Result<(), DistError> {
        Ok(())
    }
}
