// File: tests/cpp/client/support/latency.h
//
// Latency summaries shared by the two sides of the client benchmark
// (opd_client_bench through the daemon, opd_ref_tool in-process), so both
// report the same statistics the same way. Header-only and plain C++: the
// reference tool sees torch, the benchmark sees gRPC.
#pragma once

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

namespace cache_dit_opd::testing {

struct LatencySummary {
  double p50 = 0, p99 = 0, mean = 0, min = 0, max = 0;
};

// Nearest-rank percentiles of `v` (microseconds, any order).
inline LatencySummary Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  LatencySummary s;
  if (v.empty()) return s;
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))]; };
  s.p50 = at(0.5);
  s.p99 = at(0.99);
  s.min = v.front();
  s.max = v.back();
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / v.size();
  return s;
}

// {"p50": .., "p99": .., "mean": .., "min": .., "max": ..} with 3 decimals.
inline std::string Json(const LatencySummary& s) {
  std::ostringstream os;
  os.precision(3);
  os << std::fixed << "{\"p50\": " << s.p50 << ", \"p99\": " << s.p99 << ", \"mean\": " << s.mean
     << ", \"min\": " << s.min << ", \"max\": " << s.max << "}";
  return os.str();
}

}  // namespace cache_dit_opd::testing
