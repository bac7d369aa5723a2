#include "server/session/region_registry.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/fake_daemon/fakes.h"

namespace cache_dit_opd {
namespace {

using testing::FakeRegionOpener;
using testing::Handle;

class RegionRegistryTest : public ::testing::Test {
 protected:
  std::unique_ptr<RegionRegistry> Make(RegionLimits limits, uint32_t lanes = 2) {
    completed_.assign(lanes, 0);
    return std::make_unique<RegionRegistry>(&opener_, /*device=*/0, limits, lanes,
                                            [this](uint32_t l) { return completed_[l]; });
  }
  FakeRegionOpener opener_;
  std::vector<uint64_t> completed_;
};

TEST_F(RegionRegistryTest, HandleMustBe64Bytes) {
  auto reg = Make({});
  RegionRegistry::Registered r;
  Status s = reg->Register(std::string(63, 'a'), 0, &r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("63 bytes"), std::string::npos) << s.message();
  EXPECT_EQ(reg->Register(std::string(65, 'a'), 0, &r).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opener_.opens, 0);
}

TEST_F(RegionRegistryTest, RegisterReportsDriverSizeAndReusesHandle) {
  opener_.sizes[1] = 4096;
  auto reg = Make({});
  RegionRegistry::Registered a, b;
  ASSERT_TRUE(reg->Register(Handle(1), 1000, &a).ok());
  EXPECT_NE(a.region_id, 0u);
  EXPECT_EQ(a.mapped_size, 4096u);
  EXPECT_FALSE(a.reused);
  ASSERT_TRUE(reg->Register(Handle(1), 4096, &b).ok());
  EXPECT_EQ(b.region_id, a.region_id);
  EXPECT_TRUE(b.reused);
  EXPECT_EQ(opener_.opens, 1);
  MappedRegion m;
  ASSERT_TRUE(reg->Resolve(a.region_id, &m).ok());
  EXPECT_EQ(m.size, 4096u);
  EXPECT_EQ(m.device, 0);
}

TEST_F(RegionRegistryTest, ClaimLargerThanAllocationClosesHandle) {
  opener_.sizes[2] = 4096;
  auto reg = Make({});
  RegionRegistry::Registered r;
  Status s = reg->Register(Handle(2), 4097, &r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("4097"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("4096"), std::string::npos) << s.message();
  EXPECT_EQ(opener_.open_count(), 0);  // the scope guard closed it
  EXPECT_EQ(reg->counts().regions, 0u);
}

TEST_F(RegionRegistryTest, OpenerRefusalPassesThrough) {
  opener_.refuse.insert(3);
  auto reg = Make({});
  RegionRegistry::Registered r;
  EXPECT_EQ(reg->Register(Handle(3), 0, &r).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opener_.open_count(), 0);
}

TEST_F(RegionRegistryTest, RegionLargerThanByteBudgetIsRefused) {
  opener_.sizes[4] = 8 << 20;
  auto reg = Make({.max_regions = 10, .max_bytes = 4 << 20});
  RegionRegistry::Registered r;
  Status s = reg->Register(Handle(4), 0, &r);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--max-mapped-bytes"), std::string::npos) << s.message();
  EXPECT_EQ(opener_.open_count(), 0);
}

TEST_F(RegionRegistryTest, EvictsLeastRecentlyUsedIdleRegion) {
  auto reg = Make({.max_regions = 2, .max_bytes = 1ull << 40});
  RegionRegistry::Registered a, b, c;
  ASSERT_TRUE(reg->Register(Handle(10), 0, &a).ok());
  ASSERT_TRUE(reg->Register(Handle(11), 0, &b).ok());
  MappedRegion m;
  ASSERT_TRUE(reg->ResolveForCall(a.region_id, 0, 1, &m).ok());  // a is now more recent than b
  completed_[0] = 1;                                              // and idle again
  ASSERT_TRUE(reg->Register(Handle(12), 0, &c).ok());
  EXPECT_EQ(reg->Resolve(b.region_id, &m).code(), StatusCode::kNotFound);
  EXPECT_TRUE(reg->Resolve(a.region_id, &m).ok());
  EXPECT_TRUE(reg->Resolve(c.region_id, &m).ok());
  EXPECT_EQ(opener_.closes, 1);
  EXPECT_EQ(reg->counts().regions, 2u);
}

TEST_F(RegionRegistryTest, BusyRegionsAreNotEvicted) {
  auto reg = Make({.max_regions = 2, .max_bytes = 1ull << 40});
  RegionRegistry::Registered a, b, c;
  ASSERT_TRUE(reg->Register(Handle(20), 0, &a).ok());
  ASSERT_TRUE(reg->Register(Handle(21), 0, &b).ok());
  MappedRegion m;
  ASSERT_TRUE(reg->ResolveForCall(a.region_id, 0, 5, &m).ok());
  ASSERT_TRUE(reg->ResolveForCall(b.region_id, 1, 7, &m).ok());
  Status s = reg->Register(Handle(22), 0, &c);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--max-regions 2"), std::string::npos) << s.message();
  EXPECT_EQ(opener_.open_count(), 2);  // the new handle was closed again

  completed_[0] = 5;  // a's last call finished; b's has not
  ASSERT_TRUE(reg->Register(Handle(22), 0, &c).ok());
  EXPECT_EQ(reg->Resolve(a.region_id, &m).code(), StatusCode::kNotFound);
  EXPECT_TRUE(reg->Resolve(b.region_id, &m).ok());
}

TEST_F(RegionRegistryTest, ByteBudgetEvictsUntilItFits) {
  opener_.default_size = 1 << 20;
  auto reg = Make({.max_regions = 100, .max_bytes = 3 << 20});
  RegionRegistry::Registered r;
  for (uint8_t t = 30; t < 33; ++t) ASSERT_TRUE(reg->Register(Handle(t), 0, &r).ok());
  EXPECT_EQ(reg->counts().mapped_bytes, 3u << 20);
  opener_.sizes[33] = 2 << 20;
  ASSERT_TRUE(reg->Register(Handle(33), 0, &r).ok());
  EXPECT_EQ(reg->counts().regions, 2u);  // two 1 MiB regions made room
  EXPECT_EQ(reg->counts().mapped_bytes, 3u << 20);
  EXPECT_EQ(opener_.closes, 2);
}

TEST_F(RegionRegistryTest, UnregisterDefersUntilEveryLanePassedLastUse) {
  auto reg = Make({});
  RegionRegistry::Registered a;
  ASSERT_TRUE(reg->Register(Handle(40), 0, &a).ok());
  MappedRegion m;
  ASSERT_TRUE(reg->ResolveForCall(a.region_id, 0, 2, &m).ok());
  ASSERT_TRUE(reg->ResolveForCall(a.region_id, 1, 3, &m).ok());
  completed_[0] = 2;
  completed_[1] = 2;
  bool deferred = false;
  ASSERT_TRUE(reg->Unregister(a.region_id, &deferred).ok());
  EXPECT_TRUE(deferred);
  EXPECT_EQ(reg->Resolve(a.region_id, &m).code(), StatusCode::kNotFound);
  EXPECT_EQ(reg->counts().pending_unmaps, 1u);
  EXPECT_EQ(reg->ReleaseCompleted(), 1u);
  EXPECT_EQ(opener_.closes, 0);
  completed_[1] = 3;
  EXPECT_EQ(reg->ReleaseCompleted(), 0u);
  EXPECT_EQ(opener_.closes, 1);
  EXPECT_EQ(reg->counts().mapped_bytes, 0u);
}

TEST_F(RegionRegistryTest, UnregisterIdleIsNotDeferred) {
  auto reg = Make({});
  RegionRegistry::Registered a;
  ASSERT_TRUE(reg->Register(Handle(41), 0, &a).ok());
  bool deferred = true;
  ASSERT_TRUE(reg->Unregister(a.region_id, &deferred).ok());
  EXPECT_FALSE(deferred);
  EXPECT_EQ(reg->ReleaseCompleted(), 0u);
  EXPECT_EQ(opener_.open_count(), 0);
  Status s = reg->Unregister(a.region_id, &deferred);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find(std::to_string(a.region_id)), std::string::npos);
}

TEST_F(RegionRegistryTest, ReRegisteringAPendingHandleRevivesIt) {
  auto reg = Make({});
  RegionRegistry::Registered a, b;
  ASSERT_TRUE(reg->Register(Handle(42), 0, &a).ok());
  MappedRegion m;
  ASSERT_TRUE(reg->ResolveForCall(a.region_id, 0, 9, &m).ok());
  bool deferred = false;
  ASSERT_TRUE(reg->Unregister(a.region_id, &deferred).ok());
  ASSERT_TRUE(deferred);
  ASSERT_TRUE(reg->Register(Handle(42), 0, &b).ok());
  EXPECT_EQ(b.region_id, a.region_id);
  EXPECT_TRUE(b.reused);
  EXPECT_EQ(opener_.opens, 1);  // CUDA maps a handle once per process
  EXPECT_EQ(reg->counts().pending_unmaps, 0u);
}

TEST_F(RegionRegistryTest, ClosedRegistryRefusesAndReleasesAfterDrain) {
  auto reg = Make({});
  RegionRegistry::Registered a, b;
  ASSERT_TRUE(reg->Register(Handle(50), 0, &a).ok());
  ASSERT_TRUE(reg->Register(Handle(51), 0, &b).ok());
  MappedRegion m;
  ASSERT_TRUE(reg->ResolveForCall(b.region_id, 1, 4, &m).ok());
  reg->CloseRegistry();
  RegionRegistry::Registered c;
  EXPECT_EQ(reg->Register(Handle(52), 0, &c).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg->Resolve(a.region_id, &m).code(), StatusCode::kNotFound);
  EXPECT_EQ(reg->ReleaseCompleted(), 1u);  // b still in use on lane 1
  completed_[1] = 4;
  EXPECT_EQ(reg->ReleaseCompleted(), 0u);
  EXPECT_EQ(opener_.open_count(), 0);
}

TEST_F(RegionRegistryTest, ResolveForCallChecksLaneAndId) {
  auto reg = Make({}, 2);
  RegionRegistry::Registered a;
  ASSERT_TRUE(reg->Register(Handle(60), 0, &a).ok());
  MappedRegion m;
  EXPECT_EQ(reg->ResolveForCall(a.region_id, 2, 1, &m).code(), StatusCode::kInvalidArgument);
  Status s = reg->ResolveForCall(777, 0, 1, &m);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("777"), std::string::npos);
  CallRegionResolver resolver(reg.get(), 1, 6);
  ASSERT_TRUE(resolver.Resolve(a.region_id, &m).ok());
  bool deferred = false;
  ASSERT_TRUE(reg->Unregister(a.region_id, &deferred).ok());
  EXPECT_TRUE(deferred);  // the resolver recorded lane 1's use at seq 6
}

TEST_F(RegionRegistryTest, DestructorClosesEverything) {
  {
    auto reg = Make({});
    RegionRegistry::Registered r;
    ASSERT_TRUE(reg->Register(Handle(70), 0, &r).ok());
    ASSERT_TRUE(reg->Register(Handle(71), 0, &r).ok());
  }
  EXPECT_EQ(opener_.open_count(), 0);
}

// A keep-alive whose release the test can see.
std::shared_ptr<const void> Tracked(int* alive) {
  ++*alive;
  return std::shared_ptr<const void>(new int(0), [alive](const void* p) {
    --*alive;
    delete static_cast<const int*>(p);
  });
}

TEST_F(RegionRegistryTest, ASharedRegionIsReadOnlyOpensNothingAndHoldsItsKeepAlivesUntilReleased) {
  auto reg = Make({});
  int alive = 0;
  char block[4096];
  RegionRegistry::Registered a, b;
  {
    auto first = Tracked(&alive), second = Tracked(&alive);
    ASSERT_TRUE(reg->RegisterLent("store-block:7", block, sizeof(block), {}, {first}, &a).ok());
    ASSERT_TRUE(reg->RegisterLent("store-block:7", block, sizeof(block), {}, {first}, &b).ok());  // held once
    ASSERT_TRUE(reg->RegisterLent("store-block:7", block, sizeof(block), {}, {first, second}, &b).ok());
  }
  EXPECT_EQ(b.region_id, a.region_id);
  EXPECT_TRUE(b.reused);
  EXPECT_EQ(alive, 2);
  EXPECT_EQ(opener_.opens, 0);
  MappedRegion m;
  ASSERT_TRUE(reg->ResolveForCall(a.region_id, 0, 5, &m).ok());
  EXPECT_TRUE(m.read_only);
  EXPECT_EQ(m.base, block);
  EXPECT_EQ(m.size, sizeof(block));
  EXPECT_EQ(reg->counts().regions, 1u);
  EXPECT_EQ(reg->counts().mapped_bytes, 0u);  // the daemon mapped nothing for it
  // Released by the lanes' rule, like any region: then the keep-alives go.
  bool deferred = false;
  ASSERT_TRUE(reg->Unregister(a.region_id, &deferred).ok());
  EXPECT_TRUE(deferred);
  EXPECT_EQ(reg->ReleaseCompleted(), 1u);
  EXPECT_EQ(alive, 2);
  completed_[0] = 5;
  EXPECT_EQ(reg->ReleaseCompleted(), 0u);
  EXPECT_EQ(alive, 0);
  EXPECT_EQ(opener_.closes, 0);
  EXPECT_EQ(reg->RegisterLent(std::string(kIpcHandleBytes, 's'), block, 1, {}, {Tracked(&alive)}, &a).code(),
            StatusCode::kInternal);  // a key never looks like a handle
}

// Shutdown past the drain deadline: work may still be on the GPU, so nothing
// is closed and the memory lent regions hold stays alive (a store copy still
// reading a block must not see it freed).
TEST_F(RegionRegistryTest, AbandonClosesNothingAndKeepsLentMemoryAlive) {
  auto reg = Make({});
  int alive = 0;
  char block[64];
  RegionRegistry::Registered a, b, c;
  ASSERT_TRUE(reg->Register(Handle(91), 0, &a).ok());
  ASSERT_TRUE(reg->RegisterLent("store-block:1", block, sizeof(block), {}, {Tracked(&alive)}, &b).ok());
  ASSERT_TRUE(reg->RegisterLent("store-block:2", block, sizeof(block), {}, {Tracked(&alive)}, &c).ok());
  MappedRegion m;
  ASSERT_TRUE(reg->ResolveForCall(c.region_id, 0, 1, &m).ok());
  bool deferred = false;
  ASSERT_TRUE(reg->Unregister(c.region_id, &deferred).ok());
  ASSERT_TRUE(deferred);  // pending: lane 0 has not completed seq 1
  reg->Abandon();
  EXPECT_EQ(alive, 2);  // neither the active nor the pending region's keep-alive went
  EXPECT_EQ(opener_.closes, 0);
  EXPECT_EQ(reg->Resolve(b.region_id, &m).code(), StatusCode::kNotFound);
  EXPECT_EQ(reg->counts().regions, 0u);
  reg.reset();
  EXPECT_EQ(alive, 2);
  EXPECT_EQ(opener_.closes, 0);
}

TEST_F(RegionRegistryTest, SharedRegionsCountAgainstTheRegionLimitAndAreEvictedWhenIdle) {
  auto reg = Make(RegionLimits{2, 1u << 20});
  int alive = 0;
  char block[64];
  RegionRegistry::Registered a, b, c;
  ASSERT_TRUE(reg->Register(Handle(90), 0, &a).ok());
  ASSERT_TRUE(reg->RegisterLent("store-block:1", block, sizeof(block), {}, {Tracked(&alive)}, &b).ok());
  MappedRegion m;
  ASSERT_TRUE(reg->ResolveForCall(a.region_id, 0, 1, &m).ok());  // a is busy
  ASSERT_TRUE(reg->RegisterLent("store-block:2", block, sizeof(block), {}, {Tracked(&alive)}, &c).ok());
  EXPECT_EQ(alive, 1);  // the idle shared region made room
  EXPECT_EQ(reg->Resolve(b.region_id, &m).code(), StatusCode::kNotFound);
  ASSERT_TRUE(reg->ResolveForCall(c.region_id, 1, 1, &m).ok());
  Status s = reg->RegisterLent("store-block:3", block, sizeof(block), {}, {Tracked(&alive)}, &b);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--max-regions 2"), std::string::npos) << s.message();
  EXPECT_EQ(alive, 1);  // the refused keep-alive is not kept
}

// A run of client chunks the caller mapped: read-write, counted.
constexpr RegionRegistry::Lent chunks{.read_only = false, .counts_bytes = true};

TEST_F(RegionRegistryTest, AWritableLentRegionCountsItsBytesAndIsEvictedForThem) {
  auto reg = Make(RegionLimits{16, 3u << 20});
  int alive = 0;
  char run[64];
  RegionRegistry::Registered a, b;
  ASSERT_TRUE(reg->RegisterLent("chunks:1", run, 2u << 20, chunks, {Tracked(&alive)}, &a).ok());
  MappedRegion m;
  ASSERT_TRUE(reg->Resolve(a.region_id, &m).ok());
  EXPECT_FALSE(m.read_only);
  EXPECT_EQ(reg->counts().mapped_bytes, 2u << 20);
  // 2 MiB more do not fit 3 MiB: the idle run is evicted (its keep-alive, the mapping, goes).
  ASSERT_TRUE(reg->RegisterLent("chunks:2", run, 2u << 20, chunks, {Tracked(&alive)}, &b).ok());
  EXPECT_EQ(alive, 1);
  EXPECT_EQ(reg->counts().mapped_bytes, 2u << 20);
  Status s = reg->RegisterLent("chunks:3", run, 4u << 20, chunks, {Tracked(&alive)}, &b);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("4194304 bytes exceeds --max-mapped-bytes"), std::string::npos) << s.message();
  uint64_t id = 0;
  EXPECT_TRUE(reg->FindLent("chunks:2", &id));
  EXPECT_EQ(id, b.region_id);
  EXPECT_FALSE(reg->FindLent("chunks:1", &id));
}

// The same chunks mapped again (two requests raced, or one came for a region
// waiting for release) are not kept beside the region's own mapping: each
// round would otherwise leave one more mapping alive, uncounted.
TEST_F(RegionRegistryTest, ASecondMappingOfAKnownRunIsNotKept) {
  auto reg = Make(RegionLimits{16, 3u << 20});
  int alive = 0;
  char run[64];
  RegionRegistry::Registered a, b;
  ASSERT_TRUE(reg->RegisterLent("chunks:1", run, 2u << 20, chunks, {Tracked(&alive)}, &a).ok());
  ASSERT_TRUE(reg->RegisterLent("chunks:1", run + 8, 2u << 20, chunks, {Tracked(&alive)}, &b).ok());
  EXPECT_TRUE(b.reused);
  EXPECT_EQ(b.region_id, a.region_id);
  EXPECT_EQ(alive, 1);  // the second mapping went
  MappedRegion m;
  ASSERT_TRUE(reg->ResolveForCall(a.region_id, 0, 3, &m).ok());  // in use up to lane 0's seq 3
  EXPECT_EQ(m.base, run);
  bool deferred = false;
  ASSERT_TRUE(reg->Unregister(a.region_id, &deferred).ok());
  EXPECT_TRUE(deferred);
  for (int round = 0; round < 3; ++round) {  // revived while waiting for release, mapped again each time
    ASSERT_TRUE(reg->RegisterLent("chunks:1", run + 16, 2u << 20, chunks, {Tracked(&alive)}, &b).ok());
    EXPECT_EQ(b.region_id, a.region_id);
    EXPECT_EQ(alive, 1);
    ASSERT_TRUE(reg->Unregister(a.region_id, &deferred).ok());
  }
  EXPECT_EQ(reg->counts().mapped_bytes, 2u << 20);
  completed_[0] = 3;
  EXPECT_EQ(reg->ReleaseCompleted(), 0u);
  EXPECT_EQ(alive, 0);
}

TEST_F(RegionRegistryTest, APinnedRegionIsReleasedOnlyAfterItsPinGoes) {
  auto reg = Make({});
  RegionRegistry::Registered a;
  ASSERT_TRUE(reg->Register(Handle(91), 0, &a).ok());
  MappedRegion m;
  {
    RegionRegistry::Pin pin;
    ASSERT_TRUE(reg->PinForCopy(a.region_id, &m, &pin).ok());
    EXPECT_NE(m.base, nullptr);
    bool deferred = false;
    ASSERT_TRUE(reg->Unregister(a.region_id, &deferred).ok());
    EXPECT_TRUE(deferred);  // no lane used it, but it is pinned
    EXPECT_EQ(reg->ReleaseCompleted(), 1u);
    EXPECT_EQ(opener_.closes, 0);
    RegionRegistry::Pin other;
    EXPECT_EQ(reg->PinForCopy(a.region_id, &m, &other).code(), StatusCode::kNotFound);  // unregistered
  }
  EXPECT_EQ(reg->ReleaseCompleted(), 0u);
  EXPECT_EQ(opener_.closes, 1);
}

}  // namespace
}  // namespace cache_dit_opd
