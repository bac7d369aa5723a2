#include "server/ring/ring_consumer.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

#include "cache_dit_opd/v1/ring.h"
#include "common/cpu_relax.h"
#include "common/futex.h"
#include "common/log_throttle.h"
#include "common/ring_decode.h"


namespace cache_dit_opd {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void WriteRingCompletion(SessionMemory& memory, uint64_t ticket, uint32_t lane, uint64_t seq, const Status& status) {
  v1::CompletionRecord* slot = memory.ring_completion(ticket);
  if (slot == nullptr) return;
  v1::CompletionRecord r{};
  r.ticket = ticket;
  r.seq = seq;
  r.lane = lane;
  r.status_code = static_cast<int32_t>(status.code());
  r.reason = static_cast<uint32_t>(status.reason());
  const size_t len = Utf8Prefix(status.message(), sizeof(r.message) - 1);
  std::memcpy(r.message, status.message().data(), len);
  r.message[len] = '\0';
  // Everything but done_ticket, then done_ticket with release: a client that
  // load-acquires done_ticket == ticket + 1 sees the fields of this ticket.
  constexpr size_t kBody = offsetof(v1::CompletionRecord, ticket);
  std::memcpy(reinterpret_cast<char*>(slot) + kBody, reinterpret_cast<const char*>(&r) + kBody, sizeof(r) - kBody);
  std::atomic_ref<uint64_t>(slot->done_ticket).store(ticket + 1, std::memory_order_release);
}

RingConsumer::RingConsumer(std::shared_ptr<Session> session, const std::vector<OpInfo>* catalog, Sink sink,
                           RingConsumerOptions options)
    : session_(std::move(session)), catalog_(catalog), sink_(std::move(sink)), options_(std::move(options)) {}

RingConsumer::~RingConsumer() { Stop(); }

void RingConsumer::Start() {
  if (thread_.joinable() || session_->memory().ring_capacity() == 0) return;
  thread_ = std::thread([this] { Loop(); });
}

void RingConsumer::RequestStop() {
  stop_.store(true, std::memory_order_seq_cst);
  v1::RingControl* ctl = session_->memory().ring_control();
  if (ctl == nullptr) return;
  // Changing the word first makes a FUTEX_WAIT that has not started yet
  // return at once (EAGAIN); the wake releases one that has.
  std::atomic_ref<uint32_t>(ctl->doorbell).store(v1::kDoorbellAwake, std::memory_order_seq_cst);
  FutexWake(&ctl->doorbell, /*count=*/2);  // its own thread, or the executor polling it
}

void RingConsumer::Stop() {
  RequestStop();
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    spdlog::error("session {}: ring consumer asked to join itself; leaving it detached", session_->id());
    thread_.detach();
    return;
  }
  thread_.join();
}

bool RingConsumer::ArmSleep() {
  v1::RingControl* ctl = session_->memory().ring_control();
  // Dekker with the client (store tail, then load doorbell): our store of
  // "sleeping" and re-load of the tail are both seq_cst, so either we see its
  // record or it sees us sleeping and wakes us.
  std::atomic_ref<uint32_t>(ctl->doorbell).store(v1::kDoorbellSleeping, std::memory_order_seq_cst);
  // Records that may not be taken yet (the session's held calls are at the
  // bound) are no work: what frees a place is a held call finishing, which
  // the executor sees on its own (its sleep is short while calls wait).
  return (!Takeable(std::atomic_ref<uint64_t>(ctl->sq_tail).load(std::memory_order_seq_cst)) || AtHeldBound()) &&
         !stop_.load(std::memory_order_seq_cst);
}

bool RingConsumer::Takeable(uint64_t tail) const {
  // A tail behind the head or more than a capacity ahead is no work: Poll
  // takes nothing from it (and counts it toward a violation). Taken for work,
  // it would keep the polling thread from ever sleeping, and a client that
  // sets it right now and then, inside the violation's grace, could make the
  // thread spin for as long as it likes.
  return tail > head_ && tail - head_ <= session_->memory().ring_capacity();
}

void RingConsumer::Disarm() {
  std::atomic_ref<uint32_t>(session_->memory().ring_control()->doorbell)
      .store(v1::kDoorbellAwake, std::memory_order_release);
}

uint32_t* RingConsumer::doorbell() const { return &session_->memory().ring_control()->doorbell; }

void RingConsumer::Sleep() {
  if (ArmSleep()) {
    sleeps_.fetch_add(1, std::memory_order_relaxed);
    const long rc = FutexWait(doorbell(), v1::kDoorbellSleeping, options_.sleep_timeout);
    if (rc != 0 && errno == EAGAIN && !Pending()) {
      // The word was not "sleeping" although nothing arrived: the client
      // keeps scribbling on it. Back off instead of spinning on the syscall.
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  Disarm();
}

uint32_t RingConsumer::Occupancy() const {
  v1::RingControl* ctl = session_->memory().ring_control();
  const uint64_t head = std::atomic_ref<uint64_t>(ctl->sq_head).load(std::memory_order_acquire);
  const uint64_t tail = std::atomic_ref<uint64_t>(ctl->sq_tail).load(std::memory_order_acquire);
  const uint32_t capacity = session_->memory().ring_capacity();
  return tail < head ? 0 : static_cast<uint32_t>(std::min<uint64_t>(tail - head, capacity));
}

bool RingConsumer::AtHeldBound() const {
  return session_->held.load(std::memory_order_acquire) >= options_.max_held;
}

bool RingConsumer::Pending() const {
  return (Takeable(std::atomic_ref<uint64_t>(session_->memory().ring_control()->sq_tail).load(
              std::memory_order_acquire)) &&
          !AtHeldBound()) ||
         stop_.load(std::memory_order_acquire);
}

void RingConsumer::Loop() {
  auto spin_until = Clock::now() + options_.spin;
  while (!finished()) {
    if (Poll() > 0) {
      spin_until = Clock::now() + options_.spin;
    } else if (finished()) {
      return;
    } else if (Clock::now() < spin_until) {
      CpuRelax();
    } else {
      Sleep();
      spin_until = Clock::now();  // after a wake, spin only once records came
    }
  }
}

size_t RingConsumer::Poll() {
  if (finished()) return 0;
  SessionMemory& memory = session_->memory();
  v1::RingControl* ctl = memory.ring_control();
  std::atomic_ref<uint64_t> tail_ref(ctl->sq_tail);
  std::atomic_ref<uint64_t> head_ref(ctl->sq_head);
  const uint64_t capacity = memory.ring_capacity();
  const uint64_t tail = tail_ref.load(std::memory_order_acquire);
  if (tail == head_) {
    odd_tail_since_ = Clock::time_point{};
    return 0;
  }
  if (tail < head_ || tail - head_ > capacity) {
    // A client that stores the tail byte by byte (low bytes first) can be
    // read mid-store, and preempted there for a time slice: only a value
    // that stays impossible for kOddTailGrace ends the session. Meanwhile
    // polls take nothing (and the one polling thread serves the others).
    const Clock::time_point now = Clock::now();
    if (odd_tail_since_ == Clock::time_point{}) odd_tail_since_ = now;
    if (now - odd_tail_since_ < kOddTailGrace) return 0;
    Status why = tail < head_ ? Status::Rejected(Reason::kMalformed, "call ring protocol violation: sq_tail ", tail,
                                                 " is behind the daemon's head ", head_)
                              : Status::Rejected(Reason::kMalformed, "call ring protocol violation: sq_tail ", tail,
                                                 " is ", tail - head_, " records ahead of the daemon's head ", head_,
                                                 ", more than the capacity ", capacity);
    // A client can cause this at will (once per session it opens): a bounded
    // number of lines per interval.
    static LogThrottle violations(10, std::chrono::seconds(10));
    if (const auto v = violations.Next(); v.log) {
      spdlog::error("session {}: {}; ending the session{}", session_->id(), why.message(),
                    SuppressedNote(v.suppressed));
    }
    violated_.store(true, std::memory_order_release);
    if (sink_.on_violation) sink_.on_violation(why);
    return 0;
  }
  odd_tail_since_ = Clock::time_point{};
  alignas(64) std::array<uint8_t, v1::kSlotBytes> copy;
  size_t taken = 0;
  for (; head_ != tail && !stop_.load(std::memory_order_acquire) && !AtHeldBound(); ++head_, ++taken) {
    std::memcpy(copy.data(), memory.ring_slot(head_), v1::kSlotBytes);  // the one read of this slot
    head_ref.store(head_ + 1, std::memory_order_release);
    if (options_.after_copy) options_.after_copy(head_);
    Process(head_, copy.data());
  }
  return taken;
}

void RingConsumer::Process(uint64_t ticket, const uint8_t* copy) {
  records_.fetch_add(1, std::memory_order_relaxed);
  CallRequest req;
  RecordIds ids;
  Status s = DecodeRecord(copy, v1::kSlotBytes, *catalog_, &req, &ids);
  req.transport = CallTransport::kRing;
  bool usable = ids.header_usable;
  if (usable && ids.ticket != ticket) {
    // Not this ticket's record (stale or misplaced): its lane and seq are not
    // to be trusted either.
    s = Status::Rejected(Reason::kMalformed, "record ticket ", ids.ticket, " found in the slot of ticket ", ticket);
    usable = false;
  }
  const uint32_t lane = ids.lane;
  const uint64_t seq = ids.seq;
  Completion done = [session = session_, ticket, lane, seq](const Status& st) {
    WriteRingCompletion(session->memory(), ticket, lane, seq, st);
  };
  if (s.ok()) {
    sink_.submit(std::move(req), std::move(done));
    return;
  }
  malformed_.fetch_add(1, std::memory_order_relaxed);
  // A client can write a malformed record into every slot as fast as the
  // daemon reads them: a bounded number of lines per interval, whatever the
  // log level.
  static LogThrottle rejected(10, std::chrono::seconds(10));
  if (spdlog::should_log(spdlog::level::debug)) {
    if (const auto v = rejected.Next(); v.log) {
      spdlog::debug("session {}: ring record {} rejected: {}{}", session_->id(), ticket, s.message(),
                    SuppressedNote(v.suppressed));
    }
  }
  if (usable) {
    sink_.submit_rejected(lane, seq, std::move(s), std::move(done));
    return;
  }
  // Counted like any rejection (the session's errors, the per-op metrics)
  // before its answer, as Executor::Record does for the others.
  session_->errors.fetch_add(1, std::memory_order_relaxed);
  if (sink_.count_unnumbered) sink_.count_unnumbered(s);
  done(s);
}

}  // namespace cache_dit_opd
