// MemoryTrimmer (server/memory_trim.h): freed memory that glibc keeps in a
// thread's arena goes back to the kernel.
#include "server/memory_trim.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace cache_dit_opd {
namespace {

// VmRSS of this process, bytes.
size_t Rss() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) << 10;
  }
  return 0;
}

// Like gRPC receiving a large message: 96 MiB of small blocks from a
// thread's own arena, every one touched, all freed but every 64th, so the
// arena's heap cannot shrink from its top and glibc keeps the rest resident.
// Returns the blocks kept.
std::vector<void*> AllocateAndFreeInAThread() {
  std::vector<void*> kept;
  std::thread([&] {
    std::vector<void*> blocks;
    for (int i = 0; i < 24 * 1024; ++i) {
      void* p = std::malloc(4096);
      std::memset(p, 1, 4096);
      blocks.push_back(p);
    }
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (i % 64 == 63) {
        kept.push_back(blocks[i]);
      } else {
        std::free(blocks[i]);
      }
    }
  }).join();
  return kept;
}

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
TEST(MemoryTrimmerTest, FreedMemoryHeldInAThreadsArenaIsGivenBackOncePerGrowth) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // ASan and TSan bring their own allocator: glibc's arenas hold nothing to trim.
  GTEST_SKIP() << "glibc malloc is replaced by the sanitizer's allocator";
#endif
  MemoryTrimmer trimmer(std::chrono::hours(1), size_t{16} << 20);
  bool trimmed = true;
  (void)trimmer.TrimOnce(&trimmed);  // sets the floor: nothing grew yet
  EXPECT_FALSE(trimmed);
  std::vector<void*> kept = AllocateAndFreeInAThread();
  const size_t before = Rss();
  const size_t free_bytes = trimmer.TrimOnce(&trimmed);
  const size_t after = Rss();
  EXPECT_GT(free_bytes, size_t{64} << 20);
  EXPECT_TRUE(trimmed);
  EXPECT_EQ(trimmer.trims(), 1u);
  EXPECT_LT(after + (size_t{48} << 20), before) << "RSS " << (before >> 20) << " -> " << (after >> 20) << " MiB";
  // The released pages stay on malloc's free lists: without new growth the
  // next round does not walk them again.
  EXPECT_GT(trimmer.TrimOnce(&trimmed), size_t{64} << 20);
  EXPECT_FALSE(trimmed);
  // Memory reused and freed again is resident again: trimmed again.
  std::vector<void*> kept2 = AllocateAndFreeInAThread();
  (void)trimmer.TrimOnce(&trimmed);
  EXPECT_TRUE(trimmed);
  EXPECT_EQ(trimmer.trims(), 2u);
  for (void* p : kept) std::free(p);
  for (void* p : kept2) std::free(p);
}
#endif

TEST(MemoryTrimmerTest, StartsAndStopsPromptly) {
  MemoryTrimmer trimmer(std::chrono::milliseconds(5));
  trimmer.Start();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const auto t0 = std::chrono::steady_clock::now();
  trimmer.Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  trimmer.Stop();  // idempotent
}

}  // namespace
}  // namespace cache_dit_opd
