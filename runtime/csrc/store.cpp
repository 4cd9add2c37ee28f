// Stores: c10d's TCPStore (a rank's client, rank 0's server) and PrefixStore; values cross
// as bytes.

#include "internal.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>

using namespace tdr;

extern "C" {

char* tdr_store_tcp(const char* host, uint16_t port, bool is_server, int listen_fd,
                    int world_size, int64_t connect_timeout_ms, int64_t timeout_ms,
                    TdrStore** out) {
  TDR_TRY
  configure_logging();
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.isServer = is_server;
  if (is_server && listen_fd >= 0) {
    opts.masterListenFd = listen_fd;
  }
  opts.numWorkers = world_size;
  opts.waitWorkers = false;
  opts.timeout = Millis(connect_timeout_ms);
  auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
  store->setTimeout(Millis(timeout_ms));
  *out = new TdrStore{store};
  TDR_CATCH
}

// The TCPStore handshake of PyTorch's `wait_for_workers=True` (c10d's waitForWorkers): the
// rank adds 1 to the store's own worker count (`init/`, a key outside the TCPStore's "/"
// key prefix that Store::add cannot reach); the server then waits, at most `timeout_ms`,
// until the count reaches the world size. The store's timeout is restored afterwards.
char* tdr_store_check_in(TdrStore* s, int64_t timeout_ms) {
  TDR_TRY
  auto* tcp = dynamic_cast<c10d::TCPStore*>(s->store.get());
  if (tcp == nullptr) {
    throw std::runtime_error("the worker check-in needs a TCPStore");
  }
  auto before = tcp->getTimeout();
  tcp->setTimeout(Millis(std::max<int64_t>(timeout_ms, 1)));
  try {
    tcp->waitForWorkers();
  } catch (...) {
    tcp->setTimeout(before);
    throw;
  }
  tcp->setTimeout(before);
  TDR_CATCH
}

char* tdr_store_prefix(TdrStore* base, const char* prefix, TdrStore** out) {
  TDR_TRY
  auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), base->store);
  *out = new TdrStore{store};
  TDR_CATCH
}

char* tdr_store_set(TdrStore* s, const char* key, const uint8_t* data, size_t len) {
  TDR_TRY
  s->store->set(std::string(key), std::vector<uint8_t>(data, data + len));
  TDR_CATCH
}

// Blocks until `key` exists (up to the store's timeout); the value is malloc'ed for Rust.
char* tdr_store_get(TdrStore* s, const char* key, uint8_t** data, size_t* len) {
  TDR_TRY
  auto value = s->store->get(std::string(key));
  *len = value.size();
  *data = static_cast<uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
  if (*data == nullptr) {
    throw std::runtime_error("out of memory");
  }
  if (!value.empty()) {
    std::memcpy(*data, value.data(), value.size());
  }
  TDR_CATCH
}

char* tdr_store_add(TdrStore* s, const char* key, int64_t delta, int64_t* out) {
  TDR_TRY
  *out = s->store->add(std::string(key), delta);
  TDR_CATCH
}

char* tdr_store_compare_set(TdrStore* s, const char* key, const uint8_t* expected,
                            size_t expected_len, const uint8_t* desired, size_t desired_len,
                            uint8_t** data, size_t* len) {
  TDR_TRY
  auto value = s->store->compareSet(std::string(key),
                                    std::vector<uint8_t>(expected, expected + expected_len),
                                    std::vector<uint8_t>(desired, desired + desired_len));
  *len = value.size();
  *data = static_cast<uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
  if (*data == nullptr) {
    throw std::runtime_error("out of memory");
  }
  if (!value.empty()) {
    std::memcpy(*data, value.data(), value.size());
  }
  TDR_CATCH
}

char* tdr_store_check(TdrStore* s, const char* key, bool* out) {
  TDR_TRY
  *out = s->store->check({std::string(key)});
  TDR_CATCH
}

void tdr_bytes_free(uint8_t* data) { std::free(data); }

void tdr_store_free(TdrStore* s) { delete s; }

}  // extern "C"
