#include "common/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>
#include <vector>

namespace cache_dit_opd {
namespace {

timespec ToTimespec(std::chrono::nanoseconds d) {
  return timespec{static_cast<time_t>(d.count() / 1000000000), static_cast<long>(d.count() % 1000000000)};
}

}  // namespace

long FutexWait(uint32_t* word, uint32_t expected, std::chrono::nanoseconds timeout, bool shared) {
  timespec ts = ToTimespec(timeout);
  return syscall(SYS_futex, word, shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
}

void FutexWake(uint32_t* word, int count, bool shared) {
  syscall(SYS_futex, word, shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

long FutexWaitAny(std::span<const FutexWord> words, std::chrono::nanoseconds timeout) {
#ifdef SYS_futex_waitv
  if (words.size() <= kFutexWaitAnyMax) {
    std::vector<futex_waitv> v(words.size());
    for (size_t i = 0; i < words.size(); ++i) {
      v[i].val = words[i].expected;
      v[i].uaddr = reinterpret_cast<uintptr_t>(words[i].word);
      v[i].flags = FUTEX_32 | (words[i].shared ? 0 : FUTEX_PRIVATE_FLAG);
      v[i].__reserved = 0;
    }
    // futex_waitv takes an absolute deadline on the given clock.
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    const auto deadline = std::chrono::seconds(now.tv_sec) + std::chrono::nanoseconds(now.tv_nsec) + timeout;
    timespec ts = ToTimespec(deadline);
    long rc = syscall(SYS_futex_waitv, v.data(), static_cast<unsigned>(v.size()), 0, &ts, CLOCK_MONOTONIC);
    if (rc >= 0 || errno != ENOSYS) return rc;
  }
#endif
  // No vectored wait: a short sleep, so the caller polls every word.
  std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(timeout, std::chrono::milliseconds(1)));
  errno = ENOSYS;
  return -1;
}

}  // namespace cache_dit_opd
