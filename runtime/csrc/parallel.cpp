// Differentiable collectives for tensor parallelism (Megatron's conjugate pairs). The loss
// is computed the same on every rank, so a replicated tensor's gradient is replicated:
//   reduce:         forward all-reduce (sum) of partial results, backward identity
//   copy:           forward identity,                           backward all-reduce (sum)
//   gather:         forward all-gather along `dim`,             backward own slice
//   split:          forward own slice along `dim`,              backward all-gather
//   reduce_scatter: forward sum then own slice along `dim`,     backward all-gather
//   all_to_all:     forward rows exchanged along dim 0,          backward the reverse exchange
// Slices along `dim` follow `sizes` (one per rank, uneven allowed, zeros allowed); an
// all-to-all's `sizes` are the rows this rank sends to each rank, then the rows it receives
// from each (PyTorch's `all_to_all_single` input and output splits).
// The backward node holds the group's backends, so a graph may outlive the Rust handle, and
// the Rust context of its callbacks: the step check before its collective, and the text of
// the collective's failure (a DETAIL desync decoded, the peer named) as Rust writes every
// other collective's.

#include "internal.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <cstdlib>

using namespace tdr;

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

// Rank i's rows `send[j]` land on rank j, after the rows of ranks below i; this rank receives
// `recv[i]` rows from each rank i, in rank order (alltoall_base with split sizes).
at::Tensor all_to_all_uneven(const TdrGroup& g, const at::Tensor& x,
                             const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  int64_t sent = slice_offset(send, g.size);
  if (x.size(0) != sent) {
    throw std::runtime_error("expected " + std::to_string(sent) +
                             " rows (the sum of the rows sent to each rank), got " +
                             c10::str(x.sizes()));
  }
  auto shape = x.sizes().vec();
  shape[0] = slice_offset(recv, g.size);
  at::Tensor in = x.contiguous();
  at::Tensor received;
  c10::intrusive_ptr<c10d::Work> work;
  {
    Route r = route(g, in);
    at::Tensor buf_in = r.staged ? host_copy(in) : in;
    received = at::empty(shape, buf_in.options());
    c10d::AllToAllOptions o;
    o.timeout = g.timeout;
    // The backend's signature takes the splits by mutable reference.
    std::vector<int64_t> out_splits = recv;
    std::vector<int64_t> in_splits = send;
    // The ranks' shapes differ by design: the DETAIL check compares the op alone.
    work = checked(g, r, {"all_to_all", {}}, [&]() {
      return r.backend->alltoall_base(received, buf_in, out_splits, in_splits, o);
    });
  }
  work->wait();
  return received.device() == x.device() ? received : received.to(x.device());
}

// An all-to-all's sizes: the first half sent, the second received.
std::vector<int64_t> split_half(const std::vector<int64_t>& sizes, int which) {
  size_t n = sizes.size() / 2;
  return std::vector<int64_t>(sizes.begin() + which * n, sizes.begin() + (which + 1) * n);
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
    case TDR_PARALLEL_ALL_TO_ALL:
      return all_to_all_uneven(g, x, split_half(sizes, 0), split_half(sizes, 1));
    default:
      throw std::runtime_error("unknown parallel op " + std::to_string(mode));
  }
}

// The Rust side of a backward node: its callbacks and their context, released once.
struct RustHooks {
  TdrCallback before = nullptr;
  TdrDescribe describe = nullptr;
  void* ctx = nullptr;
  TdrRelease release = nullptr;
  RustHooks(const RustHooks&) = delete;
  RustHooks& operator=(const RustHooks&) = delete;
  RustHooks(TdrCallback b, TdrDescribe d, void* c, TdrRelease r)
      : before(b), describe(d), ctx(c), release(r) {}
  ~RustHooks() {
    if (release != nullptr) {
      release(ctx);
    }
  }
};

// Throws a malloc'ed message from a callback as the exception that fails the backward pass.
[[noreturn]] void throw_message(char* msg) {
  std::string text = msg != nullptr ? msg : "out of memory describing a failure";
  std::free(msg);
  throw std::runtime_error(text);
}

// Runs `body` as an entry point runs its own (TDR_TRY/TDR_CATCH): null, or the failure's
// message with its kind in tdr_last_error_kind.
template <class F>
char* caught(F&& body) {
  TDR_TRY
  body();
  TDR_CATCH
}

struct TdrParallelBackward : public torch::autograd::Node {
  TdrGroup group;
  int mode = TDR_PARALLEL_REDUCE;
  int64_t dim = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> output_shape;
  at::TensorOptions output_options;
  std::shared_ptr<RustHooks> hooks;

  std::string name() const override { return "TdrParallelBackward"; }

  // The collective of `run`; its failure described by Rust.
  template <class F>
  at::Tensor communicate(F&& run) {
    at::Tensor out;
    if (char* failed = caught([&]() { out = run(); })) {
      throw_message(hooks->describe(hooks->ctx, failed));
    }
    return out;
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    // Every mode's node tells Rust that the backward reached it (the step check counts the
    // pass), and one that communicates is checked there first.
    if (char* refused = hooks->before(hooks->ctx, static_cast<size_t>(mode))) {
      throw_message(refused);
    }
    at::NoGradGuard no_grad;
    // Every rank must run the same collective: a missing gradient counts as zeros.
    at::Tensor g = grads[0].defined() ? grads[0] : at::zeros(output_shape, output_options);
    switch (mode) {
      case TDR_PARALLEL_REDUCE:
        return {g};
      case TDR_PARALLEL_COPY:
        return {communicate([&]() { return all_reduce_sum(group, g); })};
      case TDR_PARALLEL_GATHER:
        return {own_slice(group, g, dim, sizes)};
      case TDR_PARALLEL_SPLIT:
      case TDR_PARALLEL_REDUCE_SCATTER:
        return {communicate([&]() { return all_gather_uneven(group, g.contiguous(), dim, sizes); })};
      case TDR_PARALLEL_ALL_TO_ALL:
        // The rows go back where they came from: the splits swapped.
        return {communicate([&]() { return all_to_all_uneven(group, g, split_half(sizes, 1), split_half(sizes, 0)); })};
      default:
        throw std::runtime_error("unknown parallel op " + std::to_string(mode));
    }
  }
};

}  // namespace

extern "C" {

char* tdr_parallel_op(TdrGroup* g, at::Tensor* input, int mode, int64_t dim,
                      const int64_t* sizes, size_t n, TdrCallback before, TdrDescribe describe,
                      void* ctx, TdrRelease release, at::Tensor** out) {
  // Owns the context from here, so that it is released however this ends.
  auto hooks = std::make_shared<RustHooks>(before, describe, ctx, release);
  TDR_TRY
  const at::Tensor& x = *input;
  std::vector<int64_t> slices;
  if (mode != TDR_PARALLEL_REDUCE && mode != TDR_PARALLEL_COPY) {
    // An all-to-all takes the rows sent to each rank, then those received from each.
    size_t per_rank = mode == TDR_PARALLEL_ALL_TO_ALL ? 2 : 1;
    if (n != per_rank * static_cast<size_t>(g->size)) {
      throw std::runtime_error("expected " + std::to_string(per_rank) +
                               " slice size(s) per rank (" + std::to_string(g->size) +
                               " ranks), got " + std::to_string(n));
    }
    if (mode == TDR_PARALLEL_ALL_TO_ALL && dim != 0) {
      throw std::runtime_error("an all-to-all exchanges rows: dim must be 0, got " +
                               std::to_string(dim));
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
    node->hooks = hooks;
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(y, node);
  }
  *out = new at::Tensor(std::move(y));
  TDR_CATCH
}

}  // extern "C"
