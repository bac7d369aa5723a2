// File: client/python/native_session.h
//
// The native half of one Python client session (python/cache_dit_opd,
// _session.Session) that uses the call ring: the one ring producer, the
// lanes, and a copy of the session's region table, shared by the native
// proxy kernels (proxy_kernel.cpp) and the Python client's own calls.
//
// Division of work: Python opens, binds and fails the session, registers and
// unregisters regions over gRPC (and tells this object: AddRegion /
// ForgetRegion), checks the op catalog (SetOp) and turns rejections into
// exceptions. Everything a call does after its arguments are known runs
// here: lane, inputs_ready, record, doorbell, completion, wait on done.
// Ordering and lifetime rules are docs/DESIGN.md section 1's, unchanged: the
// lanes are client/core/lanes.h's LaneTable (streams share lanes behind fence
// events), the ring is client/core/ring_producer.h's protocol.
//
// Liveness (what ends a wait on the daemon): Fail() from Python (the
// session's watcher saw the channel close or the heartbeat stop), the
// daemon's pidfd becoming readable (it exited), or the heartbeat word not
// advancing for `heartbeat_timeout` once it was seen advancing.
//
// Torch-free and gRPC-free (plain C++ and the CUDA driver through
// common/cuda/driver_api.h). Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "client/core/cuda_backend.h"
#include "client/core/lanes.h"
#include "client/core/ring_producer.h"
#include "client/core/session_mapping.h"
#include "common/ring_encode.h"
#include "common/status.h"

namespace cache_dit_opd::client {

struct ProxySessionConfig {
  int device = -1;                 // CUDA ordinal in this process
  void* memory = nullptr;          // the session memfd as Python mapped it (stays mapped)
  uint64_t memory_bytes = 0;
  uint64_t device_base = 0;        // its device address (cuMemHostGetDevicePointer)
  uint64_t session_id = 0;
  uint32_t lanes = 0;              // granted by OpenSession
  int daemon_pidfd = -1;           // owned (closed with the session); -1: none (heartbeat and Fail only)
  std::chrono::nanoseconds spin = std::chrono::microseconds(200);
  std::chrono::nanoseconds call_timeout = std::chrono::seconds(600);
  std::chrono::nanoseconds heartbeat_timeout = std::chrono::seconds(5);  // 0: not watched
};

// Fallback reasons of the native kernels, counted per session.
enum class ProxyFallback : int {
  kFailed = 0,       // the session failed, or this is a forked child
  kPendingErrors,    // rejected asynchronous calls wait to be raised
  kCapturing,        // a CUDA graph capture is under way
  kUnknownOp,        // op not in the checked catalog
  kArgument,         // an argument the record cannot carry natively
  kRegionMiss,       // an allocation not registered yet
  kRejected,         // the daemon rejected a synchronous call
  kBroken,           // the ring failed under the call
  kCount,
};

class ProxySession {
 public:
  static Status Create(const ProxySessionConfig& config, std::unique_ptr<ProxySession>* out);
  ~ProxySession();

  int device() const { return config_.device; }
  int pid() const { return pid_; }

  // -- ops (Python: after the family's schemas matched the catalog) --------
  void SetOp(const std::string& name_overload, uint32_t op_index);
  // "name.overload" (overload empty: "name") -> catalog index.
  bool OpIndex(const std::string& name_overload, uint32_t* op_index) const;

  // -- regions (Python owns registration) -----------------------------------
  void AddRegion(uint64_t base, uint64_t size, uint64_t buffer_id, uint64_t region_id);
  void ForgetRegion(uint64_t base);
  // The region holding [ptr, ptr + nbytes): one driver query, then the table.
  // False when the allocation is not registered as it is now (or the range
  // leaves it); *offset is ptr - base.
  bool FindRegion(const void* ptr, uint64_t nbytes, uint64_t* region_id, uint64_t* offset);

  // -- calls ---------------------------------------------------------------------
  // Runs one call on `stream` (a stream of this session's device, whatever
  // device is current) on its lane: inputs_ready, record, (synchronous: wait
  // for the answer), wait on done. Returns OK with *code = the daemon's
  // answer (0 accepted; synchronous calls only), or the transport failure
  // (UNAVAILABLE / DEADLINE_EXCEEDED / INTERNAL); then the session is failed.
  Status Call(void* stream, uint32_t op_index, const RecordArgs& args, bool asynchronous, const uint64_t* regions,
              size_t nregions, int32_t* code, std::string* message);

  bool HasRejected() { return producer_->HasRejected(); }
  std::vector<RejectedCall> TakeRejected(size_t max) { return producer_->TakeRejected(max); }
  Status WaitConsumed() { return producer_->WaitConsumed(); }
  uint64_t in_flight() const { return producer_->in_flight(); }
  uint64_t published() const { return producer_->published(); }
  uint32_t ring_capacity() const { return producer_->capacity(); }
  uint64_t unanswered_async() { return producer_->unanswered_async(); }

  // -- failure -----------------------------------------------------------------
  void Fail(const std::string& reason);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Raises every lane's done to its last issued number from the host (the
  // daemon is gone); returns the calls that had not completed.
  uint64_t ReleaseFromHost(const std::string& reason);
  // Some lane's done is behind its last issued number.
  bool LanesBehind() const;

  struct LaneState {
    uint64_t issued, inputs_ready, done;
  };
  LaneState lane_state(uint32_t lane) const;
  uint32_t lane_count() const { return memory_->lane_count(); }

  // -- counters --------------------------------------------------------------
  void CountNative() { native_calls_.fetch_add(1, std::memory_order_relaxed); }
  void CountFallback(ProxyFallback why) {
    fallbacks_[static_cast<int>(why)].fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t native_calls() const { return native_calls_.load(std::memory_order_relaxed); }
  uint64_t fallbacks(ProxyFallback why) const {
    return fallbacks_[static_cast<int>(why)].load(std::memory_order_relaxed);
  }
  uint64_t ring_wakes() const { return producer_->wakes(); }
  uint64_t ring_full_waits() const { return producer_->full_waits(); }

 private:
  explicit ProxySession(const ProxySessionConfig& config);
  Status Liveness();

  struct Region {
    uint64_t size, buffer_id, region_id;
  };

  ProxySessionConfig config_;
  int pid_;
  const cuda::DriverApi* api_ = nullptr;
  std::unique_ptr<SessionMemory> memory_;
  std::unique_ptr<CudaLaneOps> lane_ops_;
  std::unique_ptr<LaneTable> lanes_;
  std::unique_ptr<RingProducer> producer_;
  std::unique_ptr<CudaAllocationBackend> allocations_;

  mutable std::shared_mutex ops_mu_;
  std::unordered_map<std::string, uint32_t> ops_;  // guarded by ops_mu_
  mutable std::shared_mutex regions_mu_;
  std::unordered_map<uint64_t, Region> regions_;   // by allocation base; guarded by regions_mu_

  std::atomic<bool> failed_{false};
  std::mutex failure_mu_;
  std::string failure_;                            // guarded by failure_mu_
  std::mutex heartbeat_mu_;
  uint64_t heartbeat_value_ = 0;                   // guarded by heartbeat_mu_
  std::chrono::steady_clock::time_point heartbeat_seen_;
  bool heartbeat_armed_ = false;

  std::atomic<uint64_t> native_calls_{0};
  std::atomic<uint64_t> fallbacks_[static_cast<int>(ProxyFallback::kCount)] = {};
};

// The session the native kernels use for `device` in this process: set by
// Python once the session is open and its catalog checked, cleared when it
// fails or closes. nullptr when none.
std::shared_ptr<ProxySession> ActiveProxySession(int device);
void SetActiveProxySession(int device, std::shared_ptr<ProxySession> session);
// Clears `device`'s entry if it still holds `session`.
void ClearActiveProxySession(int device, const ProxySession* session);

// Asynchronous mode as Python sets it: the process default, and a per-thread
// override (-1: none) for async_calls() scopes.
void SetAsyncProcess(bool enabled);
void SetAsyncThread(int mode);
bool AsyncCallsEnabled();

}  // namespace cache_dit_opd::client
