#include "server/ring/ring_consumer.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

#include "cache_dit_opd/v1/ring.h"
#include "common/cpu_relax.h"
#include "common/ring_decode.h"


namespace cache_dit_opd {
namespace {

using Clock = std::chrono::steady_clock;

// Shared futex (no FUTEX_PRIVATE_FLAG): the word is in a MAP_SHARED mapping
// and the client's FUTEX_WAKE comes from another process.
long FutexWait(uint32_t* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
  return syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWake(uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, 1, nullptr, nullptr, 0); }

// Length of at most `max` bytes of `s` that does not split a UTF-8 sequence
// (the client decodes the message as text).
size_t Utf8Prefix(const std::string& s, size_t max) {
  if (s.size() <= max) return s.size();
  size_t n = max;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return n;
}

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
  FutexWake(&ctl->doorbell);
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

void RingConsumer::Sleep(uint64_t head) {
  v1::RingControl* ctl = session_->memory().ring_control();
  std::atomic_ref<uint32_t> bell(ctl->doorbell);
  // Dekker with the client (store tail, then load doorbell): our store of
  // "sleeping" and re-load of the tail are both seq_cst, so either we see its
  // record or it sees us sleeping and wakes us.
  bell.store(v1::kDoorbellSleeping, std::memory_order_seq_cst);
  if (std::atomic_ref<uint64_t>(ctl->sq_tail).load(std::memory_order_seq_cst) == head &&
      !stop_.load(std::memory_order_seq_cst)) {
    sleeps_.fetch_add(1, std::memory_order_relaxed);
    const long rc = FutexWait(&ctl->doorbell, v1::kDoorbellSleeping, options_.sleep_timeout);
    if (rc != 0 && errno == EAGAIN &&
        std::atomic_ref<uint64_t>(ctl->sq_tail).load(std::memory_order_acquire) == head &&
        !stop_.load(std::memory_order_acquire)) {
      // The word was not "sleeping" although nothing arrived: the client
      // keeps scribbling on it. Back off instead of spinning on the syscall.
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  bell.store(v1::kDoorbellAwake, std::memory_order_release);
}

uint64_t RingConsumer::SettledTail(std::atomic_ref<uint64_t>& tail_ref) const {
  const auto until = Clock::now() + std::chrono::microseconds(50);
  while (Clock::now() < until) CpuRelax();
  return tail_ref.load(std::memory_order_acquire);
}

void RingConsumer::Loop() {
  SessionMemory& memory = session_->memory();
  v1::RingControl* ctl = memory.ring_control();
  std::atomic_ref<uint64_t> tail_ref(ctl->sq_tail);
  std::atomic_ref<uint64_t> head_ref(ctl->sq_head);
  const uint64_t capacity = memory.ring_capacity();
  alignas(64) std::array<uint8_t, v1::kSlotBytes> copy;
  uint64_t head = 0;  // private: never read back from the shared sq_head
  auto spin_until = Clock::now() + options_.spin;
  while (!stop_.load(std::memory_order_acquire)) {
    const uint64_t tail = tail_ref.load(std::memory_order_acquire);
    if (tail == head) {
      if (Clock::now() < spin_until) {
        CpuRelax();
        continue;
      }
      Sleep(head);
      spin_until = Clock::now();  // after a wake, spin only once records came
      continue;
    }
    if (tail < head || tail - head > capacity) {
      // A client that stores the tail byte by byte (low bytes first) can be
      // read mid-store, and such a value is never ahead of the real one:
      // look again a little later before ending the session over it.
      const uint64_t again = SettledTail(tail_ref);
      if (again >= head && again - head <= capacity) continue;
      Status why = again < head ? Status::Rejected(Reason::kMalformed, "call ring protocol violation: sq_tail ", again,
                                                          " is behind the daemon's head ", head)
                                : Status::Rejected(Reason::kMalformed, "call ring protocol violation: sq_tail ", again, " is ",
                                                          again - head, " records ahead of the daemon's head ",
                                                          head, ", more than the capacity ", capacity);
      spdlog::error("session {}: {}; ending the session", session_->id(), why.message());
      stop_.store(true, std::memory_order_release);
      if (sink_.on_violation) sink_.on_violation(why);
      return;
    }
    for (; head != tail && !stop_.load(std::memory_order_acquire); ++head) {
      std::memcpy(copy.data(), memory.ring_slot(head), v1::kSlotBytes);  // the one read of this slot
      head_ref.store(head + 1, std::memory_order_release);
      if (options_.after_copy) options_.after_copy(head);
      Process(head, copy.data());
    }
    spin_until = Clock::now() + options_.spin;
  }
}

void RingConsumer::Process(uint64_t ticket, const uint8_t* copy) {
  records_.fetch_add(1, std::memory_order_relaxed);
  CallRequest req;
  RecordIds ids;
  Status s = DecodeRecord(copy, v1::kSlotBytes, *catalog_, &req, &ids);
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
  spdlog::debug("session {}: ring record {} rejected: {}", session_->id(), ticket, s.message());
  if (usable) {
    sink_.submit_rejected(lane, seq, std::move(s), std::move(done));
  } else {
    done(s);
  }
}

}  // namespace cache_dit_opd
