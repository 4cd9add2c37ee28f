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
//!   input hooks and one output hook per module whose output layout changes.
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

mod plan;
mod planner;
mod sharder;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::{register_fallible_forward_hook, ForwardError, RemovableHandle};
use tch_dist_core::{contract, ContractError, Shardable};
use tch_dist_runtime::{DistError, ProcessGroup};

pub use plan::{PlanEntry, ShardingPlan, ShardingPlanBuilder};
pub use planner::{MegatronPlanner, ShardingPlanner};
pub use sharder::{ColwiseLinear, OutputLayout, RowwiseLinear, ShardedModule, Sharder};
pub use tch_dist_core::sharding::*;
pub use tch_dist_runtime::sharding::{functional, Shard, ShardedTensor};

use sharder::{chunk_sizes, sharder_for_weight_spec, ChunkedLinear};

/// Errors of [`shard_module`] and the sharders.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// The plan does not fit the model or the group; nothing was changed.
    #[error("rank {rank}: shard_module: `{fqn}`: {msg}")]
    Plan {
        /// This rank.
        rank: usize,
        /// The plan key (FQN) at fault (`""`: the root module).
        fqn: String,
        /// What is wrong.
        msg: String,
    },
    /// Applied twice, or the module's names changed.
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// The engine failed while scattering.
    #[error(transparent)]
    Dist(#[from] DistError),
}

impl ShardError {
    pub(crate) fn plan(group: &ProcessGroup, fqn: &str, msg: impl Into<String>) -> ShardError {
        ShardError::Plan {
            rank: group.rank(),
            fqn: fqn.to_string(),
            msg: msg.into(),
        }
    }
}

/// What [`shard_module`] did to a module: [`shard_module_state`] returns it.
pub struct ShardState {
    sharded: BTreeMap<String, ShardedTensorMetadata>,
    hooks: Vec<RemovableHandle>,
    group: ProcessGroup,
}

impl std::fmt::Debug for ShardState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardState")
            .field("sharded", &self.sharded.keys().collect::<Vec<_>>())
            .field("hooks", &self.hooks.len())
            .finish()
    }
}

impl ShardState {
    /// The FQNs (relative to the sharded module) of the parameters now held as shards.
    pub fn sharded_params(&self) -> impl Iterator<Item = &str> {
        self.sharded.keys().map(String::as_str)
    }

    /// The global layout of sharded parameter `fqn`.
    pub fn metadata(&self, fqn: &str) -> Option<&ShardedTensorMetadata> {
        self.sharded.get(fqn)
    }

    /// The process group the parameters are sharded over.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Sharded parameter `fqn` of `module` (the module passed to [`shard_module`]) as a
    /// [`ShardedTensor`] over this rank's live parameter, for example to gather it for a
    /// checkpoint.
    pub fn sharded_tensor<M: Shardable + ?Sized>(
        &self,
        module: &M,
        fqn: &str,
    ) -> Result<ShardedTensor, ShardError> {
        let meta = self
            .sharded
            .get(fqn)
            .ok_or_else(|| ShardError::plan(&self.group, fqn, "not a sharded parameter"))?;
        let param = module
            .named_parameters()
            .into_iter()
            .find(|(n, _)| n == fqn)
            .map(|(_, t)| t.detach())
            .ok_or_else(|| ShardError::plan(&self.group, fqn, "no such parameter"))?;
        // A single shard is the whole local parameter; several (a fused layer's parts) are
        // concatenated along dim 0 in metadata order.
        let mine = meta.shards_for_rank(self.group.rank());
        let shards = match mine.as_slice() {
            [one] => vec![Shard {
                tensor: param,
                metadata: (*one).clone(),
            }],
            several => {
                let mut off = 0;
                several
                    .iter()
                    .map(|m| {
                        let rows = m.shard_sizes[0];
                        let tensor = param.narrow(0, off, rows);
                        off += rows;
                        Shard {
                            tensor,
                            metadata: (*m).clone(),
                        }
                    })
                    .collect()
            }
        };
        Ok(ShardedTensor::from_local_shards(
            shards,
            meta.clone(),
            &self.group,
        )?)
    }

    /// Removes the forward hooks (the parameters stay sharded).
    pub fn remove_hooks(&self) {
        for h in &self.hooks {
            h.remove();
        }
    }
}

/// What one plan key shards.
enum Target {
    Linear(ChunkedLinear),
    Sharder(Arc<dyn Sharder>),
}

/// Checks the whole plan against `module` and `group`; returns the module FQN → target list.
fn validate<M: Shardable + ?Sized>(
    module: &M,
    plan: &ShardingPlan,
    src_rank: usize,
    group: &ProcessGroup,
) -> Result<Vec<(String, Target)>, ShardError> {
    let world = group.world_size();
    let err = |fqn: &str, msg: String| ShardError::plan(group, fqn, msg);
    if src_rank >= world {
        return Err(err(
            "",
            format!("src_rank {src_rank} is not in a group of size {world}"),
        ));
    }
    let modules: BTreeMap<String, &dyn Shardable> = module.named_modules().into_iter().collect();
    let params: BTreeMap<String, &Tensor> = module.named_parameters().into_iter().collect();
    let mut targets: Vec<(String, Target)> = Vec::new();
    for (key, entry) in &plan.plan {
        match entry {
            PlanEntry::Spec(spec) => {
                let Some(param) = params.get(key) else {
                    let msg = if modules.contains_key(key) {
                        "names a module, but a ShardingSpec shards a parameter; shard a module \
                         with a Sharder"
                            .to_string()
                    } else {
                        "is not a parameter of the model".to_string()
                    };
                    return Err(err(key, msg));
                };
                spec.validate_for_world(world)
                    .map_err(|e| err(key, format!("placements do not match the group: {e}")))?;
                spec.shards_metadata(&param.size())
                    .map_err(|e| err(key, e.to_string()))?;
                let (parent, leaf) = key.rsplit_once('.').unwrap_or(("", key.as_str()));
                if leaf != "weight" {
                    return Err(err(
                        key,
                        format!(
                            "only a linear layer's `weight` can be sharded by a spec (its forward \
                             is rewritten; the bias follows the weight); `{leaf}` cannot"
                        ),
                    ));
                }
                let chunked = sharder_for_weight_spec(spec).map_err(|m| err(key, m))?;
                let parent_module = modules.get(parent).ok_or_else(|| {
                    err(key, format!("its module `{parent}` is not in the model"))
                })?;
                chunked
                    .check(*parent_module, group)
                    .map_err(|m| err(key, format!("`{parent}`: {m}")))?;
                targets.push((parent.to_string(), Target::Linear(chunked)));
            }
            PlanEntry::Sharder(sharder) => {
                let Some(m) = modules.get(key) else {
                    let msg = if params.contains_key(key) {
                        "names a parameter, but a Sharder shards a module; shard a parameter with \
                         a ShardingSpec"
                            .to_string()
                    } else {
                        "is not a module of the model".to_string()
                    };
                    return Err(err(key, msg));
                };
                sharder
                    .check(key, *m, group)
                    .map_err(|m| err(key, format!("{}: {m}", sharder.name())))?;
                targets.push((key.clone(), Target::Sharder(Arc::clone(sharder))));
            }
        }
    }
    // A sharder owns its whole subtree: no other entry may reach into it.
    for (key, entry) in &plan.plan {
        for (other, other_entry) in &plan.plan {
            let PlanEntry::Sharder(sharder) = other_entry else {
                continue;
            };
            if key == other {
                continue;
            }
            let inside = other.is_empty() || key.starts_with(&format!("{other}."));
            if inside {
                let what = match entry {
                    PlanEntry::Spec(_) => "a parameter spec",
                    PlanEntry::Sharder(_) => "a sharder",
                };
                return Err(err(
                    key,
                    format!(
                        "{what} inside `{other}`, which sharder `{}` shards whole",
                        sharder.name()
                    ),
                ));
            }
        }
    }
    let mut seen = BTreeSet::new();
    for (fqn, _) in &targets {
        if !seen.insert(fqn.as_str()) {
            return Err(err(fqn, "is sharded by two plan entries".into()));
        }
    }
    for (key, spec) in &plan.output_plan {
        if !modules.contains_key(key) {
            return Err(err(
                key,
                "output_plan names a module that is not in the model".into(),
            ));
        }
        let ShardingSpec::Chunk(chunk) = spec else {
            return Err(err(
                key,
                "output_plan: only a ChunkShardingSpec can lay out a module output".into(),
            ));
        };
        spec.validate_for_world(world).map_err(|e| {
            err(
                key,
                format!("output_plan: placements do not match the group: {e}"),
            )
        })?;
        if chunk.placements.len() != world
            || chunk
                .placements
                .iter()
                .enumerate()
                .any(|(i, p)| p.rank() != i)
        {
            return Err(err(
                key,
                format!(
                    "output_plan: an output is split into one chunk per rank, chunk i on rank i \
                     ({world} placements, rank:0 first)"
                ),
            ));
        }
    }
    for key in &plan.return_local_tensor {
        if !modules.contains_key(key) {
            return Err(err(
                key,
                "return_local_tensor names a module that is not in the model".into(),
            ));
        }
        if plan.output_plan.contains_key(key) {
            continue;
        }
        let colwise = targets.iter().any(|(fqn, t)| {
            fqn == key
                && match t {
                    Target::Linear(c) => c.colwise,
                    Target::Sharder(s) => s.name().starts_with("colwise_linear"),
                }
        });
        if !colwise {
            return Err(err(
                key,
                "return_local_tensor: this module's output is not split across ranks; give it \
                 an output_plan spec saying how"
                    .into(),
            ));
        }
    }
    Ok(targets)
}

/// Shards `module` as `plan` says, with the values of rank `src_rank`, over `group`
/// (PyTorch's `shard_module`). The whole plan is checked first: an FQN not in the model, a
/// spec on a module or a sharder on a parameter, a dim out of range, placements that do not
/// match the group, an entry inside a sharder's subtree — each is an error naming it, with
/// the model unchanged. See the [module docs](self) for an example.
#[contract(crate = "crate")]
pub fn shard_module<M: Shardable + ?Sized>(
    module: &mut M,
    plan: &ShardingPlan,
    src_rank: usize,
    group: &ProcessGroup,
) -> Result<ShardState, ShardError> {
    let targets = validate(&*module, plan, src_rank, group)?;
    let module: &M = module;
    let modules: BTreeMap<String, &dyn Shardable> = module.named_modules().into_iter().collect();
    let mut sharded = BTreeMap::new();
    let mut hooks = Vec::new();
    let mut layouts: BTreeMap<String, OutputLayout> = BTreeMap::new();
    for (fqn, target) in targets {
        let m = modules[&fqn];
        let done = match &target {
            Target::Linear(c) => c.shard(&fqn, m, src_rank, group)?,
            Target::Sharder(s) => s.shard(&fqn, m, src_rank, group)?,
        };
        for (name, meta) in done.params {
            sharded.insert(tch_dist_core::path::join_fqn(&fqn, &name), meta);
        }
        hooks.extend(done.hooks);
        layouts.insert(fqn, done.output);
    }
    let mut outputs: BTreeSet<String> = layouts
        .iter()
        .filter(|(_, l)| !matches!(l, OutputLayout::Replicated))
        .map(|(k, _)| k.clone())
        .collect();
    outputs.extend(plan.return_local_tensor.iter().cloned());
    for fqn in outputs {
        let layout = layouts.remove(&fqn).unwrap_or(OutputLayout::Replicated);
        let local = plan.return_local_tensor.contains(&fqn);
        let spec = match plan.output_plan.get(&fqn) {
            Some(ShardingSpec::Chunk(c)) if local => Some(c.dim),
            _ => None,
        };
        let g = group.clone();
        let name = fqn.clone();
        // Tensors are Send but not Sync; hooks must be both.
        let layout = std::sync::Mutex::new(layout);
        let hook = register_fallible_forward_hook(modules[&fqn], move |_m, _input, out| {
            let layout = layout.lock().unwrap_or_else(|e| e.into_inner());
            convert_output(out, &layout, spec, local, &g)
                .map_err(|e| ForwardError::new(format!("shard_module: output of `{name}`: {e}")))
        })
        .map_err(|e| ShardError::plan(group, &fqn, e.to_string()))?;
        hooks.push(hook);
    }
    Ok(ShardState {
        sharded,
        hooks,
        group: group.clone(),
    })
}

/// `x` unchanged in forward; its gradient divided by `world` in backward.
fn average_gradient(x: &Tensor, world: usize) -> Tensor {
    let frozen = x.detach();
    &frozen + (x - &frozen) * (1.0 / world as f64)
}

/// The whole output from a sharded layout.
fn materialize(
    out: &Tensor,
    layout: &OutputLayout,
    g: &ProcessGroup,
) -> Result<Option<Tensor>, DistError> {
    Ok(match layout {
        OutputLayout::Replicated => None,
        OutputLayout::Sharded { dim, sizes, order } => {
            let full = functional::all_gather(out, *dim, sizes, g)?;
            Some(match order {
                Some(order) => {
                    let d = if *dim < 0 {
                        dim + full.dim() as i64
                    } else {
                        *dim
                    };
                    full.index_select(d, &Tensor::from_slice(order).to_device(full.device()))
                }
                None => full,
            })
        }
        OutputLayout::Partial { replicated } => Some(match replicated {
            Some(b) => functional::all_reduce(&(out - b), g)? + b,
            None => functional::all_reduce(out, g)?,
        }),
    })
}

/// Turns a module's raw output into what the plan asks for (`None`: unchanged).
fn convert_output(
    out: &Tensor,
    layout: &OutputLayout,
    spec_dim: Option<i64>,
    local: bool,
    g: &ProcessGroup,
) -> Result<Option<Tensor>, DistError> {
    let world = g.world_size();
    let Some(dim) = spec_dim else {
        if local {
            return Ok(None); // a column-parallel layer's local columns, handed on as they are
        }
        return materialize(out, layout, g);
    };
    let d = if dim < 0 { dim + out.dim() as i64 } else { dim };
    let local_out = match layout {
        OutputLayout::Sharded {
            dim: ldim,
            sizes,
            order: None,
        } if (if *ldim < 0 {
            ldim + out.dim() as i64
        } else {
            *ldim
        }) == d
            && *sizes == chunk_sizes(sizes.iter().sum(), world) =>
        {
            out.shallow_clone() // already this rank's chunk
        }
        OutputLayout::Partial { replicated } => {
            let len = out.size().get(d as usize).copied().unwrap_or(0);
            let sizes = chunk_sizes(len, world);
            match replicated {
                // The replicated term is this rank's own: its gradient stays local (and is
                // averaged by replicate like any data-parallel parameter's).
                Some(b) => {
                    let whole = b.expand(out.size(), false);
                    let off: i64 = sizes[..g.rank()].iter().sum();
                    let summed = functional::reduce_scatter(&(out - &whole), d, &sizes, g)?;
                    average_gradient(&summed, world) + whole.narrow(d, off, sizes[g.rank()])
                }
                None => average_gradient(&functional::reduce_scatter(out, d, &sizes, g)?, world),
            }
        }
        _ => {
            let full = materialize(out, layout, g)?.unwrap_or_else(|| out.shallow_clone());
            let len = full.size().get(d as usize).copied().unwrap_or(0);
            let sizes = chunk_sizes(len, world);
            average_gradient(&functional::split(&full, d, &sizes, g)?, world)
        }
    };
    Ok(Some(local_out))
}
