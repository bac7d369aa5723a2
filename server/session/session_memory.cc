#include "server/session/session_memory.h"

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

uint64_t SessionMemory::RingOffset(uint32_t lanes) { return RoundUp(LaneOffset(lanes), kPage); }

uint64_t SessionMemory::BytesFor(uint32_t lanes, uint32_t ring_capacity) {
  return RingOffset(lanes) + (ring_capacity ? RoundUp(v1::RingBytes(ring_capacity), kPage) : 0);
}

Status SessionMemory::Create(uint64_t session_id, uint32_t lanes, uint32_t ring_capacity,
                             std::unique_ptr<SessionMemory>* out) {
  if (lanes == 0) return Status::InvalidArgument("a session needs at least one lane");
  if ((ring_capacity & (ring_capacity - 1)) != 0) {
    return Status::InvalidArgument("ring capacity ", ring_capacity, " is not a power of two");
  }
  std::unique_ptr<SessionMemory> m(new SessionMemory());
  m->lanes_ = lanes;
  m->bytes_ = BytesFor(lanes, ring_capacity);
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
  h->ring_offset = ring_capacity ? RingOffset(lanes) : 0;
  h->ring_bytes = ring_capacity ? v1::RingBytes(ring_capacity) : 0;
  h->daemon_pid = static_cast<uint64_t>(getpid());
  h->daemon_heartbeat = 0;
  // ftruncate zero-filled the lanes and the ring already (sq_tail, sq_head,
  // every done_ticket 0; doorbell kDoorbellAwake).
  if (ring_capacity) {
    m->ring_capacity_ = ring_capacity;
    m->ring_offset_ = RingOffset(lanes);
    v1::RingControl* c = m->ring_control();
    c->version = v1::kRingVersion;
    c->capacity = ring_capacity;
    c->slot_bytes = v1::kSlotBytes;
    c->completion_bytes = v1::kCompletionBytes;
  }
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

void SessionMemory::RaiseInputsReady(uint32_t i, uint64_t value) {
  std::atomic_ref<uint64_t> word(lane(i)->inputs_ready);
  uint64_t seen = word.load(std::memory_order_acquire);
  while (!(seen >= value && seen <= v1::kInputsReadyReleased) &&
         !word.compare_exchange_weak(seen, value, std::memory_order_acq_rel)) {
  }
}

uint64_t SessionMemory::Done(uint32_t i) const {
  return std::atomic_ref<uint64_t>(lane(i)->done).load(std::memory_order_acquire);
}

v1::RingControl* SessionMemory::ring_control() const {
  if (ring_capacity_ == 0) return nullptr;
  return reinterpret_cast<v1::RingControl*>(static_cast<char*>(data_) + ring_offset_);
}

const uint8_t* SessionMemory::ring_slot(uint64_t ticket) const {
  if (ring_capacity_ == 0) return nullptr;
  const uint64_t index = ticket & (ring_capacity_ - 1);
  return static_cast<const uint8_t*>(data_) + ring_offset_ + v1::kRingControlBytes + index * v1::kSlotBytes;
}

v1::CompletionRecord* SessionMemory::ring_completion(uint64_t ticket) const {
  if (ring_capacity_ == 0) return nullptr;
  const uint64_t index = ticket & (ring_capacity_ - 1);
  const uint64_t completions =
      ring_offset_ + v1::kRingControlBytes + uint64_t{ring_capacity_} * v1::kSlotBytes;
  return reinterpret_cast<v1::CompletionRecord*>(static_cast<char*>(data_) + completions +
                                                 index * v1::kCompletionBytes);
}

void SessionMemory::Heartbeat() {
  std::atomic_ref<uint64_t>(header()->daemon_heartbeat).fetch_add(1, std::memory_order_release);
}

}  // namespace cache_dit_opd
