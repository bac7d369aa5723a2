#include "server/device/cuda_store_allocator.h"

#include <cuda_runtime_api.h>

namespace cache_dit_opd::cuda {
namespace {

class CudaStoreBlock final : public StoreBlock {
 public:
  CudaStoreBlock(int device, void* p, uint64_t bytes) : device_(device), p_(p), bytes_(bytes) {}
  ~CudaStoreBlock() override {
    // The store's worker or a gRPC thread drops the last reference: the
    // current device of that thread is not necessarily ours.
    cudaSetDevice(device_);
    cudaFree(p_);
  }
  uint64_t address() const override { return reinterpret_cast<uint64_t>(p_); }
  uint64_t bytes() const override { return bytes_; }
  Status Write(uint64_t offset, std::span<const std::byte> src) override {
    if (offset > bytes_ || src.size() > bytes_ - offset) {
      return Status::Internal("store block write of ", src.size(), " bytes at ", offset, " past its ", bytes_);
    }
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) err = cudaMemcpy(static_cast<char*>(p_) + offset, src.data(), src.size(), cudaMemcpyHostToDevice);
    if (err != cudaSuccess) return Status::Internal("cudaMemcpy into the store: ", cudaGetErrorString(err));
    return Status::Ok();
  }

 private:
  const int device_;
  void* const p_;
  const uint64_t bytes_;
};

}  // namespace

Status CudaStoreAllocator::Allocate(uint64_t bytes, std::unique_ptr<StoreBlock>* out) {
  cudaError_t err = cudaSetDevice(device_);
  void* p = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it
    return Status::Rejected(Reason::kResourceExhausted, "the GPU has no ", bytes, " bytes free for the store");
  }
  if (err != cudaSuccess) return Status::Internal("cudaMalloc(", bytes, ") for the store: ", cudaGetErrorString(err));
  *out = std::make_unique<CudaStoreBlock>(device_, p, bytes);
  return Status::Ok();
}

}  // namespace cache_dit_opd::cuda
