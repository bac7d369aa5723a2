// File: client/core/cuda_backend.h
//
// The CUDA implementations of the client's two device-facing interfaces:
//   CudaLaneOps            LaneStreamOps: semaphore writes and waits with
//                          cuStreamWriteValue64_v2 / cuStreamWaitValue64_v2
//                          (a call's pair in one cuStreamBatchMemOp_v2)
//                          on the shared memory mapped for the device, and
//                          one fence event per lane.
//   CudaAllocationBackend  AllocationBackend: cuPointerGetAttributes for the
//                          hot-path lookup, cuMemGetAddressRange +
//                          cuIpcGetMemHandle for the export.
// Internal to opd_client.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "client/core/lanes.h"
#include "client/core/regions.h"
#include "client/core/session_mapping.h"
#include "common/cuda/device_guard.h"
#include "common/cuda/driver_api.h"

namespace cache_dit_opd::client {

class CudaLaneOps final : public LaneStreamOps {
 public:
  // `device_base`: device address of `memory->base()` (cuMemHostGetDevicePointer).
  CudaLaneOps(const cuda::DriverApi* api, int device, const SessionMapping* memory, uint64_t device_base);
  // Destroys the fence events; only once no stream can still wait on them
  // (FencesPassed()), else call Leak() first.
  ~CudaLaneOps() override;

  Status WriteInputsReady(void* stream, uint32_t lane, uint64_t value) override;
  Status WaitDone(void* stream, uint32_t lane, uint64_t value) override;
  Status WriteInputsReadyThenWaitDone(void* stream, uint32_t lane, uint64_t value) override;
  Status RecordFence(void* stream, uint32_t lane) override;
  Status WaitFence(void* stream, uint32_t lane) override;

  // -1 also when a query failed (broken context or runtime shut down).
  int FencesPassed() const override;
  void Leak() override { leak_ = true; }

 private:
  const cuda::DriverApi* api_;
  int device_;
  const SessionMapping* memory_;
  uint64_t device_base_;
  // One per lane, created on first use; guarded by the lane's mutex in
  // LaneTable: Issue creates and records them, FencesPassed reads them with
  // every lane's mutex held (LaneTable::FencesPassed).
  std::vector<void*> events_;
  bool leak_ = false;
};

class CudaAllocationBackend final : public AllocationBackend {
 public:
  explicit CudaAllocationBackend(const cuda::DriverApi* api) : api_(api) {}
  Status Lookup(const void* ptr, AllocationInfo* info) override;
  Status Export(const AllocationInfo& alloc, std::array<uint8_t, 64>* handle) override;
  Status ChunkId(const void* ptr, uint64_t* buffer_id) override;

 private:
  const cuda::DriverApi* api_;
};

}  // namespace cache_dit_opd::client
