// The shim's private header: what its sections share. shim.h is the one contract with Rust
// (src/ffi.rs mirrors it); nothing declared here crosses the boundary.
//
// Every entry point runs its body inside TDR_TRY/TDR_CATCH: every C++ exception is caught
// there and nothing unwinds into Rust.
//
// The files, one per section (file: what it does; what it wraps in libtorch):
// - internal.h: TDR_TRY/TDR_CATCH, the handles, routing and DETAIL's shared declarations.
// - errors.cpp: the error kind of the thread's last failure, messages for Rust, c10's logs;
//   c10::Error, c10::SetStackTraceFetcher.
// - store.cpp: stores; c10d::TCPStore, c10d::PrefixStore.
// - devices.cpp: CUDA devices (the current one, a GPU's UUID); c10::cuda::set_device,
//   at::cuda::getDeviceProperties.
// - group.cpp: process groups (backends, eager connect, shutdown); c10d::ProcessGroupGloo,
//   c10d::ProcessGroupNCCL, as torch.distributed's _new_process_group_helper.
// - detail.cpp: TCH_DIST_DEBUG=DETAIL (the root check, the desync report);
//   c10d::ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL).
// - collectives.cpp: routing, collectives, point-to-point, works and their waits;
//   c10d::Backend's collectives, c10d::Work.
// - autograd_hooks.cpp: gradient-ready hooks, end-of-backward callbacks (the reducer's);
//   AccumulateGrad post hooks, Engine::queue_callback.
// - fsdp.cpp: gradient interceptors, storage release and restore, set_data (fully_shard's);
//   AccumulateGrad pre hooks, c10::StorageImpl, TensorImpl::shallow_copy_from.
// - use_guard.cpp: use guards (autograd uses of parameters outside a hooked call);
//   autograd Node pre hooks, the graph task's nodes.
// - fence.cpp: shard fences (ops on a shard outside a hooked call); a c10::Dispatcher
//   fallback on the DeferredInit key (torch::Library).
// - parallel.cpp: differentiable collectives for tensor parallelism; a custom
//   torch::autograd::Node (Megatron's conjugate pairs).
// - checkpoint.cpp: activation checkpointing (a forward run again in backward); a custom
//   torch::autograd::Function, torch::autograd::grad, the default generators' states.
// - function.cpp: custom autograd functions whose forward and backward are Rust callbacks;
//   a custom torch::autograd::Function.
// - split_backward.cpp: pipelining's split backward (the input's gradient first, the
//   parameters' later); torch::autograd::grad, Node pre hooks, Engine::execute from edges.
// - kernels.cpp: a seeded randperm (DistributedSampler's shuffle), fused AdamW and SGD;
//   at::randperm, at::_fused_adamw_, at::_fused_sgd_.

#ifndef TCH_DIST_INTERNAL_H
#define TCH_DIST_INTERNAL_H

#include "shim.h"

namespace torch::autograd {
struct AutogradContext;
}  // namespace torch::autograd

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gloo/common/error.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace tdr {

// A malloc'ed copy of `msg`, for Rust to free with tdr_string_free (null when out of memory).
char* dup_message(const char* msg);
char* dup_message(const std::string& msg);

// TCH_DIST_DEBUG=DETAIL found that the ranks' collectives differ, or that a rank did not
// reach the check (TDR_ERROR_DESYNC); the message is the report `desync_report` builds, which
// src/error.rs parses.
struct DesyncError : std::runtime_error {
  explicit DesyncError(const std::string& report) : std::runtime_error(report) {}
};

// A collective on a group that was shut down (TDR_ERROR_SHUT_DOWN).
struct ShutDownError : std::runtime_error {
  ShutDownError()
      : std::runtime_error(
            "the process group was shut down (ProcessGroup::shutdown or "
            "destroy_process_group)") {}
};

// c10d reports a backend's own timeout as an ordinary error; its text tells: NCCL's watchdog
// ("Watchdog caught collective operation timeout: WorkNCCL(...) ran for N milliseconds
// before timing out"), or a blocking wait (TORCH_NCCL_BLOCKING_WAIT=1). A peer that exited
// shows as NCCL's remote error.
int classify(const std::string& msg, int fallback);

// What kind of failure the last entry point called on this thread returned (read with
// tdr_last_error_kind right after the call).
extern thread_local int last_error_kind;

// Records `kind` as this thread's last failure and returns `msg` for Rust.
char* fail(int kind, const char* msg);

// c10::Error's what() carries a C++ backtrace, and c10d logs what() when it retries (the
// TCPStore client's connect loop prints about 40 lines per try). As PyTorch's Python
// bindings do, the backtrace is left out unless TORCH_SHOW_CPP_STACKTRACES=1; c10d's one-line
// log messages stay (TORCH_CPP_LOG_LEVEL controls them).
void configure_logging();

using Millis = std::chrono::milliseconds;

// A group's backends, shared by the group's handle and by every autograd node that
// communicates over it. Launches hold `mutex` shared; shutting down holds it exclusively,
// after which no backend is reachable.
// With DETAIL, `gloo` and `nccl` are c10d ProcessGroupWrappers (what collectives go
// through) and `nccl_raw` the NCCL backend they wrap (what shutdown reaches: the wrapper does
// not forward it).
struct Backends {
  std::shared_mutex mutex;
  bool shut_down = false;
  c10::intrusive_ptr<c10d::Backend> gloo;
  c10::intrusive_ptr<c10d::Backend> nccl;
  c10::intrusive_ptr<c10d::Backend> nccl_raw;
  // DETAIL: the Gloo backends the wrappers check over (null otherwise).
  c10::intrusive_ptr<c10d::Backend> gloo_check;
  c10::intrusive_ptr<c10d::Backend> nccl_check;
  // DETAIL in a job with ranks that are not tch-dist's (PyTorch's): only c10d's own checks,
  // which PyTorch's ranks make too (no root check, no gathering of every rank's call).
  std::shared_ptr<std::atomic<bool>> foreign = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace tdr

// The one error-check pattern of every entry point: a body in TDR_TRY ... TDR_CATCH returns
// null, or the message of the exception it threw, classified: a lost connection (c10d's
// DistNetworkError, Gloo's IoException, NCCL's remote error), a backend's own timeout, a
// shut-down group, or any other engine error. c10::Error's what() carries a C++ backtrace;
// users want the message only.
#define TDR_TRY                                                             \
  tdr::last_error_kind = TDR_ERROR_NONE;                                    \
  try {
#define TDR_CATCH                                                           \
  }                                                                         \
  catch (const c10::DistNetworkError& e) {                                  \
    return tdr::fail(TDR_ERROR_NETWORK, e.what_without_backtrace());        \
  }                                                                         \
  catch (const c10::Error& e) {                                             \
    std::string msg = e.what_without_backtrace();                           \
    return tdr::fail(tdr::classify(msg, TDR_ERROR_ENGINE), msg.c_str());    \
  }                                                                         \
  catch (const gloo::IoException& e) {                                      \
    return tdr::fail(TDR_ERROR_NETWORK, e.what());                          \
  }                                                                         \
  catch (const tdr::ShutDownError& e) {                                     \
    return tdr::fail(TDR_ERROR_SHUT_DOWN, e.what());                        \
  }                                                                         \
  catch (const tdr::DesyncError& e) {                                       \
    return tdr::fail(TDR_ERROR_DESYNC, e.what());                           \
  }                                                                         \
  catch (const std::exception& e) {                                         \
    return tdr::fail(tdr::classify(e.what(), TDR_ERROR_ENGINE), e.what());  \
  }                                                                         \
  catch (...) {                                                             \
    return tdr::fail(TDR_ERROR_ENGINE, "unknown C++ exception");            \
  }                                                                         \
  return nullptr;

// The handles of shim.h.

struct TdrStore {
  c10::intrusive_ptr<c10d::Store> store;
};

// One process group as the Rust side sees it: Gloo always (CPU tensors, control traffic
// such as monitored barriers and metadata checks), NCCL when asked for (CUDA tensors), the
// CUDA device it is bound to.
struct TdrGroup {
  int rank;
  int size;
  tdr::Millis timeout;
  int device;          // the bound CUDA device; -1: none
  bool cuda_via_gloo;  // CUDA tensors through Gloo, copied through host memory
  std::shared_ptr<tdr::Backends> backends;
};

// An in-flight collective. `finish` runs once, after a successful wait: it copies results
// back into non-contiguous user tensors (or from host copies to the device) and divides for
// AVG where the backend cannot. `on_stream`: an NCCL work, waited on the current stream.
struct TdrWork {
  c10::intrusive_ptr<c10d::Work> work;
  std::function<void()> finish;
  bool on_stream = false;
  bool finished = false;
};

// The tensors a forward callback hands to the shim (checkpoint.cpp, function.cpp).
struct TdrTensorList {
  std::vector<at::Tensor> tensors;
};

namespace tdr {

// Routing (collectives.cpp).

// The backend a tensor goes through, held for the launch (the group cannot be shut down
// meanwhile). `staged`: a CUDA tensor through Gloo, communicated as a host copy.
struct Route {
  std::shared_lock<std::shared_mutex> lock;
  c10::intrusive_ptr<c10d::Backend> backend;
  // DETAIL: the Gloo backend `backend`'s wrapper checks over (null otherwise).
  c10::intrusive_ptr<c10d::Backend> check;
  bool gloo = true;
  bool staged = false;
};

// The group's backends, locked for a launch; throws ShutDownError once the group is shut down.
Route lock_backends(const TdrGroup& g);

// Gloo, for control traffic (monitored barriers): a group without one (PyTorch's "nccl")
// refuses `op`.
Route route_gloo(const TdrGroup& g, const char* op);

// A barrier's backend: Gloo where the group has one, else NCCL (PyTorch's barrier on an
// NCCL-only group, a one-element all_reduce on the bound device).
Route route_barrier(const TdrGroup& g);

// The backend `t` goes through: NCCL for CUDA tensors (Gloo, staged, with cuda_via_gloo),
// Gloo for CPU tensors; a group without that backend refuses the tensor.
Route route(const TdrGroup& g, const at::Tensor& t);

// A host copy of `t` (synchronous: it follows what the current stream queued before).
at::Tensor host_copy(const at::Tensor& t);

// TCH_DIST_DEBUG=DETAIL (detail.cpp).

// One rank's side of a collective, as a desync report names it: torch.distributed's name of
// the operation, and the tensors its fingerprint covers.
struct Call {
  const char* op;
  std::vector<at::Tensor> tensors;
  int root = -1;  // a broadcast's source rank
};

// `rank \t seq \t op \t tensors \t root`, tensors separated by `|`, each
// `d0,d1,...;Dtype;device`, the root empty when the op has none (src/desync.rs parses it).
std::string encode_call(int rank, uint64_t seq, const Call& c);

// Every rank's encoded call, one line each in rank order, gathered over the check backend.
// Only called once the wrapper found a mismatch: every rank found it at the same step of the
// check (each compared the same gathered fingerprints with its own), so all of them are here.
std::string gather_calls(const c10::intrusive_ptr<c10d::Backend>& check,
                         const std::string& mine);

// c10d's ProcessGroupWrapper around `inner`, checking over `check`, with the root check.
c10::intrusive_ptr<c10d::Backend> wrap_checked(const c10::intrusive_ptr<c10d::Backend>& inner,
                                               const c10::intrusive_ptr<c10d::Backend>& check,
                                               std::shared_ptr<std::atomic<bool>> foreign);

// Launches a collective; with DETAIL, the wrapper's failed check becomes a DesyncError whose
// report src/error.rs reads: `tdr-desync:differ` and every rank's call, or
// `tdr-desync:missing`, this rank's call and the monitored barrier's message (a rank did not
// arrive, or closed its connection).
template <typename F>
c10::intrusive_ptr<c10d::Work> checked(const TdrGroup& g, const Route& r, const Call& call,
                                       F&& launch) {
  if (!r.check) {
    return launch();
  }
  uint64_t seq = r.backend->getSequenceNumberForGroup();
  try {
    return launch();
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    std::string mine = encode_call(g.rank, seq, call);
    if (msg.find("Detected mismatch between collectives on ranks") != std::string::npos) {
      if (g.backends->foreign->load()) {
        // The other ranks (PyTorch's) gather nothing more: this rank's call only.
        throw DesyncError("tdr-desync:differ\n" + mine + "\n");
      }
      throw DesyncError("tdr-desync:differ\n" + gather_calls(r.check, mine));
    }
    if (msg.find("monitoredBarrier") != std::string::npos ||
        msg.find("ProcessGroupWrapper: Monitored Barrier") != std::string::npos) {
      throw DesyncError("tdr-desync:missing\n" + mine + "\n" + msg);
    }
    throw;
  }
}

// The tensors a forward callback pushes (checkpoint.cpp, function.cpp).
std::vector<at::Tensor> call_forward(TdrForwardCallback cb, void* ctx,
                                     std::vector<at::Tensor> inputs);

// A custom function's forward outputs, checked (an undefined one throws) and its integral
// ones marked not differentiable (checkpoint.cpp, function.cpp).
void check_forward_outputs(torch::autograd::AutogradContext* ctx,
                           const std::vector<at::Tensor>& outputs);

// Whether `node` is a function whose backward is a Rust callback (function.cpp): a split
// backward would run it twice too.
bool is_rust_function_node(const torch::autograd::Node* node);

// Whether `node` is activation checkpointing's function (checkpoint.cpp), whose backward
// runs its forward again: a split backward (split_backward.cpp) would run it twice.
bool is_checkpoint_node(const torch::autograd::Node* node);

}  // namespace tdr

#endif  // TCH_DIST_INTERNAL_H
