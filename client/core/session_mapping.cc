#include "client/core/session_mapping.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

namespace cache_dit_opd::client {
namespace {

constexpr uint64_t kPage = 4096;

bool AddOverflows(uint64_t a, uint64_t b, uint64_t* sum) { return __builtin_add_overflow(a, b, sum); }
bool MulOverflows(uint64_t a, uint64_t b, uint64_t* p) { return __builtin_mul_overflow(a, b, p); }

}  // namespace

Status ValidateSessionMemoryHeader(const v1::SessionMemoryHeader& h, uint64_t mapped_bytes,
                                   const ExpectedLayout& expect) {
  if (mapped_bytes < sizeof(v1::SessionMemoryHeader)) {
    return Status::Internal("session memory is ", mapped_bytes, " bytes, smaller than its ",
                            sizeof(v1::SessionMemoryHeader), "-byte header");
  }
  if (h.magic != v1::kSessionMemoryMagic) {
    return Status::FailedPrecondition("session memory magic is 0x", std::hex, h.magic,
                                      ", expected 0x", v1::kSessionMemoryMagic,
                                      " (not a cache-dit-opd session object)");
  }
  if (h.layout_version != v1::kLayoutVersion) {
    return Status::FailedPrecondition("session memory layout version ", h.layout_version,
                                      " is not the client's ", v1::kLayoutVersion,
                                      "; upgrade the client or the daemon so they agree");
  }
  if (h.total_bytes != mapped_bytes) {
    return Status::Internal("session memory header says ", h.total_bytes,
                            " bytes but the memfd has ", mapped_bytes);
  }
  if (expect.total_bytes != 0 && h.total_bytes != expect.total_bytes) {
    return Status::Internal("session memory is ", h.total_bytes, " bytes but OpenSession announced ",
                            expect.total_bytes);
  }
  if (h.session_id != expect.session_id) {
    return Status::Internal("session memory belongs to session ", h.session_id, ", not ",
                            expect.session_id);
  }
  if (h.lane_count == 0 || h.lane_count > kMaxLanes) {
    return Status::Internal("session memory declares ", h.lane_count, " lanes (allowed 1..",
                            kMaxLanes, ")");
  }
  if (h.lane_count != expect.lanes) {
    return Status::Internal("session memory declares ", h.lane_count,
                            " lanes but OpenSession granted ", expect.lanes);
  }
  if (h.lane_stride != sizeof(v1::LaneSemaphores)) {
    return Status::Internal("session memory lane stride is ", h.lane_stride, ", layout v1 has ",
                            sizeof(v1::LaneSemaphores));
  }
  if (h.lanes_offset < sizeof(v1::SessionMemoryHeader) || h.lanes_offset % kPage != 0) {
    return Status::Internal("session memory lanes_offset ", h.lanes_offset,
                            " is not a page multiple past the header");
  }
  uint64_t lanes_bytes = 0, lanes_end = 0;
  if (MulOverflows(h.lane_count, h.lane_stride, &lanes_bytes) ||
      AddOverflows(h.lanes_offset, lanes_bytes, &lanes_end) || lanes_end > mapped_bytes) {
    return Status::Internal("session memory lanes [", h.lanes_offset, ", +", h.lane_count, " x ",
                            h.lane_stride, ") run past its ", mapped_bytes, " bytes");
  }
  if ((h.ring_offset == 0) != (h.ring_bytes == 0)) {
    return Status::Internal("session memory ring_offset ", h.ring_offset, " and ring_bytes ",
                            h.ring_bytes, " disagree about whether a ring exists");
  }
  if (h.ring_offset != 0) {
    // The ring's control words are 8-byte atomics in 64-byte-aligned
    // lines (ring.h): the ring producer's atomic_ref on a misaligned one is
    // undefined (and, off an 8-byte boundary, a split lock on x86 rather
    // than an atomic access). The daemon puts the ring on the first page
    // after the lanes.
    if (h.ring_offset % kPage != 0) {
      return Status::Internal("session memory ring_offset ", h.ring_offset, " is not a page multiple");
    }
    uint64_t ring_end = 0;
    if (h.ring_offset < lanes_end || AddOverflows(h.ring_offset, h.ring_bytes, &ring_end) ||
        ring_end > mapped_bytes) {
      return Status::Internal("session memory ring [", h.ring_offset, ", +", h.ring_bytes,
                              ") overlaps the lanes or runs past its ", mapped_bytes, " bytes");
    }
  }
  return Status::Ok();
}

SessionMapping::SessionMapping(void* base, uint64_t bytes, bool owned, const v1::SessionMemoryHeader& h)
    : base_(base),
      bytes_(bytes),
      owned_(owned),
      lane_count_(h.lane_count),
      lanes_offset_(h.lanes_offset),
      ring_offset_(h.ring_offset),
      ring_bytes_(h.ring_bytes) {}

SessionMapping::~SessionMapping() {
  if (owned_ && base_ != nullptr) ::munmap(base_, bytes_);
}

Status SessionMapping::Map(int memfd, const ExpectedLayout& expect, std::unique_ptr<SessionMapping>* out) {
  struct stat st {};
  if (::fstat(memfd, &st) != 0) {
    return Status::Internal("fstat(session memfd): ", std::strerror(errno));
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (expect.total_bytes != 0 && size != expect.total_bytes) {
    return Status::Internal("session memfd is ", size, " bytes, the daemon announced ",
                            expect.total_bytes);
  }
  if (size < sizeof(v1::SessionMemoryHeader) || size % kPage != 0) {
    return Status::Internal("session memfd size ", size, " is not a page multiple >= 4096");
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (p == MAP_FAILED) return Status::Internal("mmap(session memfd, ", size, "): ", std::strerror(errno));
  // Validate a private copy: the daemon can change the shared page at any
  // time, and only values checked once are used afterwards.
  v1::SessionMemoryHeader h;
  std::memcpy(&h, p, sizeof(h));
  Status s = ValidateSessionMemoryHeader(h, size, expect);
  if (!s.ok()) {
    ::munmap(p, size);
    return s;
  }
  out->reset(new SessionMapping(p, size, /*owned=*/true, h));
  return Status::Ok();
}

Status SessionMapping::Wrap(void* base, uint64_t bytes, const ExpectedLayout& expect,
                           std::unique_ptr<SessionMapping>* out) {
  if (bytes < sizeof(v1::SessionMemoryHeader)) {
    return Status::Internal("session memory is ", bytes, " bytes, smaller than its header");
  }
  v1::SessionMemoryHeader h;
  std::memcpy(&h, base, sizeof(h));
  OPD_RETURN_IF_ERROR(ValidateSessionMemoryHeader(h, bytes, expect));
  out->reset(new SessionMapping(base, bytes, /*owned=*/false, h));
  return Status::Ok();
}

v1::LaneSemaphores* SessionMapping::lane(uint32_t lane) const {
  return reinterpret_cast<v1::LaneSemaphores*>(static_cast<char*>(base_) + lane_offset(lane));
}

uint64_t SessionMapping::daemon_heartbeat() const {
  const auto* h = static_cast<const v1::SessionMemoryHeader*>(base_);
  return __atomic_load_n(&h->daemon_heartbeat, __ATOMIC_ACQUIRE);
}

uint64_t SessionMapping::daemon_pid() const {
  const auto* h = static_cast<const v1::SessionMemoryHeader*>(base_);
  return __atomic_load_n(&h->daemon_pid, __ATOMIC_ACQUIRE);
}

uint64_t LoadSemaphore(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

void StoreSemaphore(uint64_t* p, uint64_t value) { __atomic_store_n(p, value, __ATOMIC_RELEASE); }

uint64_t RaiseSemaphore(uint64_t* p, uint64_t value) {
  uint64_t cur = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  // Compared as the GPU's GEQ compares: (int64)(cur - value) >= 0.
  while (static_cast<int64_t>(cur - value) < 0) {
    if (__atomic_compare_exchange_n(p, &cur, value, /*weak=*/false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      return value;
    }
  }
  return cur;
}

}  // namespace cache_dit_opd::client
