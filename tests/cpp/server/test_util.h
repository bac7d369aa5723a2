// Helpers for tests that talk to the session channel like a client would.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "cache_dit_opd/v1/session_memory.h"

namespace cache_dit_opd::testing {

// A fresh temporary directory, removed (with its files) on destruction.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/opd-test-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::string cmd = "rm -rf '" + path_ + "'";
    int rc = system(cmd.c_str());
    (void)rc;
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A .safetensors file image: the 8-byte little-endian header length, the
// header, `data` bytes of `fill`.
inline std::string SafetensorsImage(const std::string& header, size_t data, char fill = '\x5a') {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  out += std::string(data, fill);
  return out;
}

inline int ConnectSeqpacket(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

inline v1::BindRequest MakeBind(uint64_t session_id, const std::string& token) {
  v1::BindRequest req{};
  req.magic = v1::kBindRequestMagic;
  req.protocol_version = v1::kProtocolVersion;
  req.session_id = session_id;
  std::memcpy(req.token, token.data(), std::min<size_t>(token.size(), sizeof(req.token)));
  return req;
}

// Receives a BindReply and the attached fd (-1 when none). Returns false on
// timeout or EOF.
inline bool RecvBindReply(int fd, v1::BindReply* reply, int* memfd, int timeout_ms = 3000) {
  *memfd = -1;
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) != 1) return false;
  iovec iov{reply, sizeof(*reply)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
  if (n != static_cast<ssize_t>(sizeof(*reply))) return false;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) std::memcpy(memfd, CMSG_DATA(c), sizeof(int));
  }
  return true;
}

// A test client's end of a bound session: the session channel and the
// session memory, mapped shared. The caller closes and unmaps.
struct BoundChannel {
  int fd = -1;
  void* memory = nullptr;  // nullptr when the bind or the mapping failed
  uint64_t bytes = 0;
};

// Connects to the session channel at `path`, binds `session_id` with `token`
// and maps the memfd of the reply. Every failed step is a test failure.
inline BoundChannel BindAndMap(const std::string& path, uint64_t session_id, const std::string& token) {
  BoundChannel b;
  b.fd = ConnectSeqpacket(path);
  v1::BindRequest bind = MakeBind(session_id, token);
  EXPECT_EQ(send(b.fd, &bind, sizeof(bind), 0), static_cast<ssize_t>(sizeof(bind)));
  v1::BindReply reply;
  int memfd = -1;
  EXPECT_TRUE(RecvBindReply(b.fd, &reply, &memfd));
  EXPECT_EQ(reply.status_code, 0) << reply.message;
  if (memfd < 0) return b;
  b.bytes = reply.shared_memory_bytes;
  void* p = mmap(nullptr, b.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  close(memfd);
  EXPECT_NE(p, MAP_FAILED);
  if (p != MAP_FAILED) b.memory = p;
  return b;
}

// True when the peer closed the connection within `timeout_ms`.
inline bool PeerClosed(int fd, int timeout_ms = 3000) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) != 1) return false;
  char buf[512];
  return recv(fd, buf, sizeof(buf), MSG_DONTWAIT) == 0;
}

}  // namespace cache_dit_opd::testing
