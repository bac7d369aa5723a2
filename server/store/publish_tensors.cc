#include "server/store/publish_tensors.h"

#include <deque>

#include "common/view_extent.h"
#include "server/store/publish_file.h"

namespace cache_dit_opd::server {
namespace {

// The source of one entry: where it starts in the daemon's address space.
Status Source(const NamedTensor& t, RegionRegistry& regions, std::deque<RegionRegistry::Pin>* pins, const void** src) {
  const TensorRef& v = t.tensor;
  auto bad = [&](auto&&... why) {
    return Status::Rejected(Reason::kBadArgument, "publish '", t.name.substr(0, kMaxStoreNameBytes), "': ", why...);
  };
  if (!IsWireDType(static_cast<int64_t>(v.dtype))) return bad("dtype value ", static_cast<int>(v.dtype), " is not a wire dtype");
  if (v.sizes.size() > static_cast<size_t>(v1::kMaxTensorDims) || v.sizes.size() != v.strides.size()) {
    return bad(v.sizes.size(), " sizes and ", v.strides.size(), " strides (equal, at most ", v1::kMaxTensorDims, ")");
  }
  const auto item = static_cast<uint64_t>(DTypeSize(v.dtype));
  uint64_t extent = 0;
  if (!ViewExtentBytes(v.sizes, v.strides, item, &extent)) return bad("a negative size or stride, or an extent past 64 bits");
  if (HasNoElements(v.sizes)) {
    *src = nullptr;  // nothing to copy, no region to pin (wire.h kNoRegion or not)
    return Status::Ok();
  }
  int64_t expected = 0;
  if (const int i = FirstNonContiguousDim(v.sizes, v.strides, &expected); i >= 0) {
    return bad("the tensor must be contiguous, but dim ", i, " has stride ", v.strides[i], " where ", expected,
               " is needed");
  }
  if (v.region_id == kNoRegion) return bad("region ", kNoRegion, " holds no memory, only tensors with no element");
  MappedRegion region;
  RegionRegistry::Pin pin;
  if (Status s = regions.PinForCopy(v.region_id, &region, &pin); !s.ok()) {
    return s.Annotated("publish '" + t.name.substr(0, kMaxStoreNameBytes) + "': ");
  }
  pins->push_back(std::move(pin));
  uint64_t end = 0;
  if (v.byte_offset % item != 0 || __builtin_add_overflow(v.byte_offset, extent, &end) || end > region.size) {
    return bad("bytes [", v.byte_offset, ", +", extent, ") of ", item, "-byte elements do not lie aligned in region ",
               v.region_id, " (", region.size, " bytes)");
  }
  *src = static_cast<const char*>(region.base) + v.byte_offset;
  return Status::Ok();
}

}  // namespace

Status PublishTensors(WeightStore& store, const PeerCred& owner, RegionRegistry& regions,
                      const std::vector<NamedTensor>& tensors, const std::vector<uid_t>& readers,
                      std::vector<StoreEntryInfo>* out) {
  out->clear();
  if (tensors.size() > kMaxPublishTensors) {
    return Status::Rejected(Reason::kBadArgument, "publish: ", tensors.size(), " tensors (at most ", kMaxPublishTensors,
                            " a set)");
  }
  std::deque<RegionRegistry::Pin> pins;  // until the copies are done
  std::vector<const void*> sources(tensors.size());
  std::vector<StoreTensorSpec> specs;
  specs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    OPD_RETURN_IF_ERROR(Source(tensors[i], regions, &pins, &sources[i]));
    specs.push_back({tensors[i].name, tensors[i].tensor.dtype, tensors[i].tensor.sizes});
  }
  return store.Publish(owner, specs, readers,
                       [&](size_t i, const StoreEntry& e) { return e.CopyFromDevice(sources[i]); }, out);
}

}  // namespace cache_dit_opd::server
