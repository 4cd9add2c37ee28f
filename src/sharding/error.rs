//! The errors of tensor parallelism: [`ShardError`] (what [`shard_module`](super::shard_module),
//! [`parallelize_module`](super::parallelize_module), the sharders and the sharded layers'
//! hooks fail with), its context written once — [`OnRank`] of a [`ShardProblem`] (the plan
//! entry's [`PlanProblem`], a style's [`StyleProblem`], an argument), [`OnRank`] of a
//! [`Composition`] rule, an [`EngineFailure`], an [`OnHook`] of a [`ForwardProblem`] — and
//! [`SharderError`] (why a [`Sharder`](super::Sharder) refuses a module).
//!
//! Every message names the rank, the operation (`shard_module`) and the FQN at fault once.
//! Plan errors read `rank R: shard_module: `FQN`: what`; a failing hook reads
//! `shard_module: <part> `FQN` on rank R: what`, as PyTorch's module call raises it.
//!
//! One rule (see [`report`](crate::report)): a variant's Display names only its own context,
//! and what went wrong inside it is its [`source`](std::error::Error::source): the plan
//! entry's [`PlanProblem`], the spec check's
//! [`ShardingError`](tch_dist_core::sharding::ShardingError), the [`DistError`] of a failed
//! collective. `report(&err)` gives the whole text. A [`DistError`] names its rank itself,
//! so the context around it does not.

use std::fmt;
use std::sync::Arc;

use tch_dist_core::hooks::HookError;
use tch_dist_core::sharding::{Placement, ShardingError};
use tch_dist_core::ContractError;
use tch_dist_runtime::{ArgumentError, DistError, ProcessGroup};

use crate::sharding::Layout;
use crate::{Api, Composition, OnRank};

/// Errors of [`shard_module`](super::shard_module), of the sharders and of the sharded
/// layers' forward hooks (which hand them to [`ForwardError`](crate::ForwardError): a
/// caller of `f_call` gets them back with
/// [`ForwardError::downcast_ref`](crate::ForwardError::downcast_ref)). This rank's refusal
/// is [`OnRank`](Self::OnRank) of a [`ShardProblem`], or [`Composition`](Self::Composition)
/// of a rule of composing the APIs, its rank written once; the engine's failure on this
/// rank is an [`EngineFailure`], a failed hook an [`OnHook`]; another layer's error names
/// its own.
///
/// ```
/// use tch_dist::sharding::{PlanProblem, ShardProblem};
/// let problem = PlanProblem::NotAParameter;
/// let e = ShardProblem::Plan { fqn: "fc3.weight".into(), problem }.on(1);
/// assert_eq!(e.to_string(), "rank 1: shard_module: `fc3.weight`");
/// assert_eq!(
///     tch_dist::report(&e),
///     "rank 1: shard_module: `fc3.weight`: is not a parameter of the model"
/// );
/// assert_eq!(e.rank(), Some(1));
/// assert!(matches!(
///     e.problem(),
///     Some(ShardProblem::Plan { problem: PlanProblem::NotAParameter, .. })
/// ));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// This rank refused: its rank and the problem (the plan, a style, an argument); nothing
    /// was changed.
    #[error(transparent)]
    OnRank(#[from] OnRank<ShardProblem>),
    /// A rule of composing shard_module with the other APIs, broken on this rank
    /// ([`Api::ShardModule`]'s [`Composition`]): a module `shard_module` hooked ran without
    /// its hooks ([`Composition::HooksBypassed`]: its parameter was used, in the autograd
    /// graph, outside a call of the module through them, where this rank's shard alone
    /// gives a wrong result). Raised by the check of the sharded model's call (`f_call`
    /// returns it in a [`ForwardError`](crate::ForwardError)) or, as its message, by the
    /// backward pass, before any guarded parameter gets a gradient.
    #[error(transparent)]
    Composition(#[from] OnRank<Composition>),
    /// The engine failed on this rank: sharding a module or parameter, or summing a
    /// sequence-parallel gradient.
    #[error(transparent)]
    Engine(#[from] EngineFailure),
    /// A sharded module's forward hook failed: the module call (`f_call`) returns this
    /// error inside a [`ForwardError`](crate::ForwardError), `call` panics with its message.
    #[error(transparent)]
    Forward(#[from] OnHook),
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
    /// The rank the error names (this rank's, or the disagreement's); `None` for a
    /// contract's error.
    pub fn rank(&self) -> Option<usize> {
        match self {
            ShardError::OnRank(e) => Some(e.rank),
            ShardError::Composition(e) => Some(e.rank),
            ShardError::Engine(e) => Some(e.rank),
            ShardError::Forward(e) => Some(e.rank),
            ShardError::Disagreement { source } => source.rank(),
            ShardError::Contract(_) => None,
        }
    }

    /// This rank's problem (`None` for any other error).
    pub fn problem(&self) -> Option<&ShardProblem> {
        match self {
            ShardError::OnRank(e) => Some(&e.problem),
            _ => None,
        }
    }

    /// The rule of composing the APIs this rank broke (`None` for any other error).
    ///
    /// ```
    /// use tch_dist::sharding::ShardError;
    /// use tch_dist::{Api, Composition, OnRank};
    /// let (module, param) = ("fc1".into(), "fc1.weight".into());
    /// let bypassed = Composition::HooksBypassed { api: Api::ShardModule, module, param };
    /// let e = ShardError::from(OnRank::new(0, bypassed));
    /// assert!(tch_dist::report(&e).starts_with(
    ///     "rank 0: shard_module: parameter `fc1.weight` of `fc1` was used outside a call of the \
    ///      module through its forward hooks"
    /// ));
    /// assert!(matches!(e.composition(), Some(Composition::HooksBypassed { .. })));
    /// ```
    pub fn composition(&self) -> Option<&Composition> {
        match self {
            ShardError::Composition(e) => Some(&e.problem),
            _ => None,
        }
    }

    /// A plan error of this rank of `group`.
    pub fn plan(group: &ProcessGroup, fqn: &str, problem: PlanProblem) -> ShardError {
        let fqn = fqn.to_string();
        ShardProblem::Plan { fqn, problem }.on(group.rank())
    }

    /// `fqn`'s hooks could not be registered, on this rank of `group`.
    pub(crate) fn unhookable(group: &ProcessGroup, fqn: &str, source: HookError) -> ShardError {
        ShardError::plan(group, fqn, PlanProblem::Unhookable { source })
    }

    /// An engine failure of this rank of `group` while sharding `fqn` (for a
    /// [`Sharder`](super::Sharder)'s collectives).
    pub fn dist(group: &ProcessGroup, fqn: &str, source: DistError) -> ShardError {
        let problem = EngineProblem::Sharding {
            fqn: fqn.to_string(),
            source: Box::new(source),
        };
        ShardError::Engine(EngineFailure {
            rank: group.rank(),
            problem,
        })
    }

    pub(crate) fn forward(
        group: &ProcessGroup,
        fqn: &str,
        site: HookSite,
        problem: ForwardProblem,
    ) -> ShardError {
        ShardError::Forward(OnHook {
            rank: group.rank(),
            site,
            fqn: fqn.to_string(),
            problem,
        })
    }

    /// `param` of `module` used outside a call of the module through its hooks, on `rank`.
    pub(crate) fn hooks_bypassed(rank: usize, module: &str, param: &str) -> ShardError {
        let bypassed = Composition::HooksBypassed {
            api: Api::ShardModule,
            module: module.to_string(),
            param: param.to_string(),
        };
        ShardError::Composition(OnRank::new(rank, bypassed))
    }
}

/// Why [`shard_module`](super::shard_module) or
/// [`parallelize_module`](super::parallelize_module) refused on a rank, before anything
/// changed ([`ShardError::OnRank`] adds the rank). Each names the operation and the plan
/// key at fault; what is wrong is the [`source`](std::error::Error::source).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ShardProblem {
    /// The plan does not fit the model or the group.
    #[error("shard_module: {}", Key(fqn))]
    Plan {
        /// The plan key (FQN) at fault (`""`: the root module).
        fqn: String,
        /// What is wrong.
        #[source]
        problem: PlanProblem,
    },
    /// [`parallelize_module`](super::parallelize_module)'s mesh or plan asks for what
    /// tch-dist does not build.
    #[error("parallelize_module: {}", Key(fqn))]
    Parallelize {
        /// The plan key (FQN) at fault (`""`: the mesh).
        fqn: String,
        /// What is wrong.
        #[source]
        problem: StyleProblem,
    },
    /// An argument of [`shard_module`](super::shard_module) is out of range (`src_rank`).
    #[error("shard_module")]
    InvalidArgument {
        /// What is wrong (boxed, so that every `Result` stays small).
        #[source]
        problem: Box<ArgumentError>,
    },
}

impl ShardProblem {
    /// This problem as rank `rank`'s [`ShardError`].
    pub fn on(self, rank: usize) -> ShardError {
        ShardError::OnRank(OnRank::new(rank, self))
    }
}

/// The engine failed on this rank, its context written once: the rank, then what
/// `shard_module` was doing ([`EngineProblem`]), whose [`DistError`] is the
/// [`source`](std::error::Error::source). The [`DistError`] names the rank itself, so the
/// context writes `rank R: ` only where it does not (an error of no group, of another rank).
///
/// ```
/// use tch_dist::sharding::{EngineFailure, EngineProblem};
/// use tch_dist::DistError;
/// let source = DistError::Collective { rank: 1, op: "scatter", cause: "Connection reset".into() };
/// let problem = EngineProblem::Sharding { fqn: "fc1.weight".into(), source: Box::new(source) };
/// let e = EngineFailure { rank: 1, problem };
/// assert_eq!(
///     tch_dist::report(&e),
///     "shard_module: `fc1.weight`: rank 1: scatter failed: Connection reset"
/// );
/// ```
#[derive(Debug, Clone)]
pub struct EngineFailure {
    /// This rank.
    pub rank: usize,
    /// What failed.
    pub problem: EngineProblem,
}

impl fmt::Display for EngineFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.problem.dist().rank() != Some(self.rank) {
            write!(f, "rank {}: ", self.rank)?;
        }
        write!(f, "{}", self.problem)
    }
}

impl std::error::Error for EngineFailure {
    // The problem's cause (the DistError), not the problem: its text is this error's already.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.problem.source()
    }
}

/// What `shard_module` was doing on a rank when the engine failed (the
/// [`problem`](EngineFailure::problem) of an [`EngineFailure`]); the engine's [`DistError`]
/// is the [`source`](std::error::Error::source).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum EngineProblem {
    /// Sharding `fqn` (scattering or broadcasting its values, or rebuilding a sharded
    /// tensor); the modules sharded before it stay sharded.
    #[error("shard_module: {}", Key(fqn))]
    Sharding {
        /// The module or parameter being sharded.
        fqn: String,
        /// What the engine said (boxed, so that every `Result` stays small).
        source: Box<DistError>,
    },
    /// Summing a sequence-parallel parameter's gradient over the tensor-parallel group:
    /// the backward pass fails with this message.
    #[error(
        "shard_module: sequence-parallel parameter `{param}`: summing its gradient over the \
         tensor-parallel group failed"
    )]
    GradientSum {
        /// The parameter (its FQN).
        param: String,
        /// What the engine said (boxed, so that every `Result` stays small).
        source: Box<DistError>,
    },
}

impl EngineProblem {
    /// The engine's error.
    fn dist(&self) -> &DistError {
        match self {
            EngineProblem::Sharding { source, .. } | EngineProblem::GradientSum { source, .. } => {
                source
            }
        }
    }
}

/// What [`parallelize_module`](crate::sharding::parallelize_module) does not build
/// ([`ShardProblem::Parallelize`]).
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

/// Why a [`Sharder`](crate::sharding::Sharder) refuses a module: the built-in linear
/// sharders' reasons, and [`Custom`](SharderError::Custom) for third-party sharders.
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

/// A sharded module's forward hook that failed on this rank, its context written once: the
/// hook, the module and the rank, then the [`ForwardProblem`]. It reads as PyTorch's module
/// call raises it, the rank after the module: ``shard_module: row-parallel `fc2` on rank 1
/// expects ...``; a failed collective's [`DistError`] names the rank itself, so the context
/// leaves it out (``shard_module: output of `fc2`: rank 1: all_gather ...``). The problem's
/// cause is the [`source`](std::error::Error::source).
///
/// ```
/// use tch_dist::sharding::{ForwardProblem, HookSite, OnHook};
/// let e = OnHook {
///     rank: 1,
///     site: HookSite::Output,
///     fqn: "fc2".into(),
///     problem: ForwardProblem::Outputs { got: 2 },
/// };
/// assert_eq!(
///     e.to_string(),
///     "shard_module: output of `fc2` on rank 1: the plan describes one output, the call \
///      returned 2"
/// );
/// ```
#[derive(Debug, Clone)]
pub struct OnHook {
    /// This rank.
    pub rank: usize,
    /// Which of the module's hooks.
    pub site: HookSite,
    /// The module whose hook failed.
    pub fqn: String,
    /// What went wrong.
    pub problem: ForwardProblem,
}

impl fmt::Display for OnHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shard_module: {} {}", self.site, Key(&self.fqn))?;
        match &self.problem {
            // `on rank R expects ...`: the width reads on from the rank.
            problem @ ForwardProblem::InputWidth { .. } => {
                write!(f, " on rank {} {problem}", self.rank)
            }
            ForwardProblem::Collective(e) if e.rank() == Some(self.rank) => write!(f, ": {e}"),
            problem => write!(f, " on rank {}: {problem}", self.rank),
        }
    }
}

impl std::error::Error for OnHook {
    // The problem's cause, not the problem: its text is this error's already.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.problem.source()
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

/// Why a sharded module's forward hook failed (the `problem` of an [`OnHook`]).
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
    /// A collective failed (boxed, so that every `Result` stays small).
    #[error(transparent)]
    Collective(Box<DistError>),
}

impl ForwardProblem {
    /// A failed collective ([`Collective`](ForwardProblem::Collective)).
    pub(crate) fn collective(e: DistError) -> ForwardProblem {
        ForwardProblem::Collective(Box::new(e))
    }
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

#[cfg(test)]
mod tests;
