// File: client/core/session_engine.h
//
// SessionEngine: the client side of one bound session's data plane, the one
// implementation behind both clients (the C++ client, client/opd_client.h,
// and the Python client's native engine, client/python/). It owns
//   - the session memory (proto/cache_dit_opd/v1/session_memory.h): the
//     memfd from the bind, validated and mapped here, registered with CUDA;
//   - the lanes (lanes.h): stream -> lane, sequence numbers, inputs_ready
//     and done on the caller's stream, the fence between streams sharing a
//     lane;
//   - the call ring's producer (ring_producer.h, proto/.../ring.h), when the
//     daemon granted a ring;
//   - the region cache (regions.h): which client allocation is which region
//     id, mirroring the control plane's table (the C++ client registers
//     through its RegionRegistrar; Python registers over gRPC itself and
//     tells the engine with AddRegion);
//   - liveness: the session channel and the daemon's pidfd (watched by the
//     process-wide monitor, monitor.h), and the daemon's heartbeat.
// What it does not do is the control plane: discovery, OpenSession, the bind
// itself, RegisterRegion, the catalog check and CloseSession belong to each
// client (they are gRPC, which the Python engine never links).
//
// Failure (docs/DESIGN.md section 5): the session fails when the daemon
// closes the session channel, when its process exits, when its heartbeat
// stops advancing for EngineOptions::heartbeat_timeout while calls are
// outstanding, when a call answers with an action other than raise /
// re-register (the caller passes it to Fail), or when the client closes it.
// A failed engine refuses new calls at once. Waits this client enqueued are
// released from the host only once the daemon can no longer write the
// client's memory: its process exited (at once), or it closed the channel
// (after a grace); the calls released so are counted by TakeLost().
//
// Thread-safety: every method may be called from any thread. Plain C++ and
// the CUDA driver through common/cuda/driver_api.h: neither gRPC nor torch.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "client/core/cuda_backend.h"
#include "client/core/lanes.h"
#include "client/core/regions.h"
#include "client/core/ring_producer.h"
#include "client/core/session_channel.h"
#include "client/core/session_mapping.h"
#include "common/ring_encode.h"
#include "common/status.h"

namespace cache_dit_opd::client {

// A session as the client's control plane bound it.
struct BoundSession {
  uint64_t session_id = 0;
  uint32_t lanes = 0;          // granted by OpenSession
  uint64_t memory_bytes = 0;   // OpenSessionReply.shared_memory_bytes (the bind reply agreed)
  UniqueFd memfd;              // the session memory, from the bind reply
  UniqueFd channel;            // the bound session channel; the engine keeps it open
};

// EngineDevice
//
// What the engine does on the GPU, behind a seam: CUDA in both clients
// (CudaEngineDevice), host memory in the CPU tests of the engine against the
// real daemon (tests/cpp/client/engine_test.cc).
class EngineDevice {
 public:
  virtual ~EngineDevice() = default;
  // Makes [p, p + bytes) (the session memory) usable by this process's
  // streams; its device address.
  virtual Status RegisterHostMemory(void* p, size_t bytes, uint64_t* device_address) = 0;
  virtual void UnregisterHostMemory(void* p) = 0;
  // The lanes' stream operations on `memory`, mapped at `device_base`.
  virtual std::unique_ptr<LaneStreamOps> LaneOps(const SessionMapping* memory, uint64_t device_base) = 0;
  // The driver side of regions.
  virtual std::unique_ptr<AllocationBackend> Allocations() = 0;
  // Makes the device current on this thread for one call, whatever device
  // the caller has current (`guard` holds it until the call returns).
  virtual Status Enter(std::optional<cuda::DeviceGuard>* guard) = 0;
};

// The CUDA device `device`: cuMemHostRegister (DEVICEMAP | PORTABLE),
// CudaLaneOps, CudaAllocationBackend. UNAVAILABLE without a driver.
Status CudaEngineDevice(int device, std::unique_ptr<EngineDevice>* out);

struct EngineOptions {
  std::chrono::nanoseconds spin = std::chrono::microseconds(200);   // ring waits spin this long first
  std::chrono::nanoseconds call_timeout = std::chrono::seconds(600);
  // A daemon whose heartbeat stops this long while calls are outstanding is
  // taken for hung. 0: not watched.
  std::chrono::nanoseconds heartbeat_timeout = std::chrono::seconds(5);
};

// The daemon's answer to one synchronous call.
struct CallAnswer {
  int32_t code = 0;     // google.rpc.Code; 0 accepted
  uint32_t reason = 0;  // wire.h Reason
  std::string message;
  Status status() const;
};

class SessionEngine : public std::enable_shared_from_this<SessionEngine> {
 public:
  // SessionEngine::Create
  //
  // Takes over `bound` on CUDA device `device` of this process: maps and
  // validates the memory (ValidateSessionMemoryHeader), registers it with
  // CUDA, opens the ring when the header holds one, learns the daemon's pid
  // from the channel (SO_PEERCRED) and starts watching the session.
  // `registrar`, when set, registers allocations the region cache misses
  // (it must outlive the engine's use); without it a miss is reported to the
  // caller, who registers and calls AddRegion.
  // `gpu` defaults to CudaEngineDevice(device).
  static Status Create(int device, BoundSession bound, const EngineOptions& options, RegionRegistrar* registrar,
                       std::shared_ptr<SessionEngine>* out, std::unique_ptr<EngineDevice> gpu = nullptr);
  ~SessionEngine();
  SessionEngine(const SessionEngine&) = delete;
  SessionEngine& operator=(const SessionEngine&) = delete;

  uint64_t session_id() const { return session_id_; }
  int device() const { return device_; }
  int pid() const { return pid_; }  // the process that opened it (a forked child must not use it)
  uint32_t lane_count() const { return memory_->lane_count(); }
  bool has_ring() const { return ring_ != nullptr; }
  int32_t daemon_pid() const { return daemon_pid_; }

  // -- calls -----------------------------------------------------------------------
  // SessionEngine::CallRing
  //
  // Runs one call on `stream` (a stream of this session's device, whatever
  // device is current) through the ring: lane, inputs_ready, record, then
  // (synchronous) the daemon's answer in `*answer`, then the wait on done.
  // Asynchronous: returns once published; a rejection comes back from
  // TakeRejected. Non-OK only when the transport broke (UNAVAILABLE,
  // DEADLINE_EXCEEDED, INTERNAL); the engine has failed then.
  Status CallRing(void* stream, uint32_t op_index, const RecordArgs& args, bool asynchronous,
                  std::span<const uint64_t> regions, const IssueOptions& options, CallAnswer* answer);
  // SessionEngine::CallWith
  //
  // Runs one call on `stream`'s lane with another transport: `send(lane,
  // seq)` sends it (the C++ client's gRPC Call) between the inputs_ready
  // write and the done wait (LaneTable::Issue's rules).
  Status CallWith(void* stream, const IssueOptions& options, const LaneTable::SendFn& send);

  // Asynchronous rejections (ring only): whether some wait; take them,
  // oldest first; wait until every record published so far is answered.
  bool HasRejected();
  std::vector<RejectedCall> TakeRejected(size_t max = SIZE_MAX);
  Status WaitConsumed();
  uint64_t in_flight() const { return ring_ ? ring_->in_flight() : 0; }
  uint64_t published() const { return ring_ ? ring_->published() : 0; }
  uint32_t ring_capacity() const { return ring_ ? ring_->capacity() : 0; }
  uint64_t unanswered_async() { return ring_ ? ring_->unanswered_async() : 0; }
  uint64_t ring_wakes() const { return ring_ ? ring_->wakes() : 0; }
  uint64_t ring_full_waits() const { return ring_ ? ring_->full_waits() : 0; }

  // -- regions ------------------------------------------------------------------------
  // The region of the allocation holding `ptr`, registering it through the
  // registrar on a miss (INVALID_ARGUMENT for memory that cannot be shared).
  Status ResolveRegion(const void* ptr, ResolvedRegion* out) { return regions_->Resolve(ptr, out); }
  // Without registering: the region holding [ptr, ptr + nbytes), when that
  // allocation is registered as it is now (same base, size, buffer id).
  bool FindRegion(const void* ptr, uint64_t nbytes, uint64_t* region_id, uint64_t* offset);
  // The caller registered an allocation / forgot one (Python's table).
  void AddRegion(uint64_t base, uint64_t size, uint64_t buffer_id, uint64_t region_id);
  // The caller mapped [base, base + size) itself (an attached weight-store
  // block) and keeps it mapped until ForgetRegion(base): RegionCache::AddFixed.
  void AddFixedRegion(uint64_t base, uint64_t size, uint64_t region_id) { regions_->AddFixed(base, size, region_id); }
  // The caller registered a run of virtual-memory chunks as one region
  // (RegionCache::AddRun).
  void AddRunRegion(std::vector<Chunk> chunks, uint64_t region_id) { regions_->AddRun(std::move(chunks), region_id); }
  void ForgetRegion(uint64_t base);
  RegionCache& regions() { return *regions_; }

  // -- lanes ---------------------------------------------------------------------------
  LaneTable& lanes() { return *lanes_; }
  struct LaneState {
    uint64_t issued, inputs_ready, done;
  };
  LaneState lane_state(uint32_t lane) const;
  // Some lane's done is behind its last issued number (calls outstanding).
  bool LanesBehind() const;
  // Raises lane `lane`'s inputs_ready from the host (tests of a stalled client).
  void RaiseInputsReadyFromHost(uint32_t lane, uint64_t value);

  // -- failure ---------------------------------------------------------------------------
  // Fails the session with `reason` (kept by the first caller); later calls
  // return it at once. Does not touch the semaphores.
  void Fail(const Status& reason);
  bool failed() const { return lanes_->failed(); }
  Status failure() const { return lanes_->failure(); }
  // OK while the daemon can still answer (not failed, its process alive,
  // its heartbeat advancing or no call outstanding); else why not.
  Status Liveness();
  // Calls whose waits were released from the host since the last call (the
  // daemon died with them unfinished: their outputs are undefined).
  uint64_t TakeLost() { return lost_.exchange(0, std::memory_order_acq_rel); }

  // SessionEngine::Close
  //
  // The client is done with the session: fails it, half-closes the channel
  // (the daemon ends the session) and hands the memory to the monitor,
  // which frees it once no stream can still wait on it. Idempotent.
  void Close();

 private:
  friend class SessionMonitor;
  SessionEngine(int device, uint64_t session_id, const EngineOptions& options);

  // The monitor's side. Releases every lane's waits from the host; counts
  // the calls that had not completed into lost_.
  void ReleaseFromHost(const Status& reason);
  // 1: every fence passed (no stream can still wait on the memory); 0: not
  // yet; -1: unknowable (broken context).
  int FencesPassed() const;
  // Keep mapping, registration and events for the process's life.
  void Leak() { leak_ = true; }
  Status HeartbeatLost();

  const int device_;
  const uint64_t session_id_;
  const EngineOptions options_;
  const int pid_;
  std::unique_ptr<EngineDevice> gpu_;
  std::unique_ptr<SessionMapping> memory_;
  bool host_registered_ = false;
  std::unique_ptr<LaneStreamOps> lane_ops_;
  std::unique_ptr<LaneTable> lanes_;
  std::unique_ptr<RingProducer> ring_;
  std::unique_ptr<AllocationBackend> allocations_;
  std::unique_ptr<RegionCache> regions_;
  UniqueFd channel_;
  UniqueFd daemon_pidfd_;
  int32_t daemon_pid_ = 0;
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> lost_{0};
  bool leak_ = false;

  std::mutex heartbeat_mu_;
  uint64_t heartbeat_value_ = 0;                    // guarded by heartbeat_mu_
  std::chrono::steady_clock::time_point heartbeat_seen_;  // guarded by heartbeat_mu_
  bool heartbeat_armed_ = false;                    // guarded by heartbeat_mu_
};

}  // namespace cache_dit_opd::client
