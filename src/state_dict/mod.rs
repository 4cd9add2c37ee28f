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
//!         println!("{fqn}: {:?} of {:?} at {:?}", p.placements(), p.global_shape, p.offsets);
//!     }
//! }
//! # }
//! ```

use std::collections::HashMap;
use std::sync::Arc;

pub(crate) mod managed;
pub use managed::ManagingApi;

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

/// One mesh dim of a sharded parameter: how the parameter lies over it, and this rank's
/// group along it (PyTorch's `placements[i]` and `mesh.get_group(i)`).
#[derive(Clone)]
pub struct MeshDimPlacement {
    /// [`Placement::Replicate`] or [`Placement::Shard`].
    pub placement: Placement,
    /// The ranks along this dim that hold the other pieces (`Shard`) or the same piece
    /// (`Replicate`), this rank among them.
    pub group: ProcessGroup,
}

impl std::fmt::Debug for MeshDimPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} over {:?}",
            self.placement,
            self.group.global_ranks()
        )
    }
}

/// One sharded parameter: its mesh dims' placements, its global shape and this rank's piece.
#[derive(Clone)]
pub struct ParamPlacement {
    /// Its first FQN in the model's walk order.
    pub fqn: String,
    /// Per mesh dim, outermost first: the placement (PyTorch's DTensor placements:
    /// `[Shard(d)]` for one API on one group, `[Replicate, Shard(0)]` for HSDP, `[Shard(0),
    /// Shard(d)]` for `fully_shard` over a `dp` dim of a parameter tensor-parallel over a
    /// `tp` dim) with this rank's group along the dim.
    pub dims: Vec<MeshDimPlacement>,
    /// The whole tensor's shape.
    pub global_shape: Vec<i64>,
    /// Where this rank's piece starts in it.
    pub offsets: Vec<i64>,
    /// The shape of this rank's piece.
    pub local_shape: Vec<i64>,
    /// How many separate blocks of the whole tensor this rank's local tensor joins along
    /// dim 0: 1, except for a fused column-parallel layer sharded per part (`q`, `k`, `v`
    /// each split: this rank's rows of each, end to end), whose `offsets` and
    /// `local_shape` are then its first block's; a checkpoint refuses such a tensor.
    pub blocks: usize,
    pub(crate) owner: Owner,
}

impl std::fmt::Debug for ParamPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamPlacement")
            .field("fqn", &self.fqn)
            .field("dims", &self.dims)
            .field("global_shape", &self.global_shape)
            .field("offsets", &self.offsets)
            .field("local_shape", &self.local_shape)
            .finish_non_exhaustive()
    }
}

/// A `fully_shard` call's hold on a parameter: the call's state and the parameter's
/// position in its group.
#[derive(Clone)]
pub(crate) struct FsdpOwner {
    pub state: Arc<FsdpState>,
    pub index: usize,
}

/// A `shard_module` call's hold on a parameter: the call's state and the parameter's FQN
/// within the module it sharded.
#[derive(Clone)]
pub(crate) struct TpOwner {
    pub state: Arc<ShardState>,
    pub local_fqn: String,
}

/// The APIs that sharded a parameter, innermost last: `shard_module` splits the whole
/// tensor over its group, `fully_shard` then splits that piece (or the whole tensor) over
/// its own.
#[derive(Clone)]
pub(crate) struct Owner {
    pub tp: Option<TpOwner>,
    pub fsdp: Option<FsdpOwner>,
}

impl ParamPlacement {
    /// The placement per mesh dim, outermost first (a DTensor's `placements`).
    pub fn placements(&self) -> Vec<Placement> {
        self.dims.iter().map(|d| d.placement).collect()
    }

    /// Whether another rank (an earlier replica) holds this rank's piece too: a checkpoint
    /// writes it once, from the first replica.
    pub fn is_replica_copy(&self) -> bool {
        self.dims
            .iter()
            .any(|d| d.placement == Placement::Replicate && d.group.rank() != 0)
    }

    /// The groups of the `Shard` dims, outermost first: a sum over every piece is a sum
    /// over each of them in turn.
    pub fn shard_groups(&self) -> impl Iterator<Item = &ProcessGroup> {
        self.dims
            .iter()
            .filter(|d| matches!(d.placement, Placement::Shard(_)))
            .map(|d| &d.group)
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
    // parameters. `shard_module`'s piece of the whole tensor first.
    let mut by_fqn: HashMap<String, ParamPlacement> = HashMap::new();
    for (fqn, p) in crate::sharding::sharded_params_in(module) {
        let Some(meta) = p.state.metadata(&p.local_fqn) else {
            continue;
        };
        let group = p.state.group();
        let held = meta.shards_for_rank(group.rank());
        let Some(&mine) = held.first() else {
            continue;
        };
        // The one dim along which the pieces differ from the whole.
        let dim = (0..meta.size.len())
            .find(|&d| mine.shard_sizes[d] != meta.size[d])
            .unwrap_or(0);
        by_fqn.insert(
            fqn.clone(),
            ParamPlacement {
                fqn,
                dims: vec![MeshDimPlacement {
                    placement: Placement::Shard(dim),
                    group: group.clone(),
                }],
                global_shape: meta.size.clone(),
                offsets: mine.shard_offsets.clone(),
                local_shape: mine.shard_sizes.clone(),
                blocks: held.len(),
                owner: Owner {
                    tp: Some(TpOwner {
                        state: p.state.clone(),
                        local_fqn: p.local_fqn,
                    }),
                    fsdp: None,
                },
            },
        );
    }
    // Then `fully_shard`'s piece of that (FSDP x TP: the outer dims are fully_shard's, as
    // a `[dp, tp]` mesh orders them) or of the whole tensor.
    for (fqn, p) in crate::fully_shard::fsdp_params_in(module) {
        let mut dims = Vec::with_capacity(3);
        if let Some(g) = p.state.replicate_group() {
            dims.push(MeshDimPlacement {
                placement: Placement::Replicate,
                group: g.clone(),
            });
        }
        dims.push(MeshDimPlacement {
            placement: Placement::Shard(p.info.dim),
            group: p.state.process_group().clone(),
        });
        let fsdp = Some(FsdpOwner {
            state: p.state,
            index: p.index,
        });
        let record = match by_fqn.remove(&fqn) {
            // fully_shard's shape is the tensor-parallel piece; its offsets are within it.
            Some(tp) => {
                dims.extend(tp.dims);
                ParamPlacement {
                    fqn: fqn.clone(),
                    global_shape: tp.global_shape,
                    offsets: tp
                        .offsets
                        .iter()
                        .zip(&p.info.offsets)
                        .map(|(a, b)| a + b)
                        .collect(),
                    local_shape: p.info.local_shape.clone(),
                    blocks: tp.blocks,
                    dims,
                    owner: Owner {
                        tp: tp.owner.tp,
                        fsdp,
                    },
                }
            }
            None => ParamPlacement {
                fqn: fqn.clone(),
                global_shape: p.info.shape.clone(),
                offsets: p.info.offsets.clone(),
                local_shape: p.info.local_shape.clone(),
                blocks: 1,
                dims,
                owner: Owner { tp: None, fsdp },
            },
        };
        by_fqn.insert(fqn, record);
    }
    let mut by_identity = HashMap::new();
    for (fqn, t) in module.named_parameters() {
        if let Some(record) = by_fqn.remove(&fqn) {
            by_identity.entry(tensor_identity(t)).or_insert(record);
        }
    }
    Placements { by_identity }
}
