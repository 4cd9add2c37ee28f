// tch-dist's C++ shim over libtorch: c10d process groups and collectives, autograd hooks.
//
// shim.h is the contract (prototypes, enums, the boundary rules); src/ffi.rs mirrors it.
// Every C++ exception is caught here (TDR_TRY/TDR_CATCH) and nothing unwinds into Rust.

#include "shim.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/library.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <c10/util/Logging.h>
#include <gloo/common/error.h>
#ifdef TDR_WITH_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

char* dup_message(const char* msg) {
  size_t n = std::strlen(msg);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) {
    std::memcpy(out, msg, n + 1);
  }
  return out;
}

char* dup_message(const std::string& msg) { return dup_message(msg.c_str()); }

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
int classify(const std::string& msg, int fallback) {
  if (msg.find("collective operation timeout") != std::string::npos ||
      msg.find("timed out in blocking wait") != std::string::npos) {
    return TDR_ERROR_BACKEND_TIMEOUT;
  }
  if (msg.find("remote process exited or there was a network error") != std::string::npos) {
    return TDR_ERROR_NETWORK;
  }
  return fallback;
}

}  // namespace

// What kind of failure the last entry point called on this thread returned (read with
// tdr_last_error_kind right after the call).
thread_local int last_error_kind = TDR_ERROR_NONE;

char* fail(int kind, const char* msg) {
  last_error_kind = kind;
  return dup_message(msg);
}

// The one error-check pattern of every entry point: a body in TDR_TRY ... TDR_CATCH returns
// null, or the message of the exception it threw, classified: a lost connection (c10d's
// DistNetworkError, Gloo's IoException, NCCL's remote error), a backend's own timeout, a
// shut-down group, or any other engine error. c10::Error's what() carries a C++ backtrace;
// users want the message only.
#define TDR_TRY         \
  last_error_kind = TDR_ERROR_NONE; \
  try {
#define TDR_CATCH                                                            \
  }                                                                          \
  catch (const c10::DistNetworkError& e) {                                   \
    return fail(TDR_ERROR_NETWORK, e.what_without_backtrace());              \
  }                                                                          \
  catch (const c10::Error& e) {                                              \
    std::string msg = e.what_without_backtrace();                            \
    return fail(classify(msg, TDR_ERROR_ENGINE), msg.c_str());               \
  }                                                                          \
  catch (const gloo::IoException& e) {                                       \
    return fail(TDR_ERROR_NETWORK, e.what());                                \
  }                                                                          \
  catch (const ShutDownError& e) {                                           \
    return fail(TDR_ERROR_SHUT_DOWN, e.what());                              \
  }                                                                          \
  catch (const DesyncError& e) {                                             \
    return fail(TDR_ERROR_DESYNC, e.what());                                 \
  }                                                                          \
  catch (const std::exception& e) {                                          \
    return fail(classify(e.what(), TDR_ERROR_ENGINE), e.what());             \
  }                                                                          \
  catch (...) {                                                              \
    return fail(TDR_ERROR_ENGINE, "unknown C++ exception");                  \
  }                                                                          \
  return nullptr;

using Millis = std::chrono::milliseconds;

struct TdrStore {
  c10::intrusive_ptr<c10d::Store> store;
};

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

// One process group as the Rust side sees it: Gloo always (CPU tensors, control traffic
// such as monitored barriers and metadata checks), NCCL when asked for (CUDA tensors), the
// CUDA device it is bound to.
struct TdrGroup {
  int rank;
  int size;
  Millis timeout;
  int device;          // the bound CUDA device; -1: none
  bool cuda_via_gloo;  // CUDA tensors through Gloo, copied through host memory
  std::shared_ptr<Backends> backends;
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

namespace {

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

Route lock_backends(const TdrGroup& g) {
  Route r;
  r.lock = std::shared_lock<std::shared_mutex>(g.backends->mutex);
  if (g.backends->shut_down) {
    throw ShutDownError();
  }
  return r;
}

// Gloo, for control traffic (monitored barriers): a group without one (PyTorch's "nccl")
// refuses `op`.
Route route_gloo(const TdrGroup& g, const char* op) {
  Route r = lock_backends(g);
  if (!g.backends->gloo) {
    throw std::runtime_error(std::string(op) +
                             " needs a Gloo backend, and this group has NCCL only (PyTorch's "
                             "\"nccl\"); create it with \"cpu:gloo,cuda:nccl\"");
  }
  r.backend = g.backends->gloo;
  r.check = g.backends->gloo_check;
  return r;
}

// A barrier's backend: Gloo where the group has one, else NCCL (PyTorch's barrier on an
// NCCL-only group, a one-element all_reduce on the bound device).
Route route_barrier(const TdrGroup& g) {
  Route r = lock_backends(g);
  if (g.backends->gloo) {
    r.backend = g.backends->gloo;
    r.check = g.backends->gloo_check;
    return r;
  }
  r.backend = g.backends->nccl;
  r.check = g.backends->nccl_check;
  r.gloo = false;
  return r;
}

Route route(const TdrGroup& g, const at::Tensor& t) {
  Route r = lock_backends(g);
  if (t.is_cuda()) {
    if (g.cuda_via_gloo) {
      r.backend = g.backends->gloo;
      r.check = g.backends->gloo_check;
      r.staged = true;
      return r;
    }
    if (!g.backends->nccl) {
      throw std::runtime_error(
          "tensor is on " + t.device().str() +
          " but this process group has no NCCL backend (it is Gloo-only); create the "
          "group with Backend::Nccl to communicate CUDA tensors");
    }
    r.backend = g.backends->nccl;
    r.check = g.backends->nccl_check;
    r.gloo = false;
    return r;
  }
  if (!t.device().is_cpu()) {
    throw std::runtime_error("unsupported tensor device " + t.device().str());
  }
  if (!g.backends->gloo) {
    throw std::runtime_error(
        "tensor is on cpu but this process group has NCCL only (PyTorch's \"nccl\"); create "
        "the group with \"cpu:gloo,cuda:nccl\" (or \"gloo\") to communicate CPU tensors");
  }
  r.backend = g.backends->gloo;
  r.check = g.backends->gloo_check;
  return r;
}

// One rank's side of a collective, as a desync report names it: torch.distributed's name of
// the operation, and the tensors its fingerprint covers.
struct Call {
  const char* op;
  std::vector<at::Tensor> tensors;
  int root = -1;  // a broadcast's source rank
};

// `rank \t seq \t op \t tensors \t root`, tensors separated by `|`, each
// `d0,d1,...;Dtype;device`, the root empty when the op has none (src/desync.rs parses it).
std::string encode_call(int rank, uint64_t seq, const Call& c) {
  std::string out = std::to_string(rank) + "\t" + std::to_string(seq) + "\t" + c.op + "\t";
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    const at::Tensor& t = c.tensors[i];
    if (i > 0) {
      out += "|";
    }
    for (int64_t d = 0; d < t.dim(); ++d) {
      out += (d > 0 ? "," : "") + std::to_string(t.size(d));
    }
    out += std::string(";") + c10::toString(t.scalar_type()) + ";" + t.device().str();
  }
  out += "\t" + (c.root >= 0 ? std::to_string(c.root) : std::string());
  return out;
}

// Every rank's encoded call, one line each in rank order, gathered over the check backend.
// Only called once the wrapper found a mismatch: every rank found it at the same step of the
// check (each compared the same gathered fingerprints with its own), so all of them are here.
std::string gather_calls(const c10::intrusive_ptr<c10d::Backend>& check, const std::string& mine) {
  int n = check->getSize();
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  std::vector<std::vector<at::Tensor>> lens(1);
  for (int i = 0; i < n; ++i) {
    lens[0].push_back(at::zeros_like(len));
  }
  std::vector<at::Tensor> len_in{len};
  check->allgather(lens, len_in)->wait();
  int64_t longest = 1;
  for (const auto& l : lens[0]) {
    longest = std::max(longest, l.item<int64_t>());
  }
  at::Tensor buf = at::zeros({longest}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  std::vector<std::vector<at::Tensor>> bufs(1);
  for (int i = 0; i < n; ++i) {
    bufs[0].push_back(at::zeros_like(buf));
  }
  std::vector<at::Tensor> buf_in{buf};
  check->allgather(bufs, buf_in)->wait();
  std::string out;
  for (int i = 0; i < n; ++i) {
    const char* data = static_cast<const char*>(bufs[0][i].data_ptr());
    out += std::string(data, static_cast<size_t>(lens[0][i].item<int64_t>())) + "\n";
  }
  return out;
}

// DETAIL: sits between c10d's ProcessGroupWrapper and the backend it wraps, forwarding what
// the shim uses. The wrapper's fingerprint leaves out a broadcast's root (mismatched roots
// leave both ranks waiting out the timeout); once the wrapper's check has passed, every rank
// is at the same broadcast, and this compares the roots over the check backend first.
class RootCheck : public c10d::Backend {
 public:
  RootCheck(c10::intrusive_ptr<c10d::Backend> inner, c10::intrusive_ptr<c10d::Backend> check,
            std::shared_ptr<std::atomic<bool>> foreign)
      : Backend(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        check_(std::move(check)),
        foreign_(std::move(foreign)) {}

  const std::string getBackendName() const override { return inner_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& data,
                                           const c10d::BroadcastOptions& opts) override {
    if (foreign_->load()) {
      return inner_->broadcast(data, opts);
    }
    at::Tensor root = at::full({1}, opts.rootRank, at::kLong);
    std::vector<std::vector<at::Tensor>> roots(1);
    for (int i = 0; i < getSize(); ++i) {
      roots[0].push_back(at::zeros_like(root));
    }
    std::vector<at::Tensor> in{root};
    check_->allgather(roots, in)->wait();
    for (const auto& r : roots[0]) {
      if (r.item<int64_t>() != opts.rootRank) {
        Call call{"broadcast", data, static_cast<int>(opts.rootRank)};
        std::string mine = encode_call(getRank(), inner_->getSequenceNumberForGroup(), call);
        throw DesyncError("tdr-desync:differ\n" + gather_calls(check_, mine));
      }
    }
    return inner_->broadcast(data, opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t,
                                           const c10d::AllreduceOptions& o) override {
    return inner_->allreduce(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out,
                                           std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override {
    return inner_->allgather(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    return inner_->_allgather_base(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    return inner_->_reduce_scatter_base(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out,
                                                std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override {
    return inner_->reduce_scatter(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    return inner_->alltoall_base(out, in, out_splits, in_splits, o);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return inner_->send(t, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return inner_->recv(t, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    return inner_->barrier(o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    inner_->monitoredBarrier(o, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }

 private:
  c10::intrusive_ptr<c10d::Backend> inner_;
  c10::intrusive_ptr<c10d::Backend> check_;
  std::shared_ptr<std::atomic<bool>> foreign_;
};

// c10d's ProcessGroupWrapper around `inner`, checking over `check`, with the root check.
c10::intrusive_ptr<c10d::Backend> wrap_checked(const c10::intrusive_ptr<c10d::Backend>& inner,
                                               const c10::intrusive_ptr<c10d::Backend>& check,
                                               std::shared_ptr<std::atomic<bool>> foreign) {
  auto roots = c10::make_intrusive<RootCheck>(inner, check, std::move(foreign));
  return c10::make_intrusive<c10d::ProcessGroupWrapper>(roots, check);
}

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

c10d::ReduceOp to_reduce_op(int op) {
  switch (op) {
    case TDR_REDUCE_SUM:
      return c10d::ReduceOp::SUM;
    case TDR_REDUCE_AVG:
      return c10d::ReduceOp::AVG;
    case TDR_REDUCE_MIN:
      return c10d::ReduceOp::MIN;
    case TDR_REDUCE_MAX:
      return c10d::ReduceOp::MAX;
    case TDR_REDUCE_PRODUCT:
      return c10d::ReduceOp::PRODUCT;
    default:
      throw std::runtime_error("unknown reduce op code " + std::to_string(op));
  }
}

// Gloo has no AVG: it reduces with SUM and the average is taken after completion.
c10d::ReduceOp backend_reduce_op(const Route& r, int op) {
  if (op == TDR_REDUCE_AVG && r.gloo) {
    return c10d::ReduceOp::SUM;
  }
  return to_reduce_op(op);
}

void divide_by(at::Tensor& t, int64_t n) {
  if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) {
    t.div_(n);
  } else {
    t.div_(n, "trunc");
  }
}

// A host copy of `t` (synchronous: it follows what the current stream queued before).
at::Tensor host_copy(const at::Tensor& t) {
  return t.to(t.options().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true)
      .contiguous();
}

// What the backend reads: contiguous, and in host memory when staged.
at::Tensor backend_input(const at::Tensor& t, bool staged) {
  return staged ? host_copy(t) : t.contiguous();
}

// A stand-in for a user tensor the backend writes into (contiguous, in host memory when
// staged), plus the copy back. `read`: the backend also reads it (all_reduce, broadcast).
struct InOut {
  at::Tensor user;
  at::Tensor work;
  bool copy_back;
  InOut(const at::Tensor& t, bool staged, bool read = true) : user(t) {
    if (staged) {
      work = read ? host_copy(t) : at::empty(t.sizes(), t.options().device(at::kCPU));
      copy_back = true;
    } else {
      work = t.is_contiguous() ? t : t.contiguous();
      copy_back = !t.is_contiguous();
    }
  }
  void finish() {
    if (copy_back) {
      user.copy_(work);
    }
  }
};

void check_same_size(const at::Tensor& a, const at::Tensor& b, const char* what) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) {
    throw std::runtime_error(std::string(what) + ": expected a tensor of shape " +
                             c10::str(a.sizes()) + " and dtype " +
                             c10::toString(a.scalar_type()) + ", got " + c10::str(b.sizes()) +
                             " " + c10::toString(b.scalar_type()));
  }
}

TdrWork* make_work(const Route& r, c10::intrusive_ptr<c10d::Work> work,
                   std::function<void()> finish) {
  auto* w = new TdrWork();
  w->work = std::move(work);
  w->finish = std::move(finish);
  w->on_stream = !r.gloo;
  return w;
}

// The work of a reduction into `io`: on completion, Gloo's SUM is divided for AVG, then the
// result is copied back. `inputs` are kept alive until then (the backend reads them).
TdrWork* make_reduction_work(const TdrGroup& g, const Route& r, int op,
                             c10::intrusive_ptr<c10d::Work> work, std::shared_ptr<InOut> io,
                             at::Tensor inputs = at::Tensor()) {
  bool divide = op == TDR_REDUCE_AVG && r.gloo;
  int size = g.size;
  return make_work(r, std::move(work), [io, inputs, divide, size]() {
    if (divide) {
      divide_by(io->work, size);
    }
    io->finish();
  });
}

#ifdef TDR_WITH_NCCL
// tch-dist surfaces NCCL's failures and watchdog timeouts as error values from the next
// wait, as Gloo's: unless the user chose otherwise, NCCL's watchdog aborts the communicators
// and leaves the process up (CleanUpOnly) instead of PyTorch's default of taking the process
// down (SkipCleanUp). Set once, before the first ProcessGroupNCCL reads it.
void default_nccl_error_handling() {
  static std::once_flag once;
  std::call_once(once, []() { setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0); });
}

at::Device cuda_device(int device) {
  return at::Device(at::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
}
#endif

// Shuts the backends down, once: NCCL's communicators are flushed and destroyed (aborted if
// that fails), then the group lets go of both backends (Gloo's is destroyed once no autograd
// node holds it, after its queued work). Launches that follow fail with ShutDownError.
void shutdown_backends(Backends& b) {
  c10::intrusive_ptr<c10d::Backend> gloo;
  c10::intrusive_ptr<c10d::Backend> nccl;
  {
    std::unique_lock<std::shared_mutex> lock(b.mutex);
    if (b.shut_down) {
      return;
    }
    b.shut_down = true;
    gloo = std::move(b.gloo);
    nccl = std::move(b.nccl_raw);
    b.nccl.reset();
    b.gloo_check.reset();
    b.nccl_check.reset();
  }
  if (nccl) {
    try {
      nccl->shutdown();
    } catch (...) {
      try {
        nccl->abort();
      } catch (...) {
      }
    }
  }
}

// c10::Error's what() carries a C++ backtrace, and c10d logs what() when it retries (the
// TCPStore client's connect loop prints about 40 lines per try). As PyTorch's Python
// bindings do, the backtrace is left out unless TORCH_SHOW_CPP_STACKTRACES=1; c10d's one-line
// log messages stay (TORCH_CPP_LOG_LEVEL controls them).
void configure_logging() {
  static std::once_flag once;
  std::call_once(once, []() {
    const char* show = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
    if (show == nullptr || std::string(show) != "1") {
      c10::SetStackTraceFetcher([]() { return std::string(); });
    }
  });
}

// The Gloo devices PyTorch 2.11's Python binding of ProcessGroupGloo creates: one per
// comma-separated GLOO_SOCKET_IFNAME entry, else one default device (this machine's hostname,
// falling back to loopback), each with c10d's default lazy init (TORCH_GLOO_LAZY_INIT), and
// two threads per device. Collectives are spread over the devices by tag, so every rank of a
// group, PyTorch's included, must create as many. `host` (a loopback rendezvous) replaces the
// default device's address by 127.0.0.1 when GLOO_SOCKET_IFNAME is unset: same count of
// devices, an address every local peer reaches.
void add_gloo_devices(c10d::ProcessGroupGloo::Options& opts, const std::string& host) {
  bool lazy = c10d::getDefaultGlooLazyInit();
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && std::strlen(ifname) > 1) {
    std::string list(ifname);
    size_t start = 0;
    while (start <= list.size()) {
      size_t comma = list.find(',', start);
      std::string iface = list.substr(start, comma == std::string::npos ? std::string::npos
                                                                        : comma - start);
      if (!iface.empty()) {
        opts.devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface, lazy));
      }
      if (comma == std::string::npos) {
        break;
      }
      start = comma + 1;
    }
  }
  if (opts.devices.empty()) {
    opts.devices.push_back(host.empty()
                               ? c10d::ProcessGroupGloo::createDefaultDevice(lazy)
                               : c10d::ProcessGroupGloo::createDeviceForHostname(host, lazy));
  }
  opts.threads = static_cast<int>(opts.devices.size()) * 2;
}

// A Gloo backend over `store` (already prefixed, as PyTorch's `cpu/` store): its rendezvous
// waits at most `rendezvous`, then its timeout (every collective's default, the monitored
// barrier's) is `timeout`.
c10::intrusive_ptr<c10d::ProcessGroupGloo> new_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size, Millis rendezvous,
                                                    Millis timeout, const std::string& host) {
  auto opts = c10d::ProcessGroupGloo::Options::create(rendezvous);
  add_gloo_devices(*opts, host);
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  gloo->setTimeout(timeout);
  return gloo;
}

c10::intrusive_ptr<c10d::Store> prefixed(const std::string& prefix,
                                         const c10::intrusive_ptr<c10d::Store>& store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, store);
}

}  // namespace

extern "C" {

void tdr_string_free(char* s) { std::free(s); }

int tdr_last_error_kind() { return last_error_kind; }

// ---------------------------------------------------------------------------------------
// Stores
// ---------------------------------------------------------------------------------------

char* tdr_store_tcp(const char* host, uint16_t port, bool is_server, int world_size,
                    int64_t connect_timeout_ms, int64_t timeout_ms, TdrStore** out) {
  TDR_TRY
  configure_logging();
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.isServer = is_server;
  opts.numWorkers = world_size;
  opts.waitWorkers = false;
  opts.timeout = Millis(connect_timeout_ms);
  auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
  store->setTimeout(Millis(timeout_ms));
  *out = new TdrStore{store};
  TDR_CATCH
}

// The TCPStore handshake of PyTorch's `wait_for_workers=True` (c10d's waitForWorkers): the
// rank adds 1 to the store's own worker count (`init/`, a key outside the TCPStore's "/"
// key prefix that Store::add cannot reach); the server then waits, at most `timeout_ms`,
// until the count reaches the world size. The store's timeout is restored afterwards.
char* tdr_store_check_in(TdrStore* s, int64_t timeout_ms) {
  TDR_TRY
  auto* tcp = dynamic_cast<c10d::TCPStore*>(s->store.get());
  if (tcp == nullptr) {
    throw std::runtime_error("the worker check-in needs a TCPStore");
  }
  auto before = tcp->getTimeout();
  tcp->setTimeout(Millis(std::max<int64_t>(timeout_ms, 1)));
  try {
    tcp->waitForWorkers();
  } catch (...) {
    tcp->setTimeout(before);
    throw;
  }
  tcp->setTimeout(before);
  TDR_CATCH
}

char* tdr_store_prefix(TdrStore* base, const char* prefix, TdrStore** out) {
  TDR_TRY
  auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), base->store);
  *out = new TdrStore{store};
  TDR_CATCH
}

char* tdr_store_set(TdrStore* s, const char* key, const uint8_t* data, size_t len) {
  TDR_TRY
  s->store->set(std::string(key), std::vector<uint8_t>(data, data + len));
  TDR_CATCH
}

// Blocks until `key` exists (up to the store's timeout); the value is malloc'ed for Rust.
char* tdr_store_get(TdrStore* s, const char* key, uint8_t** data, size_t* len) {
  TDR_TRY
  auto value = s->store->get(std::string(key));
  *len = value.size();
  *data = static_cast<uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
  if (*data == nullptr) {
    throw std::runtime_error("out of memory");
  }
  if (!value.empty()) {
    std::memcpy(*data, value.data(), value.size());
  }
  TDR_CATCH
}

char* tdr_store_add(TdrStore* s, const char* key, int64_t delta, int64_t* out) {
  TDR_TRY
  *out = s->store->add(std::string(key), delta);
  TDR_CATCH
}

char* tdr_store_compare_set(TdrStore* s, const char* key, const uint8_t* expected,
                            size_t expected_len, const uint8_t* desired, size_t desired_len,
                            uint8_t** data, size_t* len) {
  TDR_TRY
  auto value = s->store->compareSet(std::string(key),
                                    std::vector<uint8_t>(expected, expected + expected_len),
                                    std::vector<uint8_t>(desired, desired + desired_len));
  *len = value.size();
  *data = static_cast<uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
  if (*data == nullptr) {
    throw std::runtime_error("out of memory");
  }
  if (!value.empty()) {
    std::memcpy(*data, value.data(), value.size());
  }
  TDR_CATCH
}

char* tdr_store_check(TdrStore* s, const char* key, bool* out) {
  TDR_TRY
  *out = s->store->check({std::string(key)});
  TDR_CATCH
}

void tdr_bytes_free(uint8_t* data) { std::free(data); }

void tdr_store_free(TdrStore* s) { delete s; }

// ---------------------------------------------------------------------------------------
// CUDA devices
// ---------------------------------------------------------------------------------------

// torch.cuda.set_device: the calling thread's current CUDA device.
char* tdr_cuda_set_device(int device) {
  TDR_TRY
#ifdef TDR_WITH_NCCL
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
#else
  (void)device;
  throw std::runtime_error("tch-dist was built without CUDA support (no NCCL headers)");
#endif
  TDR_CATCH
}

// The GPU's UUID as nvidia-smi prints it ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"):
// the same physical GPU has the same UUID whatever CUDA_VISIBLE_DEVICES calls it.
char* tdr_cuda_device_uuid(int device, char** out) {
  TDR_TRY
#ifdef TDR_WITH_NCCL
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
  const auto* b = reinterpret_cast<const unsigned char*>(prop->uuid.bytes);
  char text[64];
  std::snprintf(text, sizeof(text),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  *out = dup_message(text);
  if (*out == nullptr) {
    throw std::runtime_error("out of memory");
  }
#else
  (void)device;
  (void)out;
  throw std::runtime_error("tch-dist was built without CUDA support (no NCCL headers)");
#endif
  TDR_CATCH
}

// ---------------------------------------------------------------------------------------
// Process groups
// ---------------------------------------------------------------------------------------

bool tdr_nccl_compiled() {
#ifdef TDR_WITH_NCCL
  return true;
#else
  return false;
#endif
}

// `store` is the group's store, PyTorch's `PrefixStore(f"{group_name}/", default store)`; as
// PyTorch's _new_process_group_helper, each backend gets `PrefixStore(f"{device}/")` over
// it (`cpu/` for Gloo, `cuda/` for NCCL), and with DETAIL the wrapper's helper Gloo group
// `PrefixStore(f"pg_wrapper:{group_name}")` over that. `gloo_host` names the address Gloo
// binds to when GLOO_SOCKET_IFNAME is unset; empty means c10d's default device (this
// machine's hostname, falling back to loopback). A `device` of 0 or more becomes this
// thread's current CUDA device (torch.cuda.set_device) and NCCL's bound device
// (init_process_group's device_id); NCCL connects lazily, at the first collective, unless
// tdr_group_connect is called. Without `with_gloo` (PyTorch's "nccl") there is no Gloo
// backend: CPU tensors are refused and barriers go through NCCL.
char* tdr_group_new(TdrStore* store, const char* group_name, int rank, int size,
                    int64_t timeout_ms, int64_t rendezvous_ms, const char* gloo_host,
                    bool with_gloo, bool with_nccl, int device, bool cuda_via_gloo, bool detail,
                    TdrGroup** out) {
  TDR_TRY
  configure_logging();
  auto timeout = Millis(timeout_ms);
  auto deadline = std::chrono::steady_clock::now() + Millis(rendezvous_ms);
  // What is left of the rendezvous' time (at least a millisecond: 0 reads as "no limit").
  auto left = [deadline]() {
    auto d = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
    return std::max(d, Millis(1));
  };
  if (device >= 0) {
    char* err = tdr_cuda_set_device(device);
    if (err != nullptr) {
      std::string msg(err);
      std::free(err);
      throw std::runtime_error("binding CUDA device " + std::to_string(device) + ": " + msg);
    }
  }
  std::string host(gloo_host);
  std::string wrapper_prefix = std::string("pg_wrapper:") + group_name;
  auto backends = std::make_shared<Backends>();
  if (with_gloo || cuda_via_gloo) {
    auto cpu_store = prefixed("cpu/", store->store);
    backends->gloo = new_gloo(cpu_store, rank, size, left(), timeout, host);
    if (detail) {
      // The checks' own Gloo backend (PyTorch's helper group of
      // TORCH_DISTRIBUTED_DEBUG=DETAIL), so that their traffic never interleaves with the
      // collectives they check.
      backends->gloo_check =
          new_gloo(prefixed(wrapper_prefix, cpu_store), rank, size, left(), timeout, host);
      backends->gloo = wrap_checked(backends->gloo, backends->gloo_check, backends->foreign);
    }
  }
  if (with_nccl && !cuda_via_gloo) {
#ifdef TDR_WITH_NCCL
    if (device < 0) {
      throw std::runtime_error("an NCCL group needs a CUDA device to bind");
    }
    default_nccl_error_handling();
    auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
    nccl_opts->timeout = timeout;
    nccl_opts->is_high_priority_stream = false;
    nccl_opts->group_name = group_name;
    auto cuda_store = prefixed("cuda/", store->store);
    backends->nccl_raw =
        c10::make_intrusive<c10d::ProcessGroupNCCL>(cuda_store, rank, size, nccl_opts);
    backends->nccl_raw->setBoundDeviceId(cuda_device(device));
    backends->nccl = backends->nccl_raw;
    if (detail) {
      backends->nccl_check =
          new_gloo(prefixed(wrapper_prefix, cuda_store), rank, size, left(), timeout, host);
      backends->nccl = wrap_checked(backends->nccl_raw, backends->nccl_check, backends->foreign);
    }
#else
    throw std::runtime_error("tch-dist was built without NCCL support");
#endif
  }
  if (!backends->gloo && !backends->nccl) {
    throw std::runtime_error("a process group needs a Gloo or an NCCL backend");
  }
  *out = new TdrGroup{rank, size, timeout, device, cuda_via_gloo, std::move(backends)};
  TDR_CATCH
}

// init_process_group's eager init: NCCL creates its communicator on the bound device now
// (ncclCommInitRank with every rank) instead of at the first collective. A group without
// NCCL has nothing to connect.
char* tdr_group_connect(TdrGroup* g) {
  TDR_TRY
  Route r = lock_backends(*g);
#ifdef TDR_WITH_NCCL
  if (g->backends->nccl) {
    g->backends->nccl_raw->eagerConnectSingleDevice(cuda_device(g->device));
  }
#endif
  TDR_CATCH
}

// DETAIL in a job with ranks that are not tch-dist's: c10d's checks only (see Backends).
char* tdr_group_set_foreign_peers(TdrGroup* g, bool foreign) {
  TDR_TRY
  g->backends->foreign->store(foreign);
  TDR_CATCH
}

// Shuts the backends down now, whoever else holds the group (see shutdown_backends).
char* tdr_group_shutdown(TdrGroup* g) {
  TDR_TRY
  shutdown_backends(*g->backends);
  TDR_CATCH
}

void tdr_group_free(TdrGroup* g) {
  if (g == nullptr) {
    return;
  }
  try {
    shutdown_backends(*g->backends);
  } catch (...) {
    // Shutting down a broken communicator may throw; the group is going away regardless.
  }
  delete g;
}

// ---------------------------------------------------------------------------------------
// Collectives: each returns a TdrWork for `tdr_work_wait`.
// ---------------------------------------------------------------------------------------

char* tdr_all_reduce(TdrGroup* g, at::Tensor* t, int op, TdrWork** out) {
  TDR_TRY
  Route r = route(*g, *t);
  auto io = std::make_shared<InOut>(*t, r.staged);
  std::vector<at::Tensor> tensors{io->work};
  c10d::AllreduceOptions opts;
  opts.reduceOp = backend_reduce_op(r, op);
  opts.timeout = g->timeout;
  auto work = checked(*g, r, {"all_reduce", tensors},
                      [&]() { return r.backend->allreduce(tensors, opts); });
  *out = make_reduction_work(*g, r, op, work, io);
  TDR_CATCH
}

char* tdr_broadcast(TdrGroup* g, at::Tensor* t, int root, TdrWork** out) {
  TDR_TRY
  Route r = route(*g, *t);
  auto io = std::make_shared<InOut>(*t, r.staged);
  std::vector<at::Tensor> tensors{io->work};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = g->timeout;
  auto work = checked(*g, r, {"broadcast", tensors, root},
                      [&]() { return r.backend->broadcast(tensors, opts); });
  *out = make_work(r, work, [io]() { io->finish(); });
  TDR_CATCH
}

// List form: outputs[i] receives rank i's input.
char* tdr_all_gather(TdrGroup* g, at::Tensor** outputs, size_t n, at::Tensor* input,
                     TdrWork** out) {
  TDR_TRY
  if (static_cast<int>(n) != g->size) {
    throw std::runtime_error("all_gather: expected " + std::to_string(g->size) +
                             " output tensors (one per rank), got " + std::to_string(n));
  }
  Route r = route(*g, *input);
  std::vector<std::shared_ptr<InOut>> ios;
  std::vector<std::vector<at::Tensor>> outs(1);
  for (size_t i = 0; i < n; ++i) {
    check_same_size(*input, *outputs[i], "all_gather output");
    ios.push_back(std::make_shared<InOut>(*outputs[i], r.staged, /*read=*/false));
    outs[0].push_back(ios.back()->work);
  }
  std::vector<at::Tensor> ins{backend_input(*input, r.staged)};
  c10d::AllgatherOptions opts;
  opts.timeout = g->timeout;
  auto work = checked(*g, r, {"all_gather", ins},
                      [&]() { return r.backend->allgather(outs, ins, opts); });
  *out = make_work(r, work, [ios, ins]() {
    for (auto& io : ios) {
      io->finish();
    }
  });
  TDR_CATCH
}

// Flat form: `output` has world_size times the rows of `input` (dim 0).
char* tdr_all_gather_flat(TdrGroup* g, at::Tensor* output, at::Tensor* input, TdrWork** out) {
  TDR_TRY
  Route r = route(*g, *input);
  if (output->scalar_type() != input->scalar_type() ||
      output->numel() != input->numel() * g->size || output->dim() == 0 ||
      output->size(0) != (input->dim() == 0 ? 1 : input->size(0)) * g->size) {
    throw std::runtime_error("all_gather_into_tensor: output must have world_size (" +
                             std::to_string(g->size) + ") times the rows of the input " +
                             c10::str(input->sizes()) + " and its dtype, got " +
                             c10::str(output->sizes()));
  }
  auto io = std::make_shared<InOut>(*output, r.staged, /*read=*/false);
  at::Tensor in = backend_input(*input, r.staged);
  c10d::AllgatherOptions opts;
  opts.timeout = g->timeout;
  auto work = checked(*g, r, {"all_gather_into_tensor", {in}},
                      [&]() { return r.backend->_allgather_base(io->work, in, opts); });
  *out = make_work(r, work, [io, in]() { io->finish(); });
  TDR_CATCH
}

// List form: rank r receives the reduction of every rank's inputs[r]. The backend's own list
// reduce_scatter, as torch.distributed.reduce_scatter calls it, so that a PyTorch rank's list
// form meets this one on the wire.
char* tdr_reduce_scatter(TdrGroup* g, at::Tensor* output, at::Tensor** inputs, size_t n,
                         int op, TdrWork** out) {
  TDR_TRY
  if (static_cast<int>(n) != g->size) {
    throw std::runtime_error("reduce_scatter: expected " + std::to_string(g->size) +
                             " input tensors (one per rank), got " + std::to_string(n));
  }
  Route r = route(*g, *output);
  std::vector<std::vector<at::Tensor>> ins(1);
  for (size_t i = 0; i < n; ++i) {
    check_same_size(*output, *inputs[i], "reduce_scatter input");
    ins[0].push_back(backend_input(*inputs[i], r.staged));
  }
  auto io = std::make_shared<InOut>(*output, r.staged, /*read=*/false);
  std::vector<at::Tensor> outs{io->work};
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = backend_reduce_op(r, op);
  opts.timeout = g->timeout;
  std::vector<at::Tensor> fingerprint{io->work};
  auto work = checked(*g, r, {"reduce_scatter", fingerprint},
                      [&]() { return r.backend->reduce_scatter(outs, ins, opts); });
  // As make_reduction_work, keeping the inputs alive until the backend is done with them.
  bool divide = op == TDR_REDUCE_AVG && r.gloo;
  int size = g->size;
  *out = make_work(r, work, [io, ins, divide, size]() {
    if (divide) {
      divide_by(io->work, size);
    }
    io->finish();
  });
  TDR_CATCH
}

// Flat form: `input` has world_size times the rows of `output` (dim 0).
char* tdr_reduce_scatter_flat(TdrGroup* g, at::Tensor* output, at::Tensor* input, int op,
                              TdrWork** out) {
  TDR_TRY
  Route r = route(*g, *output);
  if (output->scalar_type() != input->scalar_type() ||
      input->numel() != output->numel() * g->size) {
    throw std::runtime_error("reduce_scatter_tensor: input must have world_size (" +
                             std::to_string(g->size) + ") times the elements of the output " +
                             c10::str(output->sizes()) + " and its dtype, got " +
                             c10::str(input->sizes()));
  }
  auto io = std::make_shared<InOut>(*output, r.staged, /*read=*/false);
  at::Tensor in = backend_input(*input, r.staged);
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = backend_reduce_op(r, op);
  opts.timeout = g->timeout;
  auto work = checked(*g, r, {"reduce_scatter_tensor", {in, io->work}},
                      [&]() { return r.backend->_reduce_scatter_base(io->work, in, opts); });
  *out = make_reduction_work(*g, r, op, work, io, in);
  TDR_CATCH
}

// Equal splits along dim 0: chunk j of rank i's input lands in chunk i of rank j's output.
char* tdr_all_to_all(TdrGroup* g, at::Tensor* output, at::Tensor* input, TdrWork** out) {
  TDR_TRY
  Route r = route(*g, *input);
  check_same_size(*input, *output, "all_to_all output");
  if (input->dim() == 0 || input->size(0) % g->size != 0) {
    throw std::runtime_error("all_to_all: dim 0 of the input " + c10::str(input->sizes()) +
                             " must be divisible by the world size " +
                             std::to_string(g->size));
  }
  auto io = std::make_shared<InOut>(*output, r.staged, /*read=*/false);
  at::Tensor in = backend_input(*input, r.staged);
  std::vector<int64_t> splits;
  c10d::AllToAllOptions opts;
  opts.timeout = g->timeout;
  auto work = checked(*g, r, {"all_to_all", {}}, [&]() {
    return r.backend->alltoall_base(io->work, in, splits, splits, opts);
  });
  *out = make_work(r, work, [io, in]() { io->finish(); });
  TDR_CATCH
}

char* tdr_send(TdrGroup* g, at::Tensor* t, int dst, int tag, TdrWork** out) {
  TDR_TRY
  Route r = route(*g, *t);
  std::vector<at::Tensor> tensors{backend_input(*t, r.staged)};
  auto work = r.backend->send(tensors, dst, tag);
  *out = make_work(r, work, [tensors]() {});
  TDR_CATCH
}

char* tdr_recv(TdrGroup* g, at::Tensor* t, int src, int tag, TdrWork** out) {
  TDR_TRY
  Route r = route(*g, *t);
  auto io = std::make_shared<InOut>(*t, r.staged, /*read=*/false);
  std::vector<at::Tensor> tensors{io->work};
  auto work = r.backend->recv(tensors, src, tag);
  *out = make_work(r, work, [io]() { io->finish(); });
  TDR_CATCH
}

char* tdr_barrier(TdrGroup* g, TdrWork** out) {
  TDR_TRY
  Route r = route_barrier(*g);
  c10d::BarrierOptions opts;
  opts.timeout = g->timeout;
  auto work = checked(*g, r, {"barrier", {}}, [&]() { return r.backend->barrier(opts); });
  *out = make_work(r, work, []() {});
  TDR_CATCH
}

// Gloo's monitored barrier: on timeout its message names the ranks that did not arrive.
char* tdr_monitored_barrier(TdrGroup* g, int64_t timeout_ms, bool wait_all_ranks) {
  TDR_TRY
  c10::intrusive_ptr<c10d::Backend> gloo = route_gloo(*g, "monitored_barrier").backend;
  c10d::BarrierOptions opts;
  opts.timeout = Millis(timeout_ms);
  gloo->monitoredBarrier(opts, wait_all_ranks);
  TDR_CATCH
}

// A wait that ends with the work still pending is a timeout (TDR_ERROR_TIMEOUT), and the
// work may be waited on again. Gloo's works are waited on the CPU: c10d's Work::wait throws
// when the time passes. NCCL's are waited on the caller's current stream (WorkNCCL::wait
// without a timeout: the stream waits for NCCL's end event, the CPU does not); a timeout
// given to WorkNCCL::wait would block the CPU and abort the communicator when it passes, so
// a CPU-bounded wait polls for completion first. A failure or a watchdog timeout that NCCL
// recorded on the work is thrown by WorkNCCL::wait.
char* tdr_work_wait(TdrWork* w, int64_t timeout_ms, bool cpu_bound) {
  TDR_TRY
  if (!w->finished) {
    if (w->on_stream) {
      if (cpu_bound) {
        auto deadline = std::chrono::steady_clock::now() + Millis(timeout_ms);
        while (!w->work->isCompleted()) {
          if (std::chrono::steady_clock::now() >= deadline) {
            return fail(TDR_ERROR_TIMEOUT, "the wait ended before the work completed");
          }
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
      w->work->wait(kNoTimeout);
    } else {
      bool done = false;
      try {
        done = w->work->wait(Millis(std::max<int64_t>(timeout_ms, 1)));
      } catch (const std::exception& e) {
        // Only c10d's own "Operation timed out!" is this wait ending early: some of Gloo's
        // works (reduce_scatter_tensor's) throw a failed peer's error before they count as
        // completed, and that error must reach the caller as what it is.
        const bool wait_ended = std::strstr(e.what(), "Operation timed out!") != nullptr;
        if (wait_ended && !w->work->isCompleted()) {
          return fail(TDR_ERROR_TIMEOUT, "the wait ended before the work completed");
        }
        throw;
      }
      if (!done) {
        return fail(TDR_ERROR_TIMEOUT, "the wait ended before the work completed");
      }
    }
    w->finished = true;
    if (w->finish) {
      w->finish();
    }
  }
  TDR_CATCH
}

bool tdr_work_on_stream(TdrWork* w) { return w->on_stream; }

bool tdr_work_is_completed(TdrWork* w) {
  try {
    return w->work->isCompleted();
  } catch (...) {
    return true;
  }
}

void tdr_work_free(TdrWork* w) { delete w; }

}  // extern "C"

// ---------------------------------------------------------------------------------------
// Autograd: gradient-ready hooks and end-of-backward callbacks (the reducer's triggers).
// ---------------------------------------------------------------------------------------

struct TdrHook {
  // Held so the accumulator (and the hook in it) lives as long as the registration.
  std::shared_ptr<torch::autograd::Node> accumulator;
  uintptr_t key;
};

namespace {

void call_or_throw(TdrCallback cb, void* ctx, size_t index) {
  char* err = cb(ctx, index);
  if (err != nullptr) {
    std::string msg(err);
    std::free(err);
    throw std::runtime_error(msg);
  }
}

}  // namespace

extern "C" {

// Runs `cb(ctx, index)` right after autograd has accumulated `param`'s gradient.
char* tdr_add_grad_ready_hook(at::Tensor* param, TdrCallback cb, void* ctx, size_t index,
                              TdrHook** out) {
  TDR_TRY
  if (!param->requires_grad() || !param->is_leaf()) {
    throw std::runtime_error("only leaf tensors that require grad have a gradient accumulator");
  }
  auto acc = torch::autograd::impl::grad_accumulator(*param);
  if (!acc) {
    throw std::runtime_error("tensor has no gradient accumulator");
  }
  auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [cb, ctx, index](const torch::autograd::variable_list& outputs,
                       const torch::autograd::variable_list& /*inputs*/) {
        call_or_throw(cb, ctx, index);
        return outputs;
      }));
  *out = new TdrHook{acc, key};
  TDR_CATCH
}

void tdr_hook_remove(TdrHook* h) {
  if (h == nullptr) {
    return;
  }
  try {
    h->accumulator->del_post_hook(h->key);
  } catch (...) {
  }
  delete h;
}

// Queues `cb(ctx, index)` to run once at the end of the backward pass that is running on
// this thread (call it from a gradient-ready hook).
char* tdr_queue_end_of_backward(TdrCallback cb, void* ctx, size_t index) {
  TDR_TRY
  torch::autograd::Engine::get_default_engine().queue_callback(
      [cb, ctx, index]() { call_or_throw(cb, ctx, index); });
  TDR_CATCH
}

// Makes `grad` the `.grad` of `param` (gradient_as_bucket_view), or clears it when null.
char* tdr_set_grad(at::Tensor* param, at::Tensor* grad) {
  TDR_TRY
  if (grad == nullptr) {
    param->mutable_grad() = at::Tensor();
  } else {
    param->mutable_grad() = *grad;
  }
  TDR_CATCH
}

}  // extern "C"

// ---------------------------------------------------------------------------------------
// Fully sharded parameters (fully_shard). Between steps a parameter holds its shard; during
// its group's forward and backward it holds the gathered full tensor. Its gradient must not
// land in `.grad` (which keeps the shard's shape for the optimizer): a pre-hook on the
// gradient accumulator hands the full gradient to Rust and passes on an undefined tensor,
// which AccumulateGrad skips. The accumulator is made while the parameter is full-sized and
// held by the registration, so autograd checks gradients against the full shape. The full
// tensor's memory is released between uses by shrinking its storage to nothing and given
// back before the next use, so tensors autograd saved (views of it) see the refilled values.
// ---------------------------------------------------------------------------------------

namespace {

// A Rust context shared by the hooks that call into it: released (ctx's `release`) when the
// last hook holding it is destroyed, which may be after Rust dropped its own handle.
using SharedContext = std::shared_ptr<void>;

void call_grad_or_throw(TdrGradCallback cb, void* ctx, size_t index, const at::Tensor& grad) {
  at::Tensor handle = grad;
  char* err = cb(ctx, index, &handle);
  if (err != nullptr) {
    std::string msg(err);
    std::free(err);
    throw std::runtime_error(msg);
  }
}

struct GradInterceptor : torch::autograd::FunctionPreHook {
  TdrGradCallback cb;
  SharedContext ctx;
  size_t index;
  GradInterceptor(TdrGradCallback cb, SharedContext ctx, size_t index)
      : cb(cb), ctx(std::move(ctx)), index(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!grads.empty() && grads[0].defined()) {
      call_grad_or_throw(cb, ctx.get(), index, grads[0]);
    }
    // AccumulateGrad returns without touching `.grad` for an undefined gradient.
    return torch::autograd::variable_list(grads.size());
  }
};

}  // namespace

struct TdrInterceptor {
  std::shared_ptr<torch::autograd::Node> accumulator;
  const GradInterceptor* hook;
};

extern "C" {

char* tdr_add_grad_interceptor(at::Tensor* param, TdrGradCallback cb, void* ctx,
                               TdrRelease release, size_t index, TdrInterceptor** out) {
  TDR_TRY
  SharedContext shared(ctx, release);
  if (!param->requires_grad() || !param->is_leaf()) {
    throw std::runtime_error("only leaf tensors that require grad have a gradient accumulator");
  }
  auto acc = torch::autograd::impl::grad_accumulator(*param);
  if (!acc) {
    throw std::runtime_error("tensor has no gradient accumulator");
  }
  auto hook = std::make_unique<GradInterceptor>(cb, std::move(shared), index);
  const GradInterceptor* raw = hook.get();
  acc->add_pre_hook(std::move(hook));
  *out = new TdrInterceptor{std::move(acc), raw};
  TDR_CATCH
}

void tdr_interceptor_remove(TdrInterceptor* h) {
  if (h == nullptr) {
    return;
  }
  try {
    auto& hooks = h->accumulator->pre_hooks();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [h](const std::unique_ptr<torch::autograd::FunctionPreHook>& p) {
                                 return p.get() == h->hook;
                               }),
                hooks.end());
  } catch (...) {
  }
  delete h;
}

char* tdr_add_output_grad_hook(at::Tensor* output, TdrGradCallback cb, void* ctx,
                               TdrRelease release, size_t index) {
  TDR_TRY
  SharedContext shared(ctx, release);
  if (!output->requires_grad()) {
    throw std::runtime_error("the tensor does not require grad");
  }
  output->register_hook([cb, shared, index](const at::Tensor& grad) {
    call_grad_or_throw(cb, shared.get(), index, grad);
  });
  TDR_CATCH
}

char* tdr_storage_release(at::Tensor* t) {
  TDR_TRY
  c10::StorageImpl* st = t->storage().unsafeGetStorageImpl();
  c10::Allocator* alloc = st->allocator();
  if (alloc == nullptr) {
    alloc = c10::GetAllocator(t->device().type());
  }
  st->set_data_ptr_noswap(alloc->allocate(0));
  st->set_nbytes(0);
  TDR_CATCH
}

char* tdr_storage_restore(at::Tensor* t) {
  TDR_TRY
  c10::StorageImpl* st = t->storage().unsafeGetStorageImpl();
  const size_t needed = (t->storage_offset() + t->numel()) * t->element_size();
  if (st->nbytes() < needed) {
    c10::Allocator* alloc = st->allocator();
    if (alloc == nullptr) {
      alloc = c10::GetAllocator(t->device().type());
    }
    st->set_data_ptr_noswap(alloc->allocate(needed));
    st->set_nbytes(needed);
  }
  TDR_CATCH
}

size_t tdr_storage_nbytes(at::Tensor* t) {
  try {
    return t->storage().nbytes();
  } catch (...) {
    return 0;
  }
}

char* tdr_set_data_keep_accumulator(at::Tensor* param, at::Tensor* data) {
  TDR_TRY
  c10::TensorImpl* impl = param->unsafeGetTensorImpl();
  if (!impl->has_compatible_shallow_copy_type(data->key_set())) {
    throw std::runtime_error("set_data: the new data is of an incompatible tensor type");
  }
  // What Tensor::set_data does, without resetting the gradient accumulator on a dtype
  // change.
  impl->shallow_copy_from(data->getIntrusivePtr());
  TDR_CATCH
}

uint64_t tdr_tensor_version(at::Tensor* t) {
  try {
    return static_cast<uint64_t>(t->_version());
  } catch (...) {
    return UINT64_MAX;
  }
}

uint64_t tdr_tensor_identity(at::Tensor* t) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t->unsafeGetTensorImpl()));
}

}  // extern "C"

// ---------------------------------------------------------------------------------------
// Use guards. The parameters of a module that an API hooked (a sharded layer) give wrong
// results when the module runs without its hooks (`x.apply(&layer)`), so every autograd use
// of them must come from inside a hooked call. A call's pre-hook takes a mark (autograd's
// sequence number on its thread); its forward hook claims the uses made since: the nodes
// reachable from the output, made on this thread at or after the mark, with an edge into a
// guarded parameter's gradient accumulator get a ClaimMarker (a pre-hook that does
// nothing) naming those accumulators. A pre-hook on every guarded accumulator checks, once
// per graph task and before any guarded gradient is accumulated, that every edge into a
// guarded accumulator among the task's nodes is claimed; otherwise it fails the backward
// pass with the guard's message. tdr_guard_first_unclaimed runs the same check over an
// output's graph in forward. The check is a scan of the graph task's nodes, like the
// engine's own dependency count.
// ---------------------------------------------------------------------------------------

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// Marks a node whose edges into `accumulators` are claimed uses.
struct ClaimMarker : torch::autograd::FunctionPreHook {
  std::vector<const Node*> accumulators;
  variable_list operator()(const variable_list& grads) override { return grads; }
};

// The check, on each guarded accumulator; `guard` identifies the registration to remove.
struct GuardCheck : torch::autograd::FunctionPreHook {
  const TdrGuard* guard;
  explicit GuardCheck(const TdrGuard* g) : guard(g) {}
  variable_list operator()(const variable_list& grads) override;
};

}  // namespace

struct TdrGuard {
  uint64_t serial;  // creation order: the first guard in it is reported first
  // Held so each accumulator (and so its address and hook) lives as long as the guard.
  std::vector<std::shared_ptr<Node>> accumulators;
  std::unordered_map<const Node*, size_t> index;  // accumulator -> parameter position
  TdrCallback cb;
  void* ctx;
};

namespace {

struct Guarded {
  TdrGuard* guard;
  size_t index;
};

std::mutex guards_mutex;
std::atomic<uint64_t> next_guard_serial{0};
// The last graph task checked (get_current_graph_task_id).
std::atomic<int> last_checked_task{-1};

// Every guarded accumulator (under guards_mutex); leaked, so that it outlives static
// destruction order.
std::unordered_map<const Node*, Guarded>& guarded() {
  static auto* map = new std::unordered_map<const Node*, Guarded>();
  return *map;
}

bool is_claimed(const Node& node, const Node* accumulator) {
  for (const auto& hook : node.pre_hooks()) {
    auto* marker = dynamic_cast<const ClaimMarker*>(hook.get());
    if (marker != nullptr &&
        std::find(marker->accumulators.begin(), marker->accumulators.end(), accumulator) !=
            marker->accumulators.end()) {
      return true;
    }
  }
  return false;
}

// Calls visit(node) for each node `output` depends on that this thread made at or after
// `mark` (nodes made before the call, on other threads, and accumulators end the walk).
template <typename F>
void walk_since(const at::Tensor& output, uint64_t mark, F&& visit) {
  std::shared_ptr<Node> root = output.defined() ? output.grad_fn() : nullptr;
  if (!root) {
    return;
  }
  const uint64_t thread = at::RecordFunction::currentThreadId();
  std::vector<Node*> stack{root.get()};
  std::unordered_set<Node*> seen;
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) {
      continue;
    }
    const uint64_t nr = node->sequence_nr();
    if (nr == UINT64_MAX || nr < mark || node->thread_id() != thread) {
      continue;
    }
    visit(*node);
    for (const auto& edge : node->next_edges()) {
      if (edge.function) {
        stack.push_back(edge.function.get());
      }
    }
  }
}

// The unclaimed use to report among `nodes`: the guard made first, its first parameter
// (only guards `accept` takes). Under guards_mutex.
template <typename Nodes, typename Accept>
const Guarded* first_unclaimed(const Nodes& nodes, Accept&& accept) {
  const Guarded* worst = nullptr;
  for (const Node* node : nodes) {
    for (const auto& edge : node->next_edges()) {
      const Node* acc = edge.function.get();
      if (acc == nullptr) {
        continue;
      }
      auto it = guarded().find(acc);
      if (it == guarded().end() || !accept(it->second.guard) || is_claimed(*node, acc)) {
        continue;
      }
      const Guarded& g = it->second;
      if (worst == nullptr || g.guard->serial < worst->guard->serial ||
          (g.guard == worst->guard && g.index < worst->index)) {
        worst = &g;
      }
    }
  }
  return worst;
}

variable_list GuardCheck::operator()(const variable_list& grads) {
  const int task = torch::autograd::get_current_graph_task_id();
  if (task < 0 || last_checked_task.exchange(task) == task) {
    return grads;  // checked already (every guarded accumulator of the task runs this)
  }
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (nodes == nullptr) {
    return grads;
  }
  std::string message = "a guarded parameter was used outside its module's hooked call";
  {
    // The message is built under the lock, so the guard cannot be freed meanwhile.
    std::lock_guard<std::mutex> lock(guards_mutex);
    const Guarded* found = first_unclaimed(*nodes, [](const TdrGuard*) { return true; });
    if (found == nullptr) {
      return grads;
    }
    char* text = found->guard->cb(found->guard->ctx, found->index);
    if (text != nullptr) {
      message = text;
      std::free(text);
    }
  }
  throw std::runtime_error(message);
}

}  // namespace

extern "C" {

uint64_t tdr_autograd_mark(void) { return at::sequence_number::peek(); }

char* tdr_guard_new(at::Tensor** params, size_t n, TdrCallback cb, void* ctx, TdrGuard** out) {
  TDR_TRY
  auto guard = std::make_unique<TdrGuard>();
  guard->serial = next_guard_serial.fetch_add(1);
  guard->cb = cb;
  guard->ctx = ctx;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = *params[i];
    if (!p.requires_grad() || !p.is_leaf()) {
      throw std::runtime_error("only leaf tensors that require grad can be guarded");
    }
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (!acc) {
      throw std::runtime_error("tensor has no gradient accumulator");
    }
    guard->index.emplace(acc.get(), i);
    guard->accumulators.push_back(std::move(acc));
  }
  std::lock_guard<std::mutex> lock(guards_mutex);
  for (const auto& acc : guard->accumulators) {
    acc->add_pre_hook(std::make_unique<GuardCheck>(guard.get()));
    guarded()[acc.get()] = Guarded{guard.get(), guard->index.at(acc.get())};
  }
  *out = guard.release();
  TDR_CATCH
}

char* tdr_guard_claim(TdrGuard* g, at::Tensor* output, uint64_t mark) {
  TDR_TRY
  std::lock_guard<std::mutex> lock(guards_mutex);
  walk_since(*output, mark, [g](Node& node) {
    std::vector<const Node*> mine;
    for (const auto& edge : node.next_edges()) {
      const Node* acc = edge.function.get();
      const bool ours = acc != nullptr &&
                        (g != nullptr ? g->index.count(acc) > 0 : guarded().count(acc) > 0);
      if (ours && !is_claimed(node, acc)) {
        mine.push_back(acc);
      }
    }
    if (!mine.empty()) {
      auto marker = std::make_unique<ClaimMarker>();
      marker->accumulators = std::move(mine);
      node.add_pre_hook(std::move(marker));
    }
  });
  TDR_CATCH
}

char* tdr_guard_first_unclaimed(TdrGuard** guards, size_t n, at::Tensor* output,
                                uint64_t mark, size_t* guard, size_t* index) {
  TDR_TRY
  *guard = SIZE_MAX;
  *index = 0;
  std::vector<const Node*> nodes;
  walk_since(*output, mark, [&nodes](Node& node) { nodes.push_back(&node); });
  std::lock_guard<std::mutex> lock(guards_mutex);
  auto position = [guards, n](const TdrGuard* g) {
    return static_cast<size_t>(std::find(guards, guards + n, g) - guards);
  };
  const Guarded* found =
      first_unclaimed(nodes, [&](const TdrGuard* g) { return position(g) < n; });
  if (found != nullptr) {
    *guard = position(found->guard);
    *index = found->index;
  }
  TDR_CATCH
}

void tdr_guard_free(TdrGuard* g) {
  if (g == nullptr) {
    return;
  }
  try {
    std::lock_guard<std::mutex> lock(guards_mutex);
    for (const auto& acc : g->accumulators) {
      auto it = guarded().find(acc.get());
      if (it != guarded().end() && it->second.guard == g) {
        guarded().erase(it);
      }
      auto& hooks = acc->pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                 [g](const std::unique_ptr<torch::autograd::FunctionPreHook>& h) {
                                   auto* check = dynamic_cast<GuardCheck*>(h.get());
                                   return check != nullptr && check->guard == g;
                                 }),
                  hooks.end());
    }
  } catch (...) {
  }
  delete g;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------
// Shard fences (src/shard_fence.rs). A parameter an API keeps as this rank's shard (a
// fully_shard parameter between its uses, a tensor-parallel layer's weight) gives a wrong
// result when an op uses it without the API's hooks (`layer.forward(&x)`), under `no_grad`
// too, where autograd records nothing for the use guards to see. While a thread runs a
// hooked call of such an API, the dispatch key kFenceKey is in its thread-local included
// set, so every op on that thread goes first through `fence_fallback`: an op whose tensor
// arguments include an armed parameter (one that holds only its shard now) not opened on
// this thread (inside its own module's hooked call) is refused with a c10::Error, before
// any kernel runs; the message is cb(ctx, index), built by the Rust side, which also records
// the hit for `f_call`'s typed error. Any other op is redispatched below the key.
//
// Outside hooked calls the thread that created a fence keeps the key included too (the
// "watch"): a model whose root is run without any hooked call (`model.forward(&x)` under
// no_grad, where no use guard sees anything) would compute with the shards. There only the
// ops through which layers apply their weights (linear, matmul, embedding, convolutions,
// norms, ...: `applies_weights`) are refused on an armed parameter, and never inside a
// backward pass (a graph task runs: tensor-parallel weights are used as shards there by
// design); every other op passes, so optimizer steps, checkpoints and `clip_grad_norm`
// between steps use the shards freely.
//
// kFenceKey is DeferredInit: a functionality key above Autograd that libtorch reserves for
// torchdistx and registers nothing for (registration fails, as an error, if something else
// did). The fallback is registered once, on the first fence.
// ---------------------------------------------------------------------------------------

struct TdrFence {
  std::vector<c10::TensorImpl*> impls;  // the parameters' tensor objects (set_data keeps them)
  std::vector<at::Tensor> params;       // held, so that no other tensor takes an address
  TdrCallback cb;
  void* ctx;
};

namespace {

constexpr c10::DispatchKey kFenceKey = c10::DispatchKey::DeferredInit;

struct Fenced {
  const TdrFence* fence;
  size_t index;
};

// The armed parameters, by tensor object. Written when a parameter is armed or disarmed
// (a reshard, an unshard), read by the fallback on every op of a checked call.
std::shared_mutex fences_mutex;
std::unordered_map<const c10::TensorImpl*, Fenced>& armed() {
  static auto* m = new std::unordered_map<const c10::TensorImpl*, Fenced>();
  return *m;
}
std::atomic<size_t> armed_count{0};

// This thread's checked calls (the key is included while > 0) and the fences opened by
// the hooked calls running on it, innermost last.
thread_local int fence_check_depth = 0;
thread_local std::vector<const TdrFence*> open_fences;
// Whether this thread watches for ops applying armed weights outside hooked calls (it
// created a fence that still lives), and how many fences live in the process.
thread_local bool fence_watch = false;
std::atomic<size_t> live_fences{0};

std::once_flag fence_registration;
std::string fence_registration_error;
std::atomic<bool> fence_registered{false};

// Refuses an op that uses an armed parameter outside its call; redispatches any other.
void check_tensor(const at::Tensor& t, const Fenced** found) {
  if (*found != nullptr || !t.defined()) {
    return;
  }
  auto it = armed().find(t.unsafeGetTensorImpl());
  if (it == armed().end()) {
    return;
  }
  const TdrFence* f = it->second.fence;
  if (std::find(open_fences.begin(), open_fences.end(), f) != open_fences.end()) {
    return;
  }
  *found = &it->second;
}

// Ops that read a tensor's metadata, never its elements: a shard gives them no wrong value,
// and the instance table's liveness check (`is_set_to`) runs inside hooked calls.
bool reads_no_elements(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> names = {
      "aten::is_set_to", "aten::is_same_size", "aten::size",  "aten::stride",
      "aten::sym_size",  "aten::sym_stride",   "aten::numel", "aten::sym_numel",
      "aten::dim"};
  return names.count(op.schema().name()) > 0;
}

// The ops through which a layer applies its weights to its input (tch's nn layers and
// hand-written ones: `linear`, `matmul` after `tr()`, `embedding`, convolutions, norms, the
// recurrent cells). Outside hooked calls, one of these on an armed parameter is a layer run
// without its hooks; optimizers, checkpoints and norms never call them on a parameter.
bool applies_weights(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> names = {
      "aten::linear",        "aten::matmul",           "aten::mm",
      "aten::bmm",           "aten::addmm",            "aten::addmv",
      "aten::mv",            "aten::t",                "aten::transpose",
      "aten::einsum",        "aten::bilinear",         "aten::embedding",
      "aten::embedding_bag", "aten::_embedding_bag",   "aten::index_select",
      "aten::conv1d",        "aten::conv2d",           "aten::conv3d",
      "aten::convolution",   "aten::_convolution",     "aten::conv_transpose1d",
      "aten::conv_transpose2d", "aten::conv_transpose3d", "aten::layer_norm",
      "aten::native_layer_norm", "aten::group_norm",   "aten::native_group_norm",
      "aten::batch_norm",    "aten::native_batch_norm", "aten::_batch_norm_impl_index",
      "aten::instance_norm", "aten::rms_norm",         "aten::_fused_rms_norm",
      "aten::lstm",          "aten::gru",              "aten::rnn_tanh",
      "aten::rnn_relu",      "aten::lstm_cell",        "aten::gru_cell",
      "aten::prelu",         "aten::_weight_norm"};
  return names.count(op.schema().name()) > 0;
}

// Whether a found armed parameter refuses this op: inside a checked call every op that
// reads elements; in the watch (outside hooked calls, outside backward) only ops that apply
// weights.
bool refuses(const c10::OperatorHandle& op) {
  if (fence_check_depth > 0) {
    return !reads_no_elements(op);
  }
  return fence_watch && torch::autograd::get_current_graph_task_id() == -1 &&
         applies_weights(op);
}

void fence_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                    torch::jit::Stack* stack) {
  if (armed_count.load(std::memory_order_relaxed) > 0) {
    const size_t n = op.schema().arguments().size();
    std::string refusal;
    {
      std::shared_lock<std::shared_mutex> lock(fences_mutex);
      const Fenced* found = nullptr;
      for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n); it != stack->end(); ++it) {
        if (it->isTensor()) {
          check_tensor(it->toTensor(), &found);
        } else if (it->isList()) {
          // Tensor[] (cat), Tensor?[] (index) and other lists.
          for (const c10::IValue& v : it->toListRef()) {
            if (v.isTensor()) {
              check_tensor(v.toTensor(), &found);
            }
          }
        }
        if (found != nullptr) {
          break;
        }
      }
      if (found != nullptr && refuses(op)) {
        // Under the lock: the fence (and the Rust context) stays alive for the callback.
        char* msg = found->fence->cb(found->fence->ctx, found->index);
        refusal = msg != nullptr ? std::string(msg)
                                 : std::string("a sharded parameter was used outside its "
                                               "module's hooked call");
        std::free(msg);
      }
    }
    if (!refusal.empty()) {
      // The message alone (no "Exception raised from ..." line): outside hooked calls it is
      // what tch's panic shows the user.
      throw c10::Error(refusal);
    }
  }
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kFenceKey),
                     stack);
}

void register_fence_fallback() {
  std::call_once(fence_registration, [] {
    try {
      if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kFenceKey)) {
        fence_registration_error =
            "the dispatch key DeferredInit already has a fallback in this process (torchdistx "
            "loaded?): the shard fences cannot be installed";
        return;
      }
      // Kept for the life of the process, as TORCH_LIBRARY_IMPL's static is.
      auto* lib = new torch::Library(torch::Library::IMPL, "_", kFenceKey, __FILE__, __LINE__);
      lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fence_fallback>());
      fence_registered = true;
    } catch (const c10::Error& e) {
      fence_registration_error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      fence_registration_error = e.what();
    }
  });
  if (!fence_registered.load()) {
    throw std::runtime_error(fence_registration_error);
  }
}

// Includes the key while this thread runs a checked call or watches.
void update_fence_key() {
  if (fence_registered.load(std::memory_order_relaxed)) {
    c10::impl::tls_set_dispatch_key_included(kFenceKey, fence_check_depth > 0 || fence_watch);
  }
}

}  // namespace

extern "C" {

char* tdr_fence_new(at::Tensor** params, size_t n, TdrCallback cb, void* ctx, TdrFence** out) {
  TDR_TRY
  register_fence_fallback();
  auto fence = std::make_unique<TdrFence>();
  fence->cb = cb;
  fence->ctx = ctx;
  for (size_t i = 0; i < n; ++i) {
    fence->params.push_back(*params[i]);
    fence->impls.push_back(params[i]->unsafeGetTensorImpl());
  }
  *out = fence.release();
  live_fences.fetch_add(1);
  fence_watch = true;
  update_fence_key();
  TDR_CATCH
}

char* tdr_fence_set_armed(TdrFence* f, size_t index, bool on) {
  TDR_TRY
  if (index >= f->impls.size()) {
    throw std::runtime_error("no such fenced parameter");
  }
  std::unique_lock<std::shared_mutex> lock(fences_mutex);
  const c10::TensorImpl* impl = f->impls[index];
  auto it = armed().find(impl);
  if (on && it == armed().end()) {
    armed().emplace(impl, Fenced{f, index});
    armed_count.fetch_add(1);
  } else if (!on && it != armed().end() && it->second.fence == f) {
    armed().erase(it);
    armed_count.fetch_sub(1);
  }
  TDR_CATCH
}

void tdr_fence_free(TdrFence* f) {
  if (f == nullptr) {
    return;
  }
  try {
    std::unique_lock<std::shared_mutex> lock(fences_mutex);
    for (const c10::TensorImpl* impl : f->impls) {
      auto it = armed().find(impl);
      if (it != armed().end() && it->second.fence == f) {
        armed().erase(it);
        armed_count.fetch_sub(1);
      }
    }
  } catch (...) {
  }
  delete f;
  if (live_fences.fetch_sub(1) == 1) {
    // The last fence is gone: this thread stops watching (another thread that created one
    // keeps the key until its next checked call ends, at the cost of a lookup per op).
    fence_watch = false;
    update_fence_key();
  }
}

void tdr_fence_check_enter(void) {
  if (fence_check_depth++ == 0) {
    update_fence_key();
  }
}

void tdr_fence_check_exit(void) {
  if (fence_check_depth > 0 && --fence_check_depth == 0) {
    update_fence_key();
  }
}

void tdr_fence_open(TdrFence* f) {
  try {
    open_fences.push_back(f);
  } catch (...) {
    // Out of memory: the fence stays closed, so this call's own ops are refused (an error,
    // never a wrong value).
  }
}

void tdr_fence_close(TdrFence* f) {
  auto it = std::find(open_fences.rbegin(), open_fences.rend(), f);
  if (it != open_fences.rend()) {
    open_fences.erase(std::next(it).base(), open_fences.end());
  }
}

void tdr_fence_reset_thread(void) {
  fence_check_depth = 0;
  open_fences.clear();
  fence_watch = fence_watch && live_fences.load() > 0;
  update_fence_key();
}

bool tdr_fence_suspend(bool suspended) {
  const bool before = c10::impl::tls_is_dispatch_key_excluded(kFenceKey);
  c10::impl::tls_set_dispatch_key_excluded(kFenceKey, suspended);
  return before;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------
// Differentiable collectives for tensor parallelism (Megatron's conjugate pairs). The loss
// is computed the same on every rank, so a replicated tensor's gradient is replicated:
//   reduce:         forward all-reduce (sum) of partial results, backward identity
//   copy:           forward identity,                           backward all-reduce (sum)
//   gather:         forward all-gather along `dim`,             backward own slice
//   split:          forward own slice along `dim`,              backward all-gather
//   reduce_scatter: forward sum then own slice along `dim`,     backward all-gather
// Slices along `dim` follow `sizes` (one per rank, uneven allowed, zeros allowed).
// The backward node holds the group's backends, so a graph may outlive the Rust handle.
// ---------------------------------------------------------------------------------------

namespace {

at::Tensor all_reduce_sum(const TdrGroup& g, const at::Tensor& x) {
  at::Tensor t = x.contiguous().clone();  // never write into the caller's tensor
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor buf;
  {
    Route r = route(g, t);
    buf = r.staged ? host_copy(t) : t;
    std::vector<at::Tensor> ts{buf};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    o.timeout = g.timeout;
    work = checked(g, r, {"all_reduce", ts}, [&]() { return r.backend->allreduce(ts, o); });
  }
  work->wait();
  return buf.device() == t.device() ? buf : buf.to(t.device());
}

int64_t slice_offset(const std::vector<int64_t>& sizes, int rank) {
  int64_t off = 0;
  for (int r = 0; r < rank; ++r) {
    off += sizes[r];
  }
  return off;
}

at::Tensor own_slice(const TdrGroup& g, const at::Tensor& x, int64_t dim,
                     const std::vector<int64_t>& sizes) {
  int64_t total = slice_offset(sizes, g.size);
  if (x.size(dim) != total) {
    throw std::runtime_error("expected " + std::to_string(total) + " entries along dim " +
                             std::to_string(dim) + " (the sum of the ranks' slices), got " +
                             c10::str(x.sizes()));
  }
  return x.narrow(dim, slice_offset(sizes, g.rank), sizes[g.rank]).contiguous();
}

at::Tensor all_gather_uneven(const TdrGroup& g, const at::Tensor& x, int64_t dim,
                             const std::vector<int64_t>& sizes) {
  if (x.size(dim) != sizes[g.rank]) {
    throw std::runtime_error("this rank's slice has " + std::to_string(x.size(dim)) +
                             " entries along dim " + std::to_string(dim) + ", expected " +
                             std::to_string(sizes[g.rank]));
  }
  int64_t widest = *std::max_element(sizes.begin(), sizes.end());
  auto shape = x.sizes().vec();
  shape[dim] = widest;
  at::Tensor padded = at::zeros(shape, x.options());
  if (sizes[g.rank] > 0) {
    padded.narrow(dim, 0, sizes[g.rank]).copy_(x);
  }
  std::vector<std::vector<at::Tensor>> outs(1);
  std::vector<at::Tensor> ins;
  c10::intrusive_ptr<c10d::Work> work;
  {
    Route r = route(g, padded);
    ins.push_back(r.staged ? host_copy(padded) : padded);
    for (int i = 0; i < g.size; ++i) {
      outs[0].push_back(at::empty_like(ins[0]));
    }
    c10d::AllgatherOptions o;
    o.timeout = g.timeout;
    work = checked(g, r, {"all_gather", ins}, [&]() { return r.backend->allgather(outs, ins, o); });
  }
  work->wait();
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < g.size; ++r) {
    pieces.push_back(outs[0][r].narrow(dim, 0, sizes[r]));
  }
  at::Tensor whole = at::cat(pieces, dim);
  return whole.device() == x.device() ? whole : whole.to(x.device());
}

at::Tensor parallel_forward(const TdrGroup& g, const at::Tensor& x, int mode, int64_t dim,
                            const std::vector<int64_t>& sizes) {
  switch (mode) {
    case TDR_PARALLEL_REDUCE:
      return all_reduce_sum(g, x);
    case TDR_PARALLEL_COPY:
      return x.clone();
    case TDR_PARALLEL_GATHER:
      return all_gather_uneven(g, x, dim, sizes);
    case TDR_PARALLEL_SPLIT:
      return own_slice(g, x, dim, sizes);
    case TDR_PARALLEL_REDUCE_SCATTER:
      return own_slice(g, all_reduce_sum(g, x), dim, sizes);
    default:
      throw std::runtime_error("unknown parallel op " + std::to_string(mode));
  }
}

struct TdrParallelBackward : public torch::autograd::Node {
  TdrGroup group;
  int mode = TDR_PARALLEL_REDUCE;
  int64_t dim = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> output_shape;
  at::TensorOptions output_options;

  std::string name() const override { return "TdrParallelBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::NoGradGuard no_grad;
    // Every rank must run the same collective: a missing gradient counts as zeros.
    at::Tensor g = grads[0].defined() ? grads[0] : at::zeros(output_shape, output_options);
    switch (mode) {
      case TDR_PARALLEL_REDUCE:
        return {g};
      case TDR_PARALLEL_COPY:
        return {all_reduce_sum(group, g)};
      case TDR_PARALLEL_GATHER:
        return {own_slice(group, g, dim, sizes)};
      case TDR_PARALLEL_SPLIT:
      case TDR_PARALLEL_REDUCE_SCATTER:
        return {all_gather_uneven(group, g.contiguous(), dim, sizes)};
      default:
        throw std::runtime_error("unknown parallel op " + std::to_string(mode));
    }
  }
};

}  // namespace

extern "C" {

char* tdr_parallel_op(TdrGroup* g, at::Tensor* input, int mode, int64_t dim,
                      const int64_t* sizes, size_t n, at::Tensor** out) {
  TDR_TRY
  const at::Tensor& x = *input;
  std::vector<int64_t> slices;
  if (mode != TDR_PARALLEL_REDUCE && mode != TDR_PARALLEL_COPY) {
    if (static_cast<int>(n) != g->size) {
      throw std::runtime_error("expected one slice size per rank (" + std::to_string(g->size) +
                               "), got " + std::to_string(n));
    }
    if (x.dim() == 0) {
      throw std::runtime_error("a scalar cannot be split or gathered along a dimension");
    }
    if (dim < -x.dim() || dim >= x.dim()) {
      throw std::runtime_error("dim " + std::to_string(dim) + " out of range for a tensor of " +
                               std::to_string(x.dim()) + " dims");
    }
    if (dim < 0) {
      dim += x.dim();
    }
    slices.assign(sizes, sizes + n);
    for (auto s : slices) {
      if (s < 0) {
        throw std::runtime_error("negative slice size " + std::to_string(s));
      }
    }
  }
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = parallel_forward(*g, x, mode, dim, slices);
  }
  if (x.requires_grad() && at::GradMode::is_enabled()) {
    auto node = std::shared_ptr<TdrParallelBackward>(new TdrParallelBackward(),
                                                     torch::autograd::deleteNode);
    node->group = *g;
    node->mode = mode;
    node->dim = dim;
    node->sizes = slices;
    node->output_shape = y.sizes().vec();
    node->output_options = y.options();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(y, node);
  }
  *out = new at::Tensor(std::move(y));
  TDR_CATCH
}

}  // extern "C"

extern "C" {

char* tdr_randperm(int64_t n, uint64_t seed, at::Tensor** out) {
  TDR_TRY
  // A generator of its own, seeded as torch.Generator().manual_seed(seed): the same
  // mt19937 stream, so the same permutation as PyTorch's DistributedSampler.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  *out = new at::Tensor(at::randperm(n, gen, at::TensorOptions().dtype(at::kLong)));
  TDR_CATCH
}

// The tensors behind n pointers, as the TensorList a fused kernel takes (empty for NULL).
static std::vector<at::Tensor> tensor_list(at::Tensor** ts, size_t n, const char* what) {
  std::vector<at::Tensor> out;
  if (ts == nullptr) return out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (ts[i] == nullptr || !ts[i]->defined()) {
      throw std::runtime_error(std::string(what) + " " + std::to_string(i) + " is undefined");
    }
    out.push_back(*ts[i]);
  }
  return out;
}

char* tdr_fused_adamw(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                      at::Tensor** exp_avg_sqs, at::Tensor** max_exp_avg_sqs,
                      at::Tensor** steps, size_t n, double lr, double beta1, double beta2,
                      double weight_decay, double eps, bool amsgrad, bool maximize) {
  TDR_TRY
  if (n == 0) return nullptr;
  // An optimizer step is not part of any graph (torch.optim steps under no_grad too), and
  // in-place updates of leaves that require grad are refused with grad mode on.
  at::NoGradGuard no_grad;
  auto p = tensor_list(params, n, "parameter");
  auto g = tensor_list(grads, n, "gradient");
  auto m = tensor_list(exp_avgs, n, "exp_avg");
  auto v = tensor_list(exp_avg_sqs, n, "exp_avg_sq");
  auto vmax = tensor_list(amsgrad ? max_exp_avg_sqs : nullptr, n, "max_exp_avg_sq");
  auto s = tensor_list(steps, n, "step");
  at::_foreach_add_(s, 1);
  try {
    at::_fused_adamw_(p, g, m, v, vmax, s, lr, beta1, beta2, weight_decay, eps, amsgrad,
                      maximize);
  } catch (...) {
    // The kernel refused its input: the steps go back to what they were (the Rust side
    // checks shapes, dtypes and devices first, so the kernel has written nothing).
    at::_foreach_sub_(s, 1);
    throw;
  }
  TDR_CATCH
}

char* tdr_fused_sgd(at::Tensor** params, at::Tensor** grads, at::Tensor** momentum_buffers,
                    size_t n, double weight_decay, double momentum, double lr,
                    double dampening, bool nesterov, bool maximize, bool is_first_step) {
  TDR_TRY
  if (n == 0) return nullptr;
  at::NoGradGuard no_grad;  // as tdr_fused_adamw
  auto p = tensor_list(params, n, "parameter");
  auto g = tensor_list(grads, n, "gradient");
  auto b = tensor_list(momentum_buffers, n, "momentum_buffer");
  at::_fused_sgd_(p, g, b, weight_decay, momentum, lr, dampening, nesterov, maximize,
                  is_first_step);
  TDR_CATCH
}

}  // extern "C"
