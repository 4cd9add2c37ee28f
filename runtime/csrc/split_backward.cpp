// Pipelining's split backward (the zero-bubble schedules): a microbatch's input gradient
// first, its parameters' gradients later, as torch.distributed.pipelining._backward's
// stage_backward_input and stage_backward_weight.
//
// The input pass differentiates the stage's outputs with respect to its input only
// (torch::autograd::grad): the engine skips every branch that leads only to parameters. The
// "input path" is every node the input's gradient flows through (those above the input's
// accumulator); a "split" node lies on it and has an edge off it (a linear layer's addmm:
// the input's matmul on the path, the weight's transpose and the bias off it). Pre hooks on
// the split nodes keep the gradients that flow into them during the input pass.
//
// Then the split nodes' edges into the input path are cut: the input path has done its work,
// its memory goes at once, and the weight pass -- one engine run from the split nodes with
// the kept gradients (and from any output that does not depend on the input, with its own)
// -- reaches the parameters only: no part of the input pass runs twice, and no gradient
// flows from one split node into another, so a weight used twice along the path gets each
// use's share once.
//
// An activation-checkpointed function on the path is never split (its backward, a forward
// run again, would run twice), nor a function with a Rust backward (ring attention's, which
// communicates): there, as where the outputs do not depend on the input or the
// caller does not allow a split, the input pass is the whole backward and there is no weight
// pass.

#include "internal.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <deque>
#include <unordered_map>
#include <unordered_set>

namespace tdr_split {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// The gradients that flowed into one split node during the input pass.
struct Captured {
  std::shared_ptr<Node> node;
  variable_list grads;
};

class CaptureHook : public torch::autograd::FunctionPreHook {
 public:
  explicit CaptureHook(std::shared_ptr<Captured> into) : into_(std::move(into)) {}
  variable_list operator()(const variable_list& grads) override {
    into_->grads = grads;
    return grads;
  }

 private:
  std::shared_ptr<Captured> into_;
};

using NodeSet = std::unordered_set<Node*>;

// Every node below the roots, in breadth-first order, and each one's parents.
std::vector<Node*> below(const std::vector<Node*>& roots,
                         std::unordered_map<Node*, std::vector<Node*>>* parents) {
  NodeSet seen(roots.begin(), roots.end());
  std::deque<Node*> queue(roots.begin(), roots.end());
  std::vector<Node*> order(roots.begin(), roots.end());
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    for (const Edge& e : node->next_edges()) {
      Node* child = e.function.get();
      if (child == nullptr) {
        continue;
      }
      (*parents)[child].push_back(node);
      if (seen.insert(child).second) {
        queue.push_back(child);
        order.push_back(child);
      }
    }
  }
  return order;
}

// The input path: `input` and every node above it.
NodeSet input_path(Node* input, const std::unordered_map<Node*, std::vector<Node*>>& parents) {
  NodeSet path{input};
  std::deque<Node*> queue{input};
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    auto it = parents.find(node);
    if (it == parents.end()) {
      continue;
    }
    for (Node* parent : it->second) {
      if (path.insert(parent).second) {
        queue.push_back(parent);
      }
    }
  }
  return path;
}

}  // namespace tdr_split

struct TdrSplitBackward {
  // Split nodes and the gradients they received, then their edges into the input path cut.
  std::vector<std::shared_ptr<tdr_split::Captured>> splits;
  // Outputs that do not depend on the input, with their gradients.
  torch::autograd::variable_list other_roots;
  torch::autograd::variable_list other_grads;
};

extern "C" {

char* tdr_backward_input(TdrTensor** roots, TdrTensor** grads, size_t n, TdrTensor* input,
                         bool may_split, TdrTensor** input_grad, TdrSplitBackward** out) {
  *input_grad = nullptr;
  *out = nullptr;
  TDR_TRY
  using namespace tdr_split;
  variable_list outputs;
  variable_list output_grads;
  for (size_t i = 0; i < n; ++i) {
    outputs.push_back(*roots[i]);
    output_grads.push_back(*grads[i]);
  }
  auto state = std::make_unique<TdrSplitBackward>();
  NodeSet path;
  bool split = may_split && input != nullptr && input->requires_grad() && input->is_leaf();
  if (split) {
    std::vector<Node*> root_nodes;
    for (const auto& t : outputs) {
      if (Node* fn = torch::autograd::impl::gradient_edge(t).function.get()) {
        root_nodes.push_back(fn);
      }
    }
    std::unordered_map<Node*, std::vector<Node*>> parents;
    std::vector<Node*> order = below(root_nodes, &parents);
    Node* input_node = torch::autograd::impl::grad_accumulator(*input).get();
    split = input_node != nullptr && parents.count(input_node) != 0;
    if (split) {
      path = input_path(input_node, parents);
      for (Node* node : order) {
        if (path.count(node) == 0) {
          continue;
        }
        bool off_path = false;
        for (const Edge& e : node->next_edges()) {
          off_path = off_path || (e.function && path.count(e.function.get()) == 0);
        }
        if (!off_path) {
          continue;
        }
        if (tdr::is_checkpoint_node(node) || tdr::is_rust_function_node(node)) {
          split = false;
          break;
        }
        state->splits.push_back(std::make_shared<Captured>(Captured{node->getptr(), {}}));
      }
    }
  }
  if (!split) {
    // The whole backward now: parameters' gradients and the input's `.grad`.
    torch::autograd::backward(outputs, output_grads, /*retain_graph=*/false);
    if (input != nullptr && input->grad().defined()) {
      *input_grad = new at::Tensor(input->grad());
    }
    return nullptr;
  }
  for (size_t i = 0; i < n; ++i) {
    Node* fn = torch::autograd::impl::gradient_edge(outputs[i]).function.get();
    if (fn != nullptr && path.count(fn) == 0) {
      state->other_roots.push_back(outputs[i]);
      state->other_grads.push_back(output_grads[i]);
    }
  }
  // Hooks on the split nodes for the input pass only.
  std::vector<std::pair<Node*, torch::autograd::FunctionPreHook*>> hooks;
  for (const auto& s : state->splits) {
    auto hook = std::make_unique<CaptureHook>(s);
    hooks.emplace_back(s->node.get(), hook.get());
    s->node->add_pre_hook(std::move(hook));
  }
  auto remove_hooks = [&hooks]() {
    for (auto [node, hook] : hooks) {
      auto& list = node->pre_hooks();
      for (auto it = list.begin(); it != list.end(); ++it) {
        if (it->get() == hook) {
          list.erase(it);
          break;
        }
      }
    }
  };
  variable_list got;
  try {
    got = torch::autograd::grad(outputs, {*input}, output_grads, /*retain_graph=*/true,
                                /*create_graph=*/false, /*allow_unused=*/true);
  } catch (...) {
    remove_hooks();
    throw;
  }
  remove_hooks();
  // The input path is done with: cut it off the split nodes.
  for (const auto& s : state->splits) {
    for (Edge& e : s->node->next_edges()) {
      if (e.function && path.count(e.function.get()) != 0) {
        e = Edge();
      }
    }
  }
  if (!got.empty() && got[0].defined()) {
    *input_grad = new at::Tensor(got[0]);
  }
  *out = state.release();
  TDR_CATCH
}

char* tdr_backward_weight(TdrSplitBackward* s) {
  TDR_TRY
  torch::autograd::edge_list roots;
  torch::autograd::variable_list grads;
  for (const auto& split : s->splits) {
    for (size_t i = 0; i < split->grads.size(); ++i) {
      if (split->grads[i].defined()) {
        roots.emplace_back(split->node, i);
        grads.push_back(split->grads[i]);
      }
    }
  }
  for (size_t i = 0; i < s->other_roots.size(); ++i) {
    roots.push_back(torch::autograd::impl::gradient_edge(s->other_roots[i]));
    grads.push_back(s->other_grads[i]);
  }
  s->splits.clear();
  s->other_roots.clear();
  s->other_grads.clear();
  if (!roots.empty()) {
    torch::autograd::Engine::get_default_engine().execute(
        roots, grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true);
  }
  TDR_CATCH
}

void tdr_split_backward_free(TdrSplitBackward* s) {
  delete s;
}

}  // extern "C"
