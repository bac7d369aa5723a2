// File: common/call.h
//
// A call, as every transport hands it to the daemon's one call path. The gRPC
// Call handler and the shared-memory ring each decode their own wire format
// into a `CallRequest`; from here on (validation, dispatch, completion) no
// code depends on the transport. Plain C++: no gRPC, protobuf or torch types.
//
// A tensor never travels: a `TensorRef` names bytes inside a region (a client
// allocation the session registered and the daemon mapped) plus the view
// metadata. The dispatch layer checks that every byte the op will touch lies
// inside that region before anything is launched.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace cache_dit_opd {

// Wire dtype. The numeric values are part of protocol v1 (proto/ and the ring
// record layout use them); never renumber.
enum class DType : int32_t {
  kUnspecified = 0,
  kFloat32 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kFloat8E4M3FN = 4,
  kUInt8 = 5,
  kInt8 = 6,
  kInt32 = 7,
  kInt64 = 8,
  kFloat64 = 9,
  kBool = 10,
  kFloat8E5M2 = 11,
};

// Bytes per element; 0 for kUnspecified or an unknown value.
int64_t DTypeSize(DType dtype);
// "bfloat16", ... ; "dtype(<n>)" for an unknown value.
std::string DTypeName(DType dtype);

// Limits that hold for every transport (the ring's fixed record layout is
// sized from them).
inline constexpr int kMaxTensorDims = 8;
inline constexpr int kMaxArgs = 32;
inline constexpr int kMaxListLength = 64;

struct TensorRef {
  uint64_t region_id = 0;      // from RegisterRegion, scoped to the session
  uint64_t byte_offset = 0;    // from the region's base to element [0, ..., 0]
  std::vector<int64_t> sizes;  // elements per dim, each >= 0
  std::vector<int64_t> strides;  // elements per dim; same rank as sizes
  DType dtype = DType::kUnspecified;
};

struct NoneArg {};

// One positional or keyword argument, in schema order.
using Arg = std::variant<NoneArg, TensorRef, int64_t, double, bool, std::vector<int64_t>,
                         std::vector<double>, std::vector<bool>>;

struct CallRequest {
  std::string op;        // "fused_merge_attn_states" (namespace implied: cache_dit_cuda_ops)
  std::string overload;  // "out" for what the daemon serves; "" is the default overload
  std::vector<Arg> args;  // every schema argument in order, including kwarg-only ones
  uint32_t lane = 0;      // the client's stream lane within the session
  uint64_t seq = 0;       // the lane's sequence number of this call (> 0, +1 per call)
};

}  // namespace cache_dit_opd
