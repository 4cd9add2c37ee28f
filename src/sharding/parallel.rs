//! PyTorch's tensor-parallel API on a mesh dim (`torch.distributed.tensor.parallel`:
//! `parallelize_module`, `ColwiseParallel`, `RowwiseParallel`), translated into a
//! [`ShardingPlan`] of this module's linear sharders and applied by [`shard_module`]: the
//! same shards, hooks, checks and errors, keyed by the same typed paths or strings.
//!
//! | PyTorch | here |
//! |---|---|
//! | `ColwiseParallel()` (input replicated, output `Shard(-1)`, local) | [`ColwiseLinear`], its output this rank's columns (`return_local_tensor`) |
//! | `ColwiseParallel(output_layouts=Replicate())` | [`ColwiseLinear`], its output all-gathered |
//! | `RowwiseParallel()` (input `Shard(-1)`, output replicated) | [`RowwiseLinear`] (a whole input is sliced, a local one taken as is) |
//! | `RowwiseParallel(input_layouts=Replicate())` | the same sharder: it tells the two inputs apart by their width |
//! | `ColwiseParallel()` on an `nn.Embedding` | [`ColwiseEmbedding`]: the table split along the embedding dim, the output this rank's columns (or gathered, with `output_layouts=Replicate()`) |
//! | `RowwiseParallel(input_layouts=Replicate())` on an `nn.Embedding` (vocab-parallel; its default `Shard(-1)` input is refused: ids are not features) | [`RowwiseEmbedding`]: the table split along the vocabulary, other ranks' tokens zeroed, the outputs summed |

use std::sync::Arc;

use tch_dist_core::path::ModulePath;
use tch_dist_core::Shardable;

use super::embedding::{ColwiseEmbedding, RowwiseEmbedding};
use super::error::{ShardError, StyleProblem};
use super::plan::ShardingPlan;
use super::sharder::{ColwiseLinear, RowwiseLinear};
use super::{shard_module, ShardState};
use crate::device_mesh::DeviceMesh;

/// How a tensor is laid out over the mesh dim (PyTorch's `Placement`s `Replicate()` and
/// `Shard(dim)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The whole tensor on every rank.
    Replicate,
    /// This rank's chunk along `dim` (negative counts from the end).
    Shard(i64),
}

/// PyTorch's `ColwiseParallel`: a linear layer's weight split along its output features
/// (an embedding table's along its embedding dim).
///
/// ```
/// use tch_dist::sharding::{ColwiseParallel, Layout};
/// let c = ColwiseParallel::default();
/// assert_eq!((c.input_layouts, c.output_layouts, c.use_local_output), (Layout::Replicate, Layout::Shard(-1), true));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColwiseParallel {
    /// The input's layout: [`Layout::Replicate`] (the default; the only one supported).
    pub input_layouts: Layout,
    /// The output's: `Shard(-1)` (the default: this rank's columns) or `Replicate`
    /// (all-gathered).
    pub output_layouts: Layout,
    /// Hand on a plain local tensor (the default; tch-dist has no DTensor, so it must be
    /// `true`).
    pub use_local_output: bool,
}

impl Default for ColwiseParallel {
    fn default() -> Self {
        ColwiseParallel {
            input_layouts: Layout::Replicate,
            output_layouts: Layout::Shard(-1),
            use_local_output: true,
        }
    }
}

/// PyTorch's `RowwiseParallel`: a linear layer's weight split along its input features,
/// the partial sums all-reduced.
///
/// ```
/// use tch_dist::sharding::{Layout, RowwiseParallel};
/// let r = RowwiseParallel { input_layouts: Layout::Replicate, ..Default::default() };
/// assert_eq!(r.output_layouts, Layout::Replicate);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowwiseParallel {
    /// The input's layout: `Shard(-1)` (the default: a column-parallel layer's local
    /// output) or `Replicate` (sliced here).
    pub input_layouts: Layout,
    /// The output's: [`Layout::Replicate`] (the default; the only one supported).
    pub output_layouts: Layout,
    /// As [`ColwiseParallel::use_local_output`].
    pub use_local_output: bool,
}

impl Default for RowwiseParallel {
    fn default() -> Self {
        RowwiseParallel {
            input_layouts: Layout::Shard(-1),
            output_layouts: Layout::Replicate,
            use_local_output: true,
        }
    }
}

/// One entry of a [`ParallelizePlan`] (PyTorch's `ParallelStyle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParallelStyle {
    /// [`ColwiseParallel`].
    Colwise(ColwiseParallel),
    /// [`RowwiseParallel`].
    Rowwise(RowwiseParallel),
}

impl From<ColwiseParallel> for ParallelStyle {
    fn from(c: ColwiseParallel) -> Self {
        ParallelStyle::Colwise(c)
    }
}

impl From<RowwiseParallel> for ParallelStyle {
    fn from(r: RowwiseParallel) -> Self {
        ParallelStyle::Rowwise(r)
    }
}

/// PyTorch's `parallelize_plan`: module FQN (a typed path or a string) → style.
///
/// ```
/// use tch_dist::sharding::{ColwiseParallel, ParallelizePlan, RowwiseParallel};
/// let plan = ParallelizePlan::new()
///     .style("fc1", ColwiseParallel::default())
///     .style("fc2", RowwiseParallel::default());
/// assert_eq!(plan.len(), 2);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ParallelizePlan {
    entries: Vec<(String, ParallelStyle)>,
}

impl ParallelizePlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parallelizes `module` in `style`.
    pub fn style(mut self, module: impl ModulePath, style: impl Into<ParallelStyle>) -> Self {
        self.entries.push((module.fqn().to_string(), style.into()));
        self
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the plan is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Parallelizes `module`'s linear layers and embedding tables over a 1-D `mesh` (one dim of a larger one:
/// `mesh.dim("tp")?`) as `plan` says (PyTorch's `parallelize_module(module, mesh, plan)`),
/// with rank 0's values. Through [`shard_module`]: every plan check of it applies (a module
/// the model does not have, a style on a layer that is not linear), on every rank, before
/// anything changes; layouts tch-dist does not build are refused the same way.
///
/// ```no_run
/// use tch::nn;
/// use tch_dist::device_mesh::init_device_mesh;
/// use tch_dist::sharding::{parallelize_module, ColwiseParallel, ParallelizePlan, RowwiseParallel};
/// use tch_dist::{Call, Shardable};
///
/// #[derive(Debug, Shardable)]
/// struct Mlp { fc1: nn::Linear, fc2: nn::Linear }
/// impl nn::Module for Mlp {
///     fn forward(&self, xs: &tch::Tensor) -> tch::Tensor {
///         self.fc2.call(&self.fc1.call(xs).gelu("none"))
///     }
/// }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let mesh = init_device_mesh("cpu", &[2], &["tp"])?;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let mut mlp = Mlp {
///     fc1: nn::linear(vs.root() / "fc1", 16, 64, Default::default()),
///     fc2: nn::linear(vs.root() / "fc2", 64, 16, Default::default()),
/// };
/// let plan = ParallelizePlan::new()
///     .style(Mlp::path().fc1(), ColwiseParallel::default())
///     .style(Mlp::path().fc2(), RowwiseParallel::default());
/// parallelize_module(&mut mlp, &mesh, &plan)?;
/// # Ok(()) }
/// ```
pub fn parallelize_module<M: Shardable + ?Sized>(
    module: &mut M,
    mesh: &DeviceMesh,
    plan: &ParallelizePlan,
) -> Result<Arc<ShardState>, ShardError> {
    let rank = tch_dist_runtime::default_group().map_or(0, |g| g.rank());
    let refuse = |fqn: &str, problem| ShardError::Parallelize {
        rank,
        fqn: fqn.to_string(),
        problem,
    };
    let [group] = mesh.get_all_groups()[..] else {
        return Err(refuse("", StyleProblem::MeshDims { ndim: mesh.ndim() }));
    };
    // Which planned modules are embedding tables (sharded as PyTorch shards an
    // `nn.Embedding`: colwise on the embedding dim, rowwise on the vocabulary).
    let embeddings: std::collections::HashSet<String> = module
        .named_modules()
        .into_iter()
        .filter(|(_, m)| m.type_name().ends_with("::Embedding"))
        .map(|(fqn, _)| fqn)
        .collect();
    let mut builder = ShardingPlan::builder();
    for (fqn, style) in &plan.entries {
        let embedding = embeddings.contains(fqn);
        let unsupported = |style, which, layout| {
            refuse(
                fqn,
                StyleProblem::Layout {
                    style,
                    which,
                    layout,
                },
            )
        };
        match *style {
            ParallelStyle::Colwise(c) => {
                if c.input_layouts != Layout::Replicate {
                    return Err(unsupported("ColwiseParallel", "input", c.input_layouts));
                }
                if !c.use_local_output {
                    return Err(refuse(fqn, StyleProblem::DTensorOutput));
                }
                builder = if embedding {
                    builder.shard_module(fqn.as_str(), ColwiseEmbedding)
                } else {
                    builder.shard_module(fqn.as_str(), ColwiseLinear::default())
                };
                match c.output_layouts {
                    Layout::Replicate => {}
                    Layout::Shard(-1) => builder = builder.return_local_tensor(fqn.as_str()),
                    other => return Err(unsupported("ColwiseParallel", "output", other)),
                }
            }
            ParallelStyle::Rowwise(r) => {
                // An embedding's input is ids, never a slice of features.
                let inputs_allowed = if embedding {
                    r.input_layouts == Layout::Replicate
                } else {
                    matches!(r.input_layouts, Layout::Replicate | Layout::Shard(-1))
                };
                if !inputs_allowed {
                    return Err(unsupported("RowwiseParallel", "input", r.input_layouts));
                }
                if r.output_layouts != Layout::Replicate {
                    return Err(unsupported("RowwiseParallel", "output", r.output_layouts));
                }
                if !r.use_local_output {
                    return Err(refuse(fqn, StyleProblem::DTensorOutput));
                }
                builder = if embedding {
                    builder.shard_module(fqn.as_str(), RowwiseEmbedding)
                } else {
                    builder.shard_module(fqn.as_str(), RowwiseLinear)
                };
            }
        }
    }
    shard_module(module, &builder.build(), 0, group)
}
