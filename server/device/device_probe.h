// File: server/device/device_probe.h
//
// What the daemon learns about its GPU at start-up. Never fails hard: with
// no driver, no device or a bad ordinal, `ok` is false and `reason` says why
// (the daemon then serves GetVersion and reports NOT_SERVING with it).
// Plain C++ header; the implementation uses the CUDA runtime only.
#pragma once

#include <string>

namespace cache_dit_opd::cuda {

struct DeviceInfo {
  bool ok = false;          // the device is usable: context created, driver entry points resolved
  std::string reason;       // why not, e.g. "no GPU: cudaGetDeviceCount: cudaErrorNoDevice (...)"
  int index = -1;           // CUDA ordinal in this process (--device)
  std::string uuid;         // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it
  std::string name;         // e.g. "NVIDIA H200"
  int runtime_version = 0;  // cudaRuntimeGetVersion()
  int driver_version = 0;   // cudaDriverGetVersion(); 0 without a driver
};

// ProbeDevice
//
// Probes ordinal `device`: counts devices, reads name and UUID, creates the
// primary context (cudaSetDevice + cudaFree(0)) and resolves the driver
// entry points the daemon needs.
DeviceInfo ProbeDevice(int device);

// FormatGpuUuid
//
// 16 UUID bytes -> "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (lower-case hex,
// groups of 4-2-2-2-6 bytes).
std::string FormatGpuUuid(const unsigned char bytes[16]);

}  // namespace cache_dit_opd::cuda
