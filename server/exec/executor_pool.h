// File: server/exec/executor_pool.h
//
// The daemon's executors: a small fixed pool of Executor threads
// (server/exec/executor.h), each serving the sessions assigned to it, so the
// host work of many busy clients (decode, checks, launch, about 15 us a call
// on the H200 host) is spread over `threads` cores instead of one, while a
// session's calls keep the single-thread ordering and polling of an
// Executor. Its interface is the Executor's, routed by session.
//
// Assignment: a session's executor is picked at its first Submit,
// SubmitRejected, AddRing or DropSession (whichever comes first; all four
// agree, by a compare-and-swap on Session::executor_shard), as the one
// serving the fewest live sessions, and never changes: its lanes, its ring
// and its end are on that one thread. A session stops counting as live when
// it is dropped.
//
// Isolation: the `parking_slots` of ExecutorOptions are the device's bound
// (server/exec/executor.h: what the hardware queues isolate), so they are
// split between the executors (the first `slots % threads` get one more)
// and their sum keeps the bound; an executor with none checks its calls'
// inputs on the host. A stalled lane can take only a slot of its own
// executor.
//
// Failure: a sticky CUDA error on any executor fails every executor (the
// context is shared) and calls the fatal hook once.
//
// With `threads` = 1 the pool is exactly one Executor.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/device/device_ops.h"
#include "server/exec/call_runner.h"
#include "server/exec/executor.h"
#include "server/exec/stats.h"
#include "server/session/session.h"

namespace cache_dit_opd {

class ExecutorPool {
 public:
  static constexpr int kMaxThreads = 16;

  // `threads` in [1, kMaxThreads]; the executors' threads are named
  // "<options.thread_name>-<i>" (the name alone when there is one).
  ExecutorPool(DeviceOps* device, CallRunner* runner, DaemonStats* stats, ExecutorOptions options, int threads,
               Executor::FatalHook on_fatal);
  ExecutorPool(const ExecutorPool&) = delete;
  ExecutorPool& operator=(const ExecutorPool&) = delete;

  void Start();
  // Executor::Stop on each.
  void Stop();

  // As Executor's, on `session`'s executor.
  void Submit(const std::shared_ptr<Session>& session, CallRequest req, Executor::Completion done);
  void SubmitRejected(const std::shared_ptr<Session>& session, uint32_t lane, uint64_t seq,
                      CallTransport transport, Status reason, Executor::Completion done);
  void DropSession(const std::shared_ptr<Session>& session, Status reason, std::function<void()> then);
  // `source` is `session`'s call ring.
  void AddRing(const std::shared_ptr<Session>& session, std::shared_ptr<CallSource> source);

  // Sums and "any" over the executors.
  size_t pending() const;
  size_t parked() const;
  bool failed() const;
  // Executor::busy_ns of each executor, by index.
  std::vector<uint64_t> busy_ns() const;

  int threads() const { return static_cast<int>(executors_.size()); }
  // The executor serving `session` (assigning one if it has none yet).
  int ExecutorOf(Session& session);
  // The executor serving `session`, or -1 when none is assigned yet.
  static int Assigned(const Session& session);
  // The parking slots of executor `i`.
  int parking_slots(int i) const { return slots_[i]; }

 private:
  void OnFatal(const Status& status);

  std::vector<std::unique_ptr<Executor>> executors_;
  std::vector<int> slots_;
  std::unique_ptr<std::atomic<int>[]> live_;  // live sessions assigned to each executor
  std::atomic<bool> fatal_{false};
  const Executor::FatalHook on_fatal_;
};

}  // namespace cache_dit_opd
