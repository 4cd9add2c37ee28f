//! One `fully_shard` call's parameter group: the state machine of its parameters (sharded or
//! gathered), the all-gathers that gather them, and the reduce-scatters that shard their
//! gradients.
//!
//! Between steps each parameter's tensor (the `VarStore`'s, the module's and the optimizer's
//! handle: one tensor object) holds this rank's rows, a view into the group's flat shard
//! buffer (one per dtype and device, the padded shards of every parameter end to end, which
//! is the all-gather's input as it is). Unsharding all-gathers the flat shards and copies each
//! parameter's rows into its full tensor, then points the parameter at it
//! (`Tensor::set_data`); resharding points it back and releases the full tensor's memory.
//! Gradients never reach `.grad` at full size: the interceptor hands them to
//! [`GroupInner::on_grad`]; once every managed parameter's gradient is in, they are padded
//! into the reduce-scatter's input and reduced while backward goes on; at the end of the
//! backward pass each parameter's `.grad` becomes (or, if it had one, adds) its averaged
//! shard.

use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Device, Kind, Tensor};
use tch_dist_core::trace;

use super::backward;
use super::hooks;
use super::layout::ShardLayout;
use super::steps;
use crate::autograd::{self, is_float, Interceptor};
use crate::error::{DistError, MisuseProblem, Result};
use crate::shard_fence::{FenceOwner, ShardFence};
use crate::{ProcessGroup, ReduceOp, Work};

/// A parameter handed to [`FsdpGroup::new`]: its FQN (for errors) and the tensor the model,
/// the `VarStore` and the optimizer hold.
pub struct ManagedParam {
    /// Its FQN in the model.
    pub fqn: String,
    /// The parameter (full-sized, the same on every rank).
    pub param: Tensor,
    /// The dimension to shard (0, PyTorch's default; another one must divide evenly over
    /// the ranks, which the caller checked).
    pub dim: usize,
}

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
}

/// What a parameter is, apart from its tensors.
#[derive(Debug, Clone)]
pub(crate) struct ParamMeta {
    pub fqn: String,
    pub layout: ShardLayout,
    pub requires_grad: bool,
    /// Its bucket and its padded shard's offset in that bucket's flat shard.
    pub bucket: usize,
    pub offset: i64,
    /// Its layout over the post-forward group, and its offset in that flat shard.
    pub post_forward: Option<(ShardLayout, i64)>,
}

/// The parameters of one dtype and device, gathered and reduced together.
#[derive(Debug, Clone)]
struct BucketMeta {
    kind: Kind,
    /// The dtype gathered in (`param_dtype`) and reduced in (`reduce_dtype`).
    gather_kind: Kind,
    reduce_kind: Kind,
    device: Device,
    /// Elements of one rank's flat shard (and of its post-forward flat shard).
    numel: i64,
    post_forward_numel: i64,
    params: Vec<usize>,
}

/// A parameter's tensors.
struct ParamTensors {
    /// The module's own tensor object.
    handle: Tensor,
    /// This rank's rows: a view into its bucket's flat shard.
    local: Tensor,
    /// The full tensor; its storage holds no memory while sharded.
    full: Tensor,
}

/// Reduce-scatters in flight, finished at the end of the backward pass.
struct Reduction {
    works: Vec<Work>,
    /// Per bucket: this rank's flat shard of the summed gradients (`None`: nothing to
    /// reduce, every parameter frozen).
    outputs: Vec<Option<Tensor>>,
}

struct State {
    tensors: Vec<ParamTensors>,
    /// Per bucket: this rank's padded shards, end to end.
    flats: Vec<Tensor>,
    sharded: bool,
    options: FsdpGroupOptions,
    reshard_after_backward: bool,
    requires_gradient_sync: bool,
    /// Full gradients received in this backward pass, and how many.
    grads: Vec<Option<Tensor>>,
    received: usize,
    /// Full gradients accumulated by backward passes without gradient sync.
    stash: Vec<Option<Tensor>>,
    /// A forward recorded a graph through this group: its backward is expected.
    in_backward: bool,
    /// This pass's gradients were handed over (reduced or stashed).
    reduced: bool,
    /// The end-of-backward callback is finishing the group (autograd is done with it).
    finishing: bool,
    reduction: Option<Reduction>,
    /// An all-gather started ahead of the group's use (prefetch).
    prefetched: Option<Gather>,
    /// Between forward and backward with a post-forward group: per bucket, this rank's
    /// padded shards over that group.
    post_forward: Option<Vec<Tensor>>,
    /// Groups to prefetch when this one's forward starts, and when its backward starts
    /// (empty for backward: the group that ran forward before this one).
    forward_prefetch: Vec<std::sync::Weak<GroupInner>>,
    backward_prefetch: Vec<std::sync::Weak<GroupInner>>,
    /// Over the parameters' tensors, armed while they hold their shards ([`FsdpGroup::fence`]).
    fence: Option<ShardFence>,
    /// With `TCH_DIST_TRACE`: when this pass's backward of the group began (its pre-backward
    /// hook), on the trace's clock; the span ends where its gradients are handed over.
    backward_started_us: Option<f64>,
}

/// An all-gather of the group's shards in flight.
struct Gather {
    works: Vec<Work>,
    /// Per bucket: every rank's padded shards.
    gathered: Vec<Tensor>,
    /// Per bucket: the input (a cast copy of the flat shard under mixed precision), alive
    /// until the gather is done.
    _inputs: Vec<Tensor>,
    /// The parameters' versions when it started: a shard changed since (an optimizer step,
    /// a checkpoint load) makes the gather stale.
    versions: Vec<u64>,
}

/// The shared part of a group, which libtorch's hooks call into.
pub(crate) struct GroupInner {
    /// The managed module's type, for errors.
    module: String,
    /// The managed module's FQN as the outermost enclosing call sees it (set when that call
    /// is applied; `""` until then, and for that call's own module): errors name each
    /// parameter by its FQN from there.
    module_fqn: Mutex<String>,
    group: ProcessGroup,
    meta: Vec<ParamMeta>,
    buckets: Vec<BucketMeta>,
    /// Parameters that require a gradient.
    expected: usize,
    state: Mutex<State>,
    /// The typed error of a hook that failed the last backward pass (libtorch carries only
    /// its message); the next forward returns it.
    failure: Mutex<Option<DistError>>,
}

/// One `fully_shard` call's parameters, sharded over a group of ranks.
///
/// Built by `tch_dist::fully_shard`, which drives it from forward hooks; see there for
/// the user-facing API. Dropping it removes its gradient hooks (the parameters keep their
/// shards).
pub struct FsdpGroup {
    inner: Arc<GroupInner>,
    _interceptors: Vec<Interceptor>,
}

impl std::fmt::Debug for FsdpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpGroup")
            .field("module", &self.inner.module)
            .field("params", &self.inner.meta.len())
            .finish()
    }
}

fn engine(group: &ProcessGroup, op: &'static str, cause: impl ToString) -> DistError {
    DistError::Collective {
        rank: group.rank(),
        op,
        cause: cause.to_string(),
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
        let (world, rank) = (group.world_size(), group.rank());
        let mut meta = Vec::with_capacity(params.len());
        let mut buckets: Vec<BucketMeta> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let (kind, device) = (p.param.kind(), p.param.device());
            let b = match buckets
                .iter()
                .position(|b| b.kind == kind && b.device == device)
            {
                Some(b) => b,
                None => {
                    let float = is_float(kind);
                    let gather_kind = options.param_dtype.filter(|_| float).unwrap_or(kind);
                    let reduce_kind = options
                        .reduce_dtype
                        .or(options.param_dtype)
                        .filter(|_| float)
                        .unwrap_or(kind);
                    buckets.push(BucketMeta {
                        kind,
                        gather_kind,
                        reduce_kind,
                        device,
                        numel: 0,
                        post_forward_numel: 0,
                        params: Vec::new(),
                    });
                    buckets.len() - 1
                }
            };
            let layout = ShardLayout::along(&p.param.size(), p.dim, world, rank);
            let offset = buckets[b].numel;
            buckets[b].numel += layout.padded_numel();
            buckets[b].params.push(i);
            let post_forward = options.post_forward_group.as_ref().map(|g| {
                let l = ShardLayout::along(&p.param.size(), p.dim, g.world_size(), g.rank());
                let off = buckets[b].post_forward_numel;
                buckets[b].post_forward_numel += l.padded_numel();
                (l, off)
            });
            meta.push(ParamMeta {
                fqn: p.fqn.clone(),
                layout,
                requires_grad: p.param.requires_grad(),
                bucket: b,
                offset,
                post_forward,
            });
        }
        let expected = meta.iter().filter(|m| m.requires_grad).count();
        // This rank's padded shards, copied out of the full tensors.
        let flats: Vec<Tensor> = buckets
            .iter()
            .map(|b| Tensor::zeros([b.numel], (b.kind, b.device)))
            .collect();
        let mut tensors = Vec::with_capacity(params.len());
        tch::no_grad(|| {
            for (m, p) in meta.iter().zip(&params) {
                let l = &m.layout;
                let local = flats[m.bucket]
                    .narrow(0, m.offset, l.local_numel())
                    .view(l.local_shape().as_slice());
                if l.local_rows() > 0 {
                    local
                        .shallow_clone()
                        .copy_(&l.local_of(&p.param).reshape(l.local_shape().as_slice()));
                }
                tensors.push(ParamTensors {
                    handle: p.param.shallow_clone(),
                    local,
                    // A tensor with a version counter of its own (a `detach` would share
                    // the parameter's, and filling it would then fail the backward of
                    // tensors saved in forward); its memory is released at once.
                    full: Tensor::empty(
                        p.param.size(),
                        (buckets[m.bucket].gather_kind, p.param.device()),
                    ),
                });
            }
        });
        let n = params.len();
        let inner = Arc::new(GroupInner {
            module: module.to_string(),
            module_fqn: Mutex::new(String::new()),
            group: group.clone(),
            meta,
            buckets,
            expected,
            failure: Mutex::new(None),
            state: Mutex::new(State {
                tensors,
                flats,
                sharded: false,
                options,
                reshard_after_backward: true,
                requires_gradient_sync: true,
                grads: (0..n).map(|_| None).collect(),
                received: 0,
                stash: (0..n).map(|_| None).collect(),
                in_backward: false,
                reduced: false,
                finishing: false,
                reduction: None,
                prefetched: None,
                post_forward: None,
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
                        .map_err(|e| engine(&group, "fully_shard", e.message))?,
                );
            }
        }
        {
            let mut st = inner.lock();
            inner.reshard_locked(&mut st)?;
        }
        Ok(FsdpGroup {
            inner,
            _interceptors: interceptors,
        })
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
        for i in 0..st.tensors.len() {
            fence.set_armed(i, st.sharded)?;
        }
        st.fence = Some(fence);
        Ok(())
    }

    /// Whether the parameters hold their shards now.
    pub fn is_sharded(&self) -> bool {
        self.inner.lock().sharded
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
        for g in next.iter().filter_map(std::sync::Weak::upgrade) {
            g.prefetch()?;
            backward::note_prefetch(&g);
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
                .map_err(|e| engine(&self.inner.group, "fully_shard", e.message))?;
            records = true;
        }
        if records {
            backward::join(&self.inner);
        }
        let mut st = self.inner.lock();
        if records {
            st.in_backward = true;
        }
        if !records || st.options.reshard_after_forward {
            let kept = if records && st.options.post_forward_group.is_some() {
                self.inner.post_forward_shards(&st)
            } else {
                None
            };
            self.inner.reshard_locked(&mut st)?;
            st.post_forward = kept;
        }
        Ok(())
    }

    /// Whether backward reduce-scatters gradients (`true`, the default) or accumulates the
    /// full gradients locally for a later synchronised backward (gradient accumulation).
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.inner.lock().requires_gradient_sync = sync;
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
        self.inner
            .meta
            .iter()
            .map(|m| ShardInfo {
                fqn: m.fqn.clone(),
                shape: m.layout.shape().to_vec(),
                dim: m.layout.dim(),
                offsets: m.layout.offsets(),
                local_shape: m.layout.local_shape(),
            })
            .collect()
    }

    /// The full value of managed parameter `index` (a new tensor; collective: every rank
    /// calls it for the same parameters in the same order).
    pub fn full_param(&self, index: usize) -> Result<Tensor> {
        let inner = &self.inner;
        let m = inner
            .meta
            .get(index)
            .ok_or_else(|| engine(&inner.group, "fully_shard", "no such parameter"))?;
        // From the shards whatever the state: a gathered tensor may be in `param_dtype`.
        let st = inner.lock();
        let l = &m.layout;
        let world = l.world();
        let padded = Tensor::zeros(
            [l.padded_numel()],
            (inner.buckets[m.bucket].kind, st.flats[m.bucket].device()),
        );
        tch::no_grad(|| {
            padded
                .narrow(0, 0, l.local_numel())
                .copy_(&st.tensors[index].local.reshape([-1]))
        });
        drop(st);
        let out = padded.new_empty([world * l.padded_numel()], (padded.kind(), padded.device()));
        steps::before_collective(&inner.group)?;
        inner.group.all_gather_into_tensor(&out, &padded)?;
        let full = padded.new_empty(l.shape(), (padded.kind(), padded.device()));
        tch::no_grad(|| l.copy_from_rank_major(&full, &out.view([world, l.padded_numel()])));
        Ok(full)
    }

    /// Bytes of the shards kept over the post-forward group now (between forward and
    /// backward with `post_forward_group`; 0 otherwise).
    pub fn post_forward_bytes(&self) -> usize {
        let st = self.inner.lock();
        st.post_forward.as_ref().map_or(0, |flats| {
            flats
                .iter()
                .map(|t| t.numel() * t.kind().elt_size_in_bytes())
                .sum()
        })
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

/// Where one managed parameter's shard sits ([`FsdpGroup::params`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    /// Its FQN in the model.
    pub fqn: String,
    /// The full shape.
    pub shape: Vec<i64>,
    /// The sharded dimension.
    pub dim: usize,
    /// Where this rank's shard starts in the full tensor (a distributed checkpoint's
    /// offsets).
    pub offsets: Vec<i64>,
    /// The shape of this rank's shard.
    pub local_shape: Vec<i64>,
}

impl GroupInner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The FQN of parameter `m` as the outermost enclosing call sees it.
    fn param_fqn(&self, m: &ParamMeta) -> String {
        let module = self.module_fqn.lock().unwrap_or_else(|e| e.into_inner());
        tch_dist_core::path::join_fqn(&module, &m.fqn)
    }

    /// Keeps `e`, a hook's error, for the next forward (the first one of a pass).
    pub(crate) fn note_failure(&self, e: &DistError) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        f.get_or_insert_with(|| e.clone());
    }

    fn take_failure(&self) -> Option<DistError> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Starts the all-gather of the group's shards.
    fn begin_gather(&self, st: &State) -> Result<Gather> {
        steps::before_collective(&self.group)?;
        let world = self.group.world_size() as i64;
        let mut gathered = Vec::with_capacity(self.buckets.len());
        let mut works = Vec::with_capacity(self.buckets.len());
        let mut inputs = Vec::with_capacity(self.buckets.len());
        for (b, flat) in self.buckets.iter().zip(&st.flats) {
            let out = Tensor::empty([world * b.numel], (b.gather_kind, b.device));
            let input = if b.gather_kind == b.kind {
                flat.shallow_clone()
            } else {
                tch::no_grad(|| flat.to_kind(b.gather_kind))
            };
            works.push(self.group.all_gather_into_tensor_async(&out, &input)?);
            gathered.push(out);
            inputs.push(input);
        }
        Ok(Gather {
            works,
            gathered,
            _inputs: inputs,
            versions: st
                .tensors
                .iter()
                .map(|t| autograd::tensor_version(&t.handle))
                .collect(),
        })
    }

    /// Whether a shard changed since `g` started.
    fn stale(&self, st: &State, g: &Gather) -> bool {
        st.tensors
            .iter()
            .zip(&g.versions)
            .any(|(t, v)| autograd::tensor_version(&t.handle) != *v)
    }

    fn unshard_locked(&self, st: &mut State) -> Result<()> {
        if !st.sharded {
            return Ok(());
        }
        if let Some(flats) = st.post_forward.take() {
            return self.unshard_post_forward_locked(st, flats);
        }
        let gather = match st.prefetched.take() {
            Some(g) if !self.stale(st, &g) => g,
            Some(g) => {
                // Gathered before its shards changed: wait it out, gather again.
                for w in g.works {
                    w.wait()?;
                }
                self.begin_gather(st)?
            }
            None => self.begin_gather(st)?,
        };
        for w in gather.works {
            w.wait()?;
        }
        let world = self.group.world_size() as i64;
        self.install_gathered(st, &gather.gathered, world, |m| {
            Some((&m.layout, m.offset, self.buckets[m.bucket].numel))
        })
    }

    /// Restores the full tensors from `gathered` (per bucket, `ranks` rows of padded
    /// shards end to end; `place` says where a parameter's shard sits in a row: its layout,
    /// its offset and the row's length) and points each parameter at its full tensor.
    fn install_gathered<'m>(
        &'m self,
        st: &mut State,
        gathered: &[Tensor],
        ranks: i64,
        place: impl Fn(&'m ParamMeta) -> Option<(&'m ShardLayout, i64, i64)>,
    ) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (i, m) in self.meta.iter().enumerate() {
                let Some((l, offset, width)) = place(m) else {
                    continue;
                };
                if let Some(fence) = &st.fence {
                    fence.set_armed(i, false)?;
                }
                let t = &mut st.tensors[i];
                autograd::restore_storage(&t.full)
                    .map_err(|e| engine(&self.group, "fully_shard", e.message))?;
                let rows =
                    gathered[m.bucket]
                        .view([ranks, width])
                        .narrow(1, offset, l.padded_numel());
                l.copy_from_rank_major(&t.full, &rows);
                autograd::set_data(&t.handle, &t.full)
                    .map_err(|e| engine(&self.group, "fully_shard", e.message))?;
            }
            Ok(())
        })?;
        st.sharded = false;
        Ok(())
    }

    /// Copies this rank's shards over the post-forward group out of the gathered
    /// parameters (before they are freed after forward).
    fn post_forward_shards(&self, st: &State) -> Option<Vec<Tensor>> {
        if st.sharded {
            return None;
        }
        let flats: Vec<Tensor> = self
            .buckets
            .iter()
            .map(|b| Tensor::zeros([b.post_forward_numel], (b.gather_kind, b.device)))
            .collect();
        tch::no_grad(|| {
            for (m, t) in self.meta.iter().zip(&st.tensors) {
                let Some((l, off)) = &m.post_forward else {
                    continue;
                };
                if l.local_rows() > 0 {
                    flats[m.bucket]
                        .narrow(0, *off, l.local_numel())
                        .view(l.local_shape().as_slice())
                        .copy_(&l.local_of(&t.full).reshape(l.local_shape().as_slice()));
                }
            }
        });
        Some(flats)
    }

    /// Gathers the parameters within the post-forward group, from `flats`.
    fn unshard_post_forward_locked(&self, st: &mut State, flats: Vec<Tensor>) -> Result<()> {
        let Some(sub) = st.options.post_forward_group.clone() else {
            return Err(engine(&self.group, "fully_shard", "no post-forward group"));
        };
        // The check over the whole group covers the post-forward group's members.
        steps::before_collective(&self.group)?;
        let n = sub.world_size() as i64;
        let mut gathered = Vec::with_capacity(flats.len());
        let mut works = Vec::with_capacity(flats.len());
        for (b, flat) in self.buckets.iter().zip(&flats) {
            let out = Tensor::empty([n * b.post_forward_numel], (b.gather_kind, b.device));
            works.push(sub.all_gather_into_tensor_async(&out, flat)?);
            gathered.push(out);
        }
        for w in works {
            w.wait()?;
        }
        self.install_gathered(st, &gathered, n, |m| {
            let (l, off) = m.post_forward.as_ref()?;
            Some((l, *off, self.buckets[m.bucket].post_forward_numel))
        })
    }

    /// Starts gathering the group's parameters ahead of their use (nothing to do when they
    /// are gathered or being gathered, or held over the post-forward group).
    pub(crate) fn prefetch(&self) -> Result<()> {
        let mut st = self.lock();
        if st.sharded && st.prefetched.is_none() && st.post_forward.is_none() {
            st.prefetched = Some(self.begin_gather(&st)?);
        }
        Ok(())
    }

    /// Waits out a prefetch nobody used (its result would be stale by the next use).
    pub(crate) fn drop_prefetch(&self) -> Result<()> {
        let mut st = self.lock();
        self.drop_prefetch_locked(&mut st)
    }

    fn drop_prefetch_locked(&self, st: &mut State) -> Result<()> {
        if let Some(g) = st.prefetched.take() {
            for w in g.works {
                w.wait()?;
            }
        }
        Ok(())
    }

    fn reshard_locked(&self, st: &mut State) -> Result<()> {
        self.drop_prefetch_locked(st)?;
        // Shards over the post-forward group serve only the coming backward.
        st.post_forward = None;
        if st.sharded {
            return Ok(());
        }
        tch::no_grad(|| -> Result<()> {
            for (i, t) in st.tensors.iter().enumerate() {
                autograd::set_data(&t.handle, &t.local)
                    .map_err(|e| engine(&self.group, "fully_shard", e.message))?;
                autograd::release_storage(&t.full)
                    .map_err(|e| engine(&self.group, "fully_shard", e.message))?;
                if let Some(fence) = &st.fence {
                    fence.set_armed(i, true)?;
                }
            }
            Ok(())
        })?;
        st.sharded = true;
        Ok(())
    }

    /// The pre-backward hook: gathers the parameters for the module's backward, then starts
    /// gathering the group whose backward comes next.
    pub(crate) fn pre_backward(&self) -> Result<()> {
        backward::queue_finish(self.group.rank())?;
        let explicit = {
            let mut st = self.lock();
            if st.backward_started_us.is_none() && trace::enabled() {
                st.backward_started_us = Some(trace::now_us());
            }
            self.unshard_locked(&mut st)?;
            st.backward_prefetch.clone()
        };
        let next: Vec<Arc<GroupInner>> = if explicit.is_empty() {
            backward::joined_before(self).into_iter().collect()
        } else {
            explicit
                .iter()
                .filter_map(std::sync::Weak::upgrade)
                .collect()
        };
        for g in next {
            g.prefetch()?;
            backward::note_prefetch(&g);
        }
        Ok(())
    }

    /// The interceptor: parameter `index`'s full gradient of this pass.
    pub(crate) fn on_grad(&self, index: usize, grad: Tensor) -> Result<()> {
        backward::queue_finish(self.group.rank())?;
        let mut st = self.lock();
        match st.grads[index].take() {
            Some(g) => st.grads[index] = Some(g + grad),
            None => {
                st.grads[index] = Some(grad);
                st.received += 1;
            }
        }
        if st.received == self.expected {
            self.hand_over_locked(&mut st)?;
        }
        Ok(())
    }

    /// Every managed gradient of this pass is in (or the pass ended): reduce-scatters them
    /// (parameters autograd did not reach count as zeros, on every rank alike), or stashes
    /// them without gradient sync; then reshards.
    fn hand_over_locked(&self, st: &mut State) -> Result<()> {
        if st.reduced {
            return Ok(());
        }
        st.reduced = true;
        st.received = 0;
        if let Some(start) = st.backward_started_us.take() {
            // The group's backward: from its pre-backward hook (the gather) to its gradients'
            // hand-over (the reduce-scatter's launch, or the stash without gradient sync).
            let first = self.meta.first().map_or("", |m| m.fqn.as_str());
            let args = [("params", format!("{} (first: {first})", self.meta.len()))];
            trace::complete(
                "backward (fully_shard)",
                "backward",
                start,
                trace::now_us(),
                &args,
            );
        }
        let grads = std::mem::take(&mut st.grads);
        st.grads = (0..self.meta.len()).map(|_| None).collect();
        if !st.requires_gradient_sync {
            for (i, g) in grads.into_iter().enumerate() {
                if let Some(g) = g {
                    st.stash[i] = Some(match st.stash[i].take() {
                        Some(s) => s + g,
                        None => g,
                    });
                }
            }
            if st.reshard_after_backward {
                self.reshard_after_grads_locked(st)?;
            }
            return Ok(());
        }
        steps::before_collective(&self.group)?;
        let world = self.group.world_size() as i64;
        let mut works = Vec::new();
        let mut outputs = Vec::with_capacity(self.buckets.len());
        let mut grads = grads;
        for b in &self.buckets {
            if !b.params.iter().any(|&i| self.meta[i].requires_grad) {
                outputs.push(None);
                continue;
            }
            let input = Tensor::zeros([world * b.numel], (b.reduce_kind, b.device));
            let per_rank = input.view([world, b.numel]);
            tch::no_grad(|| {
                for &i in &b.params {
                    let m = &self.meta[i];
                    let l = &m.layout;
                    let g = match (grads[i].take(), st.stash[i].take()) {
                        (Some(g), Some(s)) => g + s,
                        (Some(g), None) | (None, Some(g)) => g,
                        (None, None) => continue,
                    };
                    let g = if g.kind() == b.reduce_kind {
                        g
                    } else {
                        g.to_kind(b.reduce_kind)
                    };
                    l.copy_to_rank_major(&per_rank.narrow(1, m.offset, l.padded_numel()), &g);
                }
            });
            let out = Tensor::empty([b.numel], (b.reduce_kind, b.device));
            works.push(
                self.group
                    .reduce_scatter_tensor_async(&out, &input, ReduceOp::Sum)?,
            );
            outputs.push(Some(out));
        }
        st.reduction = Some(Reduction { works, outputs });
        self.reshard_after_grads_locked(st)
    }

    /// Reshards once every trainable parameter's gradient is in, unless the group has
    /// frozen parameters: autograd may still use those for other tensors' gradients (a
    /// frozen weight for its input's), so such a group keeps them until the end of the
    /// backward pass.
    fn reshard_after_grads_locked(&self, st: &mut State) -> Result<()> {
        if self.meta.iter().any(|m| !m.requires_grad) && !st.finishing {
            return Ok(());
        }
        self.reshard_locked(st)
    }

    /// The end of the backward pass: hands over what autograd did not reach, waits for the
    /// reductions and installs each parameter's averaged shard as (or adds it to) `.grad`.
    pub(crate) fn finish_backward(&self) -> Result<()> {
        let mut st = self.lock();
        if !st.in_backward {
            return Ok(());
        }
        st.finishing = true;
        let result = self.finish_locked(&mut st).and_then(|()| {
            // A group with frozen parameters kept them until now.
            if st.requires_gradient_sync || st.reshard_after_backward {
                self.reshard_locked(&mut st)
            } else {
                Ok(())
            }
        });
        st.finishing = false;
        st.post_forward = None;
        st.in_backward = false;
        st.reduced = false;
        st.received = 0;
        st.grads.iter_mut().for_each(|g| *g = None);
        result
    }

    fn finish_locked(&self, st: &mut State) -> Result<()> {
        self.hand_over_locked(st)?;
        let Some(reduction) = st.reduction.take() else {
            return Ok(());
        };
        for w in reduction.works {
            w.wait()?;
        }
        let world = self.group.world_size() as f64;
        let rank = self.group.rank();
        for (b, out) in self.buckets.iter().zip(reduction.outputs) {
            let Some(mut out) = out else { continue };
            tch::no_grad(|| {
                let _ = out.g_div_scalar_(world);
            });
            for &i in &b.params {
                let m = &self.meta[i];
                if !m.requires_grad {
                    continue;
                }
                let l = &m.layout;
                let shard = out
                    .narrow(0, m.offset, l.local_numel())
                    .view(l.local_shape().as_slice());
                // Reduced in `reduce_dtype`, installed in the parameter's own.
                let shard = if shard.kind() == b.kind {
                    shard
                } else {
                    shard.to_kind(b.kind)
                };
                let handle = &st.tensors[i].handle;
                let existing = handle.grad();
                if existing.defined() {
                    if existing.size() != shard.size() {
                        return Err(DistError::Misuse {
                            rank,
                            op: "fully_shard",
                            problem: Box::new(MisuseProblem::GradShape {
                                module: self.module.clone(),
                                fqn: self.param_fqn(m),
                                shape: existing.size(),
                                expected: shard.size(),
                            }),
                        });
                    }
                    tch::no_grad(|| {
                        let mut e = existing;
                        let _ = e.g_add_(&shard);
                    });
                } else {
                    // A tensor of its own, not a view of the flat output: tch's zero_grad
                    // detaches `.grad` in place, which libtorch refuses for views.
                    let own = if shard.is_contiguous() && shard.kind() != b.reduce_kind {
                        shard
                    } else {
                        shard.copy()
                    };
                    autograd::set_grad_for(handle, Some(&own), rank, "fully_shard")?;
                }
            }
        }
        Ok(())
    }
}
