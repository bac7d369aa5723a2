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

}  // namespace cache_dit_opd
