// Activation checkpointing, the reentrant style: a custom autograd function whose forward
// runs a module's forward (a Rust callback) with grad disabled, keeping only its inputs, and
// whose backward runs that forward again (another Rust callback) with grad enabled and the
// RNG and autocast states of the first run, then differentiates it with
// torch::autograd::grad.
//
// The module's parameters are inputs of the function too, so the outer graph has an edge
// into each parameter's gradient accumulator: their gradients are returned by this backward
// and accumulated by the outer pass, where the hooks of replicate and fully_shard (the
// reducer's grad-ready hooks, fully_shard's interceptors) and the use guards see them once.
// The inner grad() captures them at the accumulators' edges without running the
// accumulators.

#include "internal.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <set>
#include <utility>

void tdr::check_forward_outputs(torch::autograd::AutogradContext* ctx,
                                const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> integral;
  for (const auto& out : outputs) {
    if (!out.defined()) {
      throw std::runtime_error("the forward returned an undefined tensor");
    }
    if (!at::isFloatingType(out.scalar_type()) && !at::isComplexType(out.scalar_type())) {
      integral.push_back(out);
    }
  }
  if (!integral.empty()) {
    ctx->mark_non_differentiable(integral);
  }
}

namespace tdr_checkpoint {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The default generators' states: the CPU's and each CUDA device's among `tensors`.
struct RngStates {
  std::vector<std::pair<c10::Device, at::Tensor>> states;
};

RngStates capture(const std::vector<at::Tensor>& tensors) {
  std::set<c10::DeviceIndex> cuda;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda()) {
      cuda.insert(t.device().index());
    }
  }
  RngStates out;
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (auto index : cuda) {
    devices.emplace_back(c10::kCUDA, index);
  }
  for (const auto& device : devices) {
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.states.emplace_back(device, gen.get_state());
  }
  return out;
}

void restore(const RngStates& rng) {
  for (const auto& [device, state] : rng.states) {
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
}

// The autocast state of the CPU and CUDA (enabled, dtype), as torch.utils.checkpoint keeps it
// for the recomputation.
struct AutocastState {
  std::vector<std::tuple<c10::DeviceType, bool, at::ScalarType>> devices;
};

AutocastState autocast_now() {
  AutocastState out;
  for (auto d : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    out.devices.emplace_back(d, at::autocast::is_autocast_enabled(d),
                             at::autocast::get_autocast_dtype(d));
  }
  return out;
}

void set_autocast(const AutocastState& s) {
  for (const auto& [d, enabled, dtype] : s.devices) {
    at::autocast::set_autocast_enabled(d, enabled);
    at::autocast::set_autocast_dtype(d, dtype);
  }
}

// Puts an autocast state back however the recomputation ends.
struct AutocastOnExit {
  AutocastState state;
  ~AutocastOnExit() {
    try {
      set_autocast(state);
    } catch (...) {
    }
  }
};

// What the backward needs: the recompute callback and its Rust context (released with
// this), which inputs require grad, the parameters, the first run's RNG states.
struct Shared : torch::CustomClassHolder {
  TdrForwardCallback again = nullptr;
  void* again_ctx = nullptr;
  TdrRelease release = nullptr;
  size_t num_inputs = 0;
  std::vector<bool> input_requires_grad;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;
  bool preserve_rng = false;
  RngStates rng;
  AutocastState autocast;
  ~Shared() override {
    if (release != nullptr) {
      release(again_ctx);
    }
  }
};

}  // namespace tdr_checkpoint

std::vector<at::Tensor> tdr::call_forward(TdrForwardCallback cb, void* ctx,
                                          std::vector<at::Tensor> inputs) {
  std::vector<at::Tensor*> ptrs;
  ptrs.reserve(inputs.size());
  for (auto& t : inputs) {
    ptrs.push_back(&t);
  }
  TdrTensorList out;
  char* err = cb(ctx, ptrs.data(), ptrs.size(), &out);
  if (err != nullptr) {
    std::string msg(err);
    std::free(err);
    throw std::runtime_error(msg);
  }
  return std::move(out.tensors);
}

namespace tdr_checkpoint {

// Puts the RNG states back however the recomputation ends.
struct RestoreOnExit {
  const RngStates* states;
  ~RestoreOnExit() {
    if (states != nullptr) {
      try {
        restore(*states);
      } catch (...) {
      }
    }
  }
};

// The module's buffers as they were before the recomputation, put back when the backward
// that recomputed ends (also when it fails): a training forward updates a BatchNorm's running
// statistics, and the recomputation is no second forward, so they end as without
// checkpointing (PyTorch's checkpoint updates them twice per step, silently). Not sooner: the
// recomputed graph saved them, and writing them before its grad() would fail it.
struct BuffersBefore {
  std::vector<at::Tensor> live;
  std::vector<at::Tensor> before;
  explicit BuffersBefore(const std::vector<at::Tensor>& buffers) : live(buffers) {
    at::NoGradGuard no_grad;
    before.reserve(live.size());
    for (const auto& b : live) {
      before.push_back(b.clone());
    }
  }
  ~BuffersBefore() {
    try {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < live.size(); ++i) {
        live[i].copy_(before[i]);
      }
    } catch (...) {
    }
  }
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `args`: the inputs, then the parameters.
  static variable_list forward(AutogradContext* ctx, at::TensorList args,
                               c10::intrusive_ptr<Shared> shared, TdrForwardCallback first,
                               void* first_ctx) {
    std::vector<at::Tensor> inputs(args.begin(), args.begin() + shared->num_inputs);
    if (shared->preserve_rng) {
      shared->rng = capture(inputs);
    }
    shared->autocast = autocast_now();
    auto outputs = tdr::call_forward(first, first_ctx, inputs);
    tdr::check_forward_outputs(ctx, outputs);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward(inputs);
    ctx->saved_data["shared"] = c10::IValue::make_capsule(shared);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto shared =
        c10::static_intrusive_pointer_cast<Shared>(ctx->saved_data["shared"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    inputs.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor d = saved[i].detach();
      if (shared->input_requires_grad[i]) {
        d.requires_grad_(true);
      }
      inputs.push_back(std::move(d));
    }
    BuffersBefore buffers_before(shared->buffers);
    std::vector<at::Tensor> outputs;
    {
      RngStates now;
      RestoreOnExit back{nullptr};
      if (shared->preserve_rng) {
        now = capture(inputs);
        back.states = &now;
        restore(shared->rng);
      }
      AutocastOnExit autocast_back{autocast_now()};
      set_autocast(shared->autocast);
      at::AutoGradMode grad(true);
      outputs = tdr::call_forward(shared->again, shared->again_ctx, inputs);
    }
    if (outputs.size() != grad_outputs.size()) {
      throw std::runtime_error("the recomputation returned " + std::to_string(outputs.size()) +
                               " outputs, the first run " +
                               std::to_string(grad_outputs.size()));
    }
    variable_list roots;
    variable_list root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    // One slot per argument of `forward`: the inputs, the parameters, then the three
    // arguments that are not tensors (left undefined).
    variable_list result(shared->num_inputs + shared->params.size() + 3);
    variable_list targets;
    std::vector<size_t> slots;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (shared->input_requires_grad[i]) {
        targets.push_back(inputs[i]);
        slots.push_back(i);
      }
    }
    for (size_t j = 0; j < shared->params.size(); ++j) {
      targets.push_back(shared->params[j]);
      slots.push_back(shared->num_inputs + j);
    }
    if (roots.empty() || targets.empty()) {
      return result;
    }
    auto grads = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < grads.size(); ++k) {
      result[slots[k]] = grads[k];
    }
    return result;
  }
};

}  // namespace tdr_checkpoint

bool tdr::is_checkpoint_node(const torch::autograd::Node* node) {
  return dynamic_cast<const torch::autograd::CppNode<tdr_checkpoint::CheckpointFunction>*>(
             node) != nullptr;
}

extern "C" {

char* tdr_tensor_list_push(TdrTensorList* list, TdrTensor* t) {
  TDR_TRY
  list->tensors.push_back(*t);
  TDR_CATCH
}

char* tdr_checkpoint_apply(TdrTensor** inputs, size_t num_inputs, TdrTensor** params,
                           size_t num_params, TdrTensor** buffers, size_t num_buffers,
                           bool preserve_rng, TdrForwardCallback first,
                           void* first_ctx, TdrForwardCallback again, void* again_ctx,
                           TdrRelease release, TdrTensorList** out) {
  TDR_TRY
  // Owns the context from here, so that it is released however this ends.
  auto shared = c10::make_intrusive<tdr_checkpoint::Shared>();
  shared->again = again;
  shared->again_ctx = again_ctx;
  shared->release = release;
  shared->num_inputs = num_inputs;
  shared->preserve_rng = preserve_rng;
  torch::autograd::variable_list args;
  for (size_t i = 0; i < num_inputs; ++i) {
    args.push_back(*inputs[i]);
    shared->input_requires_grad.push_back(inputs[i]->requires_grad());
  }
  for (size_t j = 0; j < num_params; ++j) {
    if (!params[j]->requires_grad() || !params[j]->is_leaf()) {
      throw std::runtime_error("only leaf parameters that require grad can be checkpointed");
    }
    args.push_back(*params[j]);
    shared->params.push_back(*params[j]);
  }
  for (size_t k = 0; k < num_buffers; ++k) {
    if (buffers[k]->defined()) {
      shared->buffers.push_back(*buffers[k]);
    }
  }
  auto result = std::make_unique<TdrTensorList>();
  result->tensors =
      tdr_checkpoint::CheckpointFunction::apply(at::TensorList(args), shared, first, first_ctx);
  *out = result.release();
  TDR_CATCH
}

size_t tdr_tensor_list_len(TdrTensorList* list) {
  return list == nullptr ? 0 : list->tensors.size();
}

TdrTensor* tdr_tensor_list_take(TdrTensorList* list, size_t index) {
  try {
    return new at::Tensor(std::move(list->tensors.at(index)));
  } catch (...) {
    return nullptr;
  }
}

void tdr_tensor_list_free(TdrTensorList* list) { delete list; }

}  // extern "C"
