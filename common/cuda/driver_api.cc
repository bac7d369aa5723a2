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
  if (s.ok()) s = Resolve("cuStreamBatchMemOp", 12000, &a.stream_batch_mem_op);
  if (s.ok()) s = Resolve("cuMemHostRegister", 6050, &a.mem_host_register);
  if (s.ok()) s = Resolve("cuMemHostUnregister", 4000, &a.mem_host_unregister);
  if (s.ok()) s = Resolve("cuMemHostGetDevicePointer", 3020, &a.mem_host_get_device_pointer);
  if (s.ok()) s = Resolve("cuMemGetAddressRange", 3020, &a.mem_get_address_range);
  if (s.ok()) s = Resolve("cuIpcGetMemHandle", 4010, &a.ipc_get_mem_handle);
  if (s.ok()) s = Resolve("cuPointerGetAttributes", 7000, &a.pointer_get_attributes);
  if (s.ok()) s = Resolve("cuMemCreate", 10020, &a.mem_create);
  if (s.ok()) s = Resolve("cuMemRelease", 10020, &a.mem_release);
  if (s.ok()) s = Resolve("cuMemAddressReserve", 10020, &a.mem_address_reserve);
  if (s.ok()) s = Resolve("cuMemAddressFree", 10020, &a.mem_address_free);
  if (s.ok()) s = Resolve("cuMemMap", 10020, &a.mem_map);
  if (s.ok()) s = Resolve("cuMemUnmap", 10020, &a.mem_unmap);
  if (s.ok()) s = Resolve("cuMemSetAccess", 10020, &a.mem_set_access);
  if (s.ok()) s = Resolve("cuMemGetAllocationGranularity", 10020, &a.mem_get_allocation_granularity);
  if (s.ok()) s = Resolve("cuMemExportToShareableHandle", 10020, &a.mem_export_to_shareable_handle);
  if (s.ok()) s = Resolve("cuMemImportFromShareableHandle", 10020, &a.mem_import_from_shareable_handle);
  if (s.ok()) s = Resolve("cuMemRetainAllocationHandle", 11000, &a.mem_retain_allocation_handle);
  if (s.ok()) {
    s = Resolve("cuMemGetAllocationPropertiesFromHandle", 10020, &a.mem_get_allocation_properties_from_handle);
  }
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

namespace {

// The one table of errors after which the CUDA context is unusable: every
// later call in the process fails the same way, so the daemon fails every
// session and exits for its supervisor to restart it. Driver and runtime
// spell the same numbers (checked below); 999 (unknown) is on the list
// because a context in an unknown state is not one to keep serving from.
struct StickyError {
  CUresult driver;
  cudaError_t runtime;
};
constexpr StickyError kStickyErrors[] = {
    {CUDA_ERROR_ECC_UNCORRECTABLE, cudaErrorECCUncorrectable},
    {CUDA_ERROR_NVLINK_UNCORRECTABLE, cudaErrorNvlinkUncorrectable},
    {CUDA_ERROR_CONTAINED, cudaErrorContained},
    {CUDA_ERROR_ILLEGAL_ADDRESS, cudaErrorIllegalAddress},
    {CUDA_ERROR_LAUNCH_TIMEOUT, cudaErrorLaunchTimeout},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, cudaErrorContextIsDestroyed},
    {CUDA_ERROR_ASSERT, cudaErrorAssert},
    {CUDA_ERROR_HARDWARE_STACK_ERROR, cudaErrorHardwareStackError},
    {CUDA_ERROR_ILLEGAL_INSTRUCTION, cudaErrorIllegalInstruction},
    {CUDA_ERROR_MISALIGNED_ADDRESS, cudaErrorMisalignedAddress},
    {CUDA_ERROR_INVALID_ADDRESS_SPACE, cudaErrorInvalidAddressSpace},
    {CUDA_ERROR_INVALID_PC, cudaErrorInvalidPc},
    {CUDA_ERROR_LAUNCH_FAILED, cudaErrorLaunchFailure},
    {CUDA_ERROR_TENSOR_MEMORY_LEAK, cudaErrorTensorMemoryLeak},
    {CUDA_ERROR_MPS_CLIENT_TERMINATED, cudaErrorMpsClientTerminated},
    {CUDA_ERROR_EXTERNAL_DEVICE, cudaErrorExternalDevice},
    {CUDA_ERROR_UNKNOWN, cudaErrorUnknown},
};

constexpr bool DriverAndRuntimeAgree() {
  for (const StickyError& e : kStickyErrors) {
    if (static_cast<int>(e.driver) != static_cast<int>(e.runtime)) return false;
  }
  return true;
}
static_assert(DriverAndRuntimeAgree(), "a sticky error has different driver and runtime numbers");

}  // namespace

bool IsStickyCudaError(int code) {
  for (const StickyError& e : kStickyErrors) {
    if (static_cast<int>(e.driver) == code) return true;
  }
  return false;
}

}  // namespace cache_dit_opd::cuda
