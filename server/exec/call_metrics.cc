#include "server/exec/call_metrics.h"

#include <algorithm>
#include <utility>

namespace cache_dit_opd {

const char* CallStageName(CallStage stage) {
  switch (stage) {
    case CallStage::kAccept: return "accept";
    case CallStage::kInputsWait: return "inputs_wait";
    case CallStage::kRun: return "run";
    case CallStage::kTotal: return "total";
  }
  return "stage";
}

namespace {
// The bounds in integer nanoseconds: a sample on a bound lands in that bucket
// (1000 ns * 1e-9 is a hair above 1e-6 in doubles).
constexpr auto kBoundsNs = [] {
  std::array<int64_t, kLatencyBucketBounds.size()> ns{};
  for (size_t i = 0; i < ns.size(); ++i) ns[i] = static_cast<int64_t>(kLatencyBucketBounds[i] * 1e9 + 0.5);
  return ns;
}();
}  // namespace

void LatencyHistogram::Observe(std::chrono::nanoseconds d) {
  const int64_t ns = std::max<int64_t>(d.count(), 0);
  // 22 bounds: a linear scan is as fast as a search and branch-predictable.
  size_t i = 0;
  while (i < kBoundsNs.size() && ns > kBoundsNs[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
}

LatencyHistogram::Snapshot LatencyHistogram::Read() const {
  Snapshot s;
  uint64_t running = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    running += buckets_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = running;
  }
  s.count = running;
  s.sum_seconds = static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) * 1e-9;
  return s;
}

namespace {
using OpKey = std::pair<std::string_view, std::string_view>;
OpKey KeyOf(const OpInfo& o) { return {o.name, o.overload}; }
std::vector<OpInfo> Sorted(std::vector<OpInfo> ops) {
  std::sort(ops.begin(), ops.end(), [](const OpInfo& a, const OpInfo& b) { return KeyOf(a) < KeyOf(b); });
  return ops;
}
}  // namespace

CallMetrics::CallMetrics(std::vector<OpInfo> catalog)
    : catalog_(Sorted(std::move(catalog))), counters_(new OpCallCounters[(catalog_.size() + 1) * kCallTransportCount]) {}

size_t CallMetrics::Row(std::string_view op, std::string_view overload) const {
  const OpKey key{op, overload};
  auto it = std::lower_bound(catalog_.begin(), catalog_.end(), key,
                             [](const OpInfo& o, const OpKey& k) { return KeyOf(o) < k; });
  return it != catalog_.end() && KeyOf(*it) == key ? static_cast<size_t>(it - catalog_.begin()) : other_row();
}

const OpInfo& CallMetrics::op(size_t row) const { return row < catalog_.size() ? catalog_[row] : other_; }

size_t CallMetrics::Index(size_t row, CallTransport transport) const {
  return std::min(row, other_row()) * kCallTransportCount + static_cast<size_t>(transport);
}

const OpCallCounters& CallMetrics::counters(size_t row, CallTransport transport) const {
  return counters_[Index(row, transport)];
}

void CallMetrics::Count(size_t row, CallTransport transport, const Status& outcome) {
  OpCallCounters& c = counters_[Index(row, transport)];
  if (outcome.ok()) {
    c.calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const auto reason = static_cast<uint32_t>(outcome.reason());
  c.rejections[reason < v1::kReasonCount ? reason : 0].fetch_add(1, std::memory_order_relaxed);
}

void CallMetrics::Observe(size_t row, CallTransport transport, CallStage stage, std::chrono::nanoseconds d) {
  counters_[Index(row, transport)].stages[static_cast<size_t>(stage)].Observe(d);
}

}  // namespace cache_dit_opd
