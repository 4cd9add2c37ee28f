//! `fully_shard`: fully sharded data parallelism (PyTorch's FSDP2,
//! `torch.distributed.fsdp.fully_shard`).
//!
//! Each call manages the parameters of its module that no nested call took (one *group* per
//! call, split by dtype automatically). Between steps every rank holds only its dim-0 chunk
//! of each managed parameter (`torch.chunk` rows, padded; uneven and empty shards allowed),
//! installed in place: the FQNs, the `VarStore` and an optimizer built from it see the
//! shard, and `.grad` after backward is the averaged gradient's shard. Around the module's
//! forward the group's parameters are all-gathered and, where `reshard_after_forward`,
//! freed after it; backward gathers them again (a hook on the module's output) and
//! reduce-scatters the gradients as soon as the group's backward is done, while the rest of
//! backward runs; an end-of-backward callback finishes the groups autograd never reached.
//!
//! Apply it bottom-up, then to the root; call children with `.call` (a managed layer run
//! with `x.apply(&layer)` or `layer.forward(&x)` bypasses the hooks: inside a hooked call its
//! first op fails, under `no_grad` too, and `f_call` returns [`FsdpError::HooksBypassed`]
//! naming the parameter's FQN; outside any, the backward pass fails with that error):
//!
//! ```no_run
//! use tch::nn::{self, Module};
//! use tch_dist::{fully_shard, optim, Call, FsdpOptions, Shardable};
//!
//! #[derive(Debug, Shardable)]
//! struct Net { blocks: Vec<nn::Linear>, head: nn::Linear }
//! impl Module for Net {
//!     fn forward(&self, xs: &tch::Tensor) -> tch::Tensor {
//!         let h = self.blocks.iter().fold(xs.shallow_clone(), |h, b| b.call(&h).relu());
//!         self.head.call(&h)
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let p = vs.root();
//! let model = Net {
//!     blocks: (0..4).map(|i| nn::linear(&p / "blocks" / i, 64, 64, Default::default())).collect(),
//!     head: nn::linear(&p / "head", 64, 10, Default::default()),
//! };
//! for b in &model.blocks { fully_shard(b, FsdpOptions::default())?; } // bottom-up
//! fully_shard(&model, FsdpOptions::default())?;                        // then the root
//! let mut opt = optim::AdamW::default().build(&vs, 1e-3)?;              // sees the shards
//! let (x, y) = (tch::Tensor::randn([8, 64], tch::kind::FLOAT_CPU), tch::Tensor::zeros([8], tch::kind::INT64_CPU));
//! opt.backward_step(&model.f_call(&x)?.cross_entropy_for_logits(&y))?;
//! # Ok(()) }
//! ```
//!
//! | file | what it does | PyTorch's counterpart |
//! |---|---|---|
//! | `mod.rs` | the API: [`fully_shard`], [`full_state_dict`] | `_fully_shard.py`, `_fsdp_init.py` |
//! | `options.rs` | [`FsdpOptions`] and its parts | `fully_shard`'s keyword arguments, `MixedPrecisionPolicy` |
//! | `state.rs` | [`FsdpState`] | `FSDPModule` methods, `_fsdp_state.py` |
//! | `collect.rs` | what a call manages, and why it refuses | `_fsdp_init.py` (`_get_managed_modules`) |
//! | `hooks.rs` | the call scope per managed module, the call guard | `FSDPState._pre_forward` / `_post_forward` |
//! | `error.rs` | [`FsdpError`] | (the errors of `_fsdp_init.py`) |

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};
use tch_dist_core::hooks::{
    register_call_guard, register_call_scope, register_fallible_forward_hook_n,
    register_fallible_forward_pre_hook_n, RemovableHandle,
};
use tch_dist_core::path::join_fqn;
use tch_dist_core::{contract, Shardable};
use tch_dist_runtime::fsdp::{
    is_float, tensor_identity, FsdpGroup, FsdpGroupOptions, ManagedParam, ShardInfo,
};
use tch_dist_runtime::{default_group, DistError, GroupOptions, UseGuard, BROADCAST_BUCKET_BYTES};

mod collect;
mod error;
mod hooks;
mod options;
mod state;

pub use error::FsdpError;
pub use options::{FsdpOptions, MixedPrecisionPolicy, ReshardAfterForward, ShardPlacementFn};
pub use state::FsdpState;

use collect::{collect, is_within};

/// The state [`fully_shard`] stored for `module` (PyTorch's `FSDPModule` methods), if it was
/// applied to it.
pub use fully_shard_state as state;

/// Identities of every parameter any fully_shard call manages, with its FQN there.
static MANAGED: Mutex<BTreeMap<u64, String>> = Mutex::new(BTreeMap::new());

/// A copy of [`MANAGED`].
fn managed_identities() -> BTreeMap<u64, String> {
    MANAGED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The short name of a module's type, for errors (`Block` for `my_crate::model::Block`).
fn short_type(module: &dyn Shardable) -> String {
    let full = module.type_name();
    let base = full.split('<').next().unwrap_or(full);
    base.rsplit("::").next().unwrap_or(base).to_string()
}

/// Applies fully_shard to `module`: shards the parameters it manages (those no nested call
/// took, outside `ignored_params`, not sharded by `shard_module`) over the group, starting
/// from rank 0's values, and hooks its forward and backward. Every check runs on every rank
/// together before anything changes: applied twice or with `replicate`, a `replicate`d
/// submodule, options or parameters that differ across ranks, a non-contiguous parameter,
/// a parameter tied to one another call manages, an unknown `ignored_params` entry. A
/// module whose parameters nested calls took entirely manages nothing, which is fine. See
/// the [module docs](self) for an example.
#[contract(crate = "crate", conflicts(replicate))]
pub fn fully_shard<M: Shardable + ?Sized>(
    module: &M,
    opts: FsdpOptions,
) -> Result<FsdpState, FsdpError> {
    let group = match &opts.process_group {
        Some(g) => g.clone(),
        None => default_group()?,
    };
    let rank = group.rank();
    let label = short_type(module.as_dyn_shardable());
    let found = collect(module.as_dyn_shardable(), &opts.ignored_params, rank);
    // The dimension each parameter is sharded along, checked.
    let world = group.world_size() as i64;
    let mut dims = Vec::with_capacity(found.params.len());
    let mut problem = found.problem;
    for (fqn, t) in &found.params {
        let dim = opts
            .shard_placement_fn
            .as_ref()
            .and_then(|f| f.dim(fqn, t))
            .unwrap_or(0);
        let size = t.size();
        if dim > 0 && problem.is_none() && (dim >= size.len() || size[dim] % world != 0) {
            problem = Some(FsdpError::ShardDim {
                rank,
                fqn: fqn.clone(),
                dim,
                shape: size.clone(),
                world: world as usize,
            });
        }
        dims.push(dim);
    }
    if let Some(ReshardAfterForward::ToRanks(n)) = opts.reshard_after_forward {
        if problem.is_none() && (n == 0 || group.world_size() % n != 0) {
            problem = Some(FsdpError::ReshardRanks {
                rank,
                ranks: n,
                world: group.world_size(),
            });
        }
    }
    let local = match problem {
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
    // Every rank starts from rank 0's values, as replicate does.
    let tensors: Vec<&Tensor> = found.params.iter().map(|(_, t)| t).collect();
    group.broadcast_coalesced(&tensors, 0, BROADCAST_BUCKET_BYTES)?;
    let names = Arc::new(hooks::CallNames {
        rank,
        prefix: Mutex::new(String::new()),
        params: found.params.iter().map(|(n, _)| n.clone()).collect(),
    });
    // The guard takes each parameter's gradient accumulator while it is full-sized.
    let trainable: Vec<usize> = (0..found.params.len())
        .filter(|&i| found.params[i].1.requires_grad())
        .collect();
    let guard = if trainable.is_empty() {
        None
    } else {
        let refs: Vec<&Tensor> = trainable.iter().map(|&i| &found.params[i].1).collect();
        let (names, positions) = (Arc::clone(&names), trainable.clone());
        Some(Arc::new(UseGuard::new(
            rank,
            "fully_shard",
            &refs,
            move |i| names.bypassed(positions[i]).to_string(),
        )?))
    };
    let identities: Vec<(u64, String)> = found
        .params
        .iter()
        .map(|(n, t)| (tensor_identity(t), n.clone()))
        .collect();
    let params: Vec<ManagedParam> = found
        .params
        .into_iter()
        .zip(dims)
        .map(|((fqn, param), dim)| ManagedParam { fqn, param, dim })
        .collect();
    // Resharding to n ranks: this rank's n consecutive ranks, as a group of their own (only
    // its members create it).
    let post_forward_group = match opts.reshard_after_forward {
        Some(ReshardAfterForward::ToRanks(n)) if n > 1 && n < group.world_size() => {
            let members: Vec<usize> = group.global_ranks().to_vec();
            let mine = &members[rank / n * n..rank / n * n + n];
            let sub_opts = GroupOptions::new(group.backend()).with_local_synchronization();
            group.new_group_with(mine, &sub_opts)?
        }
        _ => None,
    };
    let fsdp_group = Arc::new(FsdpGroup::new(
        &label,
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
            post_forward_group,
        },
    )?);
    // Armed while sharded: a managed module run without its hooks inside a hooked forward
    // fails its first op, in every grad mode.
    fsdp_group.fence(Arc::clone(&names))?;
    register_call_guard(&hooks::GUARD);
    for (prefix, n) in &found.nested {
        for inner in n.all() {
            inner.set_prefix(prefix);
            if inner.reshard_after_forward.is_none() {
                inner.group.set_reshard_after_forward(true);
            }
        }
    }
    let nested_guards: Vec<hooks::NestedGuard> = found
        .nested
        .iter()
        .flat_map(|(_, n)| n.all())
        .filter_map(|s| s.guard.clone())
        .collect();
    let own_guard = guard.map(|g| hooks::NestedGuard {
        guard: g,
        names: Arc::clone(&names),
        trainable,
    });
    let scope = Arc::new(hooks::Scope {
        group: Arc::clone(&fsdp_group),
        names: Arc::clone(&names),
        guard: own_guard.as_ref().map(|g| Arc::clone(&g.guard)),
        nested: nested_guards,
    });
    let mut hooks: Vec<RemovableHandle> = register_call_scope(module, scope)?.into();
    let mp = opts.mp_policy;
    // Every floating input and output, as PyTorch's `_cast_fp_tensor` over the args pytree.
    if let Some(dtype) = mp.param_dtype.filter(|_| mp.cast_forward_inputs) {
        hooks.push(register_fallible_forward_pre_hook_n(
            module,
            move |_, xs| Ok(cast_floats(xs, dtype)),
        )?);
    }
    if let Some(dtype) = mp.output_dtype {
        hooks.push(register_fallible_forward_hook_n(
            module,
            move |_, _, outs| Ok(cast_floats(outs, dtype)),
        )?);
    }
    let own_identities: Vec<u64> = identities.iter().map(|(id, _)| *id).collect();
    MANAGED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .extend(identities);
    Ok(FsdpState {
        group: fsdp_group,
        process_group: group,
        reshard_after_forward: opts.reshard_after_forward,
        names,
        nested: found.nested.into_iter().map(|(_, s)| s).collect(),
        _hooks: hooks,
        guard: own_guard,
        identities: own_identities,
    })
}

/// `tensors` with each floating one of another dtype cast to `dtype` (`None`: none is).
fn cast_floats(tensors: &[Tensor], dtype: Kind) -> Option<Vec<Tensor>> {
    let cast = |t: &Tensor| is_float(t.kind()) && t.kind() != dtype;
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

/// A parameter a fully_shard call manages ([`fsdp_params_in`]).
pub(crate) struct FsdpParam {
    /// The call's state.
    pub state: Arc<FsdpState>,
    /// Its position in the call's group.
    pub index: usize,
    /// Where this rank's rows sit.
    pub info: ShardInfo,
}

/// Every parameter a fully_shard call in `module` manages, by its FQN in `module`.
pub(crate) fn fsdp_params_in<M: Shardable + ?Sized>(module: &M) -> HashMap<String, FsdpParam> {
    let mut out = HashMap::new();
    let mut outermost: Vec<String> = Vec::new();
    for (prefix, m) in module.named_modules() {
        if outermost.iter().any(|o| is_within(&prefix, o)) {
            continue;
        }
        let Some(s) = fully_shard_state(m) else {
            continue;
        };
        outermost.push(prefix.clone());
        let base = s.prefix();
        for inner in s.all() {
            // Prefixes are relative to the outermost call; `s` may be a nested one.
            let own = inner.prefix();
            let rel = own
                .strip_prefix(base.as_str())
                .map(|r| r.trim_start_matches('.'))
                .unwrap_or(own.as_str());
            for (index, mut info) in inner.group.params().into_iter().enumerate() {
                info.fqn = join_fqn(&prefix, &join_fqn(rel, &info.fqn));
                out.insert(
                    info.fqn.clone(),
                    FsdpParam {
                        state: Arc::clone(&inner),
                        index,
                        info,
                    },
                );
            }
        }
    }
    out
}

/// Puts every fully_shard parameter in `module` back on its shard (a checkpoint reads and
/// writes shards).
pub(crate) fn reshard_all<M: Shardable + ?Sized>(module: &M) -> Result<(), DistError> {
    for (_, m) in module.named_modules() {
        if let Some(s) = fully_shard_state(m) {
            s.group.reshard()?;
        }
    }
    Ok(())
}

/// Every parameter and buffer of `module` with its full value, in walk order (PyTorch's
/// full `state_dict`, for evaluation or export; a tied parameter under each of its names).
/// A collective: every rank calls it, and every rank gets the full values. Parameters
/// sharded by `fully_shard` or `shard_module` are all-gathered; the others are copied.
///
/// ```no_run
/// # fn demo<M: tch_dist::Shardable>(model: &M) -> Result<(), tch_dist::fully_shard::FsdpError> {
/// let full = tch_dist::fully_shard::full_state_dict(model)?;
/// for (fqn, t) in &full { println!("{fqn}: {:?}", t.size()); }
/// # Ok(()) }
/// ```
pub fn full_state_dict<M: Shardable + ?Sized>(
    module: &M,
) -> Result<Vec<(String, Tensor)>, FsdpError> {
    let managed = fsdp_params_in(module);
    // Tied names reach the managed parameter through its identity.
    let by_identity: HashMap<u64, &FsdpParam> = module
        .named_parameters()
        .into_iter()
        .filter_map(|(fqn, t)| managed.get(&fqn).map(|p| (tensor_identity(t), p)))
        .collect();
    let tensor_parallel = crate::sharding::sharded_params_in(module);
    let modules = module.named_modules();
    let mut gathered: HashMap<u64, Tensor> = HashMap::new();
    let mut out = Vec::new();
    for (fqn, t) in module.named_parameters() {
        let id = tensor_identity(t);
        let full = if let Some(full) = gathered.get(&id) {
            full.shallow_clone()
        } else if let Some(p) = by_identity.get(&id) {
            let full = p.state.group.full_param(p.index)?;
            gathered.insert(id, full.shallow_clone());
            full
        } else if let Some(tp) = tensor_parallel.get(&fqn) {
            let owner = modules
                .iter()
                .find(|(_, m)| {
                    crate::sharding::shard_module_state(*m)
                        .is_some_and(|s| Arc::ptr_eq(&s, &tp.state))
                })
                .map(|(_, m)| *m)
                .ok_or(FsdpError::NotFullyShard)?;
            let st = tp.state.sharded_tensor(owner, &tp.local_fqn)?;
            st.all_gather()?
        } else {
            tch::no_grad(|| t.detach().copy())
        };
        out.push((fqn, full));
    }
    for (fqn, b) in module.named_buffers() {
        out.push((fqn, tch::no_grad(|| b.detach().copy())));
    }
    Ok(out)
}
