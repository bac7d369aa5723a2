#include "common/cuda/device_guard.h"

#include <cuda_runtime_api.h>

#include "common/cuda/driver_api.h"

namespace cache_dit_opd::cuda {
namespace {

// The device whose primary context this thread last bound through a
// DeviceGuard; -1 before the first. cudaGetDevice alone reports device 0 on a
// fresh thread without binding any context, which driver calls then lack.
thread_local int t_bound_device = -1;

}  // namespace

DeviceGuard::DeviceGuard(int device) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess) {
    cudaGetLastError();
    status_ = Status::Unavailable("cudaGetDevice: ", RuntimeErrorString(err));
    return;
  }
  if (current == device && t_bound_device == device) return;
  // cudaSetDevice initializes and binds the primary context (CUDA >= 12).
  err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    status_ = Status::Unavailable("cudaSetDevice(", device, "): ", RuntimeErrorString(err));
    return;
  }
  t_bound_device = device;
  if (current != device) {
    previous_ = current;
    restore_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (!restore_) return;
  if (cudaSetDevice(previous_) == cudaSuccess) {
    t_bound_device = previous_;
  } else {
    cudaGetLastError();
  }
}

}  // namespace cache_dit_opd::cuda
