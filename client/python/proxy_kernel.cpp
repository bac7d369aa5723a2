#include "client/python/proxy_kernel.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <shared_mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "client/python/functional_kernel.h"
#include "client/python/native_session.h"
#include "common/torch/scalar_type.h"
#include "common/view_extent.h"

namespace cache_dit_opd::client {

namespace {

constexpr const char* kNamespace = "cache_dit_cuda_ops";

// What the kernel needs of one op besides its schema.
struct OpPlan {
  std::string key;                // "name.overload" as the catalog check names it
  std::vector<size_t> return_of;  // return i is argument return_of[i]
};

std::shared_mutex g_plans_mu;
std::unordered_map<const c10::FunctionSchema*, OpPlan> g_plans;  // guarded by g_plans_mu
std::vector<std::unique_ptr<torch::Library>> g_libraries;        // guarded by g_plans_mu

const OpPlan* PlanOf(const c10::OperatorHandle& op) {
  std::shared_lock lock(g_plans_mu);
  auto it = g_plans.find(&op.schema());
  return it == g_plans.end() ? nullptr : &it->second;
}

// The view's bytes from element [0..0] to one past its last element (the
// span the daemon checks); false for a negative stride or an overflow.
bool ViewBytes(const at::Tensor& t, uint64_t* nbytes) {
  return cache_dit_opd::ViewExtentBytes(std::span<const int64_t>(t.sizes().data(), t.sizes().size()),
                         std::span<const int64_t>(t.strides().data(), t.strides().size()),
                         static_cast<uint64_t>(t.element_size()), nbytes);
}

// Encodes and runs the call natively; false (stack untouched, the reason in
// LastFallback) when it must go to the Python implementation.
bool TryNative(const c10::OperatorHandle& op, const OpPlan& plan, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n);
  int device = -1;
  for (const c10::IValue& a : args) {
    if (a.isTensor() && a.toTensor().is_cuda()) {
      device = a.toTensor().get_device();
      break;
    }
  }
  std::shared_ptr<NativeSession> s = device >= 0 ? ActiveNativeSession(device) : nullptr;
  if (!s || s->engine().pid() != ::getpid()) {
    SetLastFallback(ProxyFallback::kNoSession);
    return false;
  }
  SessionEngine& engine = s->engine();
  auto fallback = [&](ProxyFallback why, Status status = Status()) {
    s->CountFallback(why);
    SetLastFallback(why, std::move(status));
    return false;
  };
  if (engine.failed()) return fallback(ProxyFallback::kFailed, engine.failure());
  if (engine.HasRejected()) return fallback(ProxyFallback::kPendingErrors);
  uint32_t op_index = 0;
  if (!s->OpIndex(plan.key, &op_index)) return fallback(ProxyFallback::kUnknownOp);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    cudaGetLastError();
    return fallback(ProxyFallback::kCapturing);
  }
  if (capture != cudaStreamCaptureStatusNone) return fallback(ProxyFallback::kCapturing);

  RecordArgs record;
  uint64_t regions[kMaxArgs];
  size_t nregions = 0;
  for (const c10::IValue& a : args) {
    bool ok = false;
    if (a.isTensor()) {
      const at::Tensor& t = a.toTensor();
      const auto dtype = ToWireDType(t.scalar_type());
      uint64_t nbytes = 0, region = kNoRegion, offset = 0;
      // Other devices and odd layouts take the Python path, which checks and
      // reports them.
      if (!t.is_cuda() || t.get_device() != device || !dtype || !ViewBytes(t, &nbytes)) {
        return fallback(ProxyFallback::kArgument);
      }
      // An empty tensor names no memory (its data pointer is usually null):
      // it travels as region kNoRegion at offset 0 and pins no region. The
      // daemon decides whether the call has anything to write.
      if (!HasNoElements(std::span<const int64_t>(t.sizes().data(), t.sizes().size()))) {
        if (!engine.FindRegion(t.data_ptr(), nbytes, &region, &offset)) {
          return fallback(ProxyFallback::kRegionMiss);
        }
        regions[nregions++] = region;
      }
      ok = record.AddTensor(region, offset, *dtype, t.dim(), t.sizes().data(), t.strides().data());
    } else if (a.isNone()) {
      ok = record.AddNone();
    } else if (a.isBool()) {
      ok = record.AddBool(a.toBool());
    } else if (a.isInt()) {
      ok = record.AddInt(a.toInt());
    } else if (a.isDouble()) {
      ok = record.AddFloat(a.toDouble());
    }
    if (!ok) return fallback(ProxyFallback::kArgument);
  }

  CallAnswer answer;
  Status st = engine.CallRing(stream, op_index, record, AsyncCallsEnabled(), std::span(regions, nregions),
                              IssueOptions{}, &answer);
  if (!st.ok()) return fallback(ProxyFallback::kBroken, st);
  // A rejected call wrote nothing; Python acts on the daemon's reason (raise,
  // re-register and run again, or reconnect).
  if (answer.code != 0) return fallback(ProxyFallback::kRejected, answer.status());
  s->CountNative();
  std::vector<c10::IValue> results;
  results.reserve(plan.return_of.size());
  for (size_t i : plan.return_of) results.push_back(args[i]);
  torch::jit::drop(*stack, n);
  for (auto& r : results) stack->push_back(std::move(r));
  return true;
}

void ProxyKernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const OpPlan* plan = PlanOf(op);
  if (plan != nullptr && TryNative(op, *plan, stack)) return;
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), stack);
}

}  // namespace

std::string RegisterProxyKernel(const std::string& name_overload) {
  const auto dot = name_overload.find('.');
  const std::string name = name_overload.substr(0, dot);
  const std::string overload = dot == std::string::npos ? "" : name_overload.substr(dot + 1);
  auto handle = c10::Dispatcher::singleton().findSchema({std::string(kNamespace) + "::" + name, overload});
  if (!handle) return std::string(kNamespace) + "::" + name_overload + " is not defined";
  const c10::FunctionSchema& schema = handle->schema();
  if (overload.empty()) return RegisterFunctionalKernel(name);
  OpPlan plan{name_overload, {}};
  for (const c10::Argument& r : schema.returns()) {
    std::optional<size_t> found;
    if (r.alias_info() != nullptr && r.alias_info()->isWrite()) {
      for (size_t i = 0; i < schema.arguments().size(); ++i) {
        const auto* ai = schema.arguments()[i].alias_info();
        if (ai != nullptr && ai->isWrite() && ai->beforeSets() == r.alias_info()->beforeSets()) found = i;
      }
    }
    if (!found) return "return " + r.name() + " of " + name_overload + " does not alias a mutable argument";
    plan.return_of.push_back(*found);
  }
  std::unique_lock lock(g_plans_mu);
  if (g_plans.count(&schema)) return "";
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, kNamespace, c10::DispatchKey::CUDA,
                                              __FILE__, __LINE__);
  lib->impl(name_overload.c_str(), torch::CppFunction::makeFromBoxedFunction<&ProxyKernel>());
  g_plans.emplace(&schema, std::move(plan));
  g_libraries.push_back(std::move(lib));
  return "";
}

}  // namespace cache_dit_opd::client
