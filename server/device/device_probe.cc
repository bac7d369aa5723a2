#include "server/device/device_probe.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>

#include "common/cuda/driver_api.h"
#include "common/gpu_uuid.h"

namespace cache_dit_opd::cuda {

void ConfigureCudaEnvironment(std::vector<std::string>* notes) {
  // Eager: a kernel loaded lazily at its first launch waits behind a parked
  // stream wait (bench/probes/stream_queues.cu, PROBE_LAZY=1: it hangs).
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  if (loading == nullptr || std::string(loading) != "EAGER") {
    if (loading != nullptr) {
      notes->push_back(std::string("CUDA_MODULE_LOADING=") + loading +
                       " replaced by EAGER (a lazily loaded kernel can wait behind a parked lane)");
    }
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  }
  if (std::getenv("CUDA_DEVICE_MAX_CONNECTIONS") == nullptr) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(kMaxConnections).c_str(), 1);
  }
}

int DeviceConnections() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  int n = v != nullptr ? std::atoi(v) : 8;  // CUDA's default
  return n < 1 ? 8 : (n > kMaxConnections ? kMaxConnections : n);
}

DeviceInfo ProbeDevice(int device) {
  DeviceInfo info;
  cudaRuntimeGetVersion(&info.runtime_version);
  // Returns 0 (and success) when no driver is installed.
  cudaDriverGetVersion(&info.driver_version);

  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    info.reason = "no GPU: cudaGetDeviceCount: " + RuntimeErrorString(err);
    if (info.driver_version == 0) info.reason += "; no CUDA driver is installed";
    return info;
  }
  if (count == 0) {
    info.reason = "no GPU: no CUDA device is visible";
    return info;
  }
  if (device < 0 || device >= count) {
    info.reason = "no GPU: --device " + std::to_string(device) + " but " + std::to_string(count) +
                  " CUDA device(s) are visible";
    return info;
  }
  info.index = device;
  info.connections = DeviceConnections();

  cudaDeviceProp prop{};
  err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    info.reason = "GPU " + std::to_string(device) + ": cudaGetDeviceProperties: " + RuntimeErrorString(err);
    return info;
  }
  info.name = prop.name;
  info.uuid = FormatGpuUuid(reinterpret_cast<const uint8_t*>(prop.uuid.bytes));

  err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaFree(nullptr);  // creates the primary context now, not on the first call
  if (err != cudaSuccess) {
    cudaGetLastError();
    info.reason = "GPU " + std::to_string(device) + " (" + info.uuid + "): CUDA context: " + RuntimeErrorString(err);
    return info;
  }

  Status s;
  if (GetDriverApi(&s) == nullptr) {
    info.reason = "GPU " + std::to_string(device) + ": " + s.message();
    return info;
  }
  info.ok = true;
  return info;
}

}  // namespace cache_dit_opd::cuda
