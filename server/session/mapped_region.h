// File: server/session/mapped_region.h
//
// A session's region as the daemon mapped it, and the lookup the call path
// uses to find one by id. The region registry (region_registry.h) implements
// RegionResolver; the dispatch layer (server/dispatch/) consumes it. Plain
// C++, header-only, so the torch-facing dispatch target can include it.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace cache_dit_opd {

// Device pointer of the allocation's base and the allocation size the driver
// reported (never the client's claim).
struct MappedRegion {
  void* base = nullptr;
  uint64_t size = 0;
  int device = -1;  // CUDA ordinal in the daemon's process
  // The daemon's own memory lent to the session read-only (a weight-store
  // block the client attached): no op may write it.
  bool read_only = false;
};

class RegionResolver {
 public:
  virtual ~RegionResolver() = default;
  // NOT_FOUND when the id is unknown to this session.
  virtual Status Resolve(uint64_t region_id, MappedRegion* out) const = 0;
};

}  // namespace cache_dit_opd
