// server/store/weight_store.h on host memory: names, atomic sets in one
// block each, access, the byte limit, deferred deletion, failures that leave
// nothing behind.
#include "server/store/weight_store.h"

#include "tests/fake_daemon/fakes.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace cache_dit_opd::server {
namespace {

using HostAllocator = testing::HostStoreAllocator;

PeerCred Peer(uid_t uid, gid_t gid = 100, std::vector<gid_t> groups = {}) {
  PeerCred p;
  p.pid = 1000 + static_cast<pid_t>(uid);
  p.uid = uid;
  p.gid = gid;
  p.groups = std::move(groups);
  return p;
}

StoreTensorSpec Spec(std::string name, std::vector<int64_t> shape, DType dtype = DType::kFloat32) {
  return {std::move(name), dtype, std::move(shape)};
}

// Fills entry i with bytes i+1.
Status FillIndex(size_t i, const StoreEntry& e) {
  std::vector<std::byte> bytes(e.bytes, static_cast<std::byte>(i + 1));
  return e.Write(0, bytes);
}

const PeerCred kAlice = Peer(1001), kBob = Peer(1002), kRoot = Peer(0, 0);

TEST(WeightStoreTest, PublishedSetsAreReadableWithTheirBytesAndListedByPrefix) {
  HostAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt);
  std::vector<StoreEntryInfo> published;
  ASSERT_TRUE(store.Publish(kAlice, {Spec("flux/blocks.0.ff.qweight", {4, 8}, DType::kInt8),
                                     Spec("flux/blocks.0.ff.wscales", {2, 8}, DType::kBFloat16),
                                     Spec("flux/empty", {0, 3})},
                            {}, FillIndex, &published)
                  .ok());
  ASSERT_EQ(published.size(), 3u);  // in specs order
  EXPECT_EQ(published[1].name, "flux/blocks.0.ff.wscales");
  EXPECT_EQ(published[1].bytes, 32u);
  EXPECT_EQ(published[2].shape, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(published[0].owner, 1001u);
  // One block for the set: the second tensor at the next 256-byte boundary.
  EXPECT_EQ(store.used_bytes(), kStoreAlignment + 32u);
  EXPECT_EQ(alloc.live, 1);
  EXPECT_EQ(published[0].block_bytes, kStoreAlignment + 32u);
  EXPECT_EQ(published[2].block_bytes, 0u);  // the empty tensor has no memory
  StoreRef q;
  ASSERT_TRUE(store.Lookup(kAlice, "flux/blocks.0.ff.wscales", &q).ok());
  EXPECT_EQ(q->dtype, DType::kBFloat16);
  EXPECT_EQ(q->shape, (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(q->bytes, 32u);
  EXPECT_EQ(q->owner, 1001u);
  EXPECT_EQ(q->offset, kStoreAlignment);
  EXPECT_EQ(reinterpret_cast<const char*>(q->address())[31], 2);
  EXPECT_EQ(reinterpret_cast<const char*>(q->block->address())[0], 1);  // the first tensor, same block
  // Writes stay inside their entry.
  std::vector<std::byte> two(2);
  EXPECT_EQ(q->Write(31, two).code(), StatusCode::kInternal);
  StoreRef e;
  ASSERT_TRUE(store.Lookup(kAlice, "flux/empty", &e).ok());
  EXPECT_EQ(e->block, nullptr);
  EXPECT_EQ(e->publish_id, q->publish_id);

  ASSERT_TRUE(store.Publish(kAlice, {Spec("other/x", {1})}, {}, FillIndex).ok());
  auto listed = store.List(kAlice, "flux/");
  ASSERT_EQ(listed.size(), 3u);
  EXPECT_EQ(listed[0].name, "flux/blocks.0.ff.qweight");
  EXPECT_EQ(listed[1].refs, 1);  // the StoreRef `q` above
  EXPECT_EQ(listed[0].refs, 0);
  EXPECT_EQ(store.List(kAlice).size(), 4u);
}

TEST(WeightStoreTest, BadNamesAndSpecsAreRefusedNamingTheValue) {
  HostAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt);
  struct Case { StoreTensorSpec spec; const char* says; };
  const Case cases[] = {
      {Spec("", {1}), "store name '': empty"},
      {Spec("a//b", {1}), "an empty segment at byte 2"},
      {Spec("/a", {1}), "an empty segment at byte 0"},
      {Spec("a/", {1}), "an empty segment at byte 2"},
      {Spec("a/../b", {1}), "the segment '..'"},
      {Spec("a b", {1}), "byte 1 (0x20) is not allowed"},
      {Spec("caf\xc3\xa9", {1}), "byte 3 (0xc3)"},
      {Spec(std::string(513, 'n'), {1}), "513 bytes"},
      {Spec("x", {-1}), "shape [-1] has a negative size"},
      {Spec("x", {1, 1, 1, 1, 1, 1, 1, 1, 1}), "more than 8 dimensions"},
      {Spec("x", {1ll << 32, 1ll << 32}), "byte count overflows 64 bits"},
      {StoreTensorSpec{"x", DType::kUnspecified, {1}}, "dtype value 0 is not a wire dtype"},
  };
  for (const Case& c : cases) {
    Status s = store.Publish(kAlice, {c.spec}, {}, FillIndex);
    EXPECT_EQ(s.reason(), Reason::kBadArgument) << s.ToString();
    EXPECT_NE(s.message().find(c.says), std::string::npos) << s.message();
  }
  Status s = store.Publish(kAlice, {Spec("a", {1}), Spec("a", {2})}, {}, FillIndex);
  EXPECT_NE(s.message().find("the name 'a' twice in one set"), std::string::npos) << s.message();
  EXPECT_EQ(store.Publish(kAlice, {}, {}, FillIndex).reason(), Reason::kBadArgument);
  EXPECT_EQ(store.used_bytes(), 0u);
  EXPECT_EQ(alloc.allocations, 0);
  EXPECT_TRUE(WeightStore::CheckName("flux1-dev/blocks.0.ff.net.0/qweight_v2").ok());
}

TEST(WeightStoreTest, ANamePublishedTwiceIsAlreadyExistsAndTheSetPublishesNothing) {
  HostAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt);
  ASSERT_TRUE(store.Publish(kAlice, {Spec("m/a", {4})}, {}, FillIndex).ok());
  Status s = store.Publish(kBob, {Spec("m/b", {4}), Spec("m/a", {4})}, {}, FillIndex);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(s.message().find("store entry 'm/a' exists"), std::string::npos) << s.message();
  StoreRef r;
  EXPECT_EQ(store.Lookup(kBob, "m/b", &r).code(), StatusCode::kNotFound);  // all or nothing
  EXPECT_EQ(store.used_bytes(), 16u);
}

TEST(WeightStoreTest, AccessFollowsOwnerListedUidsAllowedGidAndRoot) {
  HostAllocator alloc;
  WeightStore store(&alloc, 1 << 20, gid_t{500});
  ASSERT_TRUE(store.Publish(kAlice, {Spec("private/w", {1})}, {}, FillIndex).ok());
  ASSERT_TRUE(store.Publish(kAlice, {Spec("shared/w", {1})}, {1002}, FillIndex).ok());
  StoreRef r;
  Status s = store.Lookup(kBob, "private/w", &r);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("belongs to uid 1001, which did not admit uid 1002"), std::string::npos) << s.message();
  EXPECT_TRUE(store.Lookup(kBob, "shared/w", &r).ok());
  EXPECT_TRUE(store.Lookup(kRoot, "private/w", &r).ok());
  EXPECT_TRUE(store.Lookup(Peer(1003, 500), "private/w", &r).ok());          // primary group
  EXPECT_TRUE(store.Lookup(Peer(1003, 100, {7, 500}), "private/w", &r).ok()); // supplementary group
  EXPECT_EQ(store.Lookup(Peer(1003, 100, {7}), "private/w", &r).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(store.List(kBob).size(), 1u);  // private/w is left out
  EXPECT_EQ(store.List(kBob)[0].name, "shared/w");

  s = store.Delete(kBob, "shared/w");  // reading is not owning
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("uid 1002 may not delete it"), std::string::npos) << s.message();
  EXPECT_TRUE(store.Delete(kRoot, "shared/w").ok());
  EXPECT_EQ(store.Delete(kAlice, "shared/w").code(), StatusCode::kNotFound);
}

TEST(WeightStoreTest, DeletionIsDeferredWhileAReferenceLivesAndTheBytesCountUntilThen) {
  HostAllocator alloc;
  auto store = std::make_unique<WeightStore>(&alloc, 100, std::nullopt);
  ASSERT_TRUE(store->Publish(kAlice, {Spec("w", {16})}, {}, FillIndex).ok());  // 64 bytes
  StoreRef held;
  ASSERT_TRUE(store->Lookup(kAlice, "w", &held).ok());
  ASSERT_TRUE(store->Delete(kAlice, "w").ok());
  StoreRef again;
  EXPECT_EQ(store->Lookup(kAlice, "w", &again).code(), StatusCode::kNotFound);  // gone for new lookups
  EXPECT_EQ(alloc.live, 1);                                                      // but not freed
  EXPECT_EQ(reinterpret_cast<const char*>(held->address())[63], 1);
  EXPECT_EQ(store->used_bytes(), 64u);
  // Its bytes still count: 64 + 40 > 100.
  EXPECT_EQ(store->Publish(kAlice, {Spec("w", {10})}, {}, FillIndex).reason(), Reason::kResourceExhausted);
  held.reset();
  EXPECT_EQ(alloc.live, 0);
  EXPECT_EQ(store->used_bytes(), 0u);
  ASSERT_TRUE(store->Publish(kAlice, {Spec("w", {10})}, {}, FillIndex).ok());  // the name is free again

  // A reference may outlive the store itself.
  ASSERT_TRUE(store->Lookup(kAlice, "w", &held).ok());
  store.reset();
  EXPECT_EQ(alloc.live, 1);
  held.reset();
  EXPECT_EQ(alloc.live, 0);
}

TEST(WeightStoreTest, ASetsBlockGoesWhenItsLastEntryIsDeletedAndUnreferenced) {
  HostAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt);
  ASSERT_TRUE(store.Publish(kAlice, {Spec("m/a", {4}), Spec("m/b", {4})}, {}, FillIndex).ok());
  StoreRef b;
  ASSERT_TRUE(store.Lookup(kAlice, "m/b", &b).ok());
  ASSERT_TRUE(store.Delete(kAlice, "m/a").ok());
  EXPECT_EQ(alloc.live, 1);  // m/b still lives in the block
  EXPECT_EQ(store.used_bytes(), 272u);
  ASSERT_TRUE(store.Delete(kAlice, "m/b").ok());
  EXPECT_EQ(alloc.live, 1);  // deleted, but referenced
  EXPECT_EQ(reinterpret_cast<const char*>(b->address())[15], 2);
  b.reset();
  EXPECT_EQ(alloc.live, 0);
  EXPECT_EQ(store.used_bytes(), 0u);
}

TEST(WeightStoreTest, TheLimitCountsWhatTheBlockTakesFromTheDevice) {
  HostAllocator alloc;
  alloc.granularity = 4096;  // as the GPU's 2 MiB pages, smaller
  WeightStore store(&alloc, 3 * 4096, std::nullopt);
  std::vector<StoreEntryInfo> published;
  ASSERT_TRUE(store.Publish(kAlice, {Spec("a", {1})}, {}, FillIndex, &published).ok());
  EXPECT_EQ(store.used_bytes(), 4096u);
  EXPECT_EQ(published[0].block_bytes, 4096u);
  ASSERT_TRUE(store.Publish(kAlice, {Spec("b", {1025})}, {}, FillIndex).ok());  // 4100 bytes: two pages
  Status s = store.Publish(kAlice, {Spec("c", {1})}, {}, FillIndex);
  EXPECT_EQ(s.reason(), Reason::kResourceExhausted);
  EXPECT_NE(s.message().find("4096 bytes do not fit the store: 12288 of --max-store-bytes 12288"), std::string::npos)
      << s.message();
}

TEST(WeightStoreTest, OverTheLimitIsResourceExhaustedNamingTheBytes) {
  HostAllocator alloc;
  WeightStore store(&alloc, 100, std::nullopt);
  ASSERT_TRUE(store.Publish(kAlice, {Spec("a", {20})}, {}, FillIndex).ok());  // 80 bytes
  // 16 bytes, then 8 at the next 256-byte boundary: a block of 264.
  Status s = store.Publish(kAlice, {Spec("b", {4}), Spec("c", {2})}, {}, FillIndex);
  EXPECT_EQ(s.reason(), Reason::kResourceExhausted);
  EXPECT_NE(s.message().find("264 bytes do not fit the store: 80 of --max-store-bytes 100 are in use"), std::string::npos)
      << s.message();
  EXPECT_TRUE(store.Publish(kAlice, {Spec("b", {5})}, {}, FillIndex).ok());  // exactly full
  EXPECT_EQ(store.used_bytes(), 100u);
  WeightStore none(&alloc, 0, std::nullopt);
  EXPECT_EQ(none.Publish(kAlice, {Spec("a", {1})}, {}, FillIndex).reason(), Reason::kResourceExhausted);
  EXPECT_TRUE(none.Publish(kAlice, {Spec("empty", {0})}, {}, FillIndex).ok());  // no byte
}

// Empty tensors take no bytes, so the entry count bounds them (and the host
// memory every entry costs): a set that would pass --max-store-entries is
// refused whole, and a deleted entry frees its place.
TEST(WeightStoreTest, TheEntryLimitCountsEveryEntryEmptyOrNot) {
  HostAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt, /*max_entries=*/3);
  EXPECT_EQ(store.max_entries(), 3u);
  ASSERT_TRUE(store.Publish(kAlice, {Spec("e0", {0}), Spec("w", {4})}, {}, FillIndex).ok());
  Status s = store.Publish(kAlice, {Spec("e1", {0}), Spec("e2", {0, 3})}, {}, FillIndex);
  EXPECT_EQ(s.reason(), Reason::kResourceExhausted);
  EXPECT_NE(s.message().find("2 entries do not fit the store: 2 of --max-store-entries 3 are held"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(store.entries(), 2u);
  EXPECT_EQ(store.Publish(kAlice, {Spec("a", {0}), Spec("b", {0}), Spec("c", {0}), Spec("d", {0})}, {}, FillIndex)
                .reason(),
            Reason::kResourceExhausted);  // larger than the whole limit
  EXPECT_TRUE(store.Publish(kAlice, {Spec("e1", {0})}, {}, FillIndex).ok());  // exactly full
  ASSERT_TRUE(store.Delete(kAlice, "e0").ok());
  EXPECT_TRUE(store.Publish(kAlice, {Spec("e2", {0})}, {}, FillIndex).ok());
  EXPECT_EQ(store.entries(), 3u);
}

TEST(WeightStoreTest, AFailedAllocationOrFillLeavesNothingBehind) {
  HostAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt);
  alloc.fail_after = 0;  // the set's block fails
  Status s = store.Publish(kAlice, {Spec("a", {4}), Spec("b", {4})}, {}, FillIndex);
  EXPECT_EQ(s.reason(), Reason::kResourceExhausted);
  EXPECT_NE(s.message().find("publish of 2 tensors (272 bytes): device memory full"), std::string::npos) << s.message();
  EXPECT_EQ(alloc.live, 0);
  EXPECT_EQ(store.used_bytes(), 0u);
  alloc.fail_after = -1;

  s = store.Publish(kAlice, {Spec("a", {4}), Spec("b", {4})}, {},
                    [](size_t i, const StoreEntry&) { return i == 1 ? Status::Rejected(Reason::kBadArgument, "short file") : Status::Ok(); });
  EXPECT_NE(s.message().find("publish 'b': short file"), std::string::npos) << s.message();
  EXPECT_EQ(alloc.live, 0);
  EXPECT_EQ(store.used_bytes(), 0u);
  StoreRef r;
  EXPECT_EQ(store.Lookup(kAlice, "a", &r).code(), StatusCode::kNotFound);
  EXPECT_TRUE(store.Publish(kAlice, {Spec("a", {4}), Spec("b", {4})}, {}, FillIndex).ok());  // names free again
}

TEST(WeightStoreTest, ASetBeingFilledIsInvisibleAndItsNamesAreTaken) {
  HostAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt);
  std::atomic<int> stage{0};
  std::thread publisher([&] {
    Status s = store.Publish(kAlice, {Spec("set/a", {4}), Spec("set/b", {4})}, {}, [&](size_t i, const StoreEntry& e) {
      if (i == 1) {
        stage = 1;
        while (stage.load() != 2) std::this_thread::yield();
      }
      return FillIndex(i, e);
    });
    EXPECT_TRUE(s.ok()) << s.ToString();
  });
  while (stage.load() != 1) std::this_thread::yield();
  // Mid-publish: neither entry is visible (the fill of the first has run),
  // and the names cannot be taken by another set.
  StoreRef r;
  Status s = store.Lookup(kAlice, "set/a", &r);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("being published"), std::string::npos) << s.message();
  EXPECT_TRUE(store.List(kAlice).empty());
  EXPECT_EQ(store.Publish(kBob, {Spec("set/a", {1})}, {}, FillIndex).code(), StatusCode::kAlreadyExists);
  stage = 2;
  publisher.join();
  EXPECT_TRUE(store.Lookup(kAlice, "set/a", &r).ok());
  EXPECT_TRUE(store.Lookup(kAlice, "set/b", &r).ok());
}

TEST(WeightStoreTest, ConcurrentPublishesOfOneNameAdmitExactlyOne) {
  HostAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt);
  for (int round = 0; round < 50; ++round) {
    std::atomic<int> ok{0}, exists{0};
    std::vector<std::thread> threads;
    const std::string name = "race/" + std::to_string(round);
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        Status s = store.Publish(kAlice, {Spec(name, {8})}, {}, FillIndex);
        (s.ok() ? ok : exists) += 1;
        if (!s.ok()) {
          EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s.ToString();
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(ok.load(), 1) << name;
    EXPECT_EQ(exists.load(), 3) << name;
  }
  EXPECT_EQ(store.used_bytes(), 50u * 32u);
  EXPECT_EQ(alloc.live, 50);
}

}  // namespace
}  // namespace cache_dit_opd::server
