// File: server/store/weight_store.h
//
// The weight store's bookkeeping: named, immutable tensors in daemon-owned
// memory that outlive the clients that published them. This class decides
// names, visibility, ownership, access, the byte limit and when memory is
// freed; where the bytes live is the StoreAllocator's (GPU memory in the
// daemon, host memory in tests), and how they get there is the publisher's
// fill function (a safetensors file, a copy of a client's tensors).
//
// Memory: one block per published set, its entries at offsets that are
// multiples of kStoreAlignment, in the set's order. A block is what a client
// maps when it attaches an entry (the whole block, read-only: every entry of
// a set has the same owner and readers), and what the limit counts
// (StoreAllocator::AllocationBytes of the set's extent). "Read-only" is kept
// by the daemon's dispatch and by this project's client; the descriptor
// itself carries no access rights, so a hostile reader can write the block
// (docs/DESIGN.md section 5 says what that means for who may read a set).
//
// Contract:
//   - Names are hierarchical: segments of [A-Za-z0-9._-] joined by '/', at
//     most kMaxStoreNameBytes, no empty segment, none "." or "..". A bad
//     name is BAD_ARGUMENT naming it and its first bad byte.
//   - Publish(owner, specs, readers, fill): all or nothing, and atomic for
//     readers: the names are reserved (ALREADY_EXISTS naming a name that is
//     published or being published), the bytes reserved against the limit
//     (RESOURCE_EXHAUSTED naming the bytes asked, in use and the limit),
//     memory allocated and filled (fill(i, block) for each spec, without any
//     lock held); then every entry of the set becomes visible at once. A
//     failed fill or allocation frees what the set took and publishes
//     nothing; names and bytes are free again.
//   - Access: an entry is owned by the publishing uid. Lookup (and List)
//     admits the owner, the uids named at publish time, peers that have
//     --allowed-gid as primary or supplementary group, and root; anything
//     else is PERMISSION_DENIED naming the uid and the entry (it exists:
//     saying so leaks only the name the peer asked for). List leaves out the
//     entries a peer may not read.
//   - Delete: the owner or root; the entry disappears from lookups at once.
//     Its set's block is freed once every entry of the set is deleted and
//     the last StoreRef to any of them is dropped (an attachment holds one
//     until its last call has finished): deferred deletion. The block's
//     bytes count against the limit until then.
//   - Unknown names are NOT_FOUND naming the name.
//   - Thread safety: every method may be called from any thread; the lock is
//     never held while memory is allocated, filled or freed. The allocator
//     must outlive every StoreRef (a reference may outlive the store).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cache_dit_opd/v1/wire.h"
#include "common/call.h"
#include "common/status.h"
#include "server/device/store_memory.h"
#include "server/session/peer_policy.h"

namespace cache_dit_opd::server {

inline constexpr size_t kMaxStoreNameBytes = v1::kMaxStoreNameBytes;
// Where entries start in their set's block: what the kernels' vector loads
// and TMA boxes need (16), rounded up to the caching allocator's habit.
inline constexpr uint64_t kStoreAlignment = 256;

struct StoreTensorSpec {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
};

// One published tensor. Immutable once visible.
struct StoreEntry {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;  // prod(shape) * element size
  uid_t owner = 0;
  std::vector<uid_t> readers;
  uint64_t publish_id = 0;  // the set it was published with (1, 2, ...); names its block
  std::shared_ptr<StoreBlock> block;  // the set's memory; null for an empty tensor
  uint64_t offset = 0;                // the entry's first byte in `block`

  uint64_t address() const { return block ? block->address() + offset : 0; }
  // Copies into the entry's bytes [at, at + src.size()); INTERNAL past its end.
  Status Write(uint64_t at, std::span<const std::byte> src) const;
  // Copies the whole entry from device memory at `src`.
  Status CopyFromDevice(const void* src) const;
};

// A reference that keeps an entry (and its set's block) alive: a client's
// attachment, until its last call has finished. Dropping the last one of a
// deleted entry lets its block go.
using StoreRef = std::shared_ptr<const StoreEntry>;

struct StoreEntryInfo {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  uid_t owner = 0;
  long refs = 0;  // StoreRefs held outside the store: sessions that attached its set's block
  uint64_t publish_id = 0;
  uint64_t block_bytes = 0;  // its set's block (0 for an empty tensor)
  uint64_t offset = 0;       // its first byte in that block
};

class WeightStore {
 public:
  // `max_bytes`: --max-store-bytes (0: no entry fits). `allowed_gid`: the
  // daemon's --allowed-gid. `max_entries`: --max-store-entries, the entries
  // visible and being published (each costs host memory; an empty tensor
  // costs no bytes, so the byte limit alone would not bound them).
  WeightStore(StoreAllocator* allocator, uint64_t max_bytes, std::optional<gid_t> allowed_gid,
              uint64_t max_entries = 16384);
  ~WeightStore();
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  using Fill = std::function<Status(size_t index, const StoreEntry& entry)>;
  // Publishes `specs` as one set owned by `owner.uid`, readable as the
  // contract says (plus `readers`), in one block. `fill` writes entry i's
  // bytes (StoreEntry::Write / CopyFromDevice; never called for an empty
  // tensor). `published` (optional): the set's entries, in `specs` order,
  // as they became visible.
  Status Publish(const PeerCred& owner, const std::vector<StoreTensorSpec>& specs,
                 const std::vector<uid_t>& readers, const Fill& fill,
                 std::vector<StoreEntryInfo>* published = nullptr);
  Status Lookup(const PeerCred& who, std::string_view name, StoreRef* out) const;
  Status Delete(const PeerCred& who, std::string_view name);
  // The visible entries of the set `publish_id` that `who` may read (what a
  // session that attaches the set's block can reach), by name.
  std::vector<StoreRef> SetEntries(const PeerCred& who, uint64_t publish_id) const;
  // The entries `who` may read whose name starts with `prefix`, by name.
  std::vector<StoreEntryInfo> List(const PeerCred& who, std::string_view prefix = {}) const;

  uint64_t used_bytes() const;  // reserved + published + deleted-but-referenced
  size_t entries() const;       // visible
  uint64_t max_bytes() const { return max_bytes_; }
  uint64_t max_entries() const { return max_entries_; }

  // A valid hierarchical name, or BAD_ARGUMENT naming it.
  static Status CheckName(std::string_view name);

 private:
  struct Shared;  // what outlives the store for entries still referenced
  bool MayRead(const PeerCred& who, const StoreEntry& e) const;
  // What List and Publish report of an entry the store holds (`ref` is the
  // store's own reference: refs counts the others).
  static StoreEntryInfo Info(const StoreRef& ref);

  StoreAllocator* allocator_;
  const uint64_t max_bytes_;
  const std::optional<gid_t> allowed_gid_;
  const uint64_t max_entries_;
  std::shared_ptr<Shared> shared_;
  mutable std::mutex mu_;
  std::map<std::string, StoreRef, std::less<>> entries_;  // visible
  std::set<std::string, std::less<>> pending_;            // being published
  uint64_t next_publish_id_ = 1;
};

}  // namespace cache_dit_opd::server
