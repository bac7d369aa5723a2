// File: server/device/cuda_store_allocator.h
//
// The weight store's memory on the daemon's GPU: one cudaMalloc per stored
// tensor, written with cudaMemcpy from the publisher's host chunks. (Sharing
// a block read-only with clients will need virtual-memory allocations,
// cuMemCreate with a POSIX file descriptor handle; issue 20.)
#pragma once

#include "server/device/store_memory.h"

namespace cache_dit_opd::cuda {

class CudaStoreAllocator final : public StoreAllocator {
 public:
  explicit CudaStoreAllocator(int device) : device_(device) {}
  Status Allocate(uint64_t bytes, std::unique_ptr<StoreBlock>* out) override;

 private:
  const int device_;
};

}  // namespace cache_dit_opd::cuda
