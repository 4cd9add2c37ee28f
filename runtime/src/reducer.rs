//! The gradient reducer beneath `replicate` (PyTorch DDP's `Reducer`, re-created).
//!
//! - **Hooks.** A post hook on each parameter's gradient accumulator ([`GradReadyHook`])
//!   tells the reducer that the parameter's gradient is final for this backward pass.
//! - **Buckets.** Parameters are grouped into flat [`Bucket`]s (reverse registration order,
//!   per dtype and device, the first capped at 1 MiB and the rest at `bucket_cap_mb`, a
//!   parameter never split). A ready gradient is copied into its bucket slice — or, with
//!   `gradient_as_bucket_view`, *is* its bucket slice.
//! - **In place.** With the default hook, a gradient of at least `in_place_min_bytes`
//!   (1 MiB) is not copied at all: its `.grad` is all-reduced in place, as its own collective,
//!   as soon as it is ready and everything before it in bucket order has been launched. Only
//!   small gradients go through the flat buffer, where batching them pays. In a group of one
//!   the average is the gradient itself, so nothing is copied or communicated.
//! - **Launch order.** A bucket's in-place gradients (in bucket order), then its flat buffer,
//!   are all-reduced asynchronously as soon as they are ready and everything earlier has been
//!   launched, so communication overlaps the rest of backward and every rank launches the
//!   same collectives in the same order.
//! - **End of backward.** The first hook of a pass queues a callback that the autograd engine
//!   runs before `backward()` returns: it launches what is left (unused parameters count as
//!   zero with `find_unused_parameters`), waits for every bucket, and writes the averaged
//!   gradients back into `.grad`.
//! - **Rebuild.** After the first iteration the buckets are rebuilt once from the order in
//!   which gradients became ready (rank 0's order, adopted by all ranks).

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::collectives::{ReduceOp, Work};
use crate::error::{DistError, Result};
use crate::ffi;
use crate::powersgd::{PowerSgdOptions, PowerSgdState};
use crate::process_group::ProcessGroup;

/// The first bucket is small so that communication starts early in backward (PyTorch's
/// `dist._DEFAULT_FIRST_BUCKET_BYTES`).
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1024 * 1024;

/// Gradients of at least this many bytes are all-reduced in place rather than copied through
/// a bucket (the default of `ReducerOptions::in_place_min_bytes`): from 1 MiB up, the copy
/// into the bucket and back costs more than the one extra collective saves.
const DEFAULT_IN_PLACE_MIN_BYTES: usize = 1024 * 1024;

/// How a bucket's gradients are communicated (PyTorch's DDP communication hooks).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum CommHook {
    /// All-reduce and average (DDP's default).
    #[default]
    AllReduceMean,
    /// Divide by the world size, cast to fp16, all-reduce, cast back
    /// (`default_hooks.fp16_compress_hook`).
    Fp16Compress,
    /// The same in bfloat16 (`default_hooks.bf16_compress_hook`).
    Bf16Compress,
    /// Low-rank compression (`powerSGD_hook.powerSGD_hook`); see [`PowerSgdOptions`].
    PowerSgd(PowerSgdOptions),
}

/// Reducer settings; `replicate::Options` maps onto these.
#[derive(Debug, Clone, PartialEq)]
pub struct ReducerOptions {
    /// Cap of every bucket but the first, in MiB (default 25).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket, in bytes (default 1 MiB; never above `bucket_cap_mb`).
    pub first_bucket_bytes: usize,
    /// Parameters without a gradient count as zero instead of stalling their bucket.
    pub find_unused_parameters: bool,
    /// `.grad` of each parameter is a view into its bucket (saves a copy and memory).
    pub gradient_as_bucket_view: bool,
    /// The graph is the same every iteration: the first synchronised pass finds the unused
    /// parameters as `find_unused_parameters` does; later passes reuse what it found (no
    /// used-map all-reduce; this rank's unused parameters count as zero from the pass's first
    /// hook) and fail if a parameter's use on this rank changed.
    pub static_graph: bool,
    /// The communication hook.
    pub comm_hook: CommHook,
    /// With the default hook ([`CommHook::AllReduceMean`]), a gradient of at least this many
    /// bytes is all-reduced in place in `.grad` instead of being copied into its bucket and
    /// back (default 1 MiB; `usize::MAX` copies every gradient, as
    /// PyTorch does). The bucket layout is the same either way; with
    /// `gradient_as_bucket_view` only the copied gradients are bucket views.
    pub in_place_min_bytes: usize,
}

impl Default for ReducerOptions {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            first_bucket_bytes: DEFAULT_FIRST_BUCKET_BYTES,
            find_unused_parameters: false,
            gradient_as_bucket_view: false,
            static_graph: false,
            comm_hook: CommHook::AllReduceMean,
            in_place_min_bytes: DEFAULT_IN_PLACE_MIN_BYTES,
        }
    }
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
}

/// A contiguous buffer whose slices hold the gradients of some parameters of one dtype and
/// device, all-reduced as one tensor.
struct Bucket {
    /// The copied (not in-place) members' gradients, back to back.
    flat: Tensor,
    /// Parameter indices, in bucket order.
    params: Vec<usize>,
    /// One slice per copied member (`Param::slot`), aliasing `flat`'s storage (not an
    /// autograd view, so that optimizers may treat it as an ordinary `.grad`).
    views: Vec<Tensor>,
    /// The members all-reduced in place, in bucket order (`Param::slot` indexes this).
    in_place: Vec<usize>,
    /// Parameters of this bucket not yet ready in the current pass.
    pending: usize,
}

/// An in-place all-reduce of one parameter's gradient: the work (taken when awaited) and,
/// when `.grad` itself could not be used (no gradient, or not contiguous), the buffer that
/// was reduced instead.
struct InPlaceFlight {
    param: usize,
    work: Option<Work>,
    buffer: Option<Tensor>,
}

/// A launched bucket: its work and the compressed buffer to decompress from, if any; or a
/// PowerSGD bucket, whose dependent collectives run when the reducer waits.
enum InFlight {
    Work {
        work: Work,
        compressed: Option<Tensor>,
    },
    PowerSgd,
}

/// The parameter registry entry.
struct Param {
    fqn: String,
    tensor: Tensor,
    bucket: usize,
    /// Index into the bucket's `views` (copied) or `in_place` (in place).
    slot: usize,
    /// All-reduced in place in `.grad` instead of through the bucket's flat buffer.
    in_place: bool,
    /// Set once its in-place all-reduce has been launched in the current pass.
    launched: bool,
    /// Its `.grad` was None when `prepare_for_forward` last ran (cleared after each pass):
    /// the gradient of the coming backward is a tensor nobody else holds.
    grad_was_none: bool,
    /// Copied member, not a bucket view: its fresh `.grad` was released once copied into the
    /// bucket this pass (a new one is written at the end).
    released: bool,
}

struct State {
    params: Vec<Param>,
    buckets: Vec<Bucket>,
    ready: Vec<bool>,
    next_to_launch: usize,
    /// Position in `buckets[next_to_launch].in_place` of the next in-place launch.
    next_in_place: usize,
    in_flight: Vec<Option<InFlight>>,
    in_place_flight: Vec<InPlaceFlight>,
    /// End of backward: parameters without a gradient are launched as zeros.
    flushing: bool,
    callback_queued: bool,
    ready_order: Vec<usize>,
    first_launch: Option<Instant>,
    /// Parameters that got no gradient in the last pass when that is an error.
    unfinished: Vec<String>,
    rebuilt: bool,
    stats: ReducerStats,
    /// Set when an engine failure happened; every later pass reports it.
    failed: Option<String>,
    powersgd: PowerSgdState,
    /// `static_graph`, after the first synchronised pass: which parameters got a gradient on
    /// some rank, and which on this rank.
    static_graph_used: Option<StaticGraphUse>,
}

/// What the first pass of a static graph saw.
struct StaticGraphUse {
    global: Vec<bool>,
    local: Vec<bool>,
}

impl State {
    /// `static_graph` after its first pass, once a pass has begun: parameter `i` got no
    /// gradient on this rank in the first pass, so it counted as zero at this pass's first
    /// hook ([`presume_static_unused`]) and its bucket does not wait for it.
    fn presumed_unused(&self, i: usize) -> bool {
        self.callback_queued && self.static_graph_used.as_ref().is_some_and(|s| !s.local[i])
    }
}

/// PyTorch's error for a static graph whose parameter `fqn` changed its use on `rank`.
fn graph_changed(rank: usize, fqn: &str, used_in_first_pass: bool) -> String {
    let (was, now) = if used_in_first_pass {
        ("got a gradient", "none")
    } else {
        ("got no gradient", "one")
    };
    format!(
        "rank {rank}: replicate: the training graph changed in this iteration: `{fqn}` {was} in \
         the first iteration but {now} in this one, which static_graph=true does not allow"
    )
}

struct ReducerInner {
    group: ProcessGroup,
    opts: ReducerOptions,
    require_sync: AtomicBool,
    state: Mutex<State>,
}

/// A post hook on one parameter's gradient accumulator; removed on drop.
pub struct GradReadyHook {
    ptr: *mut ffi::TdrHook,
}

// SAFETY: the registration is only touched to remove it, which libtorch allows from any
// thread while no backward pass runs.
unsafe impl Send for GradReadyHook {}
unsafe impl Sync for GradReadyHook {}

impl Drop for GradReadyHook {
    fn drop(&mut self) {
        // SAFETY: created by tdr_add_grad_ready_hook, removed exactly once.
        unsafe { ffi::tdr_hook_remove(self.ptr) }
    }
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

fn element_size(kind: Kind) -> usize {
    kind.elt_size_in_bytes()
}

/// PyTorch's `compute_bucket_assignment_by_size`: walks `order`, fills one open bucket per
/// (dtype, device) up to its current cap (the first cap, then `cap`), never splitting a
/// tensor; buckets are then sorted by their earliest position in `order`.
pub fn assign_buckets(
    sizes: &[(usize, Kind, Device)],
    order: &[usize],
    first_cap: usize,
    cap: usize,
) -> Vec<Vec<usize>> {
    struct Open {
        key: (Kind, Device),
        members: Vec<usize>,
        bytes: usize,
        closed_before: usize,
    }
    let mut open: Vec<Open> = Vec::new();
    let mut done: Vec<Vec<usize>> = Vec::new();
    for &i in order {
        let (numel, kind, device) = sizes[i];
        let key = (kind, device);
        let pos = match open.iter().position(|o| o.key == key) {
            Some(p) => p,
            None => {
                open.push(Open {
                    key,
                    members: Vec::new(),
                    bytes: 0,
                    closed_before: 0,
                });
                open.len() - 1
            }
        };
        let o = &mut open[pos];
        o.members.push(i);
        o.bytes += numel * element_size(kind);
        let limit = if o.closed_before == 0 { first_cap } else { cap };
        if o.bytes >= limit {
            done.push(std::mem::take(&mut o.members));
            o.bytes = 0;
            o.closed_before += 1;
        }
    }
    done.extend(
        open.into_iter()
            .map(|o| o.members)
            .filter(|m| !m.is_empty()),
    );
    let position: std::collections::HashMap<usize, usize> =
        order.iter().enumerate().map(|(p, &i)| (i, p)).collect();
    done.sort_by_key(|b| b.iter().map(|i| position[i]).min().unwrap_or(usize::MAX));
    done
}

/// Parameters without a gradient in this pass count as zero: a copied member's slice is
/// zeroed (an in-place member is reduced from a zero buffer when launched) and its bucket
/// stops waiting for it.
fn count_as_zero(st: &mut State, params: &[usize]) {
    tch::no_grad(|| {
        for &i in params.iter().filter(|&&i| !st.params[i].in_place) {
            let p = &st.params[i];
            let _ = st.buckets[p.bucket].views[p.slot].shallow_clone().zero_();
        }
    });
    for &i in params {
        let b = st.params[i].bucket;
        st.buckets[b].pending -= 1;
    }
}

/// `static_graph` after its first pass, at the first hook of a pass: the parameters this
/// rank did not use in the first pass count as zero now (PyTorch's reducer marks them ready
/// when backward starts), so that buckets holding them launch during backward.
fn presume_static_unused(st: &mut State) {
    let unused: Vec<usize> = (0..st.params.len())
        .filter(|&i| st.presumed_unused(i))
        .collect();
    count_as_zero(st, &unused);
}

/// Builds the buckets of `layout`; members with `Param::in_place` set get no room in the
/// flat buffer.
fn build_buckets(params: &mut [Param], layout: &[Vec<usize>]) -> Vec<Bucket> {
    tch::no_grad(|| {
        layout
            .iter()
            .enumerate()
            .map(|(b, members)| {
                let first = &params[members[0]].tensor;
                let (kind, device) = (first.kind(), first.device());
                let total: i64 = members
                    .iter()
                    .filter(|&&i| !params[i].in_place)
                    .map(|&i| params[i].tensor.numel() as i64)
                    .sum();
                let flat = Tensor::zeros([total], (kind, device));
                let mut views = Vec::with_capacity(members.len());
                let mut in_place = Vec::new();
                let mut off = 0i64;
                for &i in members {
                    let p = &mut params[i];
                    p.bucket = b;
                    if p.in_place {
                        p.slot = in_place.len();
                        in_place.push(i);
                    } else {
                        p.slot = views.len();
                        views.push(storage_alias(&flat, off, &p.tensor.size()));
                        off += p.tensor.numel() as i64;
                    }
                }
                Bucket {
                    flat,
                    params: members.clone(),
                    views,
                    in_place,
                    pending: members.len(),
                }
            })
            .collect()
    })
}

/// Which parameters are all-reduced in place: with the default hook, those of at least
/// `in_place_min_bytes`, and every one in a group of one (where the average is the gradient).
fn mark_in_place(params: &mut [Param], opts: &ReducerOptions, world_size: usize) {
    let allowed = opts.comm_hook == CommHook::AllReduceMean;
    for p in params {
        let bytes = p.tensor.numel() * element_size(p.tensor.kind());
        p.in_place = allowed && (world_size == 1 || bytes >= opts.in_place_min_bytes);
    }
}

/// A tensor of `shape` at element `offset` of `flat`'s storage, contiguous, sharing memory
/// without being an autograd view of `flat`.
fn storage_alias(flat: &Tensor, offset: i64, shape: &[i64]) -> Tensor {
    let mut strides = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1].max(1);
    }
    let mut t = Tensor::empty([0], (flat.kind(), flat.device()));
    t.set_source_tensor_storage_offset_(flat, offset, shape, strides.as_slice())
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
        let invalid = move |msg: String| DistError::InvalidArgument {
            rank,
            op: "replicate",
            msg,
        };
        if !opts.bucket_cap_mb.is_finite() || opts.bucket_cap_mb <= 0.0 {
            return Err(invalid(format!(
                "bucket_cap_mb must be positive, got {}",
                opts.bucket_cap_mb
            )));
        }
        if let CommHook::PowerSgd(p) = &opts.comm_hook {
            p.validate().map_err(invalid)?;
        }
        for (fqn, t) in &params {
            if !t.requires_grad() {
                return Err(invalid(format!("parameter `{fqn}` does not require grad")));
            }
            if t.device() != params[0].1.device()
                && !(t.device().is_cuda() && params[0].1.device().is_cuda())
            {
                return Err(invalid(format!(
                    "parameter `{fqn}` is on {:?} but `{}` is on {:?}; a replicated module lives on one device",
                    t.device(),
                    params[0].0,
                    params[0].1.device()
                )));
            }
        }
        let mut params: Vec<Param> = params
            .into_iter()
            .map(|(fqn, tensor)| Param {
                fqn,
                tensor,
                bucket: 0,
                slot: 0,
                in_place: false,
                launched: false,
                grad_was_none: false,
                released: false,
            })
            .collect();
        mark_in_place(&mut params, &opts, group.world_size());
        let reverse: Vec<usize> = (0..params.len()).rev().collect();
        let cap = (opts.bucket_cap_mb * 1024.0 * 1024.0) as usize;
        let layout = layout_for(&params, &reverse, opts.first_bucket_bytes.min(cap), cap);
        let buckets = build_buckets(&mut params, &layout);
        let n = params.len();
        let nb = buckets.len();
        let bytes = params
            .iter()
            .map(|p| p.tensor.numel() * element_size(p.tensor.kind()))
            .sum();
        let state = State {
            params,
            buckets,
            ready: vec![false; n],
            next_to_launch: 0,
            next_in_place: 0,
            in_flight: (0..nb).map(|_| None).collect(),
            in_place_flight: Vec::new(),
            flushing: false,
            callback_queued: false,
            ready_order: Vec::new(),
            first_launch: None,
            unfinished: Vec::new(),
            rebuilt: false,
            stats: ReducerStats {
                buckets: nb,
                bytes,
                ..Default::default()
            },
            failed: None,
            powersgd: PowerSgdState::default(),
            static_graph_used: None,
        };
        let inner = Arc::new(ReducerInner {
            group,
            opts,
            require_sync: AtomicBool::new(true),
            state: Mutex::new(state),
        });
        if inner.opts.gradient_as_bucket_view {
            let mut st = lock(&inner.state);
            adopt_bucket_views(&mut st)?;
        }
        let mut hooks = Vec::with_capacity(n);
        {
            let st = lock(&inner.state);
            for (i, p) in st.params.iter().enumerate() {
                let mut out = std::ptr::null_mut();
                // SAFETY: the context is the ReducerInner, kept alive by `self.inner` for as long
                // as the hooks exist (they are removed in Drop before `inner` can go away).
                let err = unsafe {
                    ffi::tdr_add_grad_ready_hook(
                        p.tensor.as_ptr() as *mut _,
                        grad_ready_trampoline,
                        Arc::as_ptr(&inner) as *mut c_void,
                        i,
                        &mut out,
                    )
                };
                // SAFETY: `err` is the shim's return value.
                unsafe { ffi::take_error(err) }
                    .map_err(|e| invalid(format!("parameter `{}`: {e}", p.fqn)))?;
                hooks.push(GradReadyHook { ptr: out });
            }
        }
        Ok(Reducer { inner, hooks })
    }

    /// Called before each forward: fails with PyTorch's error when the previous iteration
    /// left parameters without a gradient (and unused parameters were not allowed). Also
    /// notes which copied members have no `.grad` yet (see `release_fresh_grad`).
    pub fn prepare_for_forward(&self) -> Result<()> {
        let mut st = lock(&self.inner.state);
        if !self.inner.opts.gradient_as_bucket_view {
            for p in st.params.iter_mut().filter(|p| !p.in_place) {
                p.grad_was_none = !p.tensor.grad().defined();
            }
        }
        if let Some(e) = &st.failed {
            return Err(DistError::Collective {
                rank: self.inner.group.rank(),
                op: "replicate",
                cause: e.clone(),
            });
        }
        if !st.unfinished.is_empty() {
            return Err(DistError::Collective {
                rank: self.inner.group.rank(),
                op: "replicate",
                cause: unfinished_message(self.inner.group.rank(), &st.unfinished),
            });
        }
        Ok(())
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
            .params
            .iter()
            .map(|p| p.fqn.clone())
            .collect()
    }

    /// The bucket layout: the FQNs of each bucket, in launch order.
    pub fn bucket_fqns(&self) -> Vec<Vec<String>> {
        let st = lock(&self.inner.state);
        st.buckets
            .iter()
            .map(|b| b.params.iter().map(|&i| st.params[i].fqn.clone()).collect())
            .collect()
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

fn layout_for(params: &[Param], order: &[usize], first_cap: usize, cap: usize) -> Vec<Vec<usize>> {
    let sizes: Vec<(usize, Kind, Device)> = params
        .iter()
        .map(|p| (p.tensor.numel(), p.tensor.kind(), p.tensor.device()))
        .collect();
    assign_buckets(&sizes, order, first_cap, cap)
}

/// PyTorch's wording, with replicate's option name.
fn unfinished_message(rank: usize, fqns: &[String]) -> String {
    format!(
        "Expected to have finished reduction in the prior iteration before starting a new one. \
         This error indicates that your module has parameters that were not used in producing \
         loss. You can enable unused parameter detection by passing `find_unused_parameters: \
         true` in replicate::Options, and by making sure all forward outputs participate in \
         calculating loss. Parameter indices which did not receive grad for rank {rank}: see \
         names. Parameters which did not receive grad for rank {rank}: {}",
        fqns.join(", ")
    )
}

/// Makes every existing `.grad` its parameter's bucket slice, keeping its values.
fn adopt_bucket_views(st: &mut State) -> Result<()> {
    tch::no_grad(|| {
        for p in st.params.iter().filter(|p| !p.in_place) {
            let view = &st.buckets[p.bucket].views[p.slot];
            let grad = p.tensor.grad();
            if !grad.defined() {
                continue; // as in PyTorch, a missing .grad becomes a view once it is produced
            }
            view.shallow_clone().copy_(&grad);
            set_grad(&p.tensor, Some(view)).map_err(|cause| DistError::Collective {
                rank: 0,
                op: "replicate",
                cause,
            })?;
        }
        Ok(())
    })
}

fn set_grad(param: &Tensor, grad: Option<&Tensor>) -> std::result::Result<(), String> {
    let g = grad.map_or(std::ptr::null_mut(), |g| g.as_ptr() as *mut _);
    // SAFETY: live tensors; the shim assigns the grad under its own error handling.
    let err = unsafe { ffi::tdr_set_grad(param.as_ptr() as *mut _, g) };
    // SAFETY: `err` is the shim's return value.
    unsafe { ffi::take_error(err) }
}

/// Called by libtorch right after parameter `index`'s gradient was accumulated.
unsafe extern "C" fn grad_ready_trampoline(ctx: *mut c_void, index: usize) -> *mut c_char {
    // SAFETY: `ctx` is the ReducerInner registered with the hook, alive while the hook is.
    let inner = unsafe { &*(ctx as *const ReducerInner) };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        inner.mark_ready(ctx, index)
    }));
    match result {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(msg)) => {
            // The engine abandons the pass (its end-of-backward callback never runs), so the
            // reducer's state is mid-pass: every later pass reports this error.
            let mut st = lock(&inner.state);
            if st.failed.is_none() {
                st.failed = Some(msg.clone());
            }
            ffi::malloc_message(&msg)
        }
        Err(_) => ffi::malloc_message("replicate: internal panic in the gradient-ready hook"),
    }
}

/// Called by libtorch at the end of the backward pass.
unsafe extern "C" fn end_of_backward_trampoline(ctx: *mut c_void, _index: usize) -> *mut c_char {
    // SAFETY: as above; the callback is queued by a hook of this same ReducerInner.
    let inner = unsafe { &*(ctx as *const ReducerInner) };
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.finalize_backward()));
    match result {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(msg)) => ffi::malloc_message(&msg),
        Err(_) => ffi::malloc_message("replicate: internal panic at the end of backward"),
    }
}

impl ReducerInner {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn mark_ready(&self, ctx: *mut c_void, index: usize) -> std::result::Result<(), String> {
        if !self.require_sync.load(Ordering::SeqCst) {
            // no_sync: gradients accumulate locally in .grad, which now exists.
            lock(&self.state).params[index].grad_was_none = false;
            return Ok(());
        }
        let mut st = lock(&self.state);
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        if !st.callback_queued {
            // SAFETY: we are inside a hook of a running backward pass, where queueing is allowed.
            let err = unsafe { ffi::tdr_queue_end_of_backward(end_of_backward_trampoline, ctx, 0) };
            // SAFETY: `err` is the shim's return value.
            unsafe { ffi::take_error(err) }?;
            st.callback_queued = true;
            presume_static_unused(&mut st);
        }
        if st.presumed_unused(index) {
            return Err(graph_changed(self.rank(), &st.params[index].fqn, false));
        }
        let in_place = st.params[index].in_place;
        if st.ready[index] {
            // The same parameter accumulated twice in one pass (e.g. reentrant backward): its
            // bucket slice already took the first gradient; refresh it with the final one. An
            // in-place gradient is read at launch, so only a launched one is a problem.
            if in_place && st.params[index].launched && self.group.world_size() > 1 {
                return Err(format!(
                    "rank {}: replicate: parameter `{}` received a gradient after its all-reduce \
                     had started (it was marked ready twice in one backward pass, e.g. used in \
                     several reentrant backward passes or outside forward)",
                    self.rank(),
                    st.params[index].fqn
                ));
            }
            if st.params[index].released {
                // The slice holds the first part; autograd started a fresh `.grad` for the rest.
                let p = &st.params[index];
                let grad = p.tensor.grad();
                if grad.defined() {
                    let view = &st.buckets[p.bucket].views[p.slot];
                    let _ = tch::no_grad(|| view.shallow_clone().g_add_(&grad));
                    set_grad(&p.tensor, None)?;
                }
            } else if !in_place {
                copy_grad_into_bucket(&mut st, index, self.opts.gradient_as_bucket_view)?;
            }
            return Ok(());
        }
        st.ready[index] = true;
        if !st.rebuilt {
            st.ready_order.push(index); // the order the one rebuild uses
        }
        if !in_place {
            copy_grad_into_bucket(&mut st, index, self.opts.gradient_as_bucket_view)?;
            if !self.opts.gradient_as_bucket_view {
                release_fresh_grad(&mut st.params[index])?;
            }
        }
        let b = st.params[index].bucket;
        st.buckets[b].pending -= 1;
        self.launch_ready_buckets(&mut st)
    }

    /// Launches in order while the next one is ready: bucket by bucket, its in-place
    /// gradients one by one, then its flat buffer once every member is ready.
    fn launch_ready_buckets(&self, st: &mut State) -> std::result::Result<(), String> {
        while st.next_to_launch < st.buckets.len() {
            let b = st.next_to_launch;
            while let Some(&i) = st.buckets[b].in_place.get(st.next_in_place) {
                if !st.ready[i] && !st.flushing && !st.presumed_unused(i) {
                    return Ok(());
                }
                self.launch_in_place(st, i)?;
                st.next_in_place += 1;
            }
            if st.buckets[b].pending != 0 {
                return Ok(());
            }
            if st.buckets[b].flat.numel() > 0 {
                self.launch(st, b)?;
            }
            st.next_to_launch += 1;
            st.next_in_place = 0;
        }
        Ok(())
    }

    /// All-reduces parameter `i`'s gradient in place (a zero buffer when it has none; a
    /// contiguous copy when `.grad` is not contiguous). In a group of one the gradient already
    /// is the average: nothing to do.
    fn launch_in_place(&self, st: &mut State, i: usize) -> std::result::Result<(), String> {
        st.params[i].launched = true;
        if self.group.world_size() == 1 {
            return Ok(());
        }
        let p = &st.params[i];
        let grad = p.tensor.grad();
        let usable = st.ready[i]
            && grad.defined()
            && grad.is_contiguous()
            && grad.kind() == p.tensor.kind()
            && grad.device() == p.tensor.device();
        let buffer = if usable {
            None
        } else if st.ready[i] && grad.defined() {
            Some(tch::no_grad(|| grad.contiguous().to_kind(p.tensor.kind())))
        } else {
            Some(tch::no_grad(|| p.tensor.zeros_like()))
        };
        if st.first_launch.is_none() {
            st.first_launch = Some(Instant::now());
        }
        let work = self
            .group
            .all_reduce_async(buffer.as_ref().unwrap_or(&grad), ReduceOp::Avg)
            .map_err(|e| e.to_string())?;
        st.in_place_flight.push(InPlaceFlight {
            param: i,
            work: Some(work),
            buffer,
        });
        Ok(())
    }

    fn launch(&self, st: &mut State, b: usize) -> std::result::Result<(), String> {
        if st.first_launch.is_none() {
            st.first_launch = Some(Instant::now());
        }
        let flat = &st.buckets[b].flat;
        let world = self.group.world_size() as f64;
        let (work, compressed) = match self.opts.comm_hook {
            CommHook::PowerSgd(p) if st.powersgd.compressing(&p) => {
                st.in_flight[b] = Some(InFlight::PowerSgd);
                return Ok(());
            }
            CommHook::AllReduceMean | CommHook::PowerSgd(_) => {
                (self.group.all_reduce_async(flat, ReduceOp::Avg), None)
            }
            CommHook::Fp16Compress | CommHook::Bf16Compress => {
                let kind = if self.opts.comm_hook == CommHook::Fp16Compress {
                    Kind::Half
                } else {
                    Kind::BFloat16
                };
                let c = tch::no_grad(|| flat.to_kind(kind) / world);
                (self.group.all_reduce_async(&c, ReduceOp::Sum), Some(c))
            }
        };
        let work = work.map_err(|e| e.to_string())?;
        st.in_flight[b] = Some(InFlight::Work { work, compressed });
        Ok(())
    }

    fn finalize_backward(&self) -> std::result::Result<(), String> {
        let backward_end = Instant::now();
        let mut st = lock(&self.state);
        let result = self.finalize_locked(&mut st, backward_end);
        // Whatever happened, the next pass starts clean.
        st.callback_queued = false;
        st.next_to_launch = 0;
        st.next_in_place = 0;
        st.flushing = false;
        st.in_place_flight.clear();
        for p in st.params.iter_mut() {
            p.launched = false;
            p.released = false;
            p.grad_was_none = false;
        }
        st.first_launch = None;
        st.ready.iter_mut().for_each(|r| *r = false);
        for b in st.buckets.iter_mut() {
            b.pending = b.params.len();
        }
        for f in st.in_flight.iter_mut() {
            *f = None;
        }
        if let Err(e) = &result {
            st.failed = Some(e.clone());
        }
        result
    }

    fn finalize_locked(
        &self,
        st: &mut State,
        backward_end: Instant,
    ) -> std::result::Result<(), String> {
        let tolerate_unused = self.opts.find_unused_parameters || self.opts.static_graph;
        let unready: Vec<usize> = (0..st.params.len()).filter(|&i| !st.ready[i]).collect();
        // Which parameters got a gradient on some rank (only needed when unused are allowed).
        let mut globally_used: Option<Vec<bool>> = None;
        if !unready.is_empty() && !tolerate_unused {
            // PyTorch leaves the stalled buckets unlaunched and fails the next iteration.
            st.unfinished = unready.iter().map(|&i| st.params[i].fqn.clone()).collect();
            self.wait_all(st)?;
            // Released gradients come back (their slices hold them).
            tch::no_grad(|| -> std::result::Result<(), String> {
                for p in st.params.iter().filter(|p| p.released) {
                    set_grad(&p.tensor, Some(&st.buckets[p.bucket].views[p.slot].copy()))?;
                }
                Ok(())
            })?;
            return Ok(());
        }
        if tolerate_unused {
            // Presumed unused ones were counted as zero when the pass began.
            let unready: Vec<usize> = unready
                .into_iter()
                .filter(|&i| !st.presumed_unused(i))
                .collect();
            count_as_zero(st, &unready);
            // In-place parameters without a gradient are launched as zeros.
            st.flushing = true;
            self.launch_ready_buckets(st)?;
            globally_used = Some(match &st.static_graph_used {
                // A static graph: the first pass's answer holds.
                Some(seen) => seen.global.clone(),
                None => {
                    let used = self.all_reduce_used_map(&st.ready)?;
                    if self.opts.static_graph {
                        st.static_graph_used = Some(StaticGraphUse {
                            global: used.clone(),
                            local: st.ready.clone(),
                        });
                    }
                    used
                }
            });
        }
        if st.next_to_launch != st.buckets.len() {
            return Err(format!(
                "rank {}: replicate: internal error: not every bucket was launched",
                self.rank()
            ));
        }
        self.wait_all(st)?;
        let done = Instant::now();
        let buffers: Vec<(usize, Tensor)> = st
            .in_place_flight
            .iter_mut()
            .filter_map(|f| f.buffer.take().map(|b| (f.param, b)))
            .collect();
        tch::no_grad(|| -> std::result::Result<(), String> {
            // In place: `.grad` already holds the average, unless a buffer stood in for it.
            for (i, buffer) in &buffers {
                if globally_used.as_ref().is_some_and(|u| !u[*i]) {
                    continue;
                }
                let grad = st.params[*i].tensor.grad();
                if grad.defined() {
                    grad.shallow_clone().copy_(buffer);
                } else {
                    set_grad(&st.params[*i].tensor, Some(buffer))?;
                }
            }
            for (i, p) in st.params.iter_mut().enumerate() {
                if p.in_place || globally_used.as_ref().is_some_and(|u| !u[i]) {
                    continue; // unused on every rank: .grad stays as it was (None stays None)
                }
                let view = &st.buckets[p.bucket].views[p.slot];
                let grad = p.tensor.grad();
                if self.opts.gradient_as_bucket_view {
                    if !grad.defined() || grad.data_ptr() != view.data_ptr() {
                        set_grad(&p.tensor, Some(view))?;
                    }
                } else if grad.defined() {
                    grad.shallow_clone().copy_(view);
                } else {
                    set_grad(&p.tensor, Some(&view.copy()))?;
                }
            }
            Ok(())
        })?;
        st.unfinished.clear();
        // After every collective, so that a rank whose graph changed does not leave the
        // others waiting in this pass.
        if let Some(seen) = &st.static_graph_used {
            if let Some(i) = (0..st.params.len()).find(|&i| seen.local[i] != st.ready[i]) {
                return Err(graph_changed(self.rank(), &st.params[i].fqn, seen.local[i]));
            }
        }
        let first = st.first_launch.unwrap_or(done);
        st.stats.steps += 1;
        st.powersgd.iter += 1;
        st.stats.comm_time = done.saturating_duration_since(first);
        st.stats.overlapped_time = backward_end.min(done).saturating_duration_since(first);
        if !st.rebuilt {
            self.rebuild_buckets(st)?;
        }
        Ok(())
    }

    /// Which parameters got a gradient on some rank: every rank, after all its buckets (so
    /// that the collectives line up even where another rank used a parameter this one did
    /// not), all-reduces its ready map with MAX.
    fn all_reduce_used_map(&self, ready: &[bool]) -> std::result::Result<Vec<bool>, String> {
        let used = Tensor::from_slice(&ready.iter().map(|&r| r as i32).collect::<Vec<_>>());
        self.group
            .all_reduce(&used, ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        Ok(Vec::<i32>::try_from(&used)
            .map_err(|e| e.to_string())?
            .iter()
            .map(|&u| u != 0)
            .collect())
    }

    /// Waits for every launched bucket and decompresses where a hook compressed.
    fn wait_all(&self, st: &mut State) -> std::result::Result<(), String> {
        for f in st.in_place_flight.iter_mut() {
            if let Some(work) = f.work.take() {
                work.wait().map_err(|e| e.to_string())?;
            }
        }
        for b in 0..st.in_flight.len() {
            match st.in_flight[b].take() {
                None => {}
                Some(InFlight::Work { work, compressed }) => {
                    work.wait().map_err(|e| e.to_string())?;
                    if let Some(c) = compressed {
                        tch::no_grad(|| st.buckets[b].flat.shallow_clone().copy_(&c));
                    }
                }
                Some(InFlight::PowerSgd) => {
                    let CommHook::PowerSgd(opts) = &self.opts.comm_hook else {
                        continue;
                    };
                    let bucket = &st.buckets[b];
                    st.powersgd
                        .reduce_bucket(opts, &self.group, b, &bucket.flat, &bucket.views)?;
                }
            }
        }
        Ok(())
    }

    /// Once, after the first synchronised iteration: rank 0's gradient-ready order becomes
    /// every rank's bucket order.
    fn rebuild_buckets(&self, st: &mut State) -> std::result::Result<(), String> {
        st.rebuilt = true;
        let n = st.params.len();
        let mut order = std::mem::take(&mut st.ready_order);
        let mut seen = vec![false; n];
        order.retain(|&i| !std::mem::replace(&mut seen[i], true));
        order.extend((0..n).rev().filter(|&i| !seen[i]));
        let t = Tensor::from_slice(&order.iter().map(|&i| i as i64).collect::<Vec<_>>());
        self.group.broadcast(&t, 0).map_err(|e| e.to_string())?;
        let order: Vec<usize> = Vec::<i64>::try_from(&t)
            .map_err(|e| e.to_string())?
            .iter()
            .map(|&i| i as usize)
            .collect();
        let cap = (self.opts.bucket_cap_mb * 1024.0 * 1024.0) as usize;
        let layout = layout_for(
            &st.params,
            &order,
            self.opts.first_bucket_bytes.min(cap),
            cap,
        );
        if layout
            == st
                .buckets
                .iter()
                .map(|b| b.params.clone())
                .collect::<Vec<_>>()
        {
            st.stats.rebuilt = true;
            return Ok(());
        }
        st.buckets = build_buckets(&mut st.params, &layout);
        st.powersgd.reset_buckets();
        st.in_flight = (0..st.buckets.len()).map(|_| None).collect();
        st.stats.buckets = st.buckets.len();
        st.stats.rebuilt = true;
        if self.opts.gradient_as_bucket_view {
            adopt_bucket_views(st).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// After its copy into the bucket, lets go of a copied member's `.grad` when it was None
/// before this pass (so autograd allocated it during this backward and nobody else holds
/// it); a copy of the average is written at the end of backward. Small gradients that stay
/// alive between the large ones allocated during backward fragment glibc's heap, which then
/// returns and re-faults large blocks every step (10-15% of a step in docs/PERFORMANCE.md).
fn release_fresh_grad(p: &mut Param) -> std::result::Result<(), String> {
    if p.grad_was_none && p.tensor.grad().defined() {
        set_grad(&p.tensor, None)?;
        p.released = true;
    }
    Ok(())
}

/// Copies parameter `index`'s gradient into its bucket slice (with
/// `gradient_as_bucket_view`, re-points `.grad` at the slice if autograd replaced it).
fn copy_grad_into_bucket(
    st: &mut State,
    index: usize,
    as_view: bool,
) -> std::result::Result<(), String> {
    let p = &st.params[index];
    let view = &st.buckets[p.bucket].views[p.slot];
    let grad = p.tensor.grad();
    tch::no_grad(|| -> std::result::Result<(), String> {
        if !grad.defined() {
            let _ = view.shallow_clone().zero_();
            return Ok(());
        }
        if as_view && grad.data_ptr() == view.data_ptr() {
            return Ok(());
        }
        view.shallow_clone().copy_(&grad);
        if as_view {
            set_grad(&p.tensor, Some(view))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_pytorch_assignment() {
        let f = |n: usize| (n, Kind::Float, Device::Cpu);
        // 4 bytes per element; first cap 1000 bytes, then 2000.
        let sizes = [
            f(100),
            f(200),
            f(300),
            f(400),
            (10, Kind::Double, Device::Cpu),
            f(50),
        ];
        let order: Vec<usize> = (0..sizes.len()).rev().collect(); // 5,4,3,2,1,0
        let b = assign_buckets(&sizes, &order, 1000, 2000);
        // float: 5 (200B) + 3 (1600B) -> closes the first (>=1000); 2 (1200B) + 1 (800B) -> 2000
        // closes; 0 stays open. double: 4 alone.
        assert_eq!(b, vec![vec![5, 3], vec![4], vec![2, 1], vec![0]]);
        // One bucket for all when the caps are huge (per dtype).
        let b = assign_buckets(&sizes, &order, usize::MAX, usize::MAX);
        assert_eq!(b, vec![vec![5, 3, 2, 1, 0], vec![4]]);
        // A tiny cap: one bucket per parameter.
        let b = assign_buckets(&sizes, &order, 1, 1);
        assert_eq!(
            b,
            vec![vec![5], vec![4], vec![3], vec![2], vec![1], vec![0]]
        );
    }
}
