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
//! first op fails, under `no_grad` too, and `f_call` returns an [`FsdpError::Composition`]
//! ([`Composition::HooksBypassed`](crate::Composition::HooksBypassed)) naming the
//! parameter's FQN; outside any, the backward pass fails with that error):
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
//! | `mod.rs` | the API: [`fully_shard`] (a sequence of `init.rs`'s steps), [`full_state_dict`] (the state dict's, with this API's error) | `_fully_shard.py` (`fully_shard`) |
//! | `init.rs` | the steps of one call: process group, checks on every rank, rank 0's values, bypass guard, parameter group and fence, nested calls adopted, forward hooks, the managed parameters entered with their layers and the call's holder (the placement record's) | `_fsdp_init.py` |
//! | `options.rs` | [`FsdpOptions`] and its parts | `fully_shard`'s keyword arguments, `MixedPrecisionPolicy` |
//! | `state.rs` | [`FsdpState`], [`UnshardHandle`] | `FSDPModule` methods, `UnshardHandle`, `_fsdp_state.py` |
//! | `own_mesh.rs` | per-parameter meshes: the submodules `shard_placement_fn` puts on meshes of their own, each a call of its own | `shard_placement_fn`'s `ShardPlacementResult.mesh_info` (pytorch#173509) |
//! | `collect.rs` | what a call manages, and why it refuses | `_fsdp_init.py` (`_get_managed_modules`) |
//! | `hooks.rs` | the call scope per managed module, the call guard | `FSDPState._pre_forward` / `_post_forward` |
//! | `error.rs` | [`FsdpError`], [`FsdpProblem`] | (the errors of `_fsdp_init.py`) |

use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::{contract, Shardable};
use tch_dist_runtime::default_group;
use tch_dist_runtime::fsdp::ManagedParam;

mod collect;
mod error;
mod hooks;
mod init;
mod options;
mod own_mesh;
mod state;

pub use error::{FsdpError, FsdpProblem, MeshUse};
pub use options::{
    FsdpOptions, MixedPrecisionPolicy, ReshardAfterForward, ShardPlacement, ShardPlacementFn,
};
pub use state::{FsdpState, UnshardHandle};

use collect::collect;
use tch_dist_core::path::is_within;

/// The state [`fully_shard`] stored for `module` (PyTorch's `FSDPModule` methods), if it was
/// applied to it.
pub use fully_shard_state as state;

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
///
/// ```no_run
/// use tch_dist::{fully_shard, Call, FsdpOptions};
/// tch_dist::init_process_group(tch_dist::Backend::Gloo)?;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let fc = tch::nn::linear(vs.root() / "fc", 8, 8, Default::default());
/// fully_shard(&fc, FsdpOptions::default())?; // `fc.ws`: this rank's shard of the weight
/// let y = fc.f_call(&tch::Tensor::ones([2, 8], tch::kind::FLOAT_CPU))?; // the full layer's output
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[contract(
    crate = "crate",
    conflicts(replicate),
    state_doc = r#"
```no_run
# fn demo(model: &impl tch_dist::Shardable) -> Result<(), tch_dist::fully_shard::FsdpError> {
if let Some(state) = tch_dist::fully_shard::state(model) {
    state.unshard()?; // the full parameters, for a method other than `forward`
}
# Ok(()) }
```
"#
)]
pub fn fully_shard<M: Shardable + ?Sized>(
    module: &M,
    opts: FsdpOptions,
) -> Result<FsdpState, FsdpError> {
    let opts = own_mesh::shard_own_meshes(module, opts)?;
    let groups = init::process_groups(&opts)?;
    let rank = groups.shard.rank();
    let world = default_group()?;
    let mut found = collect(
        module.as_dyn_shardable(),
        &opts.ignored_params,
        collect::Ranks {
            ranks: groups.all.global_ranks(),
            rank,
            global: world.rank(),
            world: world.world_size(),
        },
    );
    let dims = init::check(&mut found, &opts, &groups)?;
    init::broadcast_from_rank0(&found, &groups.all)?;
    let names = init::call_names(&found, rank);
    let guard = init::use_guard(&found, &names)?;
    let identities = init::identities(&found.params);
    let params: Vec<ManagedParam> = std::mem::take(&mut found.params)
        .into_iter()
        .zip(dims)
        .map(|((fqn, param), dim)| ManagedParam { fqn, param, dim })
        .collect();
    let label = short_type(module.as_dyn_shardable());
    let fsdp_group = init::param_group(&label, params, &opts, &groups, &names)?;
    init::adopt_nested(&found.nested, &fsdp_group);
    let hooks = init::register_hooks(
        module,
        &fsdp_group,
        &names,
        guard.as_ref(),
        &found.nested,
        &opts,
    )?;
    let registration = init::enter_managed(identities, &fsdp_group, &groups);
    Ok(FsdpState {
        group: fsdp_group,
        process_group: groups.shard,
        replicate_group: groups.replicate,
        reshard_after_forward: opts.reshard_after_forward,
        names,
        nested: found.nested.into_iter().map(|(_, s)| s).collect(),
        _hooks: hooks,
        guard,
        _registration: registration,
    })
}

/// The outermost fully_shard calls in `module` (none encloses another), with their FQNs,
/// in walk order.
fn outermost_states<M: Shardable + ?Sized>(module: &M) -> Vec<(String, Arc<FsdpState>)> {
    let mut roots: Vec<(String, Arc<FsdpState>)> = Vec::new();
    for (prefix, m) in module.named_modules() {
        if roots.iter().any(|(o, _)| is_within(&prefix, o)) {
            continue;
        }
        if let Some(s) = fully_shard_state(m) {
            roots.push((prefix, s));
        }
    }
    roots
}

/// Makes the outermost fully_shard calls in `module` (blocks with no common enclosing
/// fully_shard, as under a `replicate`d root) share one backward pass: the first one's end of
/// backward finishes them all, in forward order, so that a block autograd did not reach on
/// some rank still issues its (zero) reduce-scatter there, alike on every rank.
pub(crate) fn share_backward_pass<M: Shardable + ?Sized>(module: &M) {
    let roots = outermost_states(module);
    if let Some((_, first)) = roots.first() {
        for (_, root) in &roots[1..] {
            for s in root.all() {
                s.group.set_root(&first.group);
            }
        }
    }
}

/// Every parameter and buffer of `module` with its full value: the state dict's
/// [`full_state_dict`](crate::state_dict::full_state_dict), with this API's error type.
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
    Ok(crate::state_dict::full_state_dict(module)?)
}
