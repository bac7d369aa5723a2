// File: common/cuda/device_guard.h
//
// The client's view of the CUDA driver: the entry points of
// common/cuda/driver_api.h (resolved at run time, never a libcuda link, so a
// program using opd_client loads on a machine without a GPU driver and fails
// with UNAVAILABLE when it connects), and DeviceGuard.
//
// Internal to opd_client: includes CUDA headers, never torch.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

#include "common/cuda/driver_api.h"
#include "common/status.h"

namespace cache_dit_opd::client {

// The driver entry points (one loader for the daemon and the client).
using cuda::DriverApi;
using cuda::DriverErrorString;
using cuda::GetDriverApi;
using cuda::RuntimeErrorString;

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
