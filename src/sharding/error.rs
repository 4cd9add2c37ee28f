//! The errors of tensor parallelism: [`ShardError`] (what [`shard_module`](super::shard_module),
//! the sharders and the sharded layers' hooks fail with), [`PlanProblem`] (what is wrong with
//! one plan entry), [`SharderError`] (why a [`Sharder`](super::Sharder) refuses a module) and
//! [`ForwardProblem`] (why a sharded layer's forward hook failed).
//!
//! Every message names the rank, the operation (`shard_module`) and the FQN at fault once.
//! Plan errors read `rank R: shard_module: `FQN`: what`; a failing hook reads
//! `shard_module: <part> `FQN` on rank R: what`, as PyTorch's module call raises it.
//!
//! One rule (see [`report`](crate::report)): a variant's Display names only its own context,
//! and what went wrong inside it is its [`source`](std::error::Error::source): the plan
//! entry's [`PlanProblem`], the spec check's [`ShardingError`], the [`DistError`] of a failed
//! collective. `report(&err)` gives the whole text. A [`DistError`] names its rank itself, so
//! the context around it does not.

use std::fmt;
use std::sync::Arc;

use tch_dist_core::hooks::HookError;
use tch_dist_core::sharding::{Placement, ShardingError};
use tch_dist_core::ContractError;
use tch_dist_runtime::{ArgumentError, DistError, ProcessGroup};

/// Errors of [`shard_module`](super::shard_module), of the sharders and of the sharded
/// layers' forward hooks (which hand them to [`ForwardError`](crate::ForwardError): a
/// caller of `f_call` gets them back with
/// [`ForwardError::downcast_ref`](crate::ForwardError::downcast_ref)).
///
/// ```
/// use tch_dist::sharding::{PlanProblem, ShardError};
/// let e = ShardError::Plan { rank: 1, fqn: "fc3.weight".into(), problem: PlanProblem::NotAParameter };
/// assert_eq!(e.to_string(), "rank 1: shard_module: `fc3.weight`");
/// assert_eq!(
///     tch_dist::report(&e),
///     "rank 1: shard_module: `fc3.weight`: is not a parameter of the model"
/// );
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// The plan does not fit the model or the group; nothing was changed.
    #[error("rank {rank}: shard_module: {}", Key(fqn))]
    Plan {
        /// This rank.
        rank: usize,
        /// The plan key (FQN) at fault (`""`: the root module).
        fqn: String,
        /// What is wrong.
        #[source]
        problem: PlanProblem,
    },
    /// [`parallelize_module`](super::parallelize_module)'s mesh or plan asks for what
    /// tch-dist does not build; nothing was changed.
    #[error("rank {rank}: parallelize_module: {}", Key(fqn))]
    Parallelize {
        /// This rank.
        rank: usize,
        /// The plan key (FQN) at fault (`""`: the mesh).
        fqn: String,
        /// What is wrong.
        #[source]
        problem: StyleProblem,
    },
    /// An argument of [`shard_module`](super::shard_module) is out of range (`src_rank`);
    /// nothing was changed.
    #[error("rank {rank}: shard_module")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// What is wrong.
        #[source]
        problem: ArgumentError,
    },
    /// The engine failed while sharding `fqn` (scattering or broadcasting its values, or
    /// rebuilding a sharded tensor); the modules sharded before it stay sharded.
    #[error("{}shard_module: {}", RankUnlessNamed(source, *rank), Key(fqn))]
    Dist {
        /// This rank (named here unless the source names it).
        rank: usize,
        /// The module or parameter being sharded.
        fqn: String,
        /// What the engine said.
        source: DistError,
    },
    /// A sharded module's forward hook failed: the module call (`f_call`) returns this
    /// error inside a [`ForwardError`](crate::ForwardError), `call` panics with its message.
    #[error("shard_module: {site} {}{}", Key(fqn), Detail(problem, *rank))]
    Forward {
        /// This rank.
        rank: usize,
        /// The module whose hook failed.
        fqn: String,
        /// Which of its hooks.
        site: HookSite,
        /// What went wrong.
        problem: ForwardProblem,
    },
    /// A module `shard_module` hooked ran without its hooks: `param` was used (in the
    /// autograd graph) outside a call of `module` through them, where this rank's shard
    /// alone gives a wrong result. Raised by the check of the sharded model's call (`f_call`
    /// returns it in a [`ForwardError`](crate::ForwardError)) or, as its message, by the
    /// backward pass, before any guarded parameter gets a gradient.
    #[error(
        "rank {rank}: shard_module: parameter `{param}` of {} was used outside a call of the \
         module through its forward hooks, where this rank's shard alone gives a wrong result; \
         {} (a deliberate direct use goes in ShardState::allow_direct_use)",
        Key(module),
        Fix(module)
    )]
    HooksBypassed {
        /// This rank.
        rank: usize,
        /// The hooked module.
        module: String,
        /// The parameter used outside its calls (its FQN).
        param: String,
    },
    /// Summing a sequence-parallel parameter's gradient over the tensor-parallel group
    /// failed: the backward pass fails with this message.
    #[error(
        "{}shard_module: sequence-parallel parameter `{param}`: summing its gradient over the \
         tensor-parallel group failed",
        RankUnlessNamed(source, *rank)
    )]
    GradientSum {
        /// This rank (named here unless the source names it).
        rank: usize,
        /// The parameter (its FQN).
        param: String,
        /// What the engine said.
        source: DistError,
    },
    /// Applied twice, or the module's names changed (the message names `shard_module`).
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// The ranks disagree: their plans differ, or a check failed on other ranks; nothing
    /// was changed on any rank.
    #[error(transparent)]
    Disagreement {
        /// What every rank shares ([`DistError::Mismatch`] naming the plan entry and each
        /// rank's value, or [`DistError::PeersFailed`] naming the ranks whose check failed).
        source: DistError,
    },
}

impl ShardError {
    /// A plan error of this rank of `group`.
    pub fn plan(group: &ProcessGroup, fqn: &str, problem: PlanProblem) -> ShardError {
        ShardError::Plan {
            rank: group.rank(),
            fqn: fqn.to_string(),
            problem,
        }
    }

    /// `fqn`'s hooks could not be registered, on this rank of `group`.
    pub(crate) fn unhookable(group: &ProcessGroup, fqn: &str, source: HookError) -> ShardError {
        ShardError::plan(group, fqn, PlanProblem::Unhookable { source })
    }

    /// An engine failure of this rank of `group` while sharding `fqn` (for a
    /// [`Sharder`](super::Sharder)'s collectives).
    pub fn dist(group: &ProcessGroup, fqn: &str, source: DistError) -> ShardError {
        ShardError::Dist {
            rank: group.rank(),
            fqn: fqn.to_string(),
            source,
        }
    }

    pub(crate) fn forward(
        group: &ProcessGroup,
        fqn: &str,
        site: HookSite,
        problem: ForwardProblem,
    ) -> ShardError {
        ShardError::Forward {
            rank: group.rank(),
            fqn: fqn.to_string(),
            site,
            problem,
        }
    }
}

/// What [`parallelize_module`](super::parallelize_module) does not build
/// ([`ShardError::Parallelize`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StyleProblem {
    /// The mesh is not 1-D.
    #[error(
        "the mesh has {ndim} dims; parallelize_module takes a 1-D mesh (one dim of it: \
         `mesh.dim(\"tp\")`)"
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
        layout: super::parallel::Layout,
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
        from: Option<super::parallel::Layout>,
        /// The layout asked for (`desired_input_layouts[index]`).
        to: Option<super::parallel::Layout>,
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
struct LayoutName<'a>(&'a Option<super::parallel::Layout>);

impl fmt::Display for LayoutName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(l) => write!(f, "{l:?}"),
            None => f.write_str("None"),
        }
    }
}

/// What is wrong with one entry of a [`ShardingPlan`](super::ShardingPlan) (or with the key
/// a [`ShardState`](super::ShardState) method was given), checked before anything changes.
/// (Spec errors are boxed: they keep every `Result` of sharding small.)
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
    /// A sharder refused the module ([`Sharder::check`](super::Sharder::check)).
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
    /// A [`ShardState`](super::ShardState) was asked for a parameter it did not shard.
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

/// Why a [`Sharder`](super::Sharder) refuses a module: the built-in linear sharders' reasons,
/// and [`Custom`](SharderError::Custom) for third-party sharders.
///
/// ```
/// use tch_dist::sharding::SharderError;
/// #[derive(Debug, thiserror::Error)]
/// #[error("an embedding needs {0} rows per rank")]
/// struct TooFewRows(usize);
/// let e = SharderError::custom(TooFewRows(2));
/// assert_eq!(e.to_string(), "an embedding needs 2 rows per rank");
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum SharderError {
    /// A linear sharder got a module with a submodule.
    #[error(
        "a linear sharder needs a linear layer (`weight` and optional `bias`), but this \
         `{kind}` has a submodule `{child}`"
    )]
    Submodule {
        /// The module's type name.
        kind: &'static str,
        /// The submodule's FQN within it.
        child: String,
    },
    /// A linear sharder got a module with a parameter other than `weight` and `bias`.
    #[error(
        "a linear sharder needs a linear layer (`weight` and optional `bias`), but this \
         `{kind}` has a parameter `{name}`"
    )]
    ExtraParameter {
        /// The module's type name.
        kind: &'static str,
        /// The parameter.
        name: String,
    },
    /// A linear sharder got a module without `weight`.
    #[error("this `{kind}` has no `weight` parameter")]
    NoWeight {
        /// The module's type name.
        kind: &'static str,
    },
    /// `weight` is not a matrix.
    #[error(
        "`weight` has shape {shape:?}; a linear layer's weight is [out_features, in_features]"
    )]
    WeightShape {
        /// Its shape.
        shape: Vec<i64>,
    },
    /// `bias` does not match `weight`'s output features.
    #[error(
        "`bias` has shape {shape:?}; expected [{}] for a weight of shape {weight:?}",
        weight.first().copied().unwrap_or(0)
    )]
    BiasShape {
        /// The bias's shape.
        shape: Vec<i64>,
        /// The weight's shape.
        weight: Vec<i64>,
    },
    /// A linear layer's spec does not put chunk `i` on rank `i` of the group.
    #[error(
        "placements [{}] do not match the group of {world_size} ranks: a linear layer is split \
         into one chunk per rank, chunk i on rank i",
        Placements(placements)
    )]
    Placements {
        /// The spec's placements.
        placements: Vec<Placement>,
        /// The group's size.
        world_size: usize,
    },
    /// An embedding sharder got a module that is not an embedding table (one `weight`
    /// `[num_embeddings, embedding_dim]`, no submodule).
    #[error(
        "an embedding sharder needs an embedding table (one `weight` [num_embeddings, \
         embedding_dim]), but this `{kind}` has {found}"
    )]
    NotAnEmbedding {
        /// The module's type name.
        kind: &'static str,
        /// What it has instead (`a parameter `bias``).
        found: String,
    },
    /// SequenceParallel got a module that is not a norm over each token's features.
    #[error(
        "SequenceParallel needs a norm over each token's features (no submodules or buffers, \
         one-dimensional parameters: LayerNorm, an RMSNorm), but this `{kind}` {found}"
    )]
    NotANorm {
        /// The module's type name.
        kind: &'static str,
        /// What it is or has instead (`has a parameter `weight` of shape [4, 8]`).
        found: String,
    },
    /// `ColwiseLinear { fused: 0 }`.
    #[error("fused must be at least 1")]
    ZeroFused,
    /// A fused layer's output features do not split into its parts.
    #[error("`weight` has {out_features} output features, not divisible into fused={fused} parts")]
    NotDivisible {
        /// The weight's output features.
        out_features: i64,
        /// The number of parts.
        fused: usize,
    },
    /// A third-party sharder's own reason.
    #[error(transparent)]
    Custom(Arc<dyn std::error::Error + Send + Sync>),
}

impl SharderError {
    /// A third-party sharder's reason, kept whole ([`Custom`](SharderError::Custom)).
    pub fn custom(error: impl std::error::Error + Send + Sync + 'static) -> SharderError {
        SharderError::Custom(Arc::new(error))
    }
}

/// Which hook of a sharded module failed (the part of the message before its FQN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HookSite {
    /// A column-parallel layer's input hook.
    ColumnParallel,
    /// A row-parallel layer's input hook.
    RowParallel,
    /// The output hook that restores or reshards a module's output.
    Output,
    /// A vocab-parallel embedding's hooks (the ids' mapping to this rank's rows, the mask).
    VocabParallel,
    /// A sequence-parallel norm's input hook.
    SequenceParallel,
    /// `PrepareModuleInput`'s hook.
    Input,
}

impl fmt::Display for HookSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HookSite::ColumnParallel => "column-parallel",
            HookSite::RowParallel => "row-parallel",
            HookSite::Output => "output of",
            HookSite::VocabParallel => "vocab-parallel",
            HookSite::SequenceParallel => "sequence-parallel",
            HookSite::Input => "input of",
        })
    }
}

/// Why a sharded module's forward hook failed (the `problem` of [`ShardError::Forward`]).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ForwardProblem {
    /// A row-parallel layer's input is neither its whole input width nor this rank's slice.
    #[error("expects {full} input features (or its slice of {local}), got {width}")]
    InputWidth {
        /// The layer's input features.
        full: i64,
        /// This rank's slice of them.
        local: i64,
        /// The input's last dim.
        width: i64,
    },
    /// The `output_plan` spec's dim is not a dim of the module's output.
    #[error("output_plan's dim {dim} is out of range for an output of {ndim} dims")]
    OutputDim {
        /// The spec's dim.
        dim: i64,
        /// The output's number of dims.
        ndim: usize,
    },
    /// A module whose output the plan changes returned several outputs (a tuple): a layout
    /// describes one.
    #[error("the plan describes one output, the call returned {got}")]
    Outputs {
        /// How many outputs the call returned.
        got: usize,
    },
    /// A vocab-parallel embedding was called with something other than integer ids.
    #[error("expects integer ids (Int64 or Int), got {dtype}")]
    NotIds {
        /// The input's dtype.
        dtype: String,
    },
    /// An id outside the whole table: no rank holds its row, so its embedding would be
    /// zero without a word (one table raises on it too).
    #[error("id {id} is outside the table of {vocab} embeddings")]
    IdOutOfRange {
        /// The first such id.
        id: i64,
        /// The table's rows.
        vocab: i64,
    },
    /// A vocab-parallel embedding's output hook ran without its input hook (the call's mask
    /// is missing).
    #[error("the lookup ran without its input hook, so its tokens of other ranks are not masked")]
    LookupWithoutInputHook,
    /// A whole tensor to be split evenly along `dim` over the tensor-parallel group (a
    /// `Shard(dim)` layout: the sequence, under sequence parallelism) has a length the group's
    /// size does not divide. Every rank has the same shapes, so every rank refuses it.
    #[error(
        "cannot shard dim {dim} of length {len} over {world} ranks: sequence parallelism \
         splits it evenly, so the length must be divisible by the tensor-parallel size {world}"
    )]
    NotDivisible {
        /// The length along `dim`.
        len: i64,
        /// The dim (as the plan gives it).
        dim: i64,
        /// The tensor-parallel group's size.
        world: usize,
    },
    /// A `Shard(dim)` layout's dim is not a dim of the tensor.
    #[error("Shard({dim}) is out of range for a tensor of {ndim} dims")]
    LayoutDim {
        /// The layout's dim.
        dim: i64,
        /// The tensor's number of dims.
        ndim: usize,
    },
    /// `PrepareModuleInput` lays out another number of inputs than the call passed.
    #[error("the plan lays out {expected} inputs, the call passed {got}")]
    InputCount {
        /// `input_layouts.len()`.
        expected: usize,
        /// The call's inputs.
        got: usize,
    },
    /// `PrepareModuleOutput` lays out another number of outputs than the call returned.
    #[error("the plan lays out {expected} outputs, the call returned {got}")]
    OutputCount {
        /// `output_layouts.len()`.
        expected: usize,
        /// The call's outputs.
        got: usize,
    },
    /// A collective failed.
    #[error(transparent)]
    Collective(DistError),
}

/// A plan key in backquotes, the root module by name (fully_shard's errors name modules
/// the same way).
pub(crate) struct Key<'a>(pub(crate) &'a str);

impl fmt::Display for Key<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("the root module")
        } else {
            write!(f, "`{}`", self.0)
        }
    }
}

/// How to call a hooked module: with `call`, as its parent's field.
pub(crate) struct Fix<'a>(pub(crate) &'a str);

impl fmt::Display for Fix<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.rsplit('.').next().filter(|s| !s.is_empty()) {
            Some(field) => write!(
                f,
                "call the module as `self.{field}.call(&x)`, not `x.apply(&self.{field})` or \
                 `self.{field}.forward(&x)`"
            ),
            None => {
                f.write_str("call the module with `.call(&x)`, not `x.apply(..)` or `.forward(..)`")
            }
        }
    }
}

/// `rank R: `, unless the [`DistError`] inside names rank R itself (its message goes on
/// after this one's, through `source()`).
struct RankUnlessNamed<'a>(&'a DistError, usize);

impl fmt::Display for RankUnlessNamed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.rank() == Some(self.1) {
            Ok(())
        } else {
            write!(f, "rank {}: ", self.1)
        }
    }
}

/// A forward problem after the hook's module: ` on rank R expects ...` for a width,
/// ` on rank R: ...` otherwise, and `: ...` for a failed collective, whose [`DistError`]
/// names the rank itself.
struct Detail<'a>(&'a ForwardProblem, usize);

impl fmt::Display for Detail<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rank = self.1;
        match self.0 {
            ForwardProblem::InputWidth { .. } => write!(f, " on rank {rank} {}", self.0),
            ForwardProblem::Collective(e) if e.rank() == Some(rank) => write!(f, ": {e}"),
            ForwardProblem::Collective(e) => write!(f, " on rank {rank}: {e}"),
            other => write!(f, " on rank {rank}: {other}"),
        }
    }
}

/// Placements joined by `, `.
struct Placements<'a>(&'a [Placement]);

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

#[cfg(test)]
mod tests;
