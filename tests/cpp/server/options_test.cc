#include "server/options.h"

#include <gtest/gtest.h>

#include <vector>

namespace cache_dit_opd {
namespace {

Status Parse(std::vector<const char*> args, Options* o, bool* help) {
  args.insert(args.begin(), "cache-dit-opd");
  return ParseOptions(static_cast<int>(args.size()), args.data(), o, help);
}

TEST(OptionsTest, Defaults) {
  Options o;
  bool help = true;
  ASSERT_TRUE(Parse({}, &o, &help).ok());
  EXPECT_FALSE(help);
  EXPECT_EQ(o.device, 0);
  EXPECT_EQ(o.socket, "");
  EXPECT_EQ(o.log_level, "info");
  EXPECT_EQ(o.max_sessions, 64u);
  EXPECT_EQ(o.max_lanes, 16u);
  EXPECT_EQ(o.drain_deadline_ms, 5000u);
  EXPECT_FALSE(o.allowed_gid.has_value());
  EXPECT_TRUE(o.load_libraries.empty());
  EXPECT_TRUE(o.ring);
  EXPECT_EQ(o.ring_capacity, 64u);
  EXPECT_EQ(o.spin_us, 200u);
  // What a client may send: proto_test.cc shows the largest request fits.
  EXPECT_EQ(o.max_message_bytes, 64ull << 10);
  EXPECT_EQ(o.memory_trim_ms, 10000u);
}

TEST(OptionsTest, MetricsAddress) {
  Options o;
  bool help = false;
  EXPECT_EQ(o.metrics_address, "127.0.0.1:9464");
  EXPECT_FALSE(o.metrics_address_given);
  for (const char* ok : {"127.0.0.1:9464", "0.0.0.0:1", "[::1]:65535", "localhost:9500", ""}) {
    Options m;
    ASSERT_TRUE(Parse({"--metrics-address", ok}, &m, &help).ok()) << ok;
    EXPECT_EQ(m.metrics_address, ok);
    EXPECT_TRUE(m.metrics_address_given);
  }
  for (const char* bad : {"9464", "127.0.0.1:", ":9464", "127.0.0.1:0", "127.0.0.1:65536", "::1:9464",
                          "127.0.0.1:94a4", "127.0.0.1:123456"}) {
    Options m;
    Status s = Parse({"--metrics-address", bad}, &m, &help);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(std::string("'") + bad + "'"), std::string::npos) << s.message();
  }
}

TEST(OptionsTest, RingFlags) {
  Options o;
  bool help = false;
  EXPECT_EQ(o.executor_threads, 1u);
  ASSERT_TRUE(Parse({"--no-ring", "--ring-capacity", "1024", "--spin-us=0", "--executor-threads", "4"}, &o, &help).ok());
  EXPECT_FALSE(o.ring);
  EXPECT_EQ(o.ring_capacity, 1024u);
  EXPECT_EQ(o.spin_us, 0u);
  EXPECT_EQ(o.executor_threads, 4u);
  EXPECT_EQ(o.calls_ahead, 32u);
  EXPECT_EQ(o.held_calls, 256u);
  ASSERT_TRUE(Parse({"--calls-ahead", "4", "--held-calls=4096"}, &o, &help).ok());
  EXPECT_EQ(o.calls_ahead, 4u);
  EXPECT_EQ(o.held_calls, 4096u);
  EXPECT_EQ(o.park_busy_lanes, 3u);
  ASSERT_TRUE(Parse({"--park-busy-lanes", "0"}, &o, &help).ok());
  EXPECT_EQ(o.park_busy_lanes, 0u);
  ASSERT_TRUE(Parse({"--no-ring", "--ring", "--ring-capacity=8"}, &o, &help).ok());
  EXPECT_TRUE(o.ring);  // the last one wins
  EXPECT_EQ(o.ring_capacity, 8u);
  struct Case {
    std::vector<const char*> args;
    std::string expect;
  } cases[] = {
      {{"--ring-capacity", "48"}, "48 is not a power of two"},
      {{"--ring-capacity", "4"}, "out of range [8, 1024]"},
      {{"--ring-capacity", "2048"}, "out of range [8, 1024]"},
      {{"--ring-capacity"}, "needs a value"},
      {{"--spin-us", "-5"}, "'-5'"},
      {{"--spin-us", "100001"}, "out of range"},
      {{"--executor-threads", "0"}, "out of range [1, 16]"},
      {{"--executor-threads=17"}, "out of range [1, 16]"},
      {{"--calls-ahead", "0"}, "out of range [1, 64]"},
      {{"--calls-ahead", "65"}, "out of range [1, 64]"},
      {{"--held-calls", "4097"}, "out of range [1, 4096]"},
      {{"--park-busy-lanes", "4097"}, "out of range [0, 4096]"},
      {{"--ring=yes"}, "--ring takes no value"},
      {{"--no-ring=1"}, "--no-ring takes no value"},
  };
  for (const Case& c : cases) {
    Options fresh;
    Status s = Parse(c.args, &fresh, &help);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.args[0];
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << c.args[0] << ": " << s.message();
  }
}

TEST(OptionsTest, EveryFlagInBothSpellings) {
  Options o;
  bool help = false;
  ASSERT_TRUE(Parse({"--device", "3", "--socket=/tmp/x.sock", "--runtime-dir", "/tmp/rd", "--log-level=debug",
                     "--max-sessions", "8", "--max-sessions-per-uid=2", "--max-lanes=4", "--max-regions", "100", "--max-mapped-bytes", "2G",
                     "--max-store-bytes=3G", "--max-message-bytes=16M", "--drain-deadline-ms", "250", "--bind-timeout-ms=900",
                     "--allowed-gid", "1234", "--load-library", "/a.so", "--load-library=/b.so",
                     "--memory-trim-ms=250"},
                    &o, &help)
                  .ok());
  EXPECT_EQ(o.device, 3);
  EXPECT_EQ(o.socket, "/tmp/x.sock");
  EXPECT_EQ(o.runtime_dir, "/tmp/rd");
  EXPECT_EQ(o.log_level, "debug");
  EXPECT_EQ(o.max_sessions, 8u);
  EXPECT_EQ(o.max_sessions_per_uid, 2u);
  EXPECT_EQ(o.max_lanes, 4u);
  EXPECT_EQ(o.max_regions, 100u);
  EXPECT_EQ(o.max_mapped_bytes, 2ull << 30);
  EXPECT_EQ(o.max_store_bytes, 3ull << 30);
  EXPECT_EQ(o.max_message_bytes, 16ull << 20);
  EXPECT_EQ(o.drain_deadline_ms, 250u);
  EXPECT_EQ(o.bind_timeout_ms, 900u);
  ASSERT_TRUE(o.allowed_gid.has_value());
  EXPECT_EQ(*o.allowed_gid, 1234u);
  EXPECT_EQ(o.load_libraries, (std::vector<std::string>{"/a.so", "/b.so"}));
  EXPECT_EQ(o.memory_trim_ms, 250u);
}

TEST(OptionsTest, GroupNameResolves) {
  Options o;
  bool help = false;
  ASSERT_TRUE(Parse({"--allowed-gid", "root"}, &o, &help).ok());
  EXPECT_EQ(*o.allowed_gid, 0u);
  Status s = Parse({"--allowed-gid", "no-such-group-xyz"}, &o, &help);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("no-such-group-xyz"), std::string::npos);
}

TEST(OptionsTest, ErrorsNameFlagAndValue) {
  struct Case {
    std::vector<const char*> args;
    std::string expect;
  } cases[] = {
      {{"--bogus"}, "--bogus"},
      {{"--device"}, "needs a value"},
      {{"--device", "x"}, "'x'"},
      {{"--device", "-1"}, "'-1'"},
      {{"--max-sessions", "0"}, "out of range"},
      {{"--max-sessions-per-uid", "70000"}, "out of range"},
      {{"--max-lanes", "5000"}, "5000"},
      {{"--log-level", "loud"}, "'loud'"},
      {{"--max-mapped-bytes", "12Q"}, "12Q"},
      {{"--max-mapped-bytes", "0"}, "> 0"},
      {{"--max-message-bytes", "1"}, "out of range"},
      {{"--socket="}, "empty"},
      {{"positional"}, "positional"},
      {{"--max-mapped-bytes", "99999999999999T"}, "overflows"},
  };
  for (const Case& c : cases) {
    Options o;
    bool help = false;
    Status s = Parse(c.args, &o, &help);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.args[0];
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << c.args[0] << ": " << s.message();
  }
}

TEST(OptionsTest, HelpDocumentsEveryFlag) {
  Options o;
  bool help = false;
  ASSERT_TRUE(Parse({"--help"}, &o, &help).ok());
  EXPECT_TRUE(help);
  ASSERT_TRUE(Parse({"-h"}, &o, &help).ok());
  EXPECT_TRUE(help);
  const std::string text = OptionsHelp();
  for (const char* flag : {"--device", "--socket", "--runtime-dir", "--log-level", "--max-sessions", "--max-lanes",
                           "--max-regions", "--max-mapped-bytes", "--max-message-bytes", "--drain-deadline-ms",
                           "--bind-timeout-ms", "--allowed-gid", "--load-library", "--ring", "--no-ring",
                           "--ring-capacity", "--spin-us", "--executor-threads", "--parking-slots",
                           "--park-busy-lanes", "--park-deadline-ms", "--calls-ahead", "--held-calls", "--memory-trim-ms", "--metrics-address", "--help"}) {
    EXPECT_NE(text.find(flag), std::string::npos) << flag;
  }
  EXPECT_NE(text.find(".session.sock"), std::string::npos);
  EXPECT_NE(text.find("CACHE_DIT_OPD_RUNTIME_DIR"), std::string::npos);
}

TEST(OptionsTest, ByteSizes) {
  uint64_t v = 0;
  ASSERT_TRUE(ParseByteSize("4096", &v).ok());
  EXPECT_EQ(v, 4096u);
  ASSERT_TRUE(ParseByteSize("4k", &v).ok());
  EXPECT_EQ(v, 4096u);
  ASSERT_TRUE(ParseByteSize("3T", &v).ok());
  EXPECT_EQ(v, 3ull << 40);
  EXPECT_FALSE(ParseByteSize("", &v).ok());
  EXPECT_FALSE(ParseByteSize("K", &v).ok());
  EXPECT_FALSE(ParseByteSize("1.5G", &v).ok());
}

}  // namespace
}  // namespace cache_dit_opd
