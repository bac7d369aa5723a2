// File: common/intentional_leak.h
//
// IntentionalLeak: gives up ownership of an object that must outlive every
// use the program cannot rule out (the client keeps a session's mapping and
// lane ops for the process's life when a stream may still touch them), and
// tells LeakSanitizer so, when the build has it: the sanitizer suites then
// report only leaks nobody meant.
#pragma once

#include <memory>

#if defined(__SANITIZE_ADDRESS__)
#define CACHE_DIT_OPD_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CACHE_DIT_OPD_LSAN 1
#endif
#endif
#ifdef CACHE_DIT_OPD_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace cache_dit_opd {

template <typename T>
void IntentionalLeak(std::unique_ptr<T>& owner) {
  T* p = owner.release();
#ifdef CACHE_DIT_OPD_LSAN
  if (p != nullptr) __lsan_ignore_object(p);
#else
  (void)p;
#endif
}

}  // namespace cache_dit_opd
