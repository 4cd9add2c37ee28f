// Custom autograd functions whose forward and backward are both Rust callbacks
// (src/autograd/function.rs): torch.autograd.Function with its two static methods in Rust,
// for operations whose backward is not the graph of their forward (ring attention replays
// its ring with the merged output instead of keeping every block's activations).

#include "internal.h"

#include <torch/csrc/autograd/custom_function.h>

#include <utility>

namespace tdr_function {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the backward needs: its callback and the Rust context (released with this), and how
// many inputs it returns gradients for.
struct Shared : torch::CustomClassHolder {
  TdrForwardCallback backward = nullptr;
  void* backward_ctx = nullptr;
  TdrRelease release = nullptr;
  size_t num_inputs = 0;
  ~Shared() override {
    if (release != nullptr) {
      release(backward_ctx);
    }
  }
};

struct RustFunction : public torch::autograd::Function<RustFunction> {
  // Function::apply runs this with grad disabled, as torch.autograd.Function.apply does.
  static variable_list forward(AutogradContext* ctx, at::TensorList args,
                               c10::intrusive_ptr<Shared> shared, TdrForwardCallback first,
                               void* first_ctx) {
    auto outputs =
        tdr::call_forward(first, first_ctx, std::vector<at::Tensor>(args.begin(), args.end()));
    tdr::check_forward_outputs(ctx, outputs);
    ctx->saved_data["shared"] = c10::IValue::make_capsule(std::move(shared));
    return outputs;
  }

  // `grad_outputs`: one per output, zeros where an output got no gradient.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto shared =
        c10::static_intrusive_pointer_cast<Shared>(ctx->saved_data["shared"].toCapsule());
    auto grads = tdr::call_forward(shared->backward, shared->backward_ctx, grad_outputs);
    if (grads.size() != shared->num_inputs) {
      throw std::runtime_error("the backward returned " + std::to_string(grads.size()) +
                               " gradients for " + std::to_string(shared->num_inputs) +
                               " inputs");
    }
    // One slot per argument of `forward`: the inputs, then the three that are not tensors.
    grads.resize(shared->num_inputs + 3);
    return grads;
  }
};

}  // namespace tdr_function

bool tdr::is_rust_function_node(const torch::autograd::Node* node) {
  return dynamic_cast<const torch::autograd::CppNode<tdr_function::RustFunction>*>(node) !=
         nullptr;
}

extern "C" {

char* tdr_function_apply(TdrTensor** inputs, size_t num_inputs, TdrForwardCallback forward,
                         void* forward_ctx, TdrForwardCallback backward, void* backward_ctx,
                         TdrRelease release, TdrTensorList** out) {
  TDR_TRY
  // Owns the context from here, so that it is released however this ends.
  auto shared = c10::make_intrusive<tdr_function::Shared>();
  shared->backward = backward;
  shared->backward_ctx = backward_ctx;
  shared->release = release;
  shared->num_inputs = num_inputs;
  torch::autograd::variable_list args;
  args.reserve(num_inputs);
  for (size_t i = 0; i < num_inputs; ++i) {
    args.push_back(*inputs[i]);
  }
  auto result = std::make_unique<TdrTensorList>();
  result->tensors = tdr_function::RustFunction::apply(at::TensorList(args), std::move(shared),
                                                       forward, forward_ctx);
  *out = result.release();
  TDR_CATCH
}

}  // extern "C"
