// File: server/signals.h
//
// SIGTERM/SIGINT handling without a signal handler: the signals are blocked
// in every thread (BlockShutdownSignals runs in main before any thread
// exists, so all threads inherit the mask) and one dedicated thread takes
// them with sigtimedwait and calls an ordinary function. Nothing runs in
// signal context, so the callback may lock, log and notify freely.
#pragma once

#include <atomic>
#include <functional>
#include <thread>

namespace cache_dit_opd {

// Blocks SIGTERM, SIGINT and SIGHUP in the calling thread and ignores
// SIGPIPE (a peer closing a socket must not kill the daemon).
void BlockShutdownSignals();

class SignalWaiter {
 public:
  SignalWaiter() = default;
  ~SignalWaiter();
  // `on_signal(signo)` runs on the waiter thread for each signal taken.
  void Start(std::function<void(int)> on_signal);
  void Stop();

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace cache_dit_opd
