// server/store/publish_file.h: a file's tensors reach the store byte for
// byte, and a shutdown (StoreWorker::Stop) ends a publish in progress at its
// next chunk, leaving nothing behind, instead of waiting for the whole file.
#include "server/store/publish_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <string>
#include <thread>

#include "test_util.h"
#include "tests/fake_daemon/fakes.h"

namespace cache_dit_opd::server {
namespace {

using testing::TempDir;

// A safetensors file of one float32 tensor "w" of `floats` elements, every
// byte `fill`.
std::string WriteFile(const TempDir& dir, uint64_t floats, char fill) {
  const std::string header =
      R"({"w":{"dtype":"F32","shape":[)" + std::to_string(floats) + R"(],"data_offsets":[0,)" +
      std::to_string(4 * floats) + "]}}";
  const std::string path = dir.File("w.safetensors");
  std::ofstream(path, std::ios::binary) << testing::SafetensorsImage(header, 4 * floats, fill);
  return path;
}

PeerCred Self() {
  PeerCred p;
  p.pid = ::getpid();
  p.uid = ::geteuid();
  p.gid = ::getegid();
  return p;
}

TEST(PublishFileTest, ATensorReadInManyChunksArrivesWhole) {
  TempDir dir;
  testing::HostStoreAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt);
  std::vector<StoreEntryInfo> out;
  const Status s = PublishFile(store, Self(), {WriteFile(dir, 1000, '\x3c'), "m/", {}, {}}, &out, {}, 64);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(out.size(), 1u);
  StoreRef w;
  ASSERT_TRUE(store.Lookup(Self(), "m/w", &w).ok());
  ASSERT_EQ(w->bytes, 4000u);
  const auto* bytes = reinterpret_cast<const char*>(w->address());
  EXPECT_EQ(std::count(bytes, bytes + 4000, '\x3c'), 4000);
}

TEST(PublishFileTest, AStopRequestedBeforeTheFirstChunkIsDrainingAndPublishesNothing) {
  TempDir dir;
  testing::HostStoreAllocator alloc;
  WeightStore store(&alloc, 1 << 20, std::nullopt);
  std::stop_source stop;
  stop.request_stop();
  std::vector<StoreEntryInfo> out;
  const std::string path = WriteFile(dir, 1000, 1);
  const Status s = PublishFile(store, Self(), {path, "m/", {}, {}}, &out, stop.get_token());
  EXPECT_EQ(s.reason(), Reason::kDraining) << s.ToString();
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("0 of 4000 bytes of 'w' read"), std::string::npos) << s.message();
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(store.used_bytes(), 0u);
  EXPECT_EQ(alloc.live, 0);
  StoreRef w;
  EXPECT_FALSE(store.Lookup(Self(), "m/w", &w).ok());
}

// 16 MiB read 1 byte a chunk takes seconds; Stop must not wait for it.
TEST(PublishFileTest, StopEndsThePublishInProgressAndTheQueuedOneAndRefusesNewOnes) {
  TempDir dir;
  const std::string path = WriteFile(dir, 4u << 20, 2);
  testing::HostStoreAllocator alloc;
  WeightStore store(&alloc, 64u << 20, std::nullopt);
  StoreWorker worker;
  std::atomic<bool> started{false};
  Status first = Status::Ok(), second = Status::Ok();
  std::vector<StoreEntryInfo> out1, out2;
  ASSERT_TRUE(worker.Post([&] {
    started.store(true);
    first = PublishFile(store, Self(), {path, "a/", {}, {}}, &out1, worker.stop_token(), 1);
  }));
  ASSERT_TRUE(worker.Post([&] { second = PublishFile(store, Self(), {path, "b/", {}, {}}, &out2, worker.stop_token()); }));
  while (!started.load()) std::this_thread::yield();
  worker.Stop();
  EXPECT_EQ(first.reason(), Reason::kDraining) << first.ToString();
  EXPECT_NE(first.message().find("of 16777216 bytes of 'w' read"), std::string::npos) << first.message();
  EXPECT_EQ(second.reason(), Reason::kDraining) << second.ToString();
  EXPECT_NE(second.message().find("(0 of 16777216 bytes"), std::string::npos) << second.message();
  EXPECT_EQ(store.used_bytes(), 0u);
  EXPECT_EQ(alloc.live, 0);
  EXPECT_FALSE(worker.Post([] {}));
}

}  // namespace
}  // namespace cache_dit_opd::server
