#include "server/session/session.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

namespace cache_dit_opd {
namespace {

constexpr size_t kPage = 4096;
// One cache line per private counter: the lane streams write them
// concurrently.
constexpr size_t kCounterStride = 64;

}  // namespace

Status Session::Create(const SessionConfig& config, DeviceOps* device, RegionOpener* opener,
                       std::shared_ptr<Session>* out) {
  std::shared_ptr<Session> s(new Session(config, device));
  // On any failure below, the destructor releases what was acquired.
  OPD_RETURN_IF_ERROR(SessionMemory::Create(config.id, config.lanes, config.ring_capacity, &s->memory_));
  uint64_t shm_device = 0;
  OPD_RETURN_IF_ERROR(device->RegisterHostMemory(s->memory_->data(), s->memory_->bytes(), &shm_device));
  s->memory_registered_ = true;

  s->private_bytes_ = (config.lanes * kCounterStride + kPage - 1) / kPage * kPage;
  void* p = mmap(nullptr, s->private_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Status::Internal("mmap(private counters): ", std::strerror(errno));
  s->private_page_ = p;
  uint64_t private_device = 0;
  OPD_RETURN_IF_ERROR(device->RegisterHostMemory(p, s->private_bytes_, &private_device));
  s->private_registered_ = true;

  for (uint32_t i = 0; i < config.lanes; ++i) {
    auto lane = std::make_unique<Lane>();
    lane->index = i;
    uint64_t done_offset = SessionMemory::LaneOffset(i) + offsetof(v1::LaneSemaphores, done);
    lane->shm_done_address = shm_device + done_offset;
    lane->shm_inputs_address =
        shm_device + SessionMemory::LaneOffset(i) + offsetof(v1::LaneSemaphores, inputs_ready);
    lane->completed = reinterpret_cast<uint64_t*>(static_cast<char*>(p) + i * kCounterStride);
    lane->completed_address = private_device + i * kCounterStride;
    OPD_RETURN_IF_ERROR(device->CreateStream(&lane->stream));
    s->lanes_.push_back(std::move(lane));
  }
  Session* raw = s.get();
  s->regions_ = std::make_unique<RegionRegistry>(
      opener, config.device, config.region_limits, config.lanes,
      [raw](uint32_t lane) { return raw->lanes_[lane]->Completed(); });
  *out = std::move(s);
  return Status::Ok();
}

Session::~Session() {
  ReleaseDeviceResources();
  regions_.reset();
  if (private_page_ != nullptr) munmap(private_page_, private_bytes_);
}

bool Session::Drained() const {
  for (const auto& lane : lanes_) {
    if (lane->Completed() < lane->enqueued.load(std::memory_order_acquire)) return false;
  }
  return true;
}

void Session::Abandon() {
  if (released_) return;
  released_ = true;
  if (regions_) regions_->Abandon();
}

void Session::ReleaseDeviceResources() {
  if (released_) return;
  released_ = true;
  if (regions_) {
    regions_->CloseRegistry();
    // The lanes drained, so every region is idle and closes now; the
    // registry object stays for late lookups (they get NOT_FOUND).
    regions_->ReleaseCompleted();
  }
  for (auto& lane : lanes_) {
    if (lane->stream != nullptr) device_->DestroyStream(lane->stream);
    lane->stream = nullptr;
  }
  if (memory_registered_) device_->UnregisterHostMemory(memory_->data());
  memory_registered_ = false;
  if (private_registered_) device_->UnregisterHostMemory(private_page_);
  private_registered_ = false;
  // Lanes keep pointing into the private page until the Session dies.
}

}  // namespace cache_dit_opd
