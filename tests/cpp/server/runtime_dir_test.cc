#include "server/runtime_dir.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "test_util.h"

namespace cache_dit_opd {
namespace {

using testing::TempDir;

constexpr char kUuid[] = "GPU-01234567-89ab-cdef-0123-456789abcdef";

int ListenAt(const std::string& path, int type) {
  int fd = socket(AF_UNIX, type, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(listen(fd, 4), 0);
  return fd;
}

bool Exists(const std::string& p) {
  struct stat st;
  return lstat(p.c_str(), &st) == 0;
}

TEST(RuntimeDirTest, RuleOrder) {
  TempDir t;
  RuntimeDirEnv env;
  env.opd_runtime_dir = t.File("from-env");
  env.xdg_runtime_dir = t.File("xdg");
  mkdir(env.xdg_runtime_dir.c_str(), 0700);
  env.system_dir = t.File("run/cache-dit-opd");  // parent missing: not writable
  env.fallback_base = t.File("tmp");
  mkdir(env.fallback_base.c_str(), 0700);

  std::string dir;
  ASSERT_TRUE(ChooseRuntimeDir(t.File("from-flag"), env, &dir).ok());
  EXPECT_EQ(dir, t.File("from-flag"));
  ASSERT_TRUE(ChooseRuntimeDir("", env, &dir).ok());
  EXPECT_EQ(dir, t.File("from-env"));
  struct stat st;
  ASSERT_EQ(stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0770u);

  env.opd_runtime_dir.clear();
  ASSERT_TRUE(ChooseRuntimeDir("", env, &dir).ok());
  EXPECT_EQ(dir, t.File("xdg") + "/cache-dit-opd");

  env.xdg_runtime_dir.clear();
  ASSERT_TRUE(ChooseRuntimeDir("", env, &dir).ok());
  EXPECT_EQ(dir, t.File("tmp") + "/cache-dit-opd");

  mkdir(t.File("run").c_str(), 0700);  // now /run is writable
  ASSERT_TRUE(ChooseRuntimeDir("", env, &dir).ok());
  EXPECT_EQ(dir, t.File("run/cache-dit-opd"));
}

TEST(RuntimeDirTest, SocketNames) {
  EXPECT_EQ(SessionSocketPath("/a/GPU-1.sock"), "/a/GPU-1.session.sock");
  EXPECT_EQ(SessionSocketPath("/a/daemon"), "/a/daemon.session.sock");
  EXPECT_EQ(SessionSocketPath("/a/.sock"), "/a/.session.sock");

  TempDir t;
  RuntimeDirEnv env;
  env.opd_runtime_dir = t.path();
  Options o;
  SocketPaths p;
  ASSERT_TRUE(ResolveSocketPaths(o, kUuid, env, &p).ok());
  EXPECT_EQ(p.grpc, t.path() + "/" + kUuid + ".sock");
  EXPECT_EQ(p.session, t.path() + "/" + kUuid + ".session.sock");

  Status s = ResolveSocketPaths(o, "", env, &p);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("--socket"), std::string::npos);

  o.socket = t.File("mine.sock");
  ASSERT_TRUE(ResolveSocketPaths(o, "", env, &p).ok());
  EXPECT_EQ(p.grpc, t.File("mine.sock"));
  EXPECT_EQ(p.session, t.File("mine.session.sock"));

  o.socket = "/tmp/" + std::string(120, 'x') + ".sock";
  s = ResolveSocketPaths(o, "", env, &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
}

TEST(RuntimeDirTest, StaleSocketIsRemoved) {
  TempDir t;
  std::string path = t.File("d.sock");
  int fd = ListenAt(path, SOCK_STREAM);
  close(fd);  // the file stays, nobody accepts: a crashed daemon's leftover
  ASSERT_TRUE(Exists(path));
  EXPECT_EQ(ProbeSocket(path, SOCK_STREAM), SocketState::kStale);
  ASSERT_TRUE(PrepareSocketPath(path, SOCK_STREAM).ok());
  EXPECT_FALSE(Exists(path));
  EXPECT_TRUE(PrepareSocketPath(path, SOCK_STREAM).ok());  // absent is fine
}

TEST(RuntimeDirTest, LiveSocketIsRefusedAndKept) {
  TempDir t;
  std::string path = t.File("d.sock");
  int fd = ListenAt(path, SOCK_STREAM);
  Status s = PrepareSocketPath(path, SOCK_STREAM);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("another daemon"), std::string::npos);
  EXPECT_TRUE(Exists(path));
  close(fd);

  std::string seq = t.File("d.session.sock");
  int sfd = ListenAt(seq, SOCK_SEQPACKET);
  EXPECT_EQ(PrepareSocketPath(seq, SOCK_SEQPACKET).code(), StatusCode::kFailedPrecondition);
  close(sfd);
}

TEST(RuntimeDirTest, NonSocketIsNeverDeleted) {
  TempDir t;
  std::string path = t.File("d.sock");
  std::ofstream(path) << "precious";
  Status s = PrepareSocketPath(path, SOCK_STREAM);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("not a socket"), std::string::npos);
  EXPECT_TRUE(Exists(path));
}

TEST(RuntimeDirTest, InstanceLockIsExclusive) {
  TempDir t;
  std::unique_ptr<InstanceLock> a, b;
  ASSERT_TRUE(InstanceLock::Acquire(t.File("x.lock"), &a).ok());
  Status s = InstanceLock::Acquire(t.File("x.lock"), &b);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  a.reset();
  EXPECT_TRUE(InstanceLock::Acquire(t.File("x.lock"), &b).ok());
}

}  // namespace
}  // namespace cache_dit_opd
