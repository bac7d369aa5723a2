#include "common/log_throttle.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace cache_dit_opd {
namespace {

using namespace std::chrono_literals;

TEST(LogThrottle, LogsABurstPerIntervalAndCountsTheRest) {
  LogThrottle t(3, 500ms);
  int logged = 0;
  for (int i = 0; i < 100; ++i) logged += t.Next().log ? 1 : 0;
  EXPECT_EQ(logged, 3);
  std::this_thread::sleep_for(600ms);  // a new interval
  const LogThrottle::Verdict v = t.Next();
  EXPECT_TRUE(v.log);
  EXPECT_EQ(v.suppressed, 97u);  // said once, then reset
  EXPECT_EQ(t.Next().suppressed, 0u);
  EXPECT_EQ(SuppressedNote(97), " (97 similar events since the last line were not logged)");
  EXPECT_EQ(SuppressedNote(0), "");
}

TEST(LogThrottle, ManyThreadsNeverLogMoreThanTheBurst) {
  LogThrottle t(5, 10s);
  std::atomic<int> logged{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      for (int j = 0; j < 1000; ++j) logged += t.Next().log ? 1 : 0;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(logged.load(), 5);
}

}  // namespace
}  // namespace cache_dit_opd
