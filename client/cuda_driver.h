// File: client/cuda_driver.h
//
// The CUDA driver entry points the client needs, resolved at run time through
// cudaGetDriverEntryPointByVersion: opd_client never links libcuda, so a
// program that uses it still loads on a machine without a GPU driver (and
// fails with UNAVAILABLE when it tries to connect).
//
// Pinned versions: the stream memory operations are requested at 12000,
// which resolves to cuStreamWriteValue64_v2 / cuStreamWaitValue64_v2 (the
// unversioned v1 symbols return CUDA_ERROR_NOT_SUPPORTED on current drivers).
//
// Internal to opd_client: includes CUDA headers, never torch.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

#include "server/status.h"

namespace cache_dit_opd::client {

struct DriverApi {
  PFN_cuStreamWriteValue64_v11070 stream_write_value64 = nullptr;
  PFN_cuStreamWaitValue64_v11070 stream_wait_value64 = nullptr;
  PFN_cuMemHostRegister_v6050 mem_host_register = nullptr;
  PFN_cuMemHostUnregister_v4000 mem_host_unregister = nullptr;
  PFN_cuMemHostGetDevicePointer_v3020 mem_host_get_device_pointer = nullptr;
  PFN_cuMemGetAddressRange_v3020 mem_get_address_range = nullptr;
  PFN_cuIpcGetMemHandle_v4010 ipc_get_mem_handle = nullptr;
  PFN_cuPointerGetAttributes_v7000 pointer_get_attributes = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
};

// GetDriverApi
//
// Resolves every entry point once per process (thread-safe). Returns nullptr
// and sets `*status` (UNAVAILABLE, naming the symbol and the runtime error)
// when the driver or a symbol is missing.
const DriverApi* GetDriverApi(Status* status);

// "CUDA_ERROR_INVALID_VALUE (invalid argument)"; falls back to the number
// when no driver is present.
std::string DriverErrorString(CUresult result);

// "cudaErrorInvalidValue (invalid argument)".
std::string RuntimeErrorString(int cuda_error);

// DeviceGuard
//
// Makes `device` current on this thread for the guard's lifetime and binds
// its primary context (driver calls need a current context), then restores
// the caller's device. Cheap when the device is already current.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  // Non-OK when the device could not be made current.
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  bool restore_ = false;
  Status status_;
};

}  // namespace cache_dit_opd::client
