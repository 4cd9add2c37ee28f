// ---------------------------------------------------------------------------------------
// Shard fences (src/autograd/shard_fence.rs). A parameter an API keeps as this rank's shard (a
// fully_shard parameter between its uses, a tensor-parallel layer's weight) gives a wrong
// result when an op uses it without the API's hooks (`layer.forward(&x)`), under `no_grad`
// too, where autograd records nothing for the use guards to see. While a thread runs a
// hooked call of such an API, the dispatch key kFenceKey is in its thread-local included
// set, so every op on that thread goes first through `fence_fallback`: an op whose tensor
// arguments include an armed parameter (one that holds only its shard now) not opened on
// this thread (inside its own module's hooked call) is refused with a c10::Error, before
// any kernel runs; the message is cb(ctx, index), built by the Rust side, which also records
// the hit for `f_call`'s typed error. Any other op is redispatched below the key.
//
// Outside hooked calls the thread that created a fence keeps the key included too (the
// "watch"): a model whose root is run without any hooked call (`model.forward(&x)` under
// no_grad, where no use guard sees anything) would compute with the shards. There only the
// ops through which layers apply their weights (linear, matmul, embedding, convolutions,
// norms, ...: `applies_weights`) are refused on an armed parameter, and never inside a
// backward pass (a graph task runs: tensor-parallel weights are used as shards there by
// design); every other op passes, so optimizer steps, checkpoints and `clip_grad_norm`
// between steps use the shards freely.
//
// kFenceKey is DeferredInit: a functionality key above Autograd that libtorch reserves for
// torchdistx and registers nothing for (registration fails, as an error, if something else
// did). The fallback is registered once, on the first fence.
// ---------------------------------------------------------------------------------------

#include "internal.h"

#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <unordered_map>
#include <unordered_set>

struct TdrFence {
  std::vector<c10::TensorImpl*> impls;  // the parameters' tensor objects (set_data keeps them)
  std::vector<at::Tensor> params;       // held, so that no other tensor takes an address
  TdrCallback cb;
  void* ctx;
};

namespace {

constexpr c10::DispatchKey kFenceKey = c10::DispatchKey::DeferredInit;

struct Fenced {
  const TdrFence* fence;
  size_t index;
};

// The armed parameters, by tensor object. Written when a parameter is armed or disarmed
// (a reshard, an unshard), read by the fallback on every op of a checked call.
std::shared_mutex fences_mutex;
std::unordered_map<const c10::TensorImpl*, Fenced>& armed() {
  static auto* m = new std::unordered_map<const c10::TensorImpl*, Fenced>();
  return *m;
}
std::atomic<size_t> armed_count{0};

// This thread's checked calls (the key is included while > 0) and the fences opened by
// the hooked calls running on it, innermost last.
thread_local int fence_check_depth = 0;
thread_local std::vector<const TdrFence*> open_fences;
// Whether this thread watches for ops applying armed weights outside hooked calls (it
// created a fence that still lives), and how many fences live in the process.
thread_local bool fence_watch = false;
std::atomic<size_t> live_fences{0};

std::once_flag fence_registration;
std::string fence_registration_error;
std::atomic<bool> fence_registered{false};

// Refuses an op that uses an armed parameter outside its call; redispatches any other.
void check_tensor(const at::Tensor& t, const Fenced** found) {
  if (*found != nullptr || !t.defined()) {
    return;
  }
  auto it = armed().find(t.unsafeGetTensorImpl());
  if (it == armed().end()) {
    return;
  }
  const TdrFence* f = it->second.fence;
  if (std::find(open_fences.begin(), open_fences.end(), f) != open_fences.end()) {
    return;
  }
  *found = &it->second;
}

// Ops that read a tensor's metadata, never its elements: a shard gives them no wrong value,
// and the instance table's liveness check (`is_set_to`) runs inside hooked calls.
bool reads_no_elements(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> names = {
      "aten::is_set_to", "aten::is_same_size", "aten::size",  "aten::stride",
      "aten::sym_size",  "aten::sym_stride",   "aten::numel", "aten::sym_numel",
      "aten::dim"};
  return names.count(op.schema().name()) > 0;
}

// The ops through which a layer applies its weights to its input (tch's nn layers and
// hand-written ones: `linear`, `matmul` after `tr()`, `embedding`, convolutions, norms, the
// recurrent cells). Outside hooked calls, one of these on an armed parameter is a layer run
// without its hooks; optimizers, checkpoints and norms never call them on a parameter.
bool applies_weights(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> names = {
      "aten::linear",        "aten::matmul",           "aten::mm",
      "aten::bmm",           "aten::addmm",            "aten::addmv",
      "aten::mv",            "aten::t",                "aten::transpose",
      "aten::einsum",        "aten::bilinear",         "aten::embedding",
      "aten::embedding_bag", "aten::_embedding_bag",   "aten::index_select",
      "aten::conv1d",        "aten::conv2d",           "aten::conv3d",
      "aten::convolution",   "aten::_convolution",     "aten::conv_transpose1d",
      "aten::conv_transpose2d", "aten::conv_transpose3d", "aten::layer_norm",
      "aten::native_layer_norm", "aten::group_norm",   "aten::native_group_norm",
      "aten::batch_norm",    "aten::native_batch_norm", "aten::_batch_norm_impl_index",
      "aten::instance_norm", "aten::rms_norm",         "aten::_fused_rms_norm",
      "aten::lstm",          "aten::gru",              "aten::rnn_tanh",
      "aten::rnn_relu",      "aten::lstm_cell",        "aten::gru_cell",
      "aten::prelu",         "aten::_weight_norm"};
  return names.count(op.schema().name()) > 0;
}

// Whether a found armed parameter refuses this op: inside a checked call every op that
// reads elements; in the watch (outside hooked calls, outside backward) only ops that apply
// weights.
bool refuses(const c10::OperatorHandle& op) {
  if (fence_check_depth > 0) {
    return !reads_no_elements(op);
  }
  return fence_watch && torch::autograd::get_current_graph_task_id() == -1 &&
         applies_weights(op);
}

void fence_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                    torch::jit::Stack* stack) {
  if (armed_count.load(std::memory_order_relaxed) > 0) {
    const size_t n = op.schema().arguments().size();
    std::string refusal;
    {
      std::shared_lock<std::shared_mutex> lock(fences_mutex);
      const Fenced* found = nullptr;
      for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n); it != stack->end(); ++it) {
        if (it->isTensor()) {
          check_tensor(it->toTensor(), &found);
        } else if (it->isList()) {
          // Tensor[] (cat), Tensor?[] (index) and other lists.
          for (const c10::IValue& v : it->toListRef()) {
            if (v.isTensor()) {
              check_tensor(v.toTensor(), &found);
            }
          }
        }
        if (found != nullptr) {
          break;
        }
      }
      if (found != nullptr && refuses(op)) {
        // Under the lock: the fence (and the Rust context) stays alive for the callback.
        char* msg = found->fence->cb(found->fence->ctx, found->index);
        refusal = msg != nullptr ? std::string(msg)
                                 : std::string("a sharded parameter was used outside its "
                                               "module's hooked call");
        std::free(msg);
      }
    }
    if (!refusal.empty()) {
      // The message alone (no "Exception raised from ..." line): outside hooked calls it is
      // what tch's panic shows the user.
      throw c10::Error(refusal);
    }
  }
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kFenceKey),
                     stack);
}

void register_fence_fallback() {
  std::call_once(fence_registration, [] {
    try {
      if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kFenceKey)) {
        fence_registration_error =
            "the dispatch key DeferredInit already has a fallback in this process (torchdistx "
            "loaded?): the shard fences cannot be installed";
        return;
      }
      // Kept for the life of the process, as TORCH_LIBRARY_IMPL's static is.
      auto* lib = new torch::Library(torch::Library::IMPL, "_", kFenceKey, __FILE__, __LINE__);
      lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fence_fallback>());
      fence_registered = true;
    } catch (const c10::Error& e) {
      fence_registration_error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      fence_registration_error = e.what();
    }
  });
  if (!fence_registered.load()) {
    throw std::runtime_error(fence_registration_error);
  }
}

// Includes the key while this thread runs a checked call or watches.
void update_fence_key() {
  if (fence_registered.load(std::memory_order_relaxed)) {
    c10::impl::tls_set_dispatch_key_included(kFenceKey, fence_check_depth > 0 || fence_watch);
  }
}

}  // namespace

extern "C" {

char* tdr_fence_new(at::Tensor** params, size_t n, TdrCallback cb, void* ctx, TdrFence** out) {
  TDR_TRY
  register_fence_fallback();
  auto fence = std::make_unique<TdrFence>();
  fence->cb = cb;
  fence->ctx = ctx;
  for (size_t i = 0; i < n; ++i) {
    fence->params.push_back(*params[i]);
    fence->impls.push_back(params[i]->unsafeGetTensorImpl());
  }
  *out = fence.release();
  live_fences.fetch_add(1);
  fence_watch = true;
  update_fence_key();
  TDR_CATCH
}

char* tdr_fence_set_armed(TdrFence* f, size_t index, bool on) {
  TDR_TRY
  if (index >= f->impls.size()) {
    throw std::runtime_error("no such fenced parameter");
  }
  std::unique_lock<std::shared_mutex> lock(fences_mutex);
  const c10::TensorImpl* impl = f->impls[index];
  auto it = armed().find(impl);
  if (on && it == armed().end()) {
    armed().emplace(impl, Fenced{f, index});
    armed_count.fetch_add(1);
  } else if (!on && it != armed().end() && it->second.fence == f) {
    armed().erase(it);
    armed_count.fetch_sub(1);
  }
  TDR_CATCH
}

void tdr_fence_free(TdrFence* f) {
  if (f == nullptr) {
    return;
  }
  try {
    std::unique_lock<std::shared_mutex> lock(fences_mutex);
    for (const c10::TensorImpl* impl : f->impls) {
      auto it = armed().find(impl);
      if (it != armed().end() && it->second.fence == f) {
        armed().erase(it);
        armed_count.fetch_sub(1);
      }
    }
  } catch (...) {
  }
  delete f;
  if (live_fences.fetch_sub(1) == 1) {
    // The last fence is gone: this thread stops watching (another thread that created one
    // keeps the key until its next checked call ends, at the cost of a lookup per op).
    fence_watch = false;
    update_fence_key();
  }
}

void tdr_fence_check_enter(void) {
  if (fence_check_depth++ == 0) {
    update_fence_key();
  }
}

void tdr_fence_check_exit(void) {
  if (fence_check_depth > 0 && --fence_check_depth == 0) {
    update_fence_key();
  }
}

void tdr_fence_open(TdrFence* f) {
  try {
    open_fences.push_back(f);
  } catch (...) {
    // Out of memory: the fence stays closed, so this call's own ops are refused (an error,
    // never a wrong value).
  }
}

void tdr_fence_close(TdrFence* f) {
  auto it = std::find(open_fences.rbegin(), open_fences.rend(), f);
  if (it != open_fences.rend()) {
    open_fences.erase(std::next(it).base(), open_fences.end());
  }
}

void tdr_fence_reset_thread(void) {
  fence_check_depth = 0;
  open_fences.clear();
  fence_watch = fence_watch && live_fences.load() > 0;
  update_fence_key();
}

bool tdr_fence_suspend(bool suspended) {
  const bool before = c10::impl::tls_is_dispatch_key_excluded(kFenceKey);
  c10::impl::tls_set_dispatch_key_excluded(kFenceKey, suspended);
  return before;
}

}  // extern "C"
