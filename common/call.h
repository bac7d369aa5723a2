// File: common/call.h
//
// A call, as every transport hands it to the daemon's one call path and as the
// C++ client builds it. The gRPC Call handler and the shared-memory ring each
// decode their own wire format into a `CallRequest`; from there on
// (validation, dispatch, completion) no code depends on the transport. Plain
// C++: no gRPC, protobuf or torch types. Dtype values and limits are the
// contract's (proto/cache_dit_opd/v1/wire.h).
//
// A tensor never travels: a `TensorRef` names bytes inside a region (a client
// allocation the session registered and the daemon mapped) plus the view
// metadata. The daemon checks that every byte the op will touch lies inside
// that region before anything is launched. An empty view (a size of 0) needs
// no memory: it travels in region kNoRegion (0, never a registered id) at
// byte offset 0, and nothing is registered for it (wire.h kNoRegion).
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "cache_dit_opd/v1/wire.h"

namespace cache_dit_opd {

// Wire dtype: the values of protocol v1 (wire.h's table).
enum class DType : int32_t {
  kUnspecified = 0,
#define CACHE_DIT_OPD_X(e, v, name, bytes, proto) e = v,
  CACHE_DIT_OPD_WIRE_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
};

using v1::IsWireDType;
using v1::kDTypeCount;
using v1::kMaxArgs;
using v1::kMaxListLength;
using v1::kMaxTensorDims;
using v1::kNoRegion;

// Bytes per element; 0 for kUnspecified or a value outside the protocol.
int64_t DTypeSize(DType dtype);
// "bfloat16", ... (torch's name); "dtype(<n>)" for a value outside the protocol.
std::string DTypeName(DType dtype);

struct TensorRef {
  // From RegisterRegion, scoped to the session; kNoRegion only for a view
  // with no element (some size 0), and then byte_offset is 0.
  uint64_t region_id = kNoRegion;
  uint64_t byte_offset = 0;    // from the region's base to element [0, ..., 0]
  std::vector<int64_t> sizes;  // elements per dim, each >= 0
  std::vector<int64_t> strides;  // elements per dim; same rank as sizes
  DType dtype = DType::kUnspecified;
};

// Equal views: the same region, offset, dtype, sizes and strides.
inline bool operator==(const TensorRef& a, const TensorRef& b) {
  return a.region_id == b.region_id && a.byte_offset == b.byte_offset && a.dtype == b.dtype && a.sizes == b.sizes &&
         a.strides == b.strides;
}

struct NoneArg {};
inline bool operator==(NoneArg, NoneArg) { return true; }

// One positional or keyword argument, in schema order.
using Arg = std::variant<NoneArg, TensorRef, int64_t, double, bool, std::vector<int64_t>,
                         std::vector<double>, std::vector<bool>>;

// Which entry a call came in through: a label of the daemon's metrics
// (server/exec/call_metrics.h), never a branch of the call path.
enum class CallTransport : uint8_t { kGrpc = 0, kRing = 1 };
inline constexpr size_t kCallTransportCount = 2;
// "grpc", "ring".
const char* CallTransportName(CallTransport transport);

struct CallRequest {
  std::string op;        // "fused_merge_attn_states" (namespace implied: cache_dit_cuda_ops)
  std::string overload;  // "out" for what the daemon serves; "" is the default overload
  std::vector<Arg> args;  // every schema argument in order, including kwarg-only ones
  uint32_t lane = 0;      // the client's stream lane within the session
  uint64_t seq = 0;       // the lane's sequence number of this call (> 0, +1 per call)
  // The daemon numbers the call itself, runs it without waiting for the
  // lane's inputs_ready (the client synchronized its inputs), and answers
  // once it has finished on the GPU (opd.proto CallRequest.host_ordered).
  // seq is 0 then.
  bool host_ordered = false;
  CallTransport transport = CallTransport::kGrpc;  // set by the daemon's transport
};

// One entry of the op catalog a session is given at open (OpenSessionReply):
// a ring record names its op by index into it.
struct OpInfo {
  std::string name;      // "fused_merge_attn_states"
  std::string overload;  // "out" or "" (functional)
  std::string schema;    // c10 schema string, e.g. "cache_dit_cuda_ops::fp8_comm_per_token_quant.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)"
};

}  // namespace cache_dit_opd
