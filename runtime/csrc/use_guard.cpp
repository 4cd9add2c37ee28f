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

#include "internal.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdlib>
#include <unordered_map>
#include <unordered_set>

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
