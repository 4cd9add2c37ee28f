//! The `extern "C"` surface of csrc/shim.cpp and the one place its errors become Rust values.
//!
//! Every shim function returns a `char*`: null on success, else a malloc'ed message that
//! [`take_error`] copies into a `String` and frees. All `unsafe` of the runtime that touches
//! the shim goes through the declarations below; callers comment why each call is sound.

use std::ffi::{c_char, c_int, CStr};

use torch_sys::C_tensor;

/// Opaque c10d store (`TCPStore` or `PrefixStore`) owned by the shim.
#[repr(C)]
pub struct TdrStore {
    _private: [u8; 0],
}

/// Opaque process group: a Gloo backend and optionally an NCCL backend.
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

/// A callback the shim calls from libtorch's autograd threads with an opaque context; it
/// returns null or a malloc'ed error message (which fails the backward pass).
pub type TdrCallback =
    unsafe extern "C" fn(ctx: *mut std::ffi::c_void, index: usize) -> *mut c_char;

extern "C" {
    pub fn tdr_string_free(s: *mut c_char);
    pub fn tdr_bytes_free(data: *mut u8);

    pub fn tdr_store_tcp(
        host: *const c_char,
        port: u16,
        is_server: bool,
        world_size: c_int,
        timeout_ms: i64,
        out: *mut *mut TdrStore,
    ) -> *mut c_char;
    pub fn tdr_store_prefix(
        base: *mut TdrStore,
        prefix: *const c_char,
        out: *mut *mut TdrStore,
    ) -> *mut c_char;
    pub fn tdr_store_set(
        s: *mut TdrStore,
        key: *const c_char,
        data: *const u8,
        len: usize,
    ) -> *mut c_char;
    pub fn tdr_store_get(
        s: *mut TdrStore,
        key: *const c_char,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> *mut c_char;
    pub fn tdr_store_add(
        s: *mut TdrStore,
        key: *const c_char,
        delta: i64,
        out: *mut i64,
    ) -> *mut c_char;
    pub fn tdr_store_free(s: *mut TdrStore);

    pub fn tdr_nccl_compiled() -> bool;
    pub fn tdr_group_new(
        store: *mut TdrStore,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        gloo_host: *const c_char,
        with_nccl: bool,
        out: *mut *mut TdrGroup,
    ) -> *mut c_char;
    pub fn tdr_group_free(g: *mut TdrGroup);

    pub fn tdr_all_reduce(
        g: *mut TdrGroup,
        t: *mut C_tensor,
        op: c_int,
        out: *mut *mut TdrWork,
    ) -> *mut c_char;
    pub fn tdr_broadcast(
        g: *mut TdrGroup,
        t: *mut C_tensor,
        root: c_int,
        out: *mut *mut TdrWork,
    ) -> *mut c_char;
    pub fn tdr_all_gather(
        g: *mut TdrGroup,
        outputs: *const *mut C_tensor,
        n: usize,
        input: *mut C_tensor,
        out: *mut *mut TdrWork,
    ) -> *mut c_char;
    pub fn tdr_all_gather_flat(
        g: *mut TdrGroup,
        output: *mut C_tensor,
        input: *mut C_tensor,
        out: *mut *mut TdrWork,
    ) -> *mut c_char;
    pub fn tdr_reduce_scatter(
        g: *mut TdrGroup,
        output: *mut C_tensor,
        inputs: *const *mut C_tensor,
        n: usize,
        op: c_int,
        out: *mut *mut TdrWork,
    ) -> *mut c_char;
    pub fn tdr_reduce_scatter_flat(
        g: *mut TdrGroup,
        output: *mut C_tensor,
        input: *mut C_tensor,
        op: c_int,
        out: *mut *mut TdrWork,
    ) -> *mut c_char;
    pub fn tdr_all_to_all(
        g: *mut TdrGroup,
        output: *mut C_tensor,
        input: *mut C_tensor,
        out: *mut *mut TdrWork,
    ) -> *mut c_char;
    pub fn tdr_send(
        g: *mut TdrGroup,
        t: *mut C_tensor,
        dst: c_int,
        tag: c_int,
        out: *mut *mut TdrWork,
    ) -> *mut c_char;
    pub fn tdr_recv(
        g: *mut TdrGroup,
        t: *mut C_tensor,
        src: c_int,
        tag: c_int,
        out: *mut *mut TdrWork,
    ) -> *mut c_char;
    pub fn tdr_barrier(g: *mut TdrGroup, out: *mut *mut TdrWork) -> *mut c_char;
    pub fn tdr_monitored_barrier(
        g: *mut TdrGroup,
        timeout_ms: i64,
        wait_all_ranks: bool,
    ) -> *mut c_char;

    pub fn tdr_work_wait(w: *mut TdrWork, timeout_ms: i64) -> *mut c_char;
    pub fn tdr_work_is_completed(w: *mut TdrWork) -> bool;
    pub fn tdr_work_free(w: *mut TdrWork);

    pub fn tdr_add_grad_ready_hook(
        param: *mut C_tensor,
        cb: TdrCallback,
        ctx: *mut std::ffi::c_void,
        index: usize,
        out: *mut *mut TdrHook,
    ) -> *mut c_char;
    pub fn tdr_hook_remove(h: *mut TdrHook);
    pub fn tdr_queue_end_of_backward(
        cb: TdrCallback,
        ctx: *mut std::ffi::c_void,
        index: usize,
    ) -> *mut c_char;
    pub fn tdr_set_grad(param: *mut C_tensor, grad: *mut C_tensor) -> *mut c_char;

    pub fn tdr_parallel_op(
        g: *mut TdrGroup,
        input: *mut C_tensor,
        mode: c_int,
        dim: i64,
        sizes: *const i64,
        n: usize,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
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

/// Turns a shim return value into a `Result`, freeing the message.
///
/// # Safety
/// `err` must be null or a message returned by a shim function and not yet freed.
pub unsafe fn take_error(err: *mut c_char) -> Result<(), String> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: the shim returns NUL-terminated malloc'ed strings; we free it exactly once.
    let msg = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    unsafe { tdr_string_free(err) };
    Err(msg)
}
