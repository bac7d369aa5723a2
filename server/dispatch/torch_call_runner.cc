#include "server/dispatch/torch_call_runner.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/cuda/driver_api.h"
#include "common/torch/scalar_type.h"
#include "common/view_extent.h"

namespace cache_dit_opd {
namespace {

constexpr std::string_view kNamespace = "cache_dit_cuda_ops";

std::string FormatDims(const std::vector<int64_t>& dims) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << ']';
  return os.str();
}

std::string DescribeView(const TensorRef& t) {
  return "sizes " + FormatDims(t.sizes) + ", strides " + FormatDims(t.strides) + ", " +
         DTypeName(t.dtype) + " at byte offset " + std::to_string(t.byte_offset) + " of region " +
         std::to_string(t.region_id);
}


const char* ArgKindName(const Arg& value) {
  static constexpr const char* kNames[] = {"None", "Tensor", "int",     "float",
                                           "bool", "int[]",  "float[]", "bool[]"};
  static_assert(std::size(kNames) == std::variant_size_v<Arg>);
  return kNames[value.index()];
}

std::string Quoted(const std::string& s) { return "'" + s + "'"; }

// The types PrepareCall can build an IValue for from an Arg. Checked before
// any value so that an unsupported Optional fails the same way with or
// without a None.
bool IsSupported(const c10::Type& type) {
  switch (type.kind()) {
    case c10::TypeKind::TensorType:
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:
    case c10::TypeKind::FloatType:
    case c10::TypeKind::BoolType:
    case c10::TypeKind::ScalarTypeType: return true;
    case c10::TypeKind::OptionalType:
      return IsSupported(*type.expectRef<c10::OptionalType>().getElementType());
    case c10::TypeKind::ListType: {
      const c10::TypeKind elem = type.expectRef<c10::ListType>().getElementType()->kind();
      return elem == c10::TypeKind::IntType || elem == c10::TypeKind::SymIntType ||
             elem == c10::TypeKind::FloatType || elem == c10::TypeKind::BoolType;
    }
    default: return false;
  }
}

bool MentionsTensor(const c10::Type& type) {
  if (type.kind() == c10::TypeKind::TensorType) return true;
  for (const c10::TypePtr& contained : type.containedTypes()) {
    if (MentionsTensor(*contained)) return true;
  }
  return false;
}

// What every view must be, with or without a region: rank, dtype, sizes and
// strides >= 0, an element count that fits int64 (in `*numel`).
Status CheckShape(const TensorRef& t, int64_t* numel_out) {
  const size_t dims = t.sizes.size();
  if (dims > static_cast<size_t>(kMaxTensorDims)) {
    return Status::InvalidArgument("has ", dims, " dims, at most ", kMaxTensorDims, " allowed");
  }
  if (t.strides.size() != dims) {
    return Status::InvalidArgument("has ", dims, " sizes but ", t.strides.size(), " strides");
  }
  const int64_t itemsize = DTypeSize(t.dtype);
  if (itemsize <= 0) {
    return Status::InvalidArgument("has unknown dtype ", DTypeName(t.dtype));
  }

  int64_t numel = 1;
  for (size_t i = 0; i < dims; ++i) {
    if (t.sizes[i] < 0) {
      return Status::InvalidArgument("has negative size ", t.sizes[i], " in dim ", i, " (",
                                     DescribeView(t), ")");
    }
    if (t.strides[i] < 0) {
      return Status::InvalidArgument("has negative stride ", t.strides[i], " in dim ", i, " (",
                                     DescribeView(t), ")");
    }
    if (__builtin_mul_overflow(numel, t.sizes[i], &numel)) {
      return Status::InvalidArgument("has an element count that overflows int64 (", DescribeView(t),
                                     ")");
    }
  }
  *numel_out = numel;
  return Status::Ok();
}

// A view in region kNoRegion (wire.h): no memory, so it must have no element
// and no offset.
Status CheckNoRegionView(const TensorRef& t) {
  int64_t numel = 0;
  OPD_RETURN_IF_ERROR(CheckShape(t, &numel));
  if (numel != 0) {
    return Status::InvalidArgument("has sizes ", FormatDims(t.sizes), " (", numel,
                                   " elements) but no region (region id ", kNoRegion,
                                   "): only an empty view, with a size of 0, may be sent without memory");
  }
  if (t.byte_offset != 0) {
    return Status::InvalidArgument("is an empty view without a region (region id ", kNoRegion,
                                   ") but has byte offset ", t.byte_offset, "; it must be 0");
  }
  return Status::Ok();
}

// Every byte the view can address lies in the region. Written views must be
// dense as well: kernels write outputs as if contiguous, so a zero or
// overlapping stride would let a write leave the checked extent.
Status CheckView(const TensorRef& t, const MappedRegion& region, bool written) {
  int64_t numel = 0;
  OPD_RETURN_IF_ERROR(CheckShape(t, &numel));
  if (written && region.read_only) {
    return Status::InvalidArgument("is written by the op, but region ", t.region_id,
                                   " is weight-store memory, which no op may write (", DescribeView(t), ")");
  }
  const int64_t itemsize = DTypeSize(t.dtype);
  if (t.byte_offset > region.size) {
    return Status::InvalidArgument("starts at byte offset ", t.byte_offset,
                                   ", past the end of region ", t.region_id, " (", region.size,
                                   " bytes)");
  }
  const auto item = static_cast<uint64_t>(itemsize);
  if (t.byte_offset % item != 0 ||
      (reinterpret_cast<uintptr_t>(region.base) + t.byte_offset) % item != 0) {
    return Status::InvalidArgument("is not aligned to its ", item, "-byte elements (region base ",
                                   region.base, ", ", DescribeView(t), ")");
  }
  if (numel == 0) return Status::Ok();

  uint64_t end = 0;  // one past the view's last byte, from the region base
  if (!ViewExtentBytes(t.sizes, t.strides, item, &end) || __builtin_add_overflow(end, t.byte_offset, &end)) {
    return Status::InvalidArgument("has an extent that overflows 64-bit byte arithmetic (",
                                   DescribeView(t), ")");
  }
  if (end > region.size) {
    return Status::InvalidArgument("ends at byte ", end, ", past the end of region ", t.region_id,
                                   " (", region.size, " bytes; ", DescribeView(t), ")");
  }

  if (written) {
    int64_t expected = 0;
    if (const int i = FirstNonContiguousDim(t.sizes, t.strides, &expected); i >= 0) {
      return Status::InvalidArgument("is written by the op and must be contiguous, but dim ", i, " has stride ",
                                     t.strides[i], " where ", expected, " is needed (", DescribeView(t), ")");
    }
  }
  return Status::Ok();
}

// Decodes one call's arguments against its schema into a boxed stack.
// `default_device`: the daemon's CUDA ordinal, where the call runs when none
// of its tensors is in a region.
class ArgDecoder {
 public:
  // `wrap` false: resolve and check only (PrepareAgain); the tensors' stack
  // entries stay None.
  ArgDecoder(const std::string& op_name, const RegionResolver& regions, bool meta, int default_device,
             bool wrap = true)
      : op_name_(op_name), regions_(regions), meta_(meta), wrap_(wrap), default_device_(default_device) {}

  Status Decode(const c10::FunctionSchema& schema, const std::vector<Arg>& args,
                std::vector<c10::IValue>* stack) {
    const std::vector<c10::Argument>& params = schema.arguments();
    if (args.size() != params.size()) {
      return Status::InvalidArgument(op_name_, " expects ", params.size(),
                                     " arguments (kwarg-only included), got ", args.size());
    }
    stack->reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const c10::Argument& param = params[i];
      if (!IsSupported(*param.real_type())) {
        return Status::Unimplemented(Where(param), " has schema type ", param.real_type()->str(),
                                     ", which the daemon cannot decode");
      }
      c10::IValue value;
      index_ = i;
      OPD_RETURN_IF_ERROR(DecodeValue(param, *param.real_type(), args[i], &value));
      stack->push_back(std::move(value));
    }
    // Views without a region take the device of the call's other tensors,
    // whatever their order, or the daemon's when it has none.
    if (device_ < 0) device_ = default_device_;
    if (!unplaced_.empty() && (device_ < 0 || device_ > std::numeric_limits<c10::DeviceIndex>::max())) {
      return Status::Internal(op_name_, ": no valid device (", device_, ") for its empty tensors");
    }
    if (wrap_) {
      for (const auto& [index, ref] : unplaced_) (*stack)[index] = WrapView(nullptr, *ref, device_);
    }
    return Status::Ok();
  }

  std::vector<uint64_t> TakeRegions() { return std::move(region_ids_); }
  // The base of each region view's region, in argument order.
  const std::vector<const void*>& bases() const { return bases_; }
  int device() const { return device_; }
  // Whether some tensor the schema marks as written (Tensor(a!)) has an
  // element: false when the call can write nothing.
  bool writes_elements() const { return writes_elements_; }

 private:
  std::string Where(const c10::Argument& param) const {
    return op_name_ + " argument " + Quoted(param.name());
  }

  Status WrongType(const c10::Argument& param, const Arg& value) const {
    if (std::holds_alternative<NoneArg>(value) &&
        param.real_type()->kind() == c10::TypeKind::TensorType) {
      return Status::InvalidArgument(Where(param), " is a required Tensor, got None");
    }
    return Status::InvalidArgument(Where(param), " has schema type ", param.real_type()->str(),
                                   ", got ", ArgKindName(value));
  }

  Status DecodeValue(const c10::Argument& param, const c10::Type& type, const Arg& value,
                     c10::IValue* out) {
    switch (type.kind()) {
      case c10::TypeKind::OptionalType:
        if (std::holds_alternative<NoneArg>(value)) {
          *out = c10::IValue();
          return Status::Ok();
        }
        return DecodeValue(param, *type.expectRef<c10::OptionalType>().getElementType(), value,
                           out);
      case c10::TypeKind::TensorType:
        if (const auto* ref = std::get_if<TensorRef>(&value)) return DecodeTensor(param, *ref, out);
        break;
      case c10::TypeKind::IntType:
      case c10::TypeKind::SymIntType:
        if (const auto* v = std::get_if<int64_t>(&value)) {
          *out = *v;
          return Status::Ok();
        }
        break;
      case c10::TypeKind::FloatType:
        if (const auto* v = std::get_if<double>(&value)) {
          *out = *v;
          return Status::Ok();
        }
        break;
      case c10::TypeKind::BoolType:
        if (const auto* v = std::get_if<bool>(&value)) {
          *out = *v;
          return Status::Ok();
        }
        break;
      case c10::TypeKind::ScalarTypeType:
        // Sent as the wire DType number, the same vocabulary as TensorRef.dtype.
        if (const auto* v = std::get_if<int64_t>(&value)) {
          const std::optional<at::ScalarType> scalar_type =
              *v >= std::numeric_limits<int32_t>::min() && *v <= std::numeric_limits<int32_t>::max()
                  ? ToScalarType(static_cast<DType>(static_cast<int32_t>(*v)))
                  : std::nullopt;
          if (!scalar_type) {
            return Status::InvalidArgument(Where(param), " has unknown dtype value ", *v);
          }
          *out = *scalar_type;
          return Status::Ok();
        }
        break;
      case c10::TypeKind::ListType:
        switch (type.expectRef<c10::ListType>().getElementType()->kind()) {
          case c10::TypeKind::FloatType: return DecodeList<double>(param, value, out);
          case c10::TypeKind::BoolType: return DecodeList<bool>(param, value, out);
          default: return DecodeList<int64_t>(param, value, out);
        }
      default: break;
    }
    return WrongType(param, value);
  }

  template <typename T>
  Status DecodeList(const c10::Argument& param, const Arg& value, c10::IValue* out) const {
    const auto* items = std::get_if<std::vector<T>>(&value);
    if (items == nullptr) return WrongType(param, value);
    if (items->size() > static_cast<size_t>(kMaxListLength)) {
      return Status::InvalidArgument(Where(param), " has ", items->size(), " items, at most ",
                                     kMaxListLength, " allowed");
    }
    if (param.N() && items->size() != static_cast<size_t>(*param.N())) {
      return Status::InvalidArgument(Where(param), " needs exactly ", *param.N(), " items, got ",
                                     items->size());
    }
    c10::List<T> list;
    list.reserve(items->size());
    for (const T item : *items) list.push_back(item);
    *out = std::move(list);
    return Status::Ok();
  }

  Status DecodeTensor(const c10::Argument& param, const TensorRef& ref, c10::IValue* out) {
    const bool written = param.alias_info() != nullptr && param.alias_info()->isWrite();
    if (ref.region_id == kNoRegion) {
      // An empty view, no memory (wire.h kNoRegion): no region to resolve
      // or pin; wrapped once the call's device is known (Decode).
      if (Status s = CheckNoRegionView(ref); !s.ok()) return s.Annotated(Where(param) + " ");
      if (!wrap_) return Status::Ok();
      if (meta_) {
        *out = at::empty_strided(ref.sizes, ref.strides, Options(ref).device(at::kMeta));
      } else {
        unplaced_.emplace_back(index_, &ref);
      }
      return Status::Ok();
    }
    MappedRegion region;
    if (Status s = regions_.Resolve(ref.region_id, &region); !s.ok()) {
      return s.Annotated(Where(param) + ": ");
    }
    if (Status s = CheckView(ref, region, written); !s.ok()) {
      return s.Annotated(Where(param) + " ");
    }
    writes_elements_ = writes_elements_ || (written && !HasNoElements(ref.sizes));
    if (!meta_) {
      if (region.device < 0 || region.device > std::numeric_limits<c10::DeviceIndex>::max()) {
        return Status::Internal(Where(param), ": region ", ref.region_id, " has no valid device (",
                                region.device, ")");
      }
      if (device_ >= 0 && region.device != device_) {
        return Status::InvalidArgument(Where(param), " is in region ", ref.region_id, " on device ",
                                       region.device,
                                       ", but the call's other tensors are on device ", device_);
      }
    }
    device_ = region.device;
    if (std::find(region_ids_.begin(), region_ids_.end(), ref.region_id) == region_ids_.end()) {
      region_ids_.push_back(ref.region_id);
    }
    bases_.push_back(region.base);
    if (!wrap_) return Status::Ok();

    if (meta_) {
      *out = at::empty_strided(ref.sizes, ref.strides, Options(ref).device(at::kMeta));
      return Status::Ok();
    }
    *out = WrapView(static_cast<char*>(region.base) + ref.byte_offset, ref, region.device);
    return Status::Ok();
  }

  static at::TensorOptions Options(const TensorRef& ref) {
    return at::TensorOptions().dtype(*ToScalarType(ref.dtype));  // CheckShape checked the dtype
  }

  // The view at `data` (null for an empty view: no storage bytes) on CUDA
  // device `device`. An explicit target device keeps from_blob from asking
  // the driver which device owns the pointer, so wrapping needs no CUDA call
  // (and no GPU).
  static at::Tensor WrapView(void* data, const TensorRef& ref, int device) {
    const at::Device target(at::kCUDA, static_cast<c10::DeviceIndex>(device));
    return at::for_blob(data, ref.sizes)
        .strides(ref.strides)
        .options(Options(ref).device(target))
        .target_device(target)
        .make_tensor();
  }

  const std::string& op_name_;
  const RegionResolver& regions_;
  const bool meta_;
  const bool wrap_;
  const int default_device_;
  std::vector<uint64_t> region_ids_;
  std::vector<const void*> bases_;
  int device_ = -1;
  size_t index_ = 0;  // the argument being decoded
  bool writes_elements_ = false;
  std::vector<std::pair<size_t, const TensorRef*>> unplaced_;  // region-less views (CUDA): stack index, ref
};

// A fresh output would come from the daemon's caching allocator, freed as
// soon as the call returns while its kernel may still run on the lane's
// stream; clients own every output, so only overloads that write arguments
// are served.
Status CheckWritesOnly(const c10::FunctionSchema& schema, const std::string& op_name) {
  for (const c10::Argument& ret : schema.returns()) {
    const bool aliases_written = ret.alias_info() != nullptr && ret.alias_info()->isWrite();
    if (MentionsTensor(*ret.real_type()) && !aliases_written) {
      return Status::Rejected(Reason::kUnsupported, op_name, " returns a new tensor; the daemon runs only ",
                              "overloads that write caller-owned tensors (such as .out)");
    }
  }
  return Status::Ok();
}

Status OpNotFound(const std::string& qualified, const std::string& overload) {
  c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
  std::vector<std::string> overloads;
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name == qualified && dispatcher.findSchema(name)) {
      overloads.push_back(Quoted(name.overload_name));
    }
  }
  if (overloads.empty()) {
    return Status::Rejected(Reason::kOpUnknown, "op ", qualified, " is not registered (is its library loaded?)");
  }
  std::sort(overloads.begin(), overloads.end());
  std::string known;
  for (const std::string& o : overloads) known += (known.empty() ? "" : ", ") + o;
  return Status::Rejected(Reason::kOpUnknown, "op ", qualified, " has no overload ", Quoted(overload),
                          " (registered: ", known, ")");
}

Status CudaErrorStatus(const std::string& op_name, cudaError_t error, const char* what,
                       bool* sticky_cuda_error) {
  const bool sticky = cuda::IsStickyCudaError(static_cast<int>(error));
  if (sticky && sticky_cuda_error != nullptr) *sticky_cuda_error = true;
  return Status::Internal(op_name, ": CUDA error ", cudaGetErrorName(error), " (",
                          static_cast<int>(error), "): ", what,
                          sticky ? " [sticky: the CUDA context is unusable]" : "");
}

// The reason each dispatch error carries (wire.h): the lookups keep theirs
// (an unknown op; an unknown region, from the registry), every other refusal
// of the schema decoding, the bounds checks or the op's own checks is about
// the call's arguments; CUDA failures after a launch are the daemon's.
Status Classified(Status s) {
  if (s.ok() || s.reason() != Reason::kUnspecified) return s;
  switch (s.code()) {
    case StatusCode::kInvalidArgument: return s.WithReason(Reason::kBadArgument);
    case StatusCode::kUnimplemented: return s.WithReason(Reason::kUnsupported);
    case StatusCode::kResourceExhausted: return s.WithReason(Reason::kResourceExhausted);
    default: return s.WithReason(Reason::kInternal);
  }
}

class PreparedCallImpl final : public PreparedCall {
 public:
  // `nothing_to_write`: no written tensor has an element and the op's Meta
  // kernel checks it in Validate, so Run launches nothing.
  PreparedCallImpl(std::string op_name, c10::OperatorHandle op, bool has_meta_kernel, std::vector<c10::IValue> args,
                   std::vector<uint64_t> regions, std::vector<const void*> bases, int device, bool meta,
                   bool nothing_to_write)
      : op_name_(std::move(op_name)),
        op_(std::move(op)),
        has_meta_kernel_(has_meta_kernel),
        args_(std::move(args)),
        regions_(std::move(regions)),
        bases_(std::move(bases)),
        device_(device),
        meta_(meta),
        nothing_to_write_(nothing_to_write) {}

  const std::string& op_name() const override { return op_name_; }
  const std::vector<uint64_t>& regions() const override { return regions_; }
  // The region bases its views were wrapped at, in argument order, and its
  // device: what PrepareAgain compares.
  const std::vector<const void*>& bases() const { return bases_; }
  int device() const { return device_; }

  Status Validate() {
    if (!has_meta_kernel_) return Status::Ok();
    try {
      c10::InferenceMode inference;
      torch::jit::Stack stack = args_;
      // The Meta kernel of an out overload checks and returns its outputs;
      // it reads only metadata and addresses, never the memory.
      op_.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &stack);
    } catch (const c10::Error& e) {
      return Status::InvalidArgument(op_name_, ": ", e.what_without_backtrace());
    } catch (const std::exception& e) {
      return Status::Internal(op_name_, ": ", e.what());
    }
    return Status::Ok();
  }

  Status Run(cudaStream_t stream, bool* sticky_cuda_error) {
    if (nothing_to_write_) return Status::Ok();
    Status status;
    try {
      // Skips autograd and version-counter bookkeeping; nothing here is
      // differentiated.
      c10::InferenceMode inference;
      // A copy (reference counts only) keeps the call re-runnable.
      torch::jit::Stack stack = args_;
      if (meta_) {
        op_.callBoxed(stack);
        return Status::Ok();
      }
      const auto device =
          static_cast<c10::DeviceIndex>(device_ >= 0 ? device_ : c10::cuda::current_device());
      c10::cuda::CUDAGuard device_guard(device);
      c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromExternal(stream, device));
      // A stale non-sticky error belongs to some earlier call on this thread
      // (a failed IPC open, say); left set, the op's launch check would
      // report it as its own.
      if (const cudaError_t stale = cudaGetLastError(); cuda::IsStickyCudaError(static_cast<int>(stale))) {
        return CudaErrorStatus(op_name_, stale, "before launch", sticky_cuda_error);
      }
      op_.callBoxed(stack);
    } catch (const c10::AcceleratorError& e) {
      status = CudaErrorStatus(op_name_, static_cast<cudaError_t>(e.get_error_code()),
                               e.what_without_backtrace(), sticky_cuda_error);
    } catch (const c10::NotImplementedError& e) {
      status = Status::Unimplemented(op_name_, ": ", e.what_without_backtrace());
    } catch (const c10::OutOfMemoryError& e) {
      status = Status::ResourceExhausted(op_name_, ": ", e.what_without_backtrace());
    } catch (const c10::Error& e) {
      status = Status::InvalidArgument(op_name_, ": ", e.what_without_backtrace());
    } catch (const std::exception& e) {
      status = Status::Internal(op_name_, ": ", e.what());
    }
    if (meta_) return status;
    // Launch errors the op did not check itself, and faults of earlier
    // kernels that surface only now.
    if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) {
      Status cuda_status = CudaErrorStatus(op_name_, error, "after launch", sticky_cuda_error);
      if (status.ok()) status = std::move(cuda_status);
    }
    return status;
  }

 private:
  const std::string op_name_;
  const c10::OperatorHandle op_;
  const bool has_meta_kernel_;
  const std::vector<c10::IValue> args_;
  const std::vector<uint64_t> regions_;
  const std::vector<const void*> bases_;
  const int device_;
  const bool meta_;
  const bool nothing_to_write_;
};

// Calls f(name, handle, short name) for every op with a schema in the
// namespace: (cache_dit_cuda_ops::x, overload), its handle, "x". An impl can
// be registered before (or without) its def; such a name has no schema to
// serve and is skipped.
template <typename F>
void ForEachNamespaceOp(F&& f) {
  const std::string prefix = std::string(kNamespace) + "::";
  c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind(prefix, 0) != 0) continue;
    const std::optional<c10::OperatorHandle> op = dispatcher.findSchema(name);
    if (op) f(name, *op, name.name.substr(prefix.size()));
  }
}

}  // namespace

// Taken once instead of a dispatcher lookup, two name strings and a schema
// walk per call: a fifth of Prepare + Validate + Run on meta tensors (1.06 ->
// 0.85 us per call on the 2-core development VM).
struct TorchCallRunner::OpTable {
  struct Entry {
    std::string overload;
    c10::OperatorHandle handle;
    std::string name;  // cache_dit_cuda_ops::<op>[.<overload>], as statuses name it
    Status servable;   // CheckWritesOnly's verdict
    bool has_meta_kernel;
  };
  // By op name without the namespace; an op has a handful of overloads.
  std::unordered_map<std::string, std::vector<Entry>> by_op;

  const Entry* Find(const std::string& op, const std::string& overload) const {
    const auto it = by_op.find(op);
    if (it == by_op.end()) return nullptr;
    for (const Entry& e : it->second) {
      if (e.overload == overload) return &e;
    }
    return nullptr;
  }

  static std::unique_ptr<const OpTable> Build() {
    auto table = std::make_unique<OpTable>();
    ForEachNamespaceOp([&](const c10::OperatorName& name, const c10::OperatorHandle& op, std::string op_short) {
      std::string op_name = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
      Status servable = CheckWritesOnly(op.schema(), op_name);
      table->by_op[std::move(op_short)].push_back({name.overload_name, op, std::move(op_name), std::move(servable),
                                                   op.hasKernelForDispatchKey(c10::DispatchKey::Meta)});
    });
    return table;
  }
};

TorchCallRunner::TorchCallRunner(Device device, int cuda_device) : device_(device), cuda_device_(cuda_device) {}

TorchCallRunner::~TorchCallRunner() = default;

std::vector<OpInfo> TorchCallRunner::ListOps() {
  std::vector<OpInfo> ops;
  ForEachNamespaceOp([&](const c10::OperatorName& name, const c10::OperatorHandle& op, std::string op_short) {
    ops.push_back({std::move(op_short), name.overload_name, c10::toString(op.schema())});
  });
  std::sort(ops.begin(), ops.end(), [](const OpInfo& a, const OpInfo& b) {
    return std::tie(a.name, a.overload) < std::tie(b.name, b.overload);
  });
  return ops;
}

Status TorchCallRunner::LoadOpLibrary(const std::string& path) {
  try {
    // RTLD_GLOBAL so that libraries loaded later can resolve this one's
    // symbols; the handle is never closed because the dispatcher keeps
    // pointers into the library.
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char* error = dlerror();
      return Status::InvalidArgument("cannot load op library ", path, ": ",
                                     error != nullptr ? error : "unknown dlopen error");
    }
  } catch (const c10::Error& e) {
    // A TORCH_LIBRARY registration that conflicts with one already loaded
    // throws from the library's static initializers.
    return Status::InvalidArgument("op library ", path,
                                   " failed to register: ", e.what_without_backtrace());
  }
  return Status::Ok();
}

Status TorchCallRunner::Prepare(const CallRequest& req, const RegionResolver& regions,
                                std::unique_ptr<PreparedCall>* out) {
  return Classified(PrepareUnclassified(req, regions, out));
}

Status TorchCallRunner::PrepareUnclassified(const CallRequest& req, const RegionResolver& regions,
                                            std::unique_ptr<PreparedCall>* out) {
  const bool meta = device_ == Device::kMeta;
  std::call_once(ops_once_, [this] { ops_ = OpTable::Build(); });
  std::optional<c10::OperatorHandle> op;
  std::string op_name;
  bool has_meta_kernel = false;
  if (const OpTable::Entry* known = ops_->Find(req.op, req.overload)) {
    OPD_RETURN_IF_ERROR(known->servable);
    op = known->handle;
    op_name = known->name;
    has_meta_kernel = known->has_meta_kernel;
  } else {  // unknown, or registered after the table was taken
    const std::string qualified = std::string(kNamespace) + "::" + req.op;
    op = c10::Dispatcher::singleton().findSchema({qualified, req.overload});
    if (!op) return OpNotFound(qualified, req.overload);
    op_name = req.overload.empty() ? qualified : qualified + "." + req.overload;
    OPD_RETURN_IF_ERROR(CheckWritesOnly(op->schema(), op_name));
    has_meta_kernel = op->hasKernelForDispatchKey(c10::DispatchKey::Meta);
  }

  std::vector<c10::IValue> args;
  ArgDecoder decoder(op_name, regions, meta, cuda_device_);
  try {
    // Inference tensors, to match the InferenceMode that RunCall runs in.
    c10::InferenceMode inference;
    OPD_RETURN_IF_ERROR(decoder.Decode(op->schema(), req.args, &args));
  } catch (const c10::Error& e) {
    return Status::InvalidArgument(op_name, ": ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status::Internal(op_name, ": ", e.what());
  }
  const int device = decoder.device();
  // A call that can write no element has nothing to launch; it is still
  // decoded, bounds-checked and (Validate) checked by the op's Meta kernel.
  // Without a Meta kernel its checks run only in Run, so it runs.
  const bool nothing_to_write = !decoder.writes_elements() && has_meta_kernel;
  *out = std::make_unique<PreparedCallImpl>(std::move(op_name), std::move(*op), has_meta_kernel, std::move(args),
                                            decoder.TakeRegions(), decoder.bases(), device, meta, nothing_to_write);
  return Status::Ok();
}

Status TorchCallRunner::PrepareAgain(const CallRequest& req, const RegionResolver& regions,
                                     const std::shared_ptr<PreparedCall>& previous,
                                     std::shared_ptr<PreparedCall>* out, bool* reused) {
  *reused = false;
  std::call_once(ops_once_, [this] { ops_ = OpTable::Build(); });
  const auto* prev = static_cast<const PreparedCallImpl*>(previous.get());
  const OpTable::Entry* known = ops_->Find(req.op, req.overload);
  if (prev != nullptr && known != nullptr && known->servable.ok()) {
    // The same decoding as Prepare's (every bound and argument check), with
    // no tensor wrapped; the views' regions are resolved for this call.
    std::vector<c10::IValue> unused;
    ArgDecoder decoder(prev->op_name(), regions, device_ == Device::kMeta, cuda_device_, /*wrap=*/false);
    Status s;
    try {
      s = decoder.Decode(known->handle.schema(), req.args, &unused);
    } catch (const std::exception& e) {
      s = Status::Internal(prev->op_name(), ": ", e.what());
    }
    if (!s.ok()) return Classified(std::move(s));
    if (decoder.bases() == prev->bases() && decoder.device() == prev->device()) {
      *out = previous;
      *reused = true;
      return Status::Ok();
    }
  }
  return PrepareShared(req, regions, out);
}

// Only this runner's Prepare makes the calls handed back to it (the
// CallRunner contract), so the casts below are exact.
Status TorchCallRunner::Validate(PreparedCall& call) {
  return Classified(static_cast<PreparedCallImpl&>(call).Validate());
}

Status TorchCallRunner::Run(PreparedCall& call, void* stream, bool* sticky) {
  return Classified(static_cast<PreparedCallImpl&>(call).Run(static_cast<cudaStream_t>(stream), sticky));
}

}  // namespace cache_dit_opd
