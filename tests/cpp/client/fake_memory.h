// Test helpers: a session shared-memory object as the daemon would create it.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "cache_dit_opd/v1/session_memory.h"

namespace cache_dit_opd::client::test {

namespace v1 = ::cache_dit_opd::v1;

// Bytes of a v1 session object with `lanes` lanes and no ring.
inline uint64_t SessionBytes(uint32_t lanes) {
  const uint64_t end = v1::kLanesOffset + uint64_t{lanes} * sizeof(v1::LaneSemaphores);
  return (end + 4095) / 4096 * 4096;
}

inline v1::SessionMemoryHeader MakeHeader(uint64_t total, uint64_t session_id, uint32_t lanes) {
  v1::SessionMemoryHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = v1::kSessionMemoryMagic;
  h.layout_version = v1::kLayoutVersion;
  h.total_bytes = total;
  h.session_id = session_id;
  h.lane_count = lanes;
  h.lane_stride = sizeof(v1::LaneSemaphores);
  h.lanes_offset = v1::kLanesOffset;
  h.daemon_pid = 4242;
  return h;
}

// A memfd of `total` bytes whose first page holds `h`. Returns the fd.
inline int MakeMemfd(uint64_t total, const v1::SessionMemoryHeader& h) {
  int fd = ::memfd_create("opd-test-session", MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (::ftruncate(fd, static_cast<off_t>(total)) != 0) return -1;
  if (total >= sizeof(h)) {
    if (::pwrite(fd, &h, sizeof(h), 0) != static_cast<ssize_t>(sizeof(h))) return -1;
  }
  return fd;
}

// Page-aligned heap memory holding a valid header (for SessionMapping::Wrap).
struct HostSession {
  explicit HostSession(uint32_t lanes, uint64_t session_id = 7) : bytes(SessionBytes(lanes)) {
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    v1::SessionMemoryHeader h = MakeHeader(bytes, session_id, lanes);
    std::memcpy(base, &h, sizeof(h));
  }
  ~HostSession() { ::munmap(base, bytes); }
  void* base;
  uint64_t bytes;
};

}  // namespace cache_dit_opd::client::test
