// File: server/exec/executor.h
//
// The per-device executor: one thread that owns every CUDA launch of the
// daemon. Transports (the gRPC Call handler and the shared-memory call ring,
// both through Daemon::Call) hand it a transport-neutral CallRequest plus a
// completion callback; the same path decodes, validates, dispatches and
// completes every call. A ring record too malformed to decode still names
// its lane and seq: SubmitRejected keeps that seq's "done" in order.
//
// Ordering (docs/DESIGN.md section 1):
//   - Each session lane has its own daemon stream; calls on a lane run in
//     seq order. Submit accepts only seq == previous + 1 (first is 1);
//     anything else is INVALID_ARGUMENT naming the expected and the received
//     seq, completed at once, with no "done" write (done stays monotone).
//   - No client can stall another: before enqueueing call n the executor
//     checks on the HOST that the lane's inputs_ready >= n. No GPU wait on a
//     client-controlled value is ever placed in the daemon's streams. A lane
//     whose inputs never become ready holds back only its own later calls.
//   - After the kernel (or, for a call rejected by validation, in its place)
//     the lane stream writes done = n, then the daemon-private copy (see
//     server/session/session.h), so "done" reaches every seq in order, and a client
//     waiting on it is never left hanging.
//   - Nothing here synchronizes the device; unmapping happens on the reaper.
//
// Acceptance: a call is answered as soon as it is validated (decoded,
// bounds-checked, and the op's own checks run on its Meta kernel), before
// its inputs are ready and before it runs. Waiting for "inputs ready" before
// replying would make every client call a host synchronization on its own
// stream (the client could never queue work ahead of the GPU, and a call
// whose inputs depend on work its own thread enqueues later would deadlock).
// The lane still writes "done" for every accepted or rejected seq in order.
// A failure after acceptance can only be a CUDA error: it is logged and
// counted; a sticky one fails every session through the fatal hook.
//
// Polling: the thread spins for `spin` after its last progress (a wake-up
// of a sleeping thread costs tens of microseconds, more than a call). Then,
// while some queued call waits for inputs_ready, it sleeps with exponential
// backoff up to `max_backoff` (timer slack 1 us, so a short sleep is
// short); with nothing queued it sleeps on a condition variable (no CPU
// burn when idle). New submissions wake it at once.
//
// A sticky CUDA error completes the call with UNAVAILABLE, rejects every
// later one, and calls the fatal hook once (the daemon then fails every
// session and exits non-zero).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/device/device_ops.h"
#include "server/exec/call_runner.h"
#include "server/exec/stats.h"
#include "server/session/session.h"

namespace cache_dit_opd {

struct ExecutorOptions {
  // Busy-poll window after progress, with or without queued calls: a call
  // that arrives within it is picked up without a thread wake-up.
  std::chrono::microseconds spin{50};
  std::chrono::microseconds max_backoff{1000};  // longest sleep while calls wait
  int max_calls_per_lane_turn = 16;             // fairness between lanes
};

class Executor {
 public:
  // Runs exactly once per call with its acceptance status (OK once the call
  // is validated and queued to run, else the rejection), on the executor
  // thread (or, for rejections at submission, on the submitting thread).
  using Completion = std::function<void(const Status&)>;
  using FatalHook = std::function<void(const Status&)>;

  Executor(DeviceOps* device, CallRunner* runner, DaemonStats* stats, ExecutorOptions options,
           FatalHook on_fatal);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void Start();
  // Completes every queued call with UNAVAILABLE (writing their "done" in
  // order), runs pending DropSession continuations, joins the thread.
  void Stop();

  // Executor::Submit
  //
  // Queues `req` on `session`'s lane req.lane. Immediate rejections:
  // INVALID_ARGUMENT (lane out of range, seq 0, seq != previous + 1),
  // FAILED_PRECONDITION (session not bound or ended), UNAVAILABLE (stopping
  // or after a sticky CUDA error).
  void Submit(const std::shared_ptr<Session>& session, CallRequest req, Completion done);

  // Executor::SubmitRejected
  //
  // A call the transport already rejected (a malformed ring record whose
  // header still names its lane and seq). The same immediate checks as
  // Submit apply; a call that passes them takes its seq, is answered with
  // `reason` at once (on the calling thread) and is queued like any call:
  // at its turn the lane stream writes its "done" in order and nothing runs.
  // A call that fails them is answered with `reason` too (the transport's
  // error names the real defect) and touches no lane.
  void SubmitRejected(const std::shared_ptr<Session>& session, uint32_t lane, uint64_t seq, Status reason,
                      Completion done);

  // Executor::DropSession
  //
  // Completes every queued call of `session` with `reason`, enqueues one
  // "done" write per lane covering them (in order after the lane's earlier
  // work), then runs `then` on the executor thread.
  void DropSession(const std::shared_ptr<Session>& session, Status reason, std::function<void()> then);

  // Drops every queued call of every session (drain deadline).
  void DropAll(Status reason);

  // Calls queued and not yet completed.
  size_t pending() const;
  bool failed() const;

 private:
  struct Item {
    std::shared_ptr<Session> session;
    CallRequest req;
    Completion done;
    std::chrono::steady_clock::time_point received;
    std::chrono::steady_clock::time_point answered_at;
    std::unique_ptr<PreparedCall> prepared;
    Status verdict;        // validation outcome; a rejected call only writes "done"
    bool validated = false;  // Accept has run
    bool answered = false;   // `done` has run
  };
  // A host-ordered call that ran, answered once its lane stream passed it.
  struct Awaiting {
    std::shared_ptr<Session> session;
    Lane* lane;
    uint64_t seq;
    Completion done;
  };
  struct LaneQueue {
    std::shared_ptr<Session> session;
    Lane* lane = nullptr;
    std::deque<Item> items;
  };
  struct Command {
    std::shared_ptr<Session> session;  // null: every session
    Status reason;
    std::function<void()> then;
  };

  // The immediate checks shared by Submit and SubmitRejected; on success
  // takes the lane's next seq and moves `item` into the intake.
  Status Enqueue(const std::shared_ptr<Session>& session, Item& item);
  void Loop();
  // Prepares and validates `item`, records the verdict and answers it.
  void Accept(LaneQueue& q, Item& item);
  // Runs what is ready; returns whether anything completed.
  bool RunReady();
  // Writes done = item's seq on the lane stream and completes the item.
  void Finish(LaneQueue& q, Item& item, Status status);
  void Drop(const std::shared_ptr<Session>& session, const Status& reason);
  // Answers the host-ordered calls whose lane has completed them; returns
  // whether any was answered.
  bool Answer();
  // Answers `session`'s (every session's, for null) waiting host-ordered
  // calls with `reason`.
  void DropAwaiting(const std::shared_ptr<Session>& session, const Status& reason);
  void Fail(const Status& status);

  DeviceOps* const device_;
  CallRunner* const runner_;
  DaemonStats* const stats_;
  const ExecutorOptions options_;
  const FatalHook on_fatal_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> intake_;        // guarded by mu_
  std::vector<Command> commands_;   // guarded by mu_
  bool stop_ = false;               // guarded by mu_
  bool started_ = false;            // guarded by mu_
  bool exited_ = false;             // guarded by mu_: the thread has returned
  bool fatal_ = false;              // guarded by mu_
  Status fatal_status_;             // guarded by mu_
  size_t pending_ = 0;              // guarded by mu_: intake + queued
  // Set with intake_/commands_/stop_ (under mu_): lets the spinning thread
  // look for news without taking the lock.
  std::atomic<bool> news_{false};

  std::map<Lane*, LaneQueue> queues_;  // executor thread only
  std::vector<Awaiting> awaiting_;     // executor thread only
  std::thread thread_;
};

}  // namespace cache_dit_opd
