#include "common/cuda/driver_api.h"

#include <cuda_runtime_api.h>

namespace cache_dit_opd::cuda {
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
    cudaGetLastError();  // the runtime records it per thread; do not leak it to later checks
    return Status::Unavailable("CUDA driver entry point ", symbol, "@", version, ": ",
                               RuntimeErrorString(err),
                               " (is an NVIDIA driver installed and a GPU visible?)");
  }
  if (query != cudaDriverEntryPointSuccess || p == nullptr) {
    return Status::Unavailable("CUDA driver entry point ", symbol, "@", version, " not found (",
                               query == cudaDriverEntryPointVersionNotSufficent
                                   ? "driver too old"
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
  // Requesting 12000 yields the _v2 stream memory operations (the versioned
  // typedefs are named after the release that introduced them, 11.7).
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
  auto err = static_cast<cudaError_t>(cuda_error);
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

bool IsStickyCudaError(int code) {
  switch (code) {
    case 214:  // ECC uncorrectable
    case 700:  // illegal address
    case 702:  // launch timeout
    case 709:  // context is destroyed
    case 710:  // device-side assert
    case 714:  // hardware stack error
    case 715:  // illegal instruction
    case 716:  // misaligned address
    case 717:  // invalid address space
    case 718:  // invalid PC
    case 719:  // launch failed
    case 999:  // unknown
      return true;
    default:
      return false;
  }
}

}  // namespace cache_dit_opd::cuda
