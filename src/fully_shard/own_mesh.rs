//! Per-parameter meshes (PyTorch's `shard_placement_fn` returning a placement with a mesh of
//! its own, pytorch#173509; torchtitan#2281 puts a MoE block's experts on `efsdp` and the
//! rest on `dp`): the submodules whose parameters the function puts on a mesh of their own
//! are each sharded by a `fully_shard` of their own over that mesh, before the call's, which
//! then leaves them be as any nested call. PyTorch runs one collective per mesh inside one
//! parameter group; here each mesh's parameters are a group of their own, gathered around
//! their submodule's call: the same values and gradients, one more pair of hooks.

use std::collections::BTreeMap;

use tch_dist_core::path::{is_within, join_fqn};
use tch_dist_core::Shardable;

use super::ShardPlacementFn;
use super::{fully_shard_state, init, FsdpError, FsdpOptions, FsdpProblem, ShardPlacement};
use crate::device_mesh::DeviceMesh;

/// One mesh of its own and the submodules placed on it.
struct OwnMesh {
    mesh: DeviceMesh,
    modules: Vec<String>,
}

/// Shards the submodules of `module` that `opts.shard_placement_fn` puts on meshes of their
/// own, each with a `fully_shard` over its mesh, and returns the options for the rest (the
/// function's meshes dropped); when the whole module is on one mesh of its own, the options
/// over that mesh. Refused on every rank of the call's group, nothing changed, when a mesh
/// of its own holds part of a module only.
pub(super) fn shard_own_meshes<M: Shardable + ?Sized>(
    module: &M,
    opts: FsdpOptions,
) -> Result<FsdpOptions, FsdpError> {
    let Some(f) = opts.shard_placement_fn.clone() else {
        return Ok(opts);
    };
    let groups = init::process_groups(&opts)?;
    let found = own_meshes(module.as_dyn_shardable(), &opts, &f, groups.shard.rank());
    let own = groups.all.agree("fully_shard", found)?;
    if own.is_empty() {
        return Ok(opts);
    }
    let modules: BTreeMap<String, &dyn Shardable> = module.named_modules().into_iter().collect();
    let mut rest = opts.clone();
    rest.shard_placement_fn = Some(without_meshes(&f, ""));
    for OwnMesh { mesh, modules: on } in own {
        if on.iter().any(String::is_empty) {
            // The whole module: the call itself runs over that mesh.
            rest.mesh = Some(mesh);
            rest.process_group = None;
            continue;
        }
        for prefix in on {
            let sub = FsdpOptions {
                mesh: Some(mesh.clone()),
                process_group: None,
                ignored_params: opts
                    .ignored_params
                    .iter()
                    .filter_map(|i| i.strip_prefix(&format!("{prefix}.")).map(String::from))
                    .collect(),
                shard_placement_fn: Some(without_meshes(&f, &prefix)),
                ..opts.clone()
            };
            super::fully_shard(modules[prefix.as_str()], sub)?;
        }
    }
    Ok(rest)
}

/// `f` for the parameters of the submodule at `prefix`, its meshes dropped.
fn without_meshes(f: &ShardPlacementFn, prefix: &str) -> ShardPlacementFn {
    let (f, prefix) = (f.clone(), prefix.to_string());
    ShardPlacementFn::with_mesh(move |fqn, t| {
        let dim = f.placement(&join_fqn(&prefix, fqn), t)?.dim;
        Some(ShardPlacement { dim, mesh: None })
    })
}

/// The meshes of their own `f` gives `module`'s parameters (those no nested call manages
/// nor `ignored_params` names), each with the highest submodules whose parameters are all
/// on it; or the first parameter on one whose module has another parameter elsewhere (the
/// error naming this `rank`).
fn own_meshes(
    module: &dyn Shardable,
    opts: &FsdpOptions,
    f: &ShardPlacementFn,
    rank: usize,
) -> Result<Vec<OwnMesh>, FsdpError> {
    let nested: Vec<String> = module
        .named_modules()
        .into_iter()
        .skip(1)
        .filter(|(_, m)| fully_shard_state(*m).is_some())
        .map(|(p, _)| p)
        .collect();
    let left_out = |fqn: &str| {
        nested.iter().any(|n| is_within(fqn, n))
            || opts.ignored_params.iter().any(|i| is_within(fqn, i))
    };
    // Each parameter's mesh of its own, by the ranks of its groups.
    let mut placed: Vec<(String, Vec<Vec<usize>>, DeviceMesh)> = Vec::new();
    let mut elsewhere: Vec<String> = Vec::new();
    for (fqn, t) in module.named_parameters() {
        if left_out(&fqn) {
            continue;
        }
        match f.placement(&fqn, t).and_then(|p| p.mesh) {
            Some(mesh) => {
                let key = mesh
                    .get_all_groups()
                    .iter()
                    .map(|g| g.global_ranks().to_vec())
                    .collect();
                placed.push((fqn, key, mesh));
            }
            None => elsewhere.push(fqn),
        }
    }
    let mut own: Vec<(Vec<Vec<usize>>, OwnMesh)> = Vec::new();
    for (fqn, key, mesh) in &placed {
        // The module holding the parameter: every parameter within it must be on the same
        // mesh.
        let holder = fqn.rsplit_once('.').map_or("", |(m, _)| m);
        let differs = placed
            .iter()
            .filter(|(p, k, _)| is_within(p, holder) && k != key)
            .map(|(p, _, _)| p)
            .chain(elsewhere.iter().filter(|p| is_within(p, holder)))
            .next();
        if let Some(other) = differs {
            let (fqn, other) = (fqn.clone(), other.clone());
            return Err(FsdpProblem::PartialOwnMesh { fqn, other }.on(rank));
        }
        let i = own.iter().position(|(k, _)| k == key).unwrap_or_else(|| {
            let modules = Vec::new();
            own.push((
                key.clone(),
                OwnMesh {
                    mesh: mesh.clone(),
                    modules,
                },
            ));
            own.len() - 1
        });
        let entry = &mut own[i].1;
        if !entry.modules.iter().any(|m| is_within(holder, m)) {
            entry.modules.retain(|m| !is_within(m, holder));
            entry.modules.push(holder.to_string());
        }
    }
    Ok(own.into_iter().map(|(_, e)| e).collect())
}
