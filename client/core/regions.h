// File: client/core/regions.h
//
// Regions: a region is one client allocation (a cudaMalloc block, e.g. a
// caching-allocator segment) that the session exported once with a legacy
// CUDA IPC handle and the daemon mapped (docs/DESIGN.md sections 1 and 5). A
// tensor is then (region id, byte offset from the allocation base, sizes,
// strides, dtype): its memory never moves.
//
// RegionCache keeps one entry per allocation, keyed by (base, buffer id).
// CU_POINTER_ATTRIBUTE_BUFFER_ID is unique over the process's lifetime, so a
// freed and re-allocated address comes back with a new buffer id and is
// never sent as the old region: the stale entry is unregistered and the new
// allocation registered. Freed allocations should be unregistered
// (Forget/Prune) so the daemon's mapping stops pinning their memory.
//
// The driver and the daemon sit behind two small interfaces so that the
// cache logic and the offset arithmetic are tested without a GPU.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "common/call.h"
#include "common/status.h"

namespace cache_dit_opd::client {

using ::cache_dit_opd::DType;

// TensorView
//
// A tensor in client GPU memory as the caller describes it: the address of
// element [0, ..., 0], sizes and strides in elements (strides empty means
// contiguous row-major), and the wire dtype. Strides must be >= 0. A view
// with no element (a size of 0) touches no memory: its address is ignored
// (it may be null) and it travels without a region (MakeEmptyTensorRef).
struct TensorView {
  void* data = nullptr;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  DType dtype = DType::kUnspecified;
};

// Row-major contiguous strides of `sizes`.
std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& sizes);

// AllocationInfo
//
// One allocation as the driver reports it.
struct AllocationInfo {
  uint64_t base = 0;       // allocation base address (cuMemGetAddressRange)
  uint64_t size = 0;       // allocation size in bytes
  uint64_t buffer_id = 0;  // CU_POINTER_ATTRIBUTE_BUFFER_ID
  int device = -1;         // CUDA ordinal of this process
};

// ViewExtentBytes
//
// Bytes from element [0, ..., 0] to one past the last element the view can
// address: (sum (size_i - 1) * stride_i + 1) * itemsize, 0 when any size is
// 0. INVALID_ARGUMENT for negative sizes or strides, rank mismatch, more than
// kMaxTensorDims dims, an unknown dtype, or overflow.
Status ViewExtentBytes(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                       DType dtype, uint64_t* bytes);

// MakeTensorRef
//
// The wire form of `view` inside `alloc`, registered as `region_id`:
// byte_offset = data - alloc.base. INVALID_ARGUMENT (naming the values) when
// the view starts outside the allocation or its extent runs past the end;
// the daemon checks again, this only gives the caller an early, precise
// error.
Status MakeTensorRef(const TensorView& view, const AllocationInfo& alloc, uint64_t region_id,
                     TensorRef* out);

// MakeEmptyTensorRef
//
// The wire form of a view with no element (HasNoElements(view.sizes)):
// region kNoRegion, byte offset 0, whatever view.data is (wire.h); nothing
// is looked up or registered. INVALID_ARGUMENT for a view with an element
// or malformed sizes, strides or dtype.
Status MakeEmptyTensorRef(const TensorView& view, TensorRef* out);

// AllocationBackend
//
// The driver side of regions.
class AllocationBackend {
 public:
  virtual ~AllocationBackend() = default;
  // Lookup: the allocation containing `ptr` (hot path, one driver query).
  // INVALID_ARGUMENT when `ptr` is not device memory of this process that a
  // legacy IPC handle can export (host, managed, VMM/expandable-segment or
  // memory-pool memory), naming which.
  virtual Status Lookup(const void* ptr, AllocationInfo* info) = 0;
  // Export: the 64-byte legacy IPC handle of the allocation at `alloc.base`
  // (cuMemGetAddressRange confirms the base and size first).
  virtual Status Export(const AllocationInfo& alloc, std::array<uint8_t, 64>* handle) = 0;
  // ChunkId: the buffer id of the virtual-memory chunk (or allocation)
  // holding `ptr` (CU_POINTER_ATTRIBUTE_BUFFER_ID; one driver query): what
  // tells a chunk unmapped and mapped again from the one registered.
  virtual Status ChunkId(const void* ptr, uint64_t* buffer_id) = 0;
};

// One chunk of a run of client virtual memory registered as one region.
struct Chunk {
  uint64_t base = 0;
  uint64_t size = 0;
  uint64_t buffer_id = 0;
};

// RegionRegistrar
//
// The daemon side of regions (the session's RegisterRegion/UnregisterRegion).
class RegionRegistrar {
 public:
  virtual ~RegionRegistrar() = default;
  virtual Status Register(const AllocationInfo& alloc, const std::array<uint8_t, 64>& handle,
                          uint64_t* region_id) = 0;
  virtual Status Unregister(uint64_t region_id) = 0;
};

// ResolvedRegion: an allocation and its region id in the session.
struct ResolvedRegion {
  AllocationInfo alloc;
  uint64_t region_id = 0;
};

// RegionCache
//
// Which allocation of this process is which region of the session: a cache
// of the daemon's region table. With a registrar it registers what it misses
// (the C++ client); without one the owner of registration (the Python
// client's control plane) registers and calls Add.
class RegionCache {
 public:
  // `device`: the session's CUDA ordinal; allocations of other devices are
  // rejected. Both interfaces outlive the cache; `registrar` may be null.
  RegionCache(AllocationBackend* backend, RegionRegistrar* registrar, int device);

  // RegionCache::Resolve
  //
  // The region of the allocation containing `ptr`, registering it on first
  // use. A cached entry at the same base with another buffer id (or size) is
  // stale: it is unregistered, then the new allocation registered.
  Status Resolve(const void* ptr, ResolvedRegion* out);

  // RegionCache::Find
  //
  // Without registering anything: the region holding [ptr, ptr + nbytes)
  // when its allocation is cached as it is now (same base, size and buffer
  // id; a freed and re-made allocation has a new buffer id). One driver
  // query, none for a fixed range, one per chunk touched in a run.
  bool Find(const void* ptr, uint64_t nbytes, ResolvedRegion* out);

  // RegionCache::Add / Drop
  //
  // Entries registered (or forgotten) by the owner of registration.
  void Add(const AllocationInfo& alloc, uint64_t region_id);
  void Drop(uint64_t base);

  // RegionCache::AddFixed
  //
  // A range the owner itself mapped and keeps mapped until it calls Drop
  // (a weight-store block attached read-only): Find trusts it without
  // asking the driver, which knows such a mapping as no legacy allocation.
  // Its address range cannot be reused while it stays mapped, so no buffer
  // id is needed to tell it apart.
  void AddFixed(uint64_t base, uint64_t size, uint64_t region_id);

  // RegionCache::AddRun
  //
  // A run of consecutive virtual-memory chunks the owner registered as one
  // region (PyTorch's expandable segments): Find takes a view inside it when
  // every chunk the view touches still has its buffer id (one driver query
  // per chunk touched), so a chunk unmapped and mapped again is a miss.
  void AddRun(std::vector<Chunk> chunks, uint64_t region_id);
  // Drops the entries of these region ids (the daemon no longer knows them),
  // without telling the daemon.
  void ForgetIds(const std::vector<uint64_t>& region_ids);

  // RegionCache::Forget
  //
  // Unregisters the cached allocation that contains `ptr` (by address only,
  // so it works after the memory was freed). NOT_FOUND when none does.
  Status Forget(const void* ptr);

  // RegionCache::Prune
  //
  // Unregisters every cached allocation that no longer exists (freed, or
  // re-allocated with a new buffer id). `*removed` counts them.
  Status Prune(size_t* removed);

  // RegionCache::Clear
  //
  // Drops every entry without telling the daemon (the session is gone).
  void Clear();

  size_t size() const;

 private:
  // Find's run lookup (no lock held while it asks the driver).
  bool FindInRun(uint64_t p, uint64_t nbytes, ResolvedRegion* out);

  AllocationBackend* backend_;
  RegionRegistrar* registrar_;
  int device_;
  mutable std::mutex mu_;
  std::map<uint64_t, ResolvedRegion> by_base_;  // guarded by mu_
  std::map<uint64_t, ResolvedRegion> fixed_;    // AddFixed; guarded by mu_
  struct Run {
    ResolvedRegion region;
    std::vector<Chunk> chunks;
  };
  std::map<uint64_t, Run> runs_;                // AddRun, by base; guarded by mu_
};

}  // namespace cache_dit_opd::client
