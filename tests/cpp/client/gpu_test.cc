// End-to-end tests of the C++ client against the real daemon binary on GPU 0
// (ctest label "gpu"). Each test starts its own daemon with --socket in a
// private directory and prints the daemon's log when it fails.
//
// Skips (with the reason) when no CUDA device is visible or the daemon is
// not built; the bitwise test also skips when opd_ref_tool (which needs the
// kernel library target) is not built. Binaries: see support/test_support.h.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <iostream>
#include <random>
#include <set>
#include <thread>

#include "client/opd_client.h"
#include "tests/cpp/client/support/op_cases.h"
#include "tests/cpp/client/support/test_support.h"

namespace cache_dit_opd::client {
namespace {

using namespace cache_dit_opd::testing;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

#define ASSERT_OK(expr)                                   \
  do {                                                    \
    ::cache_dit_opd::Status _s = (expr);                  \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s.ToString(); \
  } while (0)
#define EXPECT_OK(expr)                                   \
  do {                                                    \
    ::cache_dit_opd::Status _s = (expr);                  \
    EXPECT_TRUE(_s.ok()) << #expr << ": " << _s.ToString(); \
  } while (0)
#define ASSERT_CUDA(expr)                                                       \
  do {                                                                          \
    cudaError_t _e = (expr);                                                    \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e);      \
  } while (0)

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

// Waits until `pred` holds or `timeout` passes.
template <typename Pred>
bool WaitFor(Pred pred, milliseconds timeout, milliseconds step = milliseconds(20)) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(step);
  }
  return true;
}

// One cudaMalloc allocation holding several tensors at 256-byte aligned
// offsets, the first one not at the base, so byte offsets from the
// allocation base are exercised.
class Arena {
 public:
  explicit Arena(size_t bytes) : buf_(bytes + 1024) {}
  bool ok() const { return buf_.ok(); }
  // Places `t`'s storage; returns the view on it.
  TensorView Place(const HostTensor& t, cudaStream_t stream, bool upload, uint8_t fill = 0xCD) {
    used_ = (used_ + 255) / 256 * 256;
    uint8_t* at = buf_.data() + used_;
    used_ += t.storage.size();
    if (upload) {
      cudaMemcpyAsync(at, t.storage.data(), t.storage.size(), cudaMemcpyHostToDevice, stream);
    } else {
      cudaMemsetAsync(at, fill, t.storage.size(), stream);
    }
    return TensorView{at + t.byte_offset, t.sizes, t.strides, t.dtype};
  }
  static size_t Need(const std::vector<HostTensor>& ts) {
    size_t n = 256;
    for (const auto& t : ts) n += (t.storage.size() + 255) / 256 * 256 + 256;
    return n;
  }

 private:
  DeviceBuffer buf_;
  size_t used_ = 256;
};

std::vector<uint8_t> Download(const TensorView& v, size_t bytes, cudaStream_t stream) {
  std::vector<uint8_t> out(bytes);
  cudaMemcpyAsync(out.data(), v.data, bytes, cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  return out;
}

class ClientGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible (cudaGetDeviceCount)";
    daemon_bin_ = FindDaemonBinary();
    if (daemon_bin_.empty()) {
      GTEST_SKIP() << "the daemon binary is not built: build target cache-dit-opd, or set "
                      "CACHE_DIT_OPD_DAEMON=<path> or CACHE_DIT_OPD_BUILD_DIR=<build dir>";
    }
    ASSERT_CUDA(cudaSetDevice(0));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (HasFailure()) {
      for (auto* d : {daemon_.get(), second_daemon_.get()}) {
        if (d) std::cerr << "\ncache-dit-opd log (" << d->socket_path() << "):\n" << d->process().LogTail() << "\n";
      }
      for (auto& c : helpers_) std::cerr << "\nhelper log:\n" << c->LogTail() << "\n";
    }
    clients_.clear();
    if (stream_) cudaStreamDestroy(stream_);
  }

  void StartDaemon(std::vector<std::string> extra = {}, std::unique_ptr<DaemonProcess>* where = nullptr,
                   const std::string& socket_path = "") {
    DaemonProcess::Options o;
    o.binary = daemon_bin_;
    o.device = 0;
    o.extra_args = std::move(extra);
    o.socket_path = socket_path;
    auto* slot = where ? where : &daemon_;
    ASSERT_OK(DaemonProcess::Start(o, slot));
  }

  ClientOptions Opts(uint32_t lanes = 4) {
    ClientOptions o;
    o.device = 0;
    o.address = daemon_->socket_path();
    o.lanes = lanes;
    o.connect_timeout_ms = 20000;
    o.client_name = "opd_client_gpu_test";
    return o;
  }

  Client* Connect(uint32_t lanes = 4) {
    std::unique_ptr<Client> c;
    Status s = Client::Connect(Opts(lanes), &c);
    EXPECT_TRUE(s.ok()) << "Client::Connect: " << s.ToString();
    if (!s.ok()) return nullptr;
    clients_.push_back(std::move(c));
    return clients_.back().get();
  }

  // A quant problem with a reference output computed once through `c`.
  struct Quant {
    HostTensor x;
    std::vector<HostTensor> outs;
    std::unique_ptr<Arena> arena;
    TensorView dx, dq;
    size_t q_bytes = 0;
  };
  void MakeQuant(Quant* q, uint64_t seed, cudaStream_t stream, std::vector<int64_t> shape = {64, 128}) {
    std::vector<HostTensor> in;
    ASSERT_OK(BenchInputs(kQuant, shape, seed, &in));
    q->x = in[0];
    ASSERT_OK(OutputsFor(kQuant, in, &q->outs));
    q->arena = std::make_unique<Arena>(Arena::Need({q->x, q->outs[0]}));
    ASSERT_TRUE(q->arena->ok());
    q->dx = q->arena->Place(q->x, stream, true);
    q->dq = q->arena->Place(q->outs[0], stream, false);
    q->q_bytes = q->outs[0].storage.size();
  }
  std::vector<Arg> QuantArgs(const Quant& q) { return {q.dx, q.dq}; }

  std::string daemon_bin_;
  std::unique_ptr<DaemonProcess> daemon_, second_daemon_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::unique_ptr<Child>> helpers_;
  cudaStream_t stream_ = nullptr;
};

// ---------------------------------------------------------------------------
// Every op's .out overload through the daemon == the functional op in-process.

CallRecord Case(const char* op, std::string label, std::vector<HostTensor> inputs) {
  CallRecord r;
  r.op = op;
  r.overload = "";  // the reference runs the functional op
  r.label = std::move(label);
  r.tensors = std::move(inputs);
  return r;
}

std::vector<CallRecord> BitwiseCases() {
  std::mt19937_64 rng(20240611);
  std::vector<CallRecord> c;
  // Per-token quant/dequant: any D >= 1, rows not 16-byte aligned.
  c.push_back(Case(kQuant, "quant [4, 7, 128]", {RandomBf16(rng, {4, 7, 128})}));
  c.push_back(Case(kQuant, "quant [3, 13] (odd D)", {RandomBf16(rng, {3, 13})}));
  c.push_back(Case(kQuant, "quant [1, 1]", {RandomBf16(rng, {1, 1})}));
  {
    HostTensor x = RandomBf16(rng, {5, 64});
    std::memset(x.storage.data() + 2 * 64 * 2, 0, 64 * 2);  // an all-zero row (amax floor)
    c.push_back(Case(kQuant, "quant [5, 64] with a zero row", {x}));
  }
  c.push_back(Case(kDequant, "dequant [4, 7, 130]", {RandomPerTokenRecords(rng, {4, 7, 130})}));
  c.push_back(Case(kDequant, "dequant [3, 15] (odd D)", {RandomPerTokenRecords(rng, {3, 15})}));
  c.push_back(Case(kDequant, "dequant [2, 3]", {RandomPerTokenRecords(rng, {2, 3})}));
  // QKV permute: contiguous, and a transposed B/S view read in place.
  c.push_back(Case(kQkvQuant, "qkv quant [2, 5, 4, 3, 64]", {RandomBf16(rng, {2, 5, 4, 3, 64})}));
  c.push_back(Case(kQkvQuant, "qkv quant [2, 3, 2, 2, 128] B/S-transposed view",
                   {AsBatchSeqTransposed(RandomBf16(rng, {2, 3, 2, 2, 128}))}));
  c.push_back(Case(kQkvQuant, "qkv quant [1, 1, 1, 1, 4]", {RandomBf16(rng, {1, 1, 1, 1, 4})}));
  c.push_back(Case(kQkvDequant, "qkv dequant [5, 2, 3, 68]", {RandomQkvRecords(rng, {5, 2, 3, 68})}));
  c.push_back(Case(kQkvDequant, "qkv dequant [1, 1, 1, 132]", {RandomQkvRecords(rng, {1, 1, 1, 132})}));
  // Merge: every out dtype, infinities on either side, both sides empty,
  // gaps of 100+, NaN, D = 1, and flash-attn's [B, H, S] LSE read in place.
  for (DType dt : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    const std::vector<int64_t> o = {2, 9, 3, 64}, l = {2, 9, 3, 1};
    c.push_back(Case(kMerge, "merge " + DTypeName(dt) + " [2, 9, 3, 64] with inf/-inf/NaN LSE",
                     {RandomFloat(rng, dt, o), RandomLse(rng, DType::kFloat32, l, 0.0f, true, true),
                      RandomFloat(rng, dt, o), RandomLse(rng, DType::kFloat32, l, 1.0f, true, true)}));
  }
  {
    const std::vector<int64_t> o = {1, 7, 4, 128}, l = {1, 7, 4, 1};
    c.push_back(Case(kMerge, "merge bf16 [1, 7, 4, 128] head-major (strided) LSE",
                     {RandomFloat(rng, DType::kBFloat16, o),
                      AsHeadMajorLse(RandomLse(rng, DType::kFloat32, l, 0.0f, true, false)),
                      RandomFloat(rng, DType::kBFloat16, o),
                      AsHeadMajorLse(RandomLse(rng, DType::kFloat32, l, 0.0f, true, false))}));
  }
  {
    const std::vector<int64_t> o = {2, 4, 2, 32}, l = {2, 4, 2, 1};
    c.push_back(Case(kMerge, "merge fp16 [2, 4, 2, 32], gap of 100+ between sides",
                     {RandomFloat(rng, DType::kFloat16, o), RandomLse(rng, DType::kFloat32, l, 0.0f, false, false),
                      RandomFloat(rng, DType::kFloat16, o),
                      RandomLse(rng, DType::kFloat32, l, 105.0f, false, false)}));
  }
  {
    const std::vector<int64_t> o = {1, 6, 2, 1}, l = {1, 6, 2, 1};
    c.push_back(Case(kMerge, "merge fp32 [1, 6, 2, 1] (D = 1)",
                     {RandomFloat(rng, DType::kFloat32, o), RandomLse(rng, DType::kFloat32, l, 0.0f, true, false),
                      RandomFloat(rng, DType::kFloat32, o),
                      RandomLse(rng, DType::kFloat32, l, 0.0f, true, false)}));
  }
  {
    const std::vector<int64_t> o = {1, 5, 2, 32}, l = {1, 5, 2, 1};
    c.push_back(Case(kMerge, "merge bf16 [1, 5, 2, 32] with fp16 LSE",
                     {RandomFloat(rng, DType::kBFloat16, o), RandomLse(rng, DType::kFloat16, l, 0.0f, true, false),
                      RandomFloat(rng, DType::kBFloat16, o),
                      RandomLse(rng, DType::kFloat16, l, 0.5f, true, false)}));
  }
  // Rejected by the op's own checks on both sides (float32 input to quant).
  c.push_back(Case(kQuant, "quant with a float32 input (both sides must reject)",
                   {RandomFloat(rng, DType::kFloat32, {2, 8})}));
  return c;
}

TEST_F(ClientGpuTest, EveryOpMatchesTheInProcessCallBitwise) {
  const std::string tool = FindRefTool();
  if (tool.empty()) {
    GTEST_SKIP() << "opd_ref_tool is not built (it needs the kernel library target cache_dit_cuda_ops); "
                    "set CACHE_DIT_OPD_REF_TOOL=<path> to use one";
  }
  CallFile calls;
  calls.calls = BitwiseCases();
  CallFile ref;
  ASSERT_OK(RunRefTool(tool, calls, 0, &ref));

  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Client* client = Connect();
  ASSERT_NE(client, nullptr);
  std::set<std::string> served;
  for (const OpEntry& e : client->session_info().catalog) served.insert(e.name + "." + e.overload);
  for (const char* op : {kMerge, kQuant, kDequant, kQkvQuant, kQkvDequant}) {
    EXPECT_TRUE(served.count(std::string(op) + ".out")) << "the daemon does not serve " << op << ".out";
  }

  for (size_t i = 0; i < calls.calls.size(); ++i) {
    const CallRecord& call = calls.calls[i];
    const CallRecord& want = ref.calls[i];
    SCOPED_TRACE(call.label);
    std::vector<HostTensor> outs;
    ASSERT_OK(OutputsFor(call.op, call.tensors, &outs));
    std::vector<HostTensor> all = call.tensors;
    all.insert(all.end(), outs.begin(), outs.end());
    Arena ins(Arena::Need(call.tensors)), out_arena(Arena::Need(outs));
    ASSERT_TRUE(ins.ok() && out_arena.ok());
    std::vector<Arg> args;
    for (const HostTensor& t : call.tensors) args.push_back(ins.Place(t, stream_, true));
    std::vector<TensorView> out_views;
    for (const HostTensor& t : outs) {
      out_views.push_back(out_arena.Place(t, stream_, false));
      args.push_back(out_views.back());
    }
    Status s = client->Call(call.op, "out", args, stream_);
    if (!want.error.empty()) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument)
          << "in-process the op rejected the inputs (" << want.error << ") but the daemon returned "
          << s.ToString();
      continue;
    }
    ASSERT_TRUE(s.ok()) << "daemon call failed: " << s.ToString();
    EXPECT_EQ(want.label.find("not contiguous"), std::string::npos) << want.label;
    ASSERT_EQ(want.tensors.size(), outs.size()) << "the functional op returned " << want.tensors.size()
                                                << " tensors";
    for (size_t k = 0; k < outs.size(); ++k) {
      EXPECT_EQ(want.tensors[k].sizes, outs[k].sizes)
          << "output " << k << ": in-process shape " << DimsString(want.tensors[k].sizes) << ", expected "
          << DimsString(outs[k].sizes);
      EXPECT_EQ(want.tensors[k].dtype, outs[k].dtype) << "output " << k;
      const std::vector<uint8_t> got = Download(out_views[k], outs[k].storage.size(), stream_);
      const std::vector<uint8_t>& exp = want.tensors[k].storage;
      const int64_t at = FirstMismatch(got, exp);
      EXPECT_EQ(at, -1) << "output " << k << " (" << DimsString(outs[k].sizes) << ", " << DTypeName(outs[k].dtype)
                        << ") differs from the in-process result at byte " << at << " of " << exp.size()
                        << ": daemon 0x" << std::hex << int(at >= 0 && size_t(at) < got.size() ? got[at] : 0)
                        << ", in-process 0x" << int(at >= 0 && size_t(at) < exp.size() ? exp[at] : 0)
                        << std::dec << (got.size() == exp.size() ? "" : " (sizes differ)");
    }
  }
}

// ---------------------------------------------------------------------------

TEST_F(ClientGpuTest, TwoClientsInThreadsAndTwoProcessesAtOnce) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  // The golden output, from one call.
  Client* c0 = Connect();
  ASSERT_NE(c0, nullptr);
  Quant golden;
  ASSERT_NO_FATAL_FAILURE(MakeQuant(&golden, 7, stream_));
  ASSERT_OK(c0->Call(kQuant, "out", QuantArgs(golden), stream_));
  const std::vector<uint8_t> want = Download(golden.dq, golden.q_bytes, stream_);

  // Two helper processes hammering at the same time as two in-process clients.
  const std::string helper = FindHelperBinary();
  if (!helper.empty()) {
    for (int i = 0; i < 2; ++i) {
      std::unique_ptr<Child> h;
      ASSERT_OK(Child::Spawn({helper, "hammer", "--address", daemon_->socket_path(), "--iters", "300", "--seed", "7"},
                             daemon_->dir() + "/hammer" + std::to_string(i) + ".log", &h));
      helpers_.push_back(std::move(h));
    }
  }
  Client* a = Connect();
  Client* b = Connect();
  ASSERT_TRUE(a && b);
  EXPECT_NE(a->session_info().session_id, b->session_info().session_id);
  auto run = [&](Client* c) -> std::string {
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    Quant q;
    MakeQuant(&q, 7, s);
    for (int i = 0; i < 300; ++i) {
      cudaMemsetAsync(q.dq.data, 0xCD, q.q_bytes, s);
      Status st = c->Call(kQuant, "out", QuantArgs(q), s);
      if (!st.ok()) return "call " + std::to_string(i) + ": " + st.ToString();
      if (i % 25 == 0 || i == 299) {
        if (Download(q.dq, q.q_bytes, s) != want) return "call " + std::to_string(i) + ": wrong output";
      }
    }
    cudaStreamDestroy(s);
    return "";
  };
  auto fa = std::async(std::launch::async, run, a);
  auto fb = std::async(std::launch::async, run, b);
  ASSERT_EQ(fa.wait_for(std::chrono::seconds(120)), std::future_status::ready) << "client A stalled";
  ASSERT_EQ(fb.wait_for(std::chrono::seconds(120)), std::future_status::ready) << "client B stalled";
  EXPECT_EQ(fa.get(), "");
  EXPECT_EQ(fb.get(), "");

  char hash[32];
  std::snprintf(hash, sizeof(hash), "HASH %016llx", static_cast<unsigned long long>(Fnv1a(want.data(), want.size())));
  for (auto& h : helpers_) {
    int st = 0;
    ASSERT_TRUE(h->Wait(milliseconds(120000), &st)) << "helper did not finish";
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "helper failed:\n" << h->LogTail();
    EXPECT_NE(h->Log().find(hash), std::string::npos) << "helper output differs from " << hash << ":\n"
                                                      << h->LogTail();
  }
  if (helper.empty()) std::cerr << "note: opd_client_test_helper not found; ran the in-process clients only\n";
}

// ---------------------------------------------------------------------------

TEST_F(ClientGpuTest, AClientThatNeverSignalsStallsNoOtherSession) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Client* a = Connect(/*lanes=*/1);
  Client* b = Connect();
  ASSERT_TRUE(a && b);

  cudaStream_t sa, sb;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  Quant qa, qb;
  ASSERT_NO_FATAL_FAILURE(MakeQuant(&qa, 7, sa));
  ASSERT_NO_FATAL_FAILURE(MakeQuant(&qb, 7, sb));
  ASSERT_CUDA(cudaStreamSynchronize(sa));
  ASSERT_CUDA(cudaStreamSynchronize(sb));
  // Golden via B.
  ASSERT_OK(b->Call(kQuant, "out", QuantArgs(qb), sb));
  const std::vector<uint8_t> want = Download(qb.dq, qb.q_bytes, sb);

  // A: a call whose inputs are never signalled. The RPC may return at once
  // (queued) or only once the call runs; either way it is in the daemon.
  PreparedCall pa;
  ASSERT_OK(a->Prepare(kQuant, "out", QuantArgs(qa), &pa));
  CallOptions never;
  never.signal_inputs_ready = false;
  never.wait_done = false;
  never.timeout_ms = 120000;
  auto fa = std::async(std::launch::async, [&] { return a->CallPrepared(pa, sa, never); });
  std::this_thread::sleep_for(milliseconds(300));

  // B: 100 calls, each synchronized, within a deadline.
  auto fb = std::async(std::launch::async, [&]() -> std::string {
    for (int i = 0; i < 100; ++i) {
      cudaMemsetAsync(qb.dq.data, 0xCD, qb.q_bytes, sb);
      Status st = b->Call(kQuant, "out", QuantArgs(qb), sb);
      if (!st.ok()) return "call " + std::to_string(i) + ": " + st.ToString();
      if (cudaStreamSynchronize(sb) != cudaSuccess) return "cudaStreamSynchronize failed";
    }
    return Download(qb.dq, qb.q_bytes, sb) == want ? "" : "wrong output";
  });
  if (fb.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    ADD_FAILURE() << "session B made no progress within 30 s while session A's call waited for inputs: "
                     "a client that never signals stalls other sessions";
    // Unblock everything so the test can end: the client releases its waits
    // when the daemon dies.
    daemon_->process().Signal(SIGKILL, milliseconds(10000));
    fb.wait();
    fa.wait();
    return;
  }
  EXPECT_EQ(fb.get(), "");

  // A is still pending: its lane's "done" has not moved.
  LaneState st;
  ASSERT_OK(a->InspectLane(0, &st));
  EXPECT_EQ(st.issued, 1u);
  EXPECT_EQ(st.done, 0u) << "the daemon ran a call whose inputs were never signalled";

  // Signalling late (from the host) lets A's call run.
  ASSERT_OK(a->RaiseInputsReadyFromHost(0, 1));
  ASSERT_EQ(fa.wait_for(std::chrono::seconds(30)), std::future_status::ready) << "A's call never returned";
  EXPECT_OK(fa.get());
  EXPECT_TRUE(WaitFor([&] { return a->InspectLane(0, &st).ok() && st.done >= 1; }, milliseconds(30000)))
      << "A's call did not complete after its inputs were signalled (done = " << st.done << ")";
  std::vector<uint8_t> got(qa.q_bytes);
  ASSERT_CUDA(cudaMemcpy(got.data(), qa.dq.data, got.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, want);
  cudaStreamDestroy(sa);
  cudaStreamDestroy(sb);
}

// ---------------------------------------------------------------------------

TEST_F(ClientGpuTest, AKilledClientWithQueuedCallsLeavesTheDaemonHealthy) {
  const std::string helper = FindHelperBinary();
  if (helper.empty()) GTEST_SKIP() << "opd_client_test_helper is not built";
  // Every lane of the helper parks, however many are busy: the released
  // waits of a killed client are what this checks.
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--park-busy-lanes", "0"}));
  Client* observer = Connect();
  ASSERT_NE(observer, nullptr);

  std::unique_ptr<Child> h;
  ASSERT_OK(Child::Spawn({helper, "stuck", "--address", daemon_->socket_path(), "--streams", "4"},
                         daemon_->dir() + "/stuck.log", &h));
  Child* stuck = h.get();
  helpers_.push_back(std::move(h));
  std::string line;
  ASSERT_TRUE(stuck->WaitForLogLine("READY", milliseconds(60000), &line)) << "the helper did not get ready";
  unsigned long long sid = 0;
  size_t regions = 0;
  ASSERT_EQ(std::sscanf(line.c_str(), "READY session=%llu regions=%zu", &sid, &regions), 2) << line;
  ASSERT_GE(regions, 2u);

  cache_dit_opd::v1::StatsReply stats;
  ASSERT_OK(observer->GetStats(false, &stats));
  bool found = false;
  for (const auto& s : stats.session()) {
    if (s.session_id() == sid) {
      found = true;
      EXPECT_GE(s.regions(), 2u);
      EXPECT_GT(s.mapped_bytes(), 64u << 20);
    }
  }
  EXPECT_TRUE(found) << "GetStats does not list the helper's session " << sid << ":\n" << stats.DebugString();

  ASSERT_TRUE(stuck->Signal(SIGKILL, milliseconds(10000)));
  // The daemon notices at once (session channel), releases the session's
  // queued calls and unmaps its regions.
  bool gone = WaitFor(
      [&] {
        if (!observer->GetStats(false, &stats).ok()) return false;
        for (const auto& s : stats.session()) {
          if (s.session_id() == sid && (s.regions() != 0 || s.mapped_bytes() != 0)) return false;
        }
        return stats.regions() == 0 && stats.mapped_bytes() == 0;
      },
      milliseconds(30000), milliseconds(100));
  EXPECT_TRUE(gone) << "30 s after the client was killed, its mappings are still there:\n" << stats.DebugString();

  // Healthy: serving, and a fresh client's call works.
  cache_dit_opd::v1::VersionReply v;
  ASSERT_OK(observer->GetVersion(&v));
  EXPECT_TRUE(v.serving()) << v.not_serving_reason();
  Client* fresh = Connect();
  ASSERT_NE(fresh, nullptr);
  Quant q;
  ASSERT_NO_FATAL_FAILURE(MakeQuant(&q, 3, stream_));
  EXPECT_OK(fresh->Call(kQuant, "out", QuantArgs(q), stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
}

// ---------------------------------------------------------------------------

TEST_F(ClientGpuTest, SigtermWithANeverSignallingClientExitsWithinTheDrainDeadline) {
  constexpr int kDrainMs = 2000;
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--drain-deadline-ms", std::to_string(kDrainMs)}));
  Client* a = Connect(1);
  ASSERT_NE(a, nullptr);
  cudaStream_t sa;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  Quant q;
  ASSERT_NO_FATAL_FAILURE(MakeQuant(&q, 5, sa));
  ASSERT_CUDA(cudaStreamSynchronize(sa));
  // Never signalled, and the stream waits for it: only a release can free it.
  CallOptions never;
  never.signal_inputs_ready = false;
  never.timeout_ms = 120000;
  auto fa = std::async(std::launch::async, [&] { return a->Call(kQuant, "out", QuantArgs(q), sa, never); });
  std::this_thread::sleep_for(milliseconds(300));

  const auto t0 = Clock::now();
  int wstatus = 0;
  const bool exited = daemon_->process().Signal(SIGTERM, milliseconds(kDrainMs + 15000), &wstatus);
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
  ASSERT_TRUE(exited) << "the daemon did not exit within " << kDrainMs + 15000 << " ms of SIGTERM";
  EXPECT_LE(took, kDrainMs + 5000) << "exit took " << took << " ms with a drain deadline of " << kDrainMs << " ms";
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << "wait status " << wstatus;
  struct stat sb {};
  EXPECT_NE(::stat(daemon_->socket_path().c_str(), &sb), 0) << "the daemon left its socket behind";

  // The client's call returns, and its stream's wait is released.
  ASSERT_EQ(fa.wait_for(std::chrono::seconds(30)), std::future_status::ready) << "the pending call never returned";
  Status s = fa.get();
  std::cerr << "pending call returned: " << s.ToString() << "\n";
  EXPECT_TRUE(WaitFor([&] { return cudaStreamQuery(sa) == cudaSuccess; }, milliseconds(20000)))
      << "the client's stream still waits 20 s after the daemon exited";
  cudaGetLastError();
  cudaStreamDestroy(sa);
}

// ---------------------------------------------------------------------------

TEST_F(ClientGpuTest, DaemonDeathReleasesWaitsAndTheNextCallReconnects) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  const std::string socket = daemon_->socket_path();
  Client* a = Connect(1);
  ASSERT_NE(a, nullptr);
  const uint64_t first_session = a->session_info().session_id;
  cudaStream_t sa;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  Quant q;
  ASSERT_NO_FATAL_FAILURE(MakeQuant(&q, 9, sa));
  ASSERT_OK(a->Call(kQuant, "out", QuantArgs(q), sa));
  const std::vector<uint8_t> want = Download(q.dq, q.q_bytes, sa);

  CallOptions never;
  never.signal_inputs_ready = false;
  never.timeout_ms = 120000;
  auto fa = std::async(std::launch::async, [&] { return a->Call(kQuant, "out", QuantArgs(q), sa, never); });
  std::this_thread::sleep_for(milliseconds(300));
  ASSERT_TRUE(daemon_->process().Signal(SIGKILL, milliseconds(10000)));

  ASSERT_EQ(fa.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  std::cerr << "pending call returned: " << fa.get().ToString() << "\n";
  EXPECT_TRUE(WaitFor([&] { return cudaStreamQuery(sa) == cudaSuccess; }, milliseconds(20000)))
      << "the client's stream still waits 20 s after the daemon was killed";
  cudaGetLastError();
  LaneState st;
  if (a->InspectLane(0, &st).ok()) {
    EXPECT_GE(st.done, st.issued);
  }

  // A new daemon on the same socket: the next call opens a new session.
  DaemonProcess::Options o;
  o.binary = daemon_bin_;
  o.socket_path = socket;
  ASSERT_OK(DaemonProcess::Start(o, &second_daemon_));
  Status s = a->Call(kQuant, "out", QuantArgs(q), sa);
  if (!s.ok()) s = a->Call(kQuant, "out", QuantArgs(q), sa);  // the first may still see the old session fail
  ASSERT_OK(s);
  EXPECT_NE(a->session_info().session_id, 0u);
  EXPECT_EQ(Download(q.dq, q.q_bytes, sa), want);
  (void)first_session;
  cudaStreamDestroy(sa);
}

// ---------------------------------------------------------------------------

TEST_F(ClientGpuTest, RegionsAreCachedPerAllocationAndFreedAddressesAreNotReused) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Client* c = Connect();
  ASSERT_NE(c, nullptr);
  std::vector<HostTensor> in, out;
  ASSERT_OK(BenchInputs(kQuant, {32, 64}, 11, &in));
  ASSERT_OK(OutputsFor(kQuant, in, &out));
  const size_t xb = in[0].storage.size(), qb = out[0].storage.size();
  std::vector<uint8_t> want;
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    // Fresh allocations each round, freed without telling the client: the
    // runtime tends to hand back the same addresses, which must never be
    // sent as the old (freed) regions (buffer ids differ).
    void* x = nullptr;
    void* y = nullptr;
    ASSERT_CUDA(cudaMalloc(&x, 1 << 20));
    ASSERT_CUDA(cudaMalloc(&y, 1 << 20));
    ASSERT_CUDA(cudaMemcpy(static_cast<char*>(x) + 512, in[0].storage.data(), xb, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemset(y, 0xCD, 1 << 20));
    std::vector<Arg> args = {TensorView{static_cast<char*>(x) + 512, in[0].sizes, {}, DType::kBFloat16},
                             TensorView{static_cast<char*>(y) + 1024, out[0].sizes, {}, DType::kFloat8E4M3FN}};
    const size_t before = c->region_count();
    ASSERT_OK(c->Call(kQuant, "out", args, stream_));
    const size_t after_first = c->region_count();
    ASSERT_OK(c->Call(kQuant, "out", args, stream_));
    EXPECT_EQ(c->region_count(), after_first) << "the same allocations were registered twice";
    EXPECT_LE(after_first, before + 2);
    std::vector<uint8_t> got(qb);
    ASSERT_CUDA(cudaMemcpyAsync(got.data(), static_cast<char*>(y) + 1024, qb, cudaMemcpyDeviceToHost, stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    if (round == 0) want = got;
    EXPECT_EQ(got, want);
    ASSERT_CUDA(cudaFree(x));
    ASSERT_CUDA(cudaFree(y));
  }
  // Every cached allocation is freed now: pruning unregisters all of them.
  size_t removed = 0;
  EXPECT_OK(c->PruneRegions(&removed));
  EXPECT_GE(removed, 2u);
  EXPECT_EQ(c->region_count(), 0u);
  cache_dit_opd::v1::StatsReply stats;
  EXPECT_TRUE(WaitFor(
      [&] {
        return c->GetStats(true, &stats).ok() && stats.session_size() == 1 && stats.session(0).regions() == 0;
      },
      milliseconds(10000)))
      << "unregistered regions still mapped in the daemon:\n" << stats.DebugString();
  // ForgetAllocation by address after free.
  void* z = nullptr;
  ASSERT_CUDA(cudaMalloc(&z, 1 << 20));
  ASSERT_CUDA(cudaMemcpy(z, in[0].storage.data(), xb, cudaMemcpyHostToDevice));
  Quant q;
  ASSERT_NO_FATAL_FAILURE(MakeQuant(&q, 11, stream_, {32, 64}));
  ASSERT_OK(c->Call(kQuant, "out", {TensorView{z, in[0].sizes, {}, DType::kBFloat16}, q.dq}, stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  const size_t n = c->region_count();
  ASSERT_CUDA(cudaFree(z));
  EXPECT_OK(c->ForgetAllocation(static_cast<char*>(z) + 100));
  EXPECT_EQ(c->region_count(), n - 1);
}

TEST_F(ClientGpuTest, MemoryThatLegacyIpcCannotExportIsRejectedClearly) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Client* c = Connect();
  ASSERT_NE(c, nullptr);
  void* pool = nullptr;
  if (cudaMallocAsync(&pool, 1 << 16, stream_) != cudaSuccess) {
    cudaGetLastError();
    GTEST_SKIP() << "cudaMallocAsync unsupported here";
  }
  void* host = nullptr;
  ASSERT_CUDA(cudaMallocHost(&host, 1 << 16));
  Quant q;
  ASSERT_NO_FATAL_FAILURE(MakeQuant(&q, 1, stream_));
  Status s = c->Call(kQuant, "out", {TensorView{pool, q.x.sizes, {}, DType::kBFloat16}, q.dq}, stream_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("legacy CUDA IPC"), std::string::npos) << s.message();
  s = c->Call(kQuant, "out", {TensorView{host, q.x.sizes, {}, DType::kBFloat16}, q.dq}, stream_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  // The session is still usable.
  EXPECT_OK(c->Call(kQuant, "out", QuantArgs(q), stream_));
  // And a call the daemon rejects (wrong output shape) keeps the stream ordered.
  TensorView bad = q.dq;
  bad.sizes.back() += 1;
  s = c->Call(kQuant, "out", {q.dx, bad}, stream_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_OK(c->Call(kQuant, "out", QuantArgs(q), stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  cudaFreeAsync(pool, stream_);
  cudaFreeHost(host);
}

}  // namespace
}  // namespace cache_dit_opd::client
