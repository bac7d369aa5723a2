// File: server/device/cuda_store_allocator.h
//
// The weight store's memory on the daemon's GPU: one virtual-memory
// allocation per block (cuMemCreate on the daemon's device, shareable as a
// POSIX file descriptor), mapped read-write into the daemon and exported with
// cuMemExportToShareableHandle for clients, which map it read-only
// (docs/DESIGN.md section 5). Sizes are rounded up to the device's
// recommended granularity (2 MiB on the H200), which is why the store keeps
// one block per published set rather than one per tensor.
#pragma once

#include <atomic>

#include "server/device/store_memory.h"

namespace cache_dit_opd::cuda {

class CudaStoreAllocator final : public StoreAllocator {
 public:
  explicit CudaStoreAllocator(int device) : device_(device) {}
  Status Allocate(uint64_t bytes, std::unique_ptr<StoreBlock>* out) override;
  uint64_t AllocationBytes(uint64_t bytes) const override;

 private:
  uint64_t Granularity() const;

  const int device_;
  mutable std::atomic<uint64_t> granularity_{0};  // 0: not asked yet
};

}  // namespace cache_dit_opd::cuda
