#include "server/session/reaper.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "common/log_throttle.h"

namespace cache_dit_opd {

Reaper::Reaper(std::chrono::milliseconds poll) : poll_(poll) {}

Reaper::~Reaper() { Stop(); }

void Reaper::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) return;
  started_ = true;
  thread_ = std::thread([this] { Loop(); });
}

void Reaper::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Whatever did not drain in time stays mapped; the process exit unmaps it.
  Abandon();
}

bool Reaper::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return false;
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

void Reaper::Retire(std::shared_ptr<Session> session, std::function<void()> on_done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    retiring_.push_back(Retiring{std::move(session), std::move(on_done)});
  }
  cv_.notify_one();
}

void Reaper::Watch(std::shared_ptr<Session> session) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Once per session: a client unregistering in a loop must not grow the
    // list (nor the sweeps that walk it).
    const bool watched = std::any_of(watched_.begin(), watched_.end(), [&](const std::weak_ptr<Session>& w) {
      return !w.owner_before(session) && !session.owner_before(w);
    });
    if (!watched) watched_.push_back(session);
  }
  cv_.notify_one();
}

bool Reaper::WaitRetired(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return retired_cv_.wait_until(lock, deadline, [&] { return retiring_.empty(); });
}

void Reaper::Abandon() {
  std::vector<Retiring> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(retiring_);
    for (auto& r : left) {
      spdlog::warn("session {}: lanes still busy on the GPU; leaving its mappings to process exit",
                   r.session->id());
      r.session->Abandon();
      abandoned_.push_back(r.session);
    }
    watched_.clear();
    retired_cv_.notify_all();
  }
  for (auto& r : left) {
    if (r.on_done) r.on_done();
  }
}

size_t Reaper::retiring() const {
  std::lock_guard<std::mutex> lock(mu_);
  return retiring_.size();
}

size_t Reaper::watched() const {
  std::lock_guard<std::mutex> lock(mu_);
  return watched_.size();
}

void Reaper::Sweep() {
  std::vector<Retiring> ready;
  std::vector<std::shared_ptr<Session>> watched;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto mid = std::partition(retiring_.begin(), retiring_.end(),
                              [](const Retiring& r) { return !r.session->Drained(); });
    ready.assign(std::make_move_iterator(mid), std::make_move_iterator(retiring_.end()));
    retiring_.erase(mid, retiring_.end());
    for (auto& w : watched_) {
      if (auto s = w.lock()) watched.push_back(std::move(s));
    }
  }
  for (auto& r : ready) {
    Session& s = *r.session;
    RegionCounts before = s.regions().counts();
    s.ReleaseDeviceResources();
    // A client can open and close sessions in a loop: bounded lines per interval.
    static LogThrottle closed(50, std::chrono::seconds(10));
    if (const auto v = closed.Next(); v.log) {
      spdlog::info("session {}: closed (pid {}, uid {}); unmapped {} region(s), {} bytes{}", s.id(),
                   s.peer().pid ? s.peer().pid : s.client_pid(), s.peer().uid,
                   before.regions + before.pending_unmaps, before.mapped_bytes, SuppressedNote(v.suppressed));
    }
    if (r.on_done) r.on_done();
  }
  // Sessions whose deferred releases all completed (or that ended) stop
  // being watched.
  std::vector<Session*> finished;
  for (auto& s : watched) {
    if (s->state() == SessionState::kClosed || s->regions().ReleaseCompleted() == 0) {
      finished.push_back(s.get());
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(watched_, [&](const std::weak_ptr<Session>& w) {
      auto s = w.lock();
      if (!s) return true;
      bool done = std::find(finished.begin(), finished.end(), s.get()) != finished.end();
      // A region unregistered during the sweep keeps its session watched.
      return done && (s->state() == SessionState::kClosed || !s->regions().has_pending());
    });
    if (retiring_.empty()) retired_cv_.notify_all();
  }
}

void Reaper::Loop() {
  while (true) {
    std::deque<std::function<void()>> tasks;
    bool stopping;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto busy = [&] { return !retiring_.empty() || !watched_.empty(); };
      if (tasks_.empty() && !stop_) {
        if (busy()) {
          cv_.wait_for(lock, poll_, [&] { return stop_ || !tasks_.empty(); });
        } else {
          cv_.wait(lock, [&] { return stop_ || !tasks_.empty() || busy(); });
        }
      }
      tasks.swap(tasks_);
      stopping = stop_;
    }
    for (auto& t : tasks) t();
    Sweep();
    if (stopping) {
      std::lock_guard<std::mutex> lock(mu_);
      if (tasks_.empty()) return;
    }
  }
}

}  // namespace cache_dit_opd
