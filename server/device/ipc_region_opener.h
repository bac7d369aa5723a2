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
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "server/device/region_opener.h"

namespace cache_dit_opd::cuda {

class IpcRegionOpener final : public RegionOpener {
 public:
  explicit IpcRegionOpener(int device) : device_(device) {}
  ~IpcRegionOpener() override = default;

  Status Open(std::string_view handle, void** base, uint64_t* size) override;
  void Close(void* base) override;

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
};

}  // namespace cache_dit_opd::cuda
