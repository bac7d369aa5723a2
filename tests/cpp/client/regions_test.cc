// Regions: TensorView -> TensorRef (region id + byte offset from the
// allocation base) and the per-allocation cache keyed by (base, buffer id)
// (client/core/regions.h), with a fake driver and a fake daemon.
#include "client/core/regions.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

namespace cache_dit_opd::client {
namespace {

void* P(uint64_t a) { return reinterpret_cast<void*>(a); }

TEST(TensorRef, ContiguousStrides) {
  EXPECT_EQ(ContiguousStrides({2, 3, 4}), (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(ContiguousStrides({5}), (std::vector<int64_t>{1}));
  EXPECT_EQ(ContiguousStrides({}), (std::vector<int64_t>{}));
  // As torch: a dim of size 0 or 1 counts as 1.
  EXPECT_EQ(ContiguousStrides({2, 0, 3}), (std::vector<int64_t>{3, 3, 1}));
}

TEST(TensorRef, ExtentBytes) {
  uint64_t b = 0;
  ASSERT_TRUE(ViewExtentBytes({2, 3}, {3, 1}, DType::kFloat32, &b).ok());
  EXPECT_EQ(b, 24u);
  // [B, S, H, 1] view of a [B, H, S] buffer: last element (1*H*S + (S-1) + (H-1)*S) + 1.
  ASSERT_TRUE(ViewExtentBytes({2, 5, 3, 1}, {15, 1, 5, 1}, DType::kFloat32, &b).ok());
  EXPECT_EQ(b, 30u * 4);
  ASSERT_TRUE(ViewExtentBytes({4, 0, 7}, {0, 7, 1}, DType::kBFloat16, &b).ok());
  EXPECT_EQ(b, 0u);
  ASSERT_TRUE(ViewExtentBytes({}, {}, DType::kFloat8E4M3FN, &b).ok());  // a scalar: one element
  EXPECT_EQ(b, 1u);
  ASSERT_TRUE(ViewExtentBytes({3, 130}, {130, 1}, DType::kFloat8E4M3FN, &b).ok());
  EXPECT_EQ(b, 390u);
}

TEST(TensorRef, ExtentRejectsBadViews) {
  uint64_t b = 0;
  EXPECT_EQ(ViewExtentBytes({-1, 2}, {2, 1}, DType::kFloat32, &b).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ViewExtentBytes({2, 2}, {-2, 1}, DType::kFloat32, &b).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ViewExtentBytes({2, 2}, {1}, DType::kFloat32, &b).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ViewExtentBytes(std::vector<int64_t>(9, 1), std::vector<int64_t>(9, 1), DType::kFloat32, &b).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ViewExtentBytes({2}, {1}, DType::kUnspecified, &b).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ViewExtentBytes({INT64_MAX, 2}, {INT64_MAX, 1}, DType::kFloat32, &b).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ViewExtentBytes({INT64_MAX}, {1}, DType::kFloat64, &b).code(), StatusCode::kInvalidArgument);
}

TEST(TensorRef, OffsetIsFromTheAllocationBase) {
  const AllocationInfo alloc{0x7f0000001000, 1 << 20, 42, 0};
  TensorView v{P(0x7f0000001000 + 0x300), {4, 130}, {}, DType::kFloat8E4M3FN};
  TensorRef r;
  ASSERT_TRUE(MakeTensorRef(v, alloc, 9, &r).ok());
  EXPECT_EQ(r.region_id, 9u);
  EXPECT_EQ(r.byte_offset, 0x300u);
  EXPECT_EQ(r.sizes, (std::vector<int64_t>{4, 130}));
  EXPECT_EQ(r.strides, (std::vector<int64_t>{130, 1}));  // filled in: contiguous
  EXPECT_EQ(r.dtype, DType::kFloat8E4M3FN);

  // Explicit (permuted) strides travel unchanged.
  TensorView lse{P(alloc.base + 4096), {2, 5, 3, 1}, {15, 1, 5, 1}, DType::kFloat32};
  ASSERT_TRUE(MakeTensorRef(lse, alloc, 9, &r).ok());
  EXPECT_EQ(r.byte_offset, 4096u);
  EXPECT_EQ(r.strides, (std::vector<int64_t>{15, 1, 5, 1}));
}

TEST(TensorRef, ViewMustLieInsideTheAllocation) {
  const AllocationInfo alloc{0x10000, 4096, 1, 0};
  TensorRef r;
  // Exactly fits.
  EXPECT_TRUE(MakeTensorRef({P(0x10000 + 4096 - 64), {16}, {}, DType::kFloat32}, alloc, 1, &r).ok());
  // One element too far.
  Status s = MakeTensorRef({P(0x10000 + 4096 - 64), {17}, {}, DType::kFloat32}, alloc, 1, &r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("past the end"), std::string::npos) << s.message();
  // Starts before the base or after the end.
  EXPECT_FALSE(MakeTensorRef({P(0x10000 - 4), {1}, {}, DType::kFloat32}, alloc, 1, &r).ok());
  EXPECT_FALSE(MakeTensorRef({P(0x10000 + 4097), {0}, {}, DType::kFloat32}, alloc, 1, &r).ok());
  // An empty view at the very end is fine.
  EXPECT_TRUE(MakeTensorRef({P(0x10000 + 4096), {0, 8}, {}, DType::kFloat32}, alloc, 1, &r).ok());
  // Strides that overflow.
  EXPECT_FALSE(MakeTensorRef({P(0x10000), {2, 2}, {INT64_MAX / 2, 1}, DType::kFloat32}, alloc, 1, &r).ok());
}

TEST(TensorRef, AnEmptyViewTravelsWithoutARegion) {
  // Whatever its pointer (torch's empty CUDA tensors have none): region 0, offset 0.
  TensorRef r;
  ASSERT_TRUE(MakeEmptyTensorRef({nullptr, {256, 0}, {}, DType::kFloat32}, &r).ok());
  EXPECT_EQ(r.region_id, kNoRegion);
  EXPECT_EQ(r.byte_offset, 0u);
  EXPECT_EQ(r.sizes, (std::vector<int64_t>{256, 0}));
  EXPECT_EQ(r.strides, (std::vector<int64_t>{1, 1}));  // contiguous, as torch writes them
  EXPECT_EQ(r.dtype, DType::kFloat32);
  ASSERT_TRUE(MakeEmptyTensorRef({P(0x1234), {0, 8}, {16, 1}, DType::kBFloat16}, &r).ok());
  EXPECT_EQ(r.region_id, kNoRegion);
  EXPECT_EQ(r.byte_offset, 0u);
  EXPECT_EQ(r.strides, (std::vector<int64_t>{16, 1}));  // explicit strides travel unchanged
  // A view with elements needs its memory; malformed views are refused as always.
  Status s = MakeEmptyTensorRef({nullptr, {256, 16}, {}, DType::kFloat32}, &r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[256, 16]"), std::string::npos) << s.message();
  EXPECT_FALSE(MakeEmptyTensorRef({nullptr, {}, {}, DType::kFloat32}, &r).ok());  // 0-dim: one element
  EXPECT_FALSE(MakeEmptyTensorRef({nullptr, {0, 2}, {1}, DType::kFloat32}, &r).ok());
  EXPECT_FALSE(MakeEmptyTensorRef({nullptr, {0, 2}, {}, DType::kUnspecified}, &r).ok());
}

// --- region cache -----------------------------------------------------------

struct FakeBackend : AllocationBackend {
  std::map<uint64_t, AllocationInfo> live;  // by base
  int lookups = 0, exports = 0;
  Status Lookup(const void* ptr, AllocationInfo* info) override {
    ++lookups;
    const auto p = reinterpret_cast<uint64_t>(ptr);
    for (const auto& [base, a] : live) {
      if (p >= base && p < base + a.size) {
        *info = a;
        return Status::Ok();
      }
    }
    return Status::InvalidArgument("not device memory");
  }
  Status Export(const AllocationInfo& a, std::array<uint8_t, 64>* h) override {
    ++exports;
    h->fill(static_cast<uint8_t>(a.buffer_id));
    return Status::Ok();
  }
  // Chunks of a run: ids by chunk base (what a VMM chunk's BUFFER_ID reads).
  std::map<uint64_t, uint64_t> chunk_ids;
  int chunk_queries = 0;
  Status ChunkId(const void* ptr, uint64_t* id) override {
    ++chunk_queries;
    auto it = chunk_ids.find(reinterpret_cast<uint64_t>(ptr));
    if (it == chunk_ids.end()) return Status::InvalidArgument("no chunk");
    *id = it->second;
    return Status::Ok();
  }
  void Alloc(uint64_t base, uint64_t size, uint64_t id, int device = 0) { live[base] = {base, size, id, device}; }
  void Free(uint64_t base) { live.erase(base); }
};

struct FakeRegistrar : RegionRegistrar {
  uint64_t next = 100;
  std::map<uint64_t, uint64_t> registered;  // region id -> buffer id
  std::vector<uint64_t> unregistered;
  Status fail_register;
  Status Register(const AllocationInfo& a, const std::array<uint8_t, 64>& h, uint64_t* id) override {
    if (!fail_register.ok()) return fail_register;
    EXPECT_EQ(h[0], static_cast<uint8_t>(a.buffer_id));
    *id = next++;
    registered[*id] = a.buffer_id;
    return Status::Ok();
  }
  Status Unregister(uint64_t id) override {
    unregistered.push_back(id);
    registered.erase(id);
    return Status::Ok();
  }
};

class RegionCacheTest : public ::testing::Test {
 protected:
  FakeBackend backend;
  FakeRegistrar daemon;
  RegionCache cache{&backend, &daemon, 0};
};

TEST_F(RegionCacheTest, RegistersEachAllocationOnce) {
  backend.Alloc(0x100000, 1 << 20, 1);
  ResolvedRegion a, b;
  ASSERT_TRUE(cache.Resolve(P(0x100000), &a).ok());
  ASSERT_TRUE(cache.Resolve(P(0x100000 + 4096), &b).ok());
  EXPECT_EQ(a.region_id, b.region_id);
  EXPECT_EQ(b.alloc.base, 0x100000u);
  EXPECT_EQ(daemon.registered.size(), 1u);
  EXPECT_EQ(backend.exports, 1);
  EXPECT_EQ(cache.size(), 1u);
}

TEST_F(RegionCacheTest, ReusedAddressWithNewBufferIdIsANewRegion) {
  backend.Alloc(0x100000, 1 << 20, 1);
  ResolvedRegion a, b;
  ASSERT_TRUE(cache.Resolve(P(0x100010), &a).ok());
  // Freed and re-allocated at the same address: the driver gives a new buffer id.
  backend.Free(0x100000);
  backend.Alloc(0x100000, 1 << 20, 2);
  ASSERT_TRUE(cache.Resolve(P(0x100010), &b).ok());
  EXPECT_NE(a.region_id, b.region_id);
  EXPECT_EQ(daemon.unregistered, (std::vector<uint64_t>{a.region_id}));
  EXPECT_EQ(daemon.registered.size(), 1u);
  EXPECT_EQ(daemon.registered.at(b.region_id), 2u);
}

TEST_F(RegionCacheTest, SameBaseDifferentSizeIsANewRegion) {
  backend.Alloc(0x100000, 4096, 1);
  ResolvedRegion a, b;
  ASSERT_TRUE(cache.Resolve(P(0x100000), &a).ok());
  backend.live[0x100000].size = 8192;  // (a driver would also change the buffer id)
  ASSERT_TRUE(cache.Resolve(P(0x100000), &b).ok());
  EXPECT_NE(a.region_id, b.region_id);
}

TEST_F(RegionCacheTest, OverlappingStaleEntriesAreReleased) {
  backend.Alloc(0x100000, 0x10000, 1);
  backend.Alloc(0x200000, 0x10000, 2);
  ResolvedRegion a, b, c;
  ASSERT_TRUE(cache.Resolve(P(0x100000), &a).ok());
  ASSERT_TRUE(cache.Resolve(P(0x200000), &b).ok());
  // Both freed; one new allocation now spans the old ranges.
  backend.Free(0x100000);
  backend.Free(0x200000);
  backend.Alloc(0x108000, 0x100000, 3);
  ASSERT_TRUE(cache.Resolve(P(0x108000), &c).ok());
  EXPECT_EQ(daemon.unregistered.size(), 2u);
  EXPECT_EQ(cache.size(), 1u);
}

TEST_F(RegionCacheTest, ForgetWorksByAddressAfterFree) {
  backend.Alloc(0x100000, 0x10000, 1);
  ResolvedRegion a;
  ASSERT_TRUE(cache.Resolve(P(0x100000), &a).ok());
  backend.Free(0x100000);
  EXPECT_TRUE(cache.Forget(P(0x100000 + 0x80)).ok());
  EXPECT_EQ(daemon.unregistered, (std::vector<uint64_t>{a.region_id}));
  EXPECT_EQ(cache.Forget(P(0x100000)).code(), StatusCode::kNotFound);
  EXPECT_EQ(cache.Forget(P(0x500000)).code(), StatusCode::kNotFound);
}

TEST_F(RegionCacheTest, PruneDropsFreedAndReallocated) {
  backend.Alloc(0x100000, 0x10000, 1);
  backend.Alloc(0x200000, 0x10000, 2);
  backend.Alloc(0x300000, 0x10000, 3);
  ResolvedRegion r;
  for (uint64_t base : {0x100000, 0x200000, 0x300000}) ASSERT_TRUE(cache.Resolve(P(base), &r).ok());
  backend.Free(0x100000);
  backend.live[0x200000].buffer_id = 9;
  size_t removed = 0;
  ASSERT_TRUE(cache.Prune(&removed).ok());
  EXPECT_EQ(removed, 2u);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(daemon.registered.size(), 1u);
}

TEST_F(RegionCacheTest, OtherDevicesAndLookupErrorsAreRejected) {
  backend.Alloc(0x100000, 0x10000, 1, /*device=*/1);
  ResolvedRegion r;
  Status s = cache.Resolve(P(0x100000), &r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("device 1"), std::string::npos) << s.message();
  EXPECT_EQ(cache.Resolve(P(0x900000), &r).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(daemon.registered.empty());
}

TEST_F(RegionCacheTest, AFixedRangeIsFoundWithoutTheDriverUntilDropped) {
  // An attached weight-store block: the driver knows it as no legacy allocation.
  cache.AddFixed(0x200000, 1 << 21, 7);
  ResolvedRegion r;
  ASSERT_TRUE(cache.Find(P(0x200000 + 512), 1024, &r));
  EXPECT_EQ(r.region_id, 7u);
  EXPECT_EQ(r.alloc.base, 0x200000u);
  EXPECT_EQ(backend.lookups, 0);
  EXPECT_FALSE(cache.Find(P(0x200000 + (1 << 21) - 8), 16, &r));  // runs past its end
  EXPECT_FALSE(cache.Find(P(0x1ff000), 8, &r));                   // before it (the driver is asked)
  EXPECT_EQ(backend.lookups, 1);
  cache.ForgetIds({7});
  EXPECT_FALSE(cache.Find(P(0x200000), 8, &r));
  cache.AddFixed(0x200000, 1 << 21, 8);
  EXPECT_EQ(cache.size(), 1u);
  cache.Drop(0x200000);
  EXPECT_FALSE(cache.Find(P(0x200000), 8, &r));
  EXPECT_EQ(cache.size(), 0u);
}

TEST_F(RegionCacheTest, ARunOfChunksIsFoundWhileEveryTouchedChunkKeepsItsId) {
  // Three 2 MiB chunks of an expandable segment, registered as one region.
  const uint64_t mb2 = 2 << 20, base = 0x300000000;
  backend.chunk_ids = {{base, 11}, {base + mb2, 12}, {base + 2 * mb2, 13}};
  cache.AddRun({{base, mb2, 11}, {base + mb2, mb2, 12}, {base + 2 * mb2, mb2, 13}}, 42);
  ResolvedRegion r;
  ASSERT_TRUE(cache.Find(P(base + mb2 - 16), 32, &r));  // spans chunks 0 and 1
  EXPECT_EQ(r.region_id, 42u);
  EXPECT_EQ(r.alloc.base, base);
  EXPECT_EQ(r.alloc.size, 3 * mb2);
  EXPECT_EQ(backend.chunk_queries, 2);  // one per chunk touched
  EXPECT_EQ(backend.lookups, 0);
  EXPECT_FALSE(cache.Find(P(base + 3 * mb2 - 8), 16, &r));  // runs past the run
  backend.chunk_ids[base + 2 * mb2] = 99;                   // chunk 2 unmapped and mapped again
  EXPECT_TRUE(cache.Find(P(base), 64, &r));                 // chunk 0 is still the registered one
  EXPECT_FALSE(cache.Find(P(base + 2 * mb2 + 8), 8, &r));   // chunk 2 is not
  cache.Drop(base);
  backend.chunk_ids[base + 2 * mb2] = 13;
  EXPECT_FALSE(cache.Find(P(base), 8, &r));
}

TEST_F(RegionCacheTest, FailedRegistrationIsNotCached) {
  backend.Alloc(0x100000, 0x10000, 1);
  daemon.fail_register = Status::ResourceExhausted("--max-regions");
  ResolvedRegion r;
  EXPECT_EQ(cache.Resolve(P(0x100000), &r).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.size(), 0u);
  daemon.fail_register = Status::Ok();
  EXPECT_TRUE(cache.Resolve(P(0x100000), &r).ok());
  EXPECT_EQ(cache.size(), 1u);
}

}  // namespace
}  // namespace cache_dit_opd::client
