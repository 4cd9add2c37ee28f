//! The `extern "C"` surface of csrc/*.cpp, mirrored from its contract csrc/shim.h, and the
//! one place its errors become Rust values.
//!
//! Every fallible shim function returns a `char*`: null on success, else a malloc'ed message,
//! declared here as a [`ShimStatus`] that [`check`] turns into a `Result` (copying the
//! message into a `String` and freeing it). A call site writes the `unsafe` itself,
//! `ffi::check(unsafe { ffi::tdr_x(args) })`, with a `// SAFETY:` comment saying why the call
//! is sound, so the compiler sees every unsafe place. `tests::header_and_bindings_agree`
//! reads shim.h and fails when a prototype or an enum code here differs from it;
//! `tests::unsafe_files_are_listed` fails when docs/ARCHITECTURE.md's list of the files
//! with `unsafe` code differs from the tree.
//!
//! The shim's files, `runtime/csrc/` (`docs/check_tables.py` checks that this table names every
//! one of them, and nothing else):
//!
//! | file | what it does | what it wraps (c10d / ATen / autograd) |
//! |---|---|---|
//! | `shim.h` | the contract: prototypes, opaque handles, enums, the boundary's rules | (mirrored by `runtime/src/ffi.rs`) |
//! | `internal.h` | `TDR_TRY`/`TDR_CATCH`, the error-kind thread-local's declaration, the handles' definitions (`TdrStore`, `TdrGroup` and its `Backends`, `TdrWork`), routing (`Route`), DETAIL's `Call` and `checked` | `c10::Error`, `c10d::Backend`, `c10d::Store`, `c10d::Work` |
//! | `errors.cpp` | the kind of the thread's last failure (`tdr_last_error_kind`), messages for Rust (`tdr_string_free`), backtrace-free logging | `c10::Error::what_without_backtrace`, `c10::SetStackTraceFetcher` |
//! | `store.cpp` | `tdr_store_*`: a TCP store, prefixes, set/get/add/compare-set/check, the workers' check-in | `c10d::TCPStore` (`waitForWorkers`), `c10d::PrefixStore` |
//! | `devices.cpp` | `tdr_cuda_set_device`, `tdr_cuda_device_uuid` (refused without CUDA) | `c10::cuda::set_device`, `at::cuda::getDeviceProperties` |
//! | `group.cpp` | `tdr_group_*`: a group's Gloo and NCCL backends over prefixed stores, Gloo's devices, eager connect, foreign peers, shutdown | `c10d::ProcessGroupGloo`, `c10d::ProcessGroupNCCL`, as `_new_process_group_helper` makes them |
//! | `detail.cpp` | `TCH_DIST_DEBUG=DETAIL`: the broadcast root check (`RootCheck`), the desync report's calls (`encode_call`, `gather_calls`) | `c10d::ProcessGroupWrapper` (`TORCH_DISTRIBUTED_DEBUG=DETAIL`) |
//! | `collectives.cpp` | routing a tensor to a backend, the collectives and point-to-point ops, staging through host memory, `tdr_work_*` | `c10d::Backend`'s collectives, `c10d::Work::wait` |
//! | `autograd_hooks.cpp` | gradient-ready hooks, end-of-backward callbacks, `tdr_set_grad` (the reducer's triggers) | `AccumulateGrad` post hooks, `Engine::queue_callback` |
//! | `checkpoint.cpp` | activation checkpointing's custom function (the reentrant style: its forward keeps only the inputs, its backward runs the forward again and differentiates it) and the tensor lists that carry a forward's outputs (`tdr_tensor_list_*`) | `torch::autograd::Function`, `torch::autograd::grad` |
//! | `function.cpp` | custom autograd functions whose forward and backward are Rust callbacks (`tdr_function_apply`; ring attention's) | `torch::autograd::Function` |
//! | `fsdp.cpp` | gradient interceptors, output-gradient hooks, storage release and restore, `set_data` keeping the accumulator, a tensor's version and identity (fully_shard's) | `AccumulateGrad` pre hooks, `Tensor::register_hook`, `c10::StorageImpl`, `TensorImpl::shallow_copy_from` |
//! | `use_guard.cpp` | use guards: claim markers and the check once per graph task | autograd `Node` pre hooks, `get_current_graph_task_nodes_in_graph` |
//! | `fence.cpp` | shard fences: a boxed fallback on the `DeferredInit` key (`runtime/src/autograd/shard_fence.rs`) | `c10::Dispatcher`, `torch::Library::fallback` |
//! | `parallel.cpp` | `tdr_parallel_op`: the differentiable tensor-parallel collectives | a custom `torch::autograd::Node` (Megatron's conjugate pairs) |
//! | `kernels.cpp` | `tdr_randperm` (DistributedSampler's shuffle), `tdr_fused_adamw`, `tdr_fused_sgd` | `at::randperm` with a seeded `CPUGeneratorImpl`, `at::_fused_adamw_`, `at::_fused_sgd_` |
//! | `split_backward.cpp` | pipelining's split backward: the input pass (`tdr_backward_input`), then the weight pass (`tdr_backward_weight`) | `torch::autograd::grad`, autograd `Node` pre hooks, `Engine::execute` |

use std::ffi::{c_char, c_int, CStr};

use torch_sys::C_tensor;

/// Opaque c10d store (`TCPStore` or `PrefixStore`) owned by the shim.
#[repr(C)]
pub struct TdrStore {
    _private: [u8; 0],
}

/// Opaque process group: a Gloo backend, optionally an NCCL backend, a bound CUDA device.
#[repr(C)]
pub struct TdrGroup {
    _private: [u8; 0],
}

/// Opaque in-flight collective.
#[repr(C)]
pub struct TdrWork {
    _private: [u8; 0],
}

/// Opaque registration of a gradient-accumulator post hook.
#[repr(C)]
pub struct TdrHook {
    _private: [u8; 0],
}

/// Opaque use guard over one module's parameters.
#[repr(C)]
pub struct TdrGuard {
    _private: [u8; 0],
}

/// Opaque shard fence over one module's parameters.
#[repr(C)]
pub struct TdrFence {
    _private: [u8; 0],
}

/// Opaque list of tensors handed between the shim and Rust (activation checkpointing).
#[repr(C)]
pub struct TdrTensorList {
    _private: [u8; 0],
}

/// Opaque state of a split backward between its input pass and its weight pass (pipelining).
#[repr(C)]
pub struct TdrSplitBackward {
    _private: [u8; 0],
}

/// Opaque registration of a gradient interceptor (fully_shard).
#[repr(C)]
pub struct TdrInterceptor {
    _private: [u8; 0],
}

// `enum TdrErrorKind` (what `tdr_last_error_kind` reports about the last failure; the first
// two are named for the contract check, `take_error` reads anything else as an engine error).
#[allow(dead_code)]
pub const TDR_ERROR_NONE: c_int = 0;
#[allow(dead_code)]
pub const TDR_ERROR_ENGINE: c_int = 1;
pub const TDR_ERROR_NETWORK: c_int = 2;
pub const TDR_ERROR_TIMEOUT: c_int = 3;
pub const TDR_ERROR_BACKEND_TIMEOUT: c_int = 4;
pub const TDR_ERROR_SHUT_DOWN: c_int = 5;
pub const TDR_ERROR_DESYNC: c_int = 6;

// `enum TdrReduceOp` (the reductions of all_reduce and reduce_scatter).
pub const TDR_REDUCE_SUM: c_int = 0;
pub const TDR_REDUCE_AVG: c_int = 1;
pub const TDR_REDUCE_MIN: c_int = 2;
pub const TDR_REDUCE_MAX: c_int = 3;
pub const TDR_REDUCE_PRODUCT: c_int = 4;

// `enum TdrParallelMode` (the differentiable collectives of `tdr_parallel_op`).
pub const TDR_PARALLEL_REDUCE: c_int = 0;
pub const TDR_PARALLEL_COPY: c_int = 1;
pub const TDR_PARALLEL_GATHER: c_int = 2;
pub const TDR_PARALLEL_SPLIT: c_int = 3;
pub const TDR_PARALLEL_REDUCE_SCATTER: c_int = 4;
pub const TDR_PARALLEL_ALL_TO_ALL: c_int = 5;

/// A callback the shim calls from libtorch's autograd threads with an opaque context; it
/// returns null or a malloc'ed error message (which fails the backward pass).
pub type TdrCallback =
    unsafe extern "C" fn(ctx: *mut std::ffi::c_void, index: usize) -> *mut c_char;

/// The same, with a tensor the shim lends for the duration of the call (a gradient).
pub type TdrGradCallback = unsafe extern "C" fn(
    ctx: *mut std::ffi::c_void,
    index: usize,
    grad: *mut C_tensor,
) -> *mut c_char;

/// Releases a context the shim shared among hooks, once the last of them is gone.
pub type TdrRelease = unsafe extern "C" fn(ctx: *mut std::ffi::c_void);

/// Turns a failure the shim caught on this thread (`message`, malloc'ed, taken and freed;
/// `tdr_last_error_kind` its kind) into the malloc'ed text a backward pass fails with.
pub type TdrDescribe =
    unsafe extern "C" fn(ctx: *mut std::ffi::c_void, message: *mut c_char) -> *mut c_char;

/// A module's forward the shim runs (activation checkpointing): `n` input tensors lent for
/// the call; the outputs pushed onto `out` with [`tdr_tensor_list_push`]; null or a
/// malloc'ed message.
pub type TdrForwardCallback = unsafe extern "C" fn(
    ctx: *mut std::ffi::c_void,
    inputs: *mut *mut C_tensor,
    n: usize,
    out: *mut TdrTensorList,
) -> *mut c_char;

unsafe extern "C" {
    pub fn tdr_string_free(s: *mut c_char);
    pub fn tdr_last_error_kind() -> c_int;
    pub fn tdr_bytes_free(data: *mut u8);

    pub fn tdr_store_tcp(
        host: *const c_char,
        port: u16,
        is_server: bool,
        listen_fd: c_int,
        world_size: c_int,
        connect_timeout_ms: i64,
        timeout_ms: i64,
        out: *mut *mut TdrStore,
    ) -> ShimStatus;
    pub fn tdr_store_check_in(s: *mut TdrStore, timeout_ms: i64) -> ShimStatus;
    pub fn tdr_store_prefix(
        base: *mut TdrStore,
        prefix: *const c_char,
        out: *mut *mut TdrStore,
    ) -> ShimStatus;
    pub fn tdr_store_set(
        s: *mut TdrStore,
        key: *const c_char,
        data: *const u8,
        len: usize,
    ) -> ShimStatus;
    pub fn tdr_store_get(
        s: *mut TdrStore,
        key: *const c_char,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> ShimStatus;
    pub fn tdr_store_add(
        s: *mut TdrStore,
        key: *const c_char,
        delta: i64,
        out: *mut i64,
    ) -> ShimStatus;
    pub fn tdr_store_compare_set(
        s: *mut TdrStore,
        key: *const c_char,
        expected: *const u8,
        expected_len: usize,
        desired: *const u8,
        desired_len: usize,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> ShimStatus;
    pub fn tdr_store_check(s: *mut TdrStore, key: *const c_char, out: *mut bool) -> ShimStatus;
    pub fn tdr_store_free(s: *mut TdrStore);

    pub fn tdr_cuda_set_device(device: c_int) -> ShimStatus;
    pub fn tdr_cuda_device_uuid(device: c_int, out: *mut *mut c_char) -> ShimStatus;

    pub fn tdr_nccl_compiled() -> bool;
    pub fn tdr_group_new(
        store: *mut TdrStore,
        group_name: *const c_char,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        rendezvous_ms: i64,
        gloo_host: *const c_char,
        with_gloo: bool,
        with_nccl: bool,
        device: c_int,
        cuda_via_gloo: bool,
        detail: bool,
        store_as_given: bool,
        out: *mut *mut TdrGroup,
    ) -> ShimStatus;
    pub fn tdr_group_connect(g: *mut TdrGroup) -> ShimStatus;
    pub fn tdr_group_set_foreign_peers(g: *mut TdrGroup, foreign: bool) -> ShimStatus;
    pub fn tdr_gloo_lazy_init(out: *mut bool) -> ShimStatus;
    pub fn tdr_group_shutdown(g: *mut TdrGroup) -> ShimStatus;
    pub fn tdr_group_free(g: *mut TdrGroup);

    pub fn tdr_all_reduce(
        g: *mut TdrGroup,
        t: *mut C_tensor,
        op: c_int,
        out: *mut *mut TdrWork,
    ) -> ShimStatus;
    pub fn tdr_broadcast(
        g: *mut TdrGroup,
        t: *mut C_tensor,
        root: c_int,
        out: *mut *mut TdrWork,
    ) -> ShimStatus;
    pub fn tdr_all_gather(
        g: *mut TdrGroup,
        outputs: *const *mut C_tensor,
        n: usize,
        input: *mut C_tensor,
        out: *mut *mut TdrWork,
    ) -> ShimStatus;
    pub fn tdr_all_gather_flat(
        g: *mut TdrGroup,
        output: *mut C_tensor,
        input: *mut C_tensor,
        out: *mut *mut TdrWork,
    ) -> ShimStatus;
    pub fn tdr_reduce_scatter(
        g: *mut TdrGroup,
        output: *mut C_tensor,
        inputs: *const *mut C_tensor,
        n: usize,
        op: c_int,
        out: *mut *mut TdrWork,
    ) -> ShimStatus;
    pub fn tdr_reduce_scatter_flat(
        g: *mut TdrGroup,
        output: *mut C_tensor,
        input: *mut C_tensor,
        op: c_int,
        out: *mut *mut TdrWork,
    ) -> ShimStatus;
    pub fn tdr_all_to_all(
        g: *mut TdrGroup,
        output: *mut C_tensor,
        input: *mut C_tensor,
        out: *mut *mut TdrWork,
    ) -> ShimStatus;
    pub fn tdr_send(
        g: *mut TdrGroup,
        t: *mut C_tensor,
        dst: c_int,
        tag: c_int,
        out: *mut *mut TdrWork,
    ) -> ShimStatus;
    pub fn tdr_recv(
        g: *mut TdrGroup,
        t: *mut C_tensor,
        src: c_int,
        tag: c_int,
        out: *mut *mut TdrWork,
    ) -> ShimStatus;
    pub fn tdr_barrier(g: *mut TdrGroup, out: *mut *mut TdrWork) -> ShimStatus;
    pub fn tdr_monitored_barrier(
        g: *mut TdrGroup,
        timeout_ms: i64,
        wait_all_ranks: bool,
    ) -> ShimStatus;

    pub fn tdr_work_wait(w: *mut TdrWork, timeout_ms: i64, cpu_bound: bool) -> ShimStatus;
    pub fn tdr_work_on_stream(w: *mut TdrWork) -> bool;
    pub fn tdr_work_is_completed(w: *mut TdrWork) -> bool;
    pub fn tdr_work_free(w: *mut TdrWork);

    pub fn tdr_add_grad_ready_hook(
        param: *mut C_tensor,
        cb: TdrCallback,
        ctx: *mut std::ffi::c_void,
        index: usize,
        out: *mut *mut TdrHook,
    ) -> ShimStatus;
    pub fn tdr_hook_remove(h: *mut TdrHook);
    pub fn tdr_queue_end_of_backward(
        cb: TdrCallback,
        ctx: *mut std::ffi::c_void,
        index: usize,
    ) -> ShimStatus;
    pub fn tdr_in_backward() -> bool;
    pub fn tdr_set_grad(param: *mut C_tensor, grad: *mut C_tensor) -> ShimStatus;

    pub fn tdr_add_grad_interceptor(
        param: *mut C_tensor,
        cb: TdrGradCallback,
        ctx: *mut std::ffi::c_void,
        release: TdrRelease,
        index: usize,
        out: *mut *mut TdrInterceptor,
    ) -> ShimStatus;
    pub fn tdr_interceptor_remove(h: *mut TdrInterceptor);
    pub fn tdr_add_output_grad_hook(
        output: *mut C_tensor,
        cb: TdrGradCallback,
        ctx: *mut std::ffi::c_void,
        release: TdrRelease,
        index: usize,
    ) -> ShimStatus;
    pub fn tdr_storage_release(t: *mut C_tensor) -> ShimStatus;
    pub fn tdr_storage_restore(t: *mut C_tensor) -> ShimStatus;
    pub fn tdr_storage_nbytes(t: *mut C_tensor) -> usize;
    pub fn tdr_set_data_keep_accumulator(param: *mut C_tensor, data: *mut C_tensor) -> ShimStatus;
    pub fn tdr_tensor_identity(t: *mut C_tensor) -> u64;
    pub fn tdr_tensor_use_count(t: *mut C_tensor) -> usize;
    pub fn tdr_tensor_version(t: *mut C_tensor) -> u64;

    pub fn tdr_tensor_list_push(list: *mut TdrTensorList, t: *mut C_tensor) -> ShimStatus;
    pub fn tdr_tensor_list_len(list: *mut TdrTensorList) -> usize;
    pub fn tdr_tensor_list_take(list: *mut TdrTensorList, index: usize) -> *mut C_tensor;
    pub fn tdr_tensor_list_free(list: *mut TdrTensorList);
    pub fn tdr_checkpoint_apply(
        inputs: *mut *mut C_tensor,
        num_inputs: usize,
        params: *mut *mut C_tensor,
        num_params: usize,
        buffers: *mut *mut C_tensor,
        num_buffers: usize,
        preserve_rng: bool,
        first: TdrForwardCallback,
        first_ctx: *mut std::ffi::c_void,
        again: TdrForwardCallback,
        again_ctx: *mut std::ffi::c_void,
        release: TdrRelease,
        out: *mut *mut TdrTensorList,
    ) -> ShimStatus;

    pub fn tdr_function_apply(
        inputs: *mut *mut C_tensor,
        num_inputs: usize,
        forward: TdrForwardCallback,
        forward_ctx: *mut std::ffi::c_void,
        backward: TdrForwardCallback,
        backward_ctx: *mut std::ffi::c_void,
        release: TdrRelease,
        out: *mut *mut TdrTensorList,
    ) -> ShimStatus;

    pub fn tdr_backward_input(
        roots: *mut *mut C_tensor,
        grads: *mut *mut C_tensor,
        n: usize,
        input: *mut C_tensor,
        may_split: bool,
        input_grad: *mut *mut C_tensor,
        out: *mut *mut TdrSplitBackward,
    ) -> ShimStatus;
    pub fn tdr_backward_weight(s: *mut TdrSplitBackward) -> ShimStatus;
    pub fn tdr_split_backward_free(s: *mut TdrSplitBackward);

    pub fn tdr_autograd_mark() -> u64;
    pub fn tdr_guard_new(
        params: *mut *mut C_tensor,
        n: usize,
        cb: TdrCallback,
        ctx: *mut std::ffi::c_void,
        out: *mut *mut TdrGuard,
    ) -> ShimStatus;
    pub fn tdr_guard_claim(g: *mut TdrGuard, output: *mut C_tensor, mark: u64) -> ShimStatus;
    pub fn tdr_guard_first_unclaimed(
        guards: *mut *mut TdrGuard,
        n: usize,
        output: *mut C_tensor,
        mark: u64,
        guard: *mut usize,
        index: *mut usize,
    ) -> ShimStatus;
    pub fn tdr_guard_free(g: *mut TdrGuard);

    pub fn tdr_fence_new(
        params: *mut *mut C_tensor,
        n: usize,
        cb: TdrCallback,
        ctx: *mut std::ffi::c_void,
        out: *mut *mut TdrFence,
    ) -> ShimStatus;
    pub fn tdr_fence_set_armed(f: *mut TdrFence, index: usize, armed: bool) -> ShimStatus;
    pub fn tdr_fence_free(f: *mut TdrFence);
    pub fn tdr_fence_check_enter();
    pub fn tdr_fence_check_exit();
    pub fn tdr_fence_open(f: *mut TdrFence);
    pub fn tdr_fence_close(f: *mut TdrFence);
    pub fn tdr_fence_reset_thread();
    pub fn tdr_fence_suspend(suspended: bool) -> bool;

    pub fn tdr_parallel_op(
        g: *mut TdrGroup,
        input: *mut C_tensor,
        mode: c_int,
        dim: i64,
        sizes: *const i64,
        n: usize,
        before: TdrCallback,
        describe: TdrDescribe,
        ctx: *mut std::ffi::c_void,
        release: TdrRelease,
        out: *mut *mut C_tensor,
    ) -> ShimStatus;

    pub fn tdr_randperm(n: i64, seed: u64, out: *mut *mut C_tensor) -> ShimStatus;

    pub fn tdr_fused_adamw(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        max_exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        amsgrad: bool,
        maximize: bool,
    ) -> ShimStatus;
    pub fn tdr_fused_sgd(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        momentum_buffers: *const *mut C_tensor,
        n: usize,
        weight_decay: f64,
        momentum: f64,
        lr: f64,
        dampening: f64,
        nesterov: bool,
        maximize: bool,
        is_first_step: bool,
    ) -> ShimStatus;
}

/// What a fallible shim entry point returns: null on success, else a malloc'ed message
/// (with its kind in `tdr_last_error_kind`) that [`check`] takes and frees.
///
/// Only the declarations above make one (the field is private), so a `ShimStatus` always
/// holds what the shim returned, and [`check`] can be safe: the `unsafe` of a shim call is
/// the call itself, written at the call site.
#[must_use = "a shim call's status must go through ffi::check, which frees its message"]
#[repr(transparent)]
pub struct ShimStatus(*mut c_char);

/// Turns what a fallible shim call returned into `Result<(), ShimError>`, freeing the
/// message: the one error check of every call into the shim, written
/// `ffi::check(unsafe { ffi::tdr_x(args) })` with the caller's `// SAFETY:` comment above
/// (why the arguments are valid: live handles and tensors, valid out-pointers).
pub fn check(status: ShimStatus) -> Result<(), ShimError> {
    // SAFETY: a `ShimStatus` only comes from a shim entry point that just returned on this
    // thread: null, or a message not yet freed, which `take_error` frees once.
    unsafe { take_error(status.0) }
}

/// The failure a shim error check made on this thread (a callback handed its `message`): its
/// text and kind, the message freed.
///
/// # Safety
/// `message` must be a non-null message from the shim's error check that ran last on this
/// thread, not yet freed.
pub unsafe fn take_failure(message: *mut c_char) -> ShimError {
    // SAFETY: the caller's promise.
    match unsafe { take_error(message) } {
        Err(e) => e,
        Ok(()) => ShimError {
            message: "an engine failure without a message".into(),
            kind: FailureKind::Engine,
        },
    }
}

/// Copies `msg` into a malloc'ed C string the shim frees (for callback errors).
pub fn malloc_message(msg: &str) -> *mut c_char {
    let bytes = msg.as_bytes();
    // SAFETY: malloc of len+1 bytes, filled and NUL-terminated below; null-checked.
    unsafe {
        let p = libc::malloc(bytes.len() + 1) as *mut u8;
        if p.is_null() {
            return std::ptr::null_mut();
        }
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
        *p.add(bytes.len()) = 0;
        p as *mut c_char
    }
}

/// What kind of failure a shim call reported (`enum TdrErrorKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Any engine error.
    Engine,
    /// A lost connection: a peer exited, crashed, or its side timed out.
    Network,
    /// A wait ended with the work still pending.
    Timeout,
    /// The backend's own timeout passed (NCCL's watchdog, or a blocking NCCL wait).
    BackendTimeout,
    /// The group was shut down.
    ShutDown,
    /// With `TCH_DIST_DEBUG=DETAIL`: c10d's ProcessGroupWrapper found that the ranks'
    /// collectives differ, or its monitored barrier failed.
    Desync,
}

/// A failed shim call: what the engine said and what kind of failure it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimError {
    /// The engine's message (without C++ backtrace).
    pub message: String,
    /// Its kind.
    pub kind: FailureKind,
}

impl From<ShimError> for String {
    fn from(e: ShimError) -> String {
        e.message
    }
}

/// Turns a shim return value into a `Result`, freeing the message.
///
/// # Safety
/// `err` must be null or a message returned by the shim function called last on this
/// thread, not yet freed.
unsafe fn take_error(err: *mut c_char) -> Result<(), ShimError> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: the kind belongs to the call that just returned on this thread.
    let kind = match unsafe { tdr_last_error_kind() } {
        TDR_ERROR_NETWORK => FailureKind::Network,
        TDR_ERROR_TIMEOUT => FailureKind::Timeout,
        TDR_ERROR_BACKEND_TIMEOUT => FailureKind::BackendTimeout,
        TDR_ERROR_SHUT_DOWN => FailureKind::ShutDown,
        TDR_ERROR_DESYNC => FailureKind::Desync,
        _ => FailureKind::Engine,
    };
    // SAFETY: the shim returns NUL-terminated malloc'ed strings; we free it exactly once.
    let message = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    unsafe { tdr_string_free(err) };
    Err(ShimError { message, kind })
}

#[cfg(test)]
mod tests {
    //! The contract check: shim.h and the declarations above must agree on every prototype
    //! (name, parameter types, return type) and every enum code; and the list of files with
    //! `unsafe` code in docs/ARCHITECTURE.md is the tree's.

    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    use crate::rules::{code_only, rust_files};

    const HEADER: &str = include_str!("../csrc/shim.h");
    const BINDINGS: &str = include_str!("ffi.rs");

    /// A type as both languages spell it, reduced to its base name and pointer depth
    /// (constness is not compared: Rust's `*const`/`*mut` and C's `const` differ in where
    /// they may appear, not in layout).
    fn c_type(t: &str) -> (String, usize) {
        let t = t.replace("const ", "");
        let depth = t.matches('*').count();
        let base = t.replace('*', "").trim().to_string();
        let base = match base.as_str() {
            "int" => "c_int",
            "int64_t" => "i64",
            "double" => "f64",
            "uint64_t" => "u64",
            "uint16_t" => "u16",
            "uint8_t" => "u8",
            "size_t" => "usize",
            "bool" => "bool",
            "char" => "c_char",
            "void" => "c_void",
            "TdrTensor" => "C_tensor",
            other => other,
        };
        (base.to_string(), depth)
    }

    fn rust_type(t: &str) -> (String, usize) {
        let mut t = t.trim();
        let mut depth = 0;
        while let Some(rest) = t
            .strip_prefix("*mut ")
            .or_else(|| t.strip_prefix("*const "))
        {
            depth += 1;
            t = rest.trim();
        }
        let base = t.rsplit("::").next().unwrap_or(t);
        if base == "ShimStatus" {
            // The owned `char*` of a fallible entry point.
            return ("c_char".to_string(), depth + 1);
        }
        (base.to_string(), depth)
    }

    type Signature = (Vec<(String, usize)>, (String, usize));

    /// `name -> (parameter types, return type)` of every `tdr_*` prototype in shim.h.
    fn header_prototypes() -> BTreeMap<String, Signature> {
        let code: String = HEADER
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join(" ");
        let mut out = BTreeMap::new();
        for decl in code.split(';') {
            let decl = decl.split_whitespace().collect::<Vec<_>>().join(" ");
            let Some(open) = decl.find("tdr_") else {
                continue;
            };
            if decl.contains("typedef") || !decl.ends_with(')') {
                continue;
            }
            let head = &decl[..open];
            let rest = &decl[open..];
            let (name, params) = rest.split_once('(').expect("a prototype has parameters");
            let params = params.trim_end_matches(')');
            let ret = head.rsplit(['{', '}']).next().unwrap_or(head);
            let types = params
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty() && *p != "void")
                .map(|p| {
                    let cut = p.rfind([' ', '*']).expect("a named parameter");
                    c_type(&p[..=cut])
                })
                .collect();
            out.insert(name.trim().to_string(), (types, c_type(ret)));
        }
        out
    }

    /// The same for the `extern "C"` block above.
    fn binding_prototypes() -> BTreeMap<String, Signature> {
        let block = BINDINGS
            .split("extern \"C\" {")
            .nth(1)
            .and_then(|b| b.split("\n}\n").next())
            .expect("ffi.rs has an extern block");
        let code = block.split_whitespace().collect::<Vec<_>>().join(" ");
        let mut out = BTreeMap::new();
        for decl in code.split(';') {
            let Some(start) = decl.find("pub fn ") else {
                continue;
            };
            let decl = &decl[start + "pub fn ".len()..];
            let (name, rest) = decl.split_once('(').expect("a declaration has parameters");
            let (params, ret) = rest.rsplit_once(')').expect("closed parameter list");
            let types = params
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| rust_type(p.split_once(':').expect("name: type").1))
                .collect();
            let ret = match ret.trim().strip_prefix("->") {
                Some(r) => rust_type(r),
                None => ("c_void".to_string(), 0),
            };
            out.insert(name.trim().to_string(), (types, ret));
        }
        out
    }

    #[test]
    fn header_and_bindings_agree() {
        let header = header_prototypes();
        let bindings = binding_prototypes();
        assert!(
            header.len() >= 30,
            "parsed only {} prototypes",
            header.len()
        );
        let names = |m: &BTreeMap<String, Signature>| m.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&header), names(&bindings), "the same entry points");
        for (name, sig) in &header {
            assert_eq!(Some(sig), bindings.get(name), "prototype of {name}");
        }
        let codes: BTreeMap<&str, i32> = HEADER
            .lines()
            .filter_map(|l| {
                let code = l.split("//").next()?.trim().trim_end_matches(',');
                let (name, value) = code.split_once(" = ")?;
                Some((
                    name.strip_prefix("TDR_").map(|_| name)?,
                    value.parse().ok()?,
                ))
            })
            .collect();
        let rust = [
            ("TDR_ERROR_NONE", super::TDR_ERROR_NONE),
            ("TDR_ERROR_ENGINE", super::TDR_ERROR_ENGINE),
            ("TDR_ERROR_NETWORK", super::TDR_ERROR_NETWORK),
            ("TDR_ERROR_TIMEOUT", super::TDR_ERROR_TIMEOUT),
            (
                "TDR_ERROR_BACKEND_TIMEOUT",
                super::TDR_ERROR_BACKEND_TIMEOUT,
            ),
            ("TDR_ERROR_SHUT_DOWN", super::TDR_ERROR_SHUT_DOWN),
            ("TDR_ERROR_DESYNC", super::TDR_ERROR_DESYNC),
            ("TDR_REDUCE_SUM", super::TDR_REDUCE_SUM),
            ("TDR_REDUCE_AVG", super::TDR_REDUCE_AVG),
            ("TDR_REDUCE_MIN", super::TDR_REDUCE_MIN),
            ("TDR_REDUCE_MAX", super::TDR_REDUCE_MAX),
            ("TDR_REDUCE_PRODUCT", super::TDR_REDUCE_PRODUCT),
            ("TDR_PARALLEL_REDUCE", super::TDR_PARALLEL_REDUCE),
            ("TDR_PARALLEL_COPY", super::TDR_PARALLEL_COPY),
            ("TDR_PARALLEL_GATHER", super::TDR_PARALLEL_GATHER),
            ("TDR_PARALLEL_SPLIT", super::TDR_PARALLEL_SPLIT),
            (
                "TDR_PARALLEL_REDUCE_SCATTER",
                super::TDR_PARALLEL_REDUCE_SCATTER,
            ),
            ("TDR_PARALLEL_ALL_TO_ALL", super::TDR_PARALLEL_ALL_TO_ALL),
        ];
        assert_eq!(codes, BTreeMap::from(rust), "the enum codes");
    }

    /// Every `.rs` file of runtime/src, launcher/src, core/src and src (the facade) whose
    /// code has the `unsafe` keyword is in docs/ARCHITECTURE.md's list
    /// (the bullets after "Files with `unsafe` code"), and nothing else is.
    #[test]
    fn unsafe_files_are_listed() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = Vec::new();
        rust_files(&root, "runtime/src", &mut files);
        rust_files(&root, "launcher/src", &mut files);
        rust_files(&root, "core/src", &mut files);
        rust_files(&root, "ft/src", &mut files);
        rust_files(&root, "src", &mut files);
        let has_unsafe = |file: &String| {
            let code = code_only(&std::fs::read_to_string(root.join(file)).expect("readable"));
            code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .any(|w| w == "unsafe")
        };
        let found: BTreeSet<String> = files.into_iter().filter(has_unsafe).collect();
        let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("the doc");
        let list = doc
            .split("Files with `unsafe` code")
            .nth(1)
            .expect("docs/ARCHITECTURE.md has the list of files with `unsafe` code");
        let listed: BTreeSet<String> = list
            .lines()
            .skip_while(|l| !l.starts_with("- "))
            .take_while(|l| l.starts_with("- "))
            .map(|l| {
                l.split('`')
                    .nth(1)
                    .expect("a bullet starts with the file's path in backticks")
                    .to_string()
            })
            .collect();
        assert_eq!(
            found, listed,
            "the files with `unsafe` code (left) and docs/ARCHITECTURE.md's list (right)"
        );
    }
}
