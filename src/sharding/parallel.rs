//! PyTorch's tensor-parallel API on a mesh dim (`torch.distributed.tensor.parallel`:
//! `parallelize_module` and its styles), translated into a [`ShardingPlan`] of this
//! module's sharders and applied by [`shard_module`]: the same shards, hooks, checks and
//! errors, keyed by the same typed paths or strings. tch-dist has no DTensor: every
//! activation is a plain local tensor, laid out as the styles declare.
//!
//! What each style becomes: [`parallelize_module`]'s table.
//!
//! Under sequence parallelism the activations between the tensor-parallel regions are each
//! rank's even chunk of the sequence: a whole tensor split into chunks (a row-parallel
//! output, `Replicate` to `Shard(d)`) whose length the tensor-parallel size does not divide
//! is refused in the hook, on every rank ([`ForwardProblem::NotDivisible`](super::ForwardProblem::NotDivisible)).
//! The gradients follow Megatron's convention: the loss is computed alike on every rank
//! (from a replicated output), so a replicated activation's gradient is whole on every rank
//! and a chunk's is this rank's piece of it; the sharded parameters' gradients are the
//! unsharded model's shards, and the replicated ones' (norms, row-parallel biases under
//! `Shard` outputs) are the unsharded model's. A plain parameter of your own used on the
//! sequence chunks outside these styles gets this rank's part of its gradient only.

use std::sync::Arc;

use tch_dist_core::path::ModulePath;
use tch_dist_core::Shardable;

use super::embedding::{ColwiseEmbedding, RowwiseEmbedding};
use super::error::{ShardError, ShardProblem, StyleProblem};
use super::expert::ExpertSharder;
use super::plan::{PlanEntry, ShardingPlan};
use super::prepare::{GatherInput, Prepare, ReshardOutput, Side};
use super::sequence::{not_a_norm, SequenceParallelNorm};
use super::sharder::{ColwiseLinear, RowwiseLinear, Sharder};
use super::{shard_module, ShardState};
use crate::device_mesh::DeviceMesh;
use tch_dist_runtime::ProcessGroup;

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
    /// The input's layout: [`Layout::Replicate`] (the default), or on a linear layer
    /// `Shard(d)` (this rank's even piece along `d`, all-gathered before the layer: a
    /// sequence-sharded input, `Shard(1)`).
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
    /// The output's: [`Layout::Replicate`] (the default: the partial sums all-reduced) or
    /// `Shard(d)` (reduce-scattered: this rank's even piece along `d`, `Shard(1)` under
    /// sequence parallelism).
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

/// PyTorch's `SequenceParallel` on a norm over each token's features (`nn::LayerNorm`, an
/// RMSNorm of your own: no submodules or buffers, one-dimensional parameters): the input is
/// this rank's chunk of the sequence (`torch.chunk` along `sequence_dim`), and so is the
/// output; the parameters stay whole on every rank, and their gradients are summed over the
/// tensor-parallel group before they are accumulated (PyTorch: the `Partial` gradient of a
/// `Replicate` parameter). Their values are the source rank's, as every parameter's that
/// no style shards (`shard_module` broadcasts them; PyTorch leaves them as each rank has
/// them).
///
/// ```
/// use tch_dist::sharding::SequenceParallel;
/// let s = SequenceParallel::default();
/// assert_eq!((s.sequence_dim, s.use_local_output), (1, false));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceParallel {
    /// The sequence dim of the norm's input (default 1: `[batch, sequence, features]`).
    pub sequence_dim: i64,
    /// PyTorch's default, `false`, hands on a DTensor whose local tensor is this rank's
    /// chunk; tch-dist has no DTensor, so either value hands on the local chunk, and the next
    /// style declares it (`PrepareModuleInput(input_layouts=Shard(1))`).
    pub use_local_output: bool,
}

impl Default for SequenceParallel {
    fn default() -> Self {
        SequenceParallel {
            sequence_dim: 1,
            use_local_output: false,
        }
    }
}

/// PyTorch's `PrepareModuleInput` on any module (an attention block called with several
/// inputs through `call_with`): before each call, positional input `i` is changed from
/// `input_layouts[i]` to `desired_input_layouts[i]` (`Shard(d)` to `Replicate`: all-gathered
/// along `d`; `Replicate` to `Shard(d)`: this rank's even chunk; the same layout, or `None`
/// on either side: left alone). A call with another number of inputs is an error. The
/// module's submodules take their own styles.
///
/// ```
/// use tch_dist::sharding::{Layout, PrepareModuleInput};
/// // torchtitan's attention: the hidden states gathered, the rotary table left alone.
/// let p = PrepareModuleInput::new(
///     [Some(Layout::Shard(1)), None],
///     [Some(Layout::Replicate), None],
/// );
/// assert!(!p.use_local_output);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareModuleInput {
    /// Each positional input's layout (`None`: leave it alone).
    pub input_layouts: Vec<Option<Layout>>,
    /// The layout each is changed to, as many (`None`: leave it alone).
    pub desired_input_layouts: Vec<Option<Layout>>,
    /// As [`SequenceParallel::use_local_output`] (PyTorch's default `false`; either value
    /// hands on local tensors).
    pub use_local_output: bool,
}

impl PrepareModuleInput {
    /// Changes the inputs from `input_layouts` to `desired_input_layouts`, PyTorch's default
    /// `use_local_output = false`.
    pub fn new(
        input_layouts: impl IntoIterator<Item = Option<Layout>>,
        desired_input_layouts: impl IntoIterator<Item = Option<Layout>>,
    ) -> Self {
        PrepareModuleInput {
            input_layouts: input_layouts.into_iter().collect(),
            desired_input_layouts: desired_input_layouts.into_iter().collect(),
            use_local_output: false,
        }
    }
}

/// PyTorch's `PrepareModuleOutput` on any module: after each call, output `i` is changed
/// from `output_layouts[i]` to `desired_output_layouts[i]`, as [`PrepareModuleInput`]
/// changes inputs. A call with another number of outputs is an error.
///
/// ```
/// use tch_dist::sharding::{Layout, PrepareModuleOutput};
/// // A block whose replicated output goes on as this rank's chunk of the sequence.
/// let p = PrepareModuleOutput::new([Some(Layout::Replicate)], [Some(Layout::Shard(1))]);
/// assert!(p.use_local_output);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareModuleOutput {
    /// Each output's layout (`None`: leave it alone).
    pub output_layouts: Vec<Option<Layout>>,
    /// The layout each is changed to, as many.
    pub desired_output_layouts: Vec<Option<Layout>>,
    /// PyTorch's default, `true`; either value hands on local tensors.
    pub use_local_output: bool,
}

impl PrepareModuleOutput {
    /// Changes the outputs from `output_layouts` to `desired_output_layouts`.
    pub fn new(
        output_layouts: impl IntoIterator<Item = Option<Layout>>,
        desired_output_layouts: impl IntoIterator<Item = Option<Layout>>,
    ) -> Self {
        PrepareModuleOutput {
            output_layouts: output_layouts.into_iter().collect(),
            desired_output_layouts: desired_output_layouts.into_iter().collect(),
            use_local_output: true,
        }
    }
}

/// torchtitan's `ExpertParallel` on grouped experts ([`GroupedExperts`](crate::nn::moe::GroupedExperts):
/// 3-D `w1`, `w2`, `w3`), over the mesh dim `ep`: each rank keeps `experts / ranks` of them
/// (rank `r` experts `r·E/ranks ..`, rank 0's values), and every call's rows go to the rank
/// holding their expert and back, by all-to-all of variable sizes (the counts first, then
/// the rows; backward the reverse). The experts' gradients gather every rank's rows and
/// are divided by the ranks: the gradients of the mean of the ranks' losses, as
/// `replicate` or `fully_shard` over the same ranks average every other parameter's, and
/// those leave the experts alone. The experts must be called with the rows grouped by
/// expert and the rows per expert, as [`MoE`](crate::nn::moe::MoE) calls them.
///
/// ```no_run
/// use tch_dist::device_mesh::init_device_mesh;
/// use tch_dist::nn::moe::{MoE, MoeConfig};
/// use tch_dist::sharding::{parallelize_module, ExpertParallel, ParallelizePlan};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 2 ranks
/// let mesh = init_device_mesh("cpu", &[2], &["ep"])?;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let mut moe = MoE::new(&vs.root() / "moe", MoeConfig::new(16, 32, 8, 2))?;
/// let plan = ParallelizePlan::new().style("experts", ExpertParallel);
/// parallelize_module(&mut moe, &mesh, &plan)?; // 4 experts on each rank
/// let r = mesh.get_local_rank("ep")? as i64;
/// assert_eq!(moe.local_experts(), 4 * r..4 * r + 4);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpertParallel;

/// torchtitan's `ExpertTensorParallel` on grouped experts, over a 2-D mesh `["ep", "tp"]`:
/// [`ExpertParallel`] over `ep`, and each expert's hidden width split over `tp` (`w1` and
/// `w3` column-parallel, `w2` row-parallel; tp rank 0's values). The tp ranks of an ep rank
/// hold the same tokens (a tensor-parallel model's activations): each computes its slice of
/// every expert's hidden width, the results are summed over `tp` (backward: the rows'
/// gradient summed over `tp`), and the experts' gradients are each tp rank's slice of the
/// ep-averaged gradient. The weights' placements are `[Shard(0), Shard(1 or 2)]` on the
/// mesh, which the state dict and checkpoints gather and place.
///
/// ```no_run
/// use tch_dist::device_mesh::init_device_mesh;
/// use tch_dist::nn::moe::{MoE, MoeConfig};
/// use tch_dist::sharding::{parallelize_module, ExpertTensorParallel, ParallelizePlan};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?; // 4 ranks
/// let mesh = init_device_mesh("cpu", &[2, 2], &["ep", "tp"])?;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let mut moe = MoE::new(&vs.root() / "moe", MoeConfig::new(16, 32, 8, 2))?;
/// let plan = ParallelizePlan::new().style("experts", ExpertTensorParallel);
/// parallelize_module(&mut moe, &mesh, &plan)?; // 4 experts of hidden width 16 on each rank
/// assert_eq!(moe.experts.w1.size(), [4, 16, 16]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpertTensorParallel;

/// One entry of a [`ParallelizePlan`] (PyTorch's `ParallelStyle`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParallelStyle {
    /// [`ColwiseParallel`].
    Colwise(ColwiseParallel),
    /// [`RowwiseParallel`].
    Rowwise(RowwiseParallel),
    /// [`SequenceParallel`].
    Sequence(SequenceParallel),
    /// [`PrepareModuleInput`].
    PrepareInput(PrepareModuleInput),
    /// [`PrepareModuleOutput`].
    PrepareOutput(PrepareModuleOutput),
    /// [`ExpertParallel`].
    Expert(ExpertParallel),
    /// [`ExpertTensorParallel`] (on a 2-D mesh `["ep", "tp"]`).
    ExpertTensor(ExpertTensorParallel),
}

impl ParallelStyle {
    /// PyTorch's name of the style.
    fn name(&self) -> &'static str {
        match self {
            ParallelStyle::Colwise(_) => "ColwiseParallel",
            ParallelStyle::Rowwise(_) => "RowwiseParallel",
            ParallelStyle::Sequence(_) => "SequenceParallel",
            ParallelStyle::PrepareInput(_) => "PrepareModuleInput",
            ParallelStyle::PrepareOutput(_) => "PrepareModuleOutput",
            ParallelStyle::Expert(_) => "ExpertParallel",
            ParallelStyle::ExpertTensor(_) => "ExpertTensorParallel",
        }
    }
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

impl From<SequenceParallel> for ParallelStyle {
    fn from(s: SequenceParallel) -> Self {
        ParallelStyle::Sequence(s)
    }
}

impl From<PrepareModuleInput> for ParallelStyle {
    fn from(p: PrepareModuleInput) -> Self {
        ParallelStyle::PrepareInput(p)
    }
}

impl From<ExpertParallel> for ParallelStyle {
    fn from(e: ExpertParallel) -> Self {
        ParallelStyle::Expert(e)
    }
}

impl From<ExpertTensorParallel> for ParallelStyle {
    fn from(e: ExpertTensorParallel) -> Self {
        ParallelStyle::ExpertTensor(e)
    }
}

impl From<PrepareModuleOutput> for ParallelStyle {
    fn from(p: PrepareModuleOutput) -> Self {
        ParallelStyle::PrepareOutput(p)
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

/// Parallelizes `module`'s layers over a 1-D `mesh` (one dim of a larger one:
/// `mesh.dim("tp")?`) as `plan` says (PyTorch's `parallelize_module(module, mesh, plan)`),
/// with rank 0's values. Through [`shard_module`]: every plan check of it applies (a module
/// the model does not have, a style on a layer it does not fit), on every rank, before
/// anything changes; layouts tch-dist does not build, and two styles on one module, are
/// refused the same way. What each style becomes:
///
/// | PyTorch | here |
/// |---|---|
/// | `ColwiseParallel()` (input replicated, output `Shard(-1)`, local) | [`ColwiseLinear`], its output this rank's columns (`return_local_tensor`) |
/// | `ColwiseParallel(output_layouts=Replicate())` | [`ColwiseLinear`], its output all-gathered |
/// | `ColwiseParallel(input_layouts=Shard(1))` (torchtitan's output head) | the input's pieces all-gathered along dim 1 first; backward: the input gradient summed over the ranks, this rank's piece kept (a reduce-scatter) |
/// | `RowwiseParallel()` (input `Shard(-1)`, output replicated) | [`RowwiseLinear`] (a whole input is sliced, a local one taken as is) |
/// | `RowwiseParallel(input_layouts=Replicate())` | the same sharder: it tells the two inputs apart by their width |
/// | `RowwiseParallel(output_layouts=Shard(1))` (sequence parallelism's `wo`, `w2`) | the partial sums reduce-scattered along dim 1, the bias added once to this rank's piece (its gradient summed over the ranks); backward: the pieces' gradients all-gathered, undivided |
/// | `ColwiseParallel()` on an `nn.Embedding` | [`ColwiseEmbedding`]: the table split along the embedding dim, the output this rank's columns (or gathered, with `output_layouts=Replicate()`) |
/// | `RowwiseParallel(input_layouts=Replicate())` on an `nn.Embedding` (vocab-parallel; its default `Shard(-1)` input is refused: ids are not features) | [`RowwiseEmbedding`]: the table split along the vocabulary, other ranks' tokens zeroed, the outputs summed (reduce-scattered along dim 1 with `output_layouts=Shard(1)`: torchtitan's `tok_embeddings`) |
/// | `SequenceParallel()` on a norm (`nn::LayerNorm`, an RMSNorm) | the input and output this rank's chunk of the sequence (`torch.chunk` along `sequence_dim`), the parameters whole, their gradients summed over the ranks before they are accumulated |
/// | `PrepareModuleInput(input_layouts, desired_input_layouts)` on any module | each positional input changed by a forward pre-hook: `Shard(d)` to `Replicate` all-gathers along `d` (backward: this rank's piece of the gradient), `Replicate` to `Shard(d)` keeps this rank's chunk (backward: all-gather), `None` leaves the input alone |
/// | `PrepareModuleOutput(output_layouts, desired_output_layouts)` | the same, on the outputs, by a forward hook |
/// | torchtitan's `ExpertParallel()` on `GroupedExperts` (over the `ep` dim) | [`ExpertSharder`]: the experts split along dim 0, the rows sent to their experts' ranks and back by all-to-all |
/// | torchtitan's `ExpertTensorParallel()` (over a 2-D `["ep", "tp"]` mesh, the plan's only style) | [`ExpertSharder`] with `tensor_parallel`: as above, each expert's hidden width split over `tp` too, the results summed over it |
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
///
/// Sequence parallelism (torchtitan's plan for a Llama block; `norm` is an RMSNorm, `attn`
/// is called as `self.attn.call_with([&h, &mask], ..)`):
///
/// ```no_run
/// use tch_dist::sharding::{
///     ColwiseParallel, Layout, ParallelizePlan, PrepareModuleInput, RowwiseParallel,
///     SequenceParallel,
/// };
/// let seq = Layout::Shard(1);
/// let plan = ParallelizePlan::new()
///     .style("tok", RowwiseParallel { input_layouts: Layout::Replicate, output_layouts: seq, ..Default::default() })
///     .style("attn_norm", SequenceParallel::default())
///     .style("attn", PrepareModuleInput::new([Some(seq), None], [Some(Layout::Replicate), None]))
///     .style("attn.wq", ColwiseParallel::default())
///     .style("attn.wo", RowwiseParallel { output_layouts: seq, ..Default::default() })
///     .style("head", ColwiseParallel { input_layouts: seq, output_layouts: Layout::Replicate, ..Default::default() });
/// ```
pub fn parallelize_module<M: Shardable + ?Sized>(
    module: &mut M,
    mesh: &DeviceMesh,
    plan: &ParallelizePlan,
) -> Result<Arc<ShardState>, ShardError> {
    let rank = tch_dist_runtime::default_group().map_or(0, |g| g.rank());
    let refuse = |fqn: &str, problem| {
        let fqn = fqn.to_string();
        ShardProblem::Parallelize { fqn, problem }.on(rank)
    };
    // A 1-D mesh, or torchtitan's ["ep", "tp"] for a plan of ExpertTensorParallel only.
    let expert_tensor = !plan.entries.is_empty()
        && plan
            .entries
            .iter()
            .all(|(_, s)| matches!(s, ParallelStyle::ExpertTensor(_)));
    let (group, tp) = match (&mesh.get_all_groups()[..], expert_tensor) {
        ([group], false) => (*group, None),
        ([ep, tp], true) => (*ep, Some(*tp)),
        _ => {
            let ndim = mesh.ndim();
            return Err(refuse("", StyleProblem::MeshDims { ndim }));
        }
    };
    let modules: std::collections::BTreeMap<String, &dyn Shardable> =
        module.named_modules().into_iter().collect();
    let mut sharded = ShardingPlan::default();
    let mut styles: std::collections::BTreeMap<&str, &'static str> = Default::default();
    for (fqn, style) in &plan.entries {
        if let Some(first) = styles.insert(fqn, style.name()) {
            let second = style.name();
            return Err(refuse(fqn, StyleProblem::TwoStyles { first, second }));
        }
        let m = modules.get(fqn.as_str()).copied();
        // Which planned modules are embedding tables (sharded as PyTorch shards an
        // `nn.Embedding`: colwise on the embedding dim, rowwise on the vocabulary).
        let embedding = m.is_some_and(|m| m.type_name().ends_with("::Embedding"));
        let sharder = match style_sharder(style, embedding, m, tp) {
            Ok(Some(s)) => s,
            Ok(None) => continue,
            Err(problem) => return Err(refuse(fqn, problem)),
        };
        sharded
            .plan
            .insert(fqn.clone(), PlanEntry::Sharder(sharder));
        if let ParallelStyle::Colwise(ColwiseParallel {
            output_layouts: Layout::Shard(-1),
            ..
        }) = style
        {
            sharded.return_local_tensor.push(fqn.clone());
        }
    }
    shard_module(module, &sharded, 0, group)
}

/// The sharder of one style on module `m` (`None`: the module is not in the model, which
/// `shard_module` reports), or `Ok(None)` when there is nothing to do (a sequence-parallel
/// norm without parameters), or what tch-dist does not build.
fn style_sharder(
    style: &ParallelStyle,
    embedding: bool,
    m: Option<&dyn Shardable>,
    tp: Option<&ProcessGroup>,
) -> Result<Option<Arc<dyn Sharder>>, StyleProblem> {
    let unsupported = |style, which, layout| StyleProblem::Layout {
        style,
        which,
        layout,
    };
    Ok(Some(match style {
        ParallelStyle::Colwise(c) => {
            if !c.use_local_output {
                return Err(StyleProblem::DTensorOutput);
            }
            if !matches!(c.output_layouts, Layout::Replicate | Layout::Shard(-1)) {
                return Err(unsupported("ColwiseParallel", "output", c.output_layouts));
            }
            match (c.input_layouts, embedding) {
                (Layout::Replicate, true) => Arc::new(ColwiseEmbedding),
                (Layout::Replicate, false) => Arc::new(ColwiseLinear::default()),
                (Layout::Shard(dim), false) => Arc::new(GatherInput {
                    inner: ColwiseLinear::default(),
                    dim,
                }),
                (other, true) => return Err(unsupported("ColwiseParallel", "input", other)),
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
            if !r.use_local_output {
                return Err(StyleProblem::DTensorOutput);
            }
            match (r.output_layouts, embedding) {
                (Layout::Replicate, true) => Arc::new(RowwiseEmbedding),
                (Layout::Replicate, false) => Arc::new(RowwiseLinear),
                (Layout::Shard(dim), true) => Arc::new(ReshardOutput {
                    inner: RowwiseEmbedding,
                    dim,
                }),
                (Layout::Shard(dim), false) => Arc::new(ReshardOutput {
                    inner: RowwiseLinear,
                    dim,
                }),
            }
        }
        ParallelStyle::Sequence(s) => {
            // A norm without parameters (no affine) computes per token: nothing to do,
            // once it is known to be a norm (the sharder's check says why not, otherwise).
            if let Some(m) = m
                && m.named_parameters().is_empty()
                && not_a_norm(m).is_none()
            {
                return Ok(None);
            }
            Arc::new(SequenceParallelNorm {
                sequence_dim: s.sequence_dim,
            })
        }
        ParallelStyle::PrepareInput(p) => Arc::new(Prepare::new(
            Side::Input,
            &p.input_layouts,
            &p.desired_input_layouts,
        )?),
        ParallelStyle::PrepareOutput(p) => Arc::new(Prepare::new(
            Side::Output,
            &p.output_layouts,
            &p.desired_output_layouts,
        )?),
        ParallelStyle::Expert(ExpertParallel) => Arc::new(ExpertSharder::default()),
        ParallelStyle::ExpertTensor(ExpertTensorParallel) => Arc::new(ExpertSharder {
            tensor_parallel: tp.cloned(),
        }),
    }))
}
