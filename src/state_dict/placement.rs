//! The placement record: where every sharded parameter's pieces live, as a DTensor's mesh
//! and placements say it, built from the [`Layer`]s the APIs registered (`managed.rs`)
//! for each tensor they shard, innermost first: `shard_module` splits the whole tensor over
//! its group, `fully_shard` then splits that piece (or the whole tensor) over its own.

use std::collections::HashMap;

use tch::Tensor;
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::tensor_identity;
use tch_dist_runtime::ProcessGroup;

use super::managed::{self, Layer};

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
    /// How the APIs split it, innermost first (what gathers it back).
    pub(crate) layers: Vec<Layer>,
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
/// docs](super)): one record per tensor object, under its first FQN in walk order.
pub fn placements<M: Shardable + ?Sized>(module: &M) -> Placements {
    let mut by_identity = HashMap::new();
    for (fqn, t) in module.named_parameters() {
        let id = tensor_identity(t);
        if by_identity.contains_key(&id) {
            continue; // a tied parameter's second name
        }
        if let Some(record) = compose(fqn, managed::layers_of(id)) {
            by_identity.insert(id, record);
        }
    }
    Placements { by_identity }
}

/// One tensor's record from its layers, innermost first: the innermost layer splits the
/// whole tensor, each outer one the piece the layer inside it left (its offsets add to the
/// inner ones', its mesh dims come first: a `[dp, tp]` mesh orders fully_shard's `dp` before
/// shard_module's `tp`).
fn compose(fqn: String, layers: Vec<Layer>) -> Option<ParamPlacement> {
    let (innermost, outer) = layers.split_first()?;
    let mut dims = innermost.dims.clone();
    let mut offsets = innermost.offsets.clone();
    let mut local_shape = innermost.local.clone();
    for layer in outer {
        dims.splice(0..0, layer.dims.iter().cloned());
        offsets = offsets
            .iter()
            .zip(&layer.offsets)
            .map(|(a, b)| a + b)
            .collect();
        local_shape = layer.local.clone();
    }
    Some(ParamPlacement {
        fqn,
        dims,
        global_shape: innermost.whole.clone(),
        offsets,
        local_shape,
        blocks: innermost.blocks,
        layers,
    })
}
