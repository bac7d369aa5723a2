// File: server/exec/call_metrics.h
//
// Per-op call counters and latency histograms: the one table behind the
// Prometheus exposition (server/metrics/metrics_exporter.h) and GetStats'
// per-op rows (opd.proto OpStats).
//
// One row per (op overload of the catalog, transport), plus one row per
// transport for every name the catalog does not hold: a client that sends
// made-up op names cannot grow the table (or a scrape's label set).
//
// Written on the call path with relaxed atomic adds only: no lock, no
// allocation, no string built. Read by a scrape at any time, concurrently:
// each figure is exact and monotone, but a scrape may see a call's count
// before its histogram samples (no snapshot across figures is promised).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "common/call.h"
#include "common/status.h"

namespace cache_dit_opd {

// Where a call's daemon-side time goes (opd.proto StatsReply.stages):
// kAccept receive -> answered, kInputsWait answered -> run start, kRun run
// start -> "done" enqueued, kTotal receive -> completion.
enum class CallStage : uint8_t { kAccept = 0, kInputsWait = 1, kRun = 2, kTotal = 3 };
inline constexpr size_t kCallStageCount = 4;
// "accept", "inputs_wait", "run", "total".
const char* CallStageName(CallStage stage);

// Upper bounds of the latency histograms' buckets, seconds (1 us .. 10 s,
// 1-2-5 steps; a +Inf bucket follows). A daemon call costs 1-20 us of host
// time and a kernel up to a few ms; the tail covers stalls.
inline constexpr std::array<double, 22> kLatencyBucketBounds = {
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3,
    5e-3, 1e-2, 2e-2, 5e-2, 1e-1, 2e-1, 5e-1, 1.0,  2.0,  5.0,  10.0};

// A cumulative histogram on atomics (Prometheus semantics: bucket i counts
// samples <= kLatencyBucketBounds[i]; the last bucket is +Inf).
class LatencyHistogram {
 public:
  void Observe(std::chrono::nanoseconds d);
  struct Snapshot {
    std::array<uint64_t, kLatencyBucketBounds.size() + 1> cumulative{};  // per bound, then +Inf (= count)
    uint64_t count = 0;
    double sum_seconds = 0;
  };
  Snapshot Read() const;

 private:
  std::array<std::atomic<uint64_t>, kLatencyBucketBounds.size() + 1> buckets_{};  // non-cumulative
  std::atomic<uint64_t> sum_ns_{0};
};

struct OpCallCounters {
  std::atomic<uint64_t> calls{0};                                  // ran
  std::array<std::atomic<uint64_t>, v1::kReasonCount> rejections{};  // by Reason value (0: none given)
  std::array<LatencyHistogram, kCallStageCount> stages;
};

class CallMetrics {
 public:
  explicit CallMetrics(std::vector<OpInfo> catalog = {});
  CallMetrics(const CallMetrics&) = delete;
  CallMetrics& operator=(const CallMetrics&) = delete;

  // The row of (op, overload): its catalog index, or other_row() for a name
  // the catalog does not hold. Binary search, no allocation.
  size_t Row(std::string_view op, std::string_view overload) const;
  size_t other_row() const { return catalog_.size(); }
  size_t rows() const { return catalog_.size() + 1; }
  // The op of a row; for other_row() an OpInfo with empty name and overload.
  const OpInfo& op(size_t row) const;

  // A call's outcome: OK counts a call, an error counts a rejection by its
  // reason (a failure after acceptance too: it carries its reason).
  void Count(size_t row, CallTransport transport, const Status& outcome);
  void Observe(size_t row, CallTransport transport, CallStage stage, std::chrono::nanoseconds d);

  const OpCallCounters& counters(size_t row, CallTransport transport) const;

 private:
  size_t Index(size_t row, CallTransport transport) const;

  const std::vector<OpInfo> catalog_;
  const OpInfo other_;
  std::unique_ptr<OpCallCounters[]> counters_;  // rows() x kCallTransportCount
};

}  // namespace cache_dit_opd
