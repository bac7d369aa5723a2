// File: server/memory_trim.h
//
// MemoryTrimmer: hands memory the daemon has freed back to the kernel, on a
// slow timer, so that a burst of large or hostile requests does not leave
// the daemon at its peak RSS for the rest of its life.
//
// Why: glibc keeps freed memory in its arenas (one per allocating thread,
// up to 8 per core) and returns on its own only what lies at the top of a
// heap. gRPC receives a message in many slices and protobuf parses it into
// many small objects, spread over the arenas of gRPC's threads, so what a
// refused request allocated stays resident after it is freed. Measured on
// the fake daemon before the gRPC memory quota (server/grpc/grpc_server.h)
// bounded such bursts: two concurrent 200 MiB requests left RSS +196 MiB
// over the baseline, three 4 MiB requests of empty Arguments +236 MiB, and
// malloc_trim(0) brought them back to +3 MiB and +28 MiB.
//
// Every `interval` the trimmer's own thread calls malloc_trim(0), which
// gives every whole free page back (MADV_DONTNEED), top of heap or not, when
// the arenas hold more than `threshold` bytes free (mallinfo2().fordblks,
// all arenas) and, since the last trim (or Start), either
//   - the resident set has grown by more than `threshold` over the lowest
//     it was seen at (memory taken, or reused, and freed since), or
//   - the free bytes have grown by more than `threshold` over the lowest
//     they were seen at (memory that was live at the last trim, freed
//     since: a trim during a burst must not hide the burst's memory).
// Trimmed pages stay on malloc's free lists, so free bytes alone would
// have every round walk (and madvise) the same released pages again.
// malloc_trim locks one arena at a time while it walks it, so a thread
// allocating from that arena waits that long: measured (glibc 2.36, 2 cores)
// 27 ms to release 197 MiB held free in 4 KiB blocks, 5 ms for 31 MiB,
// under 1 ms when the pages are already released. That is once per growth
// of `threshold`, at most once per interval; a round that does not trim
// costs a read of /proc/self/statm and mallinfo2's walk (1-250 us).
// Without glibc (>= 2.33) it does nothing.
//
//   MemoryTrimmer trimmer;            // 10 s, 16 MiB
//   trimmer.Start();
//   ...
//   trimmer.Stop();                   // joins; also on destruction
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>

namespace cache_dit_opd {

class MemoryTrimmer {
 public:
  explicit MemoryTrimmer(std::chrono::milliseconds interval = std::chrono::seconds(10),
                         size_t threshold = size_t{16} << 20)
      : interval_(interval), threshold_(threshold) {}
  ~MemoryTrimmer() { Stop(); }
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

  void Start();
  void Stop();

  // One round now (on the caller's thread), by the rule above. Returns the
  // free bytes it saw before trimming; sets `*trimmed` to whether it trimmed.
  size_t TrimOnce(bool* trimmed = nullptr);

  // Rounds that trimmed, since construction.
  uint64_t trims() const;

 private:
  void LowerFloorsLocked(size_t rss, size_t free_bytes);

  const std::chrono::milliseconds interval_;
  const size_t threshold_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;     // guarded by mu_
  uint64_t trims_ = 0;    // guarded by mu_
  size_t rss_floor_ = 0;   // guarded by mu_: the lowest RSS seen since the last trim
  size_t free_floor_ = 0;  // guarded by mu_: the fewest free bytes seen since the last trim
  bool floors_set_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace cache_dit_opd
