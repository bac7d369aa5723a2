#include "server/memory_trim.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <spdlog/spdlog.h>

namespace cache_dit_opd {
namespace {

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
constexpr bool kCanTrim = true;
size_t FreeBytes() { return mallinfo2().fordblks; }
void Trim() { malloc_trim(0); }
#else
constexpr bool kCanTrim = false;
size_t FreeBytes() { return 0; }
void Trim() {}
#endif

// Resident bytes of this process (/proc/self/statm); 0 if unreadable.
size_t ResidentBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  return n == 2 ? static_cast<size_t>(resident) * static_cast<size_t>(sysconf(_SC_PAGESIZE)) : 0;
}

}  // namespace

void MemoryTrimmer::Start() {
  if (!kCanTrim || thread_.joinable()) return;
  {
    // Growth is measured from here, not from the first round (a burst may
    // come before it).
    std::lock_guard<std::mutex> lock(mu_);
    LowerFloorsLocked(ResidentBytes(), FreeBytes());
  }
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, interval_, [this] { return stop_; })) {
      lock.unlock();
      TrimOnce();
      lock.lock();
    }
  });
}

void MemoryTrimmer::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

size_t MemoryTrimmer::TrimOnce(bool* trimmed) {
  if (trimmed) *trimmed = false;
  if (!kCanTrim) return 0;
  const size_t rss = ResidentBytes();
  const size_t free_bytes = FreeBytes();
  bool trim;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The floors follow both figures down (memory reused or released), so
    // growth is measured from their lowest since the last trim.
    LowerFloorsLocked(rss, free_bytes);
    trim = free_bytes > threshold_ && (rss > rss_floor_ + threshold_ || free_bytes > free_floor_ + threshold_);
  }
  if (!trim) return free_bytes;
  const auto t0 = std::chrono::steady_clock::now();
  Trim();
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  const size_t after = ResidentBytes();
  // At most one line per interval: no throttle needed.
  spdlog::debug("memory: {} bytes free in malloc's arenas, resident {} -> {} bytes after malloc_trim ({} us)",
                free_bytes, rss, after, us);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++trims_;
    rss_floor_ = after;
    free_floor_ = free_bytes;  // trimming frees nothing in malloc's books
  }
  if (trimmed) *trimmed = true;
  return free_bytes;
}

void MemoryTrimmer::LowerFloorsLocked(size_t rss, size_t free_bytes) {
  if (!floors_set_ || rss < rss_floor_) rss_floor_ = rss;
  if (!floors_set_ || free_bytes < free_floor_) free_floor_ = free_bytes;
  floors_set_ = true;
}

uint64_t MemoryTrimmer::trims() const {
  std::lock_guard<std::mutex> lock(mu_);
  return trims_;
}

}  // namespace cache_dit_opd
