// File: server/session/region_registry.h
//
// One session's mapped regions (client allocations opened from their CUDA IPC
// handles). Modeled on Triton's shared_memory_manager (bounds, pinning,
// deferred unregister) with the daemon's GPU-ordered lifetime rule
// (docs/DESIGN.md section 5): a region is released (unregister, LRU eviction,
// session end) only once every lane's "done" has passed the last call that
// used it.
//
// Keys: handle bytes. Registering a handle already mapped in the session
// returns the same id (reused = true); one that is waiting for release is
// revived. Bounds per session: region count and mapped bytes; when a new
// region does not fit, idle regions are evicted least recently used first,
// and RESOURCE_EXHAUSTED names the limit when nothing can be evicted.
//
// In-use tracking: every call resolves its regions through
// ResolveForCall(id, lane, seq), which records "lane `lane` uses the region
// up to seq `seq`" under the same lock as the lookup, so a region cannot be
// released between a call's lookup and its launch. A region is idle when for
// every lane, completed(lane) >= its last use there, where `completed` is the
// daemon's own record of what its lane stream finished (not the shared
// memory, which the client can write).
//
// Lent regions (RegisterLent): memory the registry does not open itself: a
// weight-store block the daemon lends the session (read-only:
// MappedRegion::read_only, the dispatch layer refuses a written tensor in
// one; not counted against max_bytes, the daemon maps nothing for it), or a
// run of a client's virtual-memory chunks the caller mapped (read-write,
// counted). The registry holds the caller's keep-alive references until the
// region is released by the same rules as any region, then drops them (a
// keep-alive may unmap on destruction). They count against max_regions and
// are keyed apart from IPC handles.
//
// Pins: a region pinned (PinForCopy) is not idle: it is released only after
// the pin is dropped, whatever the lanes say. For work outside the lanes
// (a publish copying a client's tensors into the store).
//
// Threads: all methods are thread-safe. Register and ReleaseCompleted call
// RegionOpener::Open/Close, which may synchronize the device, and dropping a
// shared region's last keep-alive may free device memory: the daemon runs
// them on its reaper thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/device/region_opener.h"
#include "server/session/mapped_region.h"

namespace cache_dit_opd {

struct RegionLimits {
  uint64_t max_regions = 4096;       // --max-regions
  uint64_t max_bytes = 1ull << 40;   // --max-mapped-bytes
};

struct RegionCounts {
  uint64_t regions = 0;         // registered (resolvable) regions
  uint64_t mapped_bytes = 0;    // bytes still mapped, pending releases included
  uint64_t pending_unmaps = 0;  // regions waiting for their last call to finish
};

class RegionRegistry final : public RegionResolver {
 public:
  // `completed(lane)` returns the highest seq the daemon's stream for `lane`
  // has finished; it must be callable from any thread.
  RegionRegistry(RegionOpener* opener, int device, RegionLimits limits, uint32_t lanes,
                 std::function<uint64_t(uint32_t lane)> completed);
  // Closes whatever is still mapped (callers first make sure the lanes are
  // drained; see ReleaseAll).
  ~RegionRegistry() override;

  struct Registered {
    uint64_t region_id = 0;
    uint64_t mapped_size = 0;
    bool reused = false;
  };

  // RegionRegistry::Register
  //
  // INVALID_ARGUMENT: handle not kIpcHandleBytes bytes, claimed size larger
  // than the allocation (the handle is closed again), or the opener's
  // refusal. RESOURCE_EXHAUSTED: the region alone exceeds max_bytes, or the
  // limits are reached and no region is idle.
  Status Register(std::string_view handle, uint64_t claimed_size, Registered* out);

  // RegionRegistry::RegisterLent
  //
  // Registers [base, base + size) as a region under `key` (never 64 bytes
  // long, so never an IPC handle's), holding `keepalive`. A key registered
  // already (or waiting for release: revived) returns its id (reused =
  // true), keeping each of `keepalive` it does not hold yet, except for a
  // region that counts bytes: `keepalive` is then a second mapping of the
  // same memory, released when this returns. RESOURCE_EXHAUSTED when the session holds max_regions
  // (or, counting bytes, max_bytes) and nothing idle can be evicted.
  struct Lent {
    bool read_only = true;      // daemon memory (a store block): no op may write it
    bool counts_bytes = false;  // mapped for this region: counts against max_bytes
  };
  Status RegisterLent(const std::string& key, void* base, uint64_t size, Lent how,
                      std::vector<std::shared_ptr<const void>> keepalive, Registered* out);

  // The id of the active region registered under `key` (RegisterLent),
  // marked recently used; false when there is none.
  bool FindLent(const std::string& key, uint64_t* region_id);

  // RegionRegistry::Unregister
  //
  // Removes the id at once (later lookups: NOT_FOUND) and schedules the
  // release; `*deferred` is true when calls still in flight delay it.
  // NOT_FOUND for an unknown id. The release itself happens in
  // ReleaseCompleted.
  Status Unregister(uint64_t region_id, bool* deferred);

  // RegionResolver: lookup without marking use (tests, introspection).
  Status Resolve(uint64_t region_id, MappedRegion* out) const override;

  // Lookup for call `seq` on `lane`: records the use, refreshes LRU order.
  // NOT_FOUND naming the id; INVALID_ARGUMENT for a lane out of range.
  Status ResolveForCall(uint64_t region_id, uint32_t lane, uint64_t seq, MappedRegion* out);

  // A pin on a region for work the lanes do not order: while it lives the
  // region is not released (nor evicted), also when unregistered meanwhile.
  class Pin {
   public:
    Pin() = default;
    Pin(Pin&& o) noexcept : registry_(o.registry_), id_(o.id_) { o.registry_ = nullptr; }
    Pin& operator=(Pin&&) = delete;
    ~Pin();

   private:
    friend class RegionRegistry;
    Pin(RegionRegistry* registry, uint64_t id) : registry_(registry), id_(id) {}
    RegionRegistry* registry_ = nullptr;
    uint64_t id_ = 0;
  };
  // The region `region_id` as Resolve sees it, pinned until `*pin` goes.
  Status PinForCopy(uint64_t region_id, MappedRegion* out, Pin* pin);

  // Closes every pending region whose lanes have passed its last use.
  // Returns how many remain pending.
  size_t ReleaseCompleted();

  // Session end: schedules every region for release (ids stop resolving)
  // and refuses later registrations (FAILED_PRECONDITION).
  void CloseRegistry();

  // Forgets every mapping without closing it and keeps every lent region's
  // keep-alives for the process's life (the process is about to exit with
  // work still on the GPU, which may read them; the driver unmaps at exit).
  void Abandon();

  RegionCounts counts() const;
  bool has_pending() const;

 private:
  struct Region {
    uint64_t id = 0;
    std::string handle;  // the IPC handle, or a shared region's key
    void* base = nullptr;
    uint64_t size = 0;
    std::vector<uint64_t> last_use;  // per lane: last seq that used it
    uint64_t lru_tick = 0;
    uint32_t pins = 0;
    bool lent = false;  // RegisterLent: keep-alives instead of an opener mapping
    Lent how;
    std::vector<std::shared_ptr<const void>> keepalive;
    uint64_t mapped_bytes() const { return !lent || how.counts_bytes ? size : 0; }
    MappedRegion Mapped(int device) const { return MappedRegion{base, size, device, lent && how.read_only}; }
  };

  bool IdleLocked(const Region& r) const;
  // Makes room for one more region of `bytes` mapped bytes by evicting idle
  // regions, least recently used first, into `evicted`; RESOURCE_EXHAUSTED
  // when nothing idle is left.
  Status MakeRoomLocked(uint64_t bytes, std::vector<Region>* evicted);
  // Finds an active or pending region by id (pins outlive an unregister).
  Region* FindAnyLocked(uint64_t region_id);
  void Unpin(uint64_t region_id);
  // Closes regions outside the lock.
  void CloseAll(std::vector<Region>& regions);

  RegionOpener* const opener_;
  const int device_;
  const RegionLimits limits_;
  const uint32_t lanes_;
  const std::function<uint64_t(uint32_t)> completed_;

  mutable std::mutex mu_;
  std::map<uint64_t, Region> active_;                      // guarded by mu_
  std::unordered_map<std::string, uint64_t> id_by_handle_;  // active only; guarded by mu_
  std::vector<Region> pending_;                             // guarded by mu_
  // Ids count up from 1, never reused: 0 is wire.h's kNoRegion (an empty
  // view without memory) and is never registered.
  uint64_t next_id_ = kNoRegion + 1;                        // guarded by mu_
  uint64_t tick_ = 0;                                       // guarded by mu_
  uint64_t mapped_bytes_ = 0;                               // active + pending; guarded by mu_
  bool closed_ = false;                                     // guarded by mu_
};

// A RegionResolver bound to one call: resolves through
// RegionRegistry::ResolveForCall so the dispatch layer's lookups mark use.
class CallRegionResolver final : public RegionResolver {
 public:
  CallRegionResolver(RegionRegistry* registry, uint32_t lane, uint64_t seq)
      : registry_(registry), lane_(lane), seq_(seq) {}
  Status Resolve(uint64_t region_id, MappedRegion* out) const override {
    return registry_->ResolveForCall(region_id, lane_, seq_, out);
  }

 private:
  RegionRegistry* registry_;
  uint32_t lane_;
  uint64_t seq_;
};

}  // namespace cache_dit_opd
