// dispatch_fuzz: the daemon's schema-driven argument decoder and its bounds
// checks (server/dispatch/torch_call_runner.h TorchCallRunner::Prepare, with
// common/view_extent.h), on calls as the transports deliver them. Torch
// side: no gRPC, protobuf or spdlog header here.
//
// The ops are the kernel library's schemas (kernels/ops.def, defined here
// without their kernels: no CUDA code is built) plus test ops covering every
// schema type the decoder handles or refuses. Every op's Meta kernel is a
// recorder that checks what it receives.
//
// Input: byte 0: bit 0 picks the runner (meta tensors, or CUDA tensors
// wrapped around the region's "device pointer", never dereferenced: no GPU
// is needed), bits 1-7 the number of regions (0-4); then per region 8 bytes
// of size (below 2^47, as the driver reports allocations) and a byte of base
// misalignment (low 4 bits) and device (bit 4); then one ring record
// (common/ring_decode.h) naming its op by index into TorchCallRunner::ListOps().
//
// Checks:
//   - Prepare either refuses with a Status whose reason is one of the
//     dispatcher's (BAD_ARGUMENT, REGION_UNKNOWN, UNSUPPORTED, OP_UNKNOWN;
//     never INTERNAL) or accepts a call in which every tensor view lies in
//     its region: offset + (1 + sum (size_i - 1) * stride_i) * itemsize <=
//     region size, computed here in 128-bit arithmetic; aligned to its
//     element; written views (Tensor(a!)) contiguous; views without a region
//     empty at offset 0; in CUDA mode all in regions of one device; the
//     call's region list is each used region once;
//   - the op then receives exactly the call's values (Validate runs the
//     recorder): every tensor with the call's sizes, strides and dtype, at
//     base + offset, every scalar and list as sent, None where sent; on
//     meta, Run calls the op once more exactly when a written tensor has an
//     element (a call that writes nothing launches nothing).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "common/ring_decode.h"
#include "common/ring_encode.h"
#include "common/torch/scalar_type.h"
#include "common/view_extent.h"
#include "kernels/ops.def"
#include "server/dispatch/torch_call_runner.h"
#include "tests/fuzz/fuzz_util.h"

namespace cache_dit_opd {
namespace {

constexpr char kNs[] = "cache_dit_cuda_ops::";

struct FuzzRegions final : RegionResolver {
  std::map<uint64_t, MappedRegion> regions;
  Status Resolve(uint64_t id, MappedRegion* out) const override {
    auto it = regions.find(id);
    if (it == regions.end()) return Status::Rejected(Reason::kRegionUnknown, "region ", id, " is not registered");
    *out = it->second;
    return Status::Ok();
  }
};

// What the recorder compares against: the call being validated.
struct Current {
  const CallRequest* call = nullptr;
  const FuzzRegions* regions = nullptr;
  bool cuda = false;
  int device = 0;  // the device of the call's tensors (CUDA mode)
  int recorded = 0;
};
Current& Now() {
  static Current current;
  return current;
}

const c10::Type& Unwrapped(const c10::Type& type) {
  if (type.kind() == c10::TypeKind::OptionalType) {
    return *type.expectRef<c10::OptionalType>().getElementType();
  }
  return type;
}

void CheckReceived(const c10::Argument& param, const c10::IValue& v, const Arg& arg) {
  const Current& now = Now();
  const c10::Type& type = Unwrapped(*param.real_type());
  const std::string& name = param.name();
  if (std::holds_alternative<NoneArg>(arg)) {
    OPD_FUZZ_CHECK(v.isNone(), name, ": None sent, ", v.tagKind(), " received");
  } else if (const auto* ref = std::get_if<TensorRef>(&arg)) {
    OPD_FUZZ_CHECK(v.isTensor(), name, ": a tensor sent, ", v.tagKind(), " received");
    const at::Tensor& t = v.toTensor();
    OPD_FUZZ_CHECK(t.sizes().vec() == ref->sizes && t.strides().vec() == ref->strides, name,
                   ": the op sees another view");
    OPD_FUZZ_CHECK(t.scalar_type() == *ToScalarType(ref->dtype), name, ": dtype");
    if (!now.cuda) {
      OPD_FUZZ_CHECK(t.is_meta(), name, ": not a meta tensor");
    } else {
      OPD_FUZZ_CHECK(t.is_cuda() && t.device().index() == now.device, name, ": on ", t.device().str());
      if (ref->region_id == kNoRegion) {
        OPD_FUZZ_CHECK(t.data_ptr() == nullptr, name, ": an empty view with storage");
      } else if (!HasNoElements(ref->sizes)) {  // torch reports no data pointer for an empty tensor
        const MappedRegion& r = now.regions->regions.at(ref->region_id);
        OPD_FUZZ_CHECK(t.data_ptr() == static_cast<char*>(r.base) + ref->byte_offset, name,
                       ": data pointer is not region base + offset");
      }
    }
  } else if (const auto* i = std::get_if<int64_t>(&arg)) {
    OPD_FUZZ_CHECK(v.isInt(), name, ": int sent, ", v.tagKind(), " received");
    if (type.kind() == c10::TypeKind::ScalarTypeType) {
      const auto st = ToScalarType(static_cast<DType>(static_cast<int32_t>(*i)));
      OPD_FUZZ_CHECK(st && v.toInt() == static_cast<int64_t>(*st), name, ": dtype value ", *i);
    } else {
      OPD_FUZZ_CHECK(v.toInt() == *i, name, ": int");
    }
  } else if (const auto* d = std::get_if<double>(&arg)) {
    OPD_FUZZ_CHECK(v.isDouble() && fuzz::Bits(v.toDouble()) == fuzz::Bits(*d), name, ": float");
  } else if (const auto* b = std::get_if<bool>(&arg)) {
    OPD_FUZZ_CHECK(v.isBool() && v.toBool() == *b, name, ": bool");
  } else if (const auto* il = std::get_if<std::vector<int64_t>>(&arg)) {
    OPD_FUZZ_CHECK(v.isIntList() && v.toIntVector() == *il, name, ": int list");
  } else if (const auto* fl = std::get_if<std::vector<double>>(&arg)) {
    OPD_FUZZ_CHECK(v.isDoubleList(), name, ": float list");
    const std::vector<double> got = v.toDoubleVector();
    OPD_FUZZ_CHECK(got.size() == fl->size(), name, ": float list length");
    for (size_t k = 0; k < got.size(); ++k) OPD_FUZZ_CHECK(fuzz::Bits(got[k]) == fuzz::Bits((*fl)[k]), name);
  } else if (const auto* bl = std::get_if<std::vector<bool>>(&arg)) {
    OPD_FUZZ_CHECK(v.isBoolList(), name, ": bool list");
    const c10::List<bool> got = v.toBoolList();
    OPD_FUZZ_CHECK(got.size() == bl->size(), name, ": bool list length");
    for (size_t k = 0; k < got.size(); ++k) OPD_FUZZ_CHECK(got.get(k) == (*bl)[k], name);
  }
}

// Every op's Meta kernel: what the op would run with, compared with the call.
void Recorder(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Current& now = Now();
  const auto& params = op.schema().arguments();
  OPD_FUZZ_CHECK(now.call != nullptr && now.call->args.size() == params.size() && stack->size() >= params.size(),
                 op.schema().name(), ": called with ", stack->size(), " values for ", params.size(), " parameters");
  const size_t base = stack->size() - params.size();
  for (size_t i = 0; i < params.size(); ++i) CheckReceived(params[i], (*stack)[base + i], now.call->args[i]);
  ++now.recorded;
  torch::jit::drop(*stack, params.size());
  for (size_t i = 0; i < op.schema().returns().size(); ++i) stack->emplace_back();  // never read
}

}  // namespace
}  // namespace cache_dit_opd

// The kernel library's schemas, without its kernels; test ops for the
// schema types the real ops do not use (as tests/cpp/dispatch does).
#define OPD_FUZZ_DEF(name, overload, schema, entry) m.def(#name overload schema);
#define OPD_FUZZ_META(name, overload, schema, entry) \
  m.impl(#name overload, torch::CppFunction::makeFromBoxedFunction<&cache_dit_opd::Recorder>());
TORCH_LIBRARY_FRAGMENT(cache_dit_cuda_ops, m) {
  CACHE_DIT_OPS_ATTN(OPD_FUZZ_DEF)
  CACHE_DIT_OPS_COMM(OPD_FUZZ_DEF)
  CACHE_DIT_OPS_SVDQ(OPD_FUZZ_DEF)
  m.def(
      "_opd_fuzz_types(Tensor x, Tensor? maybe, int n, SymInt s, float f, bool b, int[] ints, "
      "SymInt[] syms, float[] floats, bool[] bools, int? oi, float? of, int[]? ol, "
      "ScalarType? dt, int[2] pair, *, Tensor(a!) out) -> ()");
  m.def("_opd_fuzz_two_out(Tensor x, Tensor? y, *, Tensor(a!) a, Tensor(b!) b) -> (Tensor(a!), Tensor(b!))");
  m.def("_opd_fuzz_layout(Tensor x, Layout? layout) -> ()");
  m.def("_opd_fuzz_tensor_list(Tensor[] xs) -> ()");
}
TORCH_LIBRARY_IMPL(cache_dit_cuda_ops, Meta, m) {
  CACHE_DIT_OPS_ATTN(OPD_FUZZ_META)
  CACHE_DIT_OPS_COMM(OPD_FUZZ_META)
  CACHE_DIT_OPS_SVDQ(OPD_FUZZ_META)
  m.impl("_opd_fuzz_types", torch::CppFunction::makeFromBoxedFunction<&cache_dit_opd::Recorder>());
  m.impl("_opd_fuzz_two_out", torch::CppFunction::makeFromBoxedFunction<&cache_dit_opd::Recorder>());
}

namespace cache_dit_opd {
namespace {

using u128 = unsigned __int128;

// The daemon's catalog (every registered op) and two names it does not
// have: the gRPC Call names ops by string, so the dispatcher meets unknown
// ones there.
const std::vector<OpInfo>& Catalog() {
  static const auto* catalog = [] {
    auto* ops = new std::vector<OpInfo>(TorchCallRunner::ListOps());
    ops->push_back({"_opd_fuzz_no_such_op", "out", ""});
    ops->push_back({"fp8_comm_per_token_quant", "no_such_overload", ""});
    return ops;
  }();
  return *catalog;
}

size_t IndexOf(const std::string& name, const std::string& overload) {
  for (size_t i = 0; i < Catalog().size(); ++i) {
    if (Catalog()[i].name == name && Catalog()[i].overload == overload) return i;
  }
  OPD_FUZZ_CHECK(false, "no op ", name, ".", overload);
}

TorchCallRunner& Runner(bool cuda) {
  static TorchCallRunner on_meta(TorchCallRunner::Device::kMeta);
  static TorchCallRunner on_cuda(TorchCallRunner::Device::kCuda, /*cuda_device=*/0);
  return cuda ? on_cuda : on_meta;
}

// The bounds oracle for one view the runner accepted, in 128-bit arithmetic
// (no term of it can wrap: sizes and strides are below 2^63, at most 8 dims).
void CheckAcceptedView(const std::string& where, const TensorRef& t, const FuzzRegions& regions, bool written,
                       std::vector<uint64_t>* used, int* device) {
  const auto item = static_cast<u128>(DTypeSize(t.dtype));
  OPD_FUZZ_CHECK(item > 0, where, ": accepted with dtype ", static_cast<int>(t.dtype));
  OPD_FUZZ_CHECK(t.sizes.size() == t.strides.size() && t.sizes.size() <= static_cast<size_t>(kMaxTensorDims), where);
  bool empty = false;
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    OPD_FUZZ_CHECK(t.sizes[i] >= 0 && t.strides[i] >= 0, where, ": a negative size or stride was accepted");
    empty = empty || t.sizes[i] == 0;
  }
  if (t.region_id == kNoRegion) {
    OPD_FUZZ_CHECK(empty && t.byte_offset == 0, where, ": a view without a region has an element or an offset");
    return;
  }
  auto it = regions.regions.find(t.region_id);
  OPD_FUZZ_CHECK(it != regions.regions.end(), where, ": accepted in unknown region ", t.region_id);
  const MappedRegion& r = it->second;
  if (std::find(used->begin(), used->end(), t.region_id) == used->end()) used->push_back(t.region_id);
  if (device != nullptr) {  // CUDA mode: one device per call
    if (*device < 0) *device = r.device;
    OPD_FUZZ_CHECK(*device == r.device, where, ": regions of devices ", *device, " and ", r.device, " in one call");
  }
  OPD_FUZZ_CHECK(t.byte_offset <= r.size, where, ": offset ", t.byte_offset, " past region size ", r.size);
  OPD_FUZZ_CHECK(static_cast<u128>(t.byte_offset) % item == 0 &&
                     static_cast<u128>(reinterpret_cast<uintptr_t>(r.base) + t.byte_offset) % item == 0,
                 where, ": misaligned view accepted");
  if (empty) return;
  u128 last = 0;
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    last += static_cast<u128>(t.sizes[i] - 1) * static_cast<u128>(t.strides[i]);
  }
  const u128 end = static_cast<u128>(t.byte_offset) + (last + 1) * item;
  OPD_FUZZ_CHECK(end <= static_cast<u128>(r.size), where, ": view ends at byte ",
                 static_cast<double>(end), " past region ", t.region_id, " of ", r.size, " bytes");
  if (written) {
    u128 expected = 1;
    for (size_t i = t.sizes.size(); i-- > 0;) {
      if (t.sizes[i] == 1) continue;
      OPD_FUZZ_CHECK(static_cast<u128>(t.strides[i]) == expected, where, ": a written view is not contiguous");
      expected *= static_cast<u128>(t.sizes[i]);
    }
  }
}

void CheckCall(const CallRequest& call, const FuzzRegions& regions, bool cuda) {
  std::unique_ptr<PreparedCall> prepared;
  const Status s = Runner(cuda).Prepare(call, regions, &prepared);
  fuzz::Log(cuda ? "cuda " : "meta ", call.op, ".", call.overload, " (", call.args.size(), " arguments, ",
            regions.regions.size(), " regions): ", s.ToString());
  if (!s.ok()) {
    const Reason r = s.reason();
    OPD_FUZZ_CHECK(r == Reason::kBadArgument || r == Reason::kRegionUnknown || r == Reason::kUnsupported ||
                       r == Reason::kOpUnknown,
                   "Prepare refused with an unexpected reason: ", s.ToString());
    OPD_FUZZ_CHECK(s.code() == ReasonCode(r), s.ToString());
    return;
  }
  OPD_FUZZ_CHECK(prepared != nullptr);
  const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({kNs + call.op, call.overload});
  OPD_FUZZ_CHECK(op.has_value(), "accepted an op the dispatcher does not have: ", call.op);
  const auto& params = op->schema().arguments();
  OPD_FUZZ_CHECK(params.size() == call.args.size());
  std::vector<uint64_t> used;
  int device = -1;
  bool writes_elements = false;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto* t = std::get_if<TensorRef>(&call.args[i]);
    if (t == nullptr) continue;
    const bool written = params[i].alias_info() != nullptr && params[i].alias_info()->isWrite();
    CheckAcceptedView(call.op + " argument " + params[i].name(), *t, regions, written, &used,
                      cuda ? &device : nullptr);
    writes_elements = writes_elements || (written && !HasNoElements(t->sizes));
  }
  OPD_FUZZ_CHECK(prepared->regions() == used, "the call's region list is not its regions, each once");

  Current& now = Now();
  now = Current{&call, &regions, cuda, device < 0 ? 0 : device, 0};
  const Status v = Runner(cuda).Validate(*prepared);
  OPD_FUZZ_CHECK(v.ok(), "Validate: ", v.ToString());
  OPD_FUZZ_CHECK(now.recorded == 1, "the op's Meta kernel ran ", now.recorded, " times");
  if (!cuda) {
    // On meta, Run calls the op (its Meta kernel again) unless no written
    // tensor has an element: then it launches nothing (torch_call_runner.h).
    bool sticky = false;
    const Status r = Runner(cuda).Run(*prepared, nullptr, &sticky);
    OPD_FUZZ_CHECK(r.ok() && !sticky, "Run: ", r.ToString());
    OPD_FUZZ_CHECK(now.recorded == (writes_elements ? 2 : 1), "Run called the op ", now.recorded - 1,
                   " times; it writes ", writes_elements ? "elements" : "nothing");
  }
  now.call = nullptr;
}

void CheckInput(const uint8_t* data, size_t size) {
  if (size < 1) return;
  const bool cuda = data[0] & 1;
  const unsigned count = (data[0] >> 1) % 5;
  size_t at = 1;
  FuzzRegions regions;
  for (unsigned i = 0; i < count; ++i) {
    if (size - at < 9) return;
    uint64_t bytes;
    std::memcpy(&bytes, data + at, 8);
    const uint8_t b = data[at + 8];
    at += 9;
    const uintptr_t base = 0x100000000000ull + uintptr_t{i} * 0x10000000000ull + (b & 15);
    regions.regions[i + 1] = MappedRegion{reinterpret_cast<void*>(base), bytes & ((uint64_t{1} << 47) - 1),
                                          (b >> 4) & 1};
  }
  CallRequest call;
  RecordIds ids;
  if (Status s = DecodeRecord(data + at, size - at, Catalog(), &call, &ids); !s.ok()) {
    fuzz::Log("record: ", s.ToString());
    return;
  }
  CheckCall(call, regions, cuda);
}

// Regions 1 (1 MiB) and 2 (4 KiB), then the record.
std::string SeedInput(bool cuda, size_t op_index, const std::vector<Arg>& args) {
  client::RecordArgs enc;
  if (!enc.AssignCall(args)) return "";
  std::string out(1, static_cast<char>((cuda ? 1 : 0) | (2 << 1)));
  fuzz::Append(&out, uint64_t{1} << 20);
  out.push_back('\0');
  fuzz::Append(&out, uint64_t{4096});
  out.push_back('\0');
  return out + fuzz::MakeRecord(enc, fuzz::RecordFields{0, 1, 0, static_cast<uint32_t>(op_index), 0});
}

// One plausible call per op: every tensor a small contiguous view in
// region 1 or 2, every scalar a small value, chosen from the op's schema.
std::string SeedFor(size_t op_index, bool cuda) {
  const OpInfo& info = Catalog()[op_index];
  const auto op = c10::Dispatcher::singleton().findSchema({kNs + info.name, info.overload});
  if (!op) return SeedInput(cuda, op_index, {});
  std::vector<Arg> args;
  uint64_t offset = 0;
  for (const c10::Argument& p : op->schema().arguments()) {
    const c10::Type& type = Unwrapped(*p.real_type());
    switch (type.kind()) {
      case c10::TypeKind::TensorType:
        args.emplace_back(TensorRef{1 + args.size() % 2, offset, {4, 8}, {8, 1}, DType::kBFloat16});
        offset += 64;
        break;
      case c10::TypeKind::IntType:
      case c10::TypeKind::SymIntType: args.emplace_back(int64_t{1}); break;
      case c10::TypeKind::ScalarTypeType: args.emplace_back(static_cast<int64_t>(DType::kFloat16)); break;
      case c10::TypeKind::FloatType: args.emplace_back(0.5); break;
      case c10::TypeKind::BoolType: args.emplace_back(true); break;
      case c10::TypeKind::ListType: {
        const size_t n = p.N() ? static_cast<size_t>(*p.N()) : 2;
        switch (type.expectRef<c10::ListType>().getElementType()->kind()) {
          case c10::TypeKind::FloatType: args.emplace_back(std::vector<double>(n, 1.0)); break;
          case c10::TypeKind::BoolType: args.emplace_back(std::vector<bool>(n, true)); break;
          default: args.emplace_back(std::vector<int64_t>(n, 3)); break;
        }
        break;
      }
      default: args.emplace_back(NoneArg{}); break;
    }
  }
  return SeedInput(cuda, op_index, args);
}

// Near misses of the bounds checks, on _opd_fuzz_two_out(x, y?, *, a!, b!).
std::vector<std::string> EdgeSeeds() {
  const size_t op = IndexOf("_opd_fuzz_two_out", "");
  auto call = [&](TensorRef x, Arg y = NoneArg{}, TensorRef a = {1, 4096, {4, 8}, {8, 1}, DType::kFloat32}) {
    return SeedInput(false, op, {std::move(x), std::move(y), std::move(a), TensorRef{2, 0, {16}, {1}, DType::kUInt8}});
  };
  const DType bf16 = DType::kBFloat16;
  return {
      call({1, 0, {2, 2}, {int64_t{1} << 62, 1}, bf16}),               // extent overflows 64 bits
      call({1, (1 << 20) - 16, {2, 5}, {4, 1}, bf16}),                 // one element past the end
      call({1, 1 << 20, {0, 4}, {4, 1}, bf16}),                        // empty, at the region's end
      call({kNoRegion, 0, {2, 0}, {0, 1}, bf16}, TensorRef{kNoRegion, 0, {3}, {1}, bf16}),  // region 0 with elements
      call({1, 1, {2}, {1}, bf16}),                                    // misaligned offset
      call({1, 0, {2, 2}, {1, 1}, bf16}, NoneArg{}, {1, 0, {4, 8}, {1, 4}, DType::kFloat32}),  // written, not contiguous
      call({9, 0, {1}, {1}, bf16}),                                    // unknown region
      call({1, 0, {int64_t{1} << 32, int64_t{1} << 32}, {0, 0}, bf16}),  // numel overflows int64
  };
}

std::vector<std::string> Seeds() {
  std::vector<std::string> out;
  for (size_t i = 0; i < Catalog().size(); ++i) {
    if (std::string s = SeedFor(i, i % 3 == 0); !s.empty()) out.push_back(s);
  }
  for (std::string& s : EdgeSeeds()) out.push_back(std::move(s));
  return out;
}

}  // namespace
}  // namespace cache_dit_opd

OPD_FUZZ_TARGET(cache_dit_opd::Seeds, cache_dit_opd::CheckInput)
