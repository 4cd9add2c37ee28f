// TCH_DIST_DEBUG=DETAIL: the desync report's encoded calls (gathered from every rank when the
// ranks' collectives differ) and the root check between c10d's ProcessGroupWrapper (PyTorch's
// TORCH_DISTRIBUTED_DEBUG=DETAIL) and the backend it wraps.

#include "internal.h"

#include <torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp>

#include <algorithm>
#include <cstring>

namespace tdr {

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

}  // namespace tdr

namespace {

using tdr::Call;
using tdr::DesyncError;
using tdr::encode_call;
using tdr::gather_calls;

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

}  // namespace

namespace tdr {

c10::intrusive_ptr<c10d::Backend> wrap_checked(const c10::intrusive_ptr<c10d::Backend>& inner,
                                               const c10::intrusive_ptr<c10d::Backend>& check,
                                               std::shared_ptr<std::atomic<bool>> foreign) {
  auto roots = c10::make_intrusive<RootCheck>(inner, check, std::move(foreign));
  return c10::make_intrusive<c10d::ProcessGroupWrapper>(roots, check);
}

}  // namespace tdr
