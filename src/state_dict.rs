//! Where every sharded parameter's pieces live — the question PyTorch answers in a DTensor's
//! mesh and placements — answered once per model: [`placements`] walks the model's
//! `fully_shard` and `shard_module` calls and gives one [`ParamPlacement`] per sharded tensor
//! object, keyed by the tensor's identity (a tied parameter is one record under each of its
//! names). `checkpoint`'s plan, `utils::clip_grad_norm` and `fully_shard::full_state_dict`
//! read only this record.
//!
//! ```no_run
//! # fn demo<M: tch_dist::Shardable>(model: &M) {
//! for (fqn, t) in model.named_parameters() {
//!     if let Some(p) = tch_dist::state_dict::placements(model).get(t) {
//!         println!("{fqn}: {:?} of {:?} at {:?}", p.placements, p.global_shape, p.offsets);
//!     }
//! }
//! # }
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::tensor_identity;
use tch_dist_runtime::ProcessGroup;

use crate::fully_shard::FsdpState;
use crate::sharding::ShardState;

/// How a tensor lies over one dim of its mesh (PyTorch's DTensor placements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The same piece on every rank of the dim (HSDP's replicate dim).
    Replicate,
    /// Chunks along tensor dim `dim` (`fully_shard`'s padded `Shard(0)`, a column- or
    /// row-parallel weight's `Shard(0)` / `Shard(1)`).
    Shard(usize),
}

/// One sharded parameter: its mesh dims' placements, its global shape and this rank's piece.
#[derive(Clone)]
pub struct ParamPlacement {
    /// Its first FQN in the model's walk order.
    pub fqn: String,
    /// Per mesh dim, outermost first: `[Replicate, Shard(0)]` for HSDP, `[Shard(d)]`
    /// otherwise.
    pub placements: Vec<Placement>,
    /// The whole tensor's shape.
    pub global_shape: Vec<i64>,
    /// Where this rank's piece starts in it.
    pub offsets: Vec<i64>,
    /// The shape of this rank's piece.
    pub local_shape: Vec<i64>,
    /// The group the pieces are spread over (the `Shard` dim's).
    pub shard_group: ProcessGroup,
    /// The group holding the same pieces (the `Replicate` dim's), if any.
    pub replicate_group: Option<ProcessGroup>,
    pub(crate) owner: Owner,
}

impl std::fmt::Debug for ParamPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamPlacement")
            .field("fqn", &self.fqn)
            .field("placements", &self.placements)
            .field("global_shape", &self.global_shape)
            .field("offsets", &self.offsets)
            .field("local_shape", &self.local_shape)
            .finish_non_exhaustive()
    }
}

/// The API that sharded a parameter, and how to reach its state.
#[derive(Clone)]
pub(crate) enum Owner {
    /// `fully_shard`: the call's state and the parameter's position in its group.
    FullyShard { state: Arc<FsdpState>, index: usize },
    /// `shard_module`: the call's state, the FQN of the module it sharded (within the walked
    /// model) and the parameter's FQN within that module.
    ShardModule {
        state: Arc<ShardState>,
        module: String,
        local_fqn: String,
    },
}

impl ParamPlacement {
    /// Whether another rank (an earlier replica) holds this rank's piece too: a checkpoint
    /// writes it once, from the first replica.
    pub fn is_replica_copy(&self) -> bool {
        self.replicate_group.as_ref().is_some_and(|g| g.rank() != 0)
    }
}

/// Every sharded parameter of a model, by tensor identity ([`placements`]).
#[derive(Debug, Clone, Default)]
pub struct Placements {
    by_identity: HashMap<u64, ParamPlacement>,
}

impl Placements {
    /// The record of `t` (a parameter of the model), `None` when it is whole on every rank.
    pub fn get(&self, t: &Tensor) -> Option<&ParamPlacement> {
        self.by_identity.get(&tensor_identity(t))
    }

    /// Every record, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &ParamPlacement> {
        self.by_identity.values()
    }

    /// The number of sharded tensor objects.
    pub fn len(&self) -> usize {
        self.by_identity.len()
    }

    /// Whether the model has no sharded parameter.
    pub fn is_empty(&self) -> bool {
        self.by_identity.is_empty()
    }
}

/// The placement record of every sharded parameter in `module` (see the [module
/// docs](self)).
pub fn placements<M: Shardable + ?Sized>(module: &M) -> Placements {
    // Each API's own view, by the FQN it gives; identities join the names of tied
    // parameters.
    let mut by_fqn: HashMap<String, ParamPlacement> = HashMap::new();
    for (fqn, p) in crate::sharding::sharded_params_in(module) {
        let Some(meta) = p.state.metadata(&p.local_fqn) else {
            continue;
        };
        let group = p.state.group();
        let Some(mine) = meta
            .shards_metadata
            .iter()
            .find(|s| s.placement.rank() == group.rank())
        else {
            continue;
        };
        // The one dim along which the pieces differ from the whole.
        let dim = (0..meta.size.len())
            .find(|&d| mine.shard_sizes[d] != meta.size[d])
            .unwrap_or(0);
        let module_fqn = fqn
            .strip_suffix(&p.local_fqn)
            .map(|m| m.trim_end_matches('.').to_string())
            .unwrap_or_default();
        by_fqn.insert(
            fqn.clone(),
            ParamPlacement {
                fqn,
                placements: vec![Placement::Shard(dim)],
                global_shape: meta.size.clone(),
                offsets: mine.shard_offsets.clone(),
                local_shape: mine.shard_sizes.clone(),
                shard_group: group.clone(),
                replicate_group: None,
                owner: Owner::ShardModule {
                    state: p.state.clone(),
                    module: module_fqn,
                    local_fqn: p.local_fqn,
                },
            },
        );
    }
    for (fqn, p) in crate::fully_shard::fsdp_params_in(module) {
        let replicate_group = p.state.replicate_group().cloned();
        let mut placements = vec![Placement::Shard(p.info.dim)];
        if replicate_group.is_some() {
            placements.insert(0, Placement::Replicate);
        }
        by_fqn.insert(
            fqn.clone(),
            ParamPlacement {
                fqn,
                placements,
                global_shape: p.info.shape.clone(),
                offsets: p.info.offsets.clone(),
                local_shape: p.info.local_shape.clone(),
                shard_group: p.state.process_group().clone(),
                replicate_group,
                owner: Owner::FullyShard {
                    state: p.state,
                    index: p.index,
                },
            },
        );
    }
    let mut by_identity = HashMap::new();
    for (fqn, t) in module.named_parameters() {
        if let Some(record) = by_fqn.remove(&fqn) {
            by_identity.entry(tensor_identity(t)).or_insert(record);
        }
    }
    Placements { by_identity }
}
