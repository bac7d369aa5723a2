#include "server/device/ipc_region_opener.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "common/cuda/driver_api.h"

namespace cache_dit_opd::cuda {

Status IpcRegionOpener::Open(std::string_view handle, void** base, uint64_t* size) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return Status::Rejected(Reason::kBadArgument, "ipc_handle is ", handle.size(), " bytes, expected ",
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
    return Status::Rejected(Reason::kInternal, "cudaSetDevice(", device_, "): ", RuntimeErrorString(err));
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::Rejected(
        Reason::kBadArgument, "cudaIpcOpenMemHandle: ", RuntimeErrorString(err),
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
    return Status::Rejected(Reason::kInternal, "cudaPointerGetAttributes: ", RuntimeErrorString(err));
  }
  if (attr.device != device_) {
    return Status::Rejected(Reason::kBadArgument, "ipc_handle names memory on CUDA device ", attr.device,
                            " of the daemon's process; this daemon serves device ", device_, " only");
  }
  CUdeviceptr range_base = 0;
  size_t range_size = 0;
  CUresult r = api->mem_get_address_range(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(p));
  if (r != CUDA_SUCCESS) {
    return Status::Rejected(Reason::kInternal, "cuMemGetAddressRange: ", DriverErrorString(r));
  }
  if (reinterpret_cast<void*>(range_base) != p) {
    // The handle maps a whole allocation at its base; anything else means
    // our offsets would be wrong.
    return Status::Rejected(Reason::kInternal, "cuMemGetAddressRange: mapping at ", p,
                            " starts inside an allocation at ", reinterpret_cast<void*>(range_base));
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

namespace {

// Unmaps the chunks of a run mapped at `base` (sizes in order) and frees its
// addresses.
void UnmapRun(const DriverApi* api, CUdeviceptr base, const std::vector<uint64_t>& chunks, uint64_t reserved) {
  uint64_t at = 0;
  for (const uint64_t n : chunks) {
    api->mem_unmap(base + at, n);
    at += n;
  }
  api->mem_address_free(base, reserved);
}

}  // namespace

Status IpcRegionOpener::OpenChunks(std::span<const int> fds, std::span<const uint64_t> chunk_bytes, void** base,
                                   uint64_t* size) {
  Status s;
  const DriverApi* api = GetDriverApi(&s);
  if (api == nullptr) return s;
  if (fds.empty() || fds.size() != chunk_bytes.size()) {
    return Status::Rejected(Reason::kInternal, "OpenChunks: ", fds.size(), " descriptors for ", chunk_bytes.size(),
                            " chunk sizes");
  }
  uint64_t total = 0;
  for (const uint64_t n : chunk_bytes) {
    if (n == 0 || __builtin_add_overflow(total, n, &total)) {
      return Status::Rejected(Reason::kBadArgument, "chunk sizes that are 0 or overflow 64 bits");
    }
  }
  if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
    cudaGetLastError();
    return Status::Rejected(Reason::kInternal, "cudaSetDevice(", device_, "): ", RuntimeErrorString(err));
  }
  // Every step is undone when a later one fails.
  struct Undo {
    const DriverApi* api;
    uint64_t total;
    CUdeviceptr p = 0;
    std::vector<uint64_t> mapped;
    bool kept = false;
    ~Undo() {
      if (!kept && p != 0) UnmapRun(api, p, mapped, total);
    }
  } undo{api, total, 0, {}, false};
  CUresult r = api->mem_address_reserve(&undo.p, total, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    return Status::Rejected(Reason::kResourceExhausted, "cuMemAddressReserve(", total, "): ", DriverErrorString(r));
  }
  uint64_t at = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    CUmemGenericAllocationHandle h = 0;
    r = api->mem_import_from_shareable_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fds[i])),
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
      return Status::Rejected(Reason::kBadArgument, "chunk ", i, ": cuMemImportFromShareableHandle: ",
                              DriverErrorString(r), " (not a descriptor of CUDA virtual memory)");
    }
    r = api->mem_map(undo.p + at, chunk_bytes[i], 0, h, 0);
    api->mem_release(h);  // the mapping keeps the memory
    if (r != CUDA_SUCCESS) {
      return Status::Rejected(Reason::kBadArgument, "chunk ", i, " of ", chunk_bytes[i], " bytes: cuMemMap: ",
                              DriverErrorString(r), " (a size the allocation does not have?)");
    }
    undo.mapped.push_back(chunk_bytes[i]);
    at += chunk_bytes[i];
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = api->mem_set_access(undo.p, total, &access, 1);
  if (r != CUDA_SUCCESS) {
    return Status::Rejected(Reason::kBadArgument, "cuMemSetAccess for device ", device_, ": ", DriverErrorString(r));
  }
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(undo.p)) != cudaSuccess || attr.device != device_) {
    cudaGetLastError();
    return Status::Rejected(Reason::kBadArgument, "the chunks hold memory of CUDA device ", attr.device,
                            " of the daemon's process; this daemon serves device ", device_, " only");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    runs_[reinterpret_cast<void*>(undo.p)] = undo.mapped;
  }
  undo.kept = true;
  *base = reinterpret_cast<void*>(undo.p);
  *size = total;
  return Status::Ok();
}

void IpcRegionOpener::CloseChunks(void* base) {
  std::vector<uint64_t> chunks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = runs_.find(base);
    if (it == runs_.end()) return;
    chunks = std::move(it->second);
    runs_.erase(it);
  }
  Status s;
  const DriverApi* api = GetDriverApi(&s);
  if (api == nullptr) return;
  uint64_t total = 0;
  for (const uint64_t n : chunks) total += n;
  cudaSetDevice(device_);
  UnmapRun(api, reinterpret_cast<CUdeviceptr>(base), chunks, total);
}

size_t IpcRegionOpener::open_mappings() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_handle_.size();
}

}  // namespace cache_dit_opd::cuda
