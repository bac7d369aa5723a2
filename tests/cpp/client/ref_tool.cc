// opd_ref_tool: the in-process side of the client's GPU tests and latency
// benchmark. It loads the kernel library into this process (like
// torch.ops.load_library) and calls ops through the c10 dispatcher. It lives
// in its own process because a TORCH_LIBRARY namespace can be defined once
// per process and the client side must not see torch at all.
//
//   opd_ref_tool run   --library LIB --in CALLS --out RESULTS [--device N]
//       Runs every call of CALLS (a call file, support/call_file.h) as the
//       functional op (or the named overload) and writes each call's outputs
//       (or its error message) to RESULTS. Exit 0 when every call ran or was
//       rejected by the op's own checks; 2 on any other failure.
//   opd_ref_tool bench --library LIB --op OP --shape 1,64 [--iters N] [--warmup W] [--device N]
//       Times the in-process boxed call of OP.out on inputs from
//       support/op_cases.h; prints JSON on stdout.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/torch/scalar_type.h"
#include "tests/cpp/client/support/call_file.h"
#include "tests/cpp/client/support/latency.h"
#include "tests/cpp/client/support/op_cases.h"

using namespace cache_dit_opd;
using namespace cache_dit_opd::testing;

namespace {

at::ScalarType ToScalar(DType d) {
  if (auto s = ToScalarType(d)) return *s;
  throw std::runtime_error("unsupported dtype " + DTypeName(d));
}

DType FromScalar(at::ScalarType s) {
  if (auto d = ToWireDType(s)) return *d;
  throw std::runtime_error(std::string("unsupported scalar type ") + c10::toString(s));
}

at::Tensor ToDevice(const HostTensor& t, int device) {
  const int64_t item = t.itemsize();
  if (item == 0 || t.storage.size() % item != 0 || t.byte_offset % item != 0) {
    throw std::runtime_error("tensor storage is not a whole number of elements");
  }
  at::Tensor bytes = at::empty({static_cast<int64_t>(t.storage.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), t.storage.data(), t.storage.size());
  at::Tensor dev = bytes.to(at::Device(at::kCUDA, device)).view(ToScalar(t.dtype));
  return dev.as_strided(t.sizes, t.strides, static_cast<int64_t>(t.byte_offset) / item);
}

HostTensor ToHost(const at::Tensor& t) {
  at::Tensor c = t.contiguous().cpu();
  HostTensor h;
  h.dtype = FromScalar(c.scalar_type());
  h.sizes = c.sizes().vec();
  h.strides = c.strides().vec();
  h.storage.resize(static_cast<size_t>(c.numel() * c.element_size()));
  if (!h.storage.empty()) std::memcpy(h.storage.data(), c.data_ptr(), h.storage.size());
  return h;
}

void CollectTensors(const c10::IValue& v, std::vector<at::Tensor>* out) {
  if (v.isTensor()) {
    out->push_back(v.toTensor());
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) CollectTensors(e, out);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) out->push_back(t);
  }
}

std::map<std::string, std::string> ParseFlags(int argc, char** argv, int first) {
  std::map<std::string, std::string> f;
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) throw std::runtime_error("unexpected argument " + a);
    auto eq = a.find('=');
    if (eq != std::string::npos) {
      f[a.substr(2, eq - 2)] = a.substr(eq + 1);
    } else if (i + 1 < argc) {
      f[a.substr(2)] = argv[++i];
    } else {
      throw std::runtime_error("flag " + a + " needs a value");
    }
  }
  return f;
}

void LoadLibrary(const std::string& path) {
  if (path.empty()) throw std::runtime_error("--library is required (path of libcache_dit_cuda_ops.so)");
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    throw std::runtime_error(std::string("dlopen ") + path + ": " + dlerror());
  }
}

int Run(std::map<std::string, std::string>& f) {
  LoadLibrary(f["library"]);
  const int device = f.count("device") ? std::stoi(f["device"]) : 0;
  c10::cuda::CUDAGuard guard(device);
  CallFile in;
  Status s = ReadCallFile(f["in"], &in);
  if (!s.ok()) throw std::runtime_error(s.ToString());
  CallFile out;
  for (const CallRecord& call : in.calls) {
    CallRecord r;
    r.op = call.op;
    r.overload = call.overload;
    r.label = call.label;
    const std::string name = "cache_dit_cuda_ops::" + call.op;
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), call.overload.c_str());
    std::vector<c10::IValue> stack;
    for (const HostTensor& t : call.tensors) stack.emplace_back(ToDevice(t, device));
    try {
      handle.callBoxed(stack);
      std::vector<at::Tensor> outs;
      for (const auto& v : stack) CollectTensors(v, &outs);
      for (const at::Tensor& t : outs) {
        if (!t.is_contiguous()) r.label += " [functional output was not contiguous]";
        r.tensors.push_back(ToHost(t));
      }
    } catch (const c10::Error& e) {
      r.error = e.what_without_backtrace();
      if (r.error.empty()) r.error = "rejected";
    }
    out.calls.push_back(std::move(r));
  }
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(err));
  s = WriteCallFile(f["out"], out);
  if (!s.ok()) throw std::runtime_error(s.ToString());
  return 0;
}


std::vector<int64_t> ParseShape(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

int Bench(std::map<std::string, std::string>& f) {
  LoadLibrary(f["library"]);
  const int device = f.count("device") ? std::stoi(f["device"]) : 0;
  const std::string op = f.count("op") ? f["op"] : kQuant;
  const std::vector<int64_t> shape = ParseShape(f.count("shape") ? f["shape"] : "1,64");
  const int iters = f.count("iters") ? std::stoi(f["iters"]) : 2000;
  const int warmup = f.count("warmup") ? std::stoi(f["warmup"]) : 200;
  c10::cuda::CUDAGuard guard(device);
  std::vector<HostTensor> ins, outs;
  Status s = BenchInputs(op, shape, 1234, &ins);
  if (s.ok()) s = OutputsFor(op, ins, &outs);
  if (!s.ok()) throw std::runtime_error(s.ToString());
  std::vector<at::Tensor> args;
  for (const auto& t : ins) args.push_back(ToDevice(t, device));
  for (const auto& t : outs) args.push_back(ToDevice(t, device));
  const std::string name = "cache_dit_cuda_ops::" + op;
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "out");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  auto call = [&] {
    std::vector<c10::IValue> stack(args.begin(), args.end());
    handle.callBoxed(stack);
  };
  for (int i = 0; i < warmup; ++i) call();
  cudaStreamSynchronize(stream);
  using C = std::chrono::steady_clock;
  std::vector<double> host, sync;
  host.reserve(iters);
  sync.reserve(iters);
  for (int i = 0; i < iters; ++i) {
    auto t0 = C::now();
    call();
    auto t1 = C::now();
    host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  cudaStreamSynchronize(stream);
  for (int i = 0; i < iters; ++i) {
    auto t0 = C::now();
    call();
    cudaStreamSynchronize(stream);
    auto t1 = C::now();
    sync.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::cout << "{\"op\": \"" << op << ".out\", \"shape\": \"" << DimsString(shape) << "\", \"iters\": " << iters
            << ", \"warmup\": " << warmup << ", \"host_us\": " << Json(Summarize(host))
            << ", \"sync_us\": " << Json(Summarize(sync)) << "}" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || (std::string(argv[1]) != "run" && std::string(argv[1]) != "bench")) {
    std::fprintf(stderr,
                 "usage: opd_ref_tool run --library LIB --in CALLS --out RESULTS [--device N]\n"
                 "       opd_ref_tool bench --library LIB --op OP --shape 1,64 [--iters N] [--warmup W]\n");
    return 2;
  }
  try {
    auto flags = ParseFlags(argc, argv, 2);
#ifdef OPD_KERNEL_LIBRARY
    if (!flags.count("library")) flags["library"] = OPD_KERNEL_LIBRARY;
#endif
    return std::string(argv[1]) == "run" ? Run(flags) : Bench(flags);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "opd_ref_tool: %s\n", e.what());
    return 2;
  }
}
