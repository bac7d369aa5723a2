// File: proto/cache_dit_opd/v1/wire.h
//
// The numbers of protocol v1 that every transport shares: the wire dtypes
// (opd.proto's enum DType, the ring record's tensor dtype), and the limits a
// call obeys on any transport (the ring's fixed record layout is sized from
// them). Part of the contract, like opd.proto, ring.h and session_memory.h:
// client and daemon consume these values, nobody redefines them. The Python
// client's copy is generated from this header (python/cache_dit_opd/_wire.py,
// written by proto/tools/wire_py.cc).
//
// Never renumber a dtype; a new one takes the next value and bumps kDTypeCount.
#pragma once

#include <cstdint>

namespace cache_dit_opd::v1 {

// X(enumerator, value, torch name, bytes per element, opd.proto name): the
// torch name is what `str(torch.<dtype>)` prints after "torch."; opd.proto
// spells the same value DTYPE_<proto name> (the daemon static_asserts that
// the two agree). 0 is "unspecified", not a dtype.
#define CACHE_DIT_OPD_WIRE_DTYPES(X)                       \
  X(kFloat32, 1, "float32", 4, FLOAT32)                   \
  X(kFloat16, 2, "float16", 2, FLOAT16)                   \
  X(kBFloat16, 3, "bfloat16", 2, BFLOAT16)                \
  X(kFloat8E4M3FN, 4, "float8_e4m3fn", 1, FLOAT8_E4M3FN)  \
  X(kUInt8, 5, "uint8", 1, UINT8)                         \
  X(kInt8, 6, "int8", 1, INT8)                            \
  X(kInt32, 7, "int32", 4, INT32)                         \
  X(kInt64, 8, "int64", 8, INT64)                         \
  X(kFloat64, 9, "float64", 8, FLOAT64)                   \
  X(kBool, 10, "bool", 1, BOOL)                           \
  X(kFloat8E5M2, 11, "float8_e5m2", 1, FLOAT8_E5M2)

// (The enum itself is common/call.h's DType, built from this table: the
// generated protobuf code owns the name cache_dit_opd::v1::DType.)

// One past the largest wire dtype value: valid values are 1 .. kDTypeCount - 1.
inline constexpr int32_t kDTypeCount = 0
#define CACHE_DIT_OPD_X(e, v, name, bytes, proto) +1
    CACHE_DIT_OPD_WIRE_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
    + 1;

// True for the values protocol v1 defines (kUnspecified is not a dtype).
inline constexpr bool IsWireDType(int64_t value) { return value >= 1 && value < kDTypeCount; }

// Limits that hold for every transport.
inline constexpr int kMaxTensorDims = 8;
inline constexpr int kMaxArgs = 32;
inline constexpr int kMaxListLength = 64;

}  // namespace cache_dit_opd::v1
