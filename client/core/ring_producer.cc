#include "client/core/ring_producer.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <thread>

#include "common/cpu_relax.h"
#include "common/futex.h"

namespace cache_dit_opd::client {

namespace {

constexpr auto kSleepMin = std::chrono::microseconds(20);
constexpr auto kSleepMax = std::chrono::milliseconds(1);
constexpr auto kLivenessEvery = std::chrono::milliseconds(5);
constexpr int32_t kInternal = 13;  // google.rpc.Code INTERNAL

}  // namespace

Status RingProducer::Open(void* ring, uint64_t ring_bytes, const Options& options, Liveness liveness,
                          std::unique_ptr<RingProducer>* out) {
  if (ring == nullptr || ring_bytes < v1::kRingControlBytes) {
    return Status::InvalidArgument("call ring of ", ring_bytes, " bytes is smaller than its control block");
  }
  // One copy of the control fields: the daemon wrote them before the session
  // was bound and never changes them.
  v1::RingControl c;
  std::memcpy(&c, ring, sizeof(c));
  std::string problems;
  auto add = [&](auto&&... a) {
    std::ostringstream os;
    (os << ... << a);
    problems += (problems.empty() ? "" : "; ") + os.str();
  };
  if (c.version != v1::kRingVersion) add("version ", c.version, " (expected ", v1::kRingVersion, ")");
  if (c.capacity == 0 || (c.capacity & (c.capacity - 1)) != 0) {
    add("capacity ", c.capacity, " (a power of two expected)");
  }
  if (c.slot_bytes != v1::kSlotBytes) add("slot_bytes ", c.slot_bytes, " (expected ", v1::kSlotBytes, ")");
  if (c.completion_bytes != v1::kCompletionBytes) {
    add("completion_bytes ", c.completion_bytes, " (expected ", v1::kCompletionBytes, ")");
  }
  if (problems.empty() && v1::RingBytes(c.capacity) > ring_bytes) {
    add(c.capacity, " slots need ", v1::RingBytes(c.capacity), " bytes, the ring has ", ring_bytes);
  }
  if (!problems.empty()) return Status::InvalidArgument("call ring control block is invalid: ", problems);
  out->reset(new RingProducer(static_cast<uint8_t*>(ring), c.capacity, options, std::move(liveness)));
  return Status::Ok();
}

RingProducer::RingProducer(uint8_t* ring, uint32_t capacity, const Options& options, Liveness liveness)
    : ring_(ring), capacity_(capacity), mask_(capacity - 1), options_(options), liveness_(std::move(liveness)),
      entries_(new Entry[capacity]) {
  // A fresh ring starts at 0; a ring resumed in this process continues.
  const uint64_t tail = std::atomic_ref<uint64_t>(control()->sq_tail).load(std::memory_order_acquire);
  next_.store(tail, std::memory_order_relaxed);
  cursor_.store(tail, std::memory_order_relaxed);
}

v1::CompletionRecord* RingProducer::completion(uint64_t t) const {
  return reinterpret_cast<v1::CompletionRecord*>(ring_ + v1::kRingControlBytes + uint64_t{capacity_} * v1::kSlotBytes +
                                                 (t & mask_) * v1::kCompletionBytes);
}

bool RingProducer::Arrived(uint64_t t) const {
  return std::atomic_ref<uint64_t>(completion(t)->done_ticket).load(std::memory_order_acquire) == t + 1;
}

template <typename Cond>
Status RingProducer::PollUntil(const Cond& cond, const std::string& what, std::chrono::nanoseconds timeout) {
  using Clock = std::chrono::steady_clock;
  if (timeout.count() <= 0) timeout = options_.timeout;
  const auto start = Clock::now();
  // Spin: the daemon answers within microseconds of the doorbell.
  for (uint32_t n = 1;; ++n) {
    if (cond()) return Status::Ok();
    CpuRelax();
    if ((n & 63) == 0 && Clock::now() - start > options_.spin) break;
  }
  auto sleep = std::chrono::nanoseconds(kSleepMin);
  auto next_check = start;
  const auto deadline = start + timeout;
  while (true) {
    const auto now = Clock::now();
    if (now >= next_check) {
      if (liveness_) {
        Status s = liveness_();
        if (!s.ok()) return Status::Unavailable("while waiting for ", what, ": ", s.message());
      }
      if (now > deadline) {
        return Status::DeadlineExceeded(
            "no progress in ", std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count(),
            " ms while waiting for ", what);
      }
      next_check = now + kLivenessEvery;
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min<std::chrono::nanoseconds>(sleep * 2, kSleepMax);
    if (cond()) return Status::Ok();
  }
}

Status RingProducer::Publish(uint32_t lane, uint64_t seq, uint32_t op_index, const RecordArgs& args,
                             RingCompletion* sync, const uint64_t* regions, size_t nregions, uint64_t* ticket) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t t = next_.load(std::memory_order_relaxed);
    if (t - cursor_.load(std::memory_order_relaxed) >= capacity_) {
      full_waits_.fetch_add(1, std::memory_order_relaxed);
      // The lock stays held: every other publisher would wait for the same
      // room, and this thread consumes everyone's completions meanwhile.
      Status s = PollUntil(
          [&] {
            HarvestLocked();
            return t - cursor_.load(std::memory_order_relaxed) < capacity_;
          },
          "room in the call ring (ticket " + std::to_string(t) + ")");
      if (!s.ok()) return s;
    }
    Entry& e = entries_[t & mask_];
    e.ticket = t;
    e.seq = seq;
    e.lane = lane;
    e.op_index = op_index;
    e.asynchronous = sync == nullptr;
    e.answered = false;
    e.sync = sync;
    e.nregions = static_cast<uint32_t>(std::min<size_t>(nregions, kMaxArgs));
    if (e.nregions) std::memcpy(e.regions, regions, e.nregions * sizeof(uint64_t));

    v1::RecordHeader h{};
    h.magic = v1::kRecordMagic;
    h.record_bytes = static_cast<uint32_t>(sizeof(h) + args.size());
    h.ticket = t;
    h.seq = seq;
    h.lane = lane;
    h.op_index = op_index;
    h.nargs = args.count();
    h.flags = sync == nullptr ? 1u : 0u;
    uint8_t* dst = slot(t);
    std::memcpy(dst, &h, sizeof(h));
    std::memcpy(dst + sizeof(h), args.data(), args.size());
    next_.store(t + 1, std::memory_order_relaxed);
    // seq_cst (it releases the record too): see the doorbell load below.
    std::atomic_ref<uint64_t>(control()->sq_tail).store(t + 1, std::memory_order_seq_cst);
    *ticket = t;
  }
  // Store-load order between the tail and the doorbell (Dekker with the
  // daemon's "store sleeping, re-check the tail", both seq_cst): the tail
  // store and this load are seq_cst, so either the daemon's re-check sees the
  // record or this load sees it sleeping. Seq_cst operations rather than a
  // fence between a release store and a relaxed load: the same instructions
  // on x86-64 (xchg instead of mov + mfence), and ThreadSanitizer models
  // them (it ignores std::atomic_thread_fence; GCC refuses it with -Wtsan).
  std::atomic_ref<uint32_t> bell(control()->doorbell);
  if (bell.load(std::memory_order_seq_cst) == v1::kDoorbellSleeping) {
    bell.store(v1::kDoorbellAwake, std::memory_order_relaxed);
    wakes_.fetch_add(1, std::memory_order_relaxed);
    FutexWake(&control()->doorbell);  // shared: the daemon sleeps on it in its own process
  }
  return Status::Ok();
}

void RingProducer::ReadLocked(Entry& e) {
  // A private copy first: the daemon (or a hostile peer) may rewrite the slot.
  v1::CompletionRecord c;
  std::memcpy(&c, completion(e.ticket), sizeof(c));
  int32_t code = c.status_code;
  uint32_t reason = c.reason;
  std::string message;
  if (c.ticket != e.ticket || (code == 0 && (c.lane != e.lane || c.seq != e.seq))) {
    code = kInternal;
    reason = static_cast<uint32_t>(Reason::kInternal);
    message = "completion of ticket " + std::to_string(e.ticket) + " (lane " + std::to_string(e.lane) + ", seq " +
              std::to_string(e.seq) + ") echoes ticket " + std::to_string(c.ticket) + " (lane " +
              std::to_string(c.lane) + ", seq " + std::to_string(c.seq) + ")";
  } else if (code != 0) {
    message.assign(c.message, strnlen(c.message, sizeof(c.message)));
  }
  e.answered = true;
  if (e.sync != nullptr) {
    e.sync->code = code;
    e.sync->reason = reason;
    e.sync->message = std::move(message);
    e.sync->ready.store(true, std::memory_order_release);
    e.sync = nullptr;
  } else if (code != 0) {
    RejectedCall r;
    r.ticket = e.ticket;
    r.lane = e.lane;
    r.seq = e.seq;
    r.op_index = e.op_index;
    r.code = code;
    r.reason = reason;
    r.message = std::move(message);
    r.regions.assign(e.regions, e.regions + e.nregions);
    // Harvests read whatever arrived, so a later ticket can be read first:
    // keep the list in ticket order ("oldest first").
    auto at = std::upper_bound(rejected_.begin(), rejected_.end(), r.ticket,
                               [](uint64_t t, const RejectedCall& x) { return t < x.ticket; });
    rejected_.insert(at, std::move(r));
    rejected_count_.store(rejected_.size(), std::memory_order_relaxed);
  }
}

void RingProducer::HarvestLocked() {
  const uint64_t next = next_.load(std::memory_order_relaxed);
  uint64_t cursor = cursor_.load(std::memory_order_relaxed);
  for (uint64_t t = cursor; t < next; ++t) {
    Entry& e = entries_[t & mask_];
    if (!e.answered && Arrived(t)) ReadLocked(e);
  }
  while (cursor < next && entries_[cursor & mask_].answered) ++cursor;
  cursor_.store(cursor, std::memory_order_relaxed);
}

Status RingProducer::Wait(uint64_t ticket, RingCompletion* sync, std::chrono::nanoseconds timeout) {
  Status s = PollUntil(
      [&] { return sync->ready.load(std::memory_order_acquire) || Arrived(ticket); },
      "the completion of ticket " + std::to_string(ticket), timeout);
  std::lock_guard<std::mutex> lock(mu_);
  if (s.ok()) {
    HarvestLocked();
    if (sync->ready.load(std::memory_order_acquire)) return Status::Ok();
    s = Status::Internal("ticket ", ticket, " arrived but its answer was not delivered");
  }
  Entry& e = entries_[ticket & mask_];
  if (e.ticket == ticket && e.sync == sync) e.sync = nullptr;
  return s;
}

bool RingProducer::HasRejected() {
  const uint64_t cursor = cursor_.load(std::memory_order_relaxed);
  if (cursor < next_.load(std::memory_order_relaxed) && Arrived(cursor)) {
    std::lock_guard<std::mutex> lock(mu_);
    HarvestLocked();
  }
  return rejected_count_.load(std::memory_order_relaxed) != 0;
}

std::vector<RejectedCall> RingProducer::TakeRejected(size_t max) {
  std::lock_guard<std::mutex> lock(mu_);
  HarvestLocked();
  const size_t n = std::min(max, rejected_.size());
  std::vector<RejectedCall> out(std::make_move_iterator(rejected_.begin()),
                                std::make_move_iterator(rejected_.begin() + n));
  rejected_.erase(rejected_.begin(), rejected_.begin() + n);
  rejected_count_.store(rejected_.size(), std::memory_order_relaxed);
  return out;
}

Status RingProducer::WaitConsumed() {
  const uint64_t target = next_.load(std::memory_order_relaxed);
  return PollUntil(
      [&] {
        std::lock_guard<std::mutex> lock(mu_);
        HarvestLocked();
        return cursor_.load(std::memory_order_relaxed) >= target;
      },
      "the completions of the records in the call ring");
}

uint64_t RingProducer::unanswered_async() {
  std::lock_guard<std::mutex> lock(mu_);
  HarvestLocked();
  uint64_t n = 0;
  const uint64_t next = next_.load(std::memory_order_relaxed);
  for (uint64_t t = cursor_.load(std::memory_order_relaxed); t < next; ++t) {
    const Entry& e = entries_[t & mask_];
    n += e.asynchronous && !e.answered;
  }
  return n;
}

}  // namespace cache_dit_opd::client
