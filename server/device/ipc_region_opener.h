// File: server/device/ipc_region_opener.h
//
// RegionOpener (server/device/region_opener.h) with legacy CUDA IPC:
// cudaIpcOpenMemHandle on the daemon's device (cudaIpcMemLazyEnablePeerAccess),
// a check that the memory really lives on that device (a handle opens only on
// the daemon's own GPU, docs/DESIGN.md section 5), and the allocation size read
// back with cuMemGetAddressRange.
//
// CUDA lets one process open a given handle only once, so mappings are
// shared process-wide: one instance serves every session and counts opens per
// handle; the handle is closed (cudaIpcCloseMemHandle) with its last Close.
//
// Chunks (OpenChunks): cuMemImportFromShareableHandle each descriptor,
// cuMemAddressReserve the run, cuMemMap each chunk at its offset, then
// cuMemSetAccess read-write for the daemon's device; the mapped memory must
// live on that device. Each run is a mapping of its own (two sessions, or
// two runs over one chunk, map it twice).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "server/device/region_opener.h"

namespace cache_dit_opd::cuda {

class IpcRegionOpener final : public RegionOpener {
 public:
  explicit IpcRegionOpener(int device) : device_(device) {}
  ~IpcRegionOpener() override = default;

  Status Open(std::string_view handle, void** base, uint64_t* size) override;
  void Close(void* base) override;
  Status OpenChunks(std::span<const int> fds, std::span<const uint64_t> chunk_bytes, void** base,
                    uint64_t* size) override;
  void CloseChunks(void* base) override;

  // Distinct mappings currently open (tests, stats).
  size_t open_mappings() const;

 private:
  struct Mapping {
    void* base = nullptr;
    uint64_t size = 0;
    int refs = 0;
  };
  const int device_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Mapping> by_handle_;  // guarded by mu_
  std::map<void*, std::string> handle_of_;              // guarded by mu_
  std::map<void*, std::vector<uint64_t>> runs_;         // OpenChunks: chunk sizes by base; guarded by mu_
};

}  // namespace cache_dit_opd::cuda
