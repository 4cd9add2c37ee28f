// Pipelining's split backward (the zero-bubble schedules): a microbatch's input gradient
// first, its parameters' gradients later, as torch.distributed.pipelining._backward's
// stage_backward_input and stage_backward_weight.
//
// The input pass differentiates the stage's outputs with respect to its input only
// (torch::autograd::grad): the engine skips every branch that leads only to parameters. Pre
// hooks on the "split" nodes keep the gradients that flow into them: a split node lies on the
// input's path and has a parameter below it by a path that leaves the input's path (a
// linear layer's addmm, with its weight's transpose and its bias beside the input's matmul).
// The weight pass then runs the engine from each group of split nodes, with those gradients,
// to their parameters' accumulators only. No part of the input pass runs twice.
//
// Where the split could count a gradient twice, the input pass is the whole backward and
// the weight pass does nothing: a split node reachable from another of its group (one weight
// used twice along the input's path), or a parameter reached by no split node (a root that
// does not depend on the input). PyTorch's stage_backward_weight has no such check. So it is
// where a split node is activation checkpointing's function, whose backward (a forward run
// again) would run twice.

#include "internal.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <deque>
#include <map>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

namespace tdr_split {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

// The gradients that flowed into one split node during the input pass.
struct Captured {
  std::shared_ptr<Node> node;
  variable_list grads;
};

// Parameters whose gradients come from the same split nodes.
struct Group {
  std::vector<std::shared_ptr<Captured>> splits;
  edge_list params;
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
using Parents = std::unordered_map<Node*, std::vector<Node*>>;

// Every node below the roots, and each one's parents (the nodes with an edge into it).
Parents reverse_graph(const std::vector<Node*>& roots, std::vector<Node*>* order) {
  Parents parents;
  NodeSet seen(roots.begin(), roots.end());
  std::deque<Node*> queue(roots.begin(), roots.end());
  order->assign(roots.begin(), roots.end());
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    for (const Edge& e : node->next_edges()) {
      Node* child = e.function.get();
      if (child == nullptr) {
        continue;
      }
      parents[child].push_back(node);
      if (seen.insert(child).second) {
        queue.push_back(child);
        order->push_back(child);
      }
    }
  }
  return parents;
}

// `start` and every node above it, going up through parents; a node in `stop` is collected
// in `*hit` and not gone through.
NodeSet ancestors(Node* start, const Parents& parents, const NodeSet* stop, NodeSet* hit) {
  NodeSet closure{start};
  std::deque<Node*> queue{start};
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    auto it = parents.find(node);
    if (it == parents.end()) {
      continue;
    }
    for (Node* parent : it->second) {
      if (closure.count(parent) != 0) {
        continue;
      }
      if (stop != nullptr && stop->count(parent) != 0) {
        hit->insert(parent);
        continue;
      }
      closure.insert(parent);
      queue.push_back(parent);
    }
  }
  return closure;
}

// Whether `to` is below `from` by a path of nodes in `within`.
bool reaches(Node* from, Node* to, const NodeSet& within) {
  NodeSet seen{from};
  std::deque<Node*> queue{from};
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    for (const Edge& e : node->next_edges()) {
      Node* child = e.function.get();
      if (child == nullptr || within.count(child) == 0 || !seen.insert(child).second) {
        continue;
      }
      if (child == to) {
        return true;
      }
      queue.push_back(child);
    }
  }
  return false;
}

size_t find(std::vector<size_t>& up, size_t i) {
  while (up[i] != i) {
    up[i] = up[up[i]];
    i = up[i];
  }
  return i;
}

// The groups of the split, or none where it cannot be split safely (see the top).
bool plan(const std::vector<Node*>& roots, Node* input, std::vector<Group>* groups) {
  std::vector<Node*> order;
  Parents parents = reverse_graph(roots, &order);
  if (parents.count(input) == 0) {
    return false;  // the outputs do not depend on the input
  }
  NodeSet input_path = ancestors(input, parents, nullptr, nullptr);
  for (Node* root : roots) {
    if (input_path.count(root) == 0) {
      return false;
    }
  }
  // Each parameter's split nodes, in the graph's order (the same on every run).
  std::vector<Node*> params;
  std::vector<std::vector<Node*>> splits_of;
  for (Node* node : order) {
    if (node == input || dynamic_cast<torch::autograd::AccumulateGrad*>(node) == nullptr) {
      continue;
    }
    NodeSet hit;
    ancestors(node, parents, &input_path, &hit);
    if (hit.empty()) {
      return false;
    }
    for (Node* split : hit) {
      if (tdr::is_checkpoint_node(split)) {
        return false;
      }
    }
    std::vector<Node*> sorted;
    for (Node* n : order) {
      if (hit.count(n) != 0) {
        sorted.push_back(n);
      }
    }
    params.push_back(node);
    splits_of.push_back(std::move(sorted));
  }
  // Parameters sharing a split node are one group.
  std::vector<size_t> up(params.size());
  std::iota(up.begin(), up.end(), 0);
  std::unordered_map<Node*, size_t> first_param;
  for (size_t p = 0; p < params.size(); ++p) {
    for (Node* s : splits_of[p]) {
      auto [it, fresh] = first_param.emplace(s, p);
      if (!fresh) {
        up[find(up, p)] = find(up, it->second);
      }
    }
  }
  std::map<size_t, size_t> group_of_root;
  std::vector<NodeSet> group_splits;
  for (size_t p = 0; p < params.size(); ++p) {
    size_t root = find(up, p);
    auto [it, fresh] = group_of_root.emplace(root, groups->size());
    if (fresh) {
      groups->emplace_back();
      group_splits.emplace_back();
    }
    Group& g = (*groups)[it->second];
    g.params.emplace_back(params[p]->getptr(), 0);
    for (Node* s : splits_of[p]) {
      if (group_splits[it->second].insert(s).second) {
        g.splits.push_back(std::make_shared<Captured>(Captured{s->getptr(), {}}));
      }
    }
  }
  // A split node below another of its group would get its gradient twice.
  for (const Group& g : *groups) {
    for (const auto& a : g.splits) {
      for (const auto& b : g.splits) {
        if (a != b && reaches(a->node.get(), b->node.get(), input_path)) {
          groups->clear();
          return false;
        }
      }
    }
  }
  return true;
}

}  // namespace tdr_split

struct TdrSplitBackward {
  std::vector<tdr_split::Group> groups;
};

extern "C" {

char* tdr_backward_input(TdrTensor** roots, TdrTensor** grads, size_t n, TdrTensor* input,
                         TdrTensor** input_grad, TdrSplitBackward** out) {
  *input_grad = nullptr;
  *out = nullptr;
  TDR_TRY
  using namespace tdr_split;
  variable_list outputs;
  variable_list output_grads;
  std::vector<Node*> root_nodes;
  for (size_t i = 0; i < n; ++i) {
    outputs.push_back(*roots[i]);
    output_grads.push_back(*grads[i]);
    if (Node* fn = torch::autograd::impl::gradient_edge(*roots[i]).function.get()) {
      root_nodes.push_back(fn);
    }
  }
  auto state = std::make_unique<TdrSplitBackward>();
  bool split = false;
  Node* input_node = nullptr;
  if (input != nullptr && input->requires_grad() && input->is_leaf()) {
    input_node = torch::autograd::impl::grad_accumulator(*input).get();
    split = input_node != nullptr && plan(root_nodes, input_node, &state->groups);
  }
  if (!split) {
    // The whole backward now: parameters' gradients and the input's `.grad`.
    torch::autograd::backward(outputs, output_grads, /*retain_graph=*/false);
    if (input != nullptr && input->grad().defined()) {
      *input_grad = new at::Tensor(input->grad());
    }
    return nullptr;
  }
  // Hooks on the split nodes for the input pass only.
  std::vector<std::pair<Node*, torch::autograd::FunctionPreHook*>> hooks;
  for (const Group& g : state->groups) {
    for (const auto& s : g.splits) {
      auto hook = std::make_unique<CaptureHook>(s);
      hooks.emplace_back(s->node.get(), hook.get());
      s->node->add_pre_hook(std::move(hook));
    }
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
  if (!got.empty() && got[0].defined()) {
    *input_grad = new at::Tensor(got[0]);
  }
  *out = state.release();
  TDR_CATCH
}

char* tdr_backward_weight(TdrSplitBackward* s) {
  TDR_TRY
  for (auto& g : s->groups) {
    torch::autograd::edge_list roots;
    torch::autograd::variable_list grads;
    for (const auto& split : g.splits) {
      for (size_t i = 0; i < split->grads.size(); ++i) {
        if (split->grads[i].defined()) {
          roots.emplace_back(split->node, i);
          grads.push_back(split->grads[i]);
        }
      }
    }
    if (!roots.empty()) {
      torch::autograd::Engine::get_default_engine().execute(
          roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
          /*accumulate_grad=*/true, g.params);
    }
    g.splits.clear();
  }
  s->groups.clear();
  TDR_CATCH
}

void tdr_split_backward_free(TdrSplitBackward* s) {
  delete s;
}

}  // extern "C"
