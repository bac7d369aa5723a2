// File: server/session/session_memory.h
//
// A session's shared-memory object (layout: proto/cache_dit_opd/v1/
// session_memory.h): an anonymous memfd, sealed against growing and
// shrinking, mapped shared in the daemon and passed to the client over the
// session channel. Never a named /dev/shm object.
//
// The memory is hostile input: the client can write any byte at any time.
// The daemon reads only values from it (a lane's inputs_ready), each with one
// acquire load, and never trusts a size or an offset found there. It writes
// the header once at creation and the heartbeat counter afterwards (and a
// lane's inputs_ready only to release a parked wait of a failed session); the
// lanes' "done" values are written by the daemon's lane streams, not the host.
//
// The call ring (proto/cache_dit_opd/v1/ring.h), when the session has one,
// sits at a page-aligned ring_offset after the lanes, ring_bytes =
// v1::RingBytes(capacity) long (the mapping is page-rounded past it). The
// daemon writes its RingControl once at creation; afterwards it reads only
// sq_tail and the slots (each copied once, by server/ring/ring_consumer.h) and
// writes sq_head, the doorbell and the completions. It never reads a size,
// capacity or offset back from the ring: its own `ring_capacity()` rules.
#pragma once

#include <cstdint>
#include <memory>

#include "cache_dit_opd/v1/ring.h"
#include "cache_dit_opd/v1/session_memory.h"
#include "common/status.h"

namespace cache_dit_opd {

class SessionMemory {
 public:
  // SessionMemory::Create
  //
  // memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING), ftruncate, seal
  // (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL), mmap shared, header and
  // zeroed lanes; with `ring_capacity` > 0 (a power of two) also the call
  // ring, its RingControl filled in. `lanes` >= 1. INVALID_ARGUMENT for a
  // bad lane count or capacity, INTERNAL naming the failing syscall.
  static Status Create(uint64_t session_id, uint32_t lanes, uint32_t ring_capacity,
                       std::unique_ptr<SessionMemory>* out);
  ~SessionMemory();
  SessionMemory(const SessionMemory&) = delete;
  SessionMemory& operator=(const SessionMemory&) = delete;

  int fd() const { return fd_; }
  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  uint32_t lanes() const { return lanes_; }

  // Byte offset of lane `lane`'s semaphores within the mapping.
  static uint64_t LaneOffset(uint32_t lane) {
    return v1::kLanesOffset + uint64_t{lane} * sizeof(v1::LaneSemaphores);
  }
  // Where the ring starts for `lanes` lanes: the first page after them.
  static uint64_t RingOffset(uint32_t lanes);
  // Total size for `lanes` lanes and a ring of `ring_capacity` slots (0: no
  // ring), page-rounded.
  static uint64_t BytesFor(uint32_t lanes, uint32_t ring_capacity);

  v1::SessionMemoryHeader* header() const { return static_cast<v1::SessionMemoryHeader*>(data_); }
  v1::LaneSemaphores* lane(uint32_t i) const;

  // What a GPU wait "word >= n" decides (cuStreamWaitValue64 GEQ): the
  // compare is cyclic, (int64_t)(word - n) >= 0, so a value 2^63 or more
  // ahead reads as behind. The host judges a client's value by the same rule.
  static bool Reached(uint64_t word, uint64_t n) { return static_cast<int64_t>(word - n) >= 0; }

  // Acquire loads of a lane's semaphores (the client may write them anytime).
  uint64_t InputsReady(uint32_t lane) const;
  uint64_t Done(uint32_t lane) const;
  // Raises lane `lane`'s inputs_ready from the host so that every GPU wait
  // "inputs_ready >= n" for n <= `value` passes: releases a wait the
  // executor parked on it for a client that died or stalled (the only
  // memory the released calls then touch is that client's own). The word is
  // kept only when it already holds a value in [value,
  // v1::kInputsReadyReleased]; anything else (lower, or a client's value at
  // or past 2^63 that the GPU's cyclic compare reads as behind) becomes
  // `value`. `value` <= kInputsReadyReleased.
  void RaiseInputsReady(uint32_t lane, uint64_t value);
  // Increments the header's daemon_heartbeat (release store).
  void Heartbeat();

  // The call ring; capacity 0 and null pointers when the session has none.
  // Slot and completion accessors mask `ticket` by the daemon's capacity.
  uint32_t ring_capacity() const { return ring_capacity_; }
  v1::RingControl* ring_control() const;
  const uint8_t* ring_slot(uint64_t ticket) const;
  v1::CompletionRecord* ring_completion(uint64_t ticket) const;

 private:
  SessionMemory() = default;
  int fd_ = -1;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
  uint32_t lanes_ = 0;
  uint32_t ring_capacity_ = 0;
  uint64_t ring_offset_ = 0;
};

}  // namespace cache_dit_opd
