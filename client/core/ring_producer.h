// File: client/core/ring_producer.h
//
// The client's side of one session's shared-memory call ring
// (proto/cache_dit_opd/v1/ring.h, layout 1) in C++: the producer the native
// proxy ops (client/python/) and the Python client share, so one process has
// exactly one producer per ring. Python's _ring.RingProducer is the same
// protocol for processes without the native library.
//
// Protocol (ticket t is the running count of records; record t lives in slot
// t % capacity, its completion in completion slot t % capacity):
//   - back-pressure: record t is written only after completion t - capacity
//     was consumed, which implies the daemon copied record t - capacity out
//     of its slot. Publish waits; it never drops a record;
//   - publish: plain stores of the record, then store sq_tail = t + 1
//     (seq_cst, which releases the record), then load the doorbell (seq_cst);
//     if the daemon sleeps, store kDoorbellAwake and FUTEX_WAKE the (shared)
//     word. The two seq_cst operations order the tail store before the
//     doorbell load against the daemon's "store sleeping, re-check the tail"
//     (seq_cst too);
//   - completion: load-acquire done_ticket == t + 1, then the fields. A
//     completion that echoes another ticket (or, when accepted, another lane
//     or seq) is answered INTERNAL for that call.
//
// Completions are consumed in any order by whichever thread holds the lock
// (a publisher waiting for room consumes everyone's); a synchronous call's
// answer goes to the RingCompletion its caller passed to Publish, an
// asynchronous call's rejection to the list TakeRejected() returns.
//
// Waits spin for Options::spin (pause instruction), then sleep 20 us
// doubling to 1 ms, calling the liveness check every 5 ms; UNAVAILABLE with
// its reason when it fails, DEADLINE_EXCEEDED after Options::timeout.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cache_dit_opd/v1/ring.h"
#include "common/call.h"
#include "common/ring_encode.h"
#include "common/status.h"

namespace cache_dit_opd::client {

// The answer to one synchronous call; owned by the caller from Publish
// through Wait.
struct RingCompletion {
  std::atomic<bool> ready{false};
  int32_t code = 0;  // google.rpc.Code: 0 accepted
  uint32_t reason = 0;  // wire.h Reason of a rejection
  std::string message;
};

// An asynchronous call the daemon rejected.
struct RejectedCall {
  uint64_t ticket = 0;
  uint32_t lane = 0;
  uint64_t seq = 0;
  uint32_t op_index = 0;
  int32_t code = 0;
  uint32_t reason = 0;  // wire.h Reason
  std::string message;
  std::vector<uint64_t> regions;  // what the caller passed to Publish
};

class RingProducer {
 public:
  // OK while the daemon can still answer; else why not.
  using Liveness = std::function<Status()>;
  struct Options {
    std::chrono::nanoseconds spin = std::chrono::microseconds(200);
    std::chrono::nanoseconds timeout = std::chrono::seconds(600);
  };

  // Checks the control block the daemon wrote (version, power-of-two
  // capacity, slot and completion sizes, RingBytes(capacity) <= ring_bytes):
  // INVALID_ARGUMENT naming the field otherwise. `ring` must stay mapped for
  // the producer's life.
  static Status Open(void* ring, uint64_t ring_bytes, const Options& options, Liveness liveness,
                     std::unique_ptr<RingProducer>* out);

  // Publishes one record; blocks while the ring is full. `sync`: the caller's
  // answer slot for a synchronous call, nullptr for an asynchronous one.
  // `regions` (at most kMaxArgs) are reported with an asynchronous rejection.
  Status Publish(uint32_t lane, uint64_t seq, uint32_t op_index, const RecordArgs& args, RingCompletion* sync,
                 const uint64_t* regions, size_t nregions, uint64_t* ticket);

  // Waits until `sync` holds the answer to `ticket`, at most `timeout`
  // (zero: Options::timeout). On failure `sync` is detached from the record
  // (its late answer is dropped).
  Status Wait(uint64_t ticket, RingCompletion* sync, std::chrono::nanoseconds timeout = {});

  // Consumes the completions that have arrived; true when rejected
  // asynchronous calls wait for TakeRejected(). Cheap when nothing arrived.
  bool HasRejected();
  // At most `max`, oldest (lowest ticket) first; the rest stay for the next
  // call.
  std::vector<RejectedCall> TakeRejected(size_t max = SIZE_MAX);

  // Waits until every record published so far has its completion consumed.
  Status WaitConsumed();

  uint32_t capacity() const { return capacity_; }
  uint64_t published() const { return next_.load(std::memory_order_relaxed); }
  uint64_t in_flight() const {
    return next_.load(std::memory_order_relaxed) - cursor_.load(std::memory_order_relaxed);
  }
  // Asynchronous records still without a completion.
  uint64_t unanswered_async();
  uint64_t wakes() const { return wakes_.load(std::memory_order_relaxed); }
  uint64_t full_waits() const { return full_waits_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    uint64_t ticket = 0;
    uint64_t seq = 0;
    uint32_t lane = 0;
    uint32_t op_index = 0;
    bool asynchronous = false;
    bool answered = false;
    RingCompletion* sync = nullptr;
    uint32_t nregions = 0;
    uint64_t regions[kMaxArgs];
  };

  RingProducer(uint8_t* ring, uint32_t capacity, const Options& options, Liveness liveness);
  v1::RingControl* control() const { return reinterpret_cast<v1::RingControl*>(ring_); }
  uint8_t* slot(uint64_t t) const { return ring_ + v1::kRingControlBytes + (t & mask_) * v1::kSlotBytes; }
  v1::CompletionRecord* completion(uint64_t t) const;
  bool Arrived(uint64_t t) const;
  // Under mu_: reads every arrived completion, advances the cursor.
  void HarvestLocked();
  void ReadLocked(Entry& e);
  // Spins, then sleeps, until cond() (see the file comment for the policy).
  template <typename Cond>
  Status PollUntil(const Cond& cond, const std::string& what, std::chrono::nanoseconds timeout = {});

  uint8_t* ring_;
  uint32_t capacity_;
  uint64_t mask_;
  Options options_;
  Liveness liveness_;
  std::mutex mu_;
  std::unique_ptr<Entry[]> entries_;         // guarded by mu_
  std::atomic<uint64_t> next_{0};            // written under mu_
  std::atomic<uint64_t> cursor_{0};          // written under mu_: lowest unconsumed ticket
  std::vector<RejectedCall> rejected_;       // guarded by mu_
  std::atomic<size_t> rejected_count_{0};
  std::atomic<uint64_t> wakes_{0};
  std::atomic<uint64_t> full_waits_{0};
};

}  // namespace cache_dit_opd::client
