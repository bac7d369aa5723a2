#include "server/session/region_registry.h"

#include <algorithm>
#include <memory>

#include "common/intentional_leak.h"

namespace cache_dit_opd {

RegionRegistry::RegionRegistry(RegionOpener* opener, int device, RegionLimits limits, uint32_t lanes,
                               std::function<uint64_t(uint32_t)> completed)
    : opener_(opener), device_(device), limits_(limits), lanes_(lanes), completed_(std::move(completed)) {}

RegionRegistry::~RegionRegistry() {
  std::vector<Region> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : active_) all.push_back(std::move(r));
    for (auto& r : pending_) all.push_back(std::move(r));
    active_.clear();
    pending_.clear();
    id_by_handle_.clear();
  }
  CloseAll(all);
}

bool RegionRegistry::IdleLocked(const Region& r) const {
  if (r.pins > 0) return false;
  for (uint32_t l = 0; l < lanes_; ++l) {
    if (r.last_use[l] > completed_(l)) return false;
  }
  return true;
}

void RegionRegistry::CloseAll(std::vector<Region>& regions) {
  for (Region& r : regions) {
    if (!r.lent) opener_->Close(r.base);
  }
  regions.clear();  // a lent region's keep-alive references go here
}

Status RegionRegistry::MakeRoomLocked(uint64_t bytes, std::vector<Region>* evicted) {
  auto count = [&] { return uint64_t{active_.size()} + pending_.size(); };
  while (count() + 1 > limits_.max_regions || mapped_bytes_ + bytes > limits_.max_bytes) {
    // LRU among idle regions; pending ones are not ours to evict.
    auto victim = active_.end();
    for (auto it = active_.begin(); it != active_.end(); ++it) {
      if (!IdleLocked(it->second)) continue;
      if (victim == active_.end() || it->second.lru_tick < victim->second.lru_tick) victim = it;
    }
    if (victim == active_.end()) {
      if (count() + 1 > limits_.max_regions) {
        return Status::Rejected(Reason::kResourceExhausted, "session has ", count(), " regions mapped (--max-regions ",
                                limits_.max_regions, ") and none is idle");
      }
      return Status::Rejected(Reason::kResourceExhausted, "session has ", mapped_bytes_, " bytes mapped; ", bytes,
                              " more would exceed --max-mapped-bytes ", limits_.max_bytes, " and no region is idle");
    }
    mapped_bytes_ -= victim->second.mapped_bytes();
    id_by_handle_.erase(victim->second.handle);
    evicted->push_back(std::move(victim->second));
    active_.erase(victim);
  }
  return Status::Ok();
}

Status RegionRegistry::Register(std::string_view handle, uint64_t claimed_size, Registered* out) {
  if (handle.size() != kIpcHandleBytes) {
    return Status::Rejected(Reason::kBadArgument, "ipc_handle is ", handle.size(), " bytes, expected ", kIpcHandleBytes);
  }
  ReleaseCompleted();  // finished pending releases free room first
  std::string key(handle);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status::Rejected(Reason::kSessionEnded, "session is closed");
    if (auto it = id_by_handle_.find(key); it != id_by_handle_.end()) {
      Region& r = active_.at(it->second);
      if (claimed_size > r.size) {
        return Status::Rejected(Reason::kBadArgument, "size ", claimed_size, " exceeds the allocation of ", r.size,
                                       " bytes this handle maps");
      }
      r.lru_tick = ++tick_;
      *out = Registered{r.id, r.size, true};
      return Status::Ok();
    }
    // Waiting for release: CUDA maps a handle once per process, so revive it.
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->handle != key) continue;
      if (claimed_size > it->size) {
        return Status::Rejected(Reason::kBadArgument, "size ", claimed_size, " exceeds the allocation of ", it->size,
                                       " bytes this handle maps");
      }
      Region r = std::move(*it);
      pending_.erase(it);
      r.lru_tick = ++tick_;
      *out = Registered{r.id, r.size, true};
      id_by_handle_[key] = r.id;
      active_.emplace(r.id, std::move(r));
      return Status::Ok();
    }
  }

  void* base = nullptr;
  uint64_t size = 0;
  OPD_RETURN_IF_ERROR(opener_->Open(handle, &base, &size));
  // From here on every error path must close what was opened.
  bool keep = false;
  struct CloseUnlessKept {
    RegionOpener* opener;
    void* base;
    const bool* keep;
    ~CloseUnlessKept() {
      if (!*keep) opener->Close(base);
    }
  } guard{opener_, base, &keep};

  if (claimed_size > size) {
    return Status::Rejected(Reason::kBadArgument, "size ", claimed_size, " exceeds the allocation of ", size,
                                   " bytes the driver reports for this handle");
  }
  if (size > limits_.max_bytes) {
    return Status::Rejected(Reason::kResourceExhausted, "region of ", size, " bytes exceeds --max-mapped-bytes ",
                                     limits_.max_bytes);
  }

  std::vector<Region> evicted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status::Rejected(Reason::kSessionEnded, "session is closed");
    if (auto it = id_by_handle_.find(key); it != id_by_handle_.end()) {
      // Registered concurrently: our open was one more reference; drop it.
      Region& r = active_.at(it->second);
      r.lru_tick = ++tick_;
      *out = Registered{r.id, r.size, true};
      return Status::Ok();
    }
    OPD_RETURN_IF_ERROR(MakeRoomLocked(size, &evicted));
    Region r;
    r.id = next_id_++;
    r.handle = key;
    r.base = base;
    r.size = size;
    r.last_use.assign(lanes_, 0);
    r.lru_tick = ++tick_;
    mapped_bytes_ += size;
    id_by_handle_[key] = r.id;
    *out = Registered{r.id, size, false};
    active_.emplace(r.id, std::move(r));
    keep = true;
  }
  // Evicted regions were idle: nothing of ours still runs on them.
  CloseAll(evicted);
  return Status::Ok();
}

Status RegionRegistry::RegisterLent(const std::string& key, void* base, uint64_t size, Lent how,
                                    std::vector<std::shared_ptr<const void>> keepalive, Registered* out) {
  if (key.size() == kIpcHandleBytes) return Status::Internal("a lent region key of an IPC handle's size");
  if (how.counts_bytes && size > limits_.max_bytes) {
    return Status::Rejected(Reason::kResourceExhausted, "region of ", size, " bytes exceeds --max-mapped-bytes ",
                            limits_.max_bytes);
  }
  ReleaseCompleted();  // finished pending releases free room first
  std::vector<Region> evicted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status::Rejected(Reason::kSessionEnded, "session is closed");
    // A region known already maps its memory at its base. What a caller
    // mapped for it again (two requests for the same chunks raced, or one
    // came for a region waiting for release) is a second mapping nothing
    // uses: it is not kept, so it goes when this returns instead of staying,
    // uncounted, until the region goes. A store block's keep-alives are
    // references to what the region already lends: kept once each.
    auto keep = [&](Region& r, bool known) {
      if (!(known && how.counts_bytes)) {
        for (auto& k : keepalive) {
          if (std::find(r.keepalive.begin(), r.keepalive.end(), k) == r.keepalive.end()) {
            r.keepalive.push_back(std::move(k));
          }
        }
      }
      r.lru_tick = ++tick_;
      *out = Registered{r.id, r.size, true};
    };
    if (auto it = id_by_handle_.find(key); it != id_by_handle_.end()) {
      keep(active_.at(it->second), true);
      return Status::Ok();
    }
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {  // unregistered, not released yet: revive
      if (it->handle != key) continue;
      Region r = std::move(*it);
      pending_.erase(it);
      keep(r, true);
      id_by_handle_[key] = r.id;
      active_.emplace(r.id, std::move(r));
      return Status::Ok();
    }
    OPD_RETURN_IF_ERROR(MakeRoomLocked(how.counts_bytes ? size : 0, &evicted));
    Region r;
    r.id = next_id_++;
    r.handle = key;
    r.base = base;
    r.size = size;
    r.lent = true;
    r.how = how;
    r.last_use.assign(lanes_, 0);
    keep(r, false);
    mapped_bytes_ += r.mapped_bytes();
    id_by_handle_[key] = r.id;
    *out = Registered{r.id, size, false};
    active_.emplace(r.id, std::move(r));
  }
  CloseAll(evicted);
  return Status::Ok();
}

bool RegionRegistry::FindLent(const std::string& key, uint64_t* region_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = id_by_handle_.find(key);
  if (it == id_by_handle_.end()) return false;
  Region& r = active_.at(it->second);
  r.lru_tick = ++tick_;
  *region_id = r.id;
  return true;
}

Status RegionRegistry::Unregister(uint64_t region_id, bool* deferred) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(region_id);
  if (it == active_.end()) return Status::Rejected(Reason::kRegionUnknown, "region ", region_id, " is not registered in this session");
  *deferred = !IdleLocked(it->second);
  id_by_handle_.erase(it->second.handle);
  pending_.push_back(std::move(it->second));
  active_.erase(it);
  return Status::Ok();
}

Status RegionRegistry::Resolve(uint64_t region_id, MappedRegion* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(region_id);
  if (it == active_.end()) return Status::Rejected(Reason::kRegionUnknown, "region ", region_id, " is not registered in this session");
  *out = it->second.Mapped(device_);
  return Status::Ok();
}

Status RegionRegistry::ResolveForCall(uint64_t region_id, uint32_t lane, uint64_t seq, MappedRegion* out) {
  if (lane >= lanes_) return Status::Rejected(Reason::kLaneRange, "lane ", lane, " out of range [0, ", lanes_, ")");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(region_id);
  if (it == active_.end()) return Status::Rejected(Reason::kRegionUnknown, "region ", region_id, " is not registered in this session");
  Region& r = it->second;
  r.last_use[lane] = std::max(r.last_use[lane], seq);
  r.lru_tick = ++tick_;
  *out = r.Mapped(device_);
  return Status::Ok();
}

RegionRegistry::Region* RegionRegistry::FindAnyLocked(uint64_t region_id) {
  if (auto it = active_.find(region_id); it != active_.end()) return &it->second;
  for (Region& r : pending_) {
    if (r.id == region_id) return &r;
  }
  return nullptr;
}

Status RegionRegistry::PinForCopy(uint64_t region_id, MappedRegion* out, Pin* pin) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(region_id);
  if (it == active_.end()) return Status::Rejected(Reason::kRegionUnknown, "region ", region_id, " is not registered in this session");
  ++it->second.pins;
  it->second.lru_tick = ++tick_;
  *out = it->second.Mapped(device_);
  pin->registry_ = this;
  pin->id_ = region_id;
  return Status::Ok();
}

void RegionRegistry::Unpin(uint64_t region_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Region* r = FindAnyLocked(region_id); r != nullptr && r->pins > 0) --r->pins;
}

RegionRegistry::Pin::~Pin() {
  if (registry_ != nullptr) registry_->Unpin(id_);
}

size_t RegionRegistry::ReleaseCompleted() {
  std::vector<Region> done;
  size_t remaining = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto keep_end = std::partition(pending_.begin(), pending_.end(),
                                   [&](const Region& r) { return !IdleLocked(r); });
    for (auto it = keep_end; it != pending_.end(); ++it) {
      mapped_bytes_ -= it->mapped_bytes();
      done.push_back(std::move(*it));
    }
    pending_.erase(keep_end, pending_.end());
    remaining = pending_.size();
  }
  CloseAll(done);
  return remaining;
}

void RegionRegistry::CloseRegistry() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  for (auto& [id, r] : active_) pending_.push_back(std::move(r));
  active_.clear();
  id_by_handle_.clear();
}

void RegionRegistry::Abandon() {
  std::lock_guard<std::mutex> lock(mu_);
  // Lent regions hold the daemon's memory (store blocks, a client's chunk
  // mappings) through their keep-alives; a copy or kernel still on the GPU
  // may read it, so they are kept for the process's life, like the mappings.
  auto kept = std::make_unique<std::vector<std::shared_ptr<const void>>>();
  for (auto& [id, r] : active_) kept->insert(kept->end(), r.keepalive.begin(), r.keepalive.end());
  for (Region& r : pending_) kept->insert(kept->end(), r.keepalive.begin(), r.keepalive.end());
  IntentionalLeak(kept);
  closed_ = true;
  active_.clear();
  pending_.clear();
  id_by_handle_.clear();
  mapped_bytes_ = 0;
}

RegionCounts RegionRegistry::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return RegionCounts{active_.size(), mapped_bytes_, pending_.size()};
}

bool RegionRegistry::has_pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !pending_.empty();
}

}  // namespace cache_dit_opd
