//! One `fully_shard` call's parameter group and its state machine (PyTorch's
//! `FSDPParamGroup`): where the parameters' data is ([`ShardedState`]), where the group is
//! in a backward pass ([`BackwardState`]), and the moves between them that forward and
//! backward drive.
//!
//! Between steps each parameter's tensor (the `VarStore`'s, the module's and the optimizer's
//! handle: one tensor object) holds this rank's rows, a view into the group's flat shard
//! buffer (one per dtype and device, the padded shards of every parameter end to end, which
//! is the all-gather's input as it is). Unsharding all-gathers the flat shards and copies each
//! parameter's rows into its full tensor, then points the parameter at it
//! (`Tensor::set_data`); resharding points it back and releases the full tensor's memory.
//! Gradients never reach `.grad` at full size: the interceptor hands them to
//! [`ParamGroup::on_grad`]; once every managed parameter's gradient is in, they are padded
//! into the reduce-scatter's input and reduced while backward goes on; at the end of the
//! backward pass each parameter's `.grad` becomes (or, if it had one, adds) its averaged
//! shard.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tch::Tensor;
use tch_dist_core::trace;

use super::collectives::{self, Gather, Reduction};
use super::context::PassContext;
use super::param::{BucketMeta, ParamMeta, ParamTensors};
use super::FsdpGroupOptions;
use crate::autograd::ShardFence;
use crate::c10d::group::ProcessGroup;
use crate::error::{DistError, Result};

/// Where the parameters' data is (PyTorch's `ShardedState`).
pub(crate) enum ShardedState {
    /// Each parameter holds this rank's rows; `prefetch`: an all-gather started ahead of
    /// the group's use.
    Sharded { prefetch: Option<Gather> },
    /// Between forward and backward with a post-forward group: sharded, and per bucket this
    /// rank's padded shards over that smaller group, from which backward gathers.
    ShardedPostForward { flats: Vec<Tensor> },
    /// Each parameter holds its full tensor.
    Unsharded,
}

/// Where the group is in a backward pass (PyTorch's `TrainingState`, between forwards).
pub(crate) enum BackwardState {
    /// No forward recorded a graph through the group since the last backward pass ended:
    /// none is expected.
    Idle,
    /// A forward recorded a graph: the backward pass's gradients are coming.
    Expected,
    /// This pass's gradients were handed over: reduce-scattering (`Some`), or stashed
    /// without gradient sync (`None`).
    HandedOver(Option<Reduction>),
}

pub(crate) struct State {
    pub tensors: Vec<ParamTensors>,
    /// Per bucket: this rank's padded shards, end to end.
    pub flats: Vec<Tensor>,
    pub sharded: ShardedState,
    pub backward: BackwardState,
    pub options: FsdpGroupOptions,
    pub reshard_after_backward: bool,
    pub requires_gradient_sync: bool,
    /// HSDP: whether a synchronised backward all-reduces the reduce-scattered gradients
    /// over the replicate group (PyTorch's `all_reduce_grads`); plain FSDP ignores it.
    pub all_reduce_grads: bool,
    /// Reduced gradients are the sum over the ranks divided by this (PyTorch's
    /// `gradient_divide_factor`); `None`: the mean.
    pub gradient_divide_factor: Option<f64>,
    /// Whether the pre-backward hook gathers the parameters (PyTorch's
    /// `unshard_in_backward`).
    pub unshard_in_backward: bool,
    /// HSDP without all-reduce: per bucket, the reduce-scattered gradients summed over the
    /// backward passes since the last all-reduce (PyTorch's `_partial_reduce_output`).
    pub partial: Vec<Option<Tensor>>,
    /// Full gradients received in this backward pass.
    pub grads: Vec<Option<Tensor>>,
    /// Full gradients accumulated by backward passes without gradient sync.
    pub stash: Vec<Option<Tensor>>,
    /// Groups to prefetch when this one's forward starts, and when its backward starts
    /// (empty for backward: the group that ran forward before this one).
    pub forward_prefetch: Vec<Weak<ParamGroup>>,
    pub backward_prefetch: Vec<Weak<ParamGroup>>,
    /// Over the parameters' tensors, armed while they hold their shards
    /// ([`FsdpGroup::fence`](super::FsdpGroup::fence)).
    pub fence: Option<ShardFence>,
    /// With `TCH_DIST_TRACE`: when this pass's backward of the group began (its pre-backward
    /// hook), on the trace's clock; the span ends where its gradients are handed over.
    pub backward_started_us: Option<f64>,
}

/// One `fully_shard` call's parameter group (PyTorch's `FSDPParamGroup`): the part of an
/// [`FsdpGroup`](super::FsdpGroup) its libtorch hooks share and call into.
pub(crate) struct ParamGroup {
    /// This group itself (`Arc::new_cyclic`): hooks get `&ParamGroup`, and a backward pass
    /// that reaches the group enters it in its root's pass by a strong reference.
    pub me: Weak<ParamGroup>,
    /// The managed module's type, for errors.
    pub module: String,
    /// The managed module's FQN as the outermost enclosing call sees it (set when that call
    /// is applied; `""` until then, and for that call's own module): errors name each
    /// parameter by its FQN from there.
    pub module_fqn: Mutex<String>,
    pub group: ProcessGroup,
    pub meta: Vec<ParamMeta>,
    pub buckets: Vec<BucketMeta>,
    /// Parameters that require a gradient.
    pub expected: usize,
    pub state: Mutex<State>,
    /// The backward pass this group takes part in: its root's.
    pub context: Mutex<Arc<PassContext>>,
    /// The typed error of a hook that failed the last backward pass (libtorch carries only
    /// its message); the next forward returns it.
    pub failure: Mutex<Option<DistError>>,
    /// The user's hook on each bucket's reduced gradients (PyTorch's `_all_reduce_hook`),
    /// called at the end of the backward pass while `state` is locked.
    pub all_reduce_hook: Mutex<Option<AllReduceHook>>,
}

/// A hook on the reduced gradients of one bucket (PyTorch's `set_all_reduce_hook`): called
/// with the reduce-scatter's output (plain FSDP) or the all-reduce's (HSDP), a flat tensor of
/// this rank's padded shards in the reduce dtype, before it is installed into `.grad`;
/// divided as PyTorch's is at that point (f32, bf16: fully; f16: by its pre-factor only).
/// It may change the tensor in place; an `Err` fails the backward pass with its text.
///
/// ```no_run
/// use tch_dist_runtime::fsdp::AllReduceHook;
/// let hook: AllReduceHook = Box::new(|reduced: &mut tch::Tensor| {
///     let _ = reduced.f_mul_scalar_(0.5).map_err(|e| e.to_string())?;
///     Ok(())
/// });
/// ```
pub type AllReduceHook = Box<dyn FnMut(&mut Tensor) -> std::result::Result<(), String> + Send>;

impl ParamGroup {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn context(&self) -> Arc<PassContext> {
        Arc::clone(&self.context.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The FQN of parameter `m` as the outermost enclosing call sees it.
    pub(crate) fn param_fqn(&self, m: &ParamMeta) -> String {
        let module = self.module_fqn.lock().unwrap_or_else(|e| e.into_inner());
        tch_dist_core::path::join_fqn(&module, &m.fqn)
    }

    /// Keeps `e`, a hook's error, for the next forward (the first one of a pass).
    pub(crate) fn note_failure(&self, e: &DistError) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        f.get_or_insert_with(|| e.clone());
    }

    pub(crate) fn take_failure(&self) -> Option<DistError> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Gathers the full parameters: from the post-forward shards when they are kept, else
    /// from a prefetch that is still current, else by a new all-gather.
    pub(crate) fn unshard_locked(&self, st: &mut State) -> Result<()> {
        let prefetch = match std::mem::replace(&mut st.sharded, ShardedState::Unsharded) {
            ShardedState::Unsharded => return Ok(()),
            ShardedState::ShardedPostForward { flats } => {
                st.sharded = ShardedState::Sharded { prefetch: None };
                return self.unshard_post_forward_locked(st, &flats);
            }
            ShardedState::Sharded { prefetch } => {
                st.sharded = ShardedState::Sharded { prefetch: None };
                prefetch
            }
        };
        let gather = match prefetch {
            Some(g) if !g.is_stale(&st.tensors) => g,
            Some(g) => {
                // Gathered before its shards changed: wait it out, gather again.
                g.wait()?;
                self.begin_gather(st, false)?
            }
            None => self.begin_gather(st, false)?,
        };
        let gathered = gather.wait()?;
        let world = self.group.world_size() as i64;
        self.install_gathered(st, &gathered, world, |m| {
            Some((&m.layout, m.offset, self.buckets[m.bucket].numel))
        })
    }

    /// Restores each placed parameter's full tensor from `gathered` (`ranks` rows of padded
    /// shards; `place` as [`collectives::copy_out`] takes it): the group is unsharded.
    fn install_gathered<'m>(
        &'m self,
        st: &mut State,
        gathered: &[Tensor],
        ranks: i64,
        place: impl Fn(&'m ParamMeta) -> Option<collectives::Place<'m>>,
    ) -> Result<()> {
        collectives::copy_out(
            &self.group,
            &self.meta,
            &st.tensors,
            st.fence.as_ref(),
            gathered,
            ranks,
            place,
        )?;
        st.sharded = ShardedState::Unsharded;
        Ok(())
    }

    /// `copy_in`: gather a copy of the flat shards (PyTorch's copy-in), so that the gather
    /// holds their values now whatever changes them before it is waited for.
    fn begin_gather(&self, st: &State, copy_in: bool) -> Result<Gather> {
        collectives::all_gather(&self.group, &self.buckets, &st.flats, &st.tensors, copy_in)
    }

    /// Gathers the parameters within the post-forward group, from `flats`.
    fn unshard_post_forward_locked(&self, st: &mut State, flats: &[Tensor]) -> Result<()> {
        let Some(sub) = st.options.post_forward_group.clone() else {
            return Err(super::param::engine(&self.group, "no post-forward group"));
        };
        let gathered =
            collectives::all_gather_post_forward(&self.group, &sub, &self.buckets, flats)?;
        let n = sub.world_size() as i64;
        self.install_gathered(st, &gathered, n, |m| {
            let (l, off) = m.post_forward.as_ref()?;
            Some((l, *off, self.buckets[m.bucket].post_forward_numel))
        })
    }

    /// Starts gathering the group's parameters ahead of their use (nothing to do when they
    /// are gathered or being gathered, or held over the post-forward group); `copy_in` as
    /// [`begin_gather`](Self::begin_gather)'s (an explicit `unshard_async`, which the user
    /// may wait for after changing the shards).
    pub(crate) fn prefetch(&self, copy_in: bool) -> Result<()> {
        let mut st = self.lock();
        if matches!(st.sharded, ShardedState::Sharded { prefetch: None }) {
            let g = self.begin_gather(&st, copy_in)?;
            st.sharded = ShardedState::Sharded { prefetch: Some(g) };
        }
        Ok(())
    }

    /// Waits out a prefetch nobody used (its result would be stale by the next use).
    pub(crate) fn drop_prefetch(&self) -> Result<()> {
        let mut st = self.lock();
        Self::drop_prefetch_locked(&mut st)
    }

    fn drop_prefetch_locked(st: &mut State) -> Result<()> {
        if let ShardedState::Sharded { prefetch } = &mut st.sharded
            && let Some(g) = prefetch.take()
        {
            g.wait()?;
        }
        Ok(())
    }

    /// Frees the full parameters: each holds this rank's shard again (and shards over the
    /// post-forward group, which serve only the coming backward, are dropped).
    pub(crate) fn reshard_locked(&self, st: &mut State) -> Result<()> {
        Self::drop_prefetch_locked(st)?;
        match st.sharded {
            ShardedState::Sharded { .. } => return Ok(()),
            ShardedState::ShardedPostForward { .. } => {
                st.sharded = ShardedState::Sharded { prefetch: None };
                return Ok(());
            }
            ShardedState::Unsharded => {}
        }
        tch::no_grad(|| -> Result<()> {
            for (i, t) in st.tensors.iter().enumerate() {
                t.to_sharded(&self.group)?;
                if let Some(fence) = &st.fence {
                    fence.set_armed(i, true)?;
                }
            }
            Ok(())
        })?;
        st.sharded = ShardedState::Sharded { prefetch: None };
        Ok(())
    }

    /// After the managed module's forward: reshards (when `reshard_after_forward`, always
    /// when no graph was recorded: no backward will come), keeping the post-forward shards
    /// for the coming backward; `records`: the output records a graph (the group then
    /// joins its root's coming backward pass).
    pub(crate) fn post_forward_locked(
        self: &Arc<Self>,
        st: &mut State,
        records: bool,
    ) -> Result<()> {
        if records {
            self.context().join(self);
            if matches!(st.backward, BackwardState::Idle) {
                st.backward = BackwardState::Expected;
            }
        }
        if !records || st.options.reshard_after_forward {
            let kept = (records
                && st.options.post_forward_group.is_some()
                && matches!(st.sharded, ShardedState::Unsharded))
            .then(|| collectives::post_forward_shards(&self.meta, &self.buckets, &st.tensors));
            self.reshard_locked(st)?;
            if let Some(flats) = kept {
                st.sharded = ShardedState::ShardedPostForward { flats };
            }
        }
        Ok(())
    }

    /// A backward pass reached the group (its pre-backward hook, or a gradient): the group
    /// takes part in this pass, even when the forward that recorded the graph joined an
    /// earlier one. Several forwards may run before their backwards (a pipeline schedule's
    /// microbatches, each `backward` its own pass): the first pass finishes the group, and
    /// each later one that reaches it enters it again, so that every forward's gradients are
    /// reduced (or stashed) and installed, none left behind.
    fn enter_backward(&self, st: &mut State) -> Arc<PassContext> {
        let context = self.context();
        if let Some(me) = self.me.upgrade() {
            context.join(&me);
        }
        if matches!(st.backward, BackwardState::Idle) {
            st.backward = BackwardState::Expected;
        }
        context
    }

    /// The pre-backward hook: gathers the parameters for the module's backward (unless
    /// `unshard_in_backward` is off), then starts gathering the group whose backward comes
    /// next (unless that group's is off).
    pub(crate) fn pre_backward(&self) -> Result<()> {
        let context = self.enter_backward(&mut self.lock());
        context.queue_finish(self.group.rank())?;
        let explicit = {
            let mut st = self.lock();
            if st.backward_started_us.is_none() && trace::enabled() {
                st.backward_started_us = Some(trace::now_us());
            }
            if st.unshard_in_backward {
                self.unshard_locked(&mut st)?;
            }
            st.backward_prefetch.clone()
        };
        let next: Vec<Arc<ParamGroup>> = if explicit.is_empty() {
            context.joined_before(self).into_iter().collect()
        } else {
            explicit.iter().filter_map(Weak::upgrade).collect()
        };
        for g in next {
            // A group that does not unshard in backward is not prefetched for it either
            // (PyTorch's `unshard` returns early in its pre-backward state).
            if g.lock().unshard_in_backward {
                g.prefetch(false)?;
                context.note_prefetch(&g);
            }
        }
        Ok(())
    }

    /// The interceptor: parameter `index`'s full gradient of this pass.
    pub(crate) fn on_grad(&self, index: usize, grad: Tensor) -> Result<()> {
        let context = self.enter_backward(&mut self.lock());
        context.queue_finish(self.group.rank())?;
        let mut st = self.lock();
        st.grads[index] = Some(match st.grads[index].take() {
            Some(g) => g + grad,
            None => grad,
        });
        let received = st.grads.iter().filter(|g| g.is_some()).count();
        if received == self.expected {
            self.hand_over_locked(&mut st, false)?;
        }
        Ok(())
    }

    /// Every managed gradient of this pass is in (or the pass ended: `at_end`):
    /// reduce-scatters them (parameters autograd did not reach count as zeros, on every
    /// rank alike), or stashes them without gradient sync; then reshards.
    fn hand_over_locked(&self, st: &mut State, at_end: bool) -> Result<()> {
        if matches!(st.backward, BackwardState::HandedOver(_)) {
            return Ok(());
        }
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
        let mut grads = std::mem::take(&mut st.grads);
        st.grads = (0..self.meta.len()).map(|_| None).collect();
        if !st.requires_gradient_sync {
            st.backward = BackwardState::HandedOver(None);
            for (i, g) in grads.into_iter().enumerate() {
                if let Some(g) = g {
                    st.stash[i] = Some(match st.stash[i].take() {
                        Some(s) => s + g,
                        None => g,
                    });
                }
            }
            if st.reshard_after_backward {
                self.reshard_after_grads_locked(st, at_end)?;
            }
            return Ok(());
        }
        st.backward = BackwardState::HandedOver(None);
        let settings = collectives::ReduceSettings {
            factor: st.gradient_divide_factor,
            replicas: st
                .options
                .replicate_group
                .as_ref()
                .map(ProcessGroup::world_size),
            all_reduce: st.all_reduce_grads,
        };
        let reduction = collectives::reduce_scatter(
            &self.group,
            &self.meta,
            &self.buckets,
            &mut grads,
            &mut st.stash,
            &settings,
        )?;
        st.backward = BackwardState::HandedOver(Some(reduction));
        self.reshard_after_grads_locked(st, at_end)
    }

    /// Reshards once every trainable parameter's gradient is in, unless the group has
    /// frozen parameters: autograd may still use those for other tensors' gradients (a
    /// frozen weight for its input's), so such a group keeps them until the end of the
    /// backward pass.
    fn reshard_after_grads_locked(&self, st: &mut State, at_end: bool) -> Result<()> {
        if self.meta.iter().any(|m| !m.requires_grad) && !at_end {
            return Ok(());
        }
        self.reshard_locked(st)
    }

    /// The end of the backward pass: hands over what autograd did not reach, waits for the
    /// reductions and installs each parameter's averaged shard as (or adds it to) `.grad`.
    pub(crate) fn finish_backward(&self) -> Result<()> {
        let mut st = self.lock();
        if matches!(st.backward, BackwardState::Idle) {
            return Ok(());
        }
        let result = self.finish_locked(&mut st).and_then(|()| {
            // A group with frozen parameters kept them until now.
            if st.requires_gradient_sync || st.reshard_after_backward {
                self.reshard_locked(&mut st)
            } else {
                Ok(())
            }
        });
        if let ShardedState::ShardedPostForward { .. } = st.sharded {
            st.sharded = ShardedState::Sharded { prefetch: None };
        }
        st.backward = BackwardState::Idle;
        st.grads.iter_mut().for_each(|g| *g = None);
        result
    }

    fn finish_locked(&self, st: &mut State) -> Result<()> {
        self.hand_over_locked(st, true)?;
        let BackwardState::HandedOver(reduction) = &mut st.backward else {
            return Ok(());
        };
        let Some(reduction) = reduction.take() else {
            return Ok(());
        };
        let module_fqn = self
            .module_fqn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut hook = self
            .all_reduce_hook
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let st = &mut *st;
        let with = collectives::FinishWith {
            replicas: st.options.replicate_group.as_ref(),
            partial: &mut st.partial,
            hook: hook.as_mut(),
            module: &self.module,
            module_fqn: &module_fqn,
        };
        reduction.finish(
            &self.group,
            with,
            &self.meta,
            &self.buckets,
            &st.tensors,
            |m| self.param_fqn(m),
        )
    }

    /// Bytes of the shards kept over the post-forward group now.
    pub(crate) fn post_forward_bytes(st: &State) -> usize {
        match &st.sharded {
            ShardedState::ShardedPostForward { flats } => flats
                .iter()
                .map(|t| t.numel() * t.kind().elt_size_in_bytes())
                .sum(),
            _ => 0,
        }
    }

    /// Whether the parameters hold their shards now.
    pub(crate) fn is_sharded(st: &State) -> bool {
        !matches!(st.sharded, ShardedState::Unsharded)
    }

    /// Arms every parameter's fence while the group is sharded, disarms it otherwise (a
    /// new fence starts from the group's state).
    pub(crate) fn arm_fence(st: &State, fence: &ShardFence) -> Result<()> {
        let armed = Self::is_sharded(st);
        for i in 0..st.tensors.len() {
            fence.set_armed(i, armed)?;
        }
        Ok(())
    }
}
