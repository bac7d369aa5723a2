#include "client/core/monitor.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <mutex>
#include <thread>
#include <vector>

#include "client/core/session_engine.h"
#include "common/intentional_leak.h"

namespace cache_dit_opd::client {

using Clock = std::chrono::steady_clock;

namespace {

struct Entry {
  std::shared_ptr<SessionEngine> core;
  bool retired = false;
  Clock::time_point retired_at{};
  bool channel_closed = false;  // the daemon's end closed, or we closed ours fully
  Clock::time_point channel_closed_at{};
  bool daemon_exited = false;
  bool released = false;
  bool hung = false;  // failed for a stopped heartbeat: our side of the channel is shut down
  Clock::time_point reassert_until{};
};

}  // namespace

struct SessionMonitor::Impl {
  std::mutex mu;
  std::vector<Entry> entries;  // guarded by mu
  bool stop = false;           // guarded by mu
  UniqueFd wake;
  std::thread thread;

  void Wake() {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake.get(), &one, sizeof(one));
  }
  void Run();
};

namespace {
// Trivially destructible, so still readable while static objects are torn
// down after the monitor.
std::atomic<bool> g_monitor_gone{false};
}  // namespace

// The process that started the monitor's thread (0: not started).
std::atomic<pid_t> g_monitor_pid{0};

SessionMonitor* SessionMonitor::Get() {
  if (g_monitor_gone.load(std::memory_order_acquire)) return nullptr;
  // Constructed on first use, which is after the CUDA runtime initialized,
  // so it is destroyed before the runtime's own exit handlers run.
  static SessionMonitor monitor;
  if (g_monitor_pid.load(std::memory_order_acquire) != ::getpid()) return nullptr;  // a forked child
  return &monitor;
}

SessionMonitor::SessionMonitor() : impl_(new Impl) {
  impl_->wake.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  impl_->thread = std::thread([this] { impl_->Run(); });
  g_monitor_pid.store(::getpid(), std::memory_order_release);
}

SessionMonitor::~SessionMonitor() {
  g_monitor_gone.store(true, std::memory_order_release);
  if (g_monitor_pid.load(std::memory_order_acquire) != ::getpid()) {
    // A child forked after the thread started, exiting: that thread is not
    // here to join (joining would wait forever), and its lock may be held.
    // What the parent's copy owns is the parent's to release.
    IntentionalLeak(impl_);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->Wake();
  impl_->thread.join();
  // Process exit: streams may still reference these, and the runtime is
  // about to shut down. Keep them mapped; the kernel reclaims everything.
  for (Entry& e : impl_->entries) e.core->Leak();
  impl_->entries.clear();
}

void SessionMonitor::Watch(const std::shared_ptr<SessionEngine>& core) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    Entry e;
    e.core = core;
    impl_->entries.push_back(std::move(e));
  }
  impl_->Wake();
}

void SessionMonitor::Retire(const std::shared_ptr<SessionEngine>& core) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    for (Entry& e : impl_->entries) {
      if (e.core == core) {
        e.retired = true;
        e.retired_at = Clock::now();
      }
    }
  }
  impl_->Wake();
}

size_t SessionMonitor::retired_count() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  size_t n = 0;
  for (const Entry& e : impl_->entries) n += e.retired ? 1 : 0;
  return n;
}

void SessionMonitor::Impl::Run() {
  constexpr int kTickMs = 50;
  constexpr int kIdleHeartbeatMs = 1000;
  std::vector<pollfd> fds;
  std::vector<std::pair<SessionEngine*, bool>> owners;  // (engine, is_pidfd) per fds[i >= 1]
  for (;;) {
    int timeout_ms = -1;  // poll's: -1 sleeps until a descriptor or Wake()
    auto tick_within = [&timeout_ms](int ms) { timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms); };
    {
      const Clock::time_point t = Clock::now();
      std::lock_guard<std::mutex> lock(mu);
      if (stop) return;
      fds.assign(1, pollfd{wake.get(), POLLIN, 0});
      owners.clear();
      for (const Entry& e : entries) {
        if (!e.channel_closed && e.core->channel_.valid()) {
          fds.push_back(pollfd{e.core->channel_.get(), POLLIN | POLLRDHUP, 0});
          owners.emplace_back(e.core.get(), false);
        }
        if (!e.daemon_exited && e.core->daemon_pidfd_.valid()) {
          fds.push_back(pollfd{e.core->daemon_pidfd_.get(), POLLIN, 0});
          owners.emplace_back(e.core.get(), true);
        }
        if (e.retired || (e.channel_closed && !e.released) || (e.released && t < e.reassert_until)) {
          tick_within(kTickMs);
        }
        // The heartbeat of a live session: read every tick while calls are
        // outstanding (a stop then fails the session), and a few times per
        // timeout while idle, so that it is known to advance before a call
        // starts waiting (nothing wakes this thread when one does: the hot
        // path makes no system call for the monitor).
        const auto heartbeat = e.core->options_.heartbeat_timeout;
        if (!e.channel_closed && !e.hung && heartbeat.count() > 0) {
          const auto quarter = std::chrono::duration_cast<std::chrono::milliseconds>(heartbeat / 4).count();
          tick_within(e.core->LanesBehind() ? kTickMs
                                            : static_cast<int>(std::clamp<int64_t>(quarter, kTickMs, kIdleHeartbeatMs)));
        }
      }
    }
    int rc = ::poll(fds.data(), fds.size(), timeout_ms);
    if (rc < 0 && errno != EINTR) rc = 0;
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = ::read(wake.get(), &v, sizeof(v));
    }

    const Clock::time_point now = Clock::now();
    std::vector<std::pair<std::shared_ptr<SessionEngine>, Status>> fail, release;
    std::vector<std::shared_ptr<SessionEngine>> check_fences, hung;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto find = [&](SessionEngine* c) -> Entry* {
        for (Entry& e : entries) {
          if (e.core.get() == c) return &e;
        }
        return nullptr;
      };
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        Entry* e = find(owners[i - 1].first);
        if (e == nullptr) continue;
        if (owners[i - 1].second) {
          e->daemon_exited = true;
          continue;
        }
        bool closed = (fds[i].revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)) != 0;
        if (!closed && (fds[i].revents & POLLIN)) {
          // The daemon sends nothing after the bind reply; a read of 0 is
          // its end closing. Anything else is discarded.
          char buf[512];
          ssize_t n = ::recv(fds[i].fd, buf, sizeof(buf), MSG_DONTWAIT);
          closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
        }
        if (closed && !e->channel_closed) {
          e->channel_closed = true;
          e->channel_closed_at = now;
        }
      }
      for (Entry& e : entries) {
        SessionEngine& c = *e.core;
        if (e.channel_closed && !c.failed()) {
          fail.emplace_back(e.core, Status::Rejected(Reason::kClosed,
              "session ", c.session_id(), ": the daemon closed the session channel (it exited, "
              "is shutting down, or ended the session); the next call reconnects"));
        }
        if (!e.channel_closed && !e.hung && !c.failed()) {
          if (Status lost = c.HeartbeatLost(); !lost.ok()) {
            e.hung = true;
            e.retired_at = now;  // the close grace below runs from here
            fail.emplace_back(e.core, lost);
            hung.push_back(e.core);
          }
        }
        if ((e.retired || e.hung) && !e.channel_closed && now - e.retired_at >= kCloseGrace) {
          // The daemon did not answer our shutdown; close fully so it sees
          // the session end, and release after the grace below.
          c.channel_.reset();
          e.channel_closed = true;
          e.channel_closed_at = now;
        }
        const bool should_release =
            e.daemon_exited || (e.channel_closed && now - e.channel_closed_at >= kReleaseGrace);
        if (should_release && !e.released) {
          e.released = true;
          e.reassert_until = now + kReassertWindow;
          release.emplace_back(e.core, Status::Rejected(Reason::kClosed,
              "session ", c.session_id(), ": ",
              e.daemon_exited ? "the daemon process (pid " + std::to_string(c.daemon_pid()) + ") exited"
                              : std::string("the daemon closed the session channel"),
              "; this client's pending waits were released from the host and calls in flight "
              "failed; the next call reconnects"));
        } else if (e.released && now < e.reassert_until) {
          release.emplace_back(e.core, Status());
        }
        if (e.retired && !(e.released && now < e.reassert_until)) check_fences.push_back(e.core);
      }
    }

    // Outside the monitor lock: these take lane mutexes that calls in flight
    // hold across their RPC.
    for (auto& [core, reason] : fail) core->Fail(reason);
    // A hung daemon: end the session from our side, as a close would.
    for (auto& core : hung) ::shutdown(core->channel_.get(), SHUT_WR);
    for (auto& [core, reason] : release) core->ReleaseFromHost(reason);

    std::vector<std::shared_ptr<SessionEngine>> done;
    for (auto& core : check_fences) {
      const int passed = core->FencesPassed();
      if (passed == 1) {
        done.push_back(core);
      } else if (passed < 0) {
        core->Leak();  // a broken context proves nothing; never unmap under a stream
        done.push_back(core);
      }
    }
    if (!done.empty()) {
      std::lock_guard<std::mutex> lock(mu);
      for (auto& core : done) {
        for (size_t i = 0; i < entries.size(); ++i) {
          if (entries[i].core == core) {
            entries.erase(entries.begin() + static_cast<std::ptrdiff_t>(i));
            break;
          }
        }
      }
    }
    // The last references drop here, on this thread, outside the lock:
    // unregistering host memory may take a while.
    done.clear();
  }
}

}  // namespace cache_dit_opd::client
