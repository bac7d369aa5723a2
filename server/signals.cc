#include "server/signals.h"

#include <signal.h>
#include <time.h>

namespace cache_dit_opd {
namespace {

sigset_t ShutdownSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  return set;
}

}  // namespace

void BlockShutdownSignals() {
  sigset_t set = ShutdownSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

SignalWaiter::~SignalWaiter() { Stop(); }

void SignalWaiter::Start(std::function<void(int)> on_signal) {
  thread_ = std::thread([this, on_signal = std::move(on_signal)] {
    sigset_t set = ShutdownSet();
    // A timeout, so Stop() needs no signal of its own to end the thread.
    const timespec timeout{0, 200 * 1000 * 1000};
    while (!stop_.load()) {
      int sig = sigtimedwait(&set, nullptr, &timeout);
      if (sig > 0) on_signal(sig);
    }
  });
}

void SignalWaiter::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

}  // namespace cache_dit_opd
