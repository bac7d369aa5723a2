// File: server/shared_memory.h
//
// A session's shared-memory object (layout: proto/cache_dit_opd/v1/
// session_memory.h): an anonymous memfd, sealed against growing and
// shrinking, mapped shared in the daemon and passed to the client over the
// session channel. Never a named /dev/shm object.
//
// The memory is hostile input: the client can write any byte at any time.
// The daemon reads only values from it (a lane's inputs_ready), each with one
// acquire load, and never trusts a size or an offset found there. It writes
// the header once at creation and the heartbeat counter afterwards; the
// lanes' "done" values are written by the daemon's lane streams, not the host.
//
// Room for the call ring (issue 6): Create takes `ring_bytes`; the ring sits
// page-aligned after the lanes and the header records ring_offset/ring_bytes.
#pragma once

#include <cstdint>
#include <memory>

#include "cache_dit_opd/v1/session_memory.h"
#include "server/status.h"

namespace cache_dit_opd {

class SessionMemory {
 public:
  // SessionMemory::Create
  //
  // memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING), ftruncate, seal
  // (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL), mmap shared, header and
  // zeroed lanes. `lanes` >= 1. INTERNAL naming the failing syscall.
  static Status Create(uint64_t session_id, uint32_t lanes, uint64_t ring_bytes,
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
  // Total size for `lanes` lanes and a ring of `ring_bytes`, page-rounded.
  static uint64_t BytesFor(uint32_t lanes, uint64_t ring_bytes);

  v1::SessionMemoryHeader* header() const { return static_cast<v1::SessionMemoryHeader*>(data_); }
  v1::LaneSemaphores* lane(uint32_t i) const;

  // Acquire loads of a lane's semaphores (the client may write them anytime).
  uint64_t InputsReady(uint32_t lane) const;
  uint64_t Done(uint32_t lane) const;
  // Increments the header's daemon_heartbeat (release store).
  void Heartbeat();

 private:
  SessionMemory() = default;
  int fd_ = -1;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
  uint32_t lanes_ = 0;
};

}  // namespace cache_dit_opd
