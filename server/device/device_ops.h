// File: server/device/device_ops.h
//
// The CUDA work that sessions, lanes and the executor need, behind a small
// interface: the real implementation (server/device/cuda_device_ops.h, target
// opd_cuda) goes through the CUDA runtime and driver entry points; CPU tests
// use a fake that writes host memory directly. Plain C++: no CUDA headers.
//
// Addresses are "device addresses" (CUdeviceptr values) of host memory that
// RegisterHostMemory mapped for the device. Streams are opaque
// (cudaStream_t in the real implementation).
//
//   uint64_t dev = 0;
//   OPD_RETURN_IF_ERROR(ops->RegisterHostMemory(page, 4096, &dev));
//   void* stream = nullptr;
//   OPD_RETURN_IF_ERROR(ops->CreateStream(&stream));
//   uint64_t addrs[] = {dev};
//   OPD_RETURN_IF_ERROR(ops->WriteValue64(stream, addrs, 7));  // page[0] = 7 once the stream gets there
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"

namespace cache_dit_opd {

// What the daemon learns about its GPU at start-up.
struct DeviceInfo {
  bool ok = false;          // the device is usable: context created, driver entry points resolved
  std::string reason;       // why not, e.g. "no GPU: cudaGetDeviceCount: cudaErrorNoDevice (...)"
  int index = -1;           // CUDA ordinal in this process (--device)
  std::string uuid;         // common/gpu_uuid.h's form: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
  std::string name;         // e.g. "NVIDIA H200"
  int runtime_version = 0;  // cudaRuntimeGetVersion()
  int driver_version = 0;   // cudaDriverGetVersion(); 0 without a driver
  int connections = 0;      // hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS); 0 unknown
};

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;

  // DeviceOps::EnterThread
  //
  // Makes the daemon's device current on the calling thread (the CUDA
  // runtime's cudaSetDevice): a thread that enqueues stream operations or
  // launches calls it once, before its first. INTERNAL on failure.
  virtual Status EnterThread() { return Status::Ok(); }

  // DeviceOps::RegisterHostMemory
  //
  // Page-locks [p, p + bytes) and maps it for the daemon's device
  // (cuMemHostRegister with DEVICEMAP | PORTABLE); returns the device address
  // of `p`. `p` and `bytes` must be page aligned. INTERNAL with the driver's
  // error name on failure.
  virtual Status RegisterHostMemory(void* p, size_t bytes, uint64_t* device_address) = 0;
  // Undoes RegisterHostMemory. Only called once no stream can still write
  // the memory.
  virtual void UnregisterHostMemory(void* p) = 0;

  // DeviceOps::CreateStream
  //
  // A new non-blocking stream (cudaStreamNonBlocking) on the daemon's device.
  virtual Status CreateStream(void** stream) = 0;
  // Releases a stream; returns at once (pending work still completes).
  virtual void DestroyStream(void* stream) = 0;

  // DeviceOps::WriteValue64
  //
  // Enqueues on `stream`, after the stream's earlier work, a 64-bit write of
  // `value` to each address, in order (one cuStreamBatchMemOp_v2). Never waits
  // for the GPU. INTERNAL on failure; `*sticky` (when non-null) is set when
  // the error leaves the CUDA context unusable.
  virtual Status WriteValue64(void* stream, std::span<const uint64_t> device_addresses,
                              uint64_t value, bool* sticky) = 0;

  // DeviceOps::WaitValue64
  //
  // Enqueues on `stream` a wait until the 64-bit value at `device_address`
  // is >= `value` (cuStreamWaitValue64_v2, GEQ): the stream's later work
  // starts only after it. Never waits on the host. The executor bounds how
  // many lanes may have such a wait parked (server/exec/executor.h). INTERNAL
  // on failure; `*sticky` as for WriteValue64.
  virtual Status WaitValue64(void* stream, uint64_t device_address, uint64_t value, bool* sticky) = 0;
};

}  // namespace cache_dit_opd
