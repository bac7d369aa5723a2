#include "server/exec/stats.h"

#include <algorithm>
#include <cmath>

namespace cache_dit_opd {

LatencyReservoir::LatencyReservoir(size_t capacity) { samples_.reserve(capacity ? capacity : 1); }

void LatencyReservoir::Record(double us) {
  std::lock_guard<std::mutex> lock(mu_);
  if (samples_.size() < samples_.capacity()) {
    samples_.push_back(us);
  } else {
    samples_[next_] = us;
    next_ = (next_ + 1) % samples_.size();
  }
  ++recorded_;
}

void LatencyReservoir::Percentiles(double* p50, double* p99) const {
  std::vector<double> copy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    copy = samples_;
  }
  *p50 = *p99 = 0;
  if (copy.empty()) return;
  auto rank = [&](double q) {
    size_t k = static_cast<size_t>(std::ceil(q * copy.size()));
    k = std::clamp<size_t>(k, 1, copy.size()) - 1;
    std::nth_element(copy.begin(), copy.begin() + k, copy.end());
    return copy[k];
  };
  *p50 = rank(0.50);
  *p99 = rank(0.99);
}

uint64_t LatencyReservoir::recorded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recorded_;
}

void DaemonStats::Count(size_t row, CallTransport transport, const Status& outcome) {
  (outcome.ok() ? calls : errors).fetch_add(1, std::memory_order_relaxed);
  per_op.Count(row, transport, outcome);
}

void DaemonStats::Observe(size_t row, CallTransport transport, CallStage stage,
                          std::chrono::steady_clock::duration d) {
  LatencyReservoir* reservoir = stage == CallStage::kAccept       ? &accept_us
                                : stage == CallStage::kInputsWait ? &inputs_wait_us
                                : stage == CallStage::kRun        ? &run_us
                                                                  : &call_latency_us;
  reservoir->Record(std::chrono::duration<double, std::micro>(d).count());
  per_op.Observe(row, transport, stage, std::chrono::duration_cast<std::chrono::nanoseconds>(d));
}

}  // namespace cache_dit_opd
