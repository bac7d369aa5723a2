#include "server/store/weight_store.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <utility>

#include "common/view_extent.h"

namespace cache_dit_opd::server {
namespace {

inline constexpr size_t kMaxReaders = 64;

bool NameByte(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == '-';
}

std::string Shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

// The byte count the limit is checked against. Blocks subtract their bytes
// in their deleter, which may run after the store is gone (a StoreRef held
// by an attachment that ends later), so it lives in a block of its own.
struct WeightStore::Shared {
  std::atomic<uint64_t> used{0};
};

WeightStore::WeightStore(StoreAllocator* allocator, uint64_t max_bytes, std::optional<gid_t> allowed_gid,
                         uint64_t max_entries)
    : allocator_(allocator),
      max_bytes_(max_bytes),
      allowed_gid_(allowed_gid),
      max_entries_(max_entries),
      shared_(std::make_shared<Shared>()) {}

WeightStore::~WeightStore() {
  std::map<std::string, StoreRef, std::less<>> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries.swap(entries_);
  }
  // Dropped here, unlocked: an entry nobody else holds frees its memory now.
}

Status WeightStore::CheckName(std::string_view name) {
  auto bad = [&](auto&&... why) {
    return Status::Rejected(Reason::kBadArgument, "store name '", name.substr(0, kMaxStoreNameBytes), "': ", why...,
                            " (segments of A-Z a-z 0-9 . _ - joined by '/', at most ", kMaxStoreNameBytes, " bytes)");
  };
  if (name.empty()) return bad("empty");
  if (name.size() > kMaxStoreNameBytes) return bad(name.size(), " bytes");
  size_t start = 0;
  for (size_t i = 0; i <= name.size(); ++i) {
    if (i == name.size() || name[i] == '/') {
      std::string_view seg = name.substr(start, i - start);
      if (seg.empty()) return bad("an empty segment at byte ", start);
      if (seg == "." || seg == "..") return bad("the segment '", seg, "'");
      start = i + 1;
    } else if (!NameByte(name[i])) {
      return bad("byte ", i, " (0x", "0123456789abcdef"[static_cast<uint8_t>(name[i]) >> 4],
                 "0123456789abcdef"[static_cast<uint8_t>(name[i]) & 15], ") is not allowed");
    }
  }
  return Status::Ok();
}

bool WeightStore::MayRead(const PeerCred& who, const StoreEntry& e) const {
  if (who.uid == 0 || who.uid == e.owner) return true;
  if (std::find(e.readers.begin(), e.readers.end(), who.uid) != e.readers.end()) return true;
  if (!allowed_gid_) return false;
  return who.gid == *allowed_gid_ || std::find(who.groups.begin(), who.groups.end(), *allowed_gid_) != who.groups.end();
}

Status StoreEntry::Write(uint64_t at, std::span<const std::byte> src) const {
  if (at > bytes || src.size() > bytes - at) {
    return Status::Internal("store entry '", name, "': write of ", src.size(), " bytes at ", at, " past its ", bytes);
  }
  return block->Write(offset + at, src);
}

Status StoreEntry::CopyFromDevice(const void* src) const { return block->CopyFromDevice(offset, src, bytes); }

StoreEntryInfo WeightStore::Info(const StoreRef& ref) {
  return {ref->name,       ref->dtype, ref->shape, ref->bytes, ref->owner, ref.use_count() - 1, ref->publish_id,
          ref->block ? ref->block->bytes() : 0, ref->offset};
}

Status WeightStore::Publish(const PeerCred& owner, const std::vector<StoreTensorSpec>& specs,
                            const std::vector<uid_t>& readers, const Fill& fill,
                            std::vector<StoreEntryInfo>* published_out) {
  if (specs.empty()) return Status::Rejected(Reason::kBadArgument, "publish: no tensor to publish");
  if (readers.size() > kMaxReaders) {
    return Status::Rejected(Reason::kBadArgument, "publish: ", readers.size(), " reader uids (at most ", kMaxReaders, ")");
  }
  // Everything about the set that needs no lock: names, dtypes, sizes.
  std::vector<std::unique_ptr<StoreEntry>> made;
  std::set<std::string_view> names;
  uint64_t extent = 0;  // the set's bytes in its block, alignment gaps included
  for (const StoreTensorSpec& spec : specs) {
    if (Status s = CheckName(spec.name); !s.ok()) return s;
    if (!names.insert(spec.name).second) {
      return Status::Rejected(Reason::kBadArgument, "publish: the name '", spec.name, "' twice in one set");
    }
    if (!IsWireDType(static_cast<int64_t>(spec.dtype))) {
      return Status::Rejected(Reason::kBadArgument, "publish '", spec.name, "': dtype value ",
                              static_cast<int>(spec.dtype), " is not a wire dtype");
    }
    if (spec.shape.size() > v1::kMaxTensorDims) {
      return Status::Rejected(Reason::kBadArgument, "publish '", spec.name, "': shape ", Shape(spec.shape), " has more than ",
                              v1::kMaxTensorDims, " dimensions");
    }
    uint64_t bytes = 0;
    if (!DenseBytes(spec.shape, static_cast<uint64_t>(DTypeSize(spec.dtype)), &bytes)) {
      const bool negative = std::any_of(spec.shape.begin(), spec.shape.end(), [](int64_t d) { return d < 0; });
      return Status::Rejected(Reason::kBadArgument, "publish '", spec.name, "': shape ", Shape(spec.shape),
                              negative ? " has a negative size" : "'s byte count overflows 64 bits");
    }
    // The entry's place in the set's block: the next multiple of
    // kStoreAlignment (an empty tensor takes no place).
    auto e = std::make_unique<StoreEntry>();
    if (bytes > 0) {
      const uint64_t at = (extent + kStoreAlignment - 1) / kStoreAlignment * kStoreAlignment;
      if (at < extent || at > std::numeric_limits<uint64_t>::max() - bytes) {
        return Status::Rejected(Reason::kBadArgument, "publish: the set's byte count overflows 64 bits");
      }
      e->offset = at;
      extent = at + bytes;
    }
    e->name = spec.name;
    e->dtype = spec.dtype;
    e->shape = spec.shape;
    e->bytes = bytes;
    e->owner = owner.uid;
    e->readers = readers;
    made.push_back(std::move(e));
  }
  // What the block takes from the device, the limit's unit.
  const uint64_t total = allocator_->AllocationBytes(extent);
  if (total < extent) return Status::Rejected(Reason::kBadArgument, "publish: the set's byte count overflows 64 bits");

  // Reserve the names and the bytes.
  uint64_t publish_id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& e : made) {
      if (entries_.count(e->name) || pending_.count(e->name)) {
        return Status::Rejected(Reason::kStoreExists, "publish: store entry '", e->name, "' exists",
                                     entries_.count(e->name) ? "" : " (being published)",
                                     "; delete it first, or publish under another name");
      }
    }
    const uint64_t held = entries_.size() + pending_.size();
    if (made.size() > max_entries_ || held > max_entries_ - made.size()) {
      return Status::Rejected(Reason::kResourceExhausted, "publish: ", made.size(), " entries do not fit the store: ",
                              held, " of --max-store-entries ", max_entries_, " are held");
    }
    const uint64_t used = shared_->used.load();
    if (total > max_bytes_ || used > max_bytes_ - total) {
      return Status::Rejected(Reason::kResourceExhausted, "publish: ", total, " bytes do not fit the store: ", used,
                              " of --max-store-bytes ", max_bytes_, " are in use");
    }
    shared_->used += total;
    for (const auto& e : made) pending_.insert(e->name);
    publish_id = next_publish_id_++;
  }
  // Until the set is published, a failure gives back the names, and the
  // bytes unless its block was made (the block gives them back when it goes,
  // with `made`, unlocked).
  bool published = false;
  struct Release {
    WeightStore* store;
    const std::vector<std::unique_ptr<StoreEntry>>& made;
    uint64_t total;
    const bool& published;
    bool block_made = false;
    ~Release() {
      if (published) return;
      std::lock_guard<std::mutex> lock(store->mu_);
      for (const auto& e : made) store->pending_.erase(e->name);
      if (!block_made) store->shared_->used -= total;
    }
  } release{this, made, total, published};

  std::shared_ptr<StoreBlock> block;
  if (extent > 0) {
    std::unique_ptr<StoreBlock> raw;
    if (Status s = allocator_->Allocate(extent, &raw); !s.ok()) {
      return s.Annotated("publish of " + std::to_string(made.size()) + " tensors (" + std::to_string(extent) +
                         " bytes): ");
    }
    std::shared_ptr<Shared> shared = shared_;
    block.reset(raw.release(), [shared, total](StoreBlock* b) {
      delete b;
      shared->used -= total;
    });
    release.block_made = true;
  }
  for (size_t i = 0; i < made.size(); ++i) {
    StoreEntry& e = *made[i];
    e.publish_id = publish_id;
    if (e.bytes == 0) continue;
    e.block = block;
    if (Status s = fill(i, e); !s.ok()) return s.Annotated("publish '" + e.name + "': ");
  }
  block.reset();  // the entries hold it now

  // Visible at once. The block goes (and gives its bytes back) when the last
  // entry of the set does, wherever that happens: deferred deletion.
  std::vector<StoreRef> refs;
  refs.reserve(made.size());
  for (auto& e : made) refs.emplace_back(e.release());
  if (published_out) published_out->clear();
  std::lock_guard<std::mutex> lock(mu_);
  for (StoreRef& r : refs) {
    if (published_out) published_out->push_back(Info(r));
    pending_.erase(r->name);
    entries_.emplace(r->name, std::move(r));
  }
  made.clear();
  published = true;
  return Status::Ok();
}

Status WeightStore::Lookup(const PeerCred& who, std::string_view name, StoreRef* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return Status::Rejected(Reason::kStoreUnknown, "store entry '", name.substr(0, kMaxStoreNameBytes), "' does not exist",
                            pending_.count(name) ? " yet (its set is being published)" : "",
                            " (a restarted daemon's store is empty: publish it again)");
  }
  if (!MayRead(who, *it->second)) {
    return Status::Rejected(Reason::kStoreDenied, "store entry '", name, "' belongs to uid ", it->second->owner,
                                    ", which did not admit uid ", who.uid);
  }
  *out = it->second;
  return Status::Ok();
}

Status WeightStore::Delete(const PeerCred& who, std::string_view name) {
  StoreRef dropped;  // released after the lock: the last reference frees memory
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      return Status::Rejected(Reason::kStoreUnknown, "delete: store entry '", name.substr(0, kMaxStoreNameBytes), "' does not exist");
    }
    if (who.uid != 0 && who.uid != it->second->owner) {
      return Status::Rejected(Reason::kStoreDenied, "delete: store entry '", name, "' belongs to uid ", it->second->owner,
                                      "; uid ", who.uid, " may not delete it");
    }
    dropped = std::move(it->second);
    entries_.erase(it);
  }
  return Status::Ok();
}

std::vector<StoreRef> WeightStore::SetEntries(const PeerCred& who, uint64_t publish_id) const {
  std::vector<StoreRef> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, ref] : entries_) {
    if (ref->publish_id == publish_id && MayRead(who, *ref)) out.push_back(ref);
  }
  return out;
}

std::vector<StoreEntryInfo> WeightStore::List(const PeerCred& who, std::string_view prefix) const {
  std::vector<StoreEntryInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.lower_bound(prefix); it != entries_.end() && it->first.starts_with(prefix); ++it) {
    if (MayRead(who, *it->second)) out.push_back(Info(it->second));
  }
  return out;
}

uint64_t WeightStore::used_bytes() const { return shared_->used.load(); }

size_t WeightStore::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace cache_dit_opd::server
