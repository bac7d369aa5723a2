#include "server/device/cuda_device_ops.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>

#include "common/cuda/driver_api.h"

namespace cache_dit_opd::cuda {

Status CudaDeviceOps::Create(int device, std::unique_ptr<CudaDeviceOps>* out) {
  Status s;
  if (GetDriverApi(&s) == nullptr) return s;
  out->reset(new CudaDeviceOps(device));
  return Status::Ok();
}

Status CudaDeviceOps::EnterThread() {
  // The stream operations below go to the driver without a context of their
  // own; a thread that never ran a runtime call on the device has none.
  if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
    cudaGetLastError();
    return Status::Internal("cudaSetDevice(", device_, "): ", RuntimeErrorString(err));
  }
  return Status::Ok();
}

Status CudaDeviceOps::RegisterHostMemory(void* p, size_t bytes, uint64_t* device_address) {
  Status s;
  const DriverApi* api = GetDriverApi(&s);
  if (api == nullptr) return s;
  if (Status entered = EnterThread(); !entered.ok()) return entered;
  CUresult r = api->mem_host_register(p, bytes, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("cuMemHostRegister(", bytes, " bytes): ", DriverErrorString(r));
  }
  CUdeviceptr dptr = 0;
  r = api->mem_host_get_device_pointer(&dptr, p, 0);
  if (r != CUDA_SUCCESS) {
    api->mem_host_unregister(p);
    return Status::Internal("cuMemHostGetDevicePointer: ", DriverErrorString(r));
  }
  *device_address = static_cast<uint64_t>(dptr);
  return Status::Ok();
}

void CudaDeviceOps::UnregisterHostMemory(void* p) {
  const DriverApi* api = GetDriverApi(nullptr);
  if (api == nullptr || p == nullptr) return;
  cudaSetDevice(device_);
  api->mem_host_unregister(p);
}

CudaDeviceOps::~CudaDeviceOps() {
  if (anchor_ == nullptr && scratch_ == nullptr) return;
  cudaSetDevice(device_);
  if (anchor_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(anchor_));
  if (scratch_ != nullptr) cudaFree(scratch_);
}

// Gives `s` a 4-byte memset and waits for it.
static cudaError_t Use(cudaStream_t s, void* scratch) {
  cudaError_t err = cudaMemsetAsync(scratch, 0, 4, s);
  return err == cudaSuccess ? cudaStreamSynchronize(s) : err;
}

Status CudaDeviceOps::CreateStream(void** stream) {
  if (Status s = EnterThread(); !s.ok()) return s;
  // Under MPS, sessions whose lane streams first get work at enqueue time
  // alternate between two prices of the hand-off (Wan per rank +14 and +7 us
  // a call over in-process, one session dear, the next cheap); with one
  // stream used and held from the daemon's first session on, and every lane
  // stream used as it is created, every session got the cheap one
  // (bench/results/2026-12-06-h100-session-streams.md sections 4 and 5).
  // Made by the first call that succeeds: a failure (say, out of memory)
  // fails this session's stream and the next call tries again.
  cudaError_t err = cudaSuccess;
  {
    const std::lock_guard<std::mutex> lock(anchor_mu_);
    if (scratch_ == nullptr) {
      void* p = nullptr;
      err = cudaMalloc(&p, 16);
      if (err == cudaSuccess) scratch_ = p;
    }
    if (err == cudaSuccess && anchor_ == nullptr) {
      cudaStream_t a = nullptr;
      err = cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
      if (err == cudaSuccess) err = Use(a, scratch_);
      if (err == cudaSuccess) {
        anchor_ = a;
      } else if (a != nullptr) {
        cudaStreamDestroy(a);
      }
    }
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::Internal("anchor stream: ", RuntimeErrorString(err));
  }
  cudaStream_t s = nullptr;
  // Non-blocking: a lane stream must never serialize with the legacy default
  // stream that some library on the daemon's side might use.
  err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (err == cudaSuccess) {
    err = Use(s, scratch_);
    if (err != cudaSuccess) cudaStreamDestroy(s);
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::Internal("lane stream: ", RuntimeErrorString(err));
  }
  *stream = s;
  return Status::Ok();
}

void CudaDeviceOps::DestroyStream(void* stream) {
  if (stream == nullptr) return;
  cudaSetDevice(device_);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

Status CudaDeviceOps::WaitValue64(void* stream, uint64_t addr, uint64_t value, bool* sticky) {
  Status s;
  const DriverApi* api = GetDriverApi(&s);
  if (api == nullptr) return s;
  CUresult r = api->stream_wait_value64(static_cast<CUstream>(stream), static_cast<CUdeviceptr>(addr), value,
                                        CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    if (sticky != nullptr && IsStickyCudaError(r)) *sticky = true;
    return Status::Internal("cuStreamWaitValue64_v2: ", DriverErrorString(r));
  }
  return Status::Ok();
}

Status CudaDeviceOps::WriteValue64(void* stream, std::span<const uint64_t> addrs, uint64_t value,
                                   bool* sticky) {
  Status s;
  const DriverApi* api = GetDriverApi(&s);
  if (api == nullptr) return s;
  // One driver call for all the writes: the executor writes a lane's shared
  // and private "done" after every call, and each enqueue is host time on
  // the daemon's launching thread (bench/probes/stream_queues.cu hostcost).
  constexpr size_t kBatch = 8;
  for (size_t first = 0; first < addrs.size(); first += kBatch) {
    const size_t n = std::min(kBatch, addrs.size() - first);
    std::array<CUstreamBatchMemOpParams, kBatch> ops{};
    for (size_t i = 0; i < n; ++i) {
      ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      ops[i].writeValue.address = static_cast<CUdeviceptr>(addrs[first + i]);
      ops[i].writeValue.value64 = value;
      // Default flags: each write is ordered after (and makes visible) all
      // earlier work of the stream, and the writes land in array order.
      ops[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    CUresult r = api->stream_batch_mem_op(static_cast<CUstream>(stream), static_cast<unsigned int>(n), ops.data(), 0);
    if (r != CUDA_SUCCESS) {
      if (sticky != nullptr && IsStickyCudaError(r)) *sticky = true;
      return Status::Internal("cuStreamBatchMemOp_v2 (", n, " writes): ", DriverErrorString(r));
    }
  }
  return Status::Ok();
}

}  // namespace cache_dit_opd::cuda
