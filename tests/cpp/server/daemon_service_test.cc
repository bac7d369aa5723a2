// The daemon's gRPC service end to end, in one process, over a real Unix
// socket and a real session channel, with fake device operations: what a
// client sees, without a GPU.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <thread>

#include <grpcpp/completion_queue.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>

#include "cache_dit_opd/v1/opd.grpc.pb.h"
#include "client/core/session_channel.h"
#include "server/daemon.h"
#include "server/grpc/grpc_server.h"
#include "server/grpc/grpc_service.h"
#include "test_util.h"
#include "tests/fake_daemon/fakes.h"

namespace cache_dit_opd {
namespace {

using namespace std::chrono_literals;
using testing::FakeDeviceOps;
using testing::FakeRegionOpener;
using testing::FakeRunner;
using testing::TempDir;

constexpr char kUuid[] = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

// Under ThreadSanitizer (tests/sanitizers/tsan.sh) the daemon runs several
// times slower, and every thread that starts one waits while TSan
// symbolizes a report, suppressed ones in gRPC included: budgets that time
// the daemon scale by this.
#if defined(__SANITIZE_THREAD__)
constexpr int kSlowdown = 10;
#else
constexpr int kSlowdown = 1;
#endif

class DaemonServiceTest : public ::testing::Test {
 protected:
  void StartDaemon(bool with_gpu, uint32_t drain_ms = 2000, uint64_t max_store_bytes = 0) {
    Options o;
    o.drain_deadline_ms = drain_ms;
    o.max_lanes = 4;
    o.max_store_bytes = max_store_bytes;
    DaemonInfo info;
    info.daemon_version = "0.1.0";
    if (with_gpu) {
      info.device_index = 0;
      info.gpu_uuid = kUuid;
      info.gpu_name = "Fake GPU";
    }
    DaemonDeps deps;
    if (with_gpu) deps = DaemonDeps{&device_, &opener_, &runner_, &store_};
    std::vector<OpInfo> catalog = {{"op", "out", "cache_dit_cuda_ops::op.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)"}};
    daemon_ = std::make_unique<Daemon>(o, info, catalog, with_gpu ? "" : "no GPU: fake probe said so", deps,
                                       dir_.File("d.session.sock"));
    ASSERT_TRUE(daemon_->Start().ok());
    service_ = std::make_unique<OperatorDaemonService>(daemon_.get(), &peers_);
    ASSERT_TRUE(server_.Start(dir_.File("d.sock"), 4 << 20, service_.get(), daemon_->serving(), &peers_).ok());
    daemon_->SetHealthListener([this](bool s) { server_.SetServing(s); });
    channel_ = grpc::CreateChannel("unix:" + dir_.File("d.sock"), grpc::InsecureChannelCredentials());
    stub_ = v1::OperatorDaemon::NewStub(channel_);
  }
  void TearDown() override {
    if (daemon_) {
      daemon_->RequestShutdown(0, "test end");
      daemon_->Drain();
      server_.Shutdown(100ms);
      daemon_->Stop();
    }
  }

  // grpc.health.v1.Health/Check through a generic stub: returns the status
  // enum (1 SERVING, 2 NOT_SERVING) or -1. A completion queue this thread
  // drains, not the callback API: the answer then lands on this thread (a
  // callback runs on a gRPC thread, handed over by gRPC's own synchronisation,
  // which ThreadSanitizer cannot see in the uninstrumented library).
  int HealthStatus(const std::string& service = "") {
    grpc::GenericStub generic(channel_);
    std::string req;
    if (!service.empty()) {
      req.push_back(0x0a);
      req.push_back(static_cast<char>(service.size()));
      req += service;
    }
    grpc::Slice slice(req);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::ClientContext ctx;
    grpc::CompletionQueue cq;
    grpc::Status s;
    auto call = generic.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
    call->StartCall();
    call->Finish(&response, &s, /*tag=*/&s);
    void* tag = nullptr;
    bool ok = false;
    const bool got = cq.Next(&tag, &ok);
    cq.Shutdown();
    for (void* t; cq.Next(&t, &ok);) {
    }
    if (!got || tag != &s || !s.ok()) return -1;
    grpc::Slice out;
    if (!response.DumpToSingleSlice(&out).ok()) return -1;
    std::string bytes(reinterpret_cast<const char*>(out.begin()), out.size());
    if (bytes.size() == 2 && bytes[0] == 0x08) return bytes[1];
    return bytes.empty() ? 0 : -1;
  }

  struct Bound {
    uint64_t id = 0;
    std::string token;
    int channel_fd = -1;
    void* memory = nullptr;
    uint64_t bytes = 0;
    v1::LaneSemaphores* lane(uint32_t i) {
      auto* h = static_cast<v1::SessionMemoryHeader*>(memory);
      return reinterpret_cast<v1::LaneSemaphores*>(static_cast<char*>(memory) + h->lanes_offset) + i;
    }
  };

  Bound OpenAndBind(uint32_t lanes = 2) {
    Bound b;
    v1::OpenSessionRequest req;
    req.set_protocol_version(v1::kProtocolVersion);
    req.set_client_pid(getpid());
    req.set_gpu_uuid(kUuid);
    req.set_lanes(lanes);
    v1::OpenSessionReply reply;
    grpc::ClientContext ctx;
    grpc::Status s = stub_->OpenSession(&ctx, req, &reply);
    EXPECT_TRUE(s.ok()) << s.error_message();
    b.id = reply.session_id();
    b.token = reply.token();
    testing::BoundChannel c = testing::BindAndMap(reply.session_channel_path(), b.id, b.token);
    b.channel_fd = c.fd;
    b.memory = c.memory;
    b.bytes = c.bytes;
    return b;
  }

  // RegisterRegion of the fake allocation with handle tag `tag` (a test failure if refused).
  v1::RegisterRegionReply Register(const Bound& b, uint8_t tag) {
    v1::RegisterRegionRequest rr;
    rr.set_session_id(b.id);
    rr.set_token(b.token);
    rr.set_ipc_handle(testing::Handle(tag));
    v1::RegisterRegionReply reg;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub_->RegisterRegion(&ctx, rr, &reg).ok());
    return reg;
  }

  // Calls are answered when accepted; "done" follows once the executor ran them.
  static bool DoneReaches(Bound& b, uint32_t lane, uint64_t v) {
    for (int i = 0; i < 500; ++i) {
      if (std::atomic_ref<uint64_t>(b.lane(lane)->done).load() >= v) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return false;
  }

  grpc::Status Call(const Bound& b, uint32_t lane, uint64_t seq, uint64_t region_id = 0) {
    v1::CallRequest req;
    req.set_session_id(b.id);
    req.set_token(b.token);
    req.set_op("op");
    req.set_overload("out");
    req.set_lane(lane);
    req.set_seq(seq);
    if (region_id != 0) {
      auto* t = req.add_args()->mutable_tensor();
      t->set_region_id(region_id);
      t->add_sizes(4);
      t->add_strides(1);
      t->set_dtype(v1::DTYPE_FLOAT32);
    }
    v1::CallReply reply;
    grpc::ClientContext ctx;
    return stub_->Call(&ctx, req, &reply);
  }

  TempDir dir_;
  FakeDeviceOps device_;
  FakeRegionOpener opener_;
  FakeRunner runner_;
  testing::HostStoreAllocator store_;
  std::unique_ptr<Daemon> daemon_;
  PeerTable peers_;
  std::unique_ptr<OperatorDaemonService> service_;
  GrpcServer server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::OperatorDaemon::Stub> stub_;
};

TEST_F(DaemonServiceTest, WithoutGpuAnswersVersionAndReportsNotServing) {
  StartDaemon(/*with_gpu=*/false);
  struct stat st;
  ASSERT_EQ(stat(dir_.File("d.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  v1::VersionReply v;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->GetVersion(&ctx, v1::VersionRequest(), &v).ok());
  EXPECT_EQ(v.protocol_version(), v1::kProtocolVersion);
  EXPECT_EQ(v.layout_version(), v1::kLayoutVersion);
  EXPECT_FALSE(v.serving());
  EXPECT_EQ(v.not_serving_reason(), "no GPU: fake probe said so");
  EXPECT_EQ(v.device_index(), -1);
  EXPECT_EQ(HealthStatus(), 2);
  EXPECT_EQ(HealthStatus(kServiceName), 2);

  v1::OpenSessionRequest req;
  req.set_protocol_version(v1::kProtocolVersion);
  req.set_client_pid(getpid());
  v1::OpenSessionReply reply;
  grpc::ClientContext ctx2;
  grpc::Status s = stub_->OpenSession(&ctx2, req, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(s.error_message().find("no GPU"), std::string::npos);
}

TEST_F(DaemonServiceTest, SessionRegionCallStatsClose) {
  StartDaemon(/*with_gpu=*/true);
  EXPECT_EQ(HealthStatus(), 1);
  Bound b = OpenAndBind(2);
  ASSERT_NE(b.memory, nullptr);

  // RegisterRegion: bad handle, then a good one, then the same again.
  v1::RegisterRegionRequest rr;
  rr.set_session_id(b.id);
  rr.set_token(b.token);
  rr.set_ipc_handle(std::string(63, 'h'));
  v1::RegisterRegionReply reg;
  {
    grpc::ClientContext ctx;
    grpc::Status s = stub_->RegisterRegion(&ctx, rr, &reg);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("63 bytes"), std::string::npos);
  }
  rr.set_ipc_handle(testing::Handle(5));
  rr.set_size(1000);
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->RegisterRegion(&ctx, rr, &reg).ok());
    EXPECT_NE(reg.region_id(), 0u);
    EXPECT_EQ(reg.mapped_size(), 1u << 20);
    EXPECT_FALSE(reg.reused());
  }
  {
    v1::RegisterRegionReply again;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->RegisterRegion(&ctx, rr, &again).ok());
    EXPECT_EQ(again.region_id(), reg.region_id());
    EXPECT_TRUE(again.reused());
  }

  // Calls: inputs ready in the shared memory, done written back there.
  std::atomic_ref<uint64_t>(b.lane(0)->inputs_ready).store(1);
  grpc::Status s = Call(b, 0, 1, reg.region_id());
  ASSERT_TRUE(s.ok()) << s.error_message();  // accepted; it runs right after
  EXPECT_TRUE(DoneReaches(b, 0, 1));
  s = Call(b, 7, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("lane 7"), std::string::npos);
  s = Call(b, 0, 5);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("expected seq 2, got 5"), std::string::npos);
  s = Call(b, 0, 2, 999);  // unknown region: rejected in order, done still advances
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(DoneReaches(b, 0, 2));
  Bound wrong = b;
  wrong.id = 4242;
  EXPECT_EQ(Call(wrong, 0, 1).error_code(), grpc::StatusCode::NOT_FOUND);
  wrong = b;
  wrong.token = "short";
  EXPECT_EQ(Call(wrong, 0, 1).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // A second session that is not bound yet cannot call.
  {
    v1::OpenSessionRequest req;
    req.set_protocol_version(v1::kProtocolVersion);
    req.set_client_pid(getpid());
    v1::OpenSessionReply reply;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->OpenSession(&ctx, req, &reply).ok());
    EXPECT_EQ(reply.catalog_size(), 1);
    EXPECT_EQ(reply.gpu_uuid(), kUuid);
    Bound unbound{reply.session_id(), reply.token()};
    s = Call(unbound, 0, 1);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }

  v1::StatsRequest sreq;
  v1::StatsReply stats;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->GetStats(&ctx, sreq, &stats).ok());
    EXPECT_EQ(stats.sessions(), 2u);
    EXPECT_EQ(stats.calls(), 1u);
    EXPECT_GE(stats.errors(), 5u);
    EXPECT_EQ(stats.regions(), 1u);
    EXPECT_EQ(stats.mapped_bytes(), 1u << 20);
    EXPECT_GT(stats.call_p50_us(), 0.0);
    // One call ran (its three stages timed once); the one rejected at
    // validation was accepted, never run.
    ASSERT_EQ(stats.stages_size(), 3);
    EXPECT_EQ(stats.stages(0).name(), "accept");
    EXPECT_EQ(stats.stages(0).count(), 2u);
    EXPECT_EQ(stats.stages(1).name(), "inputs_wait");
    EXPECT_EQ(stats.stages(1).count(), 1u);
    EXPECT_EQ(stats.stages(2).name(), "run");
    EXPECT_EQ(stats.stages(2).count(), 1u);
    for (const auto& stage : stats.stages()) EXPECT_LE(stage.p50_us(), stage.p99_us()) << stage.name();
  }
  sreq.set_session_id(b.id);
  sreq.set_token(b.token);
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->GetStats(&ctx, sreq, &stats).ok());
    ASSERT_EQ(stats.session_size(), 1);
    EXPECT_EQ(stats.session(0).client_pid(), getpid());
    EXPECT_EQ(stats.session(0).calls(), 1u);
    EXPECT_EQ(stats.session(0).regions(), 1u);
  }

  v1::UnregisterRegionRequest ur;
  ur.set_session_id(b.id);
  ur.set_token(b.token);
  ur.set_region_id(reg.region_id());
  v1::UnregisterRegionReply ureply;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->UnregisterRegion(&ctx, ur, &ureply).ok());
    EXPECT_FALSE(ureply.deferred());  // the fake GPU finished at once
  }
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(stub_->UnregisterRegion(&ctx, ur, &ureply).error_code(), grpc::StatusCode::NOT_FOUND);
  }

  v1::CloseSessionRequest cr;
  cr.set_session_id(b.id);
  cr.set_token(b.token);
  v1::CloseSessionReply creply;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->CloseSession(&ctx, cr, &creply).ok());
  }
  EXPECT_TRUE(testing::PeerClosed(b.channel_fd));  // the client learns at once
  // The reaper unmaps once the lanes drained.
  for (int i = 0; i < 200 && opener_.open_count() > 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(opener_.open_count(), 0);
  {
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub_->CloseSession(&ctx, cr, &creply).ok());  // idempotent
  }
  sreq.Clear();
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->GetStats(&ctx, sreq, &stats).ok());
    EXPECT_EQ(stats.sessions(), 1u);
    EXPECT_EQ(stats.sessions_closed(), 1u);
  }
  munmap(b.memory, b.bytes);
  close(b.channel_fd);
}

// gRPC's own peer string names no process; the daemon's accept loop does
// (server/grpc/peer_acceptor.h): an OpenSession claiming another process's
// pid is refused at once, naming both, and takes no session slot.
TEST_F(DaemonServiceTest, OpenSessionClaimingAnotherProcessIsRefused) {
  StartDaemon(/*with_gpu=*/true);
  v1::OpenSessionRequest req;
  req.set_protocol_version(v1::kProtocolVersion);
  req.set_client_pid(getppid());
  req.set_gpu_uuid(kUuid);
  v1::OpenSessionReply reply;
  grpc::ClientContext ctx;
  grpc::Status s = stub_->OpenSession(&ctx, req, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("peer pid " + std::to_string(getpid())), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("client_pid " + std::to_string(getppid())), std::string::npos)
      << s.error_message();
  EXPECT_EQ(reply.session_id(), 0u);
  Bound b = OpenAndBind(1);  // this process's own pid: opened and bound
  EXPECT_NE(b.memory, nullptr);
}

TEST_F(DaemonServiceTest, ClientDeathUnmapsAfterLanesDrain) {
  StartDaemon(/*with_gpu=*/true);
  Bound b = OpenAndBind(1);
  v1::RegisterRegionReply reg = Register(b, 6);
  device_.hold_writes = true;  // the GPU is behind
  std::atomic_ref<uint64_t>(b.lane(0)->inputs_ready).store(1);
  ASSERT_TRUE(Call(b, 0, 1, reg.region_id()).ok());
  std::this_thread::sleep_for(50ms);  // accepted at once; let the executor launch it
  close(b.channel_fd);  // the client dies with its call still on the GPU
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(opener_.open_count(), 1);  // not unmapped under a running kernel
  device_.FlushHeld();
  for (int i = 0; i < 200 && opener_.open_count() > 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(opener_.open_count(), 0);
  EXPECT_EQ(device_.stream_count(), 0u);
  munmap(b.memory, b.bytes);
}

TEST_F(DaemonServiceTest, DrainDropsCallsWhoseInputsNeverArrive) {
  StartDaemon(/*with_gpu=*/true, /*drain_ms=*/300 * kSlowdown);
  Bound b = OpenAndBind(1);
  // Accepted at once; it can never run: the client never signals inputs_ready.
  ASSERT_TRUE(Call(b, 0, 1).ok());
  auto t0 = std::chrono::steady_clock::now();
  daemon_->RequestShutdown(0, "test");
  daemon_->Drain();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 600ms * kSlowdown);
  EXPECT_EQ(std::atomic_ref<uint64_t>(b.lane(0)->done).load(), 1u);  // its wait is released
  EXPECT_TRUE(testing::PeerClosed(b.channel_fd));
  EXPECT_EQ(HealthStatus(), 2);
  server_.Shutdown(100ms);
  daemon_->Stop();
  daemon_.reset();
  struct stat st;
  EXPECT_NE(stat(dir_.File("d.sock").c_str(), &st), 0);
  EXPECT_NE(stat(dir_.File("d.session.sock").c_str(), &st), 0);
  munmap(b.memory, b.bytes);
  close(b.channel_fd);
}

TEST_F(DaemonServiceTest, StickyErrorFailsEverySessionAndRequestsExit) {
  StartDaemon(/*with_gpu=*/true);
  Bound a = OpenAndBind(1);
  Bound b = OpenAndBind(1);
  std::atomic_ref<uint64_t>(a.lane(0)->inputs_ready).store(1);
  v1::CallRequest req;
  req.set_session_id(a.id);
  req.set_token(a.token);
  req.set_op("sticky");
  req.set_lane(0);
  req.set_seq(1);
  v1::CallReply reply;
  grpc::ClientContext ctx;
  grpc::Status s = stub_->Call(&ctx, req, &reply);
  EXPECT_TRUE(s.ok()) << s.error_message();  // accepted; the CUDA error comes when it runs
  EXPECT_EQ(daemon_->WaitForShutdownRequest(), 1);
  EXPECT_TRUE(testing::PeerClosed(a.channel_fd));
  EXPECT_TRUE(testing::PeerClosed(b.channel_fd));
  EXPECT_FALSE(daemon_->serving());
  EXPECT_EQ(Call(b, 0, 1).error_code(), grpc::StatusCode::UNAVAILABLE);
  munmap(a.memory, a.bytes);
  munmap(b.memory, b.bytes);
  close(a.channel_fd);
  close(b.channel_fd);
}

// Publishing a session's tensors (the fake block records which addresses
// the copy read: tests/fake_daemon/fakes.h), then attaching them over the
// session channel: one read-only region for the set's block, its descriptor
// mapping the very bytes the store holds.
TEST_F(DaemonServiceTest, PublishedTensorsAreAttachedAsOneReadOnlyBlockThroughTheChannel) {
  StartDaemon(/*with_gpu=*/true, 2000, /*max_store_bytes=*/1 << 20);
  Bound b = OpenAndBind(1);
  v1::RegisterRegionReply reg = Register(b, 9);
  MappedRegion client;  // where the daemon mapped the "client allocation"
  {
    std::shared_ptr<Session> s;
    ASSERT_TRUE(daemon_->sessions().Authorize(b.id, b.token, true, &s).ok());
    ASSERT_TRUE(s->regions().Resolve(reg.region_id(), &client).ok());
  }
  auto publish = [&](std::vector<std::tuple<std::string, uint64_t, std::vector<int64_t>>> tensors,
                     v1::PublishReply* reply) {
    v1::PublishTensorsRequest req;
    req.set_session_id(b.id);
    req.set_token(b.token);
    for (const auto& [name, offset, sizes] : tensors) {
      v1::NamedTensor* t = req.add_tensors();
      t->set_name(name);
      v1::TensorRef* v = t->mutable_tensor();
      v->set_region_id(reg.region_id());
      v->set_byte_offset(offset);
      int64_t stride = 1;
      std::vector<int64_t> strides(sizes.size());
      for (size_t i = sizes.size(); i-- > 0;) {
        strides[i] = stride;
        stride *= sizes[i];
      }
      for (size_t i = 0; i < sizes.size(); ++i) {
        v->add_sizes(sizes[i]);
        v->add_strides(strides[i]);
      }
      v->set_dtype(v1::DTYPE_FLOAT32);
    }
    grpc::ClientContext ctx;
    return stub_->PublishTensors(&ctx, req, reply);
  };
  v1::PublishReply published;
  grpc::Status st = publish({{"m/w", 4096, {8, 4}}, {"m/b", 64, {4}}, {"m/e", 0, {0, 4}}}, &published);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(published.entries_size(), 3);
  EXPECT_EQ(published.entries(0).set_id(), published.entries(1).set_id());
  EXPECT_EQ(published.entries(0).block_bytes(), 256u + 16u);
  EXPECT_EQ(published.store_bytes(), 256u + 16u);

  // Bad views name the tensor and the value; nothing is published.
  v1::PublishReply none;
  st = publish({{"bad/x", (1u << 20) - 8, {4}}}, &none);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("publish 'bad/x': bytes [1048568, +16)"), std::string::npos) << st.error_message();
  v1::PublishTensorsRequest strided;
  strided.set_session_id(b.id);
  strided.set_token(b.token);
  v1::TensorRef* v = strided.add_tensors()->mutable_tensor();
  strided.mutable_tensors(0)->set_name("bad/t");
  v->set_region_id(reg.region_id());
  v->add_sizes(4);
  v->add_sizes(2);
  v->add_strides(1);
  v->add_strides(4);  // a transposed view
  v->set_dtype(v1::DTYPE_FLOAT32);
  {
    grpc::ClientContext ctx;
    st = stub_->PublishTensors(&ctx, strided, &none);
  }
  EXPECT_NE(st.error_message().find("must be contiguous, but dim 1 has stride 4 where 1 is needed"), std::string::npos)
      << st.error_message();
  st = publish({{"bad name", 0, {4}}}, &none);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("store name 'bad name': byte 3"), std::string::npos) << st.error_message();
  {
    std::shared_ptr<Session> s;
    ASSERT_TRUE(daemon_->sessions().Authorize(b.id, b.token, true, &s).ok());
    bool deferred = false;
    ASSERT_TRUE(s->regions().Unregister(reg.region_id(), &deferred).ok());
  }
  st = publish({{"bad/r", 0, {4}}}, &none);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(st.error_message().find("publish 'bad/r': region"), std::string::npos) << st.error_message();

  // Attach: the set's block, read-only, its descriptor mapping the stored bytes.
  auto attach = [&](const std::string& name, client::StoreAttachment* out) {
    client::UniqueFd fd;
    Status c = client::ConnectSessionChannel(dir_.File("d.session.sock"), &fd);
    if (!c.ok()) return c;
    return client::AttachStoreEntry(fd.get(), b.id, b.token, name, 3000, out);
  };
  client::StoreAttachment w, bias;
  ASSERT_TRUE(attach("m/w", &w).ok());
  ASSERT_TRUE(attach("m/b", &bias).ok());
  EXPECT_EQ(w.reply.region_id, bias.reply.region_id);  // one region for the block
  EXPECT_EQ(w.reply.block_id, bias.reply.block_id);
  EXPECT_EQ(w.reply.daemon_instance, daemon_->instance());
  EXPECT_EQ(w.reply.offset, 0u);
  EXPECT_EQ(bias.reply.offset, 256u);
  EXPECT_EQ(w.reply.bytes, 128u);
  EXPECT_EQ(w.reply.dtype, static_cast<uint32_t>(DType::kFloat32));
  EXPECT_EQ(w.reply.ndim, 2u);
  EXPECT_EQ(w.reply.shape[0], 8);
  EXPECT_EQ(w.reply.shape[1], 4);
  ASSERT_TRUE(w.fd.valid());
  void* mapped = mmap(nullptr, w.reply.block_bytes, PROT_READ, MAP_SHARED, w.fd.get(), 0);
  ASSERT_NE(mapped, MAP_FAILED);
  uint64_t first = 0, bias_first = 0;
  std::memcpy(&first, mapped, 8);
  std::memcpy(&bias_first, static_cast<char*>(mapped) + 256, 8);
  EXPECT_EQ(first, reinterpret_cast<uint64_t>(client.base) + 4096);  // copied from region + byte_offset
  EXPECT_EQ(bias_first, reinterpret_cast<uint64_t>(client.base) + 64);
  munmap(mapped, w.reply.block_bytes);
  {
    std::shared_ptr<Session> s;
    ASSERT_TRUE(daemon_->sessions().Authorize(b.id, b.token, true, &s).ok());
    MappedRegion m;
    ASSERT_TRUE(s->regions().Resolve(w.reply.region_id, &m).ok());
    EXPECT_TRUE(m.read_only);
    EXPECT_EQ(m.size, w.reply.block_bytes);
  }
  client::StoreAttachment empty;
  ASSERT_TRUE(attach("m/e", &empty).ok());
  EXPECT_EQ(empty.reply.region_id, kNoRegion);
  EXPECT_FALSE(empty.fd.valid());
  EXPECT_EQ(empty.reply.shape[0], 0);

  // The store lists the attachment; deleting waits for it.
  v1::ListStoreReply listed;
  {
    grpc::ClientContext ctx;
    v1::ListStoreRequest lr;
    ASSERT_TRUE(stub_->ListStore(&ctx, lr, &listed).ok());
  }
  ASSERT_EQ(listed.entries_size(), 3);
  EXPECT_EQ(listed.entries(2).name(), "m/w");  // by name
  for (const auto& e : listed.entries()) {
    EXPECT_EQ(e.refs(), 1) << e.name();  // the set's block is attached to this session
    EXPECT_EQ(e.set_id(), published.entries(0).set_id());
  }
  EXPECT_EQ(listed.entries(2).offset(), 0u);
  EXPECT_EQ(listed.entries(0).offset(), 256u);
  v1::DeleteStoreRequest del;
  del.set_session_id(b.id);
  del.set_token(b.token);
  for (const char* name : {"m/w", "m/b", "m/e"}) {
    del.set_name(name);
    v1::DeleteStoreReply dr;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->DeleteStore(&ctx, del, &dr).ok());
  }
  EXPECT_EQ(store_.live, 1);  // the session's region holds the block

  // Refusals: an unknown (deleted) name, a wrong token, a malformed request.
  client::StoreAttachment refused;
  Status a = attach("m/w", &refused);
  EXPECT_EQ(a.reason(), Reason::kStoreUnknown);
  EXPECT_NE(a.message().find("store entry 'm/w' does not exist"), std::string::npos) << a.message();
  std::string wrong = b.token;
  wrong[0] ^= 1;
  {
    client::UniqueFd fd;
    ASSERT_TRUE(client::ConnectSessionChannel(dir_.File("d.session.sock"), &fd).ok());
    a = client::AttachStoreEntry(fd.get(), b.id, wrong, "m/b", 3000, &refused);
    EXPECT_EQ(a.reason(), Reason::kBadToken);
  }
  {
    client::UniqueFd fd;
    ASSERT_TRUE(client::ConnectSessionChannel(dir_.File("d.session.sock"), &fd).ok());
    v1::StoreAttachRequest req{};
    req.magic = v1::kStoreAttachMagic;
    req.protocol_version = v1::kProtocolVersion;
    req.session_id = b.id;
    std::memcpy(req.token, b.token.data(), v1::kTokenBytes);
    req.name_bytes = v1::kMaxStoreNameBytes + 1;
    ASSERT_EQ(send(fd.get(), &req, sizeof(req), 0), static_cast<ssize_t>(sizeof(req)));
    v1::StoreAttachReply rep{};
    ASSERT_EQ(recv(fd.get(), &rep, sizeof(rep), 0), static_cast<ssize_t>(sizeof(rep)));
    EXPECT_EQ(rep.reason, static_cast<uint32_t>(Reason::kMalformed));
    EXPECT_NE(std::string(rep.message).find("a name of 513 bytes"), std::string::npos) << rep.message;
  }

  // The session ends: its region goes, and with it the deleted block.
  close(b.channel_fd);
  for (int i = 0; i < 300 && store_.live.load() > 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(store_.live, 0);
  munmap(b.memory, b.bytes);
}

// A run of a client's virtual-memory chunks (PyTorch's expandable
// segments), registered over the session channel with one descriptor per
// chunk: one region of the run's bytes, counted as mapped, usable by calls,
// the same region for the same run; malformed requests are refused.
TEST_F(DaemonServiceTest, ChunkRunsAreRegisteredThroughTheChannelWithTheirDescriptors) {
  StartDaemon(/*with_gpu=*/true);
  Bound b = OpenAndBind(1);
  auto chunk = [](uint64_t bytes) {
    int fd = memfd_create("chunk", MFD_CLOEXEC);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    return fd;
  };
  auto request = [&](std::vector<uint64_t> sizes, std::vector<int> fds, uint32_t count) {
    v1::VmmRegionRequest req{};
    req.magic = v1::kVmmRegionMagic;
    req.protocol_version = v1::kProtocolVersion;
    req.session_id = b.id;
    std::memcpy(req.token, b.token.data(), v1::kTokenBytes);
    req.client_base = 0x300000000;
    req.chunk_count = count;
    for (size_t i = 0; i < sizes.size(); ++i) {
      req.chunk_bytes[i] = sizes[i];
      req.chunk_ids[i] = 100 + i;
    }
    const int sock = testing::ConnectSeqpacket(dir_.File("d.session.sock"));
    iovec iov{&req, sizeof(req)};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
    if (!fds.empty()) {
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    EXPECT_EQ(sendmsg(sock, &msg, 0), static_cast<ssize_t>(sizeof(req)));
    for (int fd : fds) close(fd);
    v1::VmmRegionReply reply{};
    EXPECT_EQ(recv(sock, &reply, sizeof(reply), 0), static_cast<ssize_t>(sizeof(reply)));
    close(sock);
    return reply;
  };
  const uint64_t mb2 = 2 << 20;
  v1::VmmRegionReply r = request({mb2, mb2}, {chunk(mb2), chunk(mb2)}, 2);
  ASSERT_EQ(r.status_code, 0) << r.message;
  EXPECT_NE(r.region_id, 0u);
  EXPECT_EQ(r.mapped_bytes, 2 * mb2);
  EXPECT_EQ(request({mb2, mb2}, {chunk(mb2), chunk(mb2)}, 2).region_id, r.region_id);  // the same run
  {
    std::shared_ptr<Session> s;
    ASSERT_TRUE(daemon_->sessions().Authorize(b.id, b.token, true, &s).ok());
    MappedRegion m;
    ASSERT_TRUE(s->regions().Resolve(r.region_id, &m).ok());
    EXPECT_FALSE(m.read_only);
    EXPECT_EQ(m.size, 2 * mb2);
    EXPECT_EQ(s->regions().counts().mapped_bytes, 2 * mb2);
    EXPECT_EQ(opener_.chunk_runs, 1u);  // mapped once
  }
  std::atomic_ref<uint64_t>(b.lane(0)->inputs_ready).store(1);
  ASSERT_TRUE(Call(b, 0, 1, r.region_id).ok());
  EXPECT_TRUE(DoneReaches(b, 0, 1));

  v1::VmmRegionReply bad = request({mb2, mb2}, {chunk(mb2)}, 2);  // one descriptor for two chunks
  EXPECT_EQ(bad.reason, static_cast<uint32_t>(Reason::kMalformed));
  EXPECT_NE(std::string(bad.message).find("2 chunks (1 to 240) with 1 descriptors"), std::string::npos) << bad.message;
  bad = request({mb2}, {chunk(4096)}, 1);  // a descriptor smaller than its chunk
  EXPECT_EQ(bad.reason, static_cast<uint32_t>(Reason::kBadArgument));
  EXPECT_NE(std::string(bad.message).find("chunk 0 of 2097152 bytes"), std::string::npos) << bad.message;
  bad = request({0}, {chunk(4096)}, 1);
  EXPECT_EQ(bad.reason, static_cast<uint32_t>(Reason::kMalformed));

  // The session ends: its runs are unmapped with its regions.
  close(b.channel_fd);
  for (int i = 0; i < 300 && opener_.open_count() > 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(opener_.open_count(), 0);
  munmap(b.memory, b.bytes);
}

}  // namespace
}  // namespace cache_dit_opd
