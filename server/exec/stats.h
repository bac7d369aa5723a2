// File: server/exec/stats.h
//
// Daemon-wide counters and the call-latency reservoirs behind the GetStats
// RPC, and the per-op table behind the metrics (server/exec/call_metrics.h).
// Per-session counters live in the Session (server/session/session.h).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/exec/call_metrics.h"

namespace cache_dit_opd {

// LatencyReservoir
//
// The last `capacity` samples (a ring), so memory is bounded and the
// percentiles follow the recent load. Thread-safe.
class LatencyReservoir {
 public:
  explicit LatencyReservoir(size_t capacity = 8192);
  void Record(double microseconds);
  // Nearest-rank percentiles of the kept samples; 0 when empty.
  void Percentiles(double* p50, double* p99) const;
  uint64_t recorded() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> samples_;  // guarded by mu_
  size_t next_ = 0;              // guarded by mu_
  uint64_t recorded_ = 0;        // guarded by mu_
};

struct DaemonStats {
  explicit DaemonStats(std::vector<OpInfo> catalog = {}) : per_op(std::move(catalog)) {}

  // A call's outcome, counted once: daemon-wide (calls or errors) and in
  // its op's row. `row` is per_op.Row(op, overload).
  void Count(size_t row, CallTransport transport, const Status& outcome);
  // A stage of a call: the GetStats reservoir (recent percentiles) and the
  // op's histogram (cumulative, for Prometheus).
  void Observe(size_t row, CallTransport transport, CallStage stage, std::chrono::steady_clock::duration d);

  std::atomic<uint64_t> calls{0};            // calls run (enqueued on the GPU) since start
  std::atomic<uint64_t> errors{0};           // calls rejected since start
  std::atomic<uint64_t> sessions_closed{0};  // sessions ended: closed, dead or dropped
  LatencyReservoir call_latency_us;          // receive -> completion, microseconds
  // Stages of a call (StageLatency in opd.proto): receive -> answered,
  // answered -> run start, run start -> "done" enqueued.
  LatencyReservoir accept_us;
  LatencyReservoir inputs_wait_us;
  LatencyReservoir run_us;
  CallMetrics per_op;
};

}  // namespace cache_dit_opd
