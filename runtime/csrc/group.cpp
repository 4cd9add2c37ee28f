// Process groups: a TdrGroup's backends as PyTorch's _new_process_group_helper makes them
// (ProcessGroupGloo with Gloo's devices as PyTorch's binding creates them, ProcessGroupNCCL,
// and with TCH_DIST_DEBUG=DETAIL their wrappers, detail.cpp); eager connect and shutdown.

#include "internal.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef TDR_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>

using namespace tdr;

namespace {

#ifdef TDR_WITH_NCCL
// tch-dist surfaces NCCL's failures and watchdog timeouts as error values from the next
// wait, as Gloo's: unless the user chose otherwise, NCCL's watchdog aborts the communicators
// and leaves the process up (CleanUpOnly) instead of PyTorch's default of taking the process
// down (SkipCleanUp). Set once, before the first ProcessGroupNCCL reads it.
void default_nccl_error_handling() {
  static std::once_flag once;
  std::call_once(once, []() { setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0); });
}

at::Device cuda_device(int device) {
  return at::Device(at::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
}
#endif

// Shuts the backends down, once: NCCL's communicators are flushed and destroyed (aborted if
// that fails), then the group lets go of both backends (Gloo's is destroyed once no autograd
// node holds it, after its queued work). Launches that follow fail with ShutDownError.
void shutdown_backends(Backends& b) {
  c10::intrusive_ptr<c10d::Backend> gloo;
  c10::intrusive_ptr<c10d::Backend> nccl;
  {
    std::unique_lock<std::shared_mutex> lock(b.mutex);
    if (b.shut_down) {
      return;
    }
    b.shut_down = true;
    gloo = std::move(b.gloo);
    nccl = std::move(b.nccl_raw);
    b.nccl.reset();
    b.gloo_check.reset();
    b.nccl_check.reset();
  }
  if (nccl) {
    try {
      nccl->shutdown();
    } catch (...) {
      try {
        nccl->abort();
      } catch (...) {
      }
    }
  }
}

// The Gloo devices PyTorch 2.11's Python binding of ProcessGroupGloo creates: one per
// comma-separated GLOO_SOCKET_IFNAME entry, else one default device (this machine's hostname,
// falling back to loopback), each with c10d's default lazy init (TORCH_GLOO_LAZY_INIT), and
// two threads per device. Collectives are spread over the devices by tag, so every rank of a
// group, PyTorch's included, must create as many. `host` (runtime/src/c10d/interface.rs:
// 127.0.0.1 for a loopback rendezvous, else the source address of the route to MASTER_ADDR)
// replaces the default device's address when GLOO_SOCKET_IFNAME is unset: the same count of
// devices, at an address the peers reach (the hostname's may be loopback).
void add_gloo_devices(c10d::ProcessGroupGloo::Options& opts, const std::string& host) {
  bool lazy = c10d::getDefaultGlooLazyInit();
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && std::strlen(ifname) > 1) {
    std::string list(ifname);
    size_t start = 0;
    while (start <= list.size()) {
      size_t comma = list.find(',', start);
      std::string iface = list.substr(start, comma == std::string::npos ? std::string::npos
                                                                        : comma - start);
      if (!iface.empty()) {
        opts.devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface, lazy));
      }
      if (comma == std::string::npos) {
        break;
      }
      start = comma + 1;
    }
  }
  if (opts.devices.empty()) {
    opts.devices.push_back(host.empty()
                               ? c10d::ProcessGroupGloo::createDefaultDevice(lazy)
                               : c10d::ProcessGroupGloo::createDeviceForHostname(host, lazy));
  }
  opts.threads = static_cast<int>(opts.devices.size()) * 2;
}

// A Gloo backend over `store` (already prefixed, as PyTorch's `cpu/` store): its rendezvous
// waits at most `rendezvous`, then its timeout (every collective's default, the monitored
// barrier's) is `timeout`.
c10::intrusive_ptr<c10d::ProcessGroupGloo> new_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size, Millis rendezvous,
                                                    Millis timeout, const std::string& host) {
  auto opts = c10d::ProcessGroupGloo::Options::create(rendezvous);
  add_gloo_devices(*opts, host);
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  gloo->setTimeout(timeout);
  return gloo;
}

c10::intrusive_ptr<c10d::Store> prefixed(const std::string& prefix,
                                         const c10::intrusive_ptr<c10d::Store>& store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, store);
}

}  // namespace

extern "C" {

bool tdr_nccl_compiled() {
#ifdef TDR_WITH_NCCL
  return true;
#else
  return false;
#endif
}

// `store` is the group's store, PyTorch's `PrefixStore(f"{group_name}/", default store)`; as
// PyTorch's _new_process_group_helper, each backend gets `PrefixStore(f"{device}/")` over
// it (`cpu/` for Gloo, `cuda/` for NCCL) unless `store_as_given` (torchft's reconfigurable
// group puts its Gloo backend straight on the quorum's store, and a tch-dist member of a
// quorum must meet it there), and with DETAIL the wrapper's helper Gloo group
// `PrefixStore(f"pg_wrapper:{group_name}")` over that. `gloo_host` names the address Gloo
// binds to when GLOO_SOCKET_IFNAME is unset; empty means c10d's default device (this
// machine's hostname, falling back to loopback). A `device` of 0 or more becomes this
// thread's current CUDA device (torch.cuda.set_device) and NCCL's bound device
// (init_process_group's device_id); NCCL connects lazily, at the first collective, unless
// tdr_group_connect is called. Without `with_gloo` (PyTorch's "nccl") there is no Gloo
// backend: CPU tensors are refused and barriers go through NCCL.
char* tdr_group_new(TdrStore* store, const char* group_name, int rank, int size,
                    int64_t timeout_ms, int64_t rendezvous_ms, const char* gloo_host,
                    bool with_gloo, bool with_nccl, int device, bool cuda_via_gloo, bool detail,
                    bool store_as_given, TdrGroup** out) {
  TDR_TRY
  configure_logging();
  auto timeout = Millis(timeout_ms);
  auto deadline = std::chrono::steady_clock::now() + Millis(rendezvous_ms);
  // What is left of the rendezvous' time (at least a millisecond: 0 reads as "no limit").
  auto left = [deadline]() {
    auto d = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
    return std::max(d, Millis(1));
  };
  if (device >= 0) {
    char* err = tdr_cuda_set_device(device);
    if (err != nullptr) {
      std::string msg(err);
      std::free(err);
      throw std::runtime_error("binding CUDA device " + std::to_string(device) + ": " + msg);
    }
  }
  std::string host(gloo_host);
  std::string wrapper_prefix = std::string("pg_wrapper:") + group_name;
  auto backends = std::make_shared<Backends>();
  if (with_gloo || cuda_via_gloo) {
    auto cpu_store = store_as_given ? store->store : prefixed("cpu/", store->store);
    backends->gloo = new_gloo(cpu_store, rank, size, left(), timeout, host);
    if (detail) {
      // The checks' own Gloo backend (PyTorch's helper group of
      // TORCH_DISTRIBUTED_DEBUG=DETAIL), so that their traffic never interleaves with the
      // collectives they check.
      backends->gloo_check =
          new_gloo(prefixed(wrapper_prefix, cpu_store), rank, size, left(), timeout, host);
      backends->gloo = wrap_checked(backends->gloo, backends->gloo_check, backends->foreign);
    }
  }
  if (with_nccl && !cuda_via_gloo) {
#ifdef TDR_WITH_NCCL
    if (device < 0) {
      throw std::runtime_error("an NCCL group needs a CUDA device to bind");
    }
    default_nccl_error_handling();
    auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
    nccl_opts->timeout = timeout;
    nccl_opts->is_high_priority_stream = false;
    nccl_opts->group_name = group_name;
    auto cuda_store = store_as_given ? store->store : prefixed("cuda/", store->store);
    backends->nccl_raw =
        c10::make_intrusive<c10d::ProcessGroupNCCL>(cuda_store, rank, size, nccl_opts);
    backends->nccl_raw->setBoundDeviceId(cuda_device(device));
    backends->nccl = backends->nccl_raw;
    if (detail) {
      backends->nccl_check =
          new_gloo(prefixed(wrapper_prefix, cuda_store), rank, size, left(), timeout, host);
      backends->nccl = wrap_checked(backends->nccl_raw, backends->nccl_check, backends->foreign);
    }
#else
    throw std::runtime_error("tch-dist was built without NCCL support");
#endif
  }
  if (!backends->gloo && !backends->nccl) {
    throw std::runtime_error("a process group needs a Gloo or an NCCL backend");
  }
  *out = new TdrGroup{rank, size, timeout, device, cuda_via_gloo, std::move(backends)};
  TDR_CATCH
}

// init_process_group's eager init: NCCL creates its communicator on the bound device now
// (ncclCommInitRank with every rank) instead of at the first collective. A group without
// NCCL has nothing to connect.
char* tdr_group_connect(TdrGroup* g) {
  TDR_TRY
  Route r = lock_backends(*g);
#ifdef TDR_WITH_NCCL
  if (g->backends->nccl) {
    g->backends->nccl_raw->eagerConnectSingleDevice(cuda_device(g->device));
  }
#endif
  TDR_CATCH
}

// DETAIL in a job with ranks that are not tch-dist's: c10d's checks only (see Backends).
char* tdr_group_set_foreign_peers(TdrGroup* g, bool foreign) {
  TDR_TRY
  g->backends->foreign->store(foreign);
  TDR_CATCH
}

// c10d's getDefaultGlooLazyInit, the setting every group's devices are created with.
char* tdr_gloo_lazy_init(bool* out) {
  TDR_TRY
  *out = c10d::getDefaultGlooLazyInit();
  TDR_CATCH
}

// Shuts the backends down now, whoever else holds the group (see shutdown_backends).
char* tdr_group_shutdown(TdrGroup* g) {
  TDR_TRY
  shutdown_backends(*g->backends);
  TDR_CATCH
}

void tdr_group_free(TdrGroup* g) {
  if (g == nullptr) {
    return;
  }
  try {
    shutdown_backends(*g->backends);
  } catch (...) {
    // Shutting down a broken communicator may throw; the group is going away regardless.
  }
  delete g;
}

}  // extern "C"
