// tch-dist's shim over libtorch: the C contract between csrc/shim.cpp and src/ffi.rs.
//
// Every declaration here is mirrored, name for name and code for code, in src/ffi.rs; a unit
// test there (`ffi::tests::header_and_bindings_agree`) reads this file and fails when the two
// drift apart. The rules of the boundary:
// - every entry point returning `char*` returns null on success, otherwise a malloc'ed
//   message that the caller owns and frees with `tdr_string_free`;
// - no C++ exception leaves an entry point (each body runs inside TDR_TRY/TDR_CATCH);
// - tensors cross as `at::Tensor*`, the pointer tch's `Tensor::as_ptr()` hands out; tensors
//   created here are returned as `new at::Tensor` for `Tensor::from_ptr`;
// - objects owned by C++ are opaque handles with a matching `*_free` (or `*_remove`).

#ifndef TCH_DIST_SHIM_H
#define TCH_DIST_SHIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
namespace at {
class Tensor;
}
typedef at::Tensor TdrTensor;
extern "C" {
#else
typedef struct TdrTensor TdrTensor;
#endif

// Reductions of all_reduce and reduce_scatter (`ReduceOp` in src/collectives.rs).
enum TdrReduceOp {
  TDR_REDUCE_SUM = 0,
  TDR_REDUCE_AVG = 1,
  TDR_REDUCE_MIN = 2,
  TDR_REDUCE_MAX = 3,
  TDR_REDUCE_PRODUCT = 4,
};

// The differentiable collectives of tdr_parallel_op (src/sharding/functional.rs).
enum TdrParallelMode {
  TDR_PARALLEL_REDUCE = 0,
  TDR_PARALLEL_COPY = 1,
  TDR_PARALLEL_GATHER = 2,
  TDR_PARALLEL_SPLIT = 3,
  TDR_PARALLEL_REDUCE_SCATTER = 4,
  TDR_PARALLEL_ALL_TO_ALL = 5,
};

// What failed, for the message an entry point returned (tdr_last_error_kind).
enum TdrErrorKind {
  TDR_ERROR_NONE = 0,
  TDR_ERROR_ENGINE = 1,   // any engine error
  TDR_ERROR_NETWORK = 2,  // a lost connection (a peer exited, crashed or timed out)
  TDR_ERROR_TIMEOUT = 3,  // tdr_work_wait ended with the work still pending
  TDR_ERROR_BACKEND_TIMEOUT = 4,  // the backend's own timeout passed (NCCL's watchdog)
  TDR_ERROR_SHUT_DOWN = 5,        // the group was shut down (tdr_group_shutdown)
  TDR_ERROR_DESYNC = 6,  // TCH_DIST_DEBUG=DETAIL: the ranks' collectives differ, or a rank
                         // did not arrive at the check before the collective
};

typedef struct TdrStore TdrStore;  // a c10d Store (TCPStore, or a PrefixStore over one)
typedef struct TdrGroup TdrGroup;  // a Gloo backend, optionally an NCCL backend, a CUDA device
typedef struct TdrWork TdrWork;    // an in-flight collective
typedef struct TdrHook TdrHook;    // a gradient-accumulator post hook's registration
typedef struct TdrGuard TdrGuard;  // a use guard over one module's parameters
typedef struct TdrFence TdrFence;  // a shard fence over one module's parameters
typedef struct TdrInterceptor TdrInterceptor;  // a gradient interceptor's registration

// A Rust callback run on libtorch's autograd threads; returns null or a malloc'ed message,
// which fails the backward pass.
typedef char* (*TdrCallback)(void* ctx, size_t index);
// The same, with a tensor borrowed for the duration of the call (a gradient).
typedef char* (*TdrGradCallback)(void* ctx, size_t index, TdrTensor* grad);
// Releases a context the shim shared among hooks (once, when the last one is gone).
typedef void (*TdrRelease)(void* ctx);
// A Rust callback that turns a failure the shim caught on this thread (`message`, malloc'ed,
// which it takes and frees; tdr_last_error_kind is the failure's kind) into the text the
// backward pass fails with, malloc'ed (null: out of memory).
typedef char* (*TdrDescribe)(void* ctx, char* message);

// Memory handed to Rust, and the kind of the last failure on this thread.
void tdr_string_free(char* s);
int tdr_last_error_kind(void);
void tdr_bytes_free(uint8_t* data);

// Stores. A client waits at most `connect_timeout_ms` for the server (the caller makes sure
// one listens, so that c10d's retry loop does not run); `timeout_ms` bounds every later wait.
// The first store created in the process also configures c10's logging (no C++ backtraces
// unless TORCH_SHOW_CPP_STACKTRACES=1).
// `listen_fd`: for a server, a socket already listening where it should (taken over and
// closed with the store), or -1 for the TCPStore's own (every interface).
char* tdr_store_tcp(const char* host, uint16_t port, bool is_server, int listen_fd,
                    int world_size, int64_t connect_timeout_ms, int64_t timeout_ms,
                    TdrStore** out);
// PyTorch's TCPStore handshake (`wait_for_workers=True`): the rank checks in on the store's
// worker count; the server then waits for world_size ranks, at most `timeout_ms`.
char* tdr_store_check_in(TdrStore* s, int64_t timeout_ms);
char* tdr_store_prefix(TdrStore* base, const char* prefix, TdrStore** out);
char* tdr_store_set(TdrStore* s, const char* key, const uint8_t* data, size_t len);
char* tdr_store_get(TdrStore* s, const char* key, uint8_t** data, size_t* len);
char* tdr_store_add(TdrStore* s, const char* key, int64_t delta, int64_t* out);
// Sets `key` to `desired` if it holds `expected` (or is absent and `expected` is empty), and
// returns the value it holds afterwards (malloc'ed for Rust).
char* tdr_store_compare_set(TdrStore* s, const char* key, const uint8_t* expected,
                            size_t expected_len, const uint8_t* desired, size_t desired_len,
                            uint8_t** data, size_t* len);
// Whether `key` exists, without waiting.
char* tdr_store_check(TdrStore* s, const char* key, bool* out);
void tdr_store_free(TdrStore* s);

// CUDA devices (built with NCCL only; otherwise each fails with a message).
char* tdr_cuda_set_device(int device);
char* tdr_cuda_device_uuid(int device, char** out);

// Process groups. `store` is the group's store (PyTorch's `{group_name}/` prefix over the
// default store); the backends take PyTorch's `cpu/` (Gloo) and `cuda/` (NCCL) prefixes over
// it. `with_gloo`, `with_nccl`: which backends (PyTorch's "gloo", "nccl",
// "cpu:gloo,cuda:nccl"). Gloo's devices follow GLOO_SOCKET_IFNAME as PyTorch's; `gloo_host`,
// when not empty, replaces the default device's address. `device` is the CUDA device the
// group is bound to (-1: none): it becomes this thread's current device and NCCL's bound
// device. With `cuda_via_gloo`, CUDA tensors go through Gloo (copied through host memory)
// and no NCCL backend is created. The backends' rendezvous waits at most `rendezvous_ms`;
// their collectives' limit is `timeout_ms`. With `detail` (TCH_DIST_DEBUG=DETAIL) each
// backend is wrapped in c10d's ProcessGroupWrapper, which checks every collective's
// fingerprint across the ranks over a Gloo backend of its own (`pg_wrapper:{group_name}`).
bool tdr_nccl_compiled(void);
char* tdr_group_new(TdrStore* store, const char* group_name, int rank, int size,
                    int64_t timeout_ms, int64_t rendezvous_ms, const char* gloo_host,
                    bool with_gloo, bool with_nccl, int device, bool cuda_via_gloo, bool detail,
                    bool store_as_given, TdrGroup** out);
char* tdr_group_connect(TdrGroup* g);
// DETAIL in a job with ranks that are not tch-dist's (PyTorch's): c10d's checks only, which
// PyTorch's ranks make too; no broadcast root check, and a mismatch reports this rank's call.
char* tdr_group_set_foreign_peers(TdrGroup* g, bool foreign);
// Whether Gloo's pairs connect at their first use (c10d's TORCH_GLOO_LAZY_INIT), not when
// a group is created.
char* tdr_gloo_lazy_init(bool* out);
char* tdr_group_shutdown(TdrGroup* g);
void tdr_group_free(TdrGroup* g);

// Collectives: each returns a TdrWork for tdr_work_wait.
char* tdr_all_reduce(TdrGroup* g, TdrTensor* t, int op, TdrWork** out);
char* tdr_broadcast(TdrGroup* g, TdrTensor* t, int root, TdrWork** out);
char* tdr_all_gather(TdrGroup* g, TdrTensor** outputs, size_t n, TdrTensor* input,
                     TdrWork** out);
char* tdr_all_gather_flat(TdrGroup* g, TdrTensor* output, TdrTensor* input, TdrWork** out);
char* tdr_reduce_scatter(TdrGroup* g, TdrTensor* output, TdrTensor** inputs, size_t n, int op,
                         TdrWork** out);
char* tdr_reduce_scatter_flat(TdrGroup* g, TdrTensor* output, TdrTensor* input, int op,
                              TdrWork** out);
char* tdr_all_to_all(TdrGroup* g, TdrTensor* output, TdrTensor* input, TdrWork** out);
char* tdr_send(TdrGroup* g, TdrTensor* t, int dst, int tag, TdrWork** out);
char* tdr_recv(TdrGroup* g, TdrTensor* t, int src, int tag, TdrWork** out);
char* tdr_barrier(TdrGroup* g, TdrWork** out);
char* tdr_monitored_barrier(TdrGroup* g, int64_t timeout_ms, bool wait_all_ranks);

// Works. A work on a CUDA stream (NCCL) is waited on that stream: with `cpu_bound` false the
// caller's current stream waits and the CPU does not (NCCL's watchdog bounds it); with
// `cpu_bound` the CPU waits at most `timeout_ms` for it and a timeout leaves it pending.
// Other works (Gloo) are waited on the CPU for at most `timeout_ms` either way.
char* tdr_work_wait(TdrWork* w, int64_t timeout_ms, bool cpu_bound);
bool tdr_work_on_stream(TdrWork* w);
bool tdr_work_is_completed(TdrWork* w);
void tdr_work_free(TdrWork* w);

// Autograd: gradient-ready hooks and end-of-backward callbacks (the reducer's triggers).
char* tdr_add_grad_ready_hook(TdrTensor* param, TdrCallback cb, void* ctx, size_t index,
                              TdrHook** out);
void tdr_hook_remove(TdrHook* h);
char* tdr_queue_end_of_backward(TdrCallback cb, void* ctx, size_t index);
// Whether this thread runs inside a backward pass of libtorch's engine (a node, a hook, a
// recomputation), where tdr_queue_end_of_backward may be called.
bool tdr_in_backward(void);
char* tdr_set_grad(TdrTensor* param, TdrTensor* grad);

// Fully sharded parameters (src/fsdp/). The interceptor is a pre-hook on `param`'s gradient
// accumulator: cb(ctx, index, grad) gets each gradient (borrowed for the call) and `.grad` is
// left alone. The output hook runs cb(ctx, index, grad) when the gradient of `output` has been
// computed (before the backward of what made it). `release(ctx)` runs when the last hook
// holding `ctx` is gone. A released storage holds no memory until restored (sized for `t`);
// its tensors must not be read in between.
char* tdr_add_grad_interceptor(TdrTensor* param, TdrGradCallback cb, void* ctx,
                               TdrRelease release, size_t index, TdrInterceptor** out);
void tdr_interceptor_remove(TdrInterceptor* h);
char* tdr_add_output_grad_hook(TdrTensor* output, TdrGradCallback cb, void* ctx,
                               TdrRelease release, size_t index);
char* tdr_storage_release(TdrTensor* t);
char* tdr_storage_restore(TdrTensor* t);
size_t tdr_storage_nbytes(TdrTensor* t);
// `param.set_data(data)` that keeps param's gradient accumulator when the dtype changes
// (set_data drops it then): a parameter gathered in a lower precision keeps its hooks, and
// autograd casts its gradients back to the accumulator's (the parameter's own) dtype.
char* tdr_set_data_keep_accumulator(TdrTensor* param, TdrTensor* data);
// The identity of the tensor object behind a handle (its TensorImpl): shallow clones share
// it, and `set_data` keeps it.
uint64_t tdr_tensor_identity(TdrTensor* t);
// How many handles hold the tensor object behind `t` (its own included; 0 when undefined).
size_t tdr_tensor_use_count(TdrTensor* t);
// The version counter of the tensor behind a handle (bumped by every in-place change made
// through it): a prefetched gather of shards changed since is stale.
uint64_t tdr_tensor_version(TdrTensor* t);

// Use guards (src/use_guard.rs): the parameters of a hooked module may only be used, in the
// autograd graph, by nodes made inside a call of that module through its hooks. A call's
// pre-hook takes a mark (autograd's sequence number on this thread), its forward hook claims
// the nodes made since that use a guarded parameter and that the output depends on. A
// backward pass through an unclaimed use fails before any guarded gradient is accumulated,
// with the message cb(ctx, index) returns for the first such parameter (index: its position
// in `params`); tdr_guard_first_unclaimed finds one in an output's graph (forward).
uint64_t tdr_autograd_mark(void);
char* tdr_guard_new(TdrTensor** params, size_t n, TdrCallback cb, void* ctx, TdrGuard** out);
// g == NULL claims the uses of every guard's parameters (a deliberate direct use).
char* tdr_guard_claim(TdrGuard* g, TdrTensor* output, uint64_t mark);
// *guard = SIZE_MAX when every use is claimed; otherwise the position in `guards` of the
// first guard with an unclaimed use, and *index the first such parameter's.
char* tdr_guard_first_unclaimed(TdrGuard** guards, size_t n, TdrTensor* output,
                                uint64_t mark, size_t* guard, size_t* index);
void tdr_guard_free(TdrGuard* g);

// Activation checkpointing (src/autograd/recompute.rs). A forward callback gets `n` input
// tensors (borrowed for the call) and pushes its outputs onto `out` with
// tdr_tensor_list_push; it returns null or a malloc'ed message.
typedef struct TdrTensorList TdrTensorList;  // tensors handed from one side to the other
typedef char* (*TdrForwardCallback)(void* ctx, TdrTensor** inputs, size_t n, TdrTensorList* out);
char* tdr_tensor_list_push(TdrTensorList* list, TdrTensor* t);
size_t tdr_tensor_list_len(TdrTensorList* list);
// A new handle on the list's tensor `index` (null when out of range), owned by the caller.
TdrTensor* tdr_tensor_list_take(TdrTensorList* list, size_t index);
void tdr_tensor_list_free(TdrTensorList* list);
// Runs first(first_ctx, inputs) with grad disabled inside a custom autograd function over
// the inputs and `params` (leaves that require grad), keeping only the inputs (and, with
// `preserve_rng`, the CPU's and the inputs' CUDA devices' RNG states); its backward runs
// again(again_ctx, detached inputs) with grad enabled and those RNG states, and returns the
// gradients of the inputs and of the parameters. `buffers` (the module's: a BatchNorm's
// running statistics) are put back as they were before the recomputation once its backward
// is done, so that the recomputation updates none of them. `again_ctx` is released (release)
// when the function's graph is gone, or at once on failure. *out: the outputs.
char* tdr_checkpoint_apply(TdrTensor** inputs, size_t num_inputs, TdrTensor** params,
                           size_t num_params, TdrTensor** buffers, size_t num_buffers,
                           bool preserve_rng, TdrForwardCallback first,
                           void* first_ctx, TdrForwardCallback again, void* again_ctx,
                           TdrRelease release, TdrTensorList** out);

// Custom autograd functions (src/autograd/function.rs): runs forward(forward_ctx, inputs)
// with grad disabled inside a custom autograd function over the inputs; its outputs are the
// function's (integral ones not differentiable). Its backward runs backward(backward_ctx,
// the outputs' gradients, zeros where an output got none), which pushes one gradient per
// input (undefined for none). `backward_ctx` is released (release) when the function's
// graph is gone, or at once on failure. *out: the outputs.
char* tdr_function_apply(TdrTensor** inputs, size_t num_inputs, TdrForwardCallback forward,
                         void* forward_ctx, TdrForwardCallback backward, void* backward_ctx,
                         TdrRelease release, TdrTensorList** out);

// Pipelining's split backward (src/autograd/split_backward.rs): tdr_backward_input
// differentiates the n `roots` (with `grads`, their gradients) with respect to `input` (a
// leaf that requires grad; null on a first stage) only, keeping what the parameters' gradients
// need in *out, and sets *input_grad (null when undefined). Without `may_split`, where the
// graph cannot be split safely (see split_backward.cpp), or without an input, it runs the
// whole backward (the parameters' gradients and the input's `.grad`) and *out is null.
// tdr_backward_weight accumulates the parameters' gradients of a split backward, once.
typedef struct TdrSplitBackward TdrSplitBackward;
char* tdr_backward_input(TdrTensor** roots, TdrTensor** grads, size_t n, TdrTensor* input,
                         bool may_split, TdrTensor** input_grad, TdrSplitBackward** out);
char* tdr_backward_weight(TdrSplitBackward* s);
void tdr_split_backward_free(TdrSplitBackward* s);

// Shard fences (src/autograd/shard_fence.rs): while this thread is inside a checked call (check_enter
// .. check_exit, nested), an op using an armed parameter of a fence not opened on this thread
// fails (a c10::Error inside the op) with the message cb(ctx, index), index being the
// parameter's position in `params`. tdr_fence_new registers the dispatcher fallback once per
// process (an error if the key is taken). reset_thread ends every checked call and closes
// every fence of this thread (an outermost hooked call ended, maybe by unwinding). suspend
// switches the check off on this thread (true) or back (false) and returns the previous state.
char* tdr_fence_new(TdrTensor** params, size_t n, TdrCallback cb, void* ctx, TdrFence** out);
char* tdr_fence_set_armed(TdrFence* f, size_t index, bool armed);
void tdr_fence_free(TdrFence* f);
void tdr_fence_check_enter(void);
void tdr_fence_check_exit(void);
// open pushes `f` on this thread's open fences; close drops its innermost entry and every
// entry after it (calls that unwound).
void tdr_fence_open(TdrFence* f);
void tdr_fence_close(TdrFence* f);
void tdr_fence_reset_thread(void);
bool tdr_fence_suspend(bool suspended);

// Differentiable collectives for tensor parallelism (mode: a TdrParallelMode). When the
// output records a graph, its backward node runs before(ctx, mode) before its collective (the
// step check: its message fails the backward) and describe(ctx, ...) on the collective's
// failure; `ctx` is released (release) with the node, or at once when none is made.
char* tdr_parallel_op(TdrGroup* g, TdrTensor* input, int mode, int64_t dim,
                      const int64_t* sizes, size_t n, TdrCallback before, TdrDescribe describe,
                      void* ctx, TdrRelease release, TdrTensor** out);

// torch.randperm(n, generator=torch.Generator().manual_seed(seed)): a new int64 CPU tensor
// (DistributedSampler's shuffle, from a generator of its own: the default one is untouched).
char* tdr_randperm(int64_t n, uint64_t seed, TdrTensor** out);

// Optimizer steps (tch_dist::optim) with libtorch's fused kernels, which tch does not expose.
// Each takes n parallel arrays of tensors (one entry per parameter with a gradient), updates
// the parameters and their state in place under no_grad. The caller checks that every
// tensor of an entry has the parameter's shape, dtype and device first.
// at::_fused_adamw_: `steps` (float32 scalars) are incremented first, as torch.optim's
// _fused_adam does; `max_exp_avg_sqs` is NULL unless amsgrad.
char* tdr_fused_adamw(TdrTensor** params, TdrTensor** grads, TdrTensor** exp_avgs,
                      TdrTensor** exp_avg_sqs, TdrTensor** max_exp_avg_sqs, TdrTensor** steps,
                      size_t n, double lr, double beta1, double beta2, double weight_decay,
                      double eps, bool amsgrad, bool maximize);
// at::_fused_sgd_: `momentum_buffers` is NULL when momentum is 0; with `is_first_step` the
// kernel fills the buffers with the (weight-decayed) gradient, as torch.optim.SGD's first step.
char* tdr_fused_sgd(TdrTensor** params, TdrTensor** grads, TdrTensor** momentum_buffers,
                    size_t n, double weight_decay, double momentum, double lr, double dampening,
                    bool nesterov, bool maximize, bool is_first_step);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TCH_DIST_SHIM_H
