#include "server/session/session_manager.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "server/session/session_channel.h"
#include "test_util.h"
#include "tests/fake_daemon/fakes.h"

namespace cache_dit_opd {
namespace {

using namespace std::chrono_literals;
using testing::FakeDeviceOps;
using testing::FakeRegionOpener;
using testing::TempDir;

constexpr char kUuid[] = "GPU-00000000-1111-2222-3333-444444444444";

class SessionManagerTest : public ::testing::Test {
 protected:
  void Init(PeerPolicy policy, uint32_t bind_timeout_ms = 5000, uint32_t max_sessions = 4) {
    SessionLimits limits;
    limits.max_sessions = max_sessions;
    limits.max_lanes = 4;
    limits.bind_timeout_ms = bind_timeout_ms;
    manager_ = std::make_unique<SessionManager>(
        limits, 0, kUuid, &device_, &opener_, policy,
        [this](const std::shared_ptr<Session>& s, const Status& reason) {
          std::lock_guard<std::mutex> lock(mu_);
          ended_[s->id()] = reason;
          cv_.notify_all();
        });
    channel_ = std::make_unique<SessionChannel>(dir_.File("gpu.session.sock"), manager_.get(), 20ms);
    ASSERT_TRUE(channel_->Listen().ok());
    ASSERT_TRUE(channel_->Start().ok());
  }
  void SetUp() override {}
  void TearDown() override {
    if (channel_) channel_->Stop();
  }

  OpenSessionParams Params(int32_t pid = getpid(), uint32_t lanes = 2) {
    OpenSessionParams p;
    p.protocol_version = v1::kProtocolVersion;
    p.client_pid = pid;
    p.gpu_uuid = kUuid;
    p.lanes = lanes;
    p.client_name = "test";
    return p;
  }
  static std::string TokenOf(const Session& s) {
    return std::string(reinterpret_cast<const char*>(s.token().data()), s.token().size());
  }
  // Connects and presents `token`; returns the connection (caller closes).
  int Bind(uint64_t id, const std::string& token, v1::BindReply* reply, int* memfd) {
    int fd = testing::ConnectSeqpacket(channel_->path());
    EXPECT_GE(fd, 0);
    v1::BindRequest req = testing::MakeBind(id, token);
    EXPECT_EQ(send(fd, &req, sizeof(req), 0), static_cast<ssize_t>(sizeof(req)));
    EXPECT_TRUE(testing::RecvBindReply(fd, reply, memfd));
    return fd;
  }
  bool WaitEnded(uint64_t id, Status* reason, std::chrono::milliseconds timeout = 3000ms) {
    std::unique_lock<std::mutex> lock(mu_);
    bool ok = cv_.wait_for(lock, timeout, [&] { return ended_.count(id) > 0; });
    if (ok && reason) *reason = ended_[id];
    return ok;
  }

  TempDir dir_;
  FakeDeviceOps device_;
  FakeRegionOpener opener_;
  std::unique_ptr<SessionManager> manager_;
  std::unique_ptr<SessionChannel> channel_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Status> ended_;
};

TEST_F(SessionManagerTest, OpenThenBindWithCorrectTokenPassesSealedMemfd) {
  Init(PeerPolicy::ForThisProcess(std::nullopt));
  struct stat st;
  ASSERT_EQ(stat(channel_->path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  EXPECT_FALSE(s->bound());
  EXPECT_EQ(s->lane_count(), 2u);
  v1::BindReply reply;
  int memfd = -1;
  int fd = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  EXPECT_EQ(reply.status_code, 0) << reply.message;
  EXPECT_EQ(reply.layout_version, v1::kLayoutVersion);
  EXPECT_EQ(reply.shared_memory_bytes, s->memory().bytes());
  ASSERT_GE(memfd, 0);
  EXPECT_TRUE(s->bound());
  EXPECT_EQ(s->peer().pid, getpid());
  EXPECT_EQ(s->peer().uid, getuid());

  int seals = fcntl(memfd, F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_GROW);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_NE(ftruncate(memfd, 1 << 20), 0);  // the client cannot resize it
  void* p = mmap(nullptr, reply.shared_memory_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  ASSERT_NE(p, MAP_FAILED);
  auto* h = static_cast<v1::SessionMemoryHeader*>(p);
  EXPECT_EQ(h->magic, v1::kSessionMemoryMagic);
  EXPECT_EQ(h->session_id, s->id());
  EXPECT_EQ(h->lane_count, 2u);
  EXPECT_EQ(h->lane_stride, sizeof(v1::LaneSemaphores));
  EXPECT_EQ(h->lanes_offset, v1::kLanesOffset);
  EXPECT_EQ(h->daemon_pid, static_cast<uint64_t>(getpid()));
  // The client's write is the daemon's read (same pages).
  auto* lanes = reinterpret_cast<v1::LaneSemaphores*>(static_cast<char*>(p) + h->lanes_offset);
  lanes[1].inputs_ready = 42;
  EXPECT_EQ(s->memory().InputsReady(1), 42u);
  // Heartbeat advances while bound.
  uint64_t hb = std::atomic_ref<uint64_t>(h->daemon_heartbeat).load();
  std::this_thread::sleep_for(100ms);
  EXPECT_GT(std::atomic_ref<uint64_t>(h->daemon_heartbeat).load(), hb);

  std::shared_ptr<Session> again;
  EXPECT_TRUE(manager_->Authorize(s->id(), TokenOf(*s), true, &again).ok());
  munmap(p, reply.shared_memory_bytes);
  close(memfd);
  close(fd);
}

TEST_F(SessionManagerTest, WrongTokenIsDeniedAndConnectionClosed) {
  Init(PeerPolicy::ForThisProcess(std::nullopt));
  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  std::string wrong = TokenOf(*s);
  wrong[0] ^= 1;
  v1::BindReply reply;
  int memfd = -1;
  int fd = Bind(s->id(), wrong, &reply, &memfd);
  EXPECT_EQ(reply.status_code, static_cast<int>(StatusCode::kPermissionDenied));
  EXPECT_NE(std::string(reply.message).find("wrong token"), std::string::npos) << reply.message;
  EXPECT_EQ(memfd, -1);
  EXPECT_TRUE(testing::PeerClosed(fd));
  EXPECT_FALSE(s->bound());
  close(fd);
  // The right token still works afterwards.
  fd = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  EXPECT_EQ(reply.status_code, 0);
  close(memfd);
  close(fd);
}

TEST_F(SessionManagerTest, BindTwiceIsRefused) {
  Init(PeerPolicy::ForThisProcess(std::nullopt));
  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  v1::BindReply reply;
  int memfd = -1;
  int fd1 = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  ASSERT_EQ(reply.status_code, 0);
  close(memfd);
  int fd2 = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  EXPECT_EQ(reply.status_code, static_cast<int>(StatusCode::kInvalidArgument));
  EXPECT_EQ(reply.reason, static_cast<uint32_t>(Reason::kMalformed));
  EXPECT_NE(std::string(reply.message).find("already bound"), std::string::npos);
  EXPECT_TRUE(testing::PeerClosed(fd2));
  EXPECT_TRUE(s->bound());  // the first binding stands
  close(fd2);
  close(fd1);
}

TEST_F(SessionManagerTest, PidMismatchIsDenied) {
  Init(PeerPolicy::ForThisProcess(std::nullopt));
  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(getpid() + 1), &s).ok());
  v1::BindReply reply;
  int memfd = -1;
  int fd = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  EXPECT_EQ(reply.status_code, static_cast<int>(StatusCode::kPermissionDenied));
  EXPECT_NE(std::string(reply.message).find("client_pid " + std::to_string(getpid() + 1)), std::string::npos)
      << reply.message;
  EXPECT_FALSE(s->bound());
  close(fd);
}

TEST_F(SessionManagerTest, ForeignUidIsDeniedUnlessItsGidIsAllowed) {
  // The daemon "runs" as another uid: the test process is a foreign peer.
  Init(PeerPolicy(getuid() + 1, std::nullopt));
  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  v1::BindReply reply;
  int memfd = -1;
  int fd = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  EXPECT_EQ(reply.status_code, static_cast<int>(StatusCode::kPermissionDenied));
  EXPECT_NE(std::string(reply.message).find("uid " + std::to_string(getuid())), std::string::npos) << reply.message;
  close(fd);
}

TEST_F(SessionManagerTest, AllowedGidAdmitsForeignUid) {
  Init(PeerPolicy(getuid() + 1, getgid()));
  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  v1::BindReply reply;
  int memfd = -1;
  int fd = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  EXPECT_EQ(reply.status_code, 0) << reply.message;
  close(memfd);
  close(fd);
}

TEST(PeerPolicyTest, Admission) {
  PeerPolicy own(1000, std::nullopt);
  EXPECT_TRUE(own.Admit({10, 1000, 5}).ok());
  Status s = own.Admit({10, 1001, 5});
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("uid 1001"), std::string::npos);
  EXPECT_NE(s.message().find("--allowed-gid"), std::string::npos);
  PeerPolicy group(1000, 77);
  EXPECT_TRUE(group.Admit({10, 1001, 77}).ok());
  EXPECT_EQ(group.Admit({10, 1001, 78}).code(), StatusCode::kPermissionDenied);
}

TEST_F(SessionManagerTest, UnboundSessionIsDroppedAfterBindTimeout) {
  Init(PeerPolicy::ForThisProcess(std::nullopt), /*bind_timeout_ms=*/100);
  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  Status reason;
  ASSERT_TRUE(WaitEnded(s->id(), &reason));
  EXPECT_EQ(reason.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s->state(), SessionState::kClosed);
  std::shared_ptr<Session> again;
  EXPECT_EQ(manager_->Authorize(s->id(), TokenOf(*s), false, &again).code(), StatusCode::kNotFound);
  // A late bind finds nothing.
  v1::BindReply reply;
  int memfd = -1;
  int fd = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  EXPECT_EQ(reply.status_code, static_cast<int>(StatusCode::kNotFound));
  close(fd);
}

TEST_F(SessionManagerTest, SilentConnectionIsClosedAfterBindTimeout) {
  Init(PeerPolicy::ForThisProcess(std::nullopt), /*bind_timeout_ms=*/100);
  int fd = testing::ConnectSeqpacket(channel_->path());
  ASSERT_GE(fd, 0);
  v1::BindReply reply;
  int memfd = -1;
  ASSERT_TRUE(testing::RecvBindReply(fd, &reply, &memfd));
  EXPECT_EQ(reply.status_code, static_cast<int>(StatusCode::kDeadlineExceeded));
  EXPECT_TRUE(testing::PeerClosed(fd));
  close(fd);
}

TEST_F(SessionManagerTest, ChannelCloseEndsSessionAtOnce) {
  Init(PeerPolicy::ForThisProcess(std::nullopt));
  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  v1::BindReply reply;
  int memfd = -1;
  int fd = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  ASSERT_EQ(reply.status_code, 0);
  close(memfd);
  auto t0 = std::chrono::steady_clock::now();
  close(fd);  // the client "dies"
  Status reason;
  ASSERT_TRUE(WaitEnded(s->id(), &reason));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_EQ(reason.code(), StatusCode::kCancelled);
  EXPECT_NE(reason.message().find("closed by the client"), std::string::npos);
  EXPECT_EQ(manager_->size(), 0u);
}

TEST_F(SessionManagerTest, CloseSessionClosesTheChannelAndIsIdempotent) {
  Init(PeerPolicy::ForThisProcess(std::nullopt));
  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  v1::BindReply reply;
  int memfd = -1;
  int fd = Bind(s->id(), TokenOf(*s), &reply, &memfd);
  ASSERT_EQ(reply.status_code, 0);
  close(memfd);
  std::string wrong(32, 'x');
  EXPECT_EQ(manager_->Close(s->id(), wrong).code(), StatusCode::kPermissionDenied);
  ASSERT_TRUE(manager_->Close(s->id(), TokenOf(*s)).ok());
  // The daemon's own hook closes the channel in production; here we do it.
  channel_->CloseSession(s->id());
  EXPECT_TRUE(testing::PeerClosed(fd));
  EXPECT_TRUE(manager_->Close(s->id(), TokenOf(*s)).ok());  // again: OK
  EXPECT_EQ(manager_->Close(999, TokenOf(*s)).code(), StatusCode::kNotFound);
  EXPECT_EQ(manager_->Close(s->id(), "short").code(), StatusCode::kInvalidArgument);
  close(fd);
}

TEST_F(SessionManagerTest, SessionScopedRpcChecks) {
  Init(PeerPolicy::ForThisProcess(std::nullopt));
  std::shared_ptr<Session> s, out;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  Status st = manager_->Authorize(s->id(), TokenOf(*s), true, &out);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("not bound"), std::string::npos);
  EXPECT_TRUE(manager_->Authorize(s->id(), TokenOf(*s), false, &out).ok());
  st = manager_->Authorize(s->id(), std::string(31, 'a'), true, &out);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("31 bytes"), std::string::npos);
  st = manager_->Authorize(12345, TokenOf(*s), true, &out);
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("12345"), std::string::npos);
  std::string wrong = TokenOf(*s);
  wrong[31] ^= 0x80;
  EXPECT_EQ(manager_->Authorize(s->id(), wrong, true, &out).code(), StatusCode::kPermissionDenied);
}

TEST_F(SessionManagerTest, OpenValidatesRequestAndLimits) {
  Init(PeerPolicy::ForThisProcess(std::nullopt), 5000, /*max_sessions=*/2);
  std::shared_ptr<Session> s;
  OpenSessionParams p = Params();
  p.protocol_version = v1::kProtocolVersion - 1;
  Status skew = manager_->Open(p, &s);
  EXPECT_EQ(skew.reason(), Reason::kVersionMismatch);
  // Both versions named, so whoever reads it knows which side to upgrade.
  EXPECT_NE(skew.message().find("protocol version " + std::to_string(v1::kProtocolVersion - 1)), std::string::npos)
      << skew.message();
  EXPECT_NE(skew.message().find("protocol version " + std::to_string(v1::kProtocolVersion)), std::string::npos)
      << skew.message();
  p = Params();
  p.gpu_uuid = "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff";
  Status st = manager_->Open(p, &s);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find(kUuid), std::string::npos);
  p = Params(0);
  EXPECT_EQ(manager_->Open(p, &s).code(), StatusCode::kInvalidArgument);
  p = Params();
  p.client_name = std::string(129, 'n');
  EXPECT_EQ(manager_->Open(p, &s).code(), StatusCode::kInvalidArgument);

  p = Params(getpid(), 0);
  p.gpu_uuid = "";  // any GPU
  ASSERT_TRUE(manager_->Open(p, &s).ok());
  EXPECT_EQ(s->lane_count(), 1u);
  ASSERT_TRUE(manager_->Open(Params(getpid(), 100), &s).ok());
  EXPECT_EQ(s->lane_count(), 4u);  // cut to --max-lanes
  st = manager_->Open(Params(), &s);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("--max-sessions 2"), std::string::npos);

  manager_->StopAccepting(Status::Rejected(Reason::kDraining, "draining"));
  manager_->EndAll(Status::Unavailable("test"));
  st = manager_->Open(Params(), &s);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
}

TEST_F(SessionManagerTest, MalformedBindMessages) {
  Init(PeerPolicy::ForThisProcess(std::nullopt));
  std::shared_ptr<Session> s;
  ASSERT_TRUE(manager_->Open(Params(), &s).ok());
  {
    int fd = testing::ConnectSeqpacket(channel_->path());
    char junk[10] = {};
    ASSERT_EQ(send(fd, junk, sizeof(junk), 0), 10);
    v1::BindReply reply;
    int memfd;
    ASSERT_TRUE(testing::RecvBindReply(fd, &reply, &memfd));
    EXPECT_EQ(reply.status_code, static_cast<int>(StatusCode::kInvalidArgument));
    EXPECT_NE(std::string(reply.message).find("10 bytes"), std::string::npos) << reply.message;
    close(fd);
  }
  {
    int fd = testing::ConnectSeqpacket(channel_->path());
    char big[100] = {};
    ASSERT_EQ(send(fd, big, sizeof(big), 0), 100);
    v1::BindReply reply;
    int memfd;
    ASSERT_TRUE(testing::RecvBindReply(fd, &reply, &memfd));
    EXPECT_EQ(reply.status_code, static_cast<int>(StatusCode::kInvalidArgument));
    close(fd);
  }
  {
    int fd = testing::ConnectSeqpacket(channel_->path());
    v1::BindRequest req = testing::MakeBind(s->id(), TokenOf(*s));
    req.magic = 0x12345678;
    ASSERT_EQ(send(fd, &req, sizeof(req), 0), static_cast<ssize_t>(sizeof(req)));
    v1::BindReply reply;
    int memfd;
    ASSERT_TRUE(testing::RecvBindReply(fd, &reply, &memfd));
    EXPECT_EQ(reply.status_code, static_cast<int>(StatusCode::kInvalidArgument));
    close(fd);
  }
  EXPECT_FALSE(s->bound());
}

TEST_F(SessionManagerTest, ReleasingDeviceResourcesUndoesCreate) {
  Init(PeerPolicy::ForThisProcess(std::nullopt));
  {
    std::shared_ptr<Session> s;
    ASSERT_TRUE(manager_->Open(Params(getpid(), 3), &s).ok());
    EXPECT_EQ(device_.stream_count(), 3u);
    EXPECT_EQ(device_.registered_count(), 2u);  // shared memory + private counters
    manager_->End(s->id(), Status::Cancelled("test"));
    s->ReleaseDeviceResources();
    EXPECT_EQ(device_.stream_count(), 0u);
    EXPECT_EQ(device_.registered_count(), 0u);
  }
  device_.fail_register = true;
  std::shared_ptr<Session> s;
  EXPECT_EQ(manager_->Open(Params(), &s).code(), StatusCode::kInternal);
  EXPECT_EQ(device_.stream_count(), 0u);
}

}  // namespace
}  // namespace cache_dit_opd
