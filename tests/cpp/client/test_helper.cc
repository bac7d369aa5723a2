// opd_client_test_helper: a second client process for the GPU tests.
//
//   opd_client_test_helper hammer --address A [--iters N] [--seed S]
//       N per-token quant calls on the same deterministic [64, 128] input;
//       every output must equal the first. Prints "HASH <16 hex digits>" of
//       the output bytes and exits 0, or prints "MISMATCH ..." and exits 1.
//   opd_client_test_helper stuck --address A [--streams K]
//       One completed call (so the session has regions mapped), then K calls
//       on K streams that never signal "inputs ready". Prints
//       "READY session=<id> regions=<n>" and sleeps until killed.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "client/opd_client.h"
#include "tests/cpp/client/support/op_cases.h"
#include "tests/cpp/client/support/test_support.h"

using namespace cache_dit_opd;
using namespace cache_dit_opd::client;
using namespace cache_dit_opd::testing;

namespace {

int Fail(const std::string& what, const Status& s) {
  std::printf("ERROR %s: %s\n", what.c_str(), s.ToString().c_str());
  std::fflush(stdout);
  return 2;
}

struct QuantBuffers {
  HostTensor x;
  std::unique_ptr<DeviceBuffer> dx, dq;
  std::vector<int64_t> qsizes;
};

Status MakeQuant(uint64_t seed, QuantBuffers* b) {
  std::vector<HostTensor> in, out;
  OPD_RETURN_IF_ERROR(BenchInputs(kQuant, {64, 128}, seed, &in));
  OPD_RETURN_IF_ERROR(OutputsFor(kQuant, in, &out));
  b->x = in[0];
  b->qsizes = out[0].sizes;
  b->dx = std::make_unique<DeviceBuffer>(b->x.storage.size());
  b->dq = std::make_unique<DeviceBuffer>(out[0].storage.size());
  if (!b->dx->ok() || !b->dq->ok()) return Status::ResourceExhausted("cudaMalloc failed");
  if (cudaMemcpy(b->dx->data(), b->x.storage.data(), b->x.storage.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
    return Status::Internal("cudaMemcpy failed");
  }
  return Status::Ok();
}

std::vector<client::Arg> QuantArgs(const QuantBuffers& b) {
  return {TensorView{b.dx->data(), b.x.sizes, {}, DType::kBFloat16},
          TensorView{b.dq->data(), b.qsizes, {}, DType::kFloat8E4M3FN}};
}

int Hammer(const std::string& address, int iters, uint64_t seed) {
  ClientOptions o;
  o.address = address;
  o.client_name = "opd_client_test_helper hammer";
  std::unique_ptr<Client> c;
  Status s = Client::Connect(o, &c);
  if (!s.ok()) return Fail("connect", s);
  QuantBuffers b;
  s = MakeQuant(seed, &b);
  if (!s.ok()) return Fail("buffers", s);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  std::vector<uint8_t> first(b.dq->size()), now(b.dq->size());
  for (int i = 0; i < iters; ++i) {
    cudaMemsetAsync(b.dq->data(), 0xCD, b.dq->size(), stream);
    s = c->Call(kQuant, "out", QuantArgs(b), stream);
    if (!s.ok()) return Fail("call " + std::to_string(i), s);
    cudaMemcpyAsync(now.data(), b.dq->data(), now.size(), cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    if (i == 0) {
      first = now;
    } else if (now != first) {
      std::printf("MISMATCH at call %d, byte %lld\n", i, static_cast<long long>(FirstMismatch(first, now)));
      return 1;
    }
  }
  std::printf("HASH %016llx\n", static_cast<unsigned long long>(Fnv1a(first.data(), first.size())));
  std::fflush(stdout);
  return 0;
}

int Stuck(const std::string& address, int streams) {
  ClientOptions o;
  o.address = address;
  o.lanes = static_cast<uint32_t>(streams + 1);  // + the stream of the completed calls
  o.client_name = "opd_client_test_helper stuck";
  std::unique_ptr<Client> c;
  Status s = Client::Connect(o, &c);
  if (!s.ok()) return Fail("connect", s);
  QuantBuffers b;
  s = MakeQuant(1, &b);
  if (!s.ok()) return Fail("buffers", s);
  DeviceBuffer big(64 << 20);  // a second, larger region
  cudaStream_t first;
  cudaStreamCreateWithFlags(&first, cudaStreamNonBlocking);
  s = c->Call(kQuant, "out", QuantArgs(b), first);
  if (!s.ok()) return Fail("first call", s);
  s = c->Call(kQuant, "out",
              {TensorView{b.dx->data(), b.x.sizes, {}, DType::kBFloat16},
               TensorView{big.data() + 4096, b.qsizes, {}, DType::kFloat8E4M3FN}},
              first);
  if (!s.ok()) return Fail("second call", s);
  cudaStreamSynchronize(first);
  std::vector<std::thread> threads;
  for (int k = 0; k < streams; ++k) {
    threads.emplace_back([&] {
      cudaStream_t st;
      cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
      CallOptions never;
      never.signal_inputs_ready = false;
      never.timeout_ms = 600000;
      Status r = c->Call(kQuant, "out", QuantArgs(b), st, never);
      std::printf("stuck call returned: %s\n", r.ToString().c_str());
      std::fflush(stdout);
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::printf("READY session=%llu regions=%zu\n",
              static_cast<unsigned long long>(c->session_info().session_id), c->region_count());
  std::fflush(stdout);
  for (;;) ::pause();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: opd_client_test_helper hammer|stuck --address A [...]\n");
    return 2;
  }
  std::map<std::string, std::string> f;
  for (int i = 2; i + 1 < argc; i += 2) f[argv[i] + (std::strncmp(argv[i], "--", 2) == 0 ? 2 : 0)] = argv[i + 1];
  const std::string mode = argv[1];
  if (mode == "hammer") {
    return Hammer(f["address"], f.count("iters") ? std::stoi(f["iters"]) : 200,
                  f.count("seed") ? std::stoull(f["seed"]) : 7);
  }
  if (mode == "stuck") return Stuck(f["address"], f.count("streams") ? std::stoi(f["streams"]) : 4);
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
