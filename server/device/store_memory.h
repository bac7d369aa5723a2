// File: server/device/store_memory.h
//
// The weight store's memory (server/store/weight_store.h decides what lives
// in it and for how long): one block of device memory the daemon owns per
// published set, written once by the publisher, then shared read-only with
// the clients that attach its entries. CudaStoreAllocator
// (cuda_store_allocator.h) on the GPU; memfd-backed host blocks in tests and
// the fake-device daemon (tests/fake_daemon/fakes.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "common/status.h"

namespace cache_dit_opd {

// Memory of one published set; freed by its destructor (which may wait for
// the device: never destroy one on the dispatch path).
class StoreBlock {
 public:
  virtual ~StoreBlock() = default;
  virtual uint64_t address() const = 0;  // device address (host address in tests)
  // The allocation's size: what was asked, rounded up to the allocator's
  // granularity. Every byte of it may be mapped by a client: a new block
  // reads as zeros.
  virtual uint64_t bytes() const = 0;
  // Copies `src` from host memory to [offset, offset + src.size()) of the
  // block, synchronously; INTERNAL when that range is not inside the block.
  virtual Status Write(uint64_t offset, std::span<const std::byte> src) = 0;
  // Copies `n` bytes of device memory at `src` (a client region the daemon
  // has mapped, pinned by the caller) to [offset, offset + n), synchronously.
  virtual Status CopyFromDevice(uint64_t offset, const void* src, uint64_t n) = 0;
  // A new descriptor of the whole block that another process can map (a
  // POSIX file descriptor: SCM_RIGHTS carries it); the caller closes it.
  virtual Status ExportFd(int* fd) = 0;
};

class StoreAllocator {
 public:
  virtual ~StoreAllocator() = default;
  // A block of AllocationBytes(bytes) (`bytes` >= 1); RESOURCE_EXHAUSTED
  // naming the bytes when the device has no memory left.
  virtual Status Allocate(uint64_t bytes, std::unique_ptr<StoreBlock>* out) = 0;
  // What a block of `bytes` takes (the size the store counts against
  // --max-store-bytes): `bytes` rounded up to the allocation granularity.
  virtual uint64_t AllocationBytes(uint64_t bytes) const { return bytes; }
};

}  // namespace cache_dit_opd
