// File: server/session/reaper.h
//
// The daemon's slow-path thread: everything that may synchronize the device
// or take milliseconds, kept off the executor and off gRPC threads.
//   - Post(task): runs tasks in order (RegisterRegion's cudaIpcOpenMemHandle
//     and evictions' cudaIpcCloseMemHandle).
//   - Retire(session): a session that ended; once every lane's daemon-private
//     "done" has reached what the executor enqueued, closes its regions,
//     destroys its streams and unregisters its shared memory.
//   - Watch(session): a session with deferred unregistrations; releases each
//     region once its lanes have passed its last use.
// Polls every `poll` while something is waiting; sleeps otherwise.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/status.h"
#include "server/session/session.h"

namespace cache_dit_opd {

class Reaper {
 public:
  explicit Reaper(std::chrono::milliseconds poll = std::chrono::milliseconds(2));
  ~Reaper();
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;

  void Start();
  // Runs the remaining tasks, releases drained sessions, abandons (never
  // touches the device for) the rest, joins.
  void Stop();

  // Runs `task` on the reaper thread; false (task dropped) once stopped.
  bool Post(std::function<void()> task);
  // `on_done` (optional) runs on the reaper thread once the session is
  // released or abandoned.
  void Retire(std::shared_ptr<Session> session, std::function<void()> on_done = nullptr);
  void Watch(std::shared_ptr<Session> session);

  // Waits until no session is retiring, or `deadline`; true when none is.
  bool WaitRetired(std::chrono::steady_clock::time_point deadline);
  // After a sticky CUDA error or a missed drain deadline: forget retiring
  // sessions without touching the device (the process is about to exit).
  void Abandon();

  size_t retiring() const;
  // Sessions watched now (each once, however often Watch was called).
  size_t watched() const;

 private:
  void Loop();
  // One pass over retiring and watched sessions.
  void Sweep();

  const std::chrono::milliseconds poll_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable retired_cv_;
  std::deque<std::function<void()>> tasks_;              // guarded by mu_
  struct Retiring {
    std::shared_ptr<Session> session;
    std::function<void()> on_done;
  };
  std::vector<Retiring> retiring_;                       // guarded by mu_
  std::vector<std::weak_ptr<Session>> watched_;          // guarded by mu_
  std::vector<std::shared_ptr<Session>> abandoned_;      // guarded by mu_; kept alive, never released
  bool stop_ = false;                                    // guarded by mu_
  bool started_ = false;                                 // guarded by mu_
  std::thread thread_;
};

}  // namespace cache_dit_opd
