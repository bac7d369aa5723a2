// A C++ stand-in for the Python client's side of the call ring
// (proto/cache_dit_opd/v1/ring.h): a record encoder and a ring client that
// takes tickets, waits for back-pressure, publishes and rings the doorbell
// the way the client must.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "cache_dit_opd/v1/ring.h"
#include "cache_dit_opd/v1/session_memory.h"
#include "common/call.h"

namespace cache_dit_opd::testing {

// Encodes one record. Setters for malformed records override what Bytes()
// would compute.
class RecordBuilder {
 public:
  RecordBuilder(uint64_t ticket, uint32_t lane, uint64_t seq, uint32_t op_index = 0) {
    h_.magic = v1::kRecordMagic;
    h_.ticket = ticket;
    h_.lane = lane;
    h_.seq = seq;
    h_.op_index = op_index;
  }

  RecordBuilder& Header(uint32_t kind, uint32_t count) {
    Put(kind);
    Put(count);
    ++nargs_;
    return *this;
  }
  template <typename T>
  RecordBuilder& Put(T v) {
    const size_t at = body_.size();
    body_.resize(at + sizeof(T));
    std::memcpy(body_.data() + at, &v, sizeof(T));
    return *this;
  }

  RecordBuilder& None() { return Header(0, 0); }
  RecordBuilder& Tensor(uint64_t region, uint64_t offset, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                        DType dtype) {
    Header(1, static_cast<uint32_t>(sizes.size()));
    Put(region).Put(offset).Put(static_cast<int32_t>(dtype)).Put(int32_t{0});
    for (int64_t s : sizes) Put(s);
    for (int64_t s : strides) Put(s);
    return *this;
  }
  RecordBuilder& Int(int64_t v) { return Header(2, 1).Put(v); }
  RecordBuilder& Float(double v) { return Header(3, 1).Put(v); }
  RecordBuilder& Bool(int64_t v) { return Header(4, 1).Put(v); }
  RecordBuilder& IntList(const std::vector<int64_t>& v) {
    Header(5, static_cast<uint32_t>(v.size()));
    for (int64_t x : v) Put(x);
    return *this;
  }
  RecordBuilder& FloatList(const std::vector<double>& v) {
    Header(6, static_cast<uint32_t>(v.size()));
    for (double x : v) Put(x);
    return *this;
  }
  RecordBuilder& BoolList(const std::vector<int64_t>& v) {
    Header(7, static_cast<uint32_t>(v.size()));
    for (int64_t x : v) Put(x);
    return *this;
  }

  RecordBuilder& Magic(uint32_t m) { h_.magic = m; return *this; }
  RecordBuilder& RecordBytes(uint32_t n) { record_bytes_ = n; return *this; }
  RecordBuilder& Nargs(uint32_t n) { nargs_override_ = n; return *this; }
  RecordBuilder& Ticket(uint64_t t) { h_.ticket = t; return *this; }
  uint64_t ticket() const { return h_.ticket; }

  std::vector<uint8_t> Bytes() const {
    v1::RecordHeader h = h_;
    h.record_bytes = record_bytes_.value_or(static_cast<uint32_t>(sizeof(h) + body_.size()));
    h.nargs = nargs_override_.value_or(nargs_);
    std::vector<uint8_t> out(sizeof(h) + body_.size());
    std::memcpy(out.data(), &h, sizeof(h));
    if (!body_.empty()) std::memcpy(out.data() + sizeof(h), body_.data(), body_.size());
    return out;
  }

 private:
  v1::RecordHeader h_{};
  std::vector<uint8_t> body_;
  uint32_t nargs_ = 0;
  std::optional<uint32_t> record_bytes_;
  std::optional<uint32_t> nargs_override_;
};

// The client side of one ring, over the client's own mapping of the memfd.
class RingClient {
 public:
  explicit RingClient(void* memory) {
    auto* h = static_cast<v1::SessionMemoryHeader*>(memory);
    base_ = static_cast<uint8_t*>(memory) + h->ring_offset;
    capacity_ = control()->capacity;
  }
  v1::RingControl* control() const { return reinterpret_cast<v1::RingControl*>(base_); }
  uint32_t capacity() const { return capacity_; }
  uint8_t* slot(uint64_t t) const { return base_ + v1::kRingControlBytes + (t % capacity_) * v1::kSlotBytes; }
  v1::CompletionRecord* completion(uint64_t t) const {
    return reinterpret_cast<v1::CompletionRecord*>(base_ + v1::kRingControlBytes +
                                                   uint64_t{capacity_} * v1::kSlotBytes +
                                                   (t % capacity_) * v1::kCompletionBytes);
  }
  uint64_t tail() const { return std::atomic_ref<uint64_t>(control()->sq_tail).load(std::memory_order_acquire); }
  uint64_t head() const { return std::atomic_ref<uint64_t>(control()->sq_head).load(std::memory_order_acquire); }
  uint32_t doorbell() const {
    return std::atomic_ref<uint32_t>(control()->doorbell).load(std::memory_order_acquire);
  }
  void SetTail(uint64_t t) { std::atomic_ref<uint64_t>(control()->sq_tail).store(t, std::memory_order_seq_cst); }

  // Takes the next ticket, builds its record with `make(ticket)`, waits until
  // completion ticket - capacity has been consumed (back-pressure), writes the
  // slot and publishes; rings the doorbell when the daemon sleeps and `wake`.
  // Serialized by one mutex, as the client serializes its threads.
  uint64_t Publish(const std::function<std::vector<uint8_t>(uint64_t)>& make, bool wake = true) {
    std::lock_guard<std::mutex> lock(publish_mu_);
    const uint64_t t = next_ticket_++;
    if (t >= capacity_) Consume(t - capacity_, std::chrono::seconds(30));
    std::vector<uint8_t> bytes = make(t);
    std::memcpy(slot(t), bytes.data(), std::min<size_t>(bytes.size(), v1::kSlotBytes));
    ++published_;
    // The tail store and the doorbell load need a full fence between them
    // (store-load order): seq_cst on both.
    std::atomic_ref<uint64_t>(control()->sq_tail).store(t + 1, std::memory_order_seq_cst);
    std::atomic_ref<uint32_t> bell(control()->doorbell);
    if (wake && bell.load(std::memory_order_seq_cst) == v1::kDoorbellSleeping) {
      bell.store(v1::kDoorbellAwake, std::memory_order_seq_cst);
      syscall(SYS_futex, &control()->doorbell, FUTEX_WAKE, 1, nullptr, nullptr, 0);
    }
    return t;
  }
  uint64_t Publish(const RecordBuilder& r, bool wake = true) {
    return Publish([&](uint64_t t) { return RecordBuilder(r).Ticket(t).Bytes(); }, wake);
  }

  // Completion `t` (consumed once; kept for later lookups). False on timeout.
  bool Wait(uint64_t t, v1::CompletionRecord* out, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    {
      std::lock_guard<std::mutex> lock(seen_mu_);
      if (auto it = seen_.find(t); it != seen_.end()) {
        *out = it->second;
        return true;
      }
    }
    if (!Consume(t, timeout)) return false;
    std::lock_guard<std::mutex> lock(seen_mu_);
    *out = seen_.at(t);
    return true;
  }
  // Back-pressure waits saw a completion that was not the one expected.
  int overwritten() const { return overwritten_.load(); }

 private:
  bool Consume(uint64_t t, std::chrono::milliseconds timeout) {
    {
      std::lock_guard<std::mutex> lock(seen_mu_);
      if (seen_.count(t)) return true;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    v1::CompletionRecord* c = completion(t);
    while (std::atomic_ref<uint64_t>(c->done_ticket).load(std::memory_order_acquire) != t + 1) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::yield();
    }
    v1::CompletionRecord copy;
    std::memcpy(&copy, c, sizeof(copy));
    if (copy.ticket != t || copy.done_ticket != t + 1) overwritten_.fetch_add(1);
    std::lock_guard<std::mutex> lock(seen_mu_);
    seen_.emplace(t, copy);
    return true;
  }

  uint8_t* base_ = nullptr;
  uint32_t capacity_ = 0;
  std::mutex publish_mu_;
  uint64_t next_ticket_ = 0;  // guarded by publish_mu_
  uint64_t published_ = 0;    // guarded by publish_mu_
  std::mutex seen_mu_;
  std::map<uint64_t, v1::CompletionRecord> seen_;  // guarded by seen_mu_
  std::atomic<int> overwritten_{0};
};

}  // namespace cache_dit_opd::testing
