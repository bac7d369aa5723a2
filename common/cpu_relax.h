// File: common/cpu_relax.h
//
// CpuRelax(): one step of a spin-wait (the daemon's ring consumers and
// executor, the client's ring producer): the pause instruction on x86, which
// eases the sibling hyper-thread and the memory order pipeline, a yield
// elsewhere. Plain C++.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#else
#include <thread>
#endif

namespace cache_dit_opd {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace cache_dit_opd
