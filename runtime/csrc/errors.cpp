// The boundary's error side: the kind of this thread's last failure (tdr_last_error_kind),
// the messages handed to Rust, and c10's logging (no C++ backtraces in messages and logs).

#include "internal.h"

#include <c10/util/Logging.h>

#include <cstdlib>
#include <cstring>

namespace tdr {

char* dup_message(const char* msg) {
  size_t n = std::strlen(msg);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) {
    std::memcpy(out, msg, n + 1);
  }
  return out;
}

char* dup_message(const std::string& msg) { return dup_message(msg.c_str()); }

int classify(const std::string& msg, int fallback) {
  if (msg.find("collective operation timeout") != std::string::npos ||
      msg.find("timed out in blocking wait") != std::string::npos) {
    return TDR_ERROR_BACKEND_TIMEOUT;
  }
  if (msg.find("remote process exited or there was a network error") != std::string::npos) {
    return TDR_ERROR_NETWORK;
  }
  return fallback;
}

thread_local int last_error_kind = TDR_ERROR_NONE;

char* fail(int kind, const char* msg) {
  last_error_kind = kind;
  return dup_message(msg);
}

void configure_logging() {
  static std::once_flag once;
  std::call_once(once, []() {
    const char* show = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
    if (show == nullptr || std::string(show) != "1") {
      c10::SetStackTraceFetcher([]() { return std::string(); });
    }
  });
}

}  // namespace tdr

extern "C" {

void tdr_string_free(char* s) { std::free(s); }

int tdr_last_error_kind() { return tdr::last_error_kind; }

}  // extern "C"
