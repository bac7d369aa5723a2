// File: common/cuda/device_guard.h
//
// DeviceGuard: makes a CUDA device current on this thread for a scope and
// binds its primary context (driver calls need a current context). Used by
// the C++ client and the native engine around every driver call, whatever
// device the caller has current. Includes CUDA headers, never torch.
#pragma once

#include "common/status.h"

namespace cache_dit_opd::cuda {

// DeviceGuard
//
// Makes `device` current for the guard's lifetime, then restores the
// caller's device. Cheap when the device is already current and bound.
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

}  // namespace cache_dit_opd::cuda
