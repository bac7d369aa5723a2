// File: server/device/device_probe.h
//
// What the daemon learns about its GPU at start-up (DeviceInfo, in
// device_ops.h). Never fails hard: with no driver, no device or a bad
// ordinal, `ok` is false and `reason` says why (the daemon then serves
// GetVersion and reports NOT_SERVING with it). Plain C++ header; the
// implementation uses the CUDA runtime only.
#pragma once

#include <string>
#include <vector>

#include "server/device/device_ops.h"

namespace cache_dit_opd::cuda {

// CUDA's upper bound on CUDA_DEVICE_MAX_CONNECTIONS (hardware work queues).
inline constexpr int kMaxConnections = 32;

// ConfigureCudaEnvironment
//
// Must run before the process's first CUDA call (ProbeDevice calls it
// first). Sets CUDA_MODULE_LOADING=EAGER, overriding any other value: with
// lazy loading a kernel's first launch can wait behind a GPU wait the
// executor parked (server/exec/executor.h), and hang. Sets
// CUDA_DEVICE_MAX_CONNECTIONS=32 unless the environment sets it. Appends a
// line to `notes` for each value it overrode.
void ConfigureCudaEnvironment(std::vector<std::string>* notes);

// The hardware work queues this process gets: CUDA_DEVICE_MAX_CONNECTIONS as
// CUDA reads it (default 8, clamped to [1, 32]).
int DeviceConnections();

// ProbeDevice
//
// Probes ordinal `device`: counts devices, reads name and UUID, creates the
// primary context (cudaSetDevice + cudaFree(0)) and resolves the driver
// entry points the daemon needs. Call ConfigureCudaEnvironment first.
DeviceInfo ProbeDevice(int device);

}  // namespace cache_dit_opd::cuda
