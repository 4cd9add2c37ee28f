//! Module outputs: the layouts sharded modules produce ([`OutputLayout`]) and the forward
//! hooks that turn them into what the plan asks for (the whole output, or this rank's chunk
//! of it for `return_local_tensor` with an `output_plan` spec).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use tch::Tensor;
use tch_dist_core::hooks::{register_fallible_forward_hook_n, ForwardError, RemovableHandle};
use tch_dist_core::sharding::chunk::{chunk_offsets, chunk_sizes, normalize_dim};
use tch_dist_core::sharding::ShardingSpec;
use tch_dist_core::Shardable;
use tch_dist_runtime::sharding::functional;
use tch_dist_runtime::ProcessGroup;

use super::error::{ForwardProblem, HookSite, ShardError};
use super::plan::ShardingPlan;

/// What a module's forward returns on each rank once it is sharded.
#[derive(Debug)]
pub enum OutputLayout {
    /// The whole output, the same on every rank.
    Replicated,
    /// This rank's slice along `dim`: rank `r` holds `sizes[r]` entries, the slices in rank
    /// order make up the output (reordered by `order` when given).
    Sharded {
        /// The dim the output is split along (negative counts from the end).
        dim: i64,
        /// Entries along `dim` per rank.
        sizes: Vec<i64>,
        /// When the ranks' slices interleave: entry `i` of the unsharded output is entry
        /// `order[i]` of the slices concatenated in rank order.
        order: Option<Vec<i64>>,
    },
    /// A partial sum: the output is the sum over ranks, plus `replicated` (added on every
    /// rank by the forward, to be counted once).
    Partial {
        /// A term every rank added (a row-parallel layer's bias).
        replicated: Option<Tensor>,
    },
}

/// Registers one forward hook per module whose output the plan changes: the sharded modules
/// whose `layouts` are not replicated, and the `return_local_tensor` modules.
pub(super) fn install_output_hooks(
    modules: &BTreeMap<String, &dyn Shardable>,
    mut layouts: BTreeMap<String, OutputLayout>,
    plan: &ShardingPlan,
    group: &ProcessGroup,
) -> Result<Vec<RemovableHandle>, ShardError> {
    let mut outputs: BTreeSet<String> = layouts
        .iter()
        .filter(|(_, l)| !matches!(l, OutputLayout::Replicated))
        .map(|(k, _)| k.clone())
        .collect();
    outputs.extend(plan.return_local_tensor.iter().cloned());
    let mut hooks = Vec::new();
    for fqn in outputs {
        let layout = layouts.remove(&fqn).unwrap_or(OutputLayout::Replicated);
        let local = plan.return_local_tensor.contains(&fqn);
        let spec_dim = match plan.output_plan.get(&fqn) {
            Some(ShardingSpec::Chunk(c)) if local => Some(c.dim),
            _ => None,
        };
        let g = group.clone();
        let name = fqn.clone();
        // Tensors are Send but not Sync; hooks must be both.
        let layout = Mutex::new(layout);
        // Any inputs (a block's `(x, mask)`); one output, which the layout describes.
        let hook = register_fallible_forward_hook_n(modules[&fqn], move |_m, _inputs, outs| {
            let layout = layout.lock().unwrap_or_else(|e| e.into_inner());
            let converted = match outs {
                [out] => convert_output(out, &layout, spec_dim, local, &g),
                _ => Err(ForwardProblem::Outputs { got: outs.len() }),
            };
            converted.map(|o| o.map(|t| vec![t])).map_err(|problem| {
                ForwardError::from_error(ShardError::forward(&g, &name, HookSite::Output, problem))
            })
        })
        .map_err(|source| ShardError::unhookable(group, &fqn, source))?;
        hooks.push(hook);
    }
    Ok(hooks)
}

/// `x` unchanged in forward; its gradient divided by `world` in backward.
fn average_gradient(x: &Tensor, world: usize) -> Tensor {
    let frozen = x.detach();
    &frozen + (x - &frozen) * (1.0 / world as f64)
}

/// `dim` of `t`, or the problem naming it.
fn dim_of(t: &Tensor, dim: i64) -> Result<usize, ForwardProblem> {
    let ndim = t.dim();
    normalize_dim(dim, ndim).ok_or(ForwardProblem::OutputDim { dim, ndim })
}

/// The whole output from a sharded layout (`None`: it is whole already).
pub(super) fn materialize(
    out: &Tensor,
    layout: &OutputLayout,
    g: &ProcessGroup,
) -> Result<Option<Tensor>, ForwardProblem> {
    let collective = ForwardProblem::collective;
    Ok(match layout {
        OutputLayout::Replicated => None,
        OutputLayout::Sharded { dim, sizes, order } => {
            let full = functional::all_gather(out, *dim, sizes, g).map_err(collective)?;
            Some(match order {
                Some(order) => {
                    let d = dim_of(&full, *dim)? as i64;
                    full.index_select(d, &Tensor::from_slice(order).to_device(full.device()))
                }
                None => full,
            })
        }
        OutputLayout::Partial { replicated } => Some(match replicated {
            Some(b) => functional::all_reduce(&(out - b), g).map_err(collective)? + b,
            None => functional::all_reduce(out, g).map_err(collective)?,
        }),
    })
}

/// Turns a module's raw output into what the plan asks for (`None`: unchanged): the whole
/// output, the local output as is (`local` without a spec dim), or this rank's chunk along
/// `spec_dim` (its gradient averaged over the ranks, which continue data-parallel).
fn convert_output(
    out: &Tensor,
    layout: &OutputLayout,
    spec_dim: Option<i64>,
    local: bool,
    g: &ProcessGroup,
) -> Result<Option<Tensor>, ForwardProblem> {
    let collective = ForwardProblem::collective;
    let world = g.world_size();
    let Some(spec_dim) = spec_dim else {
        if local {
            return Ok(None); // a column-parallel layer's local columns, handed on as they are
        }
        return materialize(out, layout, g);
    };
    let d = dim_of(out, spec_dim)?;
    let local_out = match layout {
        OutputLayout::Sharded {
            dim,
            sizes,
            order: None,
        } if normalize_dim(*dim, out.dim()) == Some(d)
            && *sizes == chunk_sizes(sizes.iter().sum(), world) =>
        {
            out.shallow_clone() // already this rank's chunk
        }
        OutputLayout::Partial { replicated } => {
            let sizes = chunk_sizes(out.size()[d], world);
            let d = d as i64;
            match replicated {
                // The replicated term is this rank's own: its gradient stays local (and is
                // averaged by replicate like any data-parallel parameter's).
                Some(b) => {
                    let whole = b.expand(out.size(), false);
                    let off = chunk_offsets(out.size()[d as usize], world)[g.rank()];
                    let summed = functional::reduce_scatter(&(out - &whole), d, &sizes, g)
                        .map_err(collective)?;
                    average_gradient(&summed, world) + whole.narrow(d, off, sizes[g.rank()])
                }
                None => average_gradient(
                    &functional::reduce_scatter(out, d, &sizes, g).map_err(collective)?,
                    world,
                ),
            }
        }
        _ => {
            let full = materialize(out, layout, g)?.unwrap_or_else(|| out.shallow_clone());
            let d = dim_of(&full, spec_dim)?;
            let sizes = chunk_sizes(full.size()[d], world);
            average_gradient(
                &functional::split(&full, d as i64, &sizes, g).map_err(collective)?,
                world,
            )
        }
    };
    Ok(Some(local_out))
}
