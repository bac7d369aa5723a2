#include "server/device/ipc_region_opener.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "common/cuda/driver_api.h"

namespace cache_dit_opd::cuda {

Status IpcRegionOpener::Open(std::string_view handle, void** base, uint64_t* size) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return Status::InvalidArgument("ipc_handle is ", handle.size(), " bytes, expected ",
                                   sizeof(cudaIpcMemHandle_t));
  }
  Status s;
  const DriverApi* api = GetDriverApi(&s);
  if (api == nullptr) return s;

  // Held across the open: two sessions registering the same allocation at
  // once must not both call cudaIpcOpenMemHandle (the second would fail).
  std::lock_guard<std::mutex> lock(mu_);
  std::string key(handle);
  if (auto it = by_handle_.find(key); it != by_handle_.end()) {
    ++it->second.refs;
    *base = it->second.base;
    *size = it->second.size;
    return Status::Ok();
  }

  cudaError_t err = cudaSetDevice(device_);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::Internal("cudaSetDevice(", device_, "): ", RuntimeErrorString(err));
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::InvalidArgument(
        "cudaIpcOpenMemHandle: ", RuntimeErrorString(err),
        " (the handle must come from cuIpcGetMemHandle on a cudaMalloc'd allocation of a live "
        "process; VMM memory such as expandable_segments cannot be shared this way)");
  }
  bool keep = false;
  struct CloseUnlessKept {
    void* p;
    bool* keep;
    ~CloseUnlessKept() {
      if (!*keep) {
        cudaIpcCloseMemHandle(p);
        cudaGetLastError();
      }
    }
  } guard{p, &keep};

  cudaPointerAttributes attr{};
  err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::Internal("cudaPointerGetAttributes: ", RuntimeErrorString(err));
  }
  if (attr.device != device_) {
    return Status::InvalidArgument("ipc_handle names memory on CUDA device ", attr.device,
                                   " of the daemon's process; this daemon serves device ", device_,
                                   " only");
  }
  CUdeviceptr range_base = 0;
  size_t range_size = 0;
  CUresult r = api->mem_get_address_range(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(p));
  if (r != CUDA_SUCCESS) {
    return Status::Internal("cuMemGetAddressRange: ", DriverErrorString(r));
  }
  if (reinterpret_cast<void*>(range_base) != p) {
    // The handle maps a whole allocation at its base; anything else means
    // our offsets would be wrong.
    return Status::Internal("cuMemGetAddressRange: mapping at ", p, " starts inside an allocation at ",
                            reinterpret_cast<void*>(range_base));
  }
  keep = true;
  by_handle_[key] = Mapping{p, range_size, 1};
  handle_of_[p] = key;
  *base = p;
  *size = range_size;
  return Status::Ok();
}

void IpcRegionOpener::Close(void* base) {
  std::lock_guard<std::mutex> lock(mu_);
  auto hit = handle_of_.find(base);
  if (hit == handle_of_.end()) return;
  auto it = by_handle_.find(hit->second);
  if (it != by_handle_.end() && --it->second.refs > 0) return;
  if (it != by_handle_.end()) by_handle_.erase(it);
  handle_of_.erase(hit);
  cudaSetDevice(device_);
  cudaIpcCloseMemHandle(base);
  cudaGetLastError();
}

size_t IpcRegionOpener::open_mappings() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_handle_.size();
}

}  // namespace cache_dit_opd::cuda
