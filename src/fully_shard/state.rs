//! [`FsdpState`]: what one `fully_shard` call keeps for its module (PyTorch's `FSDPModule`
//! methods and `FSDPState`): its parameter group, its hooks, the nested calls' states, and
//! the names its errors give; and [`UnshardHandle`], a pending
//! [`unshard_async`](FsdpState::unshard_async).

use std::sync::Arc;

use tch::Tensor;
use tch_dist_core::hooks::RemovableHandle;
use tch_dist_core::path::join_fqn;
use tch_dist_runtime::fsdp::{FsdpGroup, ShardInfo};
use tch_dist_runtime::ProcessGroup;

use super::{hooks, FsdpError, FsdpProblem, ReshardAfterForward};
use crate::state_dict::managed::Registration;

/// What `fully_shard` keeps per managed module (PyTorch's `FSDPModule` methods), returned
/// by [`fully_shard`](super::fully_shard) and by [`state`](super::state).
pub struct FsdpState {
    pub(super) group: Arc<FsdpGroup>,
    pub(super) process_group: ProcessGroup,
    /// HSDP: the ranks holding the same shards (a 2-D mesh's dim 0).
    pub(super) replicate_group: Option<ProcessGroup>,
    /// `reshard_after_forward` as given (`None`: decided by whether a later call encloses
    /// this one).
    pub(super) reshard_after_forward: Option<ReshardAfterForward>,
    /// The module's FQN within the outermost call that encloses it (set by that call) and
    /// the managed parameters' FQNs within the module: what errors name.
    pub(super) names: Arc<hooks::CallNames>,
    /// The states of the nearest nested calls.
    pub(super) nested: Vec<Arc<FsdpState>>,
    pub(super) _hooks: Vec<RemovableHandle>,
    /// The bypass guard over this call's trainable parameters.
    pub(super) guard: Option<hooks::NestedGuard>,
    /// This call's parameters in the registry of managed parameters (its group holds the
    /// tensors, so no other tensor can take one of their identities while they are there).
    pub(super) _registration: Registration,
}

impl std::fmt::Debug for FsdpState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpState")
            .field("group", &self.group)
            .field("nested", &self.nested.len())
            .finish()
    }
}

impl FsdpState {
    /// Gathers the full parameters of this module's group, so that methods other than
    /// `forward` can use them (PyTorch's `unshard()`); [`reshard`](Self::reshard) frees them.
    pub fn unshard(&self) -> Result<(), FsdpError> {
        Ok(self.group.unshard()?)
    }

    /// Starts gathering the full parameters of this module's group and returns at once
    /// (PyTorch's `unshard(async_op=True)`; not recursive): [`UnshardHandle::wait`] waits for
    /// the gather and installs the full parameters. A handle dropped unwaited leaves the
    /// gather pending: the module's next forward (its pre-forward) or
    /// [`unshard`](Self::unshard) waits for it, and [`reshard`](Self::reshard) waits it out.
    /// The all-gathers are asynchronous (the process group's own threads run them), so work
    /// between this call and `wait` overlaps them. The gather holds the shards' values at
    /// this call (a copy of them, as PyTorch's copy-in): an optimizer step before `wait`
    /// does not show in the gathered parameters (nor in PyTorch's), so wait first; a shard
    /// changed in a way the version counter sees (an in-place op outside `.data`, a
    /// checkpoint load) makes `wait` gather again. Collective: every rank of the group
    /// calls it.
    ///
    /// ```no_run
    /// # fn demo(block: &tch::nn::Linear, x: &tch::Tensor) -> Result<(), tch_dist::fully_shard::FsdpError> {
    /// use tch_dist::{fully_shard, Call, FsdpOptions};
    /// let state = fully_shard(block, FsdpOptions::default())?;
    /// let handle = state.unshard_async()?;
    /// // ... other work while the parameters are gathered ...
    /// handle.wait()?;
    /// assert!(!state.is_sharded());
    /// let y = block.call(x);
    /// # Ok(()) }
    /// ```
    pub fn unshard_async(&self) -> Result<UnshardHandle, FsdpError> {
        self.group.unshard_async()?;
        Ok(UnshardHandle {
            group: Arc::clone(&self.group),
        })
    }

    /// Frees the gathered parameters: each holds this rank's shard again.
    pub fn reshard(&self) -> Result<(), FsdpError> {
        Ok(self.group.reshard()?)
    }

    /// Whether the next backward pass is the last one before the optimizer step (PyTorch's
    /// `set_is_last_backward`; default `true`). The flag is the root's: it holds for every
    /// fully_shard call under the outermost one (or the `replicate`d root) that encloses
    /// this one, whichever of them it is set on, as PyTorch's shared state context; set it
    /// after applying that call, and back to `true` before the last micro-batch's backward.
    ///
    /// tch-dist waits for every reduction at the end of each backward pass whatever the
    /// flag says (`.grad` is complete after each pass, as PyTorch's is once its streams
    /// are synchronised), and waits out the all-gathers prefetched but not used (PyTorch
    /// keeps them for a later use: tch's optimizers write the shards through `.data`,
    /// which no version check sees, so a kept gather could install values a step made
    /// stale). What a pass that is not the last keeps, as in PyTorch, is the forward order
    /// the default backward prefetch follows, so that the second of two forwards run
    /// before their backwards still prefetches in that order; the last pass forgets it.
    ///
    /// Set it alike on every rank: a rank that sets it while another does not (or to
    /// another value) fails the next pass on every rank before it sends anything (the step
    /// check compares it), where its prefetches would pair wrongly with the others'.
    ///
    /// ```no_run
    /// # fn demo<M: tch_dist::Shardable + tch::nn::Module + 'static>(model: &M, micro: &[tch::Tensor]) -> Result<(), tch_dist::fully_shard::FsdpError> {
    /// use tch_dist::Call;
    /// let root = tch_dist::fully_shard::state(model).ok_or(tch_dist::fully_shard::FsdpError::NotFullyShard)?;
    /// let losses: Vec<_> = micro.iter().map(|x| model.call(x).sum(tch::Kind::Float)).collect();
    /// for (i, loss) in losses.iter().enumerate() {
    ///     root.set_is_last_backward(i + 1 == losses.len());
    ///     loss.backward();
    /// }
    /// # Ok(()) }
    /// ```
    pub fn set_is_last_backward(&self, is_last_backward: bool) {
        self.group.set_is_last_backward(is_last_backward);
    }

    /// Whether backward reduce-scatters gradients (the default) or accumulates them locally
    /// for a later synchronised backward (gradient accumulation without communication);
    /// applies to the nested calls too, as PyTorch's `recurse=True`. Under HSDP it sets the
    /// all-reduce over the replicate dim alike
    /// ([`set_requires_all_reduce`](Self::set_requires_all_reduce)), as PyTorch's does.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.group.set_requires_gradient_sync(sync);
        for n in &self.nested {
            n.set_requires_gradient_sync(sync);
        }
    }

    /// HSDP: whether a synchronised backward all-reduces the reduce-scattered gradients
    /// over the replicate dim (PyTorch's `set_requires_all_reduce`; default `true`); nested
    /// calls too (PyTorch's `recurse=True`). Off, each backward still reduce-scatters (and
    /// divides) over the shard dim, adds the result to a partial sum the group keeps, and
    /// leaves `.grad` as it was, as PyTorch returns before installing; the next backward
    /// with it on adds that sum before its all-reduce, so that `.grad` then holds the
    /// accumulated gradients of every micro-batch, averaged over every rank.
    /// [`set_requires_gradient_sync`](Self::set_requires_gradient_sync) sets this flag too.
    /// Plain FSDP (no replicate dim) ignores it.
    ///
    /// Set it alike on every rank: a rank that all-reduces while a replica does not fails
    /// the step check (the skipped all-reduce still counts as a pass over the replicate
    /// group) instead of pairing its all-reduce with the replica's next one.
    ///
    /// ```no_run
    /// # fn demo<M: tch_dist::Shardable + tch::nn::Module + 'static>(model: &M, micro: &[tch::Tensor]) -> Result<(), tch_dist::fully_shard::FsdpError> {
    /// use tch_dist::Call;
    /// let root = tch_dist::fully_shard::state(model).ok_or(tch_dist::fully_shard::FsdpError::NotFullyShard)?;
    /// for (i, x) in micro.iter().enumerate() {
    ///     root.set_requires_all_reduce(i + 1 == micro.len());
    ///     model.call(x).sum(tch::Kind::Float).backward();
    /// }
    /// # Ok(()) }
    /// ```
    pub fn set_requires_all_reduce(&self, requires_all_reduce: bool) {
        self.group.set_requires_all_reduce(requires_all_reduce);
        for n in &self.nested {
            n.set_requires_all_reduce(requires_all_reduce);
        }
    }

    /// Reduced gradients become the sum over every rank (both dims under HSDP) divided by
    /// `factor` instead of their mean (PyTorch's `set_gradient_divide_factor`; this call
    /// only, not the nested ones). With a reduce dtype of f32 or bf16 the reduce-scatter's
    /// output is divided (PyTorch's `PreMulSum(1 / factor)`) and the all-reduce sums; with
    /// another (f16), as in PyTorch, the input is divided by a power of two near the square
    /// root of the factor and the output by the rest, after the all-reduce hook.
    ///
    /// A factor that is not finite or not greater than 0 is refused
    /// ([`FsdpProblem::GradientDivideFactor`]) and the previous one kept. Set it alike on
    /// every rank: each rank divides its own shard of the gradients, so a factor set on one
    /// rank only would scale that shard differently; the step check compares it, and the
    /// next pass fails on every rank instead.
    ///
    /// ```no_run
    /// # fn demo(state: &tch_dist::fully_shard::FsdpState) -> Result<(), tch_dist::fully_shard::FsdpError> {
    /// // Gradients summed over the ranks rather than averaged.
    /// state.set_gradient_divide_factor(1.0)?;
    /// assert!(state.set_gradient_divide_factor(0.0).is_err());
    /// # Ok(()) }
    /// ```
    pub fn set_gradient_divide_factor(&self, factor: f64) -> Result<(), FsdpError> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(FsdpProblem::GradientDivideFactor {
                module: self.names.module(),
                factor: format!("{factor:?}"),
            }
            .on(self.process_group.rank()));
        }
        self.group.set_gradient_divide_factor(Some(factor));
        Ok(())
    }

    /// A hook run on this call's reduced gradients (PyTorch's `set_all_reduce_hook`; this
    /// call only): at the end of each synchronised backward, with the reduce-scatter's
    /// output (plain FSDP) or the all-reduce's (HSDP), before it is installed into `.grad`.
    /// The tensor is this rank's flat shard of the group's gradients in the reduce dtype
    /// (each parameter's padded rows end to end; one call per dtype when the group holds
    /// several), already divided unless the reduce dtype is f16 (PyTorch's order). Change
    /// it in place; replacing it by a tensor of another shape or dtype is an error. An HSDP
    /// backward without all-reduce does not call it (PyTorch returns before it).
    ///
    /// An `Err` (or a panic) fails the backward pass: `f_backward` returns its text and
    /// [`take_backward_error`](Self::take_backward_error) its typed error,
    /// [`FsdpError::Hooked`] naming the rank and the module, over a
    /// [`MisuseProblem::AllReduceHook`](crate::MisuseProblem::AllReduceHook) with
    /// the hook's text. It runs while the group's state is locked: it must not call this
    /// module's `FsdpState` methods. A hook that communicates must do so on every rank.
    ///
    /// ```no_run
    /// # fn demo(state: &tch_dist::fully_shard::FsdpState) {
    /// // Clip each reduced gradient element to [-1, 1] before it reaches `.grad`.
    /// state.set_all_reduce_hook(|reduced: &mut tch::Tensor| {
    ///     let _ = reduced.f_clamp_(-1.0, 1.0).map_err(|e| e.to_string())?;
    ///     Ok(())
    /// });
    /// # }
    /// ```
    pub fn set_all_reduce_hook<F>(&self, hook: F)
    where
        F: FnMut(&mut Tensor) -> Result<(), String> + Send + 'static,
    {
        self.group.set_all_reduce_hook(Some(Box::new(hook)));
    }

    /// Whether this call's pre-backward hook gathers its parameters (PyTorch's
    /// `set_unshard_in_backward`; default `true`; this call only). Off for a module whose
    /// backward needs no parameter value, an embedding's (its weight's gradient needs only
    /// the indices): the gather is skipped and the gradients are reduce-scattered all the
    /// same. A module whose backward does use its parameters (a linear layer's, for its
    /// input's gradient) then fails the backward pass (autograd finds a shard where it saved
    /// a full tensor). A group that does not unshard in backward is not prefetched for it
    /// either, as in PyTorch.
    ///
    /// Set it alike on every rank: a rank that skips the gather while another runs it would
    /// pair their collectives wrongly (Gloo aborts the process on the size mismatch); the
    /// step check compares the setting, and the next pass fails on every rank instead.
    ///
    /// ```no_run
    /// # fn demo(embedding: &tch::nn::Embedding) -> Result<(), tch_dist::fully_shard::FsdpError> {
    /// use tch_dist::{fully_shard, FsdpOptions};
    /// fully_shard(embedding, FsdpOptions::default())?.set_unshard_in_backward(false);
    /// # Ok(()) }
    /// ```
    pub fn set_unshard_in_backward(&self, unshard_in_backward: bool) {
        self.group.set_unshard_in_backward(unshard_in_backward);
    }

    /// Whether a backward without gradient sync frees the gathered parameters (default
    /// `true`); nested calls too. A synchronised backward always reshards.
    pub fn set_reshard_after_backward(&self, reshard: bool) {
        self.group.set_reshard_after_backward(reshard);
        for n in &self.nested {
            n.set_reshard_after_backward(reshard);
        }
    }

    /// Changes `reshard_after_forward` of this call (not of nested ones).
    pub fn set_reshard_after_forward(&self, reshard: bool) {
        self.group.set_reshard_after_forward(reshard);
    }

    /// The modules whose parameters start gathering when this module's forward starts
    /// (PyTorch's `set_modules_to_forward_prefetch`; default none): the next block's, so
    /// that its all-gather overlaps this block's forward.
    ///
    /// ```no_run
    /// # fn demo(blocks: &[tch::nn::Linear]) -> Result<(), tch_dist::fully_shard::FsdpError> {
    /// use tch_dist::fully_shard::{state, FsdpError};
    /// let states: Vec<_> = blocks.iter().map(|b| state(b).ok_or(FsdpError::NotFullyShard)).collect::<Result<_, _>>()?;
    /// for pair in states.windows(2) {
    ///     pair[0].set_modules_to_forward_prefetch(&[&*pair[1]]);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn set_modules_to_forward_prefetch(&self, modules: &[&FsdpState]) {
        let groups: Vec<&FsdpGroup> = modules.iter().map(|m| &*m.group).collect();
        self.group.set_forward_prefetch(&groups);
    }

    /// The modules whose parameters start gathering when this module's backward starts
    /// (PyTorch's `set_modules_to_backward_prefetch`); default: the module whose forward ran
    /// just before this one's, whose backward comes next.
    pub fn set_modules_to_backward_prefetch(&self, modules: &[&FsdpState]) {
        let groups: Vec<&FsdpGroup> = modules.iter().map(|m| &*m.group).collect();
        self.group.set_backward_prefetch(&groups);
    }

    /// The typed error of a fully_shard hook that failed the last backward pass (in this
    /// call or a nested one), taken: libtorch fails `backward` with its message only (tch's
    /// `f_backward` returns it as text), and the next forward would return it.
    ///
    /// ```no_run
    /// # fn demo<M: tch_dist::Shardable>(model: &M, loss: &tch::Tensor) -> Result<(), Box<dyn std::error::Error>> {
    /// if let Err(text) = loss.f_backward() {
    ///     let state = tch_dist::fully_shard::state(model);
    ///     return Err(match state.and_then(|s| s.take_backward_error()) {
    ///         Some(typed) => typed.into(),
    ///         None => text.into(),
    ///     });
    /// }
    /// # Ok(()) }
    /// ```
    pub fn take_backward_error(&self) -> Option<FsdpError> {
        let mut found = None;
        for s in self.all_ref() {
            if let Some(e) = s.group.take_failure() {
                found.get_or_insert(FsdpError::Hooked {
                    rank: s.process_group.rank(),
                    module: s.names.module(),
                    source: e,
                });
            }
        }
        found
    }

    /// This call and every nested one, outermost first (borrowed).
    fn all_ref(&self) -> Vec<&FsdpState> {
        let mut out = vec![self];
        for n in &self.nested {
            out.extend(n.all_ref());
        }
        out
    }

    /// Whether this module's parameters hold their shards now.
    pub fn is_sharded(&self) -> bool {
        self.group.is_sharded()
    }

    /// Where this call's parameters are sharded: FQN (within the outermost enclosing
    /// call's module), full shape, and this rank's first row and row count.
    pub fn shards(&self) -> Vec<ShardInfo> {
        let prefix = self.prefix();
        self.group
            .params()
            .into_iter()
            .map(|mut s| {
                s.fqn = join_fqn(&prefix, &s.fqn);
                s
            })
            .collect()
    }

    /// Bytes the gathered (full) parameters of this call hold now: 0 while sharded.
    pub fn gathered_bytes(&self) -> usize {
        self.group.full_bytes()
    }

    /// Bytes of the shards kept between forward and backward with
    /// `reshard_after_forward` = n ranks (0 otherwise, and outside that window).
    pub fn post_forward_bytes(&self) -> usize {
        self.group.post_forward_bytes()
    }

    /// The group this call shards over.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.process_group
    }

    /// HSDP: the group of ranks holding the same shards as this one (`None`: plain FSDP).
    pub fn replicate_group(&self) -> Option<&ProcessGroup> {
        self.replicate_group.as_ref()
    }

    /// This call and every nested one, outermost first.
    pub(super) fn all(self: &Arc<Self>) -> Vec<Arc<FsdpState>> {
        let mut out = vec![Arc::clone(self)];
        for n in &self.nested {
            out.extend(n.all());
        }
        out
    }

    /// This module's FQN within the outermost call that encloses it.
    pub(super) fn prefix(&self) -> String {
        self.names.module()
    }

    pub(super) fn set_prefix(&self, prefix: &str) {
        let mut p = self.names.prefix.lock().unwrap_or_else(|e| e.into_inner());
        *p = if p.is_empty() {
            prefix.to_string()
        } else {
            join_fqn(prefix, &p)
        };
        // The engine's own errors (a `.grad` of the wrong shape) name the same FQNs.
        self.group.set_module_fqn(&p);
    }
}

/// A pending [`FsdpState::unshard_async`] (PyTorch's `UnshardHandle`).
///
/// ```no_run
/// # fn demo(state: &tch_dist::fully_shard::FsdpState) -> Result<(), tch_dist::fully_shard::FsdpError> {
/// let handle = state.unshard_async()?;
/// handle.wait()?;
/// # Ok(()) }
/// ```
#[must_use = "the gather is only installed by `wait` (or the module's next forward)"]
pub struct UnshardHandle {
    group: Arc<FsdpGroup>,
}

impl std::fmt::Debug for UnshardHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnshardHandle")
            .field("group", &self.group)
            .finish()
    }
}

impl UnshardHandle {
    /// Waits for the gather and installs the full parameters (PyTorch's
    /// `UnshardHandle.wait`): the module's parameters are full-sized on return. Already
    /// gathered (the module's forward ran since, and kept them), it does nothing;
    /// resharded since, it gathers them again.
    pub fn wait(self) -> Result<(), FsdpError> {
        Ok(self.group.unshard()?)
    }
}
