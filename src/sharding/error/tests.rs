//! The exact text of every error variant, each built directly.

use super::*;
use tch::Device;
use tch_dist_core::sharding::{Placement, ShardMetadata, ShardingError};

fn cpu(rank: usize) -> Placement {
    Placement::new(rank, Device::Cpu)
}

fn dist() -> DistError {
    DistError::PeerGone {
        rank: 1,
        op: "all_gather (differentiable)",
        peer: Some(0),
        cause: "Connection closed by peer".into(),
    }
}

fn dim_error() -> Box<ShardingError> {
    Box::new(ShardingError::DimOutOfRange { dim: 2, ndim: 2 })
}

/// The variant's name; exhaustive, so a new variant fails to compile until it is
/// pinned below.
fn plan_name(p: &PlanProblem) -> &'static str {
    match p {
        PlanProblem::NotAParameter => "NotAParameter",
        PlanProblem::NotAModule => "NotAModule",
        PlanProblem::SpecOnModule => "SpecOnModule",
        PlanProblem::SharderOnParameter => "SharderOnParameter",
        PlanProblem::Placements { .. } => "Placements",
        PlanProblem::SpecShape { .. } => "SpecShape",
        PlanProblem::NotAWeight { .. } => "NotAWeight",
        PlanProblem::EnumerableWeightSpec => "EnumerableWeightSpec",
        PlanProblem::WeightDim { .. } => "WeightDim",
        PlanProblem::NoParentModule { .. } => "NoParentModule",
        PlanProblem::Layer { .. } => "Layer",
        PlanProblem::Sharder { .. } => "Sharder",
        PlanProblem::SpecInsideSharder { .. } => "SpecInsideSharder",
        PlanProblem::SharderInsideSharder { .. } => "SharderInsideSharder",
        PlanProblem::ShardedTwice => "ShardedTwice",
        PlanProblem::OutputNotAModule => "OutputNotAModule",
        PlanProblem::OutputNotChunk => "OutputNotChunk",
        PlanProblem::OutputPlacements { .. } => "OutputPlacements",
        PlanProblem::OutputChunkOrder { .. } => "OutputChunkOrder",
        PlanProblem::LocalNotAModule => "LocalNotAModule",
        PlanProblem::LocalNotSharded => "LocalNotSharded",
        PlanProblem::Unhookable { .. } => "Unhookable",
        PlanProblem::Layout { .. } => "Layout",
        PlanProblem::NotSharded => "NotSharded",
        PlanProblem::AlreadyManaged { .. } => "AlreadyManaged",
    }
}

fn sharder_name(e: &SharderError) -> &'static str {
    match e {
        SharderError::Submodule { .. } => "Submodule",
        SharderError::ExtraParameter { .. } => "ExtraParameter",
        SharderError::NoWeight { .. } => "NoWeight",
        SharderError::WeightShape { .. } => "WeightShape",
        SharderError::BiasShape { .. } => "BiasShape",
        SharderError::Placements { .. } => "Placements",
        SharderError::ZeroFused => "ZeroFused",
        SharderError::NotDivisible { .. } => "NotDivisible",
        SharderError::NotAnEmbedding { .. } => "NotAnEmbedding",
        SharderError::NotANorm { .. } => "NotANorm",
        SharderError::NotGroupedExperts { .. } => "NotGroupedExperts",
        SharderError::ExpertsNotDivisible { .. } => "ExpertsNotDivisible",
        SharderError::ExpertWidthNotDivisible { .. } => "ExpertWidthNotDivisible",
        SharderError::Custom(_) => "Custom",
    }
}

fn forward_name(p: &ForwardProblem) -> &'static str {
    match p {
        ForwardProblem::InputWidth { .. } => "InputWidth",
        ForwardProblem::OutputDim { .. } => "OutputDim",
        ForwardProblem::Outputs { .. } => "Outputs",
        ForwardProblem::NotIds { .. } => "NotIds",
        ForwardProblem::IdOutOfRange { .. } => "IdOutOfRange",
        ForwardProblem::LookupWithoutInputHook => "LookupWithoutInputHook",
        ForwardProblem::NotDivisible { .. } => "NotDivisible",
        ForwardProblem::LayoutDim { .. } => "LayoutDim",
        ForwardProblem::InputCount { .. } => "InputCount",
        ForwardProblem::OutputCount { .. } => "OutputCount",
        ForwardProblem::ExpertInputs { .. } => "ExpertInputs",
        ForwardProblem::DispatchCounts { .. } => "DispatchCounts",
        ForwardProblem::PeerDispatchCounts { .. } => "PeerDispatchCounts",
        ForwardProblem::CombineWithoutDispatch => "CombineWithoutDispatch",
        ForwardProblem::Collective(_) => "Collective",
    }
}

fn shard_name(e: &ShardError) -> &'static str {
    match e {
        ShardError::OnRank(e) => match e.problem {
            ShardProblem::Plan { .. } => "Plan",
            ShardProblem::Parallelize { .. } => "Parallelize",
            ShardProblem::InvalidArgument { .. } => "InvalidArgument",
        },
        ShardError::Composition(e) => match e.problem {
            Composition::HooksBypassed { .. } => "HooksBypassed",
            _ => "another rule", // shard_module breaks no other
        },
        ShardError::Engine(e) => match e.problem {
            EngineProblem::Sharding { .. } => "Dist",
            EngineProblem::GradientSum { .. } => "GradientSum",
        },
        ShardError::Forward(_) => "Forward",
        ShardError::Contract(_) => "Contract",
        ShardError::Disagreement { .. } => "Disagreement",
    }
}

/// `fqn`'s plan `problem` on `rank`.
fn plan(rank: usize, fqn: &str, problem: PlanProblem) -> ShardError {
    let fqn = fqn.to_string();
    ShardProblem::Plan { fqn, problem }.on(rank)
}

/// The engine's `source` on `rank`, sharding `fqn`.
fn engine(rank: usize, fqn: &str, source: DistError) -> ShardError {
    let fqn = fqn.to_string();
    let problem = EngineProblem::Sharding {
        fqn,
        source: Box::new(source),
    };
    ShardError::Engine(EngineFailure { rank, problem })
}

/// Checks that `cases` pins every variant `name` knows of, each once, and its composed text
/// ([`report`](crate::report): its Display, then its sources').
fn pin<T: std::error::Error>(cases: Vec<(T, &str)>, name: fn(&T) -> &'static str, all: &[&str]) {
    let mut seen: Vec<&str> = cases.iter().map(|(v, _)| name(v)).collect();
    seen.sort_unstable();
    let mut all = all.to_vec();
    all.sort_unstable();
    assert_eq!(seen, all, "every variant pinned once");
    for (value, text) in cases {
        assert_eq!(crate::report(&value), text, "{}", name(&value));
    }
}

#[test]
fn every_plan_problem_has_its_text() {
    let linear = SharderError::NotDivisible {
        out_features: 8,
        fused: 3,
    };
    pin(
        vec![
            (
                PlanProblem::NotAParameter,
                "is not a parameter of the model",
            ),
            (PlanProblem::NotAModule, "is not a module of the model"),
            (
                PlanProblem::SpecOnModule,
                "names a module, but a ShardingSpec shards a parameter; shard a module with \
                 a Sharder",
            ),
            (
                PlanProblem::SharderOnParameter,
                "names a parameter, but a Sharder shards a module; shard a parameter with a \
                 ShardingSpec",
            ),
            (
                PlanProblem::Placements {
                    source: Box::new(ShardingError::RankOutOfRange {
                        placement: cpu(2),
                        world_size: 2,
                    }),
                },
                "placements do not match the group: placement `rank:2/cpu`: rank 2 is out of \
                 range for a world of 2 ranks",
            ),
            (
                PlanProblem::SpecShape {
                    shape: vec![8, 6],
                    source: dim_error(),
                },
                "the spec does not fit the parameter's shape [8, 6]: dim 2 out of range for a \
                 tensor of 2 dims (expected a dim in -2..=1)",
            ),
            (
                PlanProblem::NotAWeight {
                    name: "bias".into(),
                },
                "only a linear layer's `weight` can be sharded by a spec (its forward is \
                 rewritten; the bias follows the weight); `bias` cannot",
            ),
            (
                PlanProblem::EnumerableWeightSpec,
                "a linear layer's weight is sharded with a ChunkShardingSpec (dim 0: \
                 column-parallel, dim 1: row-parallel); an EnumerableShardingSpec has no \
                 sharded forward",
            ),
            (
                PlanProblem::WeightDim { dim: 3 },
                "dim 3 out of range for a linear layer's weight of 2 dims",
            ),
            (
                PlanProblem::NoParentModule {
                    module: "fc1".into(),
                },
                "its module `fc1` is not in the model",
            ),
            (
                PlanProblem::Layer {
                    module: "fc1".into(),
                    source: SharderError::ZeroFused,
                },
                "`fc1`: fused must be at least 1",
            ),
            (
                PlanProblem::Sharder {
                    sharder: "colwise_linear(fused=3)".into(),
                    source: linear,
                },
                "colwise_linear(fused=3): `weight` has 8 output features, not divisible into \
                 fused=3 parts",
            ),
            (
                PlanProblem::SpecInsideSharder {
                    owner: "fc1".into(),
                    sharder: "colwise_linear".into(),
                },
                "a parameter spec inside `fc1`, which sharder `colwise_linear` shards whole",
            ),
            (
                PlanProblem::SharderInsideSharder {
                    owner: "".into(),
                    sharder: "colwise_linear".into(),
                },
                "a sharder inside the root module, which sharder `colwise_linear` shards whole",
            ),
            (PlanProblem::ShardedTwice, "is sharded by two plan entries"),
            (
                PlanProblem::OutputNotAModule,
                "output_plan names a module that is not in the model",
            ),
            (
                PlanProblem::OutputNotChunk,
                "output_plan: only a ChunkShardingSpec can lay out a module output",
            ),
            (
                PlanProblem::OutputPlacements {
                    source: Box::new(ShardingError::DuplicateRank {
                        rank: 0,
                        first: 0,
                        second: 1,
                    }),
                },
                "output_plan: placements do not match the group: placements 0 and 1 both \
                 name rank 0: a ChunkShardingSpec holds at most one chunk per rank",
            ),
            (
                PlanProblem::OutputChunkOrder {
                    placements: vec![cpu(1), cpu(0)],
                    world_size: 2,
                },
                "output_plan: an output is split into one chunk per rank, chunk i on rank i \
                 (2 placements, rank:0 first), not [rank:1/cpu, rank:0/cpu]",
            ),
            (
                PlanProblem::LocalNotAModule,
                "return_local_tensor names a module that is not in the model",
            ),
            (
                PlanProblem::LocalNotSharded,
                "return_local_tensor: this module's output is not split across ranks; give \
                 it an output_plan spec saying how",
            ),
            (
                PlanProblem::Unhookable {
                    source: HookError::NoIdentity { module: "Gelu" },
                },
                "its output cannot be hooked: cannot register a hook on a `Gelu`: it has no \
                 parameters or buffers, so the module instance cannot be identified",
            ),
            (
                PlanProblem::Layout {
                    source: Box::new(ShardingError::Overlap {
                        first: 0,
                        second: 1,
                        first_shard: Box::new(
                            ShardMetadata::new(vec![0], vec![2], cpu(0)).unwrap(),
                        ),
                        second_shard: Box::new(
                            ShardMetadata::new(vec![1], vec![2], cpu(1)).unwrap(),
                        ),
                    }),
                },
                "invalid shard layout: shards 0 and 1 overlap: offsets [0], sizes [2] on \
                 rank:0/cpu and offsets [1], sizes [2] on rank:1/cpu",
            ),
            (PlanProblem::NotSharded, "is not a sharded parameter"),
            (
                PlanProblem::AlreadyManaged {
                    param: "blocks.0.fc1.weight".into(),
                    api: "fully_shard",
                },
                "parameter `blocks.0.fc1.weight` is already managed by fully_shard; apply \
                 tensor parallelism first, then fully_shard",
            ),
        ],
        plan_name,
        &[
            "NotAParameter",
            "NotAModule",
            "SpecOnModule",
            "SharderOnParameter",
            "Placements",
            "SpecShape",
            "NotAWeight",
            "EnumerableWeightSpec",
            "WeightDim",
            "NoParentModule",
            "Layer",
            "Sharder",
            "SpecInsideSharder",
            "SharderInsideSharder",
            "ShardedTwice",
            "OutputNotAModule",
            "OutputNotChunk",
            "OutputPlacements",
            "OutputChunkOrder",
            "LocalNotAModule",
            "LocalNotSharded",
            "Unhookable",
            "Layout",
            "NotSharded",
            "AlreadyManaged",
        ],
    );
}

#[test]
fn every_sharder_error_has_its_text() {
    #[derive(Debug, thiserror::Error)]
    #[error("an embedding needs at least 2 rows per rank")]
    struct TooFewRows;
    pin(
        vec![
            (
                SharderError::Submodule {
                    kind: "Mlp",
                    child: "fc1".into(),
                },
                "a linear sharder needs a linear layer (`weight` and optional `bias`), but \
                 this `Mlp` has a submodule `fc1`",
            ),
            (
                SharderError::ExtraParameter {
                    kind: "LayerNorm",
                    name: "gamma".into(),
                },
                "a linear sharder needs a linear layer (`weight` and optional `bias`), but \
                 this `LayerNorm` has a parameter `gamma`",
            ),
            (
                SharderError::NoWeight { kind: "Embedding" },
                "this `Embedding` has no `weight` parameter",
            ),
            (
                SharderError::WeightShape { shape: vec![8] },
                "`weight` has shape [8]; a linear layer's weight is [out_features, \
                 in_features]",
            ),
            (
                SharderError::BiasShape {
                    shape: vec![4],
                    weight: vec![8, 6],
                },
                "`bias` has shape [4]; expected [8] for a weight of shape [8, 6]",
            ),
            (
                SharderError::Placements {
                    placements: vec![cpu(1), cpu(0)],
                    world_size: 2,
                },
                "placements [rank:1/cpu, rank:0/cpu] do not match the group of 2 ranks: a \
                 linear layer is split into one chunk per rank, chunk i on rank i",
            ),
            (SharderError::ZeroFused, "fused must be at least 1"),
            (
                SharderError::NotDivisible {
                    out_features: 8,
                    fused: 3,
                },
                "`weight` has 8 output features, not divisible into fused=3 parts",
            ),
            (
                SharderError::NotAnEmbedding {
                    kind: "Linear",
                    found: "a parameter `bias`".into(),
                },
                "an embedding sharder needs an embedding table (one `weight` [num_embeddings, \
                 embedding_dim]), but this `Linear` has a parameter `bias`",
            ),
            (
                SharderError::NotANorm {
                    kind: "Linear",
                    found: "has a parameter `weight` of shape [4, 8]".into(),
                },
                "SequenceParallel needs a norm over each token's features (no submodules or \
                 buffers, one-dimensional parameters: LayerNorm, an RMSNorm), but this \
                 `Linear` has a parameter `weight` of shape [4, 8]",
            ),
            (
                SharderError::NotGroupedExperts {
                    kind: "Linear",
                    found: "a parameter `weight`".into(),
                },
                "ExpertParallel needs grouped experts (3-D `w1` and `w3` [experts, hidden, \
                 dim] and `w2` [experts, dim, hidden], nothing else), but this `Linear` has a \
                 parameter `weight`",
            ),
            (
                SharderError::ExpertsNotDivisible {
                    experts: 5,
                    ranks: 2,
                },
                "5 experts cannot be split evenly over the 2 ranks of expert parallelism",
            ),
            (
                SharderError::ExpertWidthNotDivisible {
                    hidden: 10,
                    ranks: 4,
                },
                "the experts' hidden width 10 cannot be split evenly over the 4 ranks of \
                 tensor parallelism",
            ),
            (
                SharderError::custom(TooFewRows),
                "an embedding needs at least 2 rows per rank",
            ),
        ],
        sharder_name,
        &[
            "Submodule",
            "ExtraParameter",
            "NoWeight",
            "WeightShape",
            "BiasShape",
            "Placements",
            "ZeroFused",
            "NotDivisible",
            "NotAnEmbedding",
            "NotANorm",
            "NotGroupedExperts",
            "ExpertsNotDivisible",
            "ExpertWidthNotDivisible",
            "Custom",
        ],
    );
    let custom = SharderError::custom(TooFewRows);
    assert!(std::error::Error::source(&custom).is_none()); // transparent: TooFewRows's
    let SharderError::Custom(inner) = custom else {
        unreachable!()
    };
    assert!(inner.downcast_ref::<TooFewRows>().is_some());
}

#[test]
fn every_forward_problem_has_its_text() {
    pin(
        vec![
            (
                ForwardProblem::InputWidth {
                    full: 8,
                    local: 4,
                    width: 5,
                },
                "expects 8 input features (or its slice of 4), got 5",
            ),
            (
                ForwardProblem::OutputDim { dim: 3, ndim: 2 },
                "output_plan's dim 3 is out of range for an output of 2 dims",
            ),
            (
                ForwardProblem::Outputs { got: 2 },
                "the plan describes one output, the call returned 2",
            ),
            (
                ForwardProblem::NotIds {
                    dtype: "Float".into(),
                },
                "expects integer ids (Int64 or Int), got Float",
            ),
            (
                ForwardProblem::IdOutOfRange { id: 11, vocab: 11 },
                "id 11 is outside the table of 11 embeddings",
            ),
            (
                ForwardProblem::LookupWithoutInputHook,
                "the lookup ran without its input hook, so its tokens of other ranks are not \
                 masked",
            ),
            (
                ForwardProblem::NotDivisible {
                    len: 5,
                    dim: 1,
                    world: 2,
                },
                "cannot shard dim 1 of length 5 over 2 ranks: sequence parallelism splits it \
                 evenly, so the length must be divisible by the tensor-parallel size 2",
            ),
            (
                ForwardProblem::LayoutDim { dim: 3, ndim: 2 },
                "Shard(3) is out of range for a tensor of 2 dims",
            ),
            (
                ForwardProblem::InputCount {
                    expected: 2,
                    got: 1,
                },
                "the plan lays out 2 inputs, the call passed 1",
            ),
            (
                ForwardProblem::OutputCount {
                    expected: 1,
                    got: 2,
                },
                "the plan lays out 1 outputs, the call returned 2",
            ),
            (
                ForwardProblem::ExpertInputs { got: 1 },
                "expects 2 inputs, the rows grouped by expert and the count of rows per \
                 expert, the call passed 1",
            ),
            (
                ForwardProblem::DispatchCounts {
                    counts: 4,
                    sum: 9,
                    rows: 10,
                    experts: 4,
                },
                "4 counts adding up to 9 for 10 rows of 4 experts",
            ),
            (
                ForwardProblem::PeerDispatchCounts { rank: 1 },
                "rank 1's counts of rows per expert do not match its rows",
            ),
            (
                ForwardProblem::CombineWithoutDispatch,
                "the experts ran without the input hook that sent the tokens to them",
            ),
            (
                ForwardProblem::collective(dist()),
                "rank 1: all_gather (differentiable) failed: rank 0 closed the connection",
            ),
        ],
        forward_name,
        &[
            "InputWidth",
            "OutputDim",
            "Outputs",
            "NotIds",
            "IdOutOfRange",
            "LookupWithoutInputHook",
            "NotDivisible",
            "LayoutDim",
            "InputCount",
            "OutputCount",
            "ExpertInputs",
            "DispatchCounts",
            "PeerDispatchCounts",
            "CombineWithoutDispatch",
            "Collective",
        ],
    );
    let sites = [
        (HookSite::ColumnParallel, "column-parallel"),
        (HookSite::RowParallel, "row-parallel"),
        (HookSite::Output, "output of"),
        (HookSite::VocabParallel, "vocab-parallel"),
        (HookSite::SequenceParallel, "sequence-parallel"),
        (HookSite::Input, "input of"),
        (HookSite::ExpertParallel, "expert-parallel"),
    ];
    for (site, text) in sites {
        // Exhaustive: a new site fails to compile until it is pinned here.
        match site {
            HookSite::ColumnParallel
            | HookSite::RowParallel
            | HookSite::Output
            | HookSite::VocabParallel
            | HookSite::SequenceParallel
            | HookSite::Input
            | HookSite::ExpertParallel => {}
        }
        assert_eq!(site.to_string(), text);
    }
}

/// Each message names the rank, `shard_module` and the FQN once.
#[test]
fn every_shard_error_names_rank_op_and_fqn_once() {
    let forward = |site, problem| {
        let fqn = "fc2".into();
        ShardError::Forward(OnHook {
            rank: 1,
            site,
            fqn,
            problem,
        })
    };
    pin(
        vec![
            (
                plan(1, "fc3.weight", PlanProblem::NotAParameter),
                "rank 1: shard_module: `fc3.weight`: is not a parameter of the model",
            ),
            (
                ShardProblem::Parallelize {
                    fqn: "fc1".into(),
                    problem: StyleProblem::Layout {
                        style: "ColwiseParallel",
                        which: "output",
                        layout: crate::sharding::Layout::Shard(0),
                    },
                }
                .on(1),
                "rank 1: parallelize_module: `fc1`: ColwiseParallel with output_layouts = \
                 Shard(0) is not supported (ColwiseParallel: input Replicate or, on a linear \
                 layer, Shard(d); output Shard(-1) or Replicate)",
            ),
            (
                ShardProblem::InvalidArgument {
                    problem: Box::new(ArgumentError::RankNotInGroup {
                        what: "src_rank",
                        rank: 2,
                        world_size: 2,
                    }),
                }
                .on(1),
                "rank 1: shard_module: src_rank 2 is not in a group of size 2",
            ),
            (
                engine(
                    1,
                    "fc1.weight",
                    DistError::Collective {
                        rank: 1,
                        op: "scatter",
                        cause: "Connection reset".into(),
                    },
                ),
                // The DistError names the rank (once), after the context.
                "shard_module: `fc1.weight`: rank 1: scatter failed: Connection reset",
            ),
            (
                forward(
                    HookSite::RowParallel,
                    ForwardProblem::InputWidth {
                        full: 8,
                        local: 4,
                        width: 5,
                    },
                ),
                "shard_module: row-parallel `fc2` on rank 1 expects 8 input features (or its \
                 slice of 4), got 5",
            ),
            (
                ShardError::hooks_bypassed(1, "blocks.0.fc1", "blocks.0.fc1.weight"),
                "rank 1: shard_module: parameter `blocks.0.fc1.weight` of `blocks.0.fc1` was \
                 used outside a call of the module through its forward hooks, where this \
                 rank's shard alone gives a wrong result; call the module as \
                 `self.fc1.call(&x)`, not `x.apply(&self.fc1)` or `self.fc1.forward(&x)` (a \
                 deliberate direct use goes in ShardState::allow_direct_use)",
            ),
            (
                ShardError::Engine(EngineFailure {
                    rank: 1,
                    problem: EngineProblem::GradientSum {
                        param: "norm.weight".into(),
                        source: Box::new(dist()),
                    },
                }),
                // The DistError names the rank (once), after the context.
                "shard_module: sequence-parallel parameter `norm.weight`: summing its gradient \
                 over the tensor-parallel group failed: rank 1: all_gather (differentiable) \
                 failed: rank 0 closed the connection",
            ),
            (
                ShardError::Contract(ContractError::AlreadyApplied {
                    api: "shard_module",
                    module: "Mlp",
                }),
                "Each distinct composable distributed API can only be applied to a module \
                 once. shard_module has already been applied to the following module: Mlp",
            ),
            (
                ShardError::Disagreement {
                    source: DistError::Mismatch {
                        rank: 1,
                        op: "shard_module",
                        mismatch: Box::new(tch_dist_runtime::Mismatch::OptionValue {
                            option: "plan[\"fc1\"]".into(),
                            values: vec!["Sharder(\"colwise_linear\")".into(), "nothing".into()],
                        }),
                    },
                },
                "rank 1: shard_module: option `plan[\"fc1\"]` differs across ranks: rank 0 has \
                 Sharder(\"colwise_linear\"), rank 1 has nothing",
            ),
        ],
        shard_name,
        &[
            "Plan",
            "Parallelize",
            "InvalidArgument",
            "Dist",
            "Forward",
            "HooksBypassed",
            "GradientSum",
            "Contract",
            "Disagreement",
        ],
    );
    // The other shapes of the variants that carry a FQN or a DistError.
    let root = plan(
        0,
        "",
        PlanProblem::Sharder {
            sharder: "rowwise_linear".into(),
            source: SharderError::NoWeight { kind: "Mlp" },
        },
    );
    assert_eq!(
        crate::report(&root),
        "rank 0: shard_module: the root module: rowwise_linear: this `Mlp` has no `weight` \
         parameter"
    );
    // Display names only the variant's own context; the problem is its source.
    assert_eq!(root.to_string(), "rank 0: shard_module: the root module");
    // A failed collective's DistError names the rank itself, so the hook's context does not.
    let collective = forward(HookSite::Output, ForwardProblem::collective(dist()));
    assert_eq!(
        collective.to_string(),
        "shard_module: output of `fc2`: rank 1: all_gather (differentiable) failed: rank \
         0 closed the connection"
    );
    let dim = forward(
        HookSite::Output,
        ForwardProblem::OutputDim { dim: -3, ndim: 2 },
    );
    assert_eq!(
        dim.to_string(),
        "shard_module: output of `fc2` on rank 1: output_plan's dim -3 is out of range for an \
         output of 2 dims"
    );
    let column = forward(HookSite::ColumnParallel, ForwardProblem::collective(dist()));
    assert!(column
        .to_string()
        .starts_with("shard_module: column-parallel `fc2`: rank 1: all_gather"));
    // A DistError that names no rank (not from this group): the context names it.
    let other = engine(1, "fc1", DistError::NotInitialized);
    assert_eq!(
        crate::report(&other),
        "rank 1: shard_module: `fc1`: the default process group is not initialized; call \
         init_process_group first"
    );
    assert_eq!(other.to_string(), "rank 1: shard_module: `fc1`");
    let other_rank = forward(
        HookSite::RowParallel,
        ForwardProblem::collective(DistError::NotInitialized),
    );
    assert_eq!(
        other_rank.to_string(),
        "shard_module: row-parallel `fc2` on rank 1: the default process group is not \
         initialized; call init_process_group first"
    );
    let root_bypassed = ShardError::hooks_bypassed(0, "", "weight");
    assert_eq!(
        root_bypassed.to_string(),
        "rank 0: shard_module: parameter `weight` of the root module was used outside a call \
         of the module through its forward hooks, where this rank's shard alone gives a \
         wrong result; call the module with `.call(&x)`, not `x.apply(..)` or `.forward(..)` \
         (a deliberate direct use goes in ShardState::allow_direct_use)"
    );
    for e in [
        root,
        collective,
        dim,
        column,
        other,
        other_rank,
        root_bypassed,
    ] {
        let text = crate::report(&e);
        assert_eq!(text.matches("shard_module").count(), 1, "{text}");
        let rank = if text.contains("rank 0:") { 0 } else { 1 };
        assert_eq!(
            text.matches(&format!("rank {rank}")).count()
                - text.matches(&format!("rank {rank} closed")).count(),
            1,
            "{text}"
        );
    }
}

/// Display names only the variant's own context: the error inside is its source, printed
/// once by [`report`](crate::report) (and by anyhow's or eyre's `{:#}`).
#[test]
fn displays_name_only_their_own_context() {
    let placements = PlanProblem::Placements {
        source: Box::new(ShardingError::DimOutOfRange { dim: 2, ndim: 2 }),
    };
    assert_eq!(placements.to_string(), "placements do not match the group");
    assert!(std::error::Error::source(&placements).is_some());
    let layer = PlanProblem::Layer {
        module: "fc1".into(),
        source: SharderError::ZeroFused,
    };
    assert_eq!(layer.to_string(), "`fc1`");
    assert_eq!(crate::report(&layer), "`fc1`: fused must be at least 1");
    let plan = plan(0, "fc1", layer);
    assert_eq!(plan.to_string(), "rank 0: shard_module: `fc1`");
    assert_eq!(
        crate::report(&plan),
        "rank 0: shard_module: `fc1`: `fc1`: fused must be at least 1"
    );
    let invalid = ShardProblem::InvalidArgument {
        problem: Box::new(ArgumentError::SelfPeer),
    }
    .on(1);
    assert_eq!(invalid.to_string(), "rank 1: shard_module");
    let dist = engine(1, "fc1.weight", dist());
    assert_eq!(dist.to_string(), "shard_module: `fc1.weight`");
}

#[test]
fn every_style_problem_has_its_text() {
    let name = |p: &StyleProblem| match p {
        StyleProblem::MeshDims { .. } => "MeshDims",
        StyleProblem::Layout { .. } => "Layout",
        StyleProblem::DTensorOutput => "DTensorOutput",
        StyleProblem::Redistribute { .. } => "Redistribute",
        StyleProblem::LayoutCount { .. } => "LayoutCount",
        StyleProblem::TwoStyles { .. } => "TwoStyles",
    };
    pin(
        vec![
            (
                StyleProblem::MeshDims { ndim: 2 },
                "the mesh has 2 dims; parallelize_module takes a 1-D mesh (one dim of it: \
                 `mesh.dim(\"tp\")`), or a 2-D [\"ep\", \"tp\"] one for \
                 ExpertTensorParallel alone",
            ),
            (
                StyleProblem::Layout {
                    style: "RowwiseParallel",
                    which: "input",
                    layout: crate::sharding::Layout::Shard(1),
                },
                "RowwiseParallel with input_layouts = Shard(1) is not supported \
                 (RowwiseParallel: input Shard(-1) or Replicate (an embedding: Replicate); \
                 output Replicate or Shard(d))",
            ),
            (
                StyleProblem::Redistribute {
                    style: "PrepareModuleInput",
                    which: "input",
                    index: 1,
                    from: Some(crate::sharding::Layout::Shard(0)),
                    to: Some(crate::sharding::Layout::Shard(1)),
                },
                "PrepareModuleInput: input 1: Shard(0) to Shard(1) is not supported (a layout \
                 to itself, Shard(d) to Replicate, Replicate to Shard(d), or None to leave the \
                 tensor alone)",
            ),
            (
                StyleProblem::LayoutCount {
                    style: "PrepareModuleOutput",
                    which: "output",
                    layouts: 2,
                    desired: 1,
                },
                "PrepareModuleOutput: 2 output_layouts but 1 desired_output_layouts; give one \
                 of each per output (None for one to leave alone)",
            ),
            (
                StyleProblem::TwoStyles {
                    first: "ColwiseParallel",
                    second: "SequenceParallel",
                },
                "is given two styles (ColwiseParallel and SequenceParallel); a module takes one",
            ),
            (
                StyleProblem::DTensorOutput,
                "use_local_output = false asks for a DTensor output, which tch-dist does not \
                 have; outputs are local tensors",
            ),
        ],
        name,
        &[
            "MeshDims",
            "Layout",
            "DTensorOutput",
            "Redistribute",
            "LayoutCount",
            "TwoStyles",
        ],
    );
}
