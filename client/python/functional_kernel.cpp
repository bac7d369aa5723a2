#include "client/python/functional_kernel.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/ops.def"
#include "kernels/ops.h"

namespace cache_dit_opd::client {

namespace {

constexpr const char* kNamespace = "cache_dit_cuda_ops";

bool HasElements(const at::Tensor& t) { return t.numel() != 0; }
template <typename... T>
bool HasElements(const std::tuple<T...>& outs) {
  return std::apply([](const auto&... t) { return (HasElements(t) || ...); }, outs);
}

void Push(torch::jit::Stack* stack, const at::Tensor& t) { stack->emplace_back(t); }
template <typename... T>
void Push(torch::jit::Stack* stack, const std::tuple<T...>& outs) {
  std::apply([&](const auto&... t) { (stack->emplace_back(t), ...); }, outs);
}

// The kernel of the functional overload whose Meta kernel is `Meta`: the
// Meta kernel's checks and outputs (it allocates like its arguments, here on
// their CUDA device), then `<op>.out` on them. Boxed, because the .out
// overload's CUDA kernel is boxed anyway.
template <auto Meta>
struct Functional;
template <typename R, typename... A, R (*Meta)(A...)>
struct Functional<Meta> {
  // Set once, before the kernel is registered.
  static inline std::optional<c10::OperatorHandle> out_op;

  static R call(A... args) {
    R outs = Meta(args...);
    if (HasElements(outs)) {
      torch::jit::Stack stack;
      stack.reserve(sizeof...(A) + 3);
      (stack.emplace_back(args), ...);
      Push(&stack, outs);
      out_op->callBoxed(&stack);
    }
    return outs;
  }
};

using Registrar = void (*)(torch::Library* lib, const char* name, const c10::OperatorHandle& out);

template <auto Meta>
void Register(torch::Library* lib, const char* name, const c10::OperatorHandle& out) {
  // Again after an unregistration: the .out overload is the client's own
  // and outlives it, so the handle stays (and no running call sees it move).
  if (!Functional<Meta>::out_op) Functional<Meta>::out_op = out;
  lib->impl(name, TORCH_FN(Functional<Meta>::call));
}

// Only the functional rows of the table get a registrar: overload "" is a
// one-byte literal.
template <auto Meta, bool kFunctional>
constexpr Registrar RegistrarOf() {
  if constexpr (kFunctional) {
    return &Register<Meta>;
  } else {
    return nullptr;
  }
}

struct Row {
  const char* name;
  Registrar reg;
};

#define OPD_FUNCTIONAL_ROW(name, overload, schema, entry) \
  Row{#name, RegistrarOf<&entry##_meta, sizeof(overload) == 1>()},
constexpr Row kRows[] = {CACHE_DIT_OPS_ATTN(OPD_FUNCTIONAL_ROW) CACHE_DIT_OPS_COMM(OPD_FUNCTIONAL_ROW)
                             CACHE_DIT_OPS_SVDQ(OPD_FUNCTIONAL_ROW)};
#undef OPD_FUNCTIONAL_ROW

std::mutex g_mu;
// One Library per op, so that one registration can be taken back alone.
std::map<std::string, std::unique_ptr<torch::Library>> g_libraries;  // guarded by g_mu

}  // namespace

std::string RegisterFunctionalKernel(const std::string& name) {
  const Row* row = nullptr;
  for (const Row& r : kRows) {
    if (r.reg != nullptr && name == r.name) row = &r;
  }
  if (row == nullptr) return name + " is not a functional overload of kernels/ops.def";
  auto& dispatcher = c10::Dispatcher::singleton();
  auto out = dispatcher.findSchema({std::string(kNamespace) + "::" + name, "out"});
  if (!out) return std::string(kNamespace) + "::" + name + ".out is not defined";
  if (!dispatcher.findSchema({std::string(kNamespace) + "::" + name, ""})) {
    return std::string(kNamespace) + "::" + name + " is not defined";
  }
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_libraries.count(name)) return "";
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, kNamespace, c10::DispatchKey::CUDA,
                                              __FILE__, __LINE__);
  row->reg(lib.get(), row->name, *out);
  g_libraries.emplace(name, std::move(lib));
  return "";
}

bool UnregisterFunctionalKernel(const std::string& name) {
  std::unique_ptr<torch::Library> lib;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_libraries.find(name);
    if (it == g_libraries.end()) return false;
    lib = std::move(it->second);
    g_libraries.erase(it);
  }
  lib.reset();  // its registration leaves the dispatcher (outside g_mu: the dispatcher takes its own lock)
  return true;
}

}  // namespace cache_dit_opd::client
