#include "client/core/regions.h"

#include <algorithm>
#include <sstream>

#include "common/hex.h"
#include "common/view_extent.h"

namespace cache_dit_opd::client {
namespace {

std::string Dims(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

}  // namespace

std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  int64_t s = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = s;
    // Saturate instead of overflowing: ViewExtentBytes rejects the view.
    if (sizes[i] > 1 && __builtin_mul_overflow(s, sizes[i], &s)) s = INT64_MAX;
  }
  return strides;
}

Status ViewExtentBytes(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                       DType dtype, uint64_t* bytes) {
  const int64_t item = DTypeSize(dtype);
  if (item == 0) return Status::InvalidArgument("tensor dtype ", DTypeName(dtype), " is not a wire dtype");
  if (sizes.size() != strides.size()) {
    return Status::InvalidArgument("tensor has ", sizes.size(), " sizes but ", strides.size(), " strides");
  }
  if (sizes.size() > static_cast<size_t>(kMaxTensorDims)) {
    return Status::InvalidArgument("tensor has ", sizes.size(), " dims, at most ", kMaxTensorDims,
                                   " are allowed");
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) return Status::InvalidArgument("tensor size ", Dims(sizes), " has a negative dim");
    if (strides[i] < 0) {
      return Status::InvalidArgument("tensor strides ", Dims(strides), " have a negative stride");
    }
  }
  if (!cache_dit_opd::ViewExtentBytes(sizes, strides, static_cast<uint64_t>(item), bytes)) {
    return Status::InvalidArgument("tensor sizes ", Dims(sizes), " with strides ", Dims(strides),
                                   " overflow 64 bits");
  }
  return Status::Ok();
}

Status MakeTensorRef(const TensorView& view, const AllocationInfo& alloc, uint64_t region_id,
                     TensorRef* out) {
  const std::vector<int64_t> strides = view.strides.empty() ? ContiguousStrides(view.sizes) : view.strides;
  uint64_t extent = 0;
  OPD_RETURN_IF_ERROR(ViewExtentBytes(view.sizes, strides, view.dtype, &extent));
  const auto data = reinterpret_cast<uint64_t>(view.data);
  if (data < alloc.base || data - alloc.base > alloc.size) {
    return Status::InvalidArgument("tensor data ", Hex(data), " is outside its allocation [",
                                   Hex(alloc.base), ", +", alloc.size, ")");
  }
  const uint64_t offset = data - alloc.base;
  if (extent > alloc.size - offset) {
    return Status::InvalidArgument("tensor of sizes ", Dims(view.sizes), ", strides ", Dims(strides),
                                   ", ", DTypeName(view.dtype), " spans ", extent, " bytes from offset ",
                                   offset, ", past the end of its ", alloc.size, "-byte allocation");
  }
  out->region_id = region_id;
  out->byte_offset = offset;
  out->sizes = view.sizes;
  out->strides = strides;
  out->dtype = view.dtype;
  return Status::Ok();
}

Status MakeEmptyTensorRef(const TensorView& view, TensorRef* out) {
  const std::vector<int64_t> strides = view.strides.empty() ? ContiguousStrides(view.sizes) : view.strides;
  uint64_t extent = 0;
  OPD_RETURN_IF_ERROR(ViewExtentBytes(view.sizes, strides, view.dtype, &extent));
  if (!HasNoElements(view.sizes)) {
    return Status::InvalidArgument("tensor of sizes ", Dims(view.sizes),
                                   " has elements: only an empty view travels without a region");
  }
  out->region_id = kNoRegion;
  out->byte_offset = 0;
  out->sizes = view.sizes;
  out->strides = strides;
  out->dtype = view.dtype;
  return Status::Ok();
}

RegionCache::RegionCache(AllocationBackend* backend, RegionRegistrar* registrar, int device)
    : backend_(backend), registrar_(registrar), device_(device) {}

Status RegionCache::Resolve(const void* ptr, ResolvedRegion* out) {
  AllocationInfo info;
  OPD_RETURN_IF_ERROR(backend_->Lookup(ptr, &info));
  if (info.device != device_) {
    return Status::InvalidArgument("tensor at ", Hex(reinterpret_cast<uint64_t>(ptr)),
                                   " lives on CUDA device ", info.device,
                                   ", but this session's daemon serves device ", device_);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_base_.find(info.base);
  if (it != by_base_.end()) {
    if (it->second.alloc.buffer_id == info.buffer_id && it->second.alloc.size == info.size) {
      *out = it->second;
      return Status::Ok();
    }
  }
  // Every cached entry overlapping the new allocation belongs to memory that
  // was freed (the driver hands an address range to one live allocation at a
  // time): release it in the daemon before registering the new one.
  auto first = by_base_.upper_bound(info.base);
  if (first != by_base_.begin()) {
    auto prev = std::prev(first);
    if (prev->first + prev->second.alloc.size > info.base) first = prev;
  }
  if (registrar_ == nullptr) {
    return Status::Rejected(Reason::kRegionUnknown, "allocation ", Hex(info.base), " (", info.size,
                            " bytes) is not registered with the daemon");
  }
  while (first != by_base_.end() && first->first < info.base + info.size) {
    Status u = registrar_->Unregister(first->second.region_id);
    first = by_base_.erase(first);
    // NOT_FOUND: the daemon already dropped it (eviction); nothing to undo.
    if (!u.ok() && u.code() != StatusCode::kNotFound) return u;
  }
  std::array<uint8_t, 64> handle{};
  OPD_RETURN_IF_ERROR(backend_->Export(info, &handle));
  uint64_t id = 0;
  OPD_RETURN_IF_ERROR(registrar_->Register(info, handle, &id));
  ResolvedRegion r{info, id};
  by_base_[info.base] = r;
  *out = r;
  return Status::Ok();
}

Status RegionCache::Forget(const void* ptr) {
  const auto p = reinterpret_cast<uint64_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_base_.upper_bound(p);
  if (it == by_base_.begin()) return Status::NotFound("no registered allocation contains ", Hex(p));
  --it;
  if (p >= it->first + it->second.alloc.size) {
    return Status::NotFound("no registered allocation contains ", Hex(p));
  }
  const uint64_t id = it->second.region_id;
  by_base_.erase(it);
  return registrar_ ? registrar_->Unregister(id) : Status::Ok();
}

bool RegionCache::Find(const void* ptr, uint64_t nbytes, ResolvedRegion* out) {
  const auto p = reinterpret_cast<uint64_t>(ptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = fixed_.upper_bound(p); it != fixed_.begin()) {
      const ResolvedRegion& r = (--it)->second;
      if (p - r.alloc.base < r.alloc.size) {
        if (nbytes > r.alloc.size - (p - r.alloc.base)) return false;
        *out = r;
        return true;
      }
    }
  }
  if (FindInRun(p, nbytes, out)) return true;
  AllocationInfo a;
  if (!backend_->Lookup(ptr, &a).ok() || a.device != device_) return false;
  // Lookup guarantees base <= p < base + size; the view must end inside too.
  if (nbytes > a.size - (p - a.base)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_base_.find(a.base);
  // A freed and re-made allocation at the same base has a new buffer id.
  if (it == by_base_.end() || it->second.alloc.buffer_id != a.buffer_id || it->second.alloc.size != a.size) {
    return false;
  }
  *out = it->second;
  return true;
}

void RegionCache::Add(const AllocationInfo& alloc, uint64_t region_id) {
  std::lock_guard<std::mutex> lock(mu_);
  by_base_[alloc.base] = ResolvedRegion{alloc, region_id};
}

bool RegionCache::FindInRun(uint64_t p, uint64_t nbytes, ResolvedRegion* out) {
  std::vector<Chunk> touched;
  ResolvedRegion found;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = runs_.upper_bound(p);
    if (it == runs_.begin()) return false;
    const Run& run = (--it)->second;
    const uint64_t base = run.region.alloc.base, size = run.region.alloc.size;
    if (p - base >= size || nbytes > size - (p - base)) return false;
    const uint64_t last = p + (nbytes == 0 ? 0 : nbytes - 1);
    for (const Chunk& c : run.chunks) {
      if (c.base + c.size > p && c.base <= last) touched.push_back(c);
    }
    found = run.region;
  }
  // The driver is asked outside the lock.
  for (const Chunk& c : touched) {
    uint64_t id = 0;
    if (!backend_->ChunkId(reinterpret_cast<const void*>(c.base), &id).ok() || id != c.buffer_id) return false;
  }
  *out = found;
  return true;
}

void RegionCache::AddRun(std::vector<Chunk> chunks, uint64_t region_id) {
  if (chunks.empty()) return;
  uint64_t size = 0;
  for (const Chunk& c : chunks) size += c.size;
  const uint64_t base = chunks.front().base;
  std::lock_guard<std::mutex> lock(mu_);
  runs_[base] = Run{ResolvedRegion{AllocationInfo{base, size, 0, device_}, region_id}, std::move(chunks)};
}

void RegionCache::AddFixed(uint64_t base, uint64_t size, uint64_t region_id) {
  std::lock_guard<std::mutex> lock(mu_);
  fixed_[base] = ResolvedRegion{AllocationInfo{base, size, 0, device_}, region_id};
}

void RegionCache::ForgetIds(const std::vector<uint64_t>& region_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  auto named = [&](uint64_t id) { return std::find(region_ids.begin(), region_ids.end(), id) != region_ids.end(); };
  for (auto* table : {&by_base_, &fixed_}) std::erase_if(*table, [&](const auto& kv) { return named(kv.second.region_id); });
  std::erase_if(runs_, [&](const auto& kv) { return named(kv.second.region.region_id); });
}

void RegionCache::Drop(uint64_t base) {
  std::lock_guard<std::mutex> lock(mu_);
  by_base_.erase(base);
  fixed_.erase(base);
  runs_.erase(base);
}

Status RegionCache::Prune(size_t* removed) {
  size_t n = 0;
  Status first_error;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = by_base_.begin(); it != by_base_.end();) {
    AllocationInfo now;
    Status s = backend_->Lookup(reinterpret_cast<const void*>(it->first), &now);
    if (s.ok() && now.base == it->first && now.buffer_id == it->second.alloc.buffer_id &&
        now.size == it->second.alloc.size) {
      ++it;
      continue;
    }
    Status u = registrar_ ? registrar_->Unregister(it->second.region_id) : Status::Ok();
    if (!u.ok() && u.code() != StatusCode::kNotFound && first_error.ok()) first_error = u;
    it = by_base_.erase(it);
    ++n;
  }
  if (removed) *removed = n;
  return first_error;
}

void RegionCache::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  by_base_.clear();
  fixed_.clear();
  runs_.clear();
}

size_t RegionCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_base_.size() + fixed_.size() + runs_.size();
}

}  // namespace cache_dit_opd::client
