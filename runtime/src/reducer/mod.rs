//! The gradient reducer beneath `replicate` (PyTorch DDP's `Reducer`, re-created), split as
//! c10d splits it:
//!
//! | file | what it holds | PyTorch |
//! |---|---|---|
//! | `mod.rs` | [`Reducer`], its state across passes, [`ReducerStats`] | `reducer.hpp` |
//! | `options.rs` | [`ReducerOptions`], [`CommHook`] (which hook) | `DistributedDataParallel.__init__` |
//! | `buckets.rs` | bucket assignment, the flat buffers and their aliases, the rebuild | `compute_bucket_assignment_by_size`, `initialize_buckets` |
//! | `pass.rs` | one backward pass's state, created fresh for each pass | the per-iteration fields `prepare_for_backward` resets |
//! | `backward.rs` | the state machine: gradient ready, launch order, end of backward | `autograd_hook`, `mark_variable_ready`, `finalize_backward` |
//! | `grads.rs` | moving gradients between `.grad` and the buckets | `copy_grad_to_bucket`, `finalize_bucket_dense` |
//! | `unused.rs` | `find_unused_parameters` and `static_graph` | `search_unused_parameters`, `static_graph_` |
//! | `comm_hooks/` | the hook interface and one file per hook | `comm.hpp`, `default_comm_hooks.cpp`, `powerSGD_hook.py` |
//! | `autograd.rs` | the engine's hooks and callbacks | `grad_accumulator()->add_post_hook`, `queue_callback` |
//!
//! The passes the reducer refuses are [`ReducerError`](crate::ReducerError)s, written in
//! `error/reducer.rs` with every other error's text.
//!
//! How a pass goes:
//!
//! - **Hooks.** A post hook on each parameter's gradient accumulator tells the reducer that
//!   the parameter's gradient is final for this backward pass.
//! - **Buckets.** Parameters are grouped into flat buckets (reverse registration order, per
//!   dtype and device, the first capped at 1 MiB and the rest at `bucket_cap_mb`, or each
//!   at its entry of `bucket_cap_mb_list`, a parameter never split). A ready gradient is
//!   copied into its bucket slice — or, with `gradient_as_bucket_view`, *is* its bucket
//!   slice.
//! - **In place.** With the default hook, a gradient of at least `in_place_min_bytes`
//!   (1 MiB) is not copied at all: its `.grad` is all-reduced in place, as its own collective,
//!   as soon as it is ready and everything before it in bucket order has been launched. Only
//!   small gradients go through the flat buffer, where batching them pays. In a group of one
//!   the average is the gradient itself, so nothing is copied or communicated.
//! - **Launch order.** A bucket's in-place gradients (in bucket order), then its flat buffer
//!   (through the communication hook), are launched asynchronously as soon as they are ready
//!   and everything earlier has been launched, so communication overlaps the rest of
//!   backward and every rank launches the same collectives in the same order.
//! - **End of backward.** The first hook of a pass creates the pass's state and queues a
//!   callback that the autograd engine runs before `backward()` returns: it launches what is
//!   left (unused parameters count as zero with `find_unused_parameters`), waits for every
//!   bucket, and writes the averaged gradients back into `.grad`.
//! - **Skipping unused buckets.** With `skip_all_reduce_unused_params`, a bucket whose
//!   parameters no rank used in the previous synchronised pass (the all-reduced used map of
//!   `find_unused_parameters`) is passed over in launch order on every rank alike; should
//!   some rank use one of them after all, the bucket is all-reduced once this pass's used
//!   map says so, at the end of backward.
//! - **Step check.** A synchronised pass's first hook starts the step check
//!   (`c10d/step_check/`: every rank's forward and backward counts, all-gathered in a header of
//!   fixed size), and its first launch waits for it, so that a rank in another pass or step
//!   fails every rank before any bucket is sent.
//! - **Rebuild.** After the first iteration the buckets are rebuilt once from the order in
//!   which gradients became ready (rank 0's order, adopted by all ranks).

mod autograd;
mod backward;
mod buckets;
pub(crate) mod comm_hooks;
mod grads;
mod options;
mod pass;
mod unused;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tch::Tensor;

use crate::c10d::group::ProcessGroup;
use crate::error::{ArgumentError, DistError, Phase, Result, StepPosition};
use autograd::GradReadyHook;
use buckets::{Layout, Param};
use comm_hooks::BucketHook;
use pass::Pass;
use unused::StaticGraphUse;

pub use comm_hooks::PowerSgdOptions;
pub use options::{
    CommHook, ReducerOptions, DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_IN_PLACE_MIN_BYTES,
};

/// PyTorch's `dist._compute_bucket_assignment_by_size(tensors, bucket_size_limits)` (no
/// `tensor_indices`): walks `tensors` in order, filling one bucket per dtype and device up
/// to its cap (the k-th bucket of a dtype and device closes at `limits[k]` bytes, the last
/// limit for every bucket after), never splitting a tensor. The buckets come sorted by
/// their first member; DDP reduces them in the reverse order. The layout another DDP
/// (torchft's) all-reduces its gradients in.
///
/// ```
/// use tch::{Kind, Tensor};
/// let t = |n: i64| Tensor::zeros([n], (Kind::Float, tch::Device::Cpu));
/// // 4-byte floats: the first bucket closes at 16 bytes, every later one at 40.
/// let buckets = tch_dist_runtime::compute_bucket_assignment_by_size(
///     &[t(2), t(3), t(4), t(6), t(1)],
///     &[16, 40],
/// );
/// assert_eq!(buckets, [vec![0, 1], vec![2, 3], vec![4]]);
/// ```
pub fn compute_bucket_assignment_by_size(tensors: &[Tensor], limits: &[usize]) -> Vec<Vec<usize>> {
    let sizes: Vec<_> = tensors
        .iter()
        .map(|t| (t.numel(), t.kind(), t.device()))
        .collect();
    let order: Vec<usize> = (0..tensors.len()).collect();
    buckets::assign_buckets(&sizes, &order, limits)
}

/// Per-step figures, for benchmarks and `replicate::state`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReducerStats {
    /// Synchronised backward passes so far.
    pub steps: u64,
    /// Number of buckets.
    pub buckets: usize,
    /// Bytes all-reduced per step.
    pub bytes: usize,
    /// Last step: from the first bucket's launch until every bucket was done.
    pub comm_time: Duration,
    /// Last step: the part of `comm_time` that ran while backward was still computing.
    pub overlapped_time: Duration,
    /// Whether the buckets were rebuilt from the observed gradient order.
    pub rebuilt: bool,
    /// Buckets communicated in the last synchronised step (PyTorch's `num_buckets_reduced`
    /// logging figure): `buckets`, less those `skip_all_reduce_unused_params` skipped.
    pub buckets_reduced: usize,
}

/// The reducer's state across passes.
pub(crate) struct State {
    layout: Layout,
    hook: Box<dyn BucketHook>,
    /// The backward pass in progress (from its first gradient-ready hook to its end).
    pass: Option<Pass>,
    /// Which copied members had no `.grad` at the last `prepare_for_forward`, for the next
    /// pass (see `grads::release_fresh_grad`).
    fresh_grads: Vec<bool>,
    /// The order in which gradients became ready, recorded until the one rebuild (`None`
    /// once rebuilt).
    ready_order: Option<Vec<usize>>,
    /// `static_graph`, after the first synchronised pass: what it saw.
    static_graph: Option<StaticGraphUse>,
    /// `skip_all_reduce_unused_params`, after a synchronised pass that found unused
    /// parameters: per parameter, whether no rank used it in that pass (the same on every
    /// rank: from the all-reduced used map).
    skip_unused: Option<Vec<bool>>,
    /// The last pass left parameters without a gradient: the next forward fails with this.
    unfinished: Option<DistError>,
    /// An engine failure, a changed static graph or a failed step check; every later pass
    /// reports it.
    failed: Option<DistError>,
    /// Forwards begun with autograd recording (the step check's step number).
    forwards: u64,
    /// Synchronised backward passes begun.
    backwards: u64,
    stats: ReducerStats,
}

pub(crate) struct ReducerInner {
    group: ProcessGroup,
    opts: ReducerOptions,
    require_sync: AtomicBool,
    state: Mutex<State>,
}

/// Averages gradients across a process group while backward runs. See the module docs.
pub struct Reducer {
    inner: Arc<ReducerInner>,
    hooks: Vec<GradReadyHook>,
}

impl std::fmt::Debug for Reducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reducer")
            .field("buckets", &self.bucket_fqns())
            .finish()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic inside a hook is caught and turned into an error; the state stays usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Reducer {
    /// Buckets `params` (in registration order, with their FQNs) and installs the hooks.
    ///
    /// ```no_run
    /// use tch_dist_runtime::{Reducer, ReducerOptions};
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let w = vs.root().var("w", &[4, 4], tch::nn::Init::Const(1.0));
    /// let reducer = Reducer::new(vec![("w".into(), w)], pg, ReducerOptions::default())?;
    /// assert_eq!(reducer.bucket_fqns(), vec![vec!["w".to_string()]]);
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn new(
        params: Vec<(String, Tensor)>,
        group: ProcessGroup,
        opts: ReducerOptions,
    ) -> Result<Reducer> {
        let rank = group.rank();
        let invalid = |problem: ArgumentError| DistError::InvalidArgument {
            rank,
            op: "replicate",
            problem: Box::new(problem),
        };
        opts.validate().map_err(invalid)?;
        if let Some((first_fqn, first)) = params.first() {
            for (fqn, t) in &params {
                if !t.requires_grad() {
                    return Err(invalid(ArgumentError::NoGrad { fqn: fqn.clone() }));
                }
                // All CUDA devices count as one: a module may sit on several GPUs of a node.
                if t.device() != first.device()
                    && !(t.device().is_cuda() && first.device().is_cuda())
                {
                    return Err(invalid(ArgumentError::MixedDevices {
                        fqn: fqn.clone(),
                        device: t.device(),
                        first_fqn: first_fqn.clone(),
                        first_device: first.device(),
                    }));
                }
            }
        }
        let hook = comm_hooks::for_options(&opts.comm_hook);
        // In a group of one the average is the gradient itself: every gradient is "in place"
        // (unless the group was created without shortcuts, a test switch).
        let in_place_min_bytes = hook.reduces_in_place().then(|| {
            if group.skips_communication() {
                0
            } else {
                opts.in_place_min_bytes
            }
        });
        let params: Vec<Param> = params
            .into_iter()
            .map(|(fqn, tensor)| Param::new(fqn, tensor))
            .collect();
        let reverse: Vec<usize> = (0..params.len()).rev().collect();
        let layout = Layout::new(params, &reverse, &opts.bucket_limits(), in_place_min_bytes);
        let stats = ReducerStats {
            buckets: layout.buckets.len(),
            bytes: layout.params.iter().map(Param::bytes).sum(),
            ..Default::default()
        };
        let state = State {
            layout,
            hook,
            pass: None,
            fresh_grads: Vec::new(),
            ready_order: Some(Vec::new()),
            static_graph: None,
            skip_unused: None,
            unfinished: None,
            failed: None,
            forwards: 0,
            backwards: 0,
            stats,
        };
        if opts.gradient_as_bucket_view {
            grads::adopt_bucket_views(&state.layout, rank)?;
        }
        let tensors: Vec<(String, Tensor)> = state
            .layout
            .params
            .iter()
            .map(|p| (p.fqn.clone(), p.tensor.shallow_clone()))
            .collect();
        let inner = Arc::new(ReducerInner {
            group,
            opts,
            require_sync: AtomicBool::new(true),
            state: Mutex::new(state),
        });
        let mut hooks = Vec::with_capacity(tensors.len());
        for (i, (fqn, tensor)) in tensors.iter().enumerate() {
            // SAFETY: the hook's context is the ReducerInner, kept alive by `inner` for as
            // long as the hooks exist (Drop removes them before `inner` can go away).
            let hook =
                unsafe { GradReadyHook::add(tensor, Arc::as_ptr(&inner), i) }.map_err(|e| {
                    DistError::Collective {
                        rank,
                        op: "replicate",
                        cause: format!("registering the gradient hook of `{fqn}`: {}", e.message),
                    }
                })?;
            hooks.push(hook);
        }
        Ok(Reducer { inner, hooks })
    }

    /// Called before each forward: fails with the previous iteration's error — PyTorch's
    /// "Expected to have finished reduction in the prior iteration..." when it left
    /// parameters without a gradient (and unused parameters were not allowed), or the
    /// failure of an earlier pass. Also notes which copied members have no `.grad` yet.
    pub fn prepare_for_forward(&self) -> Result<()> {
        let mut st = lock(&self.inner.state);
        if !self.inner.opts.gradient_as_bucket_view {
            st.fresh_grads = st
                .layout
                .params
                .iter()
                .map(|p| !p.in_place && !p.tensor.grad().defined())
                .collect();
        }
        if let Some(e) = st.failed.as_ref().or(st.unfinished.as_ref()) {
            return Err(e.clone());
        }
        // A forward under no_grad (an evaluation, perhaps on one rank only) is no step.
        if crate::c10d::step_check::grad_enabled() {
            st.forwards += 1;
        }
        Ok(())
    }

    /// The step check before a forward's collectives (replicate's buffer broadcast): fails
    /// on every rank with [`Mismatch::Step`](crate::Mismatch::Step) when another rank is in
    /// another pass or step (a rank skipped a backward, or ran one more forward); nothing is
    /// sent then, and every later pass fails with the same error. Call it after
    /// [`prepare_for_forward`](Self::prepare_for_forward), before the forward's first
    /// collective.
    pub fn check_forward_step(&self) -> Result<()> {
        let mut st = lock(&self.inner.state);
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let me = StepPosition::now(Phase::Forward, st.forwards, st.backwards);
        let result =
            crate::c10d::step_check::check(&self.inner.group, "replicate", me, Default::default());
        if let Err(e) = &result {
            st.failed = Some(e.clone());
        }
        result
    }

    /// Whether the next backward passes synchronise (false inside `no_sync`).
    pub fn set_require_sync(&self, sync: bool) {
        self.inner.require_sync.store(sync, Ordering::SeqCst);
    }

    /// Whether backward passes currently synchronise.
    pub fn require_sync(&self) -> bool {
        self.inner.require_sync.load(Ordering::SeqCst)
    }

    /// The managed parameters' FQNs, in registration order.
    pub fn param_fqns(&self) -> Vec<String> {
        lock(&self.inner.state)
            .layout
            .params
            .iter()
            .map(|p| p.fqn.clone())
            .collect()
    }

    /// The bucket layout: the FQNs of each bucket, in launch order.
    pub fn bucket_fqns(&self) -> Vec<Vec<String>> {
        lock(&self.inner.state).layout.bucket_fqns()
    }

    /// Figures of the last synchronised step.
    pub fn stats(&self) -> ReducerStats {
        lock(&self.inner.state).stats.clone()
    }

    /// The process group the gradients are averaged over.
    pub fn group(&self) -> &ProcessGroup {
        &self.inner.group
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        // Hooks first: after this no callback can reach `inner`.
        self.hooks.clear();
    }
}

impl ReducerInner {
    fn rank(&self) -> usize {
        self.group.rank()
    }
}
