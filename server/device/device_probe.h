// File: server/device/device_probe.h
//
// What the daemon learns about its GPU at start-up (DeviceInfo, in
// device_ops.h). Never fails hard: with no driver, no device or a bad
// ordinal, `ok` is false and `reason` says why (the daemon then serves
// GetVersion and reports NOT_SERVING with it). Plain C++ header; the
// implementation uses the CUDA runtime only.
#pragma once

#include "server/device/device_ops.h"

namespace cache_dit_opd::cuda {

// ProbeDevice
//
// Probes ordinal `device`: counts devices, reads name and UUID, creates the
// primary context (cudaSetDevice + cudaFree(0)) and resolves the driver
// entry points the daemon needs.
DeviceInfo ProbeDevice(int device);

}  // namespace cache_dit_opd::cuda
