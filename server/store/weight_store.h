// File: server/store/weight_store.h
//
// The weight store's bookkeeping: named, immutable tensors in daemon-owned
// memory that outlive the clients that published them (issue 20). This class
// decides names, visibility, ownership, access, the byte limit and when
// memory is freed; where the bytes live is the StoreAllocator's (GPU memory
// in the daemon, host memory in tests), and how they get there is the
// publisher's fill function (a safetensors file, a client's upload).
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
//   - Delete: the owner or root; the entry disappears from lookups at once,
//     its memory is freed when the last StoreRef to it is dropped (a call in
//     flight or a client's mapping holds one): deferred deletion. Bytes count
//     against the limit until then.
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
#include <string>
#include <string_view>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/device/store_memory.h"
#include "server/session/peer_policy.h"

namespace cache_dit_opd::server {

inline constexpr size_t kMaxStoreNameBytes = 512;

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
  uint64_t publish_id = 0;  // the set it was published with (1, 2, ...)
  std::unique_ptr<StoreBlock> block;  // null for an empty tensor
};

// A reference that keeps an entry's memory alive (a call in flight, a
// client's mapping). Dropping the last one of a deleted entry frees it.
using StoreRef = std::shared_ptr<const StoreEntry>;

struct StoreEntryInfo {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  uid_t owner = 0;
  long refs = 0;  // StoreRefs held outside the store (calls, mappings)
};

class WeightStore {
 public:
  // `max_bytes`: --max-store-bytes (0: no entry fits). `allowed_gid`: the
  // daemon's --allowed-gid.
  WeightStore(StoreAllocator* allocator, uint64_t max_bytes, std::optional<gid_t> allowed_gid);
  ~WeightStore();
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  using Fill = std::function<Status(size_t index, const StoreEntry& entry)>;
  // Publishes `specs` as one set owned by `owner.uid`, readable as the
  // contract says (plus `readers`). `fill` writes entry i's bytes into its
  // block (never called for an empty tensor). `published` (optional): the
  // set's entries, in `specs` order, as they became visible.
  Status Publish(const PeerCred& owner, const std::vector<StoreTensorSpec>& specs,
                 const std::vector<uid_t>& readers, const Fill& fill,
                 std::vector<StoreEntryInfo>* published = nullptr);
  Status Lookup(const PeerCred& who, std::string_view name, StoreRef* out) const;
  Status Delete(const PeerCred& who, std::string_view name);
  // The entries `who` may read whose name starts with `prefix`, by name.
  std::vector<StoreEntryInfo> List(const PeerCred& who, std::string_view prefix = {}) const;

  uint64_t used_bytes() const;  // reserved + published + deleted-but-referenced
  size_t entries() const;       // visible
  uint64_t max_bytes() const { return max_bytes_; }

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
  std::shared_ptr<Shared> shared_;
  mutable std::mutex mu_;
  std::map<std::string, StoreRef, std::less<>> entries_;  // visible
  std::set<std::string, std::less<>> pending_;            // being published
  uint64_t next_publish_id_ = 1;
};

}  // namespace cache_dit_opd::server
