// File: server/device/cuda_device_ops.h
//
// DeviceOps (server/device/device_ops.h) on a real GPU: host-memory registration
// with cuMemHostRegister (DEVICEMAP | PORTABLE), non-blocking streams, and
// semaphore writes and waits with cuStream{Write,Wait}Value64_v2. CreateStream
// returns a stream that has run work (a 4-byte memset, waited for), and its
// first successful call also makes and holds one such stream of its own until
// destruction (why, measured: CreateStream in the .cc). Every method first
// makes the daemon's device current on the calling thread, so any daemon
// thread may use it.
#pragma once

#include <memory>
#include <mutex>

#include "server/device/device_ops.h"

namespace cache_dit_opd::cuda {

class CudaDeviceOps final : public DeviceOps {
 public:
  // CudaDeviceOps::Create
  //
  // UNAVAILABLE when the driver entry points cannot be resolved.
  static Status Create(int device, std::unique_ptr<CudaDeviceOps>* out);
  ~CudaDeviceOps() override;

  Status EnterThread() override;
  Status RegisterHostMemory(void* p, size_t bytes, uint64_t* device_address) override;
  void UnregisterHostMemory(void* p) override;
  Status CreateStream(void** stream) override;
  void DestroyStream(void* stream) override;
  Status WaitValue64(void* stream, uint64_t device_address, uint64_t value, bool* sticky) override;
  Status WriteValue64(void* stream, std::span<const uint64_t> device_addresses, uint64_t value,
                      bool* sticky) override;

 private:
  explicit CudaDeviceOps(int device) : device_(device) {}
  int device_;
  // Made by the first CreateStream that succeeds, held until destruction (see
  // CreateStream); guarded by anchor_mu_ until then.
  std::mutex anchor_mu_;
  void* anchor_ = nullptr;
  void* scratch_ = nullptr;
};

}  // namespace cache_dit_opd::cuda
