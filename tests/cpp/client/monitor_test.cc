// The session monitor across fork() (client/core/monitor.h): a child forked
// after the monitor's thread started gets no monitor, and exits normally
// (its static destructors run) instead of joining a thread it does not have.
#include "client/core/monitor.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

namespace cache_dit_opd::client {
namespace {

TEST(SessionMonitor, AForkedChildGetsNoneAndExitsNormally) {
  ASSERT_NE(SessionMonitor::Get(), nullptr);  // the thread runs in this process
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // exit(), not _exit(): static destructors run, ~SessionMonitor among them.
    std::exit(SessionMonitor::Get() == nullptr ? 0 : 3);
  }
  int status = 0;
  pid_t got = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((got = waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (got == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "the forked child did not exit within 20 s (it waited for the parent's monitor thread)";
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: the child got the parent's monitor; else its exit failed";
  EXPECT_NE(SessionMonitor::Get(), nullptr);  // the parent's is untouched
}

}  // namespace
}  // namespace cache_dit_opd::client
