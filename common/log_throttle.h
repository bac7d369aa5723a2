// File: common/log_throttle.h
//
// LogThrottle: at most `burst` log lines per `interval` for one kind of event
// a peer can cause at will (a refused bind, a refused OpenSession), so that a
// hostile local client cannot fill the disk through the daemon's log. Events
// past the burst are counted, and the next line that is logged says how many
// were not:
//
//   static LogThrottle refused(10, std::chrono::seconds(10));
//   if (auto v = refused.Next(); v.log) {
//     spdlog::warn("bind refused for pid {}: {}{}", pid, why, SuppressedNote(v.suppressed));
//   }
//
// Thread-safe. Plain C++: the caller logs.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace cache_dit_opd {

class LogThrottle {
 public:
  struct Verdict {
    bool log = false;         // log this event
    uint64_t suppressed = 0;  // events not logged since the last line that was
  };

  LogThrottle(int burst, std::chrono::milliseconds interval) : burst_(burst), interval_(interval) {}

  Verdict Next() {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    if (now - window_start_ >= interval_) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= burst_) {
      ++suppressed_;
      return {};
    }
    ++in_window_;
    Verdict v{true, suppressed_};
    suppressed_ = 0;
    return v;
  }

 private:
  const int burst_;
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point window_start_{};  // guarded by mu_
  int in_window_ = 0;                                    // guarded by mu_
  uint64_t suppressed_ = 0;                              // guarded by mu_
};

// " (N similar events since the last line were not logged)", or "" for 0.
inline std::string SuppressedNote(uint64_t suppressed) {
  return suppressed == 0 ? std::string()
                         : " (" + std::to_string(suppressed) + " similar events since the last line were not logged)";
}

}  // namespace cache_dit_opd
