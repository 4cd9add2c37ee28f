//! [`FsdpGroup`], the handle the facade's `fully_shard` holds for one call's group: the
//! operations its forward hooks drive (pre- and post-forward), the explicit ones (unshard,
//! reshard, the full value of a parameter) and the setters (PyTorch's `FSDPModule` methods,
//! `fully_shard.py`).

use std::sync::{Arc, Mutex, Weak};

use tch::{Kind, Tensor};

use super::collectives;
use super::context::PassContext;
use super::group::{AllReduceHook, BackwardState, ParamGroup, ShardedState, State};
use super::hooks;
use super::param::{self, engine, ManagedParam, ParamMeta, ShardInfo};
use crate::autograd::{self, Interceptor};
use crate::autograd::{FenceOwner, ShardFence};
use crate::c10d::group::ProcessGroup;
use crate::c10d::step_check::passes as steps;
use crate::error::{DistError, Result};

/// Per-group switches (PyTorch's `fully_shard` options and `FSDPModule` setters).
#[derive(Debug, Clone)]
pub struct FsdpGroupOptions {
    /// Free the gathered parameters after forward (gather them again for backward).
    pub reshard_after_forward: bool,
    /// Gather floating-point parameters in this dtype (forward and backward compute in it);
    /// `None`: their own.
    pub param_dtype: Option<Kind>,
    /// Reduce floating-point gradients in this dtype; `None`: `param_dtype`, else the
    /// parameter's own.
    pub reduce_dtype: Option<Kind>,
    /// With `reshard_after_forward`: keep, between forward and backward, a shard over this
    /// smaller group of ranks (PyTorch's `reshard_after_forward=N`, this rank's group of N)
    /// rather than over the whole group, so that backward gathers within it.
    pub post_forward_group: Option<ProcessGroup>,
    /// HSDP (a 2-D mesh): the ranks holding the same shards as this one. Each
    /// reduce-scattered gradient shard is then all-reduced over them, so that `.grad` is the
    /// average over every rank of both groups (PyTorch 2.11's HSDP: reduce-scatter over the
    /// shard dim, all-reduce over the replicate dim). `None`: plain FSDP.
    pub replicate_group: Option<ProcessGroup>,
}

/// One `fully_shard` call's parameters, sharded over a group of ranks.
///
/// Built by `tch_dist::fully_shard`, which drives it from forward hooks; see there for
/// the user-facing API. Dropping it removes its gradient hooks (the parameters keep their
/// shards).
pub struct FsdpGroup {
    inner: Arc<ParamGroup>,
    _interceptors: Vec<Interceptor>,
    /// Whose settings the step check compares for this group, and for the context it was
    /// built with (its root's, if it is a root): numbers taken in creation order.
    settings_owner: u64,
    own_context_owner: u64,
}

/// The next number [`FsdpGroup`]s and their contexts take for their settings (in creation
/// order, so the same on every rank that builds the same models).
static NEXT_SETTINGS_OWNER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(crate) fn next_settings_owner() -> u64 {
    NEXT_SETTINGS_OWNER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Drop for FsdpGroup {
    /// Its settings leave the step check's comparison with it.
    fn drop(&mut self) {
        for group in self.process_groups() {
            steps::forget_settings(&group, self.settings_owner);
            steps::forget_settings(&group, self.own_context_owner);
        }
    }
}

impl std::fmt::Debug for FsdpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpGroup")
            .field("module", &self.inner.module)
            .field("params", &self.inner.meta.len())
            .finish()
    }
}

impl FsdpGroup {
    /// Shards `params` (the same names, shapes and values on every rank; the caller checked)
    /// over `group`: each parameter's tensor now holds this rank's rows, and its gradients
    /// are reduce-scattered to them. `module` names the managed module in errors.
    pub fn new(
        module: &str,
        params: Vec<ManagedParam>,
        group: ProcessGroup,
        options: FsdpGroupOptions,
    ) -> Result<FsdpGroup> {
        let (meta, buckets) = param::plan(&params, &group, &options);
        let expected = meta.iter().filter(|m| m.requires_grad).count();
        let (flats, tensors) = param::shard_in(&meta, &buckets, &params);
        let n = params.len();
        let n_buckets = buckets.len();
        let inner = Arc::new_cyclic(|me| ParamGroup {
            me: me.clone(),
            module: module.to_string(),
            module_fqn: Mutex::new(String::new()),
            group: group.clone(),
            meta,
            buckets,
            expected,
            failure: Mutex::new(None),
            all_reduce_hook: Mutex::new(None),
            context: Mutex::new(PassContext::new()),
            state: Mutex::new(State {
                tensors,
                flats,
                // Full-sized until the reshard below.
                sharded: ShardedState::Unsharded,
                backward: BackwardState::Idle,
                options,
                reshard_after_backward: true,
                requires_gradient_sync: true,
                all_reduce_grads: true,
                gradient_divide_factor: None,
                unshard_in_backward: true,
                partial: (0..n_buckets).map(|_| None).collect(),
                grads: (0..n).map(|_| None).collect(),
                stash: (0..n).map(|_| None).collect(),
                forward_prefetch: Vec::new(),
                backward_prefetch: Vec::new(),
                fence: None,
                backward_started_us: None,
            }),
        });
        // The interceptors make each accumulator now, while the parameters are full-sized.
        let mut interceptors = Vec::new();
        for (i, p) in params.iter().enumerate() {
            if p.param.requires_grad() {
                interceptors.push(
                    hooks::intercept_grads(&p.param, &inner, i)
                        .map_err(|e| engine(&group, e.message))?,
                );
            }
        }
        {
            let mut st = inner.lock();
            inner.reshard_locked(&mut st)?;
        }
        let own_context_owner = inner.context().settings_owner;
        // A model is being built over these groups: what was set before (for another
        // model's groups, alike or not on every rank) is no longer compared.
        steps::forget_all_settings(&group);
        if let Some(replicas) = &inner.lock().options.replicate_group {
            steps::forget_all_settings(replicas);
        }
        Ok(FsdpGroup {
            inner,
            _interceptors: interceptors,
            settings_owner: next_settings_owner(),
            own_context_owner,
        })
    }

    /// Runs this group's backward passes in `root`'s context (PyTorch's root sharing its
    /// `_state_ctx`): `root`'s one end-of-backward callback finishes both, in forward order.
    /// The enclosing call sets it when it is applied, before any forward.
    pub fn set_root(&self, root: &FsdpGroup) {
        let ctx = root.inner.context();
        *self.inner.context.lock().unwrap_or_else(|e| e.into_inner()) = ctx;
    }

    /// Gathers the full parameters (before forward; or to run other methods than forward).
    pub fn unshard(&self) -> Result<()> {
        let mut st = self.inner.lock();
        self.inner.unshard_locked(&mut st)
    }

    /// Frees the full parameters: each holds this rank's shard again.
    pub fn reshard(&self) -> Result<()> {
        let mut st = self.inner.lock();
        self.inner.reshard_locked(&mut st)
    }

    /// Fences the parameters ([`ShardFence`]), owned by `owner` (whose indices are the
    /// parameters' positions here): from now on each is armed while it holds only its shard,
    /// so that an op of a checked call (a hooked forward) using it without its module's
    /// hooks is refused.
    pub fn fence<O: FenceOwner>(&self, owner: Arc<O>) -> Result<()> {
        let mut st = self.inner.lock();
        let handles: Vec<&Tensor> = st.tensors.iter().map(|t| &t.handle).collect();
        let rank = self.inner.group.rank();
        let fence = ShardFence::new(rank, "fully_shard", &handles, owner)?;
        ParamGroup::arm_fence(&st, &fence)?;
        st.fence = Some(fence);
        Ok(())
    }

    /// Whether the parameters hold their shards now.
    pub fn is_sharded(&self) -> bool {
        ParamGroup::is_sharded(&self.inner.lock())
    }

    /// The typed error of a hook that failed the last backward pass, taken (the pass itself
    /// failed with its message).
    pub fn take_failure(&self) -> Option<DistError> {
        self.inner.take_failure()
    }

    /// Before the managed module's forward: gathers the parameters, then starts gathering
    /// those of the groups set to be prefetched ([`set_forward_prefetch`](Self::set_forward_prefetch)).
    pub fn pre_forward(&self) -> Result<()> {
        if let Some(e) = self.inner.take_failure() {
            return Err(e);
        }
        steps::forward_begins();
        let next = {
            let mut st = self.inner.lock();
            self.inner.unshard_locked(&mut st)?;
            st.forward_prefetch.clone()
        };
        let context = self.inner.context();
        for g in next.iter().filter_map(Weak::upgrade) {
            g.prefetch(false)?;
            context.note_prefetch(&g);
        }
        Ok(())
    }

    /// The groups whose all-gathers start when this group's forward starts (PyTorch's
    /// `set_modules_to_forward_prefetch`); default none.
    pub fn set_forward_prefetch(&self, groups: &[&FsdpGroup]) {
        self.inner.lock().forward_prefetch =
            groups.iter().map(|g| Arc::downgrade(&g.inner)).collect();
    }

    /// The groups whose all-gathers start when this group's backward starts (PyTorch's
    /// `set_modules_to_backward_prefetch`); default: the group whose forward ran just
    /// before this one's, whose backward comes next.
    pub fn set_backward_prefetch(&self, groups: &[&FsdpGroup]) {
        self.inner.lock().backward_prefetch =
            groups.iter().map(|g| Arc::downgrade(&g.inner)).collect();
    }

    /// After the managed module's forward, with its output: hooks the output so that its
    /// backward gathers the parameters again, and frees them now when
    /// `reshard_after_forward` (always when the output records no graph: no backward will
    /// come).
    pub fn post_forward(&self, output: &Tensor) -> Result<()> {
        self.post_forward_outputs(&[output])
    }

    /// [`post_forward`](Self::post_forward) for a module with several outputs (a tuple):
    /// hooks each output that records a graph, as PyTorch's `_register_pre_backward_hook`
    /// hooks every tensor of the output (the first hook to fire gathers the parameters, the
    /// others find them gathered), and frees the parameters once.
    pub fn post_forward_outputs(&self, outputs: &[&Tensor]) -> Result<()> {
        steps::forward_ends();
        let mut records = false;
        for output in outputs.iter().filter(|o| o.requires_grad()) {
            hooks::add_pre_backward_hook(output, &self.inner)
                .map_err(|e| engine(&self.inner.group, e.message))?;
            records = true;
        }
        let mut st = self.inner.lock();
        self.inner.post_forward_locked(&mut st, records)
    }

    /// Whether backward reduce-scatters gradients (`true`, the default) or accumulates the
    /// full gradients locally for a later synchronised backward (gradient accumulation).
    /// Sets the HSDP all-reduce alike, as PyTorch's `set_requires_gradient_sync` sets both
    /// `reduce_grads` and `all_reduce_grads`.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        let mut st = self.inner.lock();
        st.requires_gradient_sync = sync;
        st.all_reduce_grads = sync;
    }

    /// HSDP: whether a synchronised backward all-reduces the reduce-scattered gradients
    /// over the replicas (`true`, the default). Off, each backward adds its reduce-scattered
    /// (and divided) output to a partial sum kept by the group and leaves `.grad` as it was;
    /// the next backward with it on adds that sum before its all-reduce, then installs
    /// (PyTorch's `all_reduce_grads` and `_partial_reduce_output`). Plain FSDP ignores it.
    pub fn set_requires_all_reduce(&self, all_reduce: bool) {
        self.inner.lock().all_reduce_grads = all_reduce;
    }

    /// Reduced gradients become the sum over the ranks divided by `factor` rather than
    /// their mean (PyTorch's `gradient_divide_factor`; `None`: the mean). The caller
    /// checked that it is finite and positive.
    pub fn set_gradient_divide_factor(&self, factor: Option<f64>) {
        self.note_setting(
            "gradient_divide_factor",
            factor.map_or(-1, |f| f.to_bits() as i64),
        );
        self.inner.lock().gradient_divide_factor = factor;
    }

    /// The hook run on each bucket's reduced gradients before they are installed (PyTorch's
    /// `set_all_reduce_hook`); see [`AllReduceHook`]. `None` removes it.
    pub fn set_all_reduce_hook(&self, hook: Option<AllReduceHook>) {
        // What a hook does cannot be compared; whether there is one can.
        self.note_setting("all_reduce_hook", i64::from(hook.is_some()));
        *self
            .inner
            .all_reduce_hook
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = hook;
    }

    /// Whether the pre-backward hook gathers the parameters (`true`, the default). Off for
    /// a group whose backward needs no parameter value (an embedding's: its gradient needs
    /// only the indices); the gradients are reduce-scattered all the same (PyTorch's
    /// `unshard_in_backward`).
    pub fn set_unshard_in_backward(&self, unshard: bool) {
        self.note_setting("unshard_in_backward", i64::from(unshard));
        self.inner.lock().unshard_in_backward = unshard;
    }

    /// Whether the next backward pass of this group's root is the last before the
    /// optimizer step (`true`, the default; PyTorch's `is_last_backward`, shared by every
    /// group of the root). Every pass waits for its reductions, installs `.grad` and waits
    /// out unused prefetches; the last also forgets the forward order its default backward
    /// prefetch follows, which another keeps for the next pass.
    pub fn set_is_last_backward(&self, last: bool) {
        // The root's flag, whichever of its groups sets it: the context's, not this module's.
        self.note_setting_as(
            self.inner.context().settings_owner,
            "is_last_backward",
            i64::from(last),
        );
        self.inner.context().set_is_last_backward(last);
    }

    /// Notes a setting of this group's module for the step check over its groups (the
    /// shard group, and the replicas' under HSDP), so that ranks that set it differently
    /// fail the next pass's check on every rank instead of computing other numbers.
    fn note_setting(&self, name: &'static str, value: i64) {
        self.note_setting_as(self.settings_owner, name, value);
    }

    fn note_setting_as(&self, owner: u64, name: &'static str, value: i64) {
        for group in self.process_groups() {
            steps::note_setting(&group, owner, name, value);
        }
    }

    /// The shard group, and the replicas' under HSDP.
    fn process_groups(&self) -> Vec<ProcessGroup> {
        let replicas = self.inner.lock().options.replicate_group.clone();
        std::iter::once(self.inner.group.clone())
            .chain(replicas)
            .collect()
    }

    /// Starts gathering the full parameters and returns at once (PyTorch's
    /// `unshard(async_op=True)`); [`unshard`](Self::unshard) (or the next forward) waits for
    /// the gather and installs the full parameters. The gather takes a copy of the shards
    /// (PyTorch's copy-in): it holds their values at this call. Nothing to do when they are
    /// gathered or being gathered.
    pub fn unshard_async(&self) -> Result<()> {
        self.inner.prefetch(true)
    }

    /// Whether a backward pass without gradient sync frees the gathered parameters (the
    /// default) or keeps them for the next micro-batch. A synchronised backward always
    /// reshards: `.grad` holds shards, and so must the parameters.
    pub fn set_reshard_after_backward(&self, reshard: bool) {
        self.inner.lock().reshard_after_backward = reshard;
    }

    /// The managed module's FQN as the outermost enclosing call sees it (that call sets it
    /// when it is applied): errors name the parameters by their FQNs from there.
    pub fn set_module_fqn(&self, fqn: &str) {
        *self
            .inner
            .module_fqn
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = fqn.to_string();
    }

    /// Changes `reshard_after_forward`.
    pub fn set_reshard_after_forward(&self, reshard: bool) {
        self.inner.lock().options.reshard_after_forward = reshard;
    }

    /// The managed parameters: FQN, full shape, and where this rank's shard sits.
    pub fn params(&self) -> Vec<ShardInfo> {
        self.inner.meta.iter().map(ParamMeta::info).collect()
    }

    /// The full value of managed parameter `index` (a new tensor; collective: every rank
    /// calls it for the same parameters in the same order).
    pub fn full_param(&self, index: usize) -> Result<Tensor> {
        let inner = &self.inner;
        let m = inner
            .meta
            .get(index)
            .ok_or_else(|| engine(&inner.group, "no such parameter"))?;
        // From the shards whatever the state: a gathered tensor may be in `param_dtype`.
        let local = inner.lock().tensors[index].local.shallow_clone();
        collectives::gather_full(&inner.group, m, &inner.buckets[m.bucket], &local)
    }

    /// Bytes of the shards kept over the post-forward group now (between forward and
    /// backward with `post_forward_group`; 0 otherwise).
    pub fn post_forward_bytes(&self) -> usize {
        ParamGroup::post_forward_bytes(&self.inner.lock())
    }

    /// Bytes of memory the full tensors of the parameters hold now (0 while sharded).
    pub fn full_bytes(&self) -> usize {
        let st = self.inner.lock();
        st.tensors
            .iter()
            .map(|t| autograd::storage_nbytes(&t.full))
            .sum()
    }
}
