// File: server/device/store_memory.h
//
// The weight store's memory (server/store/weight_store.h decides what lives
// in it and for how long): blocks of device memory the daemon owns, written
// once by the publisher. CudaStoreAllocator (cuda_store_allocator.h) on the
// GPU; host blocks in tests and the fake-device daemon.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "common/status.h"

namespace cache_dit_opd {

// Memory of one stored tensor; freed by its destructor (which may wait for
// the device: never destroy one on the dispatch path).
class StoreBlock {
 public:
  virtual ~StoreBlock() = default;
  virtual uint64_t address() const = 0;  // device address (host address in tests)
  virtual uint64_t bytes() const = 0;
  // Copies `src` to [offset, offset + src.size()) of the block,
  // synchronously; INTERNAL when that range is not inside the block.
  virtual Status Write(uint64_t offset, std::span<const std::byte> src) = 0;
};

class StoreAllocator {
 public:
  virtual ~StoreAllocator() = default;
  // A block of at least `bytes` (>= 1); RESOURCE_EXHAUSTED naming the bytes
  // when the device has no memory left.
  virtual Status Allocate(uint64_t bytes, std::unique_ptr<StoreBlock>* out) = 0;
};

}  // namespace cache_dit_opd
