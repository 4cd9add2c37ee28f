// Kernels the Rust side calls directly: a randperm from a seeded generator of its own
// (DistributedSampler's shuffle) and libtorch's fused AdamW and SGD steps (torch.optim's
// `fused=True`).

#include "internal.h"

#include <ATen/CPUGeneratorImpl.h>

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
