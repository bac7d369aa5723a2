// opd_client_bench: latency of one small op call through the daemon from the
// C++ client, against the same call made in-process through the c10 boxed
// dispatcher (measured by opd_ref_tool in its own process). Prints one JSON
// object on stdout; diagnostics go to stderr.
//
//   opd_client_bench [--device N] [--address A | --spawn-daemon PATH|auto]
//                    [--ref-tool PATH|auto|none] [--op fp8_comm_per_token_quant]
//                    [--shape 1,64] [--iters 2000] [--warmup 200] [--transport ring|grpc]
//
// Figures (microseconds, p50/p99/mean/min/max over --iters calls after
// --warmup calls):
//   remote.prepared_host_us  CallPrepared returns (semaphore write, RPC, wait
//                            enqueued); the GPU work is not waited for
//   remote.prepared_sync_us  CallPrepared + cudaStreamSynchronize: the whole
//                            round trip including the kernel
//   remote.call_host_us      Call (region lookup + encoding every time) returns
//   in_process.host_us       boxed call of OP.out returns
//   in_process.sync_us       boxed call + cudaStreamSynchronize
//   overhead_us              remote minus in-process, per percentile
// Without --address the daemon is found by the device's UUID (discovery).
#include <cuda_runtime_api.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "client/discovery.h"
#include "client/opd_client.h"
#include "tests/cpp/client/support/latency.h"
#include "tests/cpp/client/support/op_cases.h"
#include "tests/cpp/client/support/test_support.h"

using namespace cache_dit_opd;
using namespace cache_dit_opd::client;
using namespace cache_dit_opd::testing;

namespace {


std::string Quote(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o + "\"";
}

// Extracts {"p50": x, "p99": y, ...} after `key` in a flat JSON line.
bool ParseSummary(const std::string& json, const std::string& key, LatencySummary* s) {
  auto k = json.find("\"" + key + "\"");
  if (k == std::string::npos) return false;
  auto grab = [&](const char* f, double* v) {
    auto p = json.find(std::string("\"") + f + "\"", k);
    if (p == std::string::npos) return false;
    p = json.find(':', p);
    *v = std::stod(json.substr(p + 1));
    return true;
  };
  return grab("p50", &s->p50) && grab("p99", &s->p99) && grab("mean", &s->mean) && grab("min", &s->min) &&
         grab("max", &s->max);
}

std::vector<int64_t> ParseShape(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

int Die(const std::string& what) {
  std::cerr << "opd_client_bench: " << what << "\n";
  std::cout << "{\"benchmark\": \"opd_client_bench\", \"error\": " << Quote(what) << "}" << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> f = {{"device", "0"}, {"op", kQuant},      {"shape", "1,64"},
                                          {"iters", "2000"}, {"warmup", "200"}, {"ref-tool", "auto"}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cerr << "usage: opd_client_bench [--device N] [--address A | --spawn-daemon PATH|auto] "
                   "[--ref-tool PATH|auto|none] [--op OP] [--shape 1,64] [--iters N] [--warmup N] "
                   "[--transport ring|grpc]\n";
      return 0;
    }
    if (a.rfind("--", 0) != 0 || i + 1 >= argc) return Die("bad argument " + a);
    f[a.substr(2)] = argv[++i];
  }
  const int device = std::stoi(f["device"]);
  const std::string op = f["op"];
  const std::vector<int64_t> shape = ParseShape(f["shape"]);
  const int iters = std::max(1, std::stoi(f["iters"]));
  const int warmup = std::max(0, std::stoi(f["warmup"]));

  if (cudaSetDevice(device) != cudaSuccess) return Die("no CUDA device " + f["device"]);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  std::string uuid;
  (void)DeviceUuid(device, &uuid);

  std::unique_ptr<DaemonProcess> daemon;
  std::string address = f.count("address") ? f["address"] : "";
  if (f.count("spawn-daemon")) {
    DaemonProcess::Options o;
    o.binary = f["spawn-daemon"] == "auto" ? FindDaemonBinary() : f["spawn-daemon"];
    o.device = device;
    if (o.binary.empty()) return Die("--spawn-daemon auto: the daemon binary is not built");
    Status s = DaemonProcess::Start(o, &daemon);
    if (!s.ok()) return Die("starting the daemon: " + s.ToString());
    address = daemon->socket_path();
  }

  // In-process reference first (its own process; the GPU is otherwise idle).
  std::string ref_tool = f["ref-tool"] == "auto" ? FindRefTool() : (f["ref-tool"] == "none" ? "" : f["ref-tool"]);
  LatencySummary in_host, in_sync;
  std::string in_error;
  if (ref_tool.empty()) {
    in_error = f["ref-tool"] == "none" ? "skipped (--ref-tool none)" : "opd_ref_tool not built";
  } else {
    TempDir dir;
    std::unique_ptr<Child> child;
    Status s = Child::Spawn({ref_tool, "bench", "--op", op, "--shape", f["shape"], "--iters", f["iters"], "--warmup",
                             f["warmup"], "--device", f["device"]},
                            dir.path() + "/ref_bench.log", &child);
    int st = 0;
    if (s.ok() && child->Wait(std::chrono::milliseconds(600000), &st) && WIFEXITED(st) && WEXITSTATUS(st) == 0) {
      std::string json;
      std::istringstream is(child->Log());
      for (std::string line; std::getline(is, line);) {
        if (!line.empty() && line[0] == '{') json = line;
      }
      if (!ParseSummary(json, "host_us", &in_host) || !ParseSummary(json, "sync_us", &in_sync)) {
        in_error = "cannot parse opd_ref_tool output: " + json;
      }
    } else {
      in_error = "opd_ref_tool bench failed: " + (child ? child->LogTail(20) : s.ToString());
    }
  }

  ClientOptions o;
  o.device = device;
  o.address = address;
  o.lanes = 1;
  o.client_name = "opd_client_bench";
  const std::string transport = f.count("transport") ? f["transport"] : "ring";
  if (transport != "ring" && transport != "grpc") return Die("--transport must be ring or grpc, got " + transport);
  o.use_ring = transport == "ring";
  std::unique_ptr<Client> client;
  Status s = Client::Connect(o, &client);
  if (!s.ok()) return Die("connecting: " + s.ToString());

  std::vector<HostTensor> ins, outs;
  s = BenchInputs(op, shape, 1234, &ins);
  if (s.ok()) s = OutputsFor(op, ins, &outs);
  if (!s.ok()) return Die(s.ToString());
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  std::vector<client::Arg> args;
  for (auto* group : {&ins, &outs}) {
    for (const HostTensor& t : *group) {
      bufs.push_back(std::make_unique<DeviceBuffer>(t.storage.size() + 256));
      if (!bufs.back()->ok()) return Die("cudaMalloc failed");
      cudaMemcpy(bufs.back()->data(), t.storage.data(), t.storage.size(), cudaMemcpyHostToDevice);
      args.push_back(TensorView{bufs.back()->data() + t.byte_offset, t.sizes, t.strides, t.dtype});
    }
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  PreparedCall call;
  s = client->Prepare(op, "out", args, &call);
  if (!s.ok()) return Die("Prepare: " + s.ToString());
  using C = std::chrono::steady_clock;
  auto us = [](C::time_point a, C::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
  for (int i = 0; i < warmup; ++i) {
    s = client->CallPrepared(call, stream);
    if (!s.ok()) return Die("warm-up call: " + s.ToString());
  }
  cudaStreamSynchronize(stream);
  std::vector<double> host, sync, full;
  for (int i = 0; i < iters; ++i) {
    auto t0 = C::now();
    s = client->CallPrepared(call, stream);
    auto t1 = C::now();
    if (!s.ok()) return Die("call: " + s.ToString());
    host.push_back(us(t0, t1));
  }
  cudaStreamSynchronize(stream);
  for (int i = 0; i < iters; ++i) {
    auto t0 = C::now();
    s = client->CallPrepared(call, stream);
    cudaStreamSynchronize(stream);
    auto t1 = C::now();
    if (!s.ok()) return Die("call: " + s.ToString());
    sync.push_back(us(t0, t1));
  }
  for (int i = 0; i < iters; ++i) {
    auto t0 = C::now();
    s = client->Call(op, "out", args, stream);
    auto t1 = C::now();
    if (!s.ok()) return Die("call: " + s.ToString());
    full.push_back(us(t0, t1));
  }
  cudaStreamSynchronize(stream);

  cache_dit_opd::v1::VersionReply version;
  (void)client->GetVersion(&version);
  const LatencySummary r_host = Summarize(host), r_sync = Summarize(sync), r_full = Summarize(full);
  std::ostringstream out;
  out.precision(3);
  out << std::fixed;
  out << "{\"benchmark\": \"opd_client_bench\", \"transport\": " << Quote(client->session_info().transport)
      << ", \"op\": " << Quote(op + ".out") << ", \"shape\": "
      << Quote(DimsString(shape)) << ", \"iters\": " << iters << ", \"warmup\": " << warmup
      << ", \"gpu\": {\"name\": " << Quote(prop.name) << ", \"uuid\": " << Quote(uuid) << "}"
      << ", \"daemon\": {\"target\": " << Quote(client->session_info().target)
      << ", \"version\": " << Quote(version.daemon_version()) << ", \"git_commit\": " << Quote(version.git_commit())
      << ", \"spawned\": " << (daemon ? "true" : "false") << "}"
      << ", \"remote\": {\"prepared_host_us\": " << Json(r_host) << ", \"prepared_sync_us\": " << Json(r_sync)
      << ", \"call_host_us\": " << Json(r_full) << "}";
  if (in_error.empty()) {
    out << ", \"in_process\": {\"host_us\": " << Json(in_host) << ", \"sync_us\": " << Json(in_sync) << "}"
        << ", \"overhead_us\": {\"host_p50\": " << r_host.p50 - in_host.p50 << ", \"host_p99\": "
        << r_host.p99 - in_host.p99 << ", \"sync_p50\": " << r_sync.p50 - in_sync.p50
        << ", \"sync_p99\": " << r_sync.p99 - in_sync.p99 << "}";
  } else {
    out << ", \"in_process\": null, \"in_process_error\": " << Quote(in_error);
  }
  out << "}";
  std::cout << out.str() << std::endl;
  cudaStreamDestroy(stream);
  return 0;
}
