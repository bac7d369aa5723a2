#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace cache_dit_opd {
namespace {

constexpr uint64_t kPage = 4096;

uint64_t RoundUp(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

}  // namespace

uint64_t SessionMemory::BytesFor(uint32_t lanes, uint64_t ring_bytes) {
  uint64_t lanes_end = RoundUp(LaneOffset(lanes), kPage);
  return lanes_end + RoundUp(ring_bytes, kPage);
}

Status SessionMemory::Create(uint64_t session_id, uint32_t lanes, uint64_t ring_bytes,
                             std::unique_ptr<SessionMemory>* out) {
  if (lanes == 0) return Status::InvalidArgument("a session needs at least one lane");
  std::unique_ptr<SessionMemory> m(new SessionMemory());
  m->lanes_ = lanes;
  m->bytes_ = BytesFor(lanes, ring_bytes);
  m->fd_ = memfd_create("cache-dit-opd-session", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (m->fd_ < 0) return Status::Internal("memfd_create: ", std::strerror(errno));
  if (ftruncate(m->fd_, static_cast<off_t>(m->bytes_)) != 0) {
    return Status::Internal("ftruncate(memfd, ", m->bytes_, "): ", std::strerror(errno));
  }
  // The client maps it too: a client that shrank it would make the daemon's
  // own accesses fault (SIGBUS). Writes stay allowed (semaphores, ring).
  if (fcntl(m->fd_, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    return Status::Internal("fcntl(F_ADD_SEALS): ", std::strerror(errno));
  }
  void* p = mmap(nullptr, m->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd_, 0);
  if (p == MAP_FAILED) return Status::Internal("mmap(memfd, ", m->bytes_, "): ", std::strerror(errno));
  m->data_ = p;

  auto* h = m->header();
  std::memset(h, 0, sizeof(*h));
  h->magic = v1::kSessionMemoryMagic;
  h->layout_version = v1::kLayoutVersion;
  h->total_bytes = m->bytes_;
  h->session_id = session_id;
  h->lane_count = lanes;
  h->lane_stride = sizeof(v1::LaneSemaphores);
  h->lanes_offset = v1::kLanesOffset;
  uint64_t ring_offset = RoundUp(LaneOffset(lanes), kPage);
  h->ring_offset = ring_bytes ? ring_offset : 0;
  h->ring_bytes = ring_bytes ? RoundUp(ring_bytes, kPage) : 0;
  h->daemon_pid = static_cast<uint64_t>(getpid());
  h->daemon_heartbeat = 0;
  // ftruncate zero-filled the lanes and the ring already.
  *out = std::move(m);
  return Status::Ok();
}

SessionMemory::~SessionMemory() {
  if (data_ != nullptr) munmap(data_, bytes_);
  if (fd_ >= 0) close(fd_);
}

v1::LaneSemaphores* SessionMemory::lane(uint32_t i) const {
  return reinterpret_cast<v1::LaneSemaphores*>(static_cast<char*>(data_) + LaneOffset(i));
}

uint64_t SessionMemory::InputsReady(uint32_t i) const {
  return std::atomic_ref<uint64_t>(lane(i)->inputs_ready).load(std::memory_order_acquire);
}

uint64_t SessionMemory::Done(uint32_t i) const {
  return std::atomic_ref<uint64_t>(lane(i)->done).load(std::memory_order_acquire);
}

void SessionMemory::Heartbeat() {
  std::atomic_ref<uint64_t>(header()->daemon_heartbeat).fetch_add(1, std::memory_order_release);
}

}  // namespace cache_dit_opd
