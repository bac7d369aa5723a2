// The session channel bind: one BindRequest out, one BindReply with the
// memfd in (client/core/session_channel.h), against a fake daemon end.
#include "client/core/session_channel.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "tests/cpp/client/fake_memory.h"

namespace cache_dit_opd::client {
namespace {

namespace v1 = ::cache_dit_opd::v1;

const std::string kToken(32, '\x5a');
constexpr uint64_t kSession = 11;

// Sends `reply` with `fds` attached on `fd`.
void SendReply(int fd, const void* reply, size_t n, const std::vector<int>& fds) {
  iovec iov{const_cast<void*>(reply), n};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * (fds.empty() ? 1 : fds.size())));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ASSERT_EQ(::sendmsg(fd, &msg, 0), static_cast<ssize_t>(n));
}

v1::BindReply OkReply(uint64_t bytes) {
  v1::BindReply r{};
  r.status_code = 0;
  r.layout_version = v1::kLayoutVersion;
  r.shared_memory_bytes = bytes;
  return r;
}

// Runs BindSession against a fake daemon that handles the request with `daemon`.
Status BindAgainst(const std::function<void(int fd, const v1::BindRequest&)>& daemon, UniqueFd* memfd,
                   uint64_t* bytes, int timeout_ms = 2000, uint64_t expected = 0) {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  std::thread t([&] {
    v1::BindRequest req{};
    ssize_t n = ::recv(sv[1], &req, sizeof(req), 0);
    EXPECT_EQ(n, static_cast<ssize_t>(sizeof(req)));
    daemon(sv[1], req);
  });
  Status s = BindSession(sv[0], kSession, kToken, timeout_ms, expected, memfd, bytes);
  t.join();
  ::close(sv[0]);
  ::close(sv[1]);
  return s;
}

TEST(SessionChannel, BindsAndReceivesTheMemfd) {
  const uint64_t total = test::SessionBytes(2);
  int memfd = test::MakeMemfd(total, test::MakeHeader(total, kSession, 2));
  ASSERT_GE(memfd, 0);
  UniqueFd got;
  uint64_t bytes = 0;
  Status s = BindAgainst(
      [&](int fd, const v1::BindRequest& req) {
        EXPECT_EQ(req.magic, v1::kBindRequestMagic);
        EXPECT_EQ(req.protocol_version, v1::kProtocolVersion);
        EXPECT_EQ(req.session_id, kSession);
        EXPECT_EQ(std::string(reinterpret_cast<const char*>(req.token), 32), kToken);
        v1::BindReply r = OkReply(total);
        SendReply(fd, &r, sizeof(r), {memfd});
      },
      &got, &bytes, 2000, total);
  ::close(memfd);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(bytes, total);
  ASSERT_TRUE(got.valid());
  struct stat st {};
  ASSERT_EQ(::fstat(got.get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), total);
}

TEST(SessionChannel, ReportsTheDaemonsRefusal) {
  UniqueFd got;
  uint64_t bytes = 0;
  Status s = BindAgainst(
      [&](int fd, const v1::BindRequest&) {
        v1::BindReply r{};
        r.status_code = 7;  // PERMISSION_DENIED
        std::snprintf(r.message, sizeof(r.message), "uid 1234 is not admitted");
        SendReply(fd, &r, sizeof(r), {});
      },
      &got, &bytes);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
  EXPECT_NE(s.message().find("uid 1234 is not admitted"), std::string::npos);
  EXPECT_FALSE(got.valid());
}

TEST(SessionChannel, UnterminatedRefusalMessageIsBounded) {
  UniqueFd got;
  uint64_t bytes = 0;
  Status s = BindAgainst(
      [&](int fd, const v1::BindRequest&) {
        v1::BindReply r{};
        r.status_code = 9;
        std::memset(r.message, 'x', sizeof(r.message));  // no NUL
        SendReply(fd, &r, sizeof(r), {});
      },
      &got, &bytes);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_LT(s.message().size(), 400u);
}

TEST(SessionChannel, RejectsMalformedReplies) {
  const uint64_t total = test::SessionBytes(1);
  int memfd = test::MakeMemfd(total, test::MakeHeader(total, kSession, 1));
  UniqueFd got;
  uint64_t bytes = 0;
  // Success without a descriptor.
  Status s = BindAgainst([&](int fd, const v1::BindRequest&) {
    v1::BindReply r = OkReply(total);
    SendReply(fd, &r, sizeof(r), {});
  }, &got, &bytes);
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.ToString();
  // Two descriptors.
  s = BindAgainst([&](int fd, const v1::BindRequest&) {
    v1::BindReply r = OkReply(total);
    SendReply(fd, &r, sizeof(r), {memfd, memfd});
  }, &got, &bytes);
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.ToString();
  EXPECT_FALSE(got.valid());
  // Short message.
  s = BindAgainst([&](int fd, const v1::BindRequest&) {
    v1::BindReply r = OkReply(total);
    SendReply(fd, &r, 16, {memfd});
  }, &got, &bytes);
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.ToString();
  // Oversized message.
  s = BindAgainst([&](int fd, const v1::BindRequest&) {
    char big[sizeof(v1::BindReply) + 64] = {};
    v1::BindReply r = OkReply(total);
    std::memcpy(big, &r, sizeof(r));
    SendReply(fd, big, sizeof(big), {memfd});
  }, &got, &bytes);
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.ToString();
  // Layout skew.
  s = BindAgainst([&](int fd, const v1::BindRequest&) {
    v1::BindReply r = OkReply(total);
    r.layout_version = v1::kLayoutVersion + 1;
    SendReply(fd, &r, sizeof(r), {memfd});
  }, &got, &bytes);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  // Size differing from OpenSession's announcement.
  s = BindAgainst([&](int fd, const v1::BindRequest&) {
    v1::BindReply r = OkReply(total);
    SendReply(fd, &r, sizeof(r), {memfd});
  }, &got, &bytes, 2000, total + 4096);
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.ToString();
  ::close(memfd);
}

TEST(SessionChannel, ARefusalSentBeforeTheRequestIsReturnedThoughTheSendFails) {
  // The daemon refuses at accept (too many unbound connections): it replies
  // and closes before the client sends, so the send fails with EPIPE.
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  v1::BindReply r{};
  r.status_code = 8;  // RESOURCE_EXHAUSTED
  r.reason = 12;      // kResourceExhausted
  std::snprintf(r.message, sizeof(r.message), "uid 1000 holds 16 session-channel connections, at most 16 per uid");
  SendReply(sv[1], &r, sizeof(r), {});
  ::close(sv[1]);
  UniqueFd got;
  uint64_t bytes = 0;
  Status s = BindSession(sv[0], kSession, kToken, 2000, 0, &got, &bytes);
  ::close(sv[0]);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_EQ(s.reason(), Reason::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find("at most 16 per uid"), std::string::npos) << s.message();
}

TEST(SessionChannel, ClosedChannelIsUnavailable) {
  UniqueFd got;
  uint64_t bytes = 0;
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  std::thread t([&] {
    v1::BindRequest req{};
    (void)::recv(sv[1], &req, sizeof(req), 0);
    ::close(sv[1]);
  });
  Status s = BindSession(sv[0], kSession, kToken, 2000, 0, &got, &bytes);
  t.join();
  ::close(sv[0]);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
}

TEST(SessionChannel, NoReplyTimesOut) {
  UniqueFd got;
  uint64_t bytes = 0;
  Status s = BindAgainst([](int, const v1::BindRequest&) {}, &got, &bytes, 100);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
}

TEST(SessionChannel, TokenMustBe32Bytes) {
  UniqueFd got;
  uint64_t bytes = 0;
  EXPECT_EQ(BindSession(-1, kSession, "short", 10, 0, &got, &bytes).code(), StatusCode::kInvalidArgument);
}

TEST(SessionChannel, ConnectErrorsNameThePath) {
  UniqueFd fd;
  Status s = ConnectSessionChannel("/nonexistent/opd.session.sock", &fd);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("/nonexistent/opd.session.sock"), std::string::npos);
  EXPECT_EQ(ConnectSessionChannel(std::string(200, 'a'), &fd).code(), StatusCode::kInvalidArgument);
}

TEST(SessionChannel, ConnectsToASeqpacketListener) {
  char tmpl[] = "/tmp/opd-chan.XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string path = std::string(tmpl) + "/s.sock";
  int l = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  ASSERT_EQ(::bind(l, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(l, 1), 0);
  UniqueFd fd;
  Status s = ConnectSessionChannel(path, &fd);
  EXPECT_TRUE(s.ok()) << s.ToString();
  ::close(l);
  ::unlink(path.c_str());
  ::rmdir(tmpl);
}

}  // namespace
}  // namespace cache_dit_opd::client
