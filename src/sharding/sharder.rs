//! [`Sharder`]: shards a whole submodule; [`ColwiseLinear`] and [`RowwiseLinear`], the
//! Megatron-LM pair for linear layers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::ThreadId;

use tch::{Device, Tensor};
use tch_dist_core::hooks::{register_fallible_forward_pre_hook, ForwardError, RemovableHandle};
use tch_dist_core::path::join_fqn;
use tch_dist_core::sharding::chunk::{chunk_offsets, chunk_sizes, normalize_dim};
use tch_dist_core::sharding::{
    ChunkShardingSpec, EnumerableShardingSpec, Placement, ShardMetadata, ShardedTensorMetadata,
    ShardingError, ShardingSpec,
};
use tch_dist_core::Shardable;
use tch_dist_runtime::sharding::{functional, ShardedTensor};
use tch_dist_runtime::ProcessGroup;

use super::error::{ForwardProblem, HookSite, PlanProblem, ShardError, SharderError};
use super::output::OutputLayout;

/// Shards a whole submodule (PyTorch's `Sharder`): replaces its parameters by this rank's
/// shards (in place, so FQNs, `VarStore` entries and module identity stay) and installs the
/// forward hooks its sharded forward needs.
///
/// [`shard_module`](super::shard_module) calls [`Sharder::check`] on every sharder of a
/// plan before [`Sharder::shard`] on any, and handles the module's output (see
/// [`OutputLayout`]) according to the plan's `output_plan` and `return_local_tensor`.
pub trait Sharder: Send + Sync {
    /// The name plan files use for this sharder (`"colwise_linear"`).
    fn name(&self) -> String;

    /// Whether `module` (at `fqn`) can be sharded over `group`; changes nothing. A
    /// third-party sharder gives its own reasons as [`SharderError::Custom`].
    fn check(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        group: &ProcessGroup,
    ) -> Result<(), SharderError>;

    /// Whether the sharded module's output is split across the ranks (its last dim: a
    /// column-parallel layer's), so that `return_local_tensor` may hand on this rank's
    /// piece. False unless a sharder says so.
    fn splits_output(&self) -> bool {
        false
    }

    /// Whether the sharder shards the module's whole subtree, so that no other plan entry
    /// may reach inside it (true unless a sharder says so). A sharder that only lays out the
    /// module's inputs or outputs (`PrepareModuleInput`) leaves its submodules to other
    /// entries; those are then refused outside calls of the module through its hooks (inside
    /// the sharded root's call), since their inputs are laid out by it.
    fn owns_subtree(&self) -> bool {
        true
    }

    /// Whether the module computes the plan's result only through its hooks, so that a use
    /// of its parameters outside its hooked calls (`x.apply(&m)`) is refused (true unless a
    /// sharder says so). A sharder whose hooks change nothing the module computes says false
    /// (sequence parallelism's norm: its forward is the same on this rank's chunk, and its
    /// parameters' gradients are summed on the parameters themselves).
    fn needs_hooks(&self) -> bool {
        true
    }

    /// Whether each rank's piece is trained on the inputs of every rank of the group, its
    /// gradient already that of the group's data (expert parallelism: rank `r`'s experts
    /// take the tokens every rank routes to them). `replicate` and `fully_shard` over the
    /// same ranks then leave such pieces alone, where they refuse tensor-parallel ones; false
    /// unless a sharder says so.
    fn trained_on_every_rank(&self) -> bool {
        false
    }

    /// Shards `module` with the values of rank `src_rank` and installs its hooks.
    fn shard(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedModule, ShardError>;
}

/// The result of [`Sharder::shard`].
#[derive(Debug)]
pub struct ShardedModule {
    /// The sharded parameters (local names, `"weight"`) and their global layout.
    pub params: Vec<(String, ShardedTensorMetadata)>,
    /// What the module's forward now returns.
    pub output: OutputLayout,
    /// The hooks the sharder installed.
    pub hooks: Vec<RemovableHandle>,
}

impl ShardedModule {
    /// A module whose parameters stay whole and whose output needs nothing more: only
    /// `hook` (a layout sharder's).
    pub(super) fn hook_only(hook: RemovableHandle) -> ShardedModule {
        ShardedModule {
            params: Vec::new(),
            output: OutputLayout::Replicated,
            hooks: vec![hook],
        }
    }
}

/// Column-parallel linear layer (Megatron's `ColumnParallelLinear`): the weight
/// `[out, in]` and bias `[out]` are split along `out`, every rank computes its slice of the
/// output features from the whole input. With `fused = k` the weight is `k` layers stacked
/// (a fused query-key-value projection, `k = 3`): each of the `k` parts is split across the
/// ranks, so rank `r` holds the `r`-th slice of every part and can split its local output
/// into `k` pieces.
///
/// ```
/// use tch_dist::sharding::{ColwiseLinear, Sharder};
/// assert_eq!(ColwiseLinear::default().name(), "colwise_linear");
/// assert_eq!(ColwiseLinear { fused: 3 }.name(), "colwise_linear(fused=3)");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColwiseLinear {
    /// How many layers the weight stacks along `out` (1: a plain linear layer).
    pub fused: usize,
}

impl Default for ColwiseLinear {
    fn default() -> Self {
        ColwiseLinear { fused: 1 }
    }
}

/// Row-parallel linear layer (Megatron's `RowParallelLinear`): the weight `[out, in]` is
/// split along `in`, the bias stays whole; every rank computes a partial sum from its slice
/// of the input features (sliced from a whole input, or taken as is from a column-parallel
/// layer's local output).
///
/// ```
/// use tch_dist::sharding::{RowwiseLinear, Sharder};
/// assert_eq!(RowwiseLinear.name(), "rowwise_linear");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RowwiseLinear;

/// The built-in sharders by [`Sharder::name`] (for plan files).
pub(crate) fn sharder_by_name(name: &str) -> Option<Arc<dyn Sharder>> {
    if name == "rowwise_linear" {
        return Some(Arc::new(RowwiseLinear));
    }
    if name == "colwise_linear" {
        return Some(Arc::new(ColwiseLinear::default()));
    }
    if name == "colwise_embedding" {
        return Some(Arc::new(super::ColwiseEmbedding));
    }
    if name == "rowwise_embedding" {
        return Some(Arc::new(super::RowwiseEmbedding));
    }
    if name == "expert_parallel" {
        return Some(Arc::new(super::ExpertSharder::default()));
    }
    let fused = name
        .strip_prefix("colwise_linear(fused=")?
        .strip_suffix(')')?
        .parse()
        .ok()
        .filter(|&k| k >= 1)?;
    Some(Arc::new(ColwiseLinear { fused }))
}

/// Both linear sharders, and parameter specs on a linear layer's weight.
#[derive(Debug, Clone)]
pub(crate) struct ChunkedLinear {
    /// Split `out` (column-parallel) or `in` (row-parallel).
    pub colwise: bool,
    pub fused: usize,
    /// One per rank, rank `i` at position `i`; `None`: each rank on the weight's device.
    pub placements: Option<Vec<Placement>>,
}

/// A linear layer's parameters: `weight` `[out, in]` and an optional `bias` `[out]`.
struct LinearParams {
    weight: Tensor,
    bias: Option<Tensor>,
}

fn linear_params(module: &dyn Shardable) -> Result<LinearParams, SharderError> {
    let kind = module.type_name();
    if let Some(child) = first_submodule(module) {
        return Err(SharderError::Submodule { kind, child });
    }
    let mut weight = None;
    let mut bias = None;
    for (name, t) in module.named_parameters() {
        match name.as_str() {
            "weight" => weight = Some(t.shallow_clone()),
            "bias" => bias = Some(t.shallow_clone()),
            _ => return Err(SharderError::ExtraParameter { kind, name }),
        }
    }
    let weight = weight.ok_or(SharderError::NoWeight { kind })?;
    if weight.dim() != 2 {
        let shape = weight.size();
        return Err(SharderError::WeightShape { shape });
    }
    if let Some(b) = &bias
        && b.size() != [weight.size()[0]]
    {
        return Err(SharderError::BiasShape {
            shape: b.size(),
            weight: weight.size(),
        });
    }
    Ok(LinearParams { weight, bias })
}

impl ChunkedLinear {
    pub fn name(&self) -> String {
        match (self.colwise, self.fused) {
            (false, _) => "rowwise_linear".into(),
            (true, 1) => "colwise_linear".into(),
            (true, k) => format!("colwise_linear(fused={k})"),
        }
    }

    fn placements(&self, group: &ProcessGroup, device: Device) -> Vec<Placement> {
        self.placements.clone().unwrap_or_else(|| {
            (0..group.world_size())
                .map(|r| Placement::new(r, device))
                .collect()
        })
    }

    pub fn check(&self, module: &dyn Shardable, group: &ProcessGroup) -> Result<(), SharderError> {
        let p = linear_params(module)?;
        if let Some(pl) = &self.placements {
            let world_size = group.world_size();
            if pl.len() != world_size || pl.iter().enumerate().any(|(i, p)| p.rank() != i) {
                return Err(SharderError::Placements {
                    placements: pl.clone(),
                    world_size,
                });
            }
        }
        if self.fused == 0 {
            return Err(SharderError::ZeroFused);
        }
        let out_features = p.weight.size()[0];
        if self.colwise && out_features % self.fused as i64 != 0 {
            return Err(SharderError::NotDivisible {
                out_features,
                fused: self.fused,
            });
        }
        Ok(())
    }

    /// The weight's shards: `fused` parts along `out` (column-parallel) each chunked over
    /// the ranks, or one chunking of `in` (row-parallel).
    fn weight_shards(&self, shape: &[i64], placements: &[Placement]) -> Vec<ShardMetadata> {
        let (out, inp) = (shape[0], shape[1]);
        if self.colwise {
            let part = out / self.fused as i64;
            let sizes = chunk_sizes(part, placements.len());
            let offsets = chunk_offsets(part, placements.len());
            let mut shards = Vec::new();
            for j in 0..self.fused as i64 {
                for ((p, &s), &off) in placements.iter().zip(&sizes).zip(&offsets) {
                    shards.push(ShardMetadata {
                        shard_offsets: vec![j * part + off, 0],
                        shard_sizes: vec![s, inp],
                        placement: *p,
                    });
                }
            }
            shards
        } else {
            let sizes = chunk_sizes(inp, placements.len());
            let offsets = chunk_offsets(inp, placements.len());
            placements
                .iter()
                .zip(sizes.iter().zip(&offsets))
                .map(|(p, (&s, &off))| ShardMetadata {
                    shard_offsets: vec![0, off],
                    shard_sizes: vec![out, s],
                    placement: *p,
                })
                .collect()
        }
    }

    pub fn shard(
        &self,
        fqn: &str,
        module: &dyn Shardable,
        src_rank: usize,
        group: &ProcessGroup,
    ) -> Result<ShardedModule, ShardError> {
        let p = linear_params(module).map_err(|source| refused(group, fqn, self.name(), source))?;
        let layout = |e: ShardingError| {
            ShardError::plan(group, fqn, PlanProblem::Layout { source: e.into() })
        };
        let placements = self.placements(group, p.weight.device());
        let world = group.world_size();
        let rank = group.rank();
        let shape = p.weight.size();
        let weight_shards = self.weight_shards(&shape, &placements);
        let mut params = Vec::new();
        let weight_spec = ShardingSpec::Enumerable(
            EnumerableShardingSpec::new(weight_shards.clone()).map_err(layout)?,
        );
        let weight_fqn = join_fqn(fqn, "weight");
        let weight_local = scatter_local(&p.weight, &weight_spec, src_rank, group, &weight_fqn)?;
        params.push(("weight".to_string(), weight_local.1));
        let mut hooks = Vec::new();
        let unhookable = |source| ShardError::unhookable(group, fqn, source);
        let output;
        if self.colwise {
            let part = shape[0] / self.fused as i64;
            let per_rank: Vec<i64> = chunk_sizes(part, world)
                .iter()
                .map(|s| s * self.fused as i64)
                .collect();
            if let Some(b) = &p.bias {
                let bias_shards: Vec<ShardMetadata> = weight_shards
                    .into_iter()
                    .map(|m| ShardMetadata {
                        shard_offsets: vec![m.shard_offsets[0]],
                        shard_sizes: vec![m.shard_sizes[0]],
                        placement: m.placement,
                    })
                    .collect();
                let spec = ShardingSpec::Enumerable(
                    EnumerableShardingSpec::new(bias_shards).map_err(layout)?,
                );
                let local = scatter_local(b, &spec, src_rank, group, &join_fqn(fqn, "bias"))?;
                params.push(("bias".to_string(), local.1));
                set_local(b, &local.0);
            }
            set_local(&p.weight, &weight_local.0);
            // Gathered in rank order, rank r's slice holds its chunk of every fused part.
            let order = (self.fused > 1).then(|| {
                let sizes = chunk_sizes(part, world);
                let offsets = chunk_offsets(part, world);
                // Gathered entries are rank-major, then part, then row within the chunk.
                let mut gathered_from = Vec::new();
                for (&s, &off) in sizes.iter().zip(&offsets) {
                    for j in 0..self.fused as i64 {
                        gathered_from.extend((0..s).map(|i| j * part + off + i));
                    }
                }
                let mut order = vec![0i64; gathered_from.len()];
                for (g, &orig) in gathered_from.iter().enumerate() {
                    order[orig as usize] = g as i64;
                }
                order
            });
            output = OutputLayout::Sharded {
                dim: -1,
                sizes: per_rank,
                order,
            };
            let g = group.clone();
            let name = fqn.to_string();
            hooks.push(
                register_fallible_forward_pre_hook(module, move |_m, xs| {
                    functional::copy_to_ranks(xs, &g).map(Some).map_err(|e| {
                        let problem = ForwardProblem::collective(e);
                        hook_error(&g, &name, HookSite::ColumnParallel, problem)
                    })
                })
                .map_err(unhookable)?,
            );
        } else {
            set_local(&p.weight, &weight_local.0);
            // The bias stays whole on every rank: the source rank's.
            if let Some(b) = &p.bias {
                tch::no_grad(|| group.broadcast(b, src_rank))
                    .map_err(|e| ShardError::dist(group, &join_fqn(fqn, "bias"), e))?;
            }
            let sizes = chunk_sizes(shape[1], world);
            let full = shape[1];
            let local = sizes[rank];
            let g = group.clone();
            let name = fqn.to_string();
            hooks.push(
                register_fallible_forward_pre_hook(module, move |_m, xs| {
                    let width = xs.size().last().copied().unwrap_or(0);
                    if width == local {
                        return Ok(None); // already this rank's slice of the features
                    }
                    if width != full {
                        let problem = ForwardProblem::InputWidth { full, local, width };
                        return Err(hook_error(&g, &name, HookSite::RowParallel, problem));
                    }
                    functional::split(xs, -1, &sizes, &g)
                        .map(Some)
                        .map_err(|e| {
                            let problem = ForwardProblem::collective(e);
                            hook_error(&g, &name, HookSite::RowParallel, problem)
                        })
                })
                .map_err(unhookable)?,
            );
            output = OutputLayout::Partial {
                replicated: p.bias.as_ref().map(|b| b.shallow_clone()),
            };
        }
        Ok(ShardedModule {
            params,
            output,
            hooks,
        })
    }
}

/// Sharder `sharder`'s refusal (`source`) of module `fqn`, met while sharding it: the plan
/// problem its check gives.
pub(super) fn refused(
    group: &ProcessGroup,
    fqn: &str,
    sharder: String,
    source: SharderError,
) -> ShardError {
    ShardError::plan(group, fqn, PlanProblem::Sharder { sharder, source })
}

/// A failed hook's error: a typed [`ShardError::Forward`] that `f_call` callers can
/// downcast.
pub(super) fn hook_error(
    g: &ProcessGroup,
    fqn: &str,
    site: HookSite,
    problem: ForwardProblem,
) -> ForwardError {
    ForwardError::from_error(ShardError::forward(g, fqn, site, problem))
}

/// Scatters parameter `fqn` (`t`) by `spec` from `src_rank`; this rank's shards
/// concatenated along dim 0 (in metadata order), and the global metadata.
pub(super) fn scatter_local(
    t: &Tensor,
    spec: &ShardingSpec,
    src_rank: usize,
    group: &ProcessGroup,
    fqn: &str,
) -> Result<(Tensor, ShardedTensorMetadata), ShardError> {
    let st = ShardedTensor::scatter(t, spec, src_rank, group)
        .map_err(|e| ShardError::dist(group, fqn, e))?;
    let pieces: Vec<&Tensor> = st.local_shards().iter().map(|s| &s.tensor).collect();
    let local = match pieces.as_slice() {
        [one] => one.shallow_clone(),
        many => Tensor::cat(many, 0),
    };
    Ok((local, st.metadata().clone()))
}

/// Splits parameter `name` (`t`) of module `fqn` along `dim` into even chunks over `group`
/// (chunk `r` on rank `r`), from `src_rank`'s values: this rank's chunk in place, and the
/// global layout.
pub(super) fn shard_along(
    fqn: &str,
    name: &str,
    t: &Tensor,
    dim: usize,
    src_rank: usize,
    group: &ProcessGroup,
) -> Result<ShardedTensorMetadata, ShardError> {
    let shape = t.size();
    let world = group.world_size();
    let (sizes, offsets) = (
        chunk_sizes(shape[dim], world),
        chunk_offsets(shape[dim], world),
    );
    let shards = (0..world)
        .map(|r| {
            let mut shard_offsets = vec![0; shape.len()];
            let mut shard_sizes = shape.clone();
            shard_offsets[dim] = offsets[r];
            shard_sizes[dim] = sizes[r];
            ShardMetadata {
                shard_offsets,
                shard_sizes,
                placement: Placement::new(r, t.device()),
            }
        })
        .collect();
    let layout =
        |e: ShardingError| ShardError::plan(group, fqn, PlanProblem::Layout { source: e.into() });
    let spec = ShardingSpec::Enumerable(EnumerableShardingSpec::new(shards).map_err(layout)?);
    let (local, meta) = scatter_local(t, &spec, src_rank, group, &join_fqn(fqn, name))?;
    set_local(t, &local);
    Ok(meta)
}

/// The FQN of `module`'s first submodule, if it has any (a sharder of one layer refuses
/// a module that holds others).
pub(super) fn first_submodule(module: &dyn Shardable) -> Option<String> {
    module
        .named_modules()
        .into_iter()
        .map(|(n, _)| n)
        .find(|n| !n.is_empty())
}

/// What a sharder's input hook leaves for its output hook, per call: per thread (a
/// recomputation in backward runs on the engine's thread), innermost call last.
pub(super) struct PerCall<T>(Mutex<HashMap<ThreadId, Vec<T>>>);

impl<T> Default for PerCall<T> {
    fn default() -> Self {
        PerCall(Mutex::new(HashMap::new()))
    }
}

impl<T> PerCall<T> {
    /// Leaves `value` for this thread's current call.
    pub(super) fn push(&self, value: T) {
        let mut m = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        m.entry(std::thread::current().id())
            .or_default()
            .push(value);
    }

    /// Takes what this thread's innermost call left.
    pub(super) fn pop(&self) -> Option<T> {
        let mut m = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let id = std::thread::current().id();
        let value = m.get_mut(&id).and_then(Vec::pop);
        if m.get(&id).is_some_and(Vec::is_empty) {
            m.remove(&id);
        }
        value
    }
}

/// Makes `param` hold `local` (same tensor object, so every handle on it sees the shard).
pub(super) fn set_local(param: &Tensor, local: &Tensor) {
    tch::no_grad(|| {
        let mut handle = param.shallow_clone();
        handle.set_data(local);
    });
}

/// The built-in linear sharders are [`ChunkedLinear`] configurations: their [`Sharder`]
/// methods delegate to it. (A macro rather than a blanket impl over a private trait, so that
/// the documentation shows `impl Sharder for ColwiseLinear`.)
macro_rules! delegate_to_chunked_linear {
    ($($sharder:ty),*) => {$(
        impl Sharder for $sharder {
            fn name(&self) -> String {
                self.as_chunked().name()
            }
            fn check(
                &self,
                _fqn: &str,
                module: &dyn Shardable,
                group: &ProcessGroup,
            ) -> Result<(), SharderError> {
                self.as_chunked().check(module, group)
            }
            fn splits_output(&self) -> bool {
                self.as_chunked().colwise
            }
            fn shard(
                &self,
                fqn: &str,
                module: &dyn Shardable,
                src_rank: usize,
                group: &ProcessGroup,
            ) -> Result<ShardedModule, ShardError> {
                self.as_chunked().shard(fqn, module, src_rank, group)
            }
        }
    )*};
}

delegate_to_chunked_linear!(ColwiseLinear, RowwiseLinear);

impl ColwiseLinear {
    fn as_chunked(&self) -> ChunkedLinear {
        ChunkedLinear {
            colwise: true,
            fused: self.fused,
            placements: None,
        }
    }
}

impl RowwiseLinear {
    fn as_chunked(&self) -> ChunkedLinear {
        ChunkedLinear {
            colwise: false,
            fused: 1,
            placements: None,
        }
    }
}

/// A parameter spec on a linear layer's `weight`, as the equivalent sharder: chunks along
/// dim 0 are column-parallel, along dim 1 row-parallel.
pub(crate) fn sharder_for_weight_spec(spec: &ShardingSpec) -> Result<ChunkedLinear, PlanProblem> {
    let ShardingSpec::Chunk(ChunkShardingSpec { dim, placements }) = spec else {
        return Err(PlanProblem::EnumerableWeightSpec);
    };
    let colwise = match normalize_dim(*dim, 2) {
        Some(0) => true,
        Some(_) => false,
        None => return Err(PlanProblem::WeightDim { dim: *dim }),
    };
    Ok(ChunkedLinear {
        colwise,
        fused: 1,
        placements: Some(placements.clone()),
    })
}
