// The client engine (client/core/session_engine.h), the one data plane of both
// clients, against the real daemon on fake device operations
// (tests/fake_daemon/): bind, ring calls, the daemon's reasons, asynchronous
// rejections, and each way a session fails (closed, daemon killed, daemon
// stopped). Host memory stands in for the GPU: the engine's stream
// operations write the shared memory at once, and allocations are fake
// address ranges whose "IPC handles" the fake daemon decodes.
#include "client/core/session_engine.h"

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cache_dit_opd/v1/opd.grpc.pb.h"
#include "client/core/monitor.h"
#include "tests/cpp/client/support/test_support.h"

namespace cache_dit_opd::client {
namespace {

using namespace std::chrono_literals;
namespace pb = ::cache_dit_opd::v1;

template <typename Pred>
bool WaitUntil(Pred pred, std::chrono::milliseconds timeout = 10000ms) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

// Stream operations on host memory: inputs_ready lands at once; waits and
// fences are no-ops (the daemon's fake stream writes done at once too).
class HostLaneOps final : public LaneStreamOps {
 public:
  explicit HostLaneOps(const SessionMapping* m) : m_(m) {}
  Status WriteInputsReady(void*, uint32_t lane, uint64_t v) override {
    StoreSemaphore(&m_->lane(lane)->inputs_ready, v);
    return Status::Ok();
  }
  Status WaitDone(void*, uint32_t, uint64_t) override { return Status::Ok(); }
  Status RecordFence(void*, uint32_t) override { return Status::Ok(); }
  Status WaitFence(void*, uint32_t) override { return Status::Ok(); }

 private:
  const SessionMapping* m_;
};

// Allocations are address ranges with buffer ids; a handle carries the
// range as tests/fake_daemon/fakes.h's FakeRegionOpener decodes it.
class FakeAllocations final : public AllocationBackend {
 public:
  struct Range {
    uint64_t base, size, buffer_id;
  };
  explicit FakeAllocations(std::vector<Range> ranges) : ranges_(std::move(ranges)) {}
  Status Lookup(const void* ptr, AllocationInfo* info) override {
    const auto p = reinterpret_cast<uint64_t>(ptr);
    for (const Range& r : ranges_) {
      if (p >= r.base && p < r.base + r.size) {
        *info = AllocationInfo{r.base, r.size, r.buffer_id, 0};
        return Status::Ok();
      }
    }
    return Status::InvalidArgument("not device memory");
  }
  Status Export(const AllocationInfo& a, std::array<uint8_t, 64>* handle) override {
    handle->fill(0);
    const uint64_t fields[3] = {a.base, a.size, a.buffer_id};
    std::memcpy(handle->data(), fields, sizeof(fields));
    return Status::Ok();
  }
  Status ChunkId(const void* ptr, uint64_t* buffer_id) override {
    AllocationInfo a;
    OPD_RETURN_IF_ERROR(Lookup(ptr, &a));
    *buffer_id = a.buffer_id;
    return Status::Ok();
  }

 private:
  std::vector<Range> ranges_;
};

constexpr uint64_t kInBase = 0x7f1000000000, kOutBase = 0x7f2000000000;

class HostDevice final : public EngineDevice {
 public:
  Status RegisterHostMemory(void* p, size_t, uint64_t* device_address) override {
    *device_address = reinterpret_cast<uint64_t>(p);
    return Status::Ok();
  }
  void UnregisterHostMemory(void*) override {}
  std::unique_ptr<LaneStreamOps> LaneOps(const SessionMapping* m, uint64_t) override {
    return std::make_unique<HostLaneOps>(m);
  }
  std::unique_ptr<AllocationBackend> Allocations() override {
    return std::make_unique<FakeAllocations>(
        std::vector<FakeAllocations::Range>{{kInBase, 1 << 20, 1}, {kOutBase, 1 << 20, 2}});
  }
  Status Enter(std::optional<cuda::DeviceGuard>*) override { return Status::Ok(); }
};

// RegisterRegion / UnregisterRegion over the session's gRPC stub.
class GrpcRegistrar final : public RegionRegistrar {
 public:
  GrpcRegistrar(pb::OperatorDaemon::Stub* stub, uint64_t id, std::string token)
      : stub_(stub), id_(id), token_(std::move(token)) {}
  Status Register(const AllocationInfo& a, const std::array<uint8_t, 64>& handle, uint64_t* region_id) override {
    pb::RegisterRegionRequest req;
    req.set_session_id(id_);
    req.set_token(token_);
    req.set_ipc_handle(handle.data(), handle.size());
    req.set_size(a.size);
    pb::RegisterRegionReply reply;
    grpc::ClientContext ctx;
    grpc::Status g = stub_->RegisterRegion(&ctx, req, &reply);
    if (!g.ok()) return Status::Internal("RegisterRegion: ", g.error_message());
    *region_id = reply.region_id();
    return Status::Ok();
  }
  Status Unregister(uint64_t) override { return Status::Ok(); }

 private:
  pb::OperatorDaemon::Stub* stub_;
  uint64_t id_;
  std::string token_;
};

class EngineTest : public ::testing::Test {
 protected:
  void StartDaemon(bool hold = false, std::vector<std::string> flags = {}) {
    const std::string binary = OPD_FAKE_DAEMON;
    if (hold) ::setenv("CACHE_DIT_OPD_FAKE_HOLD", "1", 1);
    testing::DaemonProcess::Options o;
    o.binary = binary;
    o.extra_args = std::move(flags);
    o.startup_timeout = 30000ms;
    Status s = testing::DaemonProcess::Start(o, &daemon_);
    ::unsetenv("CACHE_DIT_OPD_FAKE_HOLD");
    ASSERT_TRUE(s.ok()) << s.ToString();
    stub_ = pb::OperatorDaemon::NewStub(grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
  }

  // OpenSession + bind, then the engine on host memory.
  void OpenEngine(EngineOptions options = {}) { Open(options, &reply_, &registrar_, &engine_); }

  void Open(EngineOptions options, pb::OpenSessionReply* out_reply, std::unique_ptr<GrpcRegistrar>* registrar,
            std::shared_ptr<SessionEngine>* engine) {
    pb::OpenSessionRequest req;
    req.set_protocol_version(pb::kProtocolVersion);
    req.set_client_pid(::getpid());
    req.set_lanes(2);
    req.set_want_ring(true);
    pb::OpenSessionReply reply;
    grpc::ClientContext ctx;
    grpc::Status g = stub_->OpenSession(&ctx, req, &reply);
    ASSERT_TRUE(g.ok()) << g.error_message();
    ASSERT_TRUE(reply.ring_enabled());
    *out_reply = reply;
    for (int i = 0; i < reply.catalog_size(); ++i) {
      if (reply.catalog(i).name() == "fp8_comm_per_token_quant" && reply.catalog(i).overload() == "out") quant_ = i;
      if (reply.catalog(i).name() == "svdq_quantize_w4a4_act_fuse_lora" && reply.catalog(i).overload() == "out") {
        act_ = i;
      }
    }
    ASSERT_GE(quant_, 0) << "the daemon serves fp8_comm_per_token_quant.out";
    BoundSession bound;
    bound.session_id = reply.session_id();
    bound.lanes = reply.lanes();
    ASSERT_TRUE(ConnectSessionChannel(reply.session_channel_path(), &bound.channel).ok());
    Status s = BindSession(bound.channel.get(), reply.session_id(), reply.token(), 5000, reply.shared_memory_bytes(),
                           &bound.memfd, &bound.memory_bytes);
    ASSERT_TRUE(s.ok()) << s.ToString();
    *registrar = std::make_unique<GrpcRegistrar>(stub_.get(), reply.session_id(), reply.token());
    s = SessionEngine::Create(0, std::move(bound), options, registrar->get(), engine, std::make_unique<HostDevice>());
    ASSERT_TRUE(s.ok()) << s.ToString();
  }

  void TearDown() override {
    if (engine_) engine_->Close();
  }

  // fp8_comm_per_token_quant.out(x [4, 64] `dtype`, out [4, 66] e4m3) as a record.
  RecordArgs Quant(DType dtype = DType::kBFloat16, uint64_t in_region = 0, SessionEngine* engine = nullptr) {
    if (engine == nullptr) engine = engine_.get();
    ResolvedRegion in, out;
    EXPECT_TRUE(engine->ResolveRegion(reinterpret_cast<void*>(kInBase), &in).ok());
    EXPECT_TRUE(engine->ResolveRegion(reinterpret_cast<void*>(kOutBase), &out).ok());
    RecordArgs r;
    const int64_t xs[] = {4, 64}, xst[] = {64, 1}, os[] = {4, 66}, ost[] = {66, 1};
    EXPECT_TRUE(r.AddTensor(in_region ? in_region : in.region_id, 0, dtype, 2, xs, xst));
    EXPECT_TRUE(r.AddTensor(out.region_id, 0, DType::kFloat8E4M3FN, 2, os, ost));
    return r;
  }

  CallAnswer Call(const RecordArgs& args, bool asynchronous = false, int op = -1) {
    CallAnswer a;
    Status s = engine_->CallRing(nullptr, static_cast<uint32_t>(op < 0 ? quant_ : op), args, asynchronous, {},
                                 IssueOptions{}, &a);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return a;
  }

  // svdq_quantize_w4a4_act_fuse_lora.out(input [200, 128] bf16, None, None,
  // False, False, 256, output [256, 128] e4m3, oscales [2, 256] bf16,
  // lora_act_out [256, rank] f32) as a record, with lora_act_out in region 0
  // (wire.h kNoRegion: no memory) as the clients send an empty tensor.
  RecordArgs ActWithoutLoraMemory(int64_t rank) {
    ResolvedRegion in, out;
    EXPECT_TRUE(engine_->ResolveRegion(reinterpret_cast<void*>(kInBase), &in).ok());
    EXPECT_TRUE(engine_->ResolveRegion(reinterpret_cast<void*>(kOutBase), &out).ok());
    RecordArgs r;
    const int64_t xs[] = {200, 128}, xst[] = {128, 1}, os[] = {256, 128}, ost[] = {128, 1};
    const int64_t ss[] = {2, 256}, sst[] = {256, 1}, ls[] = {256, rank}, lst[] = {rank, 1};
    EXPECT_TRUE(r.AddTensor(in.region_id, 0, DType::kBFloat16, 2, xs, xst));
    EXPECT_TRUE(r.AddNone() && r.AddNone() && r.AddBool(false) && r.AddBool(false) && r.AddInt(256));
    EXPECT_TRUE(r.AddTensor(out.region_id, 0, DType::kFloat8E4M3FN, 2, os, ost));
    EXPECT_TRUE(r.AddTensor(out.region_id, 65536, DType::kBFloat16, 2, ss, sst));
    EXPECT_TRUE(r.AddTensor(kNoRegion, 0, DType::kFloat32, 2, ls, lst));
    return r;
  }

  uint64_t DaemonCalls(const pb::OpenSessionReply* session = nullptr) {
    if (session == nullptr) session = &reply_;
    pb::StatsRequest req;
    req.set_session_id(session->session_id());
    req.set_token(session->token());
    pb::StatsReply rep;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub_->GetStats(&ctx, req, &rep).ok());
    return rep.session_size() == 1 ? rep.session(0).calls() : 0;
  }

  std::unique_ptr<testing::DaemonProcess> daemon_;
  std::unique_ptr<pb::OperatorDaemon::Stub> stub_;
  pb::OpenSessionReply reply_;
  int quant_ = -1;
  int act_ = -1;  // svdq_quantize_w4a4_act_fuse_lora.out, when the kernel library has it
  std::unique_ptr<GrpcRegistrar> registrar_;
  std::shared_ptr<SessionEngine> engine_;
};

TEST_F(EngineTest, ARingCallIsAcceptedAndItsDoneArrives) {
  StartDaemon();
  OpenEngine();
  EXPECT_TRUE(engine_->has_ring());
  EXPECT_GT(engine_->daemon_pid(), 0);
  const CallAnswer a = Call(Quant());
  EXPECT_EQ(a.code, 0) << a.message;
  ASSERT_TRUE(WaitUntil([&] { return !engine_->LanesBehind(); }));
  EXPECT_EQ(engine_->lane_state(0).done, 1u);
  EXPECT_EQ(engine_->regions().size(), 2u);
}

TEST_F(EngineTest, ARejectionCarriesItsReasonAndKeepsTheSession) {
  StartDaemon();
  OpenEngine();
  const CallAnswer bad = Call(Quant(DType::kFloat16));  // the op's own check: x must be bfloat16
  EXPECT_EQ(bad.code, static_cast<int>(StatusCode::kInvalidArgument));
  EXPECT_EQ(ReasonFromWire(bad.reason), Reason::kBadArgument) << bad.message;
  EXPECT_NE(bad.message.find("torch.bfloat16"), std::string::npos) << bad.message;
  EXPECT_EQ(bad.status().action(), v1::ClientAction::kRaiseValue);
  EXPECT_FALSE(engine_->failed());
  EXPECT_EQ(Call(Quant()).code, 0);  // the lane goes on: seq 2 after the rejected seq 1
  ASSERT_TRUE(WaitUntil([&] { return engine_->lane_state(0).done == 2; }));
}

TEST_F(EngineTest, AnUnknownRegionAsksForReregistration) {
  StartDaemon();
  OpenEngine();
  const CallAnswer a = Call(Quant(DType::kBFloat16, /*in_region=*/999));
  EXPECT_EQ(ReasonFromWire(a.reason), Reason::kRegionUnknown) << a.message;
  EXPECT_EQ(a.status().action(), v1::ClientAction::kReregister);
  EXPECT_FALSE(engine_->failed());
}

TEST_F(EngineTest, AnEmptyTensorWithoutARegionTravelsBesideTheOthers) {
  StartDaemon();
  OpenEngine();
  if (act_ < 0) GTEST_SKIP() << "the kernel library has no svdq ops";
  // Rank 0: lora_act_out [256, 0] has no memory; output and oscales have
  // elements. The daemon runs the call (nothing dropped on the way).
  const CallAnswer a = Call(ActWithoutLoraMemory(0), false, act_);
  EXPECT_EQ(a.code, 0) << a.message;
  ASSERT_TRUE(WaitUntil([&] { return engine_->lane_state(0).done == 1; }));
  EXPECT_EQ(DaemonCalls(), 1u);
  EXPECT_EQ(engine_->regions().size(), 2u);  // nothing registered for the empty tensor
  // Region 0 with elements: the caller's mistake, named, the session goes on.
  const CallAnswer bad = Call(ActWithoutLoraMemory(16), false, act_);
  EXPECT_EQ(bad.code, static_cast<int>(StatusCode::kInvalidArgument));
  EXPECT_EQ(ReasonFromWire(bad.reason), Reason::kBadArgument) << bad.message;
  EXPECT_EQ(bad.status().action(), v1::ClientAction::kRaiseValue);  // not "register again"
  EXPECT_NE(bad.message.find("'lora_act_out'"), std::string::npos) << bad.message;
  EXPECT_NE(bad.message.find("[256, 16]"), std::string::npos) << bad.message;
  EXPECT_FALSE(engine_->failed());
  ASSERT_TRUE(WaitUntil([&] { return engine_->lane_state(0).done == 2; }));  // the rejected seq completes too
}

TEST_F(EngineTest, AsynchronousRejectionsAreTakenWithTheirReasons) {
  StartDaemon();
  OpenEngine();
  Call(Quant(DType::kFloat16), /*asynchronous=*/true);
  Call(Quant(), /*asynchronous=*/true);
  ASSERT_TRUE(engine_->WaitConsumed().ok());
  ASSERT_TRUE(engine_->HasRejected());
  std::vector<RejectedCall> r = engine_->TakeRejected();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].seq, 1u);
  EXPECT_EQ(ReasonFromWire(r[0].reason), Reason::kBadArgument);
  EXPECT_EQ(r[0].regions.size(), 0u);  // none passed with the call
  EXPECT_FALSE(engine_->HasRejected());
}

TEST_F(EngineTest, ASessionTheDaemonEndsFailsTheEngine) {
  StartDaemon();
  OpenEngine();
  const RecordArgs quant = Quant();  // its regions registered while the session lives
  pb::CloseSessionRequest req;
  req.set_session_id(reply_.session_id());
  req.set_token(reply_.token());
  pb::CloseSessionReply rep;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->CloseSession(&ctx, req, &rep).ok());
  ASSERT_TRUE(WaitUntil([&] { return engine_->failed(); }));
  EXPECT_EQ(engine_->failure().reason(), Reason::kClosed);
  EXPECT_EQ(engine_->failure().action(), v1::ClientAction::kReconnect);
  CallAnswer a;
  Status refused = engine_->CallRing(nullptr, static_cast<uint32_t>(quant_), quant, false, {}, {}, &a);
  EXPECT_EQ(refused.reason(), Reason::kClosed) << refused.ToString();
}

TEST_F(EngineTest, AKilledDaemonReleasesTheWaitsAndCountsTheLostCalls) {
  StartDaemon(/*hold=*/true);  // its kernels never finish: "done" never comes
  OpenEngine();
  for (int i = 0; i < 3; ++i) Call(Quant(), /*asynchronous=*/true);
  ASSERT_TRUE(engine_->WaitConsumed().ok());  // accepted, all three
  EXPECT_TRUE(engine_->LanesBehind());
  ASSERT_TRUE(daemon_->process().Signal(SIGKILL, 5000ms));
  ASSERT_TRUE(WaitUntil([&] { return engine_->failed() && !engine_->LanesBehind(); }));
  EXPECT_EQ(engine_->lane_state(0).done, 3u);  // released from the host up to what was issued
  EXPECT_EQ(engine_->TakeLost(), 3u);
  EXPECT_EQ(engine_->TakeLost(), 0u);  // reported once
}

TEST_F(EngineTest, AStoppedDaemonIsFoundByItsHeartbeat) {
  StartDaemon(/*hold=*/true);
  EngineOptions o;
  o.heartbeat_timeout = 300ms;
  OpenEngine(o);
  Call(Quant(), /*asynchronous=*/true);  // outstanding: its done never comes
  ASSERT_TRUE(engine_->WaitConsumed().ok());
  ASSERT_TRUE(WaitUntil([&] { return engine_->lane_state(0).done == 0 && engine_->LanesBehind(); }));
  std::this_thread::sleep_for(300ms);  // the heartbeat is seen advancing first
  ASSERT_EQ(::kill(daemon_->process().pid(), SIGSTOP), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const bool failed = WaitUntil([&] { return engine_->failed(); }, 5000ms);
  const auto took = std::chrono::steady_clock::now() - t0;
  ::kill(daemon_->process().pid(), SIGCONT);
  ASSERT_TRUE(failed);
  EXPECT_LT(took, 3000ms);
  EXPECT_NE(engine_->failure().message().find("heartbeat"), std::string::npos) << engine_->failure().ToString();
}

// The daemon with several executor threads: six clients calling at once,
// each from its own thread, every call answered and counted, and the threads
// there to be seen by name.
// A close while another thread is inside an issue (past its failed() check,
// its wait enqueued, its fence not yet recorded): the monitor must not take
// the fences as passed and free the memory under that wait. It keeps the
// engine until the issue has ended, then lets it go.
TEST_F(EngineTest, ACloseDuringAnIssueKeepsTheMemoryUntilTheIssueEnds) {
  StartDaemon();
  OpenEngine();
  SessionMonitor* monitor = SessionMonitor::Get();
  ASSERT_NE(monitor, nullptr);
  ASSERT_TRUE(WaitUntil([&] { return monitor->retired_count() == 0; }));  // earlier tests' engines are gone
  std::mutex mu;
  std::condition_variable cv;
  bool in_send = false, let_go = false;
  std::thread caller([&] {
    Status s = engine_->CallWith(nullptr, IssueOptions{}, [&](uint32_t, uint64_t) {
      std::unique_lock<std::mutex> lock(mu);
      in_send = true;
      cv.notify_all();
      cv.wait(lock, [&] { return let_go; });
      return Status::Unavailable("the test's transport");
    });
    EXPECT_FALSE(s.ok());
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 10s, [&] { return in_send; }));
  }
  engine_->Close();
  std::this_thread::sleep_for(400ms);  // eight of the monitor's 50 ms ticks
  EXPECT_EQ(monitor->retired_count(), 1u) << "the engine was let go with an issue in progress";
  {
    std::lock_guard<std::mutex> lock(mu);
    let_go = true;
  }
  cv.notify_all();
  caller.join();
  EXPECT_TRUE(WaitUntil([&] { return monitor->retired_count() == 0; }));
}

TEST_F(EngineTest, SeveralExecutorThreadsServeClientsCallingAtOnce) {
  StartDaemon(/*hold=*/false, {"--executor-threads", "3"});
  constexpr int kClients = 6;
  constexpr int kCalls = 300;
  std::vector<pb::OpenSessionReply> replies(kClients);
  std::vector<std::unique_ptr<GrpcRegistrar>> registrars(kClients);
  std::vector<std::shared_ptr<SessionEngine>> engines(kClients);
  for (int i = 0; i < kClients; ++i) {
    Open({}, &replies[i], &registrars[i], &engines[i]);
    ASSERT_TRUE(engines[i]);
  }
  std::vector<RecordArgs> args;
  for (int i = 0; i < kClients; ++i) args.push_back(Quant(DType::kBFloat16, 0, engines[i].get()));
  std::atomic<int> failures{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      for (int n = 0; n < kCalls; ++n) {
        CallAnswer a;
        // Mostly asynchronous, every tenth waits for its answer.
        Status s = engines[i]->CallRing(nullptr, static_cast<uint32_t>(quant_), args[i], n % 10 != 9, {},
                                        IssueOptions{}, &a);
        if (!s.ok() || a.code != 0) failures.fetch_add(1);
      }
      if (!engines[i]->WaitConsumed().ok()) failures.fetch_add(1);
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(failures.load(), 0);
  for (int i = 0; i < kClients; ++i) {
    ASSERT_TRUE(WaitUntil([&] { return !engines[i]->LanesBehind(); })) << "client " << i;
    EXPECT_EQ(engines[i]->lane_state(0).done, static_cast<uint64_t>(kCalls));
    EXPECT_FALSE(engines[i]->HasRejected());
    EXPECT_EQ(DaemonCalls(&replies[i]), static_cast<uint64_t>(kCalls)) << "client " << i;
  }
  std::set<std::string> names;
  const std::string tasks = "/proc/" + std::to_string(daemon_->process().pid()) + "/task";
  for (const auto& t : std::filesystem::directory_iterator(tasks)) {
    std::ifstream comm(t.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name.rfind("opd-exec", 0) == 0) names.insert(name);
  }
  EXPECT_EQ(names, (std::set<std::string>{"opd-exec-0", "opd-exec-1", "opd-exec-2"}));
  for (auto& e : engines) e->Close();
}

}  // namespace
}  // namespace cache_dit_opd::client
