// File: server/exec/executor.h
//
// An executor: one thread that owns every CUDA launch of the sessions it
// serves (the daemon's executors: server/exec/executor_pool.h). Transports
// (the gRPC Call handler and the shared-memory call ring, both through
// Daemon::Call) hand it a transport-neutral CallRequest plus a completion
// callback; the same path decodes, validates, dispatches and completes
// every call. A ring record too malformed to decode still names
// its lane and seq: SubmitRejected keeps that seq's "done" in order.
//
// Ordering (docs/DESIGN.md section 1):
//   - Each session lane has its own daemon stream; calls on a lane run in
//     seq order. Submit accepts only seq == previous + 1 (first is 1);
//     anything else is INVALID_ARGUMENT naming the expected and the received
//     seq, completed at once, with no "done" write (done stays monotone).
//   - Launch ahead, bounded: a call whose inputs are not ready yet (the
//     lane's inputs_ready, read on the host, does not pass "inputs_ready >=
//     n" by the GPU's cyclic compare: SessionMemory::Reached) is enqueued at
//     once behind a GPU wait "inputs_ready >= n" on its lane stream, if its
//     lane holds one of `parking_slots` parking slots. It keeps the slot until
//     its stream has completed the parked seq by the daemon's own record
//     (Lane::Completed), whatever the client writes meanwhile; later calls of
//     the lane need no other. Without a slot the call waits in its queue
//     until the host sees its inputs ready, and nothing of it is on the GPU. The bound is what keeps a client from
//     stalling another: a stream wait that never completes holds up nothing
//     else while few are parked, but once parked waits approach
//     CUDA_DEVICE_MAX_CONNECTIONS every stream of the device stalls
//     (measured on the H200: 8 parked with 32 connections block none of 88
//     other streams, 31 block 49 of 65; bench/probes/stream_queues.cu). A
//     call whose inputs the host already sees ready gets no wait.
//   - Ahead, bounded in depth too: a lane has at most `max_calls_ahead`
//     calls on the GPU beyond what its stream has completed (the daemon's
//     own record, never a value the client writes); later ones wait in its
//     queue. A CUDA launch blocks while its stream's command queue is
//     full, and this thread launches for every session: a client that never
//     signals must not be able to fill its lane stream. (On the H200, after
//     a client was killed with 400 calls queued behind its wait, every later
//     OpenSession timed out: a thread blocked in such a launch.)
//   - Releasing a parked wait: when the session ends (closed, its client
//     dead, dropped), DropSession raises its lanes' inputs_ready from the
//     host, on the thread that ends it (the executor's thread may itself be
//     blocked in a launch behind the wait), so its calls run (on that
//     client's own memory) and its lanes drain. A lane whose inputs are
//     behind its parked seq and whose stream has completed nothing for
//     `park_deadline` loses its slot when another lane needs one: its wait is
//     released to the parked seq and `on_stalled` is told (the daemon ends
//     that session with INPUTS_STALLED). A client that keeps a released wait
//     from passing (writing its inputs_ready again) keeps that slot taken:
//     the parked waits stay within the bound, and other lanes wait on the
//     host instead.
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
// One thread for all of its sessions: besides launching, it polls every
// call source added with AddRing (each of its bound sessions' shared-memory
// call ring, server/ring/ring_consumer.h) and submits what it decodes to
// itself, so a ring call reaches its launch without a thread hand-off, and
// the daemon's CPU grows with its load, not with its sessions. The daemon
// runs a small fixed pool of executors (server/exec/executor_pool.h), each
// serving the sessions assigned to it.
//
// Polling: the thread spins for `spin` after its last progress (a wake-up
// of a sleeping thread costs tens of microseconds, more than a call). Then,
// while some queued call waits for inputs_ready on the host or some lane
// holds a parking slot, it sleeps with exponential backoff up to
// `max_backoff` (timer slack 1 us, so a short sleep is short); with nothing
// queued or parked it sleeps up to `idle_sleep`. Either sleep is one
// futex_waitv (common/futex.h) on a private word that submissions, commands
// and Stop bump, and on every ring's doorbell (armed first, so a client that
// publishes wakes it). Idle, the daemon burns no CPU.
//
// Lazy module loading (CUDA_MODULE_LOADING=LAZY, torch's default) loads a
// kernel at its first launch, and that load waits behind a parked stream
// wait (measured: it hangs). The daemon therefore loads modules eagerly
// (server/device/device_probe.h) before any slot can be used.
//
// A sticky CUDA error completes the call with UNAVAILABLE, rejects every
// later one, and calls the fatal hook once (the daemon then fails every
// session and exits non-zero).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/device/device_ops.h"
#include "server/exec/call_runner.h"
#include "server/exec/stats.h"
#include "server/session/session.h"

namespace cache_dit_opd {

// What the executor's thread polls besides its own queue: a session's call
// ring (server/ring/ring_consumer.h is the implementation and its contract).
class CallSource {
 public:
  virtual ~CallSource() = default;
  // Takes what was published and submits it (on the polling thread);
  // returns how many records it took.
  virtual size_t Poll() = 0;
  // About to sleep: true when the thread may sleep on doorbell() expecting
  // `sleeping_value()`; false when there is work. Disarm() after waking.
  virtual bool ArmSleep() = 0;
  virtual void Disarm() = 0;
  virtual uint32_t* doorbell() const = 0;
  virtual uint32_t sleeping_value() const = 0;
  // Nothing more will come from it: the executor lets it go.
  virtual bool finished() const = 0;
};

struct ExecutorOptions {
  // Busy-poll window after progress, with or without queued calls: a call
  // that arrives within it is picked up without a thread wake-up.
  std::chrono::microseconds spin{50};
  std::chrono::microseconds max_backoff{1000};  // longest sleep while calls wait
  std::chrono::milliseconds idle_sleep{100};     // longest idle sleep (bounds a missed wake-up)
  int max_calls_per_lane_turn = 16;             // fairness between lanes
  // Lanes that may have a GPU wait on their client's inputs_ready parked at
  // once (--parking-slots); 0: every call waits for its inputs on the host.
  int parking_slots = 8;
  // Launch ahead only while at most this many lanes have calls queued or on
  // the GPU, counted over every executor sharing `busy_lanes` (the daemon's
  // executors share one: the cost below is the GPU's, whichever thread
  // launched) (--park-busy-lanes; 0: no limit). Past it,
  // every call waits for its inputs on the host: a parked wait is one more
  // stream memory operation per call, and the GPU takes those one at a
  // time, so with many busy lanes it, not the host's latency, is the bound
  // (docs/DESIGN.md section 7, 2026-12-07: 8 processes 103k calls/s
  // host-checked against 88k launched ahead; one process 64k against 83k).
  int park_busy_lanes = 0;
  // The busy lanes of the executors that share it (ExecutorPool gives its
  // executors one); null: the executor counts its own alone.
  std::shared_ptr<std::atomic<int>> busy_lanes;
  // Calls a lane may have on the GPU beyond what its stream has completed
  // (each is a wait, its launches and two writes in the stream's queue).
  int max_calls_ahead = 32;
  // A lane whose inputs are behind its parked seq and whose stream has
  // completed nothing for this long gives up its slot (and its session)
  // when another lane needs one (--park-deadline-ms).
  std::chrono::milliseconds park_deadline{2000};
  // The thread's name (at most 15 characters), as `top -H` shows it.
  std::string thread_name = "opd-executor";
  // Told (on the executor thread) that `session` was released for stalling;
  // the daemon ends it. Must not call back into the executor synchronously.
  std::function<void(const std::shared_ptr<Session>&, const Status&)> on_stalled;
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
  // A call `transport` already rejected (a malformed ring record whose
  // header still names its lane and seq, a gRPC request that does not
  // convert to a call). The same immediate checks as
  // Submit apply; a call that passes them takes its seq, is answered with
  // `reason` at once (on the calling thread) and is queued like any call:
  // at its turn the lane stream writes its "done" in order and nothing runs.
  // A call that fails them is answered with `reason` too (the transport's
  // error names the real defect) and touches no lane.
  void SubmitRejected(const std::shared_ptr<Session>& session, uint32_t lane, uint64_t seq,
                      CallTransport transport, Status reason, Completion done);

  // Executor::DropSession
  //
  // Raises the session's inputs_ready on every lane to the maximum (it will
  // never signal again) on the calling thread, completes every queued call
  // of `session` with `reason`, enqueues one "done" write per lane covering
  // them (in order after the lane's earlier work), then runs `then` on the
  // executor thread. Call it after the session's state is kClosed: from
  // then on the executor launches none of its queued calls (the raised
  // inputs_ready would otherwise let them run on inputs never written).
  void DropSession(const std::shared_ptr<Session>& session, Status reason, std::function<void()> then);

  // Executor::AddRing
  //
  // The executor's thread polls `source` from now on, until it is finished
  // (RingConsumer::RequestStop) or the executor stops; it keeps `source`
  // alive meanwhile.
  void AddRing(std::shared_ptr<CallSource> source);

  // Executor::Fail
  //
  // As after a sticky CUDA error: every later call is rejected with
  // `status`, every queued one completes with it (its "done" is not
  // written: the device is gone), and the fatal hook runs once, on the
  // calling thread. Idempotent; the first status stays.
  void Fail(const Status& status);

  // Calls queued and not yet completed.
  size_t pending() const;
  // Lanes holding a parking slot (as of the executor's last look).
  size_t parked() const { return parked_count_.load(std::memory_order_acquire); }
  bool failed() const;
  // Nanoseconds the thread has spent, since Start, in passes of its loop
  // that did work (took a ring record or a submission, accepted, launched,
  // completed or answered a call, ran a command); not in passes that found
  // nothing (spinning on idle rings) nor asleep. Over a window, its growth
  // divided by the window is how saturated the thread is (1: the executor
  // is the bound).
  uint64_t busy_ns() const { return busy_ns_.load(std::memory_order_relaxed); }

 private:
  // An item's place in its session's `held` count, from Enqueue until the
  // item is destroyed (finished, dropped or refused: every path).
  class HeldCall {
   public:
    HeldCall() = default;
    explicit HeldCall(Session* s) : session_(s) { session_->held.fetch_add(1, std::memory_order_relaxed); }
    HeldCall(HeldCall&& o) noexcept : session_(std::exchange(o.session_, nullptr)) {}
    HeldCall& operator=(HeldCall&& o) noexcept {
      if (this != &o) {
        Reset();
        session_ = std::exchange(o.session_, nullptr);
      }
      return *this;
    }
    ~HeldCall() { Reset(); }

   private:
    void Reset() {
      if (session_ != nullptr) session_->held.fetch_sub(1, std::memory_order_release);
      session_ = nullptr;
    }
    Session* session_ = nullptr;
  };
  struct Item {
    std::shared_ptr<Session> session;
    CallRequest req;
    Completion done;
    std::chrono::steady_clock::time_point received{};
    std::chrono::steady_clock::time_point answered_at{};
    std::shared_ptr<PreparedCall> prepared{};
    // Validation outcome; a rejected call only writes "done". Not OK before
    // Accept only for a call its transport rejected (SubmitRejected).
    Status verdict{};
    bool answered = false;   // `done` has run
    bool recorded = false;   // Record has run
    size_t row = 0;          // the op's row of DaemonStats::per_op
    HeldCall held{};         // set by Enqueue
  };
  // A host-ordered call that ran, answered once its lane stream passed it.
  struct Awaiting {
    std::shared_ptr<Session> session;
    Lane* lane;
    uint64_t seq;
    Completion done;
  };
  // A lane's last accepted calls (op, overload, arguments) and what they were
  // prepared into: a call equal to one of them is prepared again (its regions
  // resolved and bounds-checked) without decoding or Validate
  // (CallRunner::PrepareAgain). A pipeline repeats a few calls per lane.
  struct AcceptedCall {
    std::string op, overload;
    std::vector<Arg> args;
    std::shared_ptr<PreparedCall> prepared;
  };
  struct LaneCalls {
    static constexpr size_t kKept = 4;
    uint64_t session_id = 0;
    std::array<AcceptedCall, kKept> calls{};
    size_t next = 0;  // replaced next, round robin
  };
  struct LaneQueue {
    std::shared_ptr<Session> session;
    Lane* lane = nullptr;
    std::deque<Item> items;
    // items[0, validated) have been through Accept (or came rejected): a
    // prefix, since items are appended at the back, accepted in order and
    // taken from the front. Kept so that
    // a pass over a deep queue costs what its new items cost, not its depth
    // (a client far ahead of its GPU queues many).
    size_t validated = 0;
    void PopFront() {
      items.pop_front();
      if (validated > 0) --validated;
    }
  };
  // A lane holding a parking slot: a GPU wait up to `seq` may be pending
  // until the lane's stream has completed `seq` (Lane::Completed).
  struct Parked {
    std::shared_ptr<Session> session;
    Lane* lane;
    uint64_t seq;                              // highest seq enqueued behind a wait
    uint64_t seen;                             // the client's inputs_ready when last looked at
    uint64_t completed;                        // Lane::Completed() when last looked at
    std::chrono::steady_clock::time_point moved;  // when `completed` last grew (or the slot was taken)
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
  // Polls every ring, letting finished ones go; returns records taken.
  size_t PollRings();
  // Bumps wake_word_ and wakes the thread if it sleeps.
  void Wake();
  // One futex_waitv on wake_word_ and the rings' doorbells, for at most
  // `timeout`, unless news or a record is already there.
  void Sleep(std::chrono::nanoseconds timeout);
  // Whether at most park_busy_lanes lanes are busy in all (this executor's
  // `busy_`, swept of lanes whose stream completed their last seq at most
  // every kBusySweep, plus what the others sharing the count published).
  bool FewBusyLanes();
  // Erases the lanes of busy_ whose stream has completed their last seq.
  void SweepBusy(std::chrono::steady_clock::time_point now);
  // Adds the change in busy_.size() since the last call to the shared count.
  void PublishBusy();
  // Gives `q`'s lane a parking slot for a wait up to `seq` (it may hold one
  // already); false when none is free and none can be taken from a stalled
  // lane.
  bool Park(LaneQueue& q, uint64_t seq);
  // Frees the slots of lanes whose streams completed their parked seq.
  void ReapParked();
  // Raises the parked lanes' inputs_ready (of `session`, or every one for
  // null) and frees their slots.
  void ReleaseParked(const std::shared_ptr<Session>& session);

  DeviceOps* const device_;
  CallRunner* const runner_;
  DaemonStats* const stats_;
  // Once per call, before the answer that ends it (a rejection is counted by
  // the time its client reads it): the session's calls/errors and last call,
  // stats_->Count, and the total latency up to `at`.
  void Record(Item& item, const Status& outcome, std::chrono::steady_clock::time_point at);
  // stats_->Observe for `item`, when there are stats.
  void Observe(const Item& item, CallStage stage, std::chrono::steady_clock::duration d);
  const ExecutorOptions options_;
  const FatalHook on_fatal_;

  mutable std::mutex mu_;
  std::vector<Item> intake_;        // guarded by mu_
  std::vector<std::shared_ptr<CallSource>> ring_intake_;  // guarded by mu_
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
  // The thread's private futex word (bumped by Wake) and whether it sleeps.
  std::atomic<uint32_t> wake_word_{0};
  std::atomic<bool> sleeping_{false};

  std::map<Lane*, LaneQueue> queues_;  // executor thread only
  std::vector<Awaiting> awaiting_;     // executor thread only
  std::map<Lane*, Parked> parked_;     // executor thread only
  // Lanes given calls and the last seq each was given: busy until its
  // stream completes that seq (by the daemon's own record). Executor thread
  // only; erased with their session (Drop).
  struct Busy {
    std::shared_ptr<Session> session;
    uint64_t seq;
  };
  std::map<Lane*, Busy> busy_;
  // When busy_ was last swept: at most every kBusySweep (each look at a
  // lane's completion reads a word the GPU writes, a cache miss).
  static constexpr std::chrono::microseconds kBusySweep{50};
  std::chrono::steady_clock::time_point busy_swept_{};
  int busy_published_ = 0;  // this executor's part of *options_.busy_lanes
  std::map<const Lane*, LaneCalls> accepted_;  // executor thread only; erased with their session (Drop)
  std::vector<std::shared_ptr<CallSource>> rings_;  // executor thread only
  std::atomic<size_t> parked_count_{0};
  std::atomic<uint64_t> busy_ns_{0};  // written by the executor thread only
  std::thread thread_;
};

}  // namespace cache_dit_opd
