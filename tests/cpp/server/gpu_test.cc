// GPU tests of the daemon's CUDA layer (ctest label "gpu"). Each test skips
// when no CUDA device is usable.
//
// The binary doubles as the exporter process of the region tests: run with
// --opd-export-helper BYTES it allocates BYTES with cudaMalloc, fills them
// with a pattern, prints the 64-byte IPC handle in hex on stdout and waits
// until its stdin closes (so the allocation outlives the parent's use).
#include <gtest/gtest.h>
#include <cuda_runtime_api.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <future>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda/driver_api.h"
#include "server/daemon.h"
#include "server/device/cuda_device_ops.h"
#include "server/device/device_probe.h"
#include "server/device/ipc_region_opener.h"
#include "server/session/region_registry.h"
#include "server/session/session_memory.h"
#include "test_util.h"
#include "tests/fake_daemon/fakes.h"

extern char** environ;

namespace cache_dit_opd {
namespace {

using namespace std::chrono_literals;

std::string g_self;  // path of this binary, for the exporter helper

#define SKIP_WITHOUT_GPU()                                      \
  do {                                                          \
    DeviceInfo info = cuda::ProbeDevice(0);               \
    if (!info.ok) GTEST_SKIP() << "no usable GPU: " << info.reason; \
  } while (0)

uint64_t DoneAddress(uint64_t base, uint32_t lane) {
  return base + SessionMemory::LaneOffset(lane) + offsetof(v1::LaneSemaphores, done);
}

TEST(GpuLaneSemaphoreTest, StreamWriteReachesRegisteredMemfdAndItsOtherMapping) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<SessionMemory> mem;
  ASSERT_TRUE(SessionMemory::Create(1, 2, 0, &mem).ok());
  std::unique_ptr<cuda::CudaDeviceOps> ops;
  ASSERT_TRUE(cuda::CudaDeviceOps::Create(0, &ops).ok());
  uint64_t dev = 0;
  ASSERT_TRUE(ops->RegisterHostMemory(mem->data(), mem->bytes(), &dev).ok());
  void* stream = nullptr;
  ASSERT_TRUE(ops->CreateStream(&stream).ok());

  // The client's view: a second shared mapping of the same memfd.
  void* client = mmap(nullptr, mem->bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, mem->fd(), 0);
  ASSERT_NE(client, MAP_FAILED);
  auto* client_lane = reinterpret_cast<v1::LaneSemaphores*>(static_cast<char*>(client) + SessionMemory::LaneOffset(1));

  const uint64_t addr[] = {DoneAddress(dev, 1)};
  bool sticky = false;
  Status s = ops->WriteValue64(stream, addr, 77, &sticky);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), cudaSuccess);
  EXPECT_EQ(mem->Done(1), 77u);
  EXPECT_EQ(std::atomic_ref<uint64_t>(client_lane->done).load(), 77u);
  EXPECT_EQ(mem->Done(0), 0u);

  // The other direction: a stream wait on inputs_ready released by a host
  // write through the client's mapping, then done written.
  Status api_status;
  const cuda::DriverApi* api = cuda::GetDriverApi(&api_status);
  ASSERT_NE(api, nullptr) << api_status.ToString();
  uint64_t ready_addr = dev + SessionMemory::LaneOffset(1) + offsetof(v1::LaneSemaphores, inputs_ready);
  ASSERT_EQ(api->stream_wait_value64(static_cast<CUstream>(stream), ready_addr, 5, CU_STREAM_WAIT_VALUE_GEQ),
            CUDA_SUCCESS);
  ASSERT_TRUE(ops->WriteValue64(stream, addr, 78, &sticky).ok());
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(mem->Done(1), 77u);  // still parked on the wait
  std::atomic_ref<uint64_t>(client_lane->inputs_ready).store(5, std::memory_order_release);
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (mem->Done(1) != 78u && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_EQ(mem->Done(1), 78u);

  ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), cudaSuccess);
  ops->DestroyStream(stream);
  ops->UnregisterHostMemory(mem->data());
  munmap(client, mem->bytes());
}

// A child process exporting a cudaMalloc'd allocation.
class Exporter {
 public:
  explicit Exporter(size_t bytes) {
    int in[2], out[2];
    EXPECT_EQ(pipe(in), 0);
    EXPECT_EQ(pipe(out), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    std::string n = std::to_string(bytes);
    char* argv[] = {g_self.data(), const_cast<char*>("--opd-export-helper"), n.data(), nullptr};
    EXPECT_EQ(posix_spawn(&pid_, g_self.c_str(), &fa, nullptr, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    stdin_ = in[1];
    FILE* f = fdopen(out[0], "r");
    char line[256] = {};
    if (fgets(line, sizeof(line), f) != nullptr) {
      std::string hex(line);
      while (!hex.empty() && (hex.back() == '\n' || hex.back() == '\r')) hex.pop_back();
      for (size_t i = 0; i + 1 < hex.size(); i += 2) handle_.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
    fclose(f);
  }
  ~Exporter() {
    close(stdin_);  // the helper frees its memory and exits
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  const std::string& handle() const { return handle_; }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  std::string handle_;
};

int ExportHelper(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return 3;
  cudaMemset(p, 0x5a, bytes);
  cudaDeviceSynchronize();
  cudaIpcMemHandle_t h;
  if (cudaIpcGetMemHandle(&h, p) != cudaSuccess) return 4;
  const unsigned char* b = reinterpret_cast<const unsigned char*>(&h);
  for (size_t i = 0; i < sizeof(h); ++i) std::printf("%02x", b[i]);
  std::printf("\n");
  std::fflush(stdout);
  char c;
  while (read(0, &c, 1) > 0) {
  }
  cudaFree(p);
  return 0;
}

TEST(GpuRegionTest, RealHandleFromAnotherProcess) {
  SKIP_WITHOUT_GPU();
  const size_t bytes = (1 << 20) + 4096;
  Exporter exporter(bytes);
  ASSERT_EQ(exporter.handle().size(), 64u);

  cuda::IpcRegionOpener opener(0);
  std::vector<uint64_t> completed(1, 0);
  RegionRegistry reg(&opener, 0, RegionLimits{}, 1, [&](uint32_t l) { return completed[l]; });

  RegionRegistry::Registered r;
  Status s = reg.Register(exporter.handle(), bytes, &r);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GE(r.mapped_size, bytes);
  EXPECT_FALSE(r.reused);
  EXPECT_EQ(opener.open_mappings(), 1u);

  RegionRegistry::Registered r2;
  ASSERT_TRUE(reg.Register(exporter.handle(), 0, &r2).ok());
  EXPECT_EQ(r2.region_id, r.region_id);
  EXPECT_TRUE(r2.reused);

  MappedRegion m;
  ASSERT_TRUE(reg.Resolve(r.region_id, &m).ok());
  std::vector<unsigned char> host(bytes);
  ASSERT_EQ(cudaMemcpy(host.data(), m.base, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(host.front(), 0x5a);
  EXPECT_EQ(host.back(), 0x5a);

  // A claim past the real size is refused (and leaks no mapping).
  RegionRegistry::Registered r3;
  s = reg.Register(exporter.handle(), r.mapped_size + 1, &r3);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opener.open_mappings(), 1u);

  bool deferred = true;
  ASSERT_TRUE(reg.Unregister(r.region_id, &deferred).ok());
  EXPECT_FALSE(deferred);
  EXPECT_EQ(reg.ReleaseCompleted(), 0u);
  EXPECT_EQ(opener.open_mappings(), 0u);

  // Garbage handle: the driver refuses; the daemon says so and keeps going.
  s = reg.Register(std::string(64, '\x11'), 0, &r3);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.reason(), Reason::kBadArgument);
  EXPECT_NE(s.message().find("cudaIpcOpenMemHandle"), std::string::npos) << s.message();
}

// The daemon core on a real GPU: real lane streams writing "done" into the
// registered memfd, a real IPC mapping from another process, the no-stall
// rule across sessions, and a client death that unmaps only after drain.
// The op runner is a fake (the dispatch layer has its own tests). With two
// executor threads the two sessions are served by different ones, and the
// stalled session's first stream operation is its parked wait: the thread
// makes the device current before its first (DeviceOps::EnterThread).
void OrderingNoStallAndClientDeath(uint32_t executor_threads) {
  DeviceInfo dev = cuda::ProbeDevice(0);
  testing::TempDir dir;
  std::unique_ptr<cuda::CudaDeviceOps> ops;
  ASSERT_TRUE(cuda::CudaDeviceOps::Create(0, &ops).ok());
  cuda::IpcRegionOpener opener(0);
  testing::FakeRunner runner;
  Options o;
  o.drain_deadline_ms = 2000;
  o.executor_threads = executor_threads;
  DaemonInfo info;
  info.device_index = 0;
  info.gpu_uuid = dev.uuid;
  Daemon d(o, info, {}, "", DaemonDeps{ops.get(), &opener, &runner}, dir.File("g.session.sock"));
  ASSERT_TRUE(d.Start().ok());
  Exporter exporter(1 << 20);
  ASSERT_EQ(exporter.handle().size(), 64u);

  struct Client {
    OpenSessionResult r;
    std::string token;
    int fd = -1;
    void* mem = nullptr;
    uint64_t bytes = 0;
    v1::LaneSemaphores* lane() {
      return reinterpret_cast<v1::LaneSemaphores*>(static_cast<char*>(mem) + v1::kLanesOffset);
    }
  };
  auto open = [&](Client* c) {
    OpenSessionParams p;
    p.protocol_version = v1::kProtocolVersion;
    p.client_pid = getpid();
    p.gpu_uuid = dev.uuid;
    p.lanes = 1;
    ASSERT_TRUE(d.OpenSession(p, &c->r).ok());
    c->token.assign(reinterpret_cast<const char*>(c->r.token.data()), c->r.token.size());
    testing::BoundChannel b = testing::BindAndMap(c->r.session_channel_path, c->r.session_id, c->token);
    c->fd = b.fd;
    c->mem = b.memory;
    c->bytes = b.bytes;
    ASSERT_NE(c->mem, nullptr);
  };
  auto call = [&](Client& c, uint64_t seq, uint64_t region) {
    auto st = std::make_shared<std::promise<Status>>();
    CallRequest req;
    req.op = "op";
    req.overload = "out";
    req.seq = seq;
    if (region) {
      TensorRef t;
      t.region_id = region;
      t.dtype = DType::kFloat32;
      req.args.push_back(t);
    }
    d.Call(c.r.session_id, c.token, req, [st](const Status& s) { st->set_value(s); });
    return st->get_future();
  };
  auto wait_done = [](v1::LaneSemaphores* l, uint64_t v) {
    auto deadline = std::chrono::steady_clock::now() + 5s;
    while (std::atomic_ref<uint64_t>(l->done).load() < v && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    return std::atomic_ref<uint64_t>(l->done).load();
  };

  Client a, b;
  open(&a);
  open(&b);
  if (executor_threads > 1) {
    auto session = [&](const Client& c) {
      std::shared_ptr<Session> s;
      EXPECT_TRUE(d.sessions().Authorize(c.r.session_id, c.token, /*require_bound=*/true, &s).ok());
      return s;
    };
    // Neither has called yet, so asking assigns them: a to one executor, b
    // (the other then serving fewer) to the other.
    auto sa = session(a), sb = session(b);
    ASSERT_TRUE(sa && sb);
    EXPECT_NE(d.executor().ExecutorOf(*sa), d.executor().ExecutorOf(*sb));
  }
  std::promise<std::pair<Status, RegionRegistry::Registered>> reg;
  d.RegisterRegion(a.r.session_id, a.token, exporter.handle(), 1 << 20,
                   [&](const Status& s, const RegionRegistry::Registered& r) { reg.set_value({s, r}); });
  auto [rs, region] = reg.get_future().get();
  ASSERT_TRUE(rs.ok()) << rs.ToString();
  EXPECT_EQ(opener.open_mappings(), 1u);

  // A's inputs never arrive; B is served anyway.
  auto a1 = call(a, 1, region.region_id);
  std::atomic_ref<uint64_t>(b.lane()->inputs_ready).store(1);
  auto b1 = call(b, 1, 0);
  ASSERT_EQ(b1.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(b1.get().ok());
  EXPECT_EQ(wait_done(b.lane(), 1), 1u);
  // A's call is accepted (answered at validation) and launched ahead behind
  // a parked wait, so its "done" does not move.
  ASSERT_EQ(a1.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(a1.get().ok());
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(std::atomic_ref<uint64_t>(a.lane()->done).load(), 0u);

  std::atomic_ref<uint64_t>(a.lane()->inputs_ready).store(2);
  EXPECT_EQ(wait_done(a.lane(), 1), 1u);
  auto a2 = call(a, 2, region.region_id);
  ASSERT_EQ(a2.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(a2.get().ok());
  EXPECT_EQ(wait_done(a.lane(), 2), 2u);

  // A's third call goes to the GPU behind a parked wait on inputs that
  // never come; then A dies. Its session ends, the daemon releases the wait,
  // and its mapping goes once its lane drained.
  auto a3 = call(a, 3, region.region_id);
  ASSERT_EQ(a3.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(a3.get().ok());
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(std::atomic_ref<uint64_t>(a.lane()->done).load(), 2u);
  const auto died = std::chrono::steady_clock::now();
  close(a.fd);
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (opener.open_mappings() > 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(opener.open_mappings(), 0u);
  std::printf("[ measured ] parked wait of a dead client released and its region unmapped %.1f ms after its "
              "channel closed\n",
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - died).count());
  // Raised past every seq (it will never signal again), on the ending thread.
  EXPECT_EQ(std::atomic_ref<uint64_t>(a.lane()->inputs_ready).load(), v1::kInputsReadyReleased);
  EXPECT_EQ(std::atomic_ref<uint64_t>(a.lane()->done).load(), 3u);
  // B is unaffected.
  std::atomic_ref<uint64_t>(b.lane()->inputs_ready).store(2);
  auto b2 = call(b, 2, 0);
  ASSERT_EQ(b2.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(b2.get().ok());
  EXPECT_EQ(wait_done(b.lane(), 2), 2u);
  // The executor counts a call after it enqueued its "done" write, which
  // the GPU may carry out first: poll for the count.
  StatsSnapshot stats;
  deadline = std::chrono::steady_clock::now() + 5s;
  do {
    ASSERT_TRUE(d.GetStats(0, "", &stats).ok());
  } while (stats.calls < 5 && std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(stats.sessions, 1u);
  EXPECT_EQ(stats.sessions_closed, 1u);
  EXPECT_EQ(stats.calls, 5u);

  d.RequestShutdown(0, "test");
  d.Drain();
  d.Stop();
  munmap(a.mem, a.bytes);
  munmap(b.mem, b.bytes);
  close(b.fd);
}

TEST(GpuDaemonTest, OrderingNoStallAndClientDeath) {
  SKIP_WITHOUT_GPU();
  OrderingNoStallAndClientDeath(1);
}

TEST(GpuDaemonTest, OrderingNoStallAndClientDeathOnTwoExecutorThreads) {
  SKIP_WITHOUT_GPU();
  OrderingNoStallAndClientDeath(2);
}

TEST(GpuProbeTest, UuidLooksLikeNvidiaSmi) {
  SKIP_WITHOUT_GPU();
  DeviceInfo info = cuda::ProbeDevice(0);
  ASSERT_EQ(info.uuid.size(), 40u) << info.uuid;
  EXPECT_EQ(info.uuid.rfind("GPU-", 0), 0u);
  EXPECT_FALSE(info.name.empty());
  EXPECT_GT(info.driver_version, 0);
}

}  // namespace
}  // namespace cache_dit_opd

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--opd-export-helper") {
    return cache_dit_opd::ExportHelper(std::stoull(argv[2]));
  }
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  cache_dit_opd::g_self = n > 0 ? std::string(buf, n) : argv[0];
  // As the daemon's main does before its first CUDA call (server/main.cc):
  // eager module loading and 32 hardware work queues, which the no-stall
  // rule counts on, so the daemon core here runs as configured in service.
  std::vector<std::string> notes;
  cache_dit_opd::cuda::ConfigureCudaEnvironment(&notes);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
