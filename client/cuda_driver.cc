#include "client/cuda_driver.h"

#include <cuda_runtime_api.h>

namespace cache_dit_opd::client {
namespace {

struct Loaded {
  DriverApi api;
  Status status;
};

template <typename Fn>
Status Resolve(const char* symbol, unsigned int version, Fn* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &p, version, cudaEnableDefault, &query);
  if (err != cudaSuccess) {
    cudaGetLastError();  // the runtime keeps the error per thread; do not leak it into later checks
    return Status::Unavailable("CUDA driver entry point ", symbol, "@", version, ": ",
                               RuntimeErrorString(err),
                               " (is an NVIDIA driver installed and a GPU visible?)");
  }
  if (query != cudaDriverEntryPointSuccess || p == nullptr) {
    return Status::Unavailable("CUDA driver entry point ", symbol, "@", version, " not found (",
                               query == cudaDriverEntryPointVersionNotSufficent ? "driver too old"
                                                                               : "symbol not found",
                               ")");
  }
  *fn = reinterpret_cast<Fn>(p);
  return Status::Ok();
}

Loaded LoadAll() {
  Loaded l;
  DriverApi& a = l.api;
  Status s;
  // 12000 yields the _v2 stream memory operations (their typedefs carry the
  // 11.7 suffix of the release that introduced them).
  if (s.ok()) s = Resolve("cuStreamWriteValue64", 12000, &a.stream_write_value64);
  if (s.ok()) s = Resolve("cuStreamWaitValue64", 12000, &a.stream_wait_value64);
  if (s.ok()) s = Resolve("cuMemHostRegister", 6050, &a.mem_host_register);
  if (s.ok()) s = Resolve("cuMemHostUnregister", 4000, &a.mem_host_unregister);
  if (s.ok()) s = Resolve("cuMemHostGetDevicePointer", 3020, &a.mem_host_get_device_pointer);
  if (s.ok()) s = Resolve("cuMemGetAddressRange", 3020, &a.mem_get_address_range);
  if (s.ok()) s = Resolve("cuIpcGetMemHandle", 4010, &a.ipc_get_mem_handle);
  if (s.ok()) s = Resolve("cuPointerGetAttributes", 7000, &a.pointer_get_attributes);
  if (s.ok()) s = Resolve("cuGetErrorName", 6000, &a.get_error_name);
  if (s.ok()) s = Resolve("cuGetErrorString", 6000, &a.get_error_string);
  l.status = s;
  return l;
}

const Loaded& Get() {
  static const Loaded loaded = LoadAll();
  return loaded;
}

// The device whose primary context this thread last bound through a
// DeviceGuard; -1 before the first. cudaGetDevice alone reports device 0 on a
// fresh thread without binding any context, which driver calls then lack.
thread_local int t_bound_device = -1;

}  // namespace

const DriverApi* GetDriverApi(Status* status) {
  const Loaded& l = Get();
  if (!l.status.ok()) {
    if (status != nullptr) *status = l.status;
    return nullptr;
  }
  return &l.api;
}

std::string DriverErrorString(CUresult result) {
  const Loaded& l = Get();
  const char* name = nullptr;
  const char* text = nullptr;
  if (l.status.ok()) {
    l.api.get_error_name(result, &name);
    l.api.get_error_string(result, &text);
  }
  std::string out = name ? name : "CUresult(" + std::to_string(static_cast<int>(result)) + ")";
  if (text) out += std::string(" (") + text + ")";
  return out;
}

std::string RuntimeErrorString(int cuda_error) {
  auto e = static_cast<cudaError_t>(cuda_error);
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

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

}  // namespace cache_dit_opd::client
