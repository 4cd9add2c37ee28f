// Fully sharded parameters (fully_shard). Between steps a parameter holds its shard; during
// its group's forward and backward it holds the gathered full tensor. Its gradient must not
// land in `.grad` (which keeps the shard's shape for the optimizer): a pre-hook on the
// gradient accumulator hands the full gradient to Rust and passes on an undefined tensor,
// which AccumulateGrad skips. The accumulator is made while the parameter is full-sized and
// held by the registration, so autograd checks gradients against the full shape. The full
// tensor's memory is released between uses by shrinking its storage to nothing and given
// back before the next use, so tensors autograd saved (views of it) see the refilled values.

#include "internal.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdlib>

namespace {

// A Rust context shared by the hooks that call into it: released (ctx's `release`) when the
// last hook holding it is destroyed, which may be after Rust dropped its own handle.
using SharedContext = std::shared_ptr<void>;

void call_grad_or_throw(TdrGradCallback cb, void* ctx, size_t index, const at::Tensor& grad) {
  at::Tensor handle = grad;
  char* err = cb(ctx, index, &handle);
  if (err != nullptr) {
    std::string msg(err);
    std::free(err);
    throw std::runtime_error(msg);
  }
}

struct GradInterceptor : torch::autograd::FunctionPreHook {
  TdrGradCallback cb;
  SharedContext ctx;
  size_t index;
  GradInterceptor(TdrGradCallback cb, SharedContext ctx, size_t index)
      : cb(cb), ctx(std::move(ctx)), index(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!grads.empty() && grads[0].defined()) {
      call_grad_or_throw(cb, ctx.get(), index, grads[0]);
    }
    // AccumulateGrad returns without touching `.grad` for an undefined gradient.
    return torch::autograd::variable_list(grads.size());
  }
};

}  // namespace

struct TdrInterceptor {
  std::shared_ptr<torch::autograd::Node> accumulator;
  const GradInterceptor* hook;
};

extern "C" {

char* tdr_add_grad_interceptor(at::Tensor* param, TdrGradCallback cb, void* ctx,
                               TdrRelease release, size_t index, TdrInterceptor** out) {
  TDR_TRY
  SharedContext shared(ctx, release);
  if (!param->requires_grad() || !param->is_leaf()) {
    throw std::runtime_error("only leaf tensors that require grad have a gradient accumulator");
  }
  auto acc = torch::autograd::impl::grad_accumulator(*param);
  if (!acc) {
    throw std::runtime_error("tensor has no gradient accumulator");
  }
  auto hook = std::make_unique<GradInterceptor>(cb, std::move(shared), index);
  const GradInterceptor* raw = hook.get();
  acc->add_pre_hook(std::move(hook));
  *out = new TdrInterceptor{std::move(acc), raw};
  TDR_CATCH
}

void tdr_interceptor_remove(TdrInterceptor* h) {
  if (h == nullptr) {
    return;
  }
  try {
    auto& hooks = h->accumulator->pre_hooks();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [h](const std::unique_ptr<torch::autograd::FunctionPreHook>& p) {
                                 return p.get() == h->hook;
                               }),
                hooks.end());
  } catch (...) {
  }
  delete h;
}

char* tdr_add_output_grad_hook(at::Tensor* output, TdrGradCallback cb, void* ctx,
                               TdrRelease release, size_t index) {
  TDR_TRY
  SharedContext shared(ctx, release);
  if (!output->requires_grad()) {
    throw std::runtime_error("the tensor does not require grad");
  }
  output->register_hook([cb, shared, index](const at::Tensor& grad) {
    call_grad_or_throw(cb, shared.get(), index, grad);
  });
  TDR_CATCH
}

char* tdr_storage_release(at::Tensor* t) {
  TDR_TRY
  c10::StorageImpl* st = t->storage().unsafeGetStorageImpl();
  c10::Allocator* alloc = st->allocator();
  if (alloc == nullptr) {
    alloc = c10::GetAllocator(t->device().type());
  }
  st->set_data_ptr_noswap(alloc->allocate(0));
  st->set_nbytes(0);
  TDR_CATCH
}

char* tdr_storage_restore(at::Tensor* t) {
  TDR_TRY
  c10::StorageImpl* st = t->storage().unsafeGetStorageImpl();
  const size_t needed = (t->storage_offset() + t->numel()) * t->element_size();
  if (st->nbytes() < needed) {
    c10::Allocator* alloc = st->allocator();
    if (alloc == nullptr) {
      alloc = c10::GetAllocator(t->device().type());
    }
    st->set_data_ptr_noswap(alloc->allocate(needed));
    st->set_nbytes(needed);
  }
  TDR_CATCH
}

size_t tdr_storage_nbytes(at::Tensor* t) {
  try {
    return t->storage().nbytes();
  } catch (...) {
    return 0;
  }
}

char* tdr_set_data_keep_accumulator(at::Tensor* param, at::Tensor* data) {
  TDR_TRY
  c10::TensorImpl* impl = param->unsafeGetTensorImpl();
  if (!impl->has_compatible_shallow_copy_type(data->key_set())) {
    throw std::runtime_error("set_data: the new data is of an incompatible tensor type");
  }
  // What Tensor::set_data does, without resetting the gradient accumulator on a dtype
  // change.
  impl->shallow_copy_from(data->getIntrusivePtr());
  TDR_CATCH
}

uint64_t tdr_tensor_version(at::Tensor* t) {
  try {
    return static_cast<uint64_t>(t->_version());
  } catch (...) {
    return UINT64_MAX;
  }
}

uint64_t tdr_tensor_identity(at::Tensor* t) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t->unsafeGetTensorImpl()));
}

size_t tdr_tensor_use_count(at::Tensor* t) { return t->defined() ? t->use_count() : 0; }

}  // extern "C"
