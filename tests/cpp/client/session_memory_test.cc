// Session shared memory: the header is validated before anything in the
// memfd is trusted (client/core/session_mapping.h).
#include "client/core/session_mapping.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <functional>

#include "tests/cpp/client/fake_memory.h"

namespace cache_dit_opd::client {
namespace {

using test::MakeHeader;
using test::MakeMemfd;
using test::SessionBytes;

constexpr uint64_t kSession = 99;
constexpr uint32_t kLanes = 4;

Status MapWith(const std::function<void(v1::SessionMemoryHeader&)>& corrupt, uint64_t total = SessionBytes(kLanes),
               ExpectedLayout expect = {kSession, kLanes, 0}) {
  v1::SessionMemoryHeader h = MakeHeader(total, kSession, kLanes);
  corrupt(h);
  int fd = MakeMemfd(total, h);
  EXPECT_GE(fd, 0);
  std::unique_ptr<SessionMapping> m;
  Status s = SessionMapping::Map(fd, expect, &m);
  ::close(fd);
  return s;
}

TEST(SessionMapping, MapsAValidObject) {
  const uint64_t total = SessionBytes(kLanes);
  int fd = MakeMemfd(total, MakeHeader(total, kSession, kLanes));
  ASSERT_GE(fd, 0);
  std::unique_ptr<SessionMapping> m;
  Status s = SessionMapping::Map(fd, {kSession, kLanes, total}, &m);
  ::close(fd);  // the mapping outlives the descriptor
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(m->bytes(), total);
  EXPECT_EQ(m->lane_count(), kLanes);
  EXPECT_EQ(m->daemon_pid(), 4242u);
  for (uint32_t l = 0; l < kLanes; ++l) {
    EXPECT_EQ(reinterpret_cast<char*>(m->lane(l)) - static_cast<char*>(m->base()),
              static_cast<ptrdiff_t>(4096 + 128 * l));
    EXPECT_EQ(m->lane_offset(l), 4096u + 128u * l);
  }
  // Shared with the "daemon": a write through the mapping is visible to a new mapping.
  StoreSemaphore(&m->lane(2)->done, 17);
  EXPECT_EQ(LoadSemaphore(&m->lane(2)->done), 17u);
}

TEST(SessionMapping, RejectsBadMagicAndVersionAsSkew) {
  Status s = MapWith([](auto& h) { h.magic = 0x12345678; });
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("magic"), std::string::npos);
  s = MapWith([](auto& h) { h.layout_version = v1::kLayoutVersion + 1; });
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("version " + std::to_string(v1::kLayoutVersion + 1)), std::string::npos) << s.message();
}

TEST(SessionMapping, RejectsInconsistentSizes) {
  EXPECT_FALSE(MapWith([](auto& h) { h.total_bytes += 4096; }).ok());
  EXPECT_FALSE(MapWith([](auto& h) { h.total_bytes = 0; }).ok());
  // The memfd's size must equal what OpenSession announced.
  EXPECT_FALSE(MapWith([](auto&) {}, SessionBytes(kLanes), {kSession, kLanes, SessionBytes(kLanes) + 4096}).ok());
  // Smaller than a header.
  EXPECT_FALSE(MapWith([](auto&) {}, 1024).ok());
  // Not a page multiple.
  EXPECT_FALSE(MapWith([](auto& h) { h.total_bytes = 4096 + 100; }, 4096 + 100).ok());
}

TEST(SessionMapping, RejectsForeignSessionAndLaneMismatch) {
  EXPECT_FALSE(MapWith([](auto& h) { h.session_id = kSession + 1; }).ok());
  EXPECT_FALSE(MapWith([](auto& h) { h.lane_count = kLanes - 1; }).ok());
  EXPECT_FALSE(MapWith([](auto& h) { h.lane_count = 0; }).ok());
  EXPECT_FALSE(MapWith([](auto& h) { h.lane_count = kMaxLanes + 1; }).ok());
  EXPECT_FALSE(MapWith([](auto& h) { h.lane_stride = 64; }).ok());
}

TEST(SessionMapping, RejectsLanesOrRingOutsideTheMapping) {
  EXPECT_FALSE(MapWith([](auto& h) { h.lanes_offset = 0; }).ok());         // over the header
  EXPECT_FALSE(MapWith([](auto& h) { h.lanes_offset = 4096 + 64; }).ok());  // not a page multiple
  EXPECT_FALSE(MapWith([](auto& h) { h.lanes_offset = 8192; }).ok());       // runs past the end
  EXPECT_FALSE(MapWith([](auto& h) { h.lanes_offset = ~uint64_t{0} & ~uint64_t{4095}; }).ok());  // overflow
  EXPECT_FALSE(MapWith([](auto& h) { h.ring_offset = 4096 * 3; }).ok());    // offset without bytes
  EXPECT_FALSE(MapWith([](auto& h) { h.ring_bytes = 4096; }).ok());         // bytes without offset
  EXPECT_FALSE(MapWith([](auto& h) { h.ring_offset = 4096; h.ring_bytes = 512; }).ok());  // overlaps lanes
  EXPECT_FALSE(MapWith([](auto& h) { h.ring_offset = 4096 + 512; h.ring_bytes = 8192; }).ok());  // past end
  EXPECT_FALSE(MapWith([](auto& h) { h.ring_offset = 4096 + 512; h.ring_bytes = ~uint64_t{0}; }).ok());
}

// A ring inside the mapping but off a page boundary: the ring producer's
// atomics on its control words would be misaligned (UBSan in
// tests/fuzz/session_header_fuzz found the header accepted; its input is in
// the corpus).
TEST(SessionMapping, RejectsARingOffAPageBoundary) {
  const uint64_t total = 4096 * 4;
  for (uint64_t offset : {8192 + 2, 8192 + 8, 8192 + 64}) {
    Status s = MapWith([&](auto& h) { h.ring_offset = offset; h.ring_bytes = 4096; }, total, {kSession, kLanes, total});
    EXPECT_EQ(s.code(), StatusCode::kInternal) << offset << ": " << s.ToString();
    EXPECT_NE(s.message().find("ring_offset " + std::to_string(offset) + " is not a page multiple"), std::string::npos)
        << s.message();
  }
}

TEST(SessionMapping, AcceptsARingInsideTheMapping) {
  const uint64_t total = 4096 * 4;
  Status s = MapWith([](auto& h) { h.ring_offset = 8192; h.ring_bytes = 8192; }, total, {kSession, kLanes, total});
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// The ring's place is the validated copy's: a daemon rewriting the shared
// header after the bind moves nothing the client uses.
TEST(SessionMapping, KeepsTheRingWhereTheValidatedHeaderPutIt) {
  const uint64_t total = 4096 * 4;
  v1::SessionMemoryHeader h = MakeHeader(total, kSession, kLanes);
  h.ring_offset = 8192;
  h.ring_bytes = 8192;
  int fd = MakeMemfd(total, h);
  ASSERT_GE(fd, 0);
  std::unique_ptr<SessionMapping> m;
  ASSERT_TRUE(SessionMapping::Map(fd, {kSession, kLanes, total}, &m).ok());
  ::close(fd);
  auto* shared = static_cast<v1::SessionMemoryHeader*>(m->base());
  shared->ring_offset = uint64_t{1} << 40;
  shared->ring_bytes = ~uint64_t{0};
  EXPECT_EQ(m->ring_offset(), 8192u);
  EXPECT_EQ(m->ring_bytes(), 8192u);
}

TEST(Semaphores, RaiseNeverLowers) {
  uint64_t v = 5;
  EXPECT_EQ(RaiseSemaphore(&v, 3), 5u);
  EXPECT_EQ(v, 5u);
  EXPECT_EQ(RaiseSemaphore(&v, 9), 9u);
  EXPECT_EQ(v, 9u);
  // Compared the way the GPU's GEQ compares, (int64)(a - b) >= 0.
  uint64_t w = ~uint64_t{0} - 1;
  EXPECT_EQ(RaiseSemaphore(&w, 2), 2u);
}

}  // namespace
}  // namespace cache_dit_opd::client
