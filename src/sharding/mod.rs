//! Tensor parallelism: PyTorch's `torch.distributed._shard` (`ShardingPlan`,
//! `ShardingSpec`, `ShardedTensor`, `Sharder`, `ShardingPlanner`, `shard_module`), re-created
//! so that sharded models train.
//!
//! * A [`ShardingPlan`] maps parameter FQNs to [`ShardingSpec`]s and module FQNs to
//!   [`Sharder`]s, plus how module outputs are laid out (`output_plan`) and where sharded
//!   outputs continue as local tensors (`return_local_tensor`). Build it with typed paths
//!   (`Net::path().fc1()`), read it from JSON/TOML, or let a [`ShardingPlanner`] such as
//!   [`MegatronPlanner`] write it.
//! * [`shard_module`] validates the whole plan, then scatters each sharded parameter from
//!   `src_rank` so that every rank keeps its shard — in place: FQNs, `VarStore` entries and
//!   optimizers built afterwards see the shards — and installs forward hooks: the sharders'
//!   input hooks, one output hook per module whose output layout changes, and the check
//!   that hooked modules are not run without their hooks (see below).
//! * The hooks communicate with the differentiable collectives of
//!   [`functional`], so backward produces each rank's gradient shard.
//!
//! **Conventions.** Tensor-parallel modules take the same input on every rank. A module's
//! output is, by default, the whole tensor on every rank (a column-parallel layer's slices
//! are all-gathered, a row-parallel layer's partial sums all-reduced), so a sharded model
//! computes what the unsharded one does, and its gradients are the unsharded gradients'
//! shards. With `return_local_tensor` the module hands on this rank's shard of its output
//! instead: as is for a column-parallel layer feeding a row-parallel one (Megatron's MLP),
//! or resharded by `output_plan` to continue data-parallel (for example rows of the batch,
//! followed by [`replicate`](crate::replicate)): the loss is then each rank's loss on its
//! rows, averaged over ranks as `replicate` averages gradients, so the gradient flowing
//! back into the tensor-parallel part is divided by the world size.
//!
//! **Call sharded layers with `call`.** A sharded layer computes the unsharded layer's
//! result only through its hooks, so a model's `forward` must call it as
//! `self.fc1.call(&x)` (or `call_t`/`f_call`). `x.apply(&self.fc1)` and
//! `self.fc1.forward(&x)` run `Module::forward` alone, which computes with this rank's
//! shard, and `shard_module` makes that an error on every rank: a parameter of a module it
//! hooked, used outside a call of that module through its hooks, is a
//! [`Composition::HooksBypassed`](crate::Composition::HooksBypassed) naming the module, the
//! parameter and the fix. Inside a call of the module passed to `shard_module`, the first
//! op that uses it is refused, in every grad mode (`no_grad` inference too) and for frozen
//! parameters too: `f_call` of that module returns the error (`call` panics with it). Where
//! no such call runs (that module called with `forward`, a use outside it), autograd sees
//! the use: the backward pass fails with the error before any gradient of those parameters
//! is accumulated, so no optimizer step applies a wrong gradient (nothing is checked there
//! under `no_grad`). A layer that a forward does not use is fine; a deliberate direct use (a
//! regularizer over this rank's shards) goes in [`ShardState::allow_direct_use`].
//!
//! | file | job | PyTorch |
//! |---|---|---|
//! | `mod.rs` | [`shard_module`]: validation, the scatter, the hooks, in order; the re-exports | `torch/distributed/_shard/api.py` (`shard_module`, `shard_parameter`) |
//! | `plan.rs` | [`ShardingPlan`], its builder and serde | `_shard/sharding_plan/api.py` (`ShardingPlan`) |
//! | `planner.rs` | [`ShardingPlanner`], [`MegatronPlanner`] | `_shard/sharding_plan/api.py` (`ShardingPlanner`) |
//! | `validate.rs` | every check of a plan, before any change | the checks `shard_module` makes as it goes |
//! | `sharder.rs` | the [`Sharder`] trait and the linear sharders: the scatter and the input hooks | `_shard/sharder.py` (`Sharder`), `_shard/sharding_spec/chunk_sharding_spec.py` |
//! | `embedding.rs` | the embedding sharders: the table's columns, or its rows with the ids mapped and the other ranks' tokens masked | `_shard/sharding_spec/chunk_sharding_spec_ops/embedding.py` |
//! | `output.rs` | [`OutputLayout`] and the output hooks that restore or reshard outputs | `_reshard_output`, `_collect_local_shard` (`_shard/api.py`) |
//! | `state.rs` | [`ShardState`]: what `shard_module` did to a module | (none: PyTorch's sharded parameters are `ShardedTensor`s) |
//! | `guard.rs` | the bypass check: a hooked module's parameters used only in calls through its hooks | (none) |
//! | `parallel.rs` | [`parallelize_module`] and its styles ([`ColwiseParallel`], [`PrepareModuleInput`], ...) on a 1-D mesh, as a plan of sharders | `tensor/parallel/api.py` (`parallelize_module`), `tensor/parallel/style.py` |
//! | `redistribute.rs` | changes of layout of plain tensors, each a differentiable collective | DTensor's `redistribute` (`tensor/_redistribute.py`) |
//! | `prepare.rs` | the sharders that lay out a module's inputs or outputs: `PrepareModuleInput` / `PrepareModuleOutput`'s, and the wrappers that give a linear or embedding sharder sequence-sharded inputs and outputs | `tensor/parallel/style.py` (`PrepareModuleInput`, `PrepareModuleOutput`, `input_layouts` / `output_layouts` of the styles) |
//! | `expert.rs` | [`ExpertSharder`]: grouped experts split along the experts, the rows sent to their experts' ranks and back | torchtitan's `ExpertParallel` (`distributed/expert_parallel.py`), `AllToAllTokenDispatcher` |
//! | `sequence.rs` | [`SequenceParallel`]'s norm sharder and its gradient sums | `tensor/parallel/style.py` (`SequenceParallel`) |
//! | `error.rs` | [`ShardError`] and its contexts: [`ShardProblem`] on a rank, [`EngineFailure`] | the errors `shard_module` and `parallelize_module` raise |
//! | `error/` | the problems by job, a table of its own in `error.rs` | (as `error.rs`) |
//! | `loss.rs` | [`loss_parallel`]: cross-entropy over a column-parallel head's local logits, the full logits never built | `torch/distributed/tensor/parallel/loss.py` (`loss_parallel`) |
//!
//! ```no_run
//! use tch::nn;
//! use tch_dist::sharding::{shard_module, ColwiseLinear, RowwiseLinear, ShardingPlan};
//! use tch_dist::{Call, Shardable};
//!
//! #[derive(Debug, Shardable)]
//! struct Mlp { fc1: nn::Linear, fc2: nn::Linear }
//! impl nn::Module for Mlp {
//!     fn forward(&self, xs: &tch::Tensor) -> tch::Tensor {
//!         self.fc2.call(&self.fc1.call(xs).gelu("none"))
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let mut mlp = Mlp {
//!     fc1: nn::linear(vs.root() / "fc1", 16, 64, Default::default()),
//!     fc2: nn::linear(vs.root() / "fc2", 64, 16, Default::default()),
//! };
//! let plan = ShardingPlan::builder()
//!     .shard_module(Mlp::path().fc1(), ColwiseLinear::default())
//!     .shard_module(Mlp::path().fc2(), RowwiseLinear)
//!     .return_local_tensor(Mlp::path().fc1()) // fc2 takes fc1's local columns as they are
//!     .build();
//! shard_module(&mut mlp, &plan, 0, &pg)?;
//! assert_eq!(mlp.fc1.ws.size(), [64 / pg.world_size() as i64, 16]);
//! let ys = mlp.call(&tch::Tensor::randn([8, 16], tch::kind::FLOAT_CPU)); // [8, 16] everywhere
//! # Ok(()) }
//! ```

mod embedding;
mod error;
mod expert;
mod guard;
mod loss;
mod output;
mod parallel;
mod plan;
mod planner;
mod prepare;
mod redistribute;
mod sequence;
mod sharder;
mod state;
mod validate;

use std::collections::BTreeMap;

use tch_dist_core::{contract, Shardable};
use tch_dist_runtime::ProcessGroup;

pub use embedding::{ColwiseEmbedding, RowwiseEmbedding};
pub(crate) use error::Key;
pub use error::{
    EngineFailure, EngineProblem, ForwardProblem, HookSite, OnHook, PlanProblem, ShardError,
    ShardProblem, SharderError, StyleProblem,
};
pub use expert::ExpertSharder;
pub use loss::{loss_parallel, LossParallelError, LossParallelOptions, LossProblem};
pub use output::OutputLayout;
pub use parallel::{
    parallelize_module, ColwiseParallel, ExpertParallel, ExpertTensorParallel, Layout,
    ParallelStyle, ParallelizePlan, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel,
    SequenceParallel,
};
pub use plan::{PlanEntry, ShardingPlan, ShardingPlanBuilder};
pub use planner::{MegatronPlanner, ShardingPlanner};
pub use sharder::{ColwiseLinear, RowwiseLinear, ShardedModule, Sharder};
pub use state::ShardState;
pub use tch_dist_core::sharding::*;
pub use tch_dist_runtime::sharding::{functional, Shard, ShardedTensor};

use validate::{validate, Target};

use crate::state_dict::managed::{first_manager, ManagingApi};
use tch_dist_core::path::is_within;
use tch_dist_runtime::fsdp::tensor_identity;

/// Every parameter and buffer of `module`, by FQN: what the ranks must hold alike before
/// anything is sharded (names, shapes and dtypes, [`broadcast_the_rest`]'s premise).
fn all_tensors<M: Shardable + ?Sized>(module: &M) -> Vec<(String, &tch::Tensor)> {
    let mut all = module.named_parameters();
    all.extend(module.named_buffers());
    all
}

/// Every parameter and buffer of `module` that no sharder sharded (a sequence-parallel norm's,
/// a layer the plan does not name) gets `src_rank`'s values, so that the whole module starts
/// from one rank's values as the sharded pieces do: tch models are often seeded per rank,
/// and a replicated parameter that differs across the group trains apart (under FSDP x TP,
/// fully_shard's broadcast over `dp` alone left ranks at different `tp` positions with
/// different norms). The ranks checked before sharding that they hold the same tensors, and
/// the plan, the same on every rank, decided which were sharded: the lists match.
fn broadcast_the_rest<M: Shardable + ?Sized>(
    module: &M,
    sharded: &BTreeMap<String, ShardedTensorMetadata>,
    src_rank: usize,
    group: &ProcessGroup,
) -> Result<(), ShardError> {
    let mut rest = all_tensors(module);
    rest.retain(|(fqn, _)| !sharded.contains_key(fqn));
    let tensors: Vec<&tch::Tensor> = rest.iter().map(|(_, t)| *t).collect();
    group
        .broadcast_coalesced(&tensors, src_rank, tch_dist_runtime::BROADCAST_BUCKET_BYTES)
        .map_err(|source| ShardError::dist(group, "", source))
}

/// Shards `module` as `plan` says, with the values of rank `src_rank`, over `group`
/// (PyTorch's `shard_module`); every parameter and buffer no sharder shards gets
/// `src_rank`'s values too, so that the whole module starts from one rank's values. The
/// ranks' modules must hold the same tensors (names, shapes, dtypes), and the whole plan is
/// checked first: an FQN not in the model, a
/// spec on a module or a sharder on a parameter, a dim out of range, placements that do not
/// match the group, an entry inside a sharder's subtree — each is a [`ShardProblem::Plan`]
/// naming it, with the model unchanged. See the [module docs](self) for an example.
///
/// ```no_run
/// use tch::nn;
/// use tch_dist::sharding::{shard_module, ColwiseLinear, ShardingPlan};
/// #[derive(Debug, tch_dist::Shardable)]
/// struct Net { fc: nn::Linear }
/// let pg = tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let mut net = Net { fc: nn::linear(vs.root() / "fc", 16, 64, Default::default()) };
/// let plan = ShardingPlan::builder()
///     .shard_module(Net::path().fc(), ColwiseLinear::default())
///     .build();
/// shard_module(&mut net, &plan, 0, &pg)?; // `net.fc.ws`: this rank's rows of the weight
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[contract(
    crate = "crate",
    state_doc = r#"
```no_run
# fn demo(model: &impl tch_dist::Shardable) {
if let Some(state) = tch_dist::sharding::shard_module_state(model) {
    let sharded: Vec<&str> = state.sharded_params().collect(); // FQNs
}
# }
```
"#
)]
pub fn shard_module<M: Shardable + ?Sized>(
    module: &mut M,
    plan: &ShardingPlan,
    src_rank: usize,
    group: &ProcessGroup,
) -> Result<ShardState, ShardError> {
    // The same plan and source on every rank, or ranks would scatter and hook differently;
    // then each rank's own validation, shared, so that all ranks fail together before
    // anything changes.
    let disagreement = |source| ShardError::Disagreement { source };
    group
        .verify_same_options("shard_module", &plan_entries(plan, src_rank))
        .map_err(disagreement)?;
    let local = validate(&*module, plan, src_rank, group)
        .and_then(|targets| not_managed(&*module, &targets, group).map(|()| targets));
    let failed = group.failed_ranks(local.is_err()).map_err(disagreement)?;
    let targets = local?;
    if !failed.is_empty() {
        return Err(disagreement(tch_dist_runtime::DistError::PeersFailed {
            rank: group.rank(),
            op: "shard_module",
            ranks: failed,
        }));
    }
    let module: &M = module;
    let all = all_tensors(module);
    let named: Vec<(&str, &tch::Tensor)> = all.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    group
        .verify_same_tensors("shard_module", "tensors", src_rank, &named)
        .map_err(disagreement)?;
    let modules: BTreeMap<String, &dyn Shardable> = module.named_modules().into_iter().collect();
    let mut sharded = BTreeMap::new();
    let mut hooks = Vec::new();
    let mut layouts: BTreeMap<String, OutputLayout> = BTreeMap::new();
    // Modules whose calls need no guard (a sequence-parallel norm), and those that lay out
    // their inputs or outputs for their submodules.
    let mut unguarded = Vec::new();
    let mut prepared = Vec::new();
    // The parameters whose pieces train on every rank's inputs (expert parallelism's).
    let mut every_rank = std::collections::BTreeSet::new();
    for (fqn, target) in targets {
        if !target.needs_hooks() {
            unguarded.push(fqn.clone());
        }
        if target.prepares() {
            prepared.push(fqn.clone());
        }
        let m = modules[&fqn];
        let done = match &target {
            Target::Linear(c) => c.shard(&fqn, m, src_rank, group)?,
            Target::Sharder(s) => s.shard(&fqn, m, src_rank, group)?,
        };
        for (name, meta) in done.params {
            let param = tch_dist_core::path::join_fqn(&fqn, &name);
            if target.trained_on_every_rank() {
                every_rank.insert(param.clone());
            }
            sharded.insert(param, meta);
        }
        hooks.extend(done.hooks);
        layouts.insert(fqn, done.output);
    }
    broadcast_the_rest(module, &sharded, src_rank, group)?;
    let mut hooked: Vec<String> = layouts
        .keys()
        .filter(|f| !unguarded.contains(f))
        .cloned()
        .collect();
    let local_only = plan.return_local_tensor.iter();
    hooked.extend(local_only.filter(|f| !layouts.contains_key(*f)).cloned());
    hooks.extend(output::install_output_hooks(
        &modules, layouts, plan, group,
    )?);
    // Last, so that each scope sees a call's whole work, after the sharders' hooks and the
    // output hooks.
    let root = module.as_dyn_shardable();
    let (scopes, guards) = guard::install(root, &modules, &hooked, &prepared, group)?;
    hooks.extend(scopes);
    let registrations = state::enter_managed(module, &sharded, &every_rank, group);
    Ok(ShardState {
        _registrations: registrations,
        sharded,
        hooks,
        guards: std::sync::Mutex::new(guards),
        group: group.clone(),
    })
}

/// Refuses a planned module whose parameters `fully_shard` or `replicate` already manage
/// (their shards or gradient buckets hold the tensors as they are now).
fn not_managed<M: Shardable + ?Sized>(
    module: &M,
    targets: &[(String, Target)],
    group: &ProcessGroup,
) -> Result<(), ShardError> {
    let data_parallel = [ManagingApi::FullyShard, ManagingApi::Replicate];
    let params = module.named_parameters();
    for (m, _) in targets {
        for (fqn, t) in params.iter().filter(|(p, _)| is_within(p, m)) {
            if let Some((api, _)) = first_manager(tensor_identity(t), &data_parallel) {
                return Err(ShardError::plan(
                    group,
                    m,
                    PlanProblem::AlreadyManaged {
                        param: fqn.clone(),
                        api: api.name(),
                    },
                ));
            }
        }
    }
    Ok(())
}

/// The plan as the ranks compare it: one entry per plan key, output-plan key and
/// local-tensor module, and the source rank.
fn plan_entries(plan: &ShardingPlan, src_rank: usize) -> Vec<(String, String)> {
    let mut entries: Vec<(String, String)> = plan
        .plan
        .iter()
        .map(|(fqn, entry)| (format!("plan[{fqn:?}]"), format!("{entry:?}")))
        .collect();
    entries.extend(
        plan.output_plan
            .iter()
            .map(|(fqn, spec)| (format!("output_plan[{fqn:?}]"), format!("{spec:?}"))),
    );
    let mut local: Vec<&String> = plan.return_local_tensor.iter().collect();
    local.sort();
    entries.push(("return_local_tensor".into(), format!("{local:?}")));
    entries.push(("src_rank".into(), src_rank.to_string()));
    entries
}
