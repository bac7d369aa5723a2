// File: server/ring/ring_consumer.h
//
// The daemon's side of one session's shared-memory call ring
// (proto/cache_dit_opd/v1/ring.h). Passive: whoever serves it calls Poll()
// (in the daemon, the thread of the session's executor, which polls every
// ring it serves: server/exec/executor.h); Start() gives it a thread of its
// own instead (the consumer's own tests).
//
// Poll():
//   1. load-acquire sq_tail; a tail behind the consumer's PRIVATE head, or
//      more than `capacity` ahead of it, takes nothing; seen so by every
//      poll for kOddTailGrace (a tail stored byte by byte can be read
//      mid-store, and its thread preempted there), it is a protocol
//      violation: the violation hook runs once (the daemon ends that
//      session) and the consumer is finished. No poll waits for it to
//      settle (one thread polls many rings), and such a tail is no work to
//      stay awake for (ArmSleep). The shared sq_head and the RingControl
//      fields are never read.
//   2. for each ticket t in [head, tail): copy slot t % capacity (kSlotBytes,
//      the mask is the daemon's own capacity) into private memory ONCE,
//      store-release sq_head = t + 1, decode only the copy
//      (common/ring_decode.h) and hand it to the sink exactly as the gRPC
//      Call is handed over (Daemon::Call), or, when the record is malformed
//      but its header names a lane and seq, to the sink's pre-rejected path
//      (Executor::SubmitRejected: the seq still completes in order). A record
//      whose header is unusable (bad magic, or a ticket that is not t) is
//      answered INVALID_ARGUMENT without touching any lane.
//   3. the completion for t (the executor's answer: accepted or the
//      rejection) is written into completion slot t % capacity: ticket, seq,
//      lane, status code, message (truncated to 223 bytes on a UTF-8
//      boundary, NUL-terminated), then store-release done_ticket = t + 1.
//      Completions may be written after the session ended (calls dropped by
//      the executor): each holds the session, so its memory stays mapped.
//
// Waking: a server with nothing to do calls ArmSleep() (store doorbell =
// kDoorbellSleeping, seq_cst, then re-read sq_tail, seq_cst: false when a
// record is there), then sleeps on doorbell() (a shared futex: the word lives
// in a MAP_SHARED memfd mapping, so no FUTEX_PRIVATE_FLAG) with any other
// words it serves, and calls Disarm() (kDoorbellAwake) on waking. The client
// wakes a sleeping doorbell after publishing. Its own thread (Start) spins on
// sq_tail for `spin` after the last record, then sleeps so for at most
// `sleep_timeout`; an idle ring costs ~10 wake-ups a second.
//
// Back-pressure is the client's: it writes record t only after it consumed
// completion t - capacity, so the consumer never waits on the client and
// never overwrites an unconsumed completion of a well-behaved client. A
// client that breaks this harms only its own completions. The daemon's:
// Poll takes no record while the session's held calls (Session::held) are
// at `max_held`; the records wait in the ring, unanswered, and the client
// in front of its full ring (measured on the fake daemon: a C++ client
// making 2,000,000 asynchronous calls grew the daemon to 1.4 GB in 4 s
// before this bound).
//
// Thread-safety: Poll, ArmSleep and Disarm from one thread at a time (the
// one serving it). RequestStop from any thread: Poll takes no record after it
// returns except one already being copied, which the sink answers (the
// session's state rejects it). Stop must not run on its own thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "cache_dit_opd/v1/ring.h"
#include "common/call.h"
#include "common/status.h"
#include "server/exec/executor.h"
#include "server/session/session.h"

namespace cache_dit_opd {

// How long a tail may read as impossible before it is a violation: longer
// than a client thread preempted between the byte stores of its tail.
inline constexpr std::chrono::milliseconds kOddTailGrace{20};

struct RingConsumerOptions {
  std::chrono::microseconds spin{200};              // --spin-us
  std::chrono::milliseconds sleep_timeout{100};     // longest futex wait
  // Records are taken only while the session's held calls (Session::held)
  // are fewer: what one session costs the daemon's memory is bounded by
  // this plus the ring's capacity, however far ahead its client runs.
  uint64_t max_held = 256;
  // Tests only: runs on the consumer thread right after record `ticket` was
  // copied out of its slot, before the copy is decoded.
  std::function<void(uint64_t ticket)> after_copy;
};

class RingConsumer final : public CallSource {
 public:
  using Completion = std::function<void(const Status&)>;
  // Where decoded records go. Each function must answer its completion
  // exactly once (at once or later, on any thread).
  struct Sink {
    // A decoded record (Daemon::Call: the gRPC Call's path).
    std::function<void(CallRequest, Completion)> submit;
    // A malformed record whose header names `lane` and `seq`; `reason` is
    // the decode error (Daemon::CallRejected).
    std::function<void(uint32_t lane, uint64_t seq, Status reason, Completion)> submit_rejected;
    // A malformed record whose header cannot be trusted (no lane or seq to
    // complete): counted here (the per-op row of unknown ops), answered by the
    // consumer in the completion ring only. May be empty (then not counted).
    std::function<void(const Status& reason)> count_unnumbered;
    // A protocol violation (absurd sq_tail). Called once, on the consumer
    // thread, which then stops taking records. Must not call Stop() inline.
    std::function<void(const Status& why)> on_violation;
  };

  // `session` must have a ring; `catalog` must outlive the consumer.
  RingConsumer(std::shared_ptr<Session> session, const std::vector<OpInfo>* catalog, Sink sink,
               RingConsumerOptions options);
  ~RingConsumer() override;  // Stop()
  RingConsumer(const RingConsumer&) = delete;
  RingConsumer& operator=(const RingConsumer&) = delete;

  // Takes every record published so far (see the file comment); returns how
  // many. 0 once finished.
  size_t Poll() override;
  // The doorbell dance of a server about to sleep: true when it may sleep on
  // doorbell() (expecting kDoorbellSleeping), false when a record or a stop
  // came. Disarm() after waking, whichever it returned.
  bool ArmSleep() override;
  void Disarm() override;
  uint32_t* doorbell() const override;
  uint32_t sleeping_value() const override { return v1::kDoorbellSleeping; }
  // Stopped, or ended by a protocol violation: Poll takes nothing more.
  bool finished() const override {
    return stop_.load(std::memory_order_acquire) || violated_.load(std::memory_order_acquire);
  }

  // Serves the ring on a thread of its own.
  void Start();
  // Asks whoever serves it to stop and wakes its doorbell; returns at once.
  // Records not yet copied stay unanswered (the session is ending); calls
  // already handed to the sink complete through it (the executor's drop
  // path).
  void RequestStop();
  // RequestStop, then joins its own thread if it has one. Not on that thread.
  void Stop();

  uint64_t session_id() const { return session_->id(); }
  // Counters (any thread): records taken, of which malformed; futex sleeps.
  uint64_t records() const { return records_.load(std::memory_order_relaxed); }
  // Records published and not yet taken, as the session memory says
  // (sq_tail - sq_head; the client writes sq_tail, so clamped to the
  // capacity). For the metrics; any thread.
  uint32_t Occupancy() const;
  uint64_t malformed() const { return malformed_.load(std::memory_order_relaxed); }
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }

 private:
  void Loop();
  // Copies are decoded and handed over here.
  void Process(uint64_t ticket, const uint8_t* copy);
  // Its own thread's sleep: ArmSleep, futex wait, Disarm.
  void Sleep();
  // A record it may take is there, or a stop was asked.
  bool Pending() const;
  bool AtHeldBound() const;  // the session holds max_held calls: take nothing now
  bool Takeable(uint64_t tail) const;  // `tail` names records Poll could take

  const std::shared_ptr<Session> session_;
  const std::vector<OpInfo>* const catalog_;
  const Sink sink_;
  const RingConsumerOptions options_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> violated_{false};
  uint64_t head_ = 0;  // private: never read back from the shared sq_head
  // When polls began to see a tail behind head_ or too far ahead (epoch: none).
  std::chrono::steady_clock::time_point odd_tail_since_{};
  std::atomic<uint64_t> records_{0};
  std::atomic<uint64_t> malformed_{0};
  std::atomic<uint64_t> sleeps_{0};
  std::thread thread_;
};

// Writes completion `ticket` into `memory`'s ring: every field, then
// store-release done_ticket = ticket + 1. Exposed for tests.
void WriteRingCompletion(SessionMemory& memory, uint64_t ticket, uint32_t lane, uint64_t seq, const Status& status);

}  // namespace cache_dit_opd
