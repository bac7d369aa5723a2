// File: common/futex.h
//
// Linux futex calls on 32-bit words, as client and daemon use them: the call
// ring's doorbell (proto/cache_dit_opd/v1/ring.h) lives in a MAP_SHARED
// mapping and is woken from another process, so those calls are "shared"
// (no FUTEX_PRIVATE_FLAG); a word only this process touches may be private.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>

namespace cache_dit_opd {

struct FutexWord {
  uint32_t* word;
  uint32_t expected;  // sleep only while *word == expected
  bool shared;        // another process may wake it (MAP_SHARED memory)
};

// Sleeps while *word == expected, for at most `timeout`. Returns 0 when woken
// (or spuriously), else -1 with errno (EAGAIN: the word differed; ETIMEDOUT).
long FutexWait(uint32_t* word, uint32_t expected, std::chrono::nanoseconds timeout, bool shared = true);

// Wakes at most `count` waiters of `word`.
void FutexWake(uint32_t* word, int count = 1, bool shared = true);

// FutexWaitAny
//
// Sleeps until any of `words` is woken or no longer holds its expected
// value, for at most `timeout` (futex_waitv, Linux >= 5.16, at most 128
// words). Returns the index of the woken word, or -1 with errno (EAGAIN: a
// word differed at the start; ETIMEDOUT; ENOSYS: no futex_waitv, in which case
// it has slept min(timeout, 1 ms) instead, so a caller polls).
long FutexWaitAny(std::span<const FutexWord> words, std::chrono::nanoseconds timeout);

// futex_waitv's limit on words per call.
inline constexpr size_t kFutexWaitAnyMax = 128;

}  // namespace cache_dit_opd
