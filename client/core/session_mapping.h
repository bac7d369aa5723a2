// File: client/core/session_mapping.h
//
// The client's view of a session's shared memory (layout in
// proto/cache_dit_opd/v1/session_memory.h): validating the header the
// daemon wrote, mapping the memfd, and host-side access to the lane
// semaphores. No CUDA here; registering the mapping with CUDA is the
// session's job (client/client.cc).
//
// The header is checked before anything in the mapping is trusted: magic,
// layout version, total size equal to the memfd's size, session id, lane
// count and stride equal to what OpenSession granted, and every region
// (lanes, ring) page-aligned and inside the mapping with overflow-checked
// arithmetic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cache_dit_opd/v1/session_memory.h"
#include "common/status.h"

namespace cache_dit_opd::client {

namespace v1 = ::cache_dit_opd::v1;

// ExpectedLayout
//
// What OpenSession and the bind reply promised; the header must agree.
struct ExpectedLayout {
  uint64_t session_id = 0;
  uint32_t lanes = 0;        // lanes granted
  uint64_t total_bytes = 0;  // OpenSessionReply.shared_memory_bytes (== BindReply's == memfd size)
};

// Most lanes a v1 header may declare; bounds the lane area a hostile or
// corrupt header can make the client touch.
inline constexpr uint32_t kMaxLanes = 1024;

// ValidateSessionMemoryHeader
//
// Checks a copy of the header against `mapped_bytes` (the memfd's size) and
// `expect`. FAILED_PRECONDITION naming the field and both values when the
// daemon speaks another layout (magic, version); INTERNAL for inconsistent
// sizes or offsets.
Status ValidateSessionMemoryHeader(const v1::SessionMemoryHeader& header, uint64_t mapped_bytes,
                                   const ExpectedLayout& expect);

// SessionMapping
//
// Owns one MAP_SHARED mapping of a session memfd. Map() checks the memfd's
// size, maps it read-write and validates the header; the fd itself is not
// kept (the mapping keeps the object alive). Semaphore access from the host
// uses 64-bit atomics, the same width the GPU stream operations use.
class SessionMapping {
 public:
  static Status Map(int memfd, const ExpectedLayout& expect, std::unique_ptr<SessionMapping>* out);
  // Wraps memory the caller owns (tests); validates it the same way.
  static Status Wrap(void* base, uint64_t bytes, const ExpectedLayout& expect,
                     std::unique_ptr<SessionMapping>* out);
  ~SessionMapping();
  SessionMapping(const SessionMapping&) = delete;
  SessionMapping& operator=(const SessionMapping&) = delete;

  void* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  uint32_t lane_count() const { return lane_count_; }
  // Host address of lane `lane`'s semaphores (lane < lane_count()).
  v1::LaneSemaphores* lane(uint32_t lane) const;
  // Byte offset of lane `lane` from base() (device addresses are base + this).
  uint64_t lane_offset(uint32_t lane) const { return lanes_offset_ + uint64_t{lane} * sizeof(v1::LaneSemaphores); }
  // The call ring, as the validated header placed it (0 and 0: no ring).
  // Never read again from the shared header, which the daemon could rewrite.
  uint64_t ring_offset() const { return ring_offset_; }
  uint64_t ring_bytes() const { return ring_bytes_; }

  uint64_t daemon_heartbeat() const;
  uint64_t daemon_pid() const;

  // SessionMapping::Leak
  //
  // Gives up the mapping without unmapping it: for when a stream may still
  // touch it and nothing can prove otherwise (process exit, a broken CUDA
  // context). A few pages stay mapped until the process exits.
  void Leak() { owned_ = false; }

 private:
  SessionMapping(void* base, uint64_t bytes, bool owned, const v1::SessionMemoryHeader& h);
  void* base_;
  uint64_t bytes_;
  bool owned_;
  uint32_t lane_count_;
  uint64_t lanes_offset_;
  uint64_t ring_offset_;
  uint64_t ring_bytes_;
};

// Host access to a semaphore (64-bit, acquire/release).
uint64_t LoadSemaphore(const uint64_t* p);
void StoreSemaphore(uint64_t* p, uint64_t value);
// Raises *p to at least `value` (never lowers it); returns the value now there.
uint64_t RaiseSemaphore(uint64_t* p, uint64_t value);

}  // namespace cache_dit_opd::client
