//! Collectives on `tch::Tensor`, each blocking and async (a [`Work`] handle).
//!
//! Semantics follow `torch.distributed`: in-place on the given tensors, group-local ranks.
//! Non-contiguous tensors are accepted (the shim works on a contiguous copy and copies the
//! result back when the work completes). Every failure names the rank, the op and the cause.

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use tch::Tensor;
use tch_dist_core::trace;
use torch_sys::C_tensor;

use crate::c10d::departures::WATCH_SLICE;
use crate::c10d::group::ProcessGroup;
use crate::c10d::store::millis;
use crate::error::{ArgumentError, DistError, Result};
use crate::ffi::{self, FailureKind, ShimError};

/// The reduction of `all_reduce` and `reduce_scatter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Mean over ranks (integers: truncated).
    Avg,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Element-wise product.
    Product,
}

impl ReduceOp {
    fn code(self) -> i32 {
        match self {
            ReduceOp::Sum => ffi::TDR_REDUCE_SUM,
            ReduceOp::Avg => ffi::TDR_REDUCE_AVG,
            ReduceOp::Min => ffi::TDR_REDUCE_MIN,
            ReduceOp::Max => ffi::TDR_REDUCE_MAX,
            ReduceOp::Product => ffi::TDR_REDUCE_PRODUCT,
        }
    }
}

/// Who an operation failed for, to turn the shim's failure into the right [`DistError`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpContext {
    /// This process's rank in the group.
    pub rank: usize,
    /// The operation, named as in torch.distributed.
    pub op: &'static str,
    /// The peer whose loss would fail the operation, where there is exactly one (a group of
    /// two, a point-to-point transfer).
    pub peer: Option<usize>,
    /// The group's timeout (what a backend's own timeout reports).
    pub timeout: Duration,
    /// When the operation was about to be launched (a desync check that failed before the
    /// timeout failed because a connection closed).
    pub started: Instant,
}

impl OpContext {
    /// A failed launch or blocking call: a lost connection names the peer, anything else is
    /// the engine's error.
    pub fn failure(self, e: ShimError) -> DistError {
        match e.kind {
            FailureKind::Network => DistError::PeerGone {
                rank: self.rank,
                op: self.op,
                peer: self.peer,
                cause: e.message,
            },
            FailureKind::BackendTimeout => DistError::Timeout {
                rank: self.rank,
                op: self.op,
                timeout: self.timeout,
            },
            FailureKind::ShutDown => DistError::ShutDown {
                rank: self.rank,
                op: self.op,
            },
            FailureKind::Desync => {
                match crate::c10d::desync::parse(&e.message, self.timeout, self.started.elapsed()) {
                    Some(desync) => DistError::Desync {
                        rank: self.rank,
                        op: self.op,
                        desync: Box::new(desync),
                    },
                    None => DistError::Collective {
                        rank: self.rank,
                        op: self.op,
                        cause: e.message,
                    },
                }
            }
            FailureKind::Engine | FailureKind::Timeout => DistError::Collective {
                rank: self.rank,
                op: self.op,
                cause: e.message,
            },
        }
    }
}

/// An in-flight collective. Wait for it before reading its output tensors.
///
/// Dropping it without waiting lets the operation finish in the background, as dropping a
/// `torch.distributed` work object does.
///
/// How a wait waits depends on the backend, as in PyTorch:
///
/// - **Gloo** (CPU tensors): the CPU waits until the operation is done, at most until the
///   group's timeout has passed since the launch ([`Work::wait`]) or for the given time
///   ([`Work::wait_timeout`]).
/// - **NCCL** (CUDA tensors): [`Work::wait`] does not block the CPU. It makes the calling
///   thread's current CUDA stream wait for NCCL's stream (`WorkNCCL::wait` without a
///   timeout), so what that stream runs next sees the result, and anything that reads it on
///   the host (`.to(Cpu)`, `f64::try_from`) waits for it there. The bound is NCCL's
///   watchdog, which times the operation out once the group's timeout has passed since the
///   launch: a wait on that work then fails with the same [`DistError::Timeout`] (op, the
///   group's timeout) a Gloo wait gives, and the group's NCCL communicator is aborted, so
///   later NCCL operations on it fail. [`Work::wait_timeout`] blocks the CPU until the
///   operation is done, at most for the given time, and a timeout leaves the work pending, as
///   with Gloo.
pub struct Work {
    ptr: NonNull<ffi::TdrWork>,
    context: OpContext,
    /// The group's timeout, which also bounds the backend's own wait for its peers.
    timeout: Duration,
    launched: Instant,
    /// With `TCH_DIST_TRACE`: what the trace records of this operation once it is waited.
    traced: Option<Box<TracedOp>>,
    /// The group, whose departed members a long wait looks for (`departures.rs`).
    group: ProcessGroup,
}

/// A collective being traced: its async event's id, launch time and group.
struct TracedOp {
    id: u64,
    launched_us: f64,
    group: String,
}

// SAFETY: c10d work objects may be waited on from any thread; we never share one between
// threads without `&mut` (all methods but `is_completed` take `self` or `&mut self`).
unsafe impl Send for Work {}

impl Work {
    /// Waits for the operation: on the CPU until the group's timeout has passed since the
    /// launch (Gloo), or on the current CUDA stream with NCCL's watchdog as the bound (NCCL;
    /// see the type's docs).
    pub fn wait(mut self) -> Result<()> {
        let left = self.timeout.saturating_sub(self.launched.elapsed());
        self.wait_watched(left)
    }

    /// Waits up to `limit` for a blocking wait (Gloo's), in slices between which it looks
    /// for members of the group that left ([`DistError::PeerDeparted`] within seconds, where
    /// the wait would run to the group's timeout); NCCL's wait on its stream blocks nothing
    /// and is left as it is.
    fn wait_watched(&mut self, limit: Duration) -> Result<()> {
        if self.is_on_stream() {
            return self.wait_for(limit, self.timeout, false);
        }
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let last = left <= WATCH_SLICE;
            match self.wait_for(left.min(WATCH_SLICE), self.timeout, false) {
                Err(DistError::Timeout { .. }) if !last && !self.is_completed() => {
                    if let Some(departed) = self.group.watch(self.context.op) {
                        return Err(departed);
                    }
                }
                // A peer that reported its failure before it closed its connections is
                // named with what it reported.
                Err(gone @ DistError::PeerGone { .. }) => {
                    return Err(self.group.watch(self.context.op).unwrap_or(gone))
                }
                other => return other,
            }
        }
    }

    /// Waits on the CPU up to `timeout`; when it passes with the work still pending, the
    /// error is a [`DistError::Timeout`] and the work may be waited on again (Gloo and NCCL
    /// alike).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<()> {
        self.wait_for(timeout, timeout, true)
    }

    /// Waits up to `limit` (on the CPU when `cpu_bound` or on Gloo); a timeout of the wait
    /// itself is reported as `reported`.
    fn wait_for(&mut self, limit: Duration, reported: Duration, cpu_bound: bool) -> Result<()> {
        // c10d reads a zero timeout as "no timeout": wait at least a millisecond.
        let ms = millis(limit).max(1);
        let wait_start = self.traced.as_ref().map(|_| trace::now_us());
        // SAFETY: live work handle; exceptions are caught in the shim.
        let result = ffi::check(unsafe { ffi::tdr_work_wait(self.ptr.as_ptr(), ms, cpu_bound) });
        let OpContext { rank, op, .. } = self.context;
        if let Some(start) = wait_start {
            self.trace_waited(start, result.is_ok());
        }
        result.map_err(|e| match e.kind {
            // Our wait ended first.
            FailureKind::Timeout => DistError::Timeout {
                rank,
                op,
                timeout: reported,
            },
            // The backend's own wait for a peer ended (it started at the launch or later,
            // with the group's timeout): the same timeout, seen from inside.
            FailureKind::Network | FailureKind::Engine
                if self.launched.elapsed() >= self.timeout =>
            {
                DistError::Timeout {
                    rank,
                    op,
                    timeout: self.timeout,
                }
            }
            _ => self.context.failure(e),
        })
    }

    /// Records the wait (on this thread) and the operation from its launch to now (its own
    /// track); a wait that timed out is recorded, the operation only once it ended.
    fn trace_waited(&mut self, wait_start: f64, done: bool) {
        let end = trace::now_us();
        let op = self.context.op;
        trace::complete(&format!("wait {op}"), "wait", wait_start, end, &[]);
        if done && let Some(t) = self.traced.take() {
            let args = [
                ("group", t.group.clone()),
                ("end", "wait returned".to_string()),
            ];
            trace::collective(op, t.id, t.launched_us, end, &args);
        }
    }

    /// Whether the operation runs on a CUDA stream (NCCL), so that [`Work::wait`] orders the
    /// current stream after it instead of blocking the CPU.
    pub fn is_on_stream(&self) -> bool {
        // SAFETY: live work handle.
        unsafe { ffi::tdr_work_on_stream(self.ptr.as_ptr()) }
    }

    /// Whether the work has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        // SAFETY: live work handle.
        unsafe { ffi::tdr_work_is_completed(self.ptr.as_ptr()) }
    }

    /// The operation's name, as in torch.distributed.
    pub fn op(&self) -> &'static str {
        self.context.op
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: created by the shim, freed exactly once here.
        unsafe { ffi::tdr_work_free(self.ptr.as_ptr()) }
    }
}

fn raw(t: &Tensor) -> *mut C_tensor {
    t.as_ptr() as *mut C_tensor
}

impl ProcessGroup {
    /// The context of a collective of this group: in a group of two, the other rank is the
    /// one peer whose loss fails it.
    pub(crate) fn op_context(&self, op: &'static str) -> OpContext {
        OpContext {
            rank: self.rank(),
            op,
            peer: (self.world_size() == 2).then(|| 1 - self.rank()),
            timeout: self.timeout(),
            started: Instant::now(),
        }
    }

    fn launch(
        &self,
        context: OpContext,
        call: impl FnOnce(*mut ffi::TdrGroup, *mut *mut ffi::TdrWork) -> ffi::ShimStatus,
    ) -> Result<Work> {
        self.check_open(context.op)?;
        let mut out = std::ptr::null_mut();
        let launched = Instant::now();
        let traced = trace::enabled().then(|| {
            Box::new(TracedOp {
                id: trace::next_id(),
                launched_us: trace::now_us(),
                group: self.group_name().to_string(),
            })
        });
        ffi::check(call(self.raw(), &mut out)).map_err(|e| context.failure(e))?;
        let ptr = NonNull::new(out).ok_or(DistError::Internal {
            rank: context.rank,
            op: context.op,
            what: "the engine returned no work handle",
        })?;
        self.note_launch(context.op);
        Ok(Work {
            ptr,
            context,
            timeout: self.timeout(),
            launched,
            traced,
            group: self.clone(),
        })
    }

    pub(crate) fn check_rank(&self, op: &'static str, what: &'static str, r: usize) -> Result<()> {
        if r >= self.world_size() {
            return Err(DistError::InvalidArgument {
                rank: self.rank(),
                op,
                problem: Box::new(ArgumentError::RankNotInGroup {
                    what,
                    rank: r,
                    world_size: self.world_size(),
                }),
            });
        }
        Ok(())
    }

    /// Reduces `tensor` over all ranks, in place, asynchronously.
    pub fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        // SAFETY: live group and tensor; the shim keeps its own reference to the tensor.
        self.launch(self.op_context("all_reduce"), |g, out| unsafe {
            ffi::tdr_all_reduce(g, raw(tensor), op.code(), out)
        })
    }

    /// Reduces `tensor` over all ranks, in place.
    ///
    /// ```no_run
    /// # let pg = tch_dist_runtime::default_group()?;
    /// let t = tch::Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
    /// pg.all_reduce(&t, tch_dist_runtime::ReduceOp::Sum)?; // 1 + 2 + ... + world
    /// # Ok::<(), tch_dist_runtime::DistError>(())
    /// ```
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(tensor, op)?.wait()
    }

    /// Copies `tensor` from rank `src` to every rank, asynchronously.
    pub fn broadcast_async(&self, tensor: &Tensor, src: usize) -> Result<Work> {
        self.check_rank("broadcast", "source rank", src)?;
        // SAFETY: live group and tensor.
        self.launch(self.op_context("broadcast"), |g, out| unsafe {
            ffi::tdr_broadcast(g, raw(tensor), src as i32, out)
        })
    }

    /// Copies `tensor` from rank `src` to every rank.
    pub fn broadcast(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.broadcast_async(tensor, src)?.wait()
    }

    /// Gathers every rank's `input` into `outputs[rank]` (one tensor per rank), asynchronously.
    pub fn all_gather_async(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        let ptrs: Vec<*mut C_tensor> = outputs.iter().map(raw).collect();
        // SAFETY: live group and tensors; `ptrs` outlives the call.
        self.launch(self.op_context("all_gather"), |g, out| unsafe {
            ffi::tdr_all_gather(g, ptrs.as_ptr(), ptrs.len(), raw(input), out)
        })
    }

    /// Gathers every rank's `input` into `outputs[rank]`.
    pub fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<()> {
        self.all_gather_async(outputs, input)?.wait()
    }

    /// Gathers every rank's `input` into `output`, concatenated along dim 0, asynchronously.
    pub fn all_gather_into_tensor_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        // SAFETY: live group and tensors.
        self.launch(self.op_context("all_gather_into_tensor"), |g, out| unsafe {
            ffi::tdr_all_gather_flat(g, raw(output), raw(input), out)
        })
    }

    /// Gathers every rank's `input` into `output`, concatenated along dim 0.
    pub fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.all_gather_into_tensor_async(output, input)?.wait()
    }

    /// Reduces `inputs[r]` over all ranks into rank r's `output`, asynchronously.
    pub fn reduce_scatter_async(
        &self,
        output: &Tensor,
        inputs: &[Tensor],
        op: ReduceOp,
    ) -> Result<Work> {
        let ptrs: Vec<*mut C_tensor> = inputs.iter().map(raw).collect();
        // SAFETY: live group and tensors; `ptrs` outlives the call.
        self.launch(self.op_context("reduce_scatter"), |g, out| unsafe {
            ffi::tdr_reduce_scatter(g, raw(output), ptrs.as_ptr(), ptrs.len(), op.code(), out)
        })
    }

    /// Reduces `inputs[r]` over all ranks into rank r's `output`.
    pub fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_async(output, inputs, op)?.wait()
    }

    /// Reduces `input` over all ranks and leaves rank r the r-th chunk (dim 0), asynchronously.
    pub fn reduce_scatter_tensor_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Work> {
        // SAFETY: live group and tensors.
        self.launch(self.op_context("reduce_scatter_tensor"), |g, out| unsafe {
            ffi::tdr_reduce_scatter_flat(g, raw(output), raw(input), op.code(), out)
        })
    }

    /// Reduces `input` over all ranks and leaves rank r the r-th chunk (dim 0).
    pub fn reduce_scatter_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_tensor_async(output, input, op)?.wait()
    }

    /// Splits `input` into world_size equal chunks along dim 0 and sends chunk j to rank j;
    /// `output`'s chunk i receives rank i's chunk for this rank. Asynchronous.
    pub fn all_to_all_single_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        // SAFETY: live group and tensors.
        self.launch(self.op_context("all_to_all"), |g, out| unsafe {
            ffi::tdr_all_to_all(g, raw(output), raw(input), out)
        })
    }

    /// Splits `input` into equal chunks along dim 0 and exchanges them (see the async form).
    pub fn all_to_all_single(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.all_to_all_single_async(output, input)?.wait()
    }

    /// Sends `tensor` to rank `dst` (matched by a `recv` with the same tag), asynchronously.
    pub fn send_async(&self, tensor: &Tensor, dst: usize, tag: i32) -> Result<Work> {
        self.check_peer("send", dst)?;
        // SAFETY: live group and tensor.
        let context = OpContext {
            peer: Some(dst),
            ..self.op_context("send")
        };
        self.launch(context, |g, out| unsafe {
            ffi::tdr_send(g, raw(tensor), dst as i32, tag, out)
        })
    }

    /// Sends `tensor` to rank `dst`.
    pub fn send(&self, tensor: &Tensor, dst: usize, tag: i32) -> Result<()> {
        self.send_async(tensor, dst, tag)?.wait()
    }

    /// Receives into `tensor` from rank `src`, asynchronously.
    pub fn recv_async(&self, tensor: &Tensor, src: usize, tag: i32) -> Result<Work> {
        self.check_peer("recv", src)?;
        // SAFETY: live group and tensor.
        let context = OpContext {
            peer: Some(src),
            ..self.op_context("recv")
        };
        self.launch(context, |g, out| unsafe {
            ffi::tdr_recv(g, raw(tensor), src as i32, tag, out)
        })
    }

    /// Receives into `tensor` from rank `src`.
    pub fn recv(&self, tensor: &Tensor, src: usize, tag: i32) -> Result<()> {
        self.recv_async(tensor, src, tag)?.wait()
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        self.check_rank(op, "peer rank", peer)?;
        if peer == self.rank() {
            return Err(DistError::InvalidArgument {
                rank: self.rank(),
                op,
                problem: Box::new(ArgumentError::SelfPeer),
            });
        }
        Ok(())
    }

    /// Waits until every rank has reached the barrier, asynchronously.
    pub fn barrier_async(&self) -> Result<Work> {
        // SAFETY: live group.
        self.launch(self.op_context("barrier"), |g, out| unsafe {
            ffi::tdr_barrier(g, out)
        })
    }

    /// Waits until every rank has reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.barrier_async()?.wait()
    }

    /// A barrier that, when ranks fail to arrive within `timeout`, says which ones
    /// (rank 0 checks in every other rank; with `wait_all_ranks` it lists all missing ranks
    /// rather than the first).
    pub fn monitored_barrier(&self, timeout: Duration, wait_all_ranks: bool) -> Result<()> {
        const OP: &str = "monitored_barrier";
        self.check_open(OP)?;
        // SAFETY: live group; blocking call bounded by `timeout` inside Gloo.
        ffi::check(unsafe {
            ffi::tdr_monitored_barrier(self.raw(), millis(timeout), wait_all_ranks)
        })
        .map_err(|e| match e.kind {
            FailureKind::ShutDown => DistError::ShutDown {
                rank: self.rank(),
                op: OP,
            },
            _ => DistError::Collective {
                rank: self.rank(),
                op: OP,
                cause: e.message,
            },
        })
    }
}
