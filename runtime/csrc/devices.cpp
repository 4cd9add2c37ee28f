// CUDA devices: torch.cuda.set_device and a GPU's UUID; both refuse in a build without CUDA.

#include "internal.h"

#ifdef TDR_WITH_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <cstdio>

using namespace tdr;

extern "C" {

// torch.cuda.set_device: the calling thread's current CUDA device.
char* tdr_cuda_set_device(int device) {
  TDR_TRY
#ifdef TDR_WITH_NCCL
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
#else
  (void)device;
  throw std::runtime_error("tch-dist was built without CUDA support (no NCCL headers)");
#endif
  TDR_CATCH
}

// The GPU's UUID as nvidia-smi prints it ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"):
// the same physical GPU has the same UUID whatever CUDA_VISIBLE_DEVICES calls it.
char* tdr_cuda_device_uuid(int device, char** out) {
  TDR_TRY
#ifdef TDR_WITH_NCCL
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
  const auto* b = reinterpret_cast<const unsigned char*>(prop->uuid.bytes);
  char text[64];
  std::snprintf(text, sizeof(text),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  *out = dup_message(text);
  if (*out == nullptr) {
    throw std::runtime_error("out of memory");
  }
#else
  (void)device;
  (void)out;
  throw std::runtime_error("tch-dist was built without CUDA support (no NCCL headers)");
#endif
  TDR_CATCH
}

}  // extern "C"
