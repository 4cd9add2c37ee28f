//! The steps of one `fully_shard` call, in order (PyTorch's `_fsdp_init.py`, which
//! `fully_shard` in `_fully_shard.py` runs one after another): the process group, the checks
//! on every rank, rank 0's values, the bypass guard, the parameter group and its fence, the
//! nested calls handed to this root, the forward hooks, and the managed identities.

use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};
use tch_dist_core::hooks::{
    register_call_guard, register_call_scope, register_fallible_forward_hook_n,
    register_fallible_forward_pre_hook_n, RemovableHandle,
};
use tch_dist_core::Shardable;
use tch_dist_runtime::fsdp::ManagedParam;
use tch_dist_runtime::fsdp::{is_float, tensor_identity, FsdpGroup, FsdpGroupOptions};
use tch_dist_runtime::{
    default_group, DistError, GroupOptions, ProcessGroup, UseGuard, BROADCAST_BUCKET_BYTES,
};

use super::collect::Collected;
use super::{hooks, FsdpError, FsdpOptions, FsdpProblem, FsdpState, MeshUse, ReshardAfterForward};
use crate::state_dict::managed::{register, Layer, ManagingApi, Registration, ShardHolder};
use crate::state_dict::{MeshDimPlacement, Placement};

/// The groups of one call: the shard group (the options' `process_group`, a 1-D mesh's
/// group, a 2-D mesh's dim 1, else the default group), the replicate group (HSDP: a 2-D
/// mesh's dim 0) and the group over all of them, where the checks and rank 0's broadcast
/// run (`_get_device_from_mesh`, `_init_default_fully_shard_mesh`).
pub(super) struct Groups {
    pub shard: ProcessGroup,
    pub replicate: Option<ProcessGroup>,
    pub all: ProcessGroup,
}

pub(super) fn process_groups(opts: &FsdpOptions) -> Result<Groups, FsdpError> {
    let Some(mesh) = &opts.mesh else {
        let g = match &opts.process_group {
            Some(g) => g.clone(),
            None => default_group()?,
        };
        return Ok(Groups {
            shard: g.clone(),
            replicate: None,
            all: g,
        });
    };
    let world = default_group()?;
    let refuse = |problem| FsdpProblem::Mesh(problem).on(world.rank());
    if opts.process_group.is_some() {
        return Err(refuse(MeshUse::AndGroup));
    }
    match mesh.get_all_groups()[..] {
        [shard] => Ok(Groups {
            shard: shard.clone(),
            replicate: None,
            all: shard.clone(),
        }),
        [replicate, shard] => {
            if mesh.numel() != world.world_size() {
                return Err(refuse(MeshUse::NotWorld {
                    numel: mesh.numel(),
                    world: world.world_size(),
                }));
            }
            Ok(Groups {
                shard: shard.clone(),
                replicate: Some(replicate.clone()),
                all: world,
            })
        }
        _ => Err(refuse(MeshUse::Dims { ndim: mesh.ndim() })),
    }
}

/// The dimension each parameter is sharded along (`shard_placement_fn`, else 0), and the
/// first problem with it or with `reshard_after_forward`'s ranks.
fn shard_dims(
    found: &Collected,
    opts: &FsdpOptions,
    group: &ProcessGroup,
) -> (Vec<usize>, Option<FsdpError>) {
    let (rank, world) = (group.rank(), group.world_size());
    let mut dims = Vec::with_capacity(found.params.len());
    let mut problem = None;
    for (fqn, t) in &found.params {
        let dim = opts
            .shard_placement_fn
            .as_ref()
            .and_then(|f| f.dim(fqn, t))
            .unwrap_or(0);
        let size = t.size();
        if dim > 0 && problem.is_none() && (dim >= size.len() || size[dim] % world as i64 != 0) {
            problem = Some(
                FsdpProblem::ShardDim {
                    fqn: fqn.clone(),
                    dim,
                    shape: size.clone(),
                    world,
                }
                .on(rank),
            );
        }
        dims.push(dim);
    }
    if let Some(ReshardAfterForward::ToRanks(n)) = opts.reshard_after_forward
        && problem.is_none()
        && (n == 0 || world % n != 0)
    {
        problem = Some(FsdpProblem::ReshardRanks { ranks: n, world }.on(rank));
    }
    (dims, problem)
}

/// Every check, on every rank together, before anything changes: what [`collect`]
/// found wrong, the shard dims, the options and the parameters the same on every rank.
/// Returns the shard dims.
///
/// [`collect`]: super::collect::collect
pub(super) fn check(
    found: &mut Collected,
    opts: &FsdpOptions,
    groups: &Groups,
) -> Result<Vec<usize>, FsdpError> {
    let (dims, problem) = shard_dims(found, opts, &groups.shard);
    let group = &groups.all;
    let local = match found.problem.take().or(problem) {
        Some(p) => Err(p),
        None => Ok(()),
    };
    group.agree("fully_shard", local)?;
    let options: Vec<(String, String)> = [
        (
            "reshard_after_forward",
            format!("{:?}", opts.reshard_after_forward),
        ),
        ("ignored_params", format!("{:?}", opts.ignored_params)),
        ("mp_policy", format!("{:?}", opts.mp_policy)),
        ("shard_placement_fn dims", format!("{dims:?}")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    group.verify_same_options("fully_shard", &options)?;
    let named: Vec<(&str, &Tensor)> = found.params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    group.verify_same_tensors("fully_shard", "parameters", 0, &named)?;
    Ok(dims)
}

/// Every rank starts from rank 0's values, as replicate does (`_sync_params_and_buffers`).
pub(super) fn broadcast_from_rank0(
    found: &Collected,
    group: &ProcessGroup,
) -> Result<(), FsdpError> {
    let tensors: Vec<&Tensor> = found.params.iter().map(|(_, t)| t).collect();
    group.broadcast_coalesced(&tensors, 0, BROADCAST_BUCKET_BYTES)?;
    Ok(())
}

/// The bypass guard over the call's trainable parameters (`None`: there are none). It takes
/// each parameter's gradient accumulator while the parameter is full-sized.
pub(super) fn use_guard(
    found: &Collected,
    names: &Arc<hooks::CallNames>,
) -> Result<Option<hooks::NestedGuard>, FsdpError> {
    let trainable: Vec<usize> = (0..found.params.len())
        .filter(|&i| found.params[i].1.requires_grad())
        .collect();
    if trainable.is_empty() {
        return Ok(None);
    }
    let refs: Vec<&Tensor> = trainable.iter().map(|&i| &found.params[i].1).collect();
    let (bypassed, positions) = (Arc::clone(names), trainable.clone());
    let guard = Arc::new(UseGuard::new(names.rank, "fully_shard", &refs, move |i| {
        bypassed.bypassed(positions[i]).to_string()
    })?);
    Ok(Some(hooks::NestedGuard {
        guard,
        names: Arc::clone(names),
        trainable,
    }))
}

/// Resharding to n ranks: this rank's n consecutive ranks, as a group of their own (only
/// its members create it).
fn post_forward_group(
    opts: &FsdpOptions,
    group: &ProcessGroup,
) -> Result<Option<ProcessGroup>, FsdpError> {
    Ok(match opts.reshard_after_forward {
        Some(ReshardAfterForward::ToRanks(n)) if n > 1 && n < group.world_size() => {
            let members: Vec<usize> = group.global_ranks().to_vec();
            let rank = group.rank();
            let mine = &members[rank / n * n..rank / n * n + n];
            let sub_opts = GroupOptions::new(group.backend()).with_local_synchronization();
            group.new_group_with(mine, &sub_opts)?
        }
        _ => None,
    })
}

/// The call's parameter group (`FSDPParamGroup`): shards the parameters, then fences them
/// (armed while sharded: a managed module run without its hooks inside a hooked forward
/// fails its first op, in every grad mode).
pub(super) fn param_group(
    label: &str,
    params: Vec<ManagedParam>,
    opts: &FsdpOptions,
    groups: &Groups,
    names: &Arc<hooks::CallNames>,
) -> Result<Arc<FsdpGroup>, FsdpError> {
    let group = &groups.shard;
    let fsdp_group = Arc::new(FsdpGroup::new(
        label,
        params,
        group.clone(),
        FsdpGroupOptions {
            // The root's default; an enclosing call turns it on for this one.
            reshard_after_forward: !matches!(
                opts.reshard_after_forward,
                None | Some(ReshardAfterForward::Keep) | Some(ReshardAfterForward::ToRanks(1))
            ),
            param_dtype: opts.mp_policy.param_dtype,
            reduce_dtype: opts.mp_policy.reduce_dtype,
            post_forward_group: post_forward_group(opts, group)?,
            replicate_group: groups.replicate.clone(),
        },
    )?);
    fsdp_group.fence(Arc::clone(names))?;
    register_call_guard(&hooks::GUARD);
    Ok(fsdp_group)
}

/// The nested calls become this root's (PyTorch's lazy init of the root): their errors
/// name FQNs from here, they reshard after forward unless told otherwise, and their
/// backward passes are this root's (one end-of-backward callback finishes them all).
pub(super) fn adopt_nested(nested: &[(String, Arc<FsdpState>)], root: &FsdpGroup) {
    for (prefix, n) in nested {
        for inner in n.all() {
            inner.set_prefix(prefix);
            if inner.reshard_after_forward.is_none() {
                inner.group.set_reshard_after_forward(true);
            }
            inner.group.set_root(root);
        }
    }
}

/// The forward hooks: the call scope (unshard on entry; checks, backward hooks and
/// reshard on exit) and, under mixed precision, the casts of every floating input and
/// output (PyTorch's `_cast_fp_tensor` over the args pytree).
pub(super) fn register_hooks<M: Shardable + ?Sized>(
    module: &M,
    fsdp_group: &Arc<FsdpGroup>,
    names: &Arc<hooks::CallNames>,
    guard: Option<&hooks::NestedGuard>,
    nested: &[(String, Arc<FsdpState>)],
    opts: &FsdpOptions,
) -> Result<Vec<RemovableHandle>, FsdpError> {
    let scope = Arc::new(hooks::Scope {
        group: Arc::clone(fsdp_group),
        names: Arc::clone(names),
        guard: guard.map(|g| Arc::clone(&g.guard)),
        nested: nested
            .iter()
            .flat_map(|(_, n)| n.all())
            .filter_map(|s| s.guard.clone())
            .collect(),
    });
    let mut handles: Vec<RemovableHandle> = register_call_scope(module, scope)?.into();
    let mp = opts.mp_policy;
    if let Some(dtype) = mp.param_dtype.filter(|_| mp.cast_forward_inputs) {
        handles.push(register_fallible_forward_pre_hook_n(
            module,
            move |_, xs| Ok(cast_floats(xs, dtype)),
        )?);
    }
    if let Some(dtype) = mp.output_dtype {
        handles.push(register_fallible_forward_hook_n(
            module,
            move |_, _, outs| Ok(cast_floats(outs, dtype)),
        )?);
    }
    Ok(handles)
}

/// `tensors` with each floating one of another dtype cast to `dtype` (`None`: none is).
/// An undefined tensor (an output a forward left empty) has no dtype and stays as it is, as
/// PyTorch's cast leaves a `None` in a tuple.
fn cast_floats(tensors: &[Tensor], dtype: Kind) -> Option<Vec<Tensor>> {
    let cast = |t: &Tensor| t.defined() && is_float(t.kind()) && t.kind() != dtype;
    tensors.iter().any(cast).then(|| {
        tensors
            .iter()
            .map(|t| {
                if cast(t) {
                    t.to_kind(dtype)
                } else {
                    t.shallow_clone()
                }
            })
            .collect()
    })
}

/// Each parameter's identity with its FQN, for the registry of managed identities (taken
/// before the parameters move into the group, entered once every step succeeded).
pub(super) fn identities(params: &[(String, Tensor)]) -> Vec<(u64, String)> {
    params
        .iter()
        .map(|(n, t)| (tensor_identity(t), n.clone()))
        .collect()
}

/// Enters the call's parameters in the registry of managed parameters (a later call tying
/// one of them names it), each with how the call shards it (the placement record's layer:
/// over the shard group, and first the replicate group's copies under HSDP); the state
/// removes them on drop.
pub(super) fn enter_managed(
    identities: Vec<(u64, String)>,
    fsdp_group: &Arc<FsdpGroup>,
    groups: &Groups,
) -> Registration {
    let holder: Arc<dyn ShardHolder> = Arc::new(Holder(Arc::clone(fsdp_group)));
    let entries = identities
        .into_iter()
        .zip(fsdp_group.params())
        .enumerate()
        .map(|(index, ((id, fqn), info))| {
            let mut dims = Vec::with_capacity(2);
            if let Some(g) = &groups.replicate {
                dims.push(MeshDimPlacement {
                    placement: Placement::Replicate,
                    group: g.clone(),
                });
            }
            dims.push(MeshDimPlacement {
                placement: Placement::Shard(info.dim),
                group: groups.shard.clone(),
            });
            let layer = Layer {
                dims,
                whole: info.shape,
                offsets: info.offsets,
                local: info.local_shape,
                blocks: 1,
                holder: Arc::clone(&holder),
                index,
            };
            (id, fqn, Some(layer))
        })
        .collect();
    register(ManagingApi::FullyShard, groups.all.global_ranks(), entries)
}

/// fully_shard's holder in the state dict's registry: a call's group gathers its own
/// parameters' shards, and puts them back.
struct Holder(Arc<FsdpGroup>);

impl ShardHolder for Holder {
    fn gather(&self, index: usize, _piece: &Tensor) -> Result<Tensor, DistError> {
        self.0.full_param(index)
    }

    fn reshard(&self) -> Result<(), DistError> {
        self.0.reshard()
    }
}

/// The names a call's errors give: the module's FQN (set by the enclosing call) and its
/// parameters'.
pub(super) fn call_names(found: &Collected, rank: usize) -> Arc<hooks::CallNames> {
    Arc::new(hooks::CallNames {
        rank,
        prefix: Mutex::new(String::new()),
        params: found.params.iter().map(|(n, _)| n.clone()).collect(),
    })
}
