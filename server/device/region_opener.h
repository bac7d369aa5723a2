// File: server/device/region_opener.h
//
// Opening and closing a client's memory: a legacy CUDA IPC memory handle, or
// a run of CUDA virtual-memory chunks passed as POSIX descriptors (PyTorch's
// expandable segments). The only part of the region registry
// (server/session/region_registry.h) that touches CUDA, behind an interface
// so that the registry's bookkeeping (limits, LRU, deferred release) is
// tested on machines without a GPU.
//
// The real implementation (server/device/ipc_region_opener.h) opens with
// cudaIpcOpenMemHandle on the daemon's own device and reads the allocation
// size back with cuMemGetAddressRange. CUDA allows a handle to be open only
// once per process, so it keeps a process-wide reference count per handle:
// two sessions that register the same allocation share one mapping.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "common/status.h"

namespace cache_dit_opd {

inline constexpr size_t kIpcHandleBytes = 64;

class RegionOpener {
 public:
  virtual ~RegionOpener() = default;

  // RegionOpener::Open
  //
  // Maps the allocation named by `handle` (exactly kIpcHandleBytes bytes;
  // callers check) and returns its base in the daemon's address space and
  // its size as the driver reports it. INVALID_ARGUMENT when the driver
  // refuses the handle (message names the CUDA error); a handle of VMM memory
  // or of another device fails here.
  virtual Status Open(std::string_view handle, void** base, uint64_t* size) = 0;

  // RegionOpener::Close
  //
  // Releases one Open of the mapping at `base`. May synchronize the device,
  // so the daemon calls it only off the dispatch path (the reaper thread).
  virtual void Close(void* base) = 0;

  // RegionOpener::OpenChunks
  //
  // Maps the chunks another process exported as POSIX descriptors (`fds`,
  // which the caller keeps and closes) contiguously, in order, read-write on
  // the daemon's device: chunk i's `chunk_bytes[i]` bytes at the sum of the
  // sizes before it. `*size` is that sum. INVALID_ARGUMENT naming the chunk
  // when the driver refuses one (not a descriptor of CUDA memory, a size it
  // does not have, memory of another device); what was mapped is undone.
  virtual Status OpenChunks(std::span<const int> fds, std::span<const uint64_t> chunk_bytes, void** base,
                            uint64_t* size) = 0;
  // Undoes one OpenChunks (may synchronize the device: the reaper's).
  virtual void CloseChunks(void* base) = 0;
};

}  // namespace cache_dit_opd
