// Collectives: each returns a TdrWork for `tdr_work_wait`. Each launch routes its tensors to
// a backend (routing is defined here, declared in internal.h), stages CUDA tensors through
// host memory for Gloo, and finishes the work after its wait (copies back, Gloo's AVG).

#include "internal.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

using namespace tdr;

namespace tdr {

Route lock_backends(const TdrGroup& g) {
  Route r;
  r.lock = std::shared_lock<std::shared_mutex>(g.backends->mutex);
  if (g.backends->shut_down) {
    throw ShutDownError();
  }
  return r;
}

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

at::Tensor host_copy(const at::Tensor& t) {
  return t.to(t.options().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true)
      .contiguous();
}

}  // namespace tdr

namespace {

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

}  // namespace

extern "C" {

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
