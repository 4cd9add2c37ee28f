//! What is wrong with a plan, refused before anything changes: [`PlanProblem`] (one entry
//! of a [`ShardingPlan`](crate::sharding::ShardingPlan)) and [`StyleProblem`] (what
//! [`parallelize_module`](crate::sharding::parallelize_module) does not build).

use std::fmt;

use tch_dist_core::hooks::HookError;
use tch_dist_core::sharding::{Placement, ShardingError};

use super::{Key, SharderError};
use crate::sharding::Layout;

/// What [`parallelize_module`](crate::sharding::parallelize_module) does not build
/// ([`ShardProblem::Parallelize`](super::ShardProblem::Parallelize)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StyleProblem {
    /// The mesh is not 1-D (nor 2-D for a plan of `ExpertTensorParallel` only).
    #[error(
        "the mesh has {ndim} dims; parallelize_module takes a 1-D mesh (one dim of it: \
         `mesh.dim(\"tp\")`), or a 2-D [\"ep\", \"tp\"] one for ExpertTensorParallel alone"
    )]
    MeshDims {
        /// Its number of dims.
        ndim: usize,
    },
    /// A layout the style does not support here.
    #[error(
        "{style} with {which}_layouts = {layout:?} is not supported ({})",
        Supported(style)
    )]
    Layout {
        /// The style's name.
        style: &'static str,
        /// `"input"` or `"output"`.
        which: &'static str,
        /// The layout asked for.
        layout: Layout,
    },
    /// `use_local_output = false`.
    #[error(
        "use_local_output = false asks for a DTensor output, which tch-dist does not have; \
         outputs are local tensors"
    )]
    DTensorOutput,
    /// A `PrepareModuleInput` / `PrepareModuleOutput` change of layout that tch-dist does
    /// not build (`Shard(0)` to `Shard(1)`: an all-to-all).
    #[error(
        "{style}: {which} {index}: {} to {} is not supported (a layout to itself, Shard(d) to \
         Replicate, Replicate to Shard(d), or None to leave the tensor alone)",
        LayoutName(from),
        LayoutName(to)
    )]
    Redistribute {
        /// The style's name.
        style: &'static str,
        /// `"input"` or `"output"`.
        which: &'static str,
        /// The tensor's position among the module's inputs or outputs.
        index: usize,
        /// Its layout (`input_layouts[index]`).
        from: Option<Layout>,
        /// The layout asked for (`desired_input_layouts[index]`).
        to: Option<Layout>,
    },
    /// `input_layouts` and `desired_input_layouts` (or the outputs') differ in length.
    #[error(
        "{style}: {layouts} {which}_layouts but {desired} desired_{which}_layouts; give one \
         of each per {which} (None for one to leave alone)"
    )]
    LayoutCount {
        /// The style's name.
        style: &'static str,
        /// `"input"` or `"output"`.
        which: &'static str,
        /// `input_layouts.len()`.
        layouts: usize,
        /// `desired_input_layouts.len()`.
        desired: usize,
    },
    /// Two plan entries for one module (PyTorch's plan is a dict: one style per module).
    #[error("is given two styles ({first} and {second}); a module takes one")]
    TwoStyles {
        /// The first entry's style.
        first: &'static str,
        /// The second's.
        second: &'static str,
    },
}

/// What each style supports, for [`StyleProblem::Layout`].
struct Supported<'a>(&'a str);

impl fmt::Display for Supported<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            "ColwiseParallel" => {
                "ColwiseParallel: input Replicate or, on a linear layer, Shard(d); output \
                 Shard(-1) or Replicate"
            }
            "RowwiseParallel" => {
                "RowwiseParallel: input Shard(-1) or Replicate (an embedding: Replicate); output \
                 Replicate or Shard(d)"
            }
            _ => "see parallelize_module's table",
        })
    }
}

/// A layout of `PrepareModuleInput` / `PrepareModuleOutput`, `None` by name.
struct LayoutName<'a>(&'a Option<Layout>);

impl fmt::Display for LayoutName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(l) => write!(f, "{l:?}"),
            None => f.write_str("None"),
        }
    }
}

/// What is wrong with one entry of a [`ShardingPlan`](crate::sharding::ShardingPlan) (or
/// with the key a [`ShardState`](crate::sharding::ShardState) method was given), checked
/// before anything changes. (Spec errors are boxed: they keep every `Result` of sharding
/// small.)
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PlanProblem {
    /// A spec's key is neither a parameter nor a module of the model.
    #[error("is not a parameter of the model")]
    NotAParameter,
    /// A sharder's key is neither a module nor a parameter of the model.
    #[error("is not a module of the model")]
    NotAModule,
    /// A spec's key names a module.
    #[error(
        "names a module, but a ShardingSpec shards a parameter; shard a module with a Sharder"
    )]
    SpecOnModule,
    /// A sharder's key names a parameter.
    #[error(
        "names a parameter, but a Sharder shards a module; shard a parameter with a \
         ShardingSpec"
    )]
    SharderOnParameter,
    /// A spec's placements name ranks outside the group (or a rank twice).
    #[error("placements do not match the group")]
    Placements {
        /// What the spec check said.
        source: Box<ShardingError>,
    },
    /// A spec does not fit its parameter's shape (its dim is out of range, ...).
    #[error("the spec does not fit the parameter's shape {shape:?}")]
    SpecShape {
        /// The parameter's shape.
        shape: Vec<i64>,
        /// What the spec check said.
        source: Box<ShardingError>,
    },
    /// A spec names a parameter other than a linear layer's `weight`.
    #[error(
        "only a linear layer's `weight` can be sharded by a spec (its forward is rewritten; \
         the bias follows the weight); `{name}` cannot"
    )]
    NotAWeight {
        /// The parameter's local name.
        name: String,
    },
    /// A linear layer's weight has an enumerable spec.
    #[error(
        "a linear layer's weight is sharded with a ChunkShardingSpec (dim 0: column-parallel, \
         dim 1: row-parallel); an EnumerableShardingSpec has no sharded forward"
    )]
    EnumerableWeightSpec,
    /// A weight spec's dim is not a dim of a linear layer's weight.
    #[error("dim {dim} out of range for a linear layer's weight of 2 dims")]
    WeightDim {
        /// The dim as given.
        dim: i64,
    },
    /// A parameter's module is missing from the model's module list.
    #[error("its module `{module}` is not in the model")]
    NoParentModule {
        /// The module's FQN.
        module: String,
    },
    /// A spec on `module`'s weight: the layer cannot be sharded so.
    #[error("`{module}`")]
    Layer {
        /// The layer's FQN.
        module: String,
        /// Why.
        source: SharderError,
    },
    /// A sharder refused the module ([`Sharder::check`](crate::sharding::Sharder::check)).
    #[error("{sharder}")]
    Sharder {
        /// The sharder's name.
        sharder: String,
        /// Why.
        source: SharderError,
    },
    /// A parameter spec inside a module that a sharder shards whole.
    #[error(
        "a parameter spec inside {}, which sharder `{sharder}` shards whole",
        Key(owner)
    )]
    SpecInsideSharder {
        /// The module the sharder owns.
        owner: String,
        /// The sharder's name.
        sharder: String,
    },
    /// A sharder inside a module that another sharder shards whole.
    #[error(
        "a sharder inside {}, which sharder `{sharder}` shards whole",
        Key(owner)
    )]
    SharderInsideSharder {
        /// The module the outer sharder owns.
        owner: String,
        /// The outer sharder's name.
        sharder: String,
    },
    /// Two entries shard the same module.
    #[error("is sharded by two plan entries")]
    ShardedTwice,
    /// An `output_plan` key is not a module of the model.
    #[error("output_plan names a module that is not in the model")]
    OutputNotAModule,
    /// An `output_plan` spec is not a chunk spec.
    #[error("output_plan: only a ChunkShardingSpec can lay out a module output")]
    OutputNotChunk,
    /// An `output_plan` spec's placements name ranks outside the group (or a rank twice).
    #[error("output_plan: placements do not match the group")]
    OutputPlacements {
        /// What the spec check said.
        source: Box<ShardingError>,
    },
    /// An `output_plan` spec does not put chunk `i` on rank `i`.
    #[error(
        "output_plan: an output is split into one chunk per rank, chunk i on rank i \
         ({world_size} placements, rank:0 first), not [{}]",
        Placements(placements)
    )]
    OutputChunkOrder {
        /// The spec's placements.
        placements: Vec<Placement>,
        /// The group's size.
        world_size: usize,
    },
    /// A `return_local_tensor` entry is not a module of the model.
    #[error("return_local_tensor names a module that is not in the model")]
    LocalNotAModule,
    /// A `return_local_tensor` module's output is whole on every rank and has no
    /// `output_plan` spec.
    #[error(
        "return_local_tensor: this module's output is not split across ranks; give it an \
         output_plan spec saying how"
    )]
    LocalNotSharded,
    /// The module needs a hook (for its output), and hooks cannot be registered on it.
    #[error("its output cannot be hooked")]
    Unhookable {
        /// Why.
        source: HookError,
    },
    /// The shards a sharder computed for a parameter do not form a valid layout.
    #[error("invalid shard layout")]
    Layout {
        /// What the layout check said.
        source: Box<ShardingError>,
    },
    /// A [`ShardState`](crate::sharding::ShardState) was asked for a parameter it did not shard.
    #[error("is not a sharded parameter")]
    NotSharded,
    /// A parameter of a planned module is already managed by a data-parallel API, whose
    /// shards or buckets splitting it would break: tensor parallelism comes first
    /// (`parallelize_module`, then `fully_shard` or `replicate`), as in PyTorch.
    #[error(
        "parameter `{param}` is already managed by {api}; apply tensor parallelism first, \
         then {api}"
    )]
    AlreadyManaged {
        /// The parameter, by its FQN in the model.
        param: String,
        /// The API managing it (`fully_shard` or `replicate`).
        api: &'static str,
    },
}

/// Placements joined by `, `.
pub(super) struct Placements<'a>(pub(super) &'a [Placement]);

impl fmt::Display for Placements<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}
