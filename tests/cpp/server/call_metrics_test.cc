#include "server/exec/call_metrics.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace cache_dit_opd {
namespace {

using std::chrono::microseconds;
using std::chrono::nanoseconds;

std::vector<OpInfo> Catalog() {
  // Deliberately unsorted: the table sorts its own copy.
  return {OpInfo{"b_op", "out", ""}, OpInfo{"a_op", "out", ""}, OpInfo{"a_op", "", ""}};
}

TEST(CallMetricsTest, RowsAreTheCatalogAndOneRowForEveryOtherName) {
  CallMetrics m(Catalog());
  EXPECT_EQ(m.rows(), 4u);
  const size_t a_out = m.Row("a_op", "out");
  const size_t a_default = m.Row("a_op", "");
  const size_t b_out = m.Row("b_op", "out");
  EXPECT_NE(a_out, a_default);
  EXPECT_NE(a_out, b_out);
  for (size_t r : {a_out, a_default, b_out}) EXPECT_LT(r, m.other_row());
  EXPECT_EQ(m.op(a_out).name, "a_op");
  EXPECT_EQ(m.op(a_out).overload, "out");
  EXPECT_EQ(m.op(b_out).name, "b_op");
  // Unknown names and overloads, however many, share one row.
  EXPECT_EQ(m.Row("b_op", ""), m.other_row());
  EXPECT_EQ(m.Row("c_op", "out"), m.other_row());
  EXPECT_EQ(m.Row("", ""), m.other_row());
  EXPECT_EQ(m.op(m.other_row()).name, "");
}

TEST(CallMetricsTest, CountsByOutcomeReasonAndTransport) {
  CallMetrics m(Catalog());
  const size_t row = m.Row("a_op", "out");
  m.Count(row, CallTransport::kRing, Status::Ok());
  m.Count(row, CallTransport::kRing, Status::Ok());
  m.Count(row, CallTransport::kGrpc, Status::Ok());
  m.Count(row, CallTransport::kRing, Status::Rejected(Reason::kBadArgument, "x"));
  m.Count(row, CallTransport::kRing, Status::Internal("no reason given"));
  const OpCallCounters& ring = m.counters(row, CallTransport::kRing);
  EXPECT_EQ(ring.calls.load(), 2u);
  EXPECT_EQ(ring.rejections[static_cast<size_t>(Reason::kBadArgument)].load(), 1u);
  EXPECT_EQ(ring.rejections[0].load(), 1u);  // UNSPECIFIED
  EXPECT_EQ(m.counters(row, CallTransport::kGrpc).calls.load(), 1u);
  EXPECT_EQ(m.counters(m.other_row(), CallTransport::kRing).calls.load(), 0u);
}

TEST(CallMetricsTest, HistogramIsCumulativeWithInfEqualToCount) {
  LatencyHistogram h;
  h.Observe(nanoseconds(500));      // <= 1 us
  h.Observe(microseconds(1));       // exactly on the 1 us bound: counted there (le)
  h.Observe(microseconds(3));       // <= 5 us
  h.Observe(std::chrono::seconds(20));  // past every bound: +Inf only
  h.Observe(nanoseconds(-5));       // a clock step backwards counts as 0
  const LatencyHistogram::Snapshot s = h.Read();
  EXPECT_EQ(s.count, 5u);
  EXPECT_EQ(s.cumulative[0], 3u);  // 1 us: 500 ns, 1 us, the clamped one
  EXPECT_EQ(s.cumulative[1], 3u);  // 2 us
  EXPECT_EQ(s.cumulative[2], 4u);  // 5 us
  EXPECT_EQ(s.cumulative[kLatencyBucketBounds.size() - 1], 4u);  // 10 s
  EXPECT_EQ(s.cumulative.back(), 5u);
  EXPECT_NEAR(s.sum_seconds, 20.0 + 4.5e-6, 1e-9);
  for (size_t i = 1; i < s.cumulative.size(); ++i) EXPECT_LE(s.cumulative[i - 1], s.cumulative[i]);
}

TEST(CallMetricsTest, ConcurrentWritersLoseNothing) {
  CallMetrics m(Catalog());
  const size_t row = m.Row("b_op", "out");
  constexpr int kThreads = 4, kEach = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        m.Count(row, CallTransport::kGrpc, Status::Ok());
        m.Observe(row, CallTransport::kGrpc, CallStage::kRun, microseconds(7));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(m.counters(row, CallTransport::kGrpc).calls.load(), uint64_t{kThreads} * kEach);
  const auto s = m.counters(row, CallTransport::kGrpc).stages[static_cast<size_t>(CallStage::kRun)].Read();
  EXPECT_EQ(s.count, uint64_t{kThreads} * kEach);
  EXPECT_NEAR(s.sum_seconds, kThreads * kEach * 7e-6, 1e-6);
}

}  // namespace
}  // namespace cache_dit_opd
