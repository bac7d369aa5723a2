#include "server/device/cuda_store_allocator.h"

#include <cuda_runtime_api.h>

#include "common/cuda/driver_api.h"

namespace cache_dit_opd::cuda {
namespace {

CUmemAllocationProp Prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

Status Driver(const char* what, CUresult r) {
  if (r == CUDA_SUCCESS) return Status::Ok();
  return Status::Internal(what, ": ", DriverErrorString(r));
}

class CudaStoreBlock final : public StoreBlock {
 public:
  CudaStoreBlock(const DriverApi* api, int device, CUmemGenericAllocationHandle handle, CUdeviceptr p, uint64_t bytes)
      : api_(api), device_(device), handle_(handle), p_(p), bytes_(bytes) {}
  ~CudaStoreBlock() override {
    // The last reference may go on any thread (the reaper, the store's
    // worker, a gRPC thread): make the daemon's device current first. The
    // unmap waits for work still reading the range.
    cudaSetDevice(device_);
    api_->mem_unmap(p_, bytes_);
    api_->mem_address_free(p_, bytes_);
    api_->mem_release(handle_);
  }
  uint64_t address() const override { return static_cast<uint64_t>(p_); }
  uint64_t bytes() const override { return bytes_; }
  Status Write(uint64_t offset, std::span<const std::byte> src) override {
    OPD_RETURN_IF_ERROR(Inside("write", offset, src.size()));
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) {
      err = cudaMemcpy(reinterpret_cast<char*>(p_) + offset, src.data(), src.size(), cudaMemcpyHostToDevice);
    }
    if (err == cudaSuccess) err = Finished();
    if (err != cudaSuccess) return Status::Internal("cudaMemcpy into the store: ", cudaGetErrorString(err));
    return Status::Ok();
  }
  Status CopyFromDevice(uint64_t offset, const void* src, uint64_t n) override {
    OPD_RETURN_IF_ERROR(Inside("copy", offset, n));
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) err = cudaMemcpy(reinterpret_cast<char*>(p_) + offset, src, n, cudaMemcpyDeviceToDevice);
    if (err == cudaSuccess) err = Finished();
    if (err != cudaSuccess) return Status::Internal("cudaMemcpy from a client region into the store: ", cudaGetErrorString(err));
    return Status::Ok();
  }
  Status ExportFd(int* fd) override {
    int out = -1;
    OPD_RETURN_IF_ERROR(Driver("cuMemExportToShareableHandle",
                               api_->mem_export_to_shareable_handle(&out, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)));
    *fd = out;
    return Status::Ok();
  }

 private:
  // cudaMemcpy does not wait for a device-to-device copy, and from pageable
  // host memory returns once the bytes are staged, not landed: waiting on
  // the legacy stream it ran on (never the device: the lane streams are
  // non-blocking and not waited for) makes the copy done when Write or
  // CopyFromDevice returns, as StoreBlock promises. Else a set could become
  // visible before its bytes, and the client free a source still being read.
  static cudaError_t Finished() { return cudaStreamSynchronize(cudaStreamLegacy); }

  Status Inside(const char* what, uint64_t offset, uint64_t n) const {
    if (offset > bytes_ || n > bytes_ - offset) {
      return Status::Internal("store block ", what, " of ", n, " bytes at ", offset, " past its ", bytes_);
    }
    return Status::Ok();
  }

  const DriverApi* const api_;
  const int device_;
  const CUmemGenericAllocationHandle handle_;
  const CUdeviceptr p_;
  const uint64_t bytes_;
};

}  // namespace

uint64_t CudaStoreAllocator::Granularity() const {
  uint64_t g = granularity_.load(std::memory_order_relaxed);
  if (g != 0) return g;
  g = 2u << 20;  // what Hopper reports; used when the driver cannot be asked
  if (const DriverApi* api = GetDriverApi(nullptr)) {
    size_t asked = 0;
    CUmemAllocationProp prop = Prop(device_);
    if (api->mem_get_allocation_granularity(&asked, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS &&
        asked > 0) {
      g = asked;
    }
  }
  granularity_.store(g, std::memory_order_relaxed);
  return g;
}

uint64_t CudaStoreAllocator::AllocationBytes(uint64_t bytes) const {
  const uint64_t g = Granularity();
  return bytes == 0 ? 0 : (bytes + g - 1) / g * g;
}

Status CudaStoreAllocator::Allocate(uint64_t bytes, std::unique_ptr<StoreBlock>* out) {
  Status st;
  const DriverApi* api = GetDriverApi(&st);
  if (api == nullptr) return st;
  const uint64_t size = AllocationBytes(bytes);
  if (size < bytes) return Status::Rejected(Reason::kResourceExhausted, bytes, " bytes cannot be allocated");
  if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
    return Status::Internal("cudaSetDevice(", device_, ") for the store: ", cudaGetErrorString(err));
  }
  // Each step is undone when a later one fails.
  CUmemAllocationProp prop = Prop(device_);
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = api->mem_create(&handle, size, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    return Status::Rejected(Reason::kResourceExhausted, "the GPU has no ", size, " bytes free for the store");
  }
  OPD_RETURN_IF_ERROR(Driver("cuMemCreate for the store", r));
  struct Undo {
    const DriverApi* api;
    CUmemGenericAllocationHandle handle;
    CUdeviceptr p = 0;
    uint64_t size;
    bool mapped = false, kept = false;
    ~Undo() {
      if (kept) return;
      if (mapped) api->mem_unmap(p, size);
      if (p != 0) api->mem_address_free(p, size);
      api->mem_release(handle);
    }
  } undo{api, handle, 0, size};
  OPD_RETURN_IF_ERROR(Driver("cuMemAddressReserve for the store", api->mem_address_reserve(&undo.p, size, 0, 0, 0)));
  OPD_RETURN_IF_ERROR(Driver("cuMemMap for the store", api->mem_map(undo.p, size, 0, handle, 0)));
  undo.mapped = true;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  OPD_RETURN_IF_ERROR(Driver("cuMemSetAccess for the store", api->mem_set_access(undo.p, size, &access, 1)));
  // Zeroed: a set's fill writes its entries only, and an attacher maps the
  // whole block (alignment gaps and the rounded-up tail too), so whatever
  // the driver's memory held before (another owner's set) must not show.
  cudaError_t err = cudaMemset(reinterpret_cast<void*>(undo.p), 0, size);
  if (err == cudaSuccess) err = cudaStreamSynchronize(cudaStreamLegacy);
  if (err != cudaSuccess) return Status::Internal("cudaMemset of a store block: ", cudaGetErrorString(err));
  *out = std::make_unique<CudaStoreBlock>(api, device_, handle, undo.p, size);
  undo.kept = true;
  return Status::Ok();
}

}  // namespace cache_dit_opd::cuda
