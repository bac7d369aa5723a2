// PeerTable (server/grpc/peer_acceptor.h): a call's peer() name maps back to
// the credentials recorded for that connection, and nothing else does.
#include "server/grpc/peer_acceptor.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

namespace cache_dit_opd {
namespace {

ino_t InodeOf(int fd) {
  struct stat st {};
  EXPECT_EQ(fstat(fd, &st), 0);
  return st.st_ino;
}

TEST(PeerTableTest, NamesTheRecordedSocketAndNothingElse) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  PeerTable table;
  table.Record(pair[0], InodeOf(pair[0]), PeerCred{1234, 1000, 1000, {27}});
  const std::string name = "fd:" + std::to_string(pair[0]);
  auto peer = table.Lookup(name);
  ASSERT_TRUE(peer.has_value());
  EXPECT_EQ(peer->pid, 1234);
  EXPECT_EQ(peer->uid, 1000u);
  EXPECT_EQ(peer->groups, std::vector<gid_t>{27});
  // Names gRPC gives connections it accepted itself, and malformed ones.
  for (const std::string& other : {std::string("unix:/run/x.sock"), std::string("fd:"), std::string("fd:-1"),
                                   std::string("fd:12x"), "fd:" + std::to_string(pair[1]), name + "0"}) {
    EXPECT_FALSE(table.Lookup(other).has_value()) << other;
  }
  // The number reused by another socket (or a file): not the recorded peer.
  close(pair[0]);
  int again[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, again), 0);
  if (again[0] == pair[0] || again[1] == pair[0]) {
    EXPECT_FALSE(table.Lookup(name).has_value());
  }
  close(again[0]);
  close(again[1]);
  const int file = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(file, 0);
  if (file == pair[0]) {
    EXPECT_FALSE(table.Lookup(name).has_value());
  }
  close(file);
  EXPECT_FALSE(table.Lookup(name).has_value());  // closed
  close(pair[1]);
}

}  // namespace
}  // namespace cache_dit_opd
