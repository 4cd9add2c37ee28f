// Autograd: gradient-ready hooks and end-of-backward callbacks (the reducer's triggers).

#include "internal.h"

#include <torch/csrc/autograd/graph_task.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdlib>

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

bool tdr_in_backward(void) { return torch::autograd::get_current_graph_task_id() != -1; }

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
