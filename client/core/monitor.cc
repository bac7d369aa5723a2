#include "client/core/monitor.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <thread>
#include <vector>

namespace cache_dit_opd::client {

using Clock = std::chrono::steady_clock;

SessionCore::~SessionCore() {
  // The lane table references memory and ops: destroy it first.
  lanes.reset();
  if (leak_) {
    if (ops) ops->Leak();
    if (memory) memory->Leak();
    // Intentionally keep the CUDA registration and the pages.
    ops.release();
    memory.release();
    return;
  }
  ops.reset();
  if (host_registered && memory && api != nullptr) {
    cuda::DeviceGuard guard(device);
    if (guard.status().ok()) api->mem_host_unregister(memory->base());
  }
  memory.reset();
}

void SessionCore::Leak() { leak_ = true; }

namespace {

struct Entry {
  std::shared_ptr<SessionCore> core;
  bool retired = false;
  Clock::time_point retired_at{};
  bool channel_closed = false;  // the daemon's end closed, or we closed ours fully
  Clock::time_point channel_closed_at{};
  bool daemon_exited = false;
  bool released = false;
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

SessionMonitor* SessionMonitor::Get() {
  if (g_monitor_gone.load(std::memory_order_acquire)) return nullptr;
  // Constructed on first use, which is after the CUDA runtime initialized,
  // so it is destroyed before the runtime's own exit handlers run.
  static SessionMonitor monitor;
  return &monitor;
}

SessionMonitor::SessionMonitor() : impl_(new Impl) {
  impl_->wake.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  impl_->thread = std::thread([this] { impl_->Run(); });
}

SessionMonitor::~SessionMonitor() {
  g_monitor_gone.store(true, std::memory_order_release);
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

void SessionMonitor::Watch(const std::shared_ptr<SessionCore>& core) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    Entry e;
    e.core = core;
    impl_->entries.push_back(std::move(e));
  }
  impl_->Wake();
}

void SessionMonitor::Retire(const std::shared_ptr<SessionCore>& core) {
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
  std::vector<pollfd> fds;
  std::vector<std::pair<SessionCore*, bool>> owners;  // (core, is_pidfd) per fds[i >= 1]
  for (;;) {
    bool periodic = false;
    {
      const Clock::time_point t = Clock::now();
      std::lock_guard<std::mutex> lock(mu);
      if (stop) return;
      fds.assign(1, pollfd{wake.get(), POLLIN, 0});
      owners.clear();
      for (const Entry& e : entries) {
        if (!e.channel_closed && e.core->channel.valid()) {
          fds.push_back(pollfd{e.core->channel.get(), POLLIN | POLLRDHUP, 0});
          owners.emplace_back(e.core.get(), false);
        }
        if (!e.daemon_exited && e.core->daemon_pidfd.valid()) {
          fds.push_back(pollfd{e.core->daemon_pidfd.get(), POLLIN, 0});
          owners.emplace_back(e.core.get(), true);
        }
        periodic = periodic || e.retired || (e.channel_closed && !e.released) ||
                   (e.released && t < e.reassert_until);
      }
    }
    int rc = ::poll(fds.data(), fds.size(), periodic ? kTickMs : -1);
    if (rc < 0 && errno != EINTR) rc = 0;
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = ::read(wake.get(), &v, sizeof(v));
    }

    const Clock::time_point now = Clock::now();
    std::vector<std::pair<std::shared_ptr<SessionCore>, Status>> fail, release;
    std::vector<std::shared_ptr<SessionCore>> check_fences;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto find = [&](SessionCore* c) -> Entry* {
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
        SessionCore& c = *e.core;
        if (e.channel_closed && !c.lanes->failed()) {
          fail.emplace_back(e.core, Status::Unavailable(
              "session ", c.session_id, ": the daemon closed the session channel (it exited, "
              "is shutting down, or ended the session); the next call reconnects"));
        }
        if (e.retired && !e.channel_closed && now - e.retired_at >= kCloseGrace) {
          // The daemon did not answer our shutdown; close fully so it sees
          // the session end, and release after the grace below.
          c.channel.reset();
          e.channel_closed = true;
          e.channel_closed_at = now;
        }
        const bool should_release =
            e.daemon_exited || (e.channel_closed && now - e.channel_closed_at >= kReleaseGrace);
        if (should_release && !e.released) {
          e.released = true;
          e.reassert_until = now + kReassertWindow;
          release.emplace_back(e.core, Status::Unavailable(
              "session ", c.session_id, ": ",
              e.daemon_exited ? "the daemon process (pid " + std::to_string(c.daemon_pid) + ") exited"
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
    for (auto& [core, reason] : fail) core->lanes->Fail(reason);
    for (auto& [core, reason] : release) core->lanes->ReleaseFromHost(reason);

    std::vector<std::shared_ptr<SessionCore>> done;
    for (auto& core : check_fences) {
      const int passed = core->ops ? core->ops->FencesPassed() : 1;
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
