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

// The byte count the limit is checked against. Entries subtract their bytes
// in their deleter, which may run after the store is gone (a StoreRef held
// by a call that finishes later), so it lives in a block of its own.
struct WeightStore::Shared {
  std::atomic<uint64_t> used{0};
};

WeightStore::WeightStore(StoreAllocator* allocator, uint64_t max_bytes, std::optional<gid_t> allowed_gid)
    : allocator_(allocator), max_bytes_(max_bytes), allowed_gid_(allowed_gid), shared_(std::make_shared<Shared>()) {}

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

StoreEntryInfo WeightStore::Info(const StoreRef& ref) {
  return {ref->name, ref->dtype, ref->shape, ref->bytes, ref->owner, ref.use_count() - 1};
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
  uint64_t total = 0;
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
    if (total > std::numeric_limits<uint64_t>::max() - bytes) {
      return Status::Rejected(Reason::kBadArgument, "publish: the set's byte count overflows 64 bits");
    }
    total += bytes;
    auto e = std::make_unique<StoreEntry>();
    e->name = spec.name;
    e->dtype = spec.dtype;
    e->shape = spec.shape;
    e->bytes = bytes;
    e->owner = owner.uid;
    e->readers = readers;
    made.push_back(std::move(e));
  }

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
    const uint64_t used = shared_->used.load();
    if (total > max_bytes_ || used > max_bytes_ - total) {
      return Status::Rejected(Reason::kResourceExhausted, "publish: ", total, " bytes do not fit the store: ", used,
                              " of --max-store-bytes ", max_bytes_, " are in use");
    }
    shared_->used += total;
    for (const auto& e : made) pending_.insert(e->name);
    publish_id = next_publish_id_++;
  }
  // Until the set is published, a failure gives back the names and bytes
  // (the blocks already allocated are freed with `made`, unlocked).
  bool published = false;
  struct Release {
    WeightStore* store;
    const std::vector<std::unique_ptr<StoreEntry>>& made;
    uint64_t total;
    const bool& published;
    ~Release() {
      if (published) return;
      std::lock_guard<std::mutex> lock(store->mu_);
      for (const auto& e : made) store->pending_.erase(e->name);
      store->shared_->used -= total;
    }
  } release{this, made, total, published};

  for (size_t i = 0; i < made.size(); ++i) {
    StoreEntry& e = *made[i];
    e.publish_id = publish_id;
    if (e.bytes == 0) continue;
    if (Status s = allocator_->Allocate(e.bytes, &e.block); !s.ok()) {
      return s.Annotated("publish '" + e.name + "' (" + std::to_string(e.bytes) + " bytes): ");
    }
    if (Status s = fill(i, e); !s.ok()) return s.Annotated("publish '" + e.name + "': ");
  }

  // Visible at once. Each entry gives its bytes back when its last reference
  // goes (deferred deletion), wherever that happens.
  std::vector<StoreRef> refs;
  refs.reserve(made.size());
  for (auto& e : made) {
    std::shared_ptr<Shared> shared = shared_;
    refs.emplace_back(e.release(), [shared](const StoreEntry* p) {
      shared->used -= p->bytes;
      delete p;
    });
  }
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
