// Discovery: GPU UUID formatting, the fixed search order, the
// CACHE_DIT_OPD_ADDRESS override (client/discovery.h).
#include "client/discovery.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace cache_dit_opd::client {
namespace {

constexpr const char* kUuid = "GPU-5f1c2a3b-0d4e-4f60-8a9b-0c1d2e3f4a5b";

// A real Unix socket file at `path` (discovery accepts only sockets).
void MakeSocketFile(const std::string& path) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << path;
  ::close(fd);
}

class DiscoveryDirs : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/opd-disc.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    env_.runtime_dir = root_ + "/runtime";
    env_.system_dir = root_ + "/run/cache-dit-opd";
    env_.xdg_runtime_dir = root_ + "/xdg";
    env_.tmp_dir = root_ + "/tmp/cache-dit-opd";
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  std::string Sock(const std::string& dir) { return dir + "/" + kUuid + ".sock"; }

  std::string root_;
  DiscoveryEnv env_;
};

TEST(Discovery, SearchOrderIsRuntimeDirRunXdgTmp) {
  DiscoveryEnv env;
  env.runtime_dir = "/custom";
  env.xdg_runtime_dir = "/run/user/1000";
  EXPECT_EQ(DaemonSearchDirs(env),
            (std::vector<std::string>{"/custom", "/run/cache-dit-opd", "/run/user/1000/cache-dit-opd",
                                      "/tmp/cache-dit-opd"}));
  env.xdg_runtime_dir = "/run/user/1000/";
  EXPECT_EQ(DaemonSearchDirs(env)[2], "/run/user/1000/cache-dit-opd");
}

TEST(Discovery, UnsetVariablesAreSkippedAndDuplicatesKeptOnce) {
  DiscoveryEnv env;
  EXPECT_EQ(DaemonSearchDirs(env), (std::vector<std::string>{"/run/cache-dit-opd", "/tmp/cache-dit-opd"}));
  env.runtime_dir = "/tmp/cache-dit-opd";
  EXPECT_EQ(DaemonSearchDirs(env), (std::vector<std::string>{"/tmp/cache-dit-opd", "/run/cache-dit-opd"}));
}

TEST(Discovery, FromEnvironmentReadsTheThreeVariables) {
  setenv("CACHE_DIT_OPD_ADDRESS", "unix:/a.sock", 1);
  setenv("CACHE_DIT_OPD_RUNTIME_DIR", "/r", 1);
  setenv("XDG_RUNTIME_DIR", "/x", 1);
  DiscoveryEnv env = DiscoveryEnv::FromEnvironment();
  EXPECT_EQ(env.address, "unix:/a.sock");
  EXPECT_EQ(env.runtime_dir, "/r");
  EXPECT_EQ(env.xdg_runtime_dir, "/x");
  unsetenv("CACHE_DIT_OPD_ADDRESS");
  unsetenv("CACHE_DIT_OPD_RUNTIME_DIR");
  unsetenv("XDG_RUNTIME_DIR");
  env = DiscoveryEnv::FromEnvironment();
  EXPECT_EQ(env.address, "");
  EXPECT_EQ(env.runtime_dir, "");
  EXPECT_EQ(env.xdg_runtime_dir, "");
  EXPECT_EQ(env.system_dir, "/run/cache-dit-opd");
  EXPECT_EQ(env.tmp_dir, "/tmp/cache-dit-opd");
}

TEST_F(DiscoveryDirs, NothingFoundListsEveryPathTried) {
  DaemonAddress a;
  Status s = FindDaemon(kUuid, env_, &a);
  ASSERT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_NE(s.message().find(Sock(env_.runtime_dir)), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(Sock(env_.system_dir)), std::string::npos);
  EXPECT_NE(s.message().find(Sock(env_.xdg_runtime_dir + "/cache-dit-opd")), std::string::npos);
  EXPECT_NE(s.message().find(Sock(env_.tmp_dir)), std::string::npos);
  EXPECT_NE(s.message().find("cache-dit-opd --device"), std::string::npos);
}

TEST_F(DiscoveryDirs, EarlierDirectoryWins) {
  DaemonAddress a;
  MakeSocketFile(Sock(env_.tmp_dir));
  ASSERT_TRUE(FindDaemon(kUuid, env_, &a).ok());
  EXPECT_EQ(a.socket_path, Sock(env_.tmp_dir));
  EXPECT_EQ(a.target, "unix:" + Sock(env_.tmp_dir));

  MakeSocketFile(Sock(env_.xdg_runtime_dir + "/cache-dit-opd"));
  ASSERT_TRUE(FindDaemon(kUuid, env_, &a).ok());
  EXPECT_EQ(a.socket_path, Sock(env_.xdg_runtime_dir + "/cache-dit-opd"));

  MakeSocketFile(Sock(env_.system_dir));
  ASSERT_TRUE(FindDaemon(kUuid, env_, &a).ok());
  EXPECT_EQ(a.socket_path, Sock(env_.system_dir));

  MakeSocketFile(Sock(env_.runtime_dir));
  ASSERT_TRUE(FindDaemon(kUuid, env_, &a).ok());
  EXPECT_EQ(a.socket_path, Sock(env_.runtime_dir));
  EXPECT_EQ(a.source, env_.runtime_dir);
}

TEST_F(DiscoveryDirs, OnlyTheRequestedGpuMatches) {
  MakeSocketFile(env_.tmp_dir + "/GPU-00000000-0000-0000-0000-000000000000.sock");
  DaemonAddress a;
  EXPECT_EQ(FindDaemon(kUuid, env_, &a).code(), StatusCode::kNotFound);
}

TEST_F(DiscoveryDirs, NonSocketFilesAreSkipped) {
  std::filesystem::create_directories(env_.runtime_dir);
  std::ofstream(Sock(env_.runtime_dir)) << "not a socket";
  MakeSocketFile(Sock(env_.tmp_dir));
  DaemonAddress a;
  ASSERT_TRUE(FindDaemon(kUuid, env_, &a).ok());
  EXPECT_EQ(a.socket_path, Sock(env_.tmp_dir));
  std::filesystem::remove(Sock(env_.tmp_dir));
  Status s = FindDaemon(kUuid, env_, &a);
  EXPECT_NE(s.message().find("not a socket"), std::string::npos) << s.message();
}

TEST_F(DiscoveryDirs, AddressOverridesEverything) {
  MakeSocketFile(Sock(env_.runtime_dir));
  env_.address = "/somewhere/else.sock";
  DaemonAddress a;
  ASSERT_TRUE(FindDaemon(kUuid, env_, &a).ok());
  EXPECT_EQ(a.target, "unix:/somewhere/else.sock");
  EXPECT_EQ(a.socket_path, "/somewhere/else.sock");
  EXPECT_EQ(a.source, "CACHE_DIT_OPD_ADDRESS");
  // The override is used even for a malformed UUID: it names the daemon.
  ASSERT_TRUE(FindDaemon("not-a-uuid", env_, &a).ok());
}

TEST(DiscoveryOverride, AcceptsPathsAndUnixUris) {
  DaemonAddress a;
  ASSERT_TRUE(AddressFromOverride("unix:/run/x.sock", &a).ok());
  EXPECT_EQ(a.target, "unix:/run/x.sock");
  EXPECT_EQ(a.socket_path, "/run/x.sock");
  ASSERT_TRUE(AddressFromOverride("unix:///run/x.sock", &a).ok());
  EXPECT_EQ(a.target, "unix:///run/x.sock");
  EXPECT_EQ(a.socket_path, "/run/x.sock");
  ASSERT_TRUE(AddressFromOverride("relative/x.sock", &a).ok());
  EXPECT_EQ(a.target, "unix:relative/x.sock");
  ASSERT_TRUE(AddressFromOverride("unix-abstract:opd", &a).ok());
  EXPECT_EQ(a.target, "unix-abstract:opd");
  EXPECT_EQ(a.socket_path, "");
}

TEST(DiscoveryOverride, RejectsOtherSchemesAndEmpty) {
  DaemonAddress a;
  EXPECT_EQ(AddressFromOverride("", &a).code(), StatusCode::kInvalidArgument);
  for (const char* bad : {"dns:localhost:50051", "ipv4:127.0.0.1:1", "http://x", "vsock:1:2"}) {
    Status s = AddressFromOverride(bad, &a);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(bad), std::string::npos) << s.message();
  }
}

TEST(Discovery, RejectsAMalformedUuidBeforeTouchingTheFilesystem) {
  DaemonAddress a;
  Status s = FindDaemon("../../etc/passwd", DiscoveryEnv{}, &a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

}  // namespace
}  // namespace cache_dit_opd::client
