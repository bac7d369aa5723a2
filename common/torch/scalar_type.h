// File: common/torch/scalar_type.h
//
// Wire DType (proto/cache_dit_opd/v1/wire.h) <-> at::ScalarType: the one
// table every torch-facing side uses (the daemon's dispatcher, the Python
// client's native kernels in client/python/, the in-process reference tool of
// the C++ client tests). Header-only; torch-facing (c10 headers only), target
// opd_common_torch.
#pragma once

#include <c10/core/ScalarType.h>

#include <iterator>
#include <optional>
#include <utility>

#include "common/call.h"

namespace cache_dit_opd {

inline constexpr std::pair<DType, c10::ScalarType> kWireScalarTypes[] = {
    {DType::kFloat32, c10::ScalarType::Float},
    {DType::kFloat16, c10::ScalarType::Half},
    {DType::kBFloat16, c10::ScalarType::BFloat16},
    {DType::kFloat8E4M3FN, c10::ScalarType::Float8_e4m3fn},
    {DType::kUInt8, c10::ScalarType::Byte},
    {DType::kInt8, c10::ScalarType::Char},
    {DType::kInt32, c10::ScalarType::Int},
    {DType::kInt64, c10::ScalarType::Long},
    {DType::kFloat64, c10::ScalarType::Double},
    {DType::kBool, c10::ScalarType::Bool},
    {DType::kFloat8E5M2, c10::ScalarType::Float8_e5m2},
};
static_assert(std::size(kWireScalarTypes) == v1::kDTypeCount - 1, "every wire dtype has a scalar type");

// nullopt for kUnspecified and values outside protocol v1.
inline std::optional<c10::ScalarType> ToScalarType(DType dtype) {
  for (const auto& [d, s] : kWireScalarTypes) {
    if (d == dtype) return s;
  }
  return std::nullopt;
}

// nullopt for a scalar type the protocol cannot carry.
inline std::optional<DType> ToWireDType(c10::ScalarType type) {
  for (const auto& [d, s] : kWireScalarTypes) {
    if (s == type) return d;
  }
  return std::nullopt;
}

}  // namespace cache_dit_opd
